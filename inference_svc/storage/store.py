"""Where slot files live: the `SlotStore` interface and the local directory store.

A store keeps, per name, the bytes of a target file and optionally of its draft
sidecar; it neither parses nor validates them (inference_svc.storage.slotfile does).
The snapshot service's store (snapshot_store.py) implements the same interface, so the
bytes of a target file are the same whichever store holds it.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from inference_svc.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from inference_svc.storage import slotfile
from inference_svc.storage.names import DRAFT_SUFFIX, validate_name
from snapshot_svc.clientlib.files import fsync_dir

Buffer = bytes | memoryview  # a slot file's bytes, whoever holds them
LOCAL_MAX_NAME_BYTES = 255 - len(DRAFT_SUFFIX)  # `<name>.drft` must be a valid file name
_HEAD_READ = 4096  # bytes read for a target file's fixed header (more than any version's)


@dataclass(frozen=True)
class StoredSlot:
    """The bytes of one saved slot. draft is None when there is no usable sidecar."""

    target: Buffer
    draft: Buffer | None
    draft_note: str = ""  # why draft is None
    # hex SHA-256 of `target` when the store has already verified it (saves a rehash)
    target_sha256: str | None = field(default=None, compare=False)
    # hex SHA-256 of `target` without its digest trailer, when the store computed it while
    # reading (the file's own check then needs no second pass)
    target_body_sha256: str | None = field(default=None, compare=False)
    # the store's generation of what was read (0: the store keeps no generations)
    generation: int = field(default=0, compare=False)


@dataclass(frozen=True)
class StoredInfo:
    """One name a store holds, as `SlotStore.list` reports it."""

    name: str
    n_tokens: int  # from the target file's fixed header (-1: not a readable slot file)
    modified_unix_ms: int  # when the store last wrote the name


class SlotStore(Protocol):
    """Saves and loads the two files of a slot by name (names already validated)."""

    def describe(self) -> str:
        """What GetInfo reports, e.g. "local:/var/slots"."""
        ...

    def save(self, name: str, target: Buffer, draft: Buffer | None, *,
             target_sha256: str | None = None, deadline: float | None = None) -> int:
        """Stores both files as one save; returns the bytes written: the target's alone
        when the store kept no draft. Without a draft, any sidecar of an earlier save
        under the name is removed. `target_sha256`: the target's hex SHA-256 when the
        caller has it (a store that verifies the bytes need not hash them again).
        `deadline` (time.monotonic()): a remote store gives up by then."""
        ...

    def load(self, name: str, *, deadline: float | None = None) -> StoredSlot:
        """The stored bytes; NotFound when there is no target file of that name.
        `deadline` (time.monotonic()): a remote store gives up by then."""
        ...

    def conditional(self) -> bool:
        """Whether the store keeps a generation per name and takes conditional saves
        (a remote store asks its service once)."""
        ...

    def generation(self, name: str, *, deadline: float | None = None) -> int:
        """The name's stored generation, 0 when nothing is stored under it (only on a
        `conditional` store)."""
        ...

    def save_if(self, name: str, target: Buffer, draft: Buffer | None, expected: int, *,
                target_sha256: str | None = None, deadline: float | None = None) -> int:
        """`save`, committed only if the name is at generation `expected` now (0: none
        stored); returns the new generation. GenerationConflict (ABORTED, naming both
        generations) when another save came first: nothing of this one is stored. Only
        on a `conditional` store."""
        ...

    def delete(self, name: str, *, deadline: float | None = None) -> bool:
        """Removes both files of the name; False when there was nothing to remove.
        `deadline` (time.monotonic()): a remote store gives up by then."""
        ...

    def list(self, prefix: str) -> list[StoredInfo]:
        """Every name held whose target file starts with `prefix` (the store's own files
        and draft sidecars are not names), sorted by name. A remote store's call is
        bounded by its own timeout; Unavailable when it cannot answer."""
        ...


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


TEMP_PREFIX = ".tmp-"  # a file being written; removed at start-up
PENDING_PREFIX = ".pending-"  # a save's sidecar (or its absence) waiting for its target
RESERVED = (f"names starting with {TEMP_PREFIX!r} or {PENDING_PREFIX!r} or ending with "
            f"{DRAFT_SUFFIX!r} are the local store's own files")


def _name_key(name: str) -> str:
    """The fixed-length key of a name in pending file names (any name length fits)."""
    return hashlib.sha256(name.encode()).hexdigest()[:32]


class LocalStore:
    """`<dir>/<name>` and `<dir>/<name>.drft`, the pair written atomically.

    Each file goes to a temporary file that is fsynced. The new sidecar (or, for a save
    without one, an empty marker) is renamed to `.pending-<key(name)>-<digest>` first,
    `<digest>` being the SHA-256 of the new target; then the target is renamed into place
    (the commit point); then the pending file becomes `<name>.drft` (or the old sidecar
    and the marker are removed), the directory fsynced after each step. A pending file
    whose digest is the target's belongs to a committed save and is finished; any other
    is left over from a save that never committed and is removed. That happens at
    start-up for the whole directory, and before every load, save and delete of a name,
    so a reader always gets the pair of one save, whatever step a crash interrupted."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        with self._lock:
            self._sweep()

    def describe(self) -> str:
        return f"local:{self.dir}"

    def _sweep(self) -> None:
        """Removes temporary files left by a crash mid-save and settles pending sidecars."""
        for p in self.dir.glob(f"{TEMP_PREFIX}*"):
            try:
                p.unlink()
            except OSError:
                pass
        keys = {p.name[len(PENDING_PREFIX):].split("-", 1)[0]
                for p in self.dir.glob(f"{PENDING_PREFIX}*")}
        if not keys:
            return
        for p in self.dir.iterdir():
            if _name_key(p.name) in keys and not self._reserved(p.name) and p.is_file():
                self._settle(p.name)
        for p in self.dir.glob(f"{PENDING_PREFIX}*"):  # no target of that name any more
            p.unlink(missing_ok=True)
        fsync_dir(self.dir)

    def _path(self, name: str) -> Path:
        validate_name(name)
        if len(name.encode()) > LOCAL_MAX_NAME_BYTES:
            raise InvalidArgument(
                f"bad slot file name {name!r}: the local store keeps '<name>{DRAFT_SUFFIX}' next "
                f"to it, so names are limited to {LOCAL_MAX_NAME_BYTES} bytes here")
        if self._reserved(name):
            raise InvalidArgument(f"bad slot file name {name!r}: {RESERVED}")
        return self.dir / name

    @staticmethod
    def _reserved(name: str) -> bool:
        return name.startswith((TEMP_PREFIX, PENDING_PREFIX)) or name.endswith(DRAFT_SUFFIX)

    def _pending(self, name: str) -> list[Path]:
        return sorted(self.dir.glob(f"{PENDING_PREFIX}{_name_key(name)}-*"))

    def _settle(self, name: str) -> None:
        """Finishes the committed save of `name` a crash interrupted, or removes what a
        save that never committed left (under the lock)."""
        pending = self._pending(name)
        if not pending:
            return
        path = self.dir / name
        current = _file_sha256(path) if path.is_file() else None
        for p in pending:
            if p.name.rsplit("-", 1)[1] != current:
                p.unlink()
            elif p.stat().st_size == 0:  # a save without a sidecar
                path.with_name(name + DRAFT_SUFFIX).unlink(missing_ok=True)
                p.unlink()
            else:
                os.replace(p, path.with_name(name + DRAFT_SUFFIX))
        fsync_dir(self.dir)

    def _write_temp(self, data: Buffer) -> Path:
        tmp = self.dir / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def save(self, name: str, target: Buffer, draft: Buffer | None, *,
             target_sha256: str | None = None, deadline: float | None = None) -> int:
        """`target_sha256`: the target's hex SHA-256 when the caller has it (saves
        hashing it again); `deadline`: nothing to wait for locally."""
        del deadline
        path = self._path(name)
        side = path.with_name(name + DRAFT_SUFFIX)
        digest = target_sha256 or hashlib.sha256(target).hexdigest()
        pending = self.dir / f"{PENDING_PREFIX}{_name_key(name)}-{digest}"
        with self._lock:
            temps: list[Path] = []
            try:
                self._settle(name)
                temps.append(self._write_temp(target))
                temps.append(self._write_temp(draft if draft is not None else b""))
                os.replace(temps[1], pending)
                temps[1] = pending
                fsync_dir(self.dir)
                os.replace(temps[0], path)  # the commit point
                temps.clear()  # from here on, a failure leaves the pending file to _settle
                fsync_dir(self.dir)
                if draft is not None:
                    os.replace(pending, side)
                else:
                    side.unlink(missing_ok=True)
                    pending.unlink()
                fsync_dir(self.dir)
            except OSError as exc:
                for t in temps:  # before the commit point: the earlier save stays whole
                    t.unlink(missing_ok=True)
                if exc.errno in (28, 122):  # ENOSPC, EDQUOT
                    raise ResourceExhausted(f"no space left to save {name!r}: {exc}") from exc
                raise Unavailable(f"cannot save {name!r} in {self.dir}: {exc}") from exc
        return len(target) + (len(draft) if draft is not None else 0)

    def load(self, name: str, *, deadline: float | None = None) -> StoredSlot:
        del deadline  # a local read does not wait on anyone
        path = self._path(name)
        with self._lock:
            try:
                self._settle(name)
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

    def conditional(self) -> bool:
        """A local directory keeps no generations: one replica owns it."""
        return False

    def generation(self, name: str, *, deadline: float | None = None) -> int:
        raise FailedPrecondition(f"the local store {self.describe()} keeps no generations")

    def save_if(self, name: str, target: Buffer, draft: Buffer | None, expected: int, *,
                target_sha256: str | None = None, deadline: float | None = None) -> int:
        raise FailedPrecondition(f"the local store {self.describe()} takes no conditional "
                                 f"saves (of {name!r}, expected generation {expected})")

    def delete(self, name: str, *, deadline: float | None = None) -> bool:
        del deadline  # local files: nothing to wait for
        path = self._path(name)
        with self._lock:
            try:
                removed = False
                # pending and sidecar first: a crash in between leaves a target without a
                # sidecar, never a sidecar without its target
                for p in (*self._pending(name), path.with_name(name + DRAFT_SUFFIX), path):
                    try:
                        p.unlink()
                        removed = True
                    except FileNotFoundError:
                        pass
                if removed:
                    fsync_dir(self.dir)
            except OSError as exc:
                raise Unavailable(f"cannot delete {name!r} in {self.dir}: {exc}") from exc
        return removed

    def list(self, prefix: str) -> list[StoredInfo]:
        """The names in the directory starting with `prefix`, each with the token count
        of its target file's header (-1 when it is no slot file) and its mtime."""
        out = []
        with self._lock:
            try:
                paths = list(self.dir.glob(f"{_glob_escape(prefix)}*"))
            except OSError as exc:
                raise Unavailable(f"cannot list {self.dir}: {exc}") from exc
            for p in paths:
                if self._reserved(p.name):
                    continue
                try:
                    if not p.is_file():
                        continue
                    with open(p, "rb") as f:
                        head = f.read(_HEAD_READ)
                    ms = int(p.stat().st_mtime * 1000)
                except OSError:
                    continue  # removed meanwhile
                try:
                    n = slotfile.read_meta(head).n_tokens
                except slotfile.SlotFileError:
                    n = -1
                out.append(StoredInfo(p.name, n, ms))
        return sorted(out, key=lambda i: i.name)


def _glob_escape(s: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in s)
