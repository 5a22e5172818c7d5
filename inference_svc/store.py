"""Where slot files live: the `SlotStore` interface and the local directory store.

A store keeps, per name, the bytes of a target file and optionally of its draft
sidecar; it neither parses nor validates them (inference_svc.slotfile does).
The snapshot service's store (issue 6) implements the same interface, so the
bytes of a target file are the same whichever store holds it.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from inference_svc.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from inference_svc.names import DRAFT_SUFFIX, validate_name

LOCAL_MAX_NAME_BYTES = 255 - len(DRAFT_SUFFIX)  # `<name>.drft` must be a valid file name


@dataclass(frozen=True)
class StoredSlot:
    """The bytes of one saved slot. draft is None when there is no usable sidecar."""

    target: bytes
    draft: bytes | None
    draft_note: str = ""  # why draft is None
    # hex SHA-256 of `target` when the store has already verified it (saves a rehash)
    target_sha256: str | None = field(default=None, compare=False)
    # hex SHA-256 of `target` without its digest trailer, when the store computed it while
    # reading (the file's own check then needs no second pass)
    target_body_sha256: str | None = field(default=None, compare=False)


class SlotStore(Protocol):
    """Saves and loads the two files of a slot by name (names already validated)."""

    def describe(self) -> str:
        """What GetInfo reports, e.g. "local:/var/slots"."""
        ...

    def save(self, name: str, target: bytes, draft: bytes | None) -> int:
        """Stores both files as one save; returns the bytes written. Without a draft,
        any sidecar of an earlier save under the name is removed."""
        ...

    def load(self, name: str) -> StoredSlot:
        """The stored bytes; NotFound when there is no target file of that name."""
        ...

    def delete(self, name: str) -> bool:
        """Removes both files of the name; False when there was nothing to remove."""
        ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """`<dir>/<name>` and `<dir>/<name>.drft`, written atomically: each file goes to a
    temporary file that is fsynced and renamed, then the directory is fsynced. A save
    and a load of the store never interleave, so a reader gets the pair of one save
    (the sidecar records its target's digest, which restore checks as well)."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._sweep()

    def describe(self) -> str:
        return f"local:{self.dir}"

    def _sweep(self) -> None:
        """Removes temporary files left by a crash mid-save."""
        for p in self.dir.glob(".tmp-*"):
            try:
                p.unlink()
            except OSError:
                pass

    def _path(self, name: str) -> Path:
        validate_name(name)
        if len(name.encode()) > LOCAL_MAX_NAME_BYTES:
            raise InvalidArgument(
                f"bad slot file name {name!r}: the local store keeps '<name>{DRAFT_SUFFIX}' next "
                f"to it, so names are limited to {LOCAL_MAX_NAME_BYTES} bytes here")
        return self.dir / name

    def _write_temp(self, data: bytes) -> Path:
        tmp = self.dir / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def save(self, name: str, target: bytes, draft: bytes | None) -> int:
        path = self._path(name)
        side = path.with_name(name + DRAFT_SUFFIX)
        with self._lock:
            temps: list[Path] = []
            try:
                temps.append(self._write_temp(target))
                if draft is not None:
                    temps.append(self._write_temp(draft))
                os.replace(temps[0], path)
                if draft is not None:
                    os.replace(temps[1], side)
                else:
                    side.unlink(missing_ok=True)
                _fsync_dir(self.dir)
            except OSError as exc:
                for t in temps:
                    t.unlink(missing_ok=True)
                if exc.errno in (28, 122):  # ENOSPC, EDQUOT
                    raise ResourceExhausted(f"no space left to save {name!r}: {exc}") from exc
                raise Unavailable(f"cannot save {name!r} in {self.dir}: {exc}") from exc
        return len(target) + (len(draft) if draft is not None else 0)

    def load(self, name: str) -> StoredSlot:
        path = self._path(name)
        with self._lock:
            try:
                target = path.read_bytes()
            except FileNotFoundError:
                raise NotFound(f"no slot file {name!r} in {self.dir}") from None
            except IsADirectoryError:
                raise NotFound(f"{name!r} in {self.dir} is a directory, not a slot file") from None
            except OSError as exc:
                raise Unavailable(f"cannot read {name!r} in {self.dir}: {exc}") from exc
            try:
                draft: bytes | None = path.with_name(name + DRAFT_SUFFIX).read_bytes()
                note = ""
            except FileNotFoundError:
                draft, note = None, "no draft sidecar"
            except OSError as exc:
                draft, note = None, f"cannot read the draft sidecar: {exc}"
        return StoredSlot(target, draft, note)

    def delete(self, name: str) -> bool:
        path = self._path(name)
        with self._lock:
            try:
                removed = False
                # the sidecar first: a crash between the two leaves a target without one,
                # never a sidecar without its target
                for p in (path.with_name(name + DRAFT_SUFFIX), path):
                    try:
                        p.unlink()
                        removed = True
                    except FileNotFoundError:
                        pass
                if removed:
                    _fsync_dir(self.dir)
            except OSError as exc:
                raise Unavailable(f"cannot delete {name!r} in {self.dir}: {exc}") from exc
        return removed
