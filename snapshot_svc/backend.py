"""The storage backend interface of the snapshot service, and what its backends share.

A backend stores, per name, a target part and an optional draft part, committed
together (a manifest per name, written last, names both). Two implement it:

- `storage.Store`: a local data directory (the default, `--data-dir`);
- `s3store.S3Store`: a bucket on any S3 API (`--store s3://bucket/prefix`).

The gRPC handlers (server.py) see only this interface, so a client cannot tell which
backend serves it. The call sequence of a Put: `check_header` -> `begin_put` ->
`upload.write`... -> `finish_put` (commits, or stages a target whose draft follows), or
`upload.abort` on any failure. A draft claims its staged target (`claimed_target`) as
soon as its header is read: a draft Put that fails afterwards, for whatever reason (a
refused header included), calls `drop_staged` so the target it was meant to commit goes
with it. A Get: `open_part` -> `reader.read`... ->
`reader.close`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from snapshot_svc.client.names import name_problem, validate_name
from snapshot_svc.client.records import SHA256_HEX, Part, PartInfo, PartMeta, SnapshotInfo
from snapshot_svc.errors import (
    DataLoss,
    GenerationConflict,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from snapshot_svc.spares import SparePool


@dataclass(frozen=True)
class UploadHeader:
    """A validated Put header."""

    name: str
    part: Part
    size: int
    sha256: str
    meta: PartMeta
    draft_follows: bool = False  # TARGET: stage it, the draft put commits both
    target_sha256: str = ""  # DRAFT: the target it belongs to
    # commit only if the name's stored generation is this one (0: no snapshot); None:
    # whatever is stored
    expected_generation: int | None = None


@dataclass(frozen=True)
class PutOutcome:
    info: PartInfo
    commit_id: str
    committed: bool  # False: a staged target
    has_draft: bool
    generation: int = 0  # the committed generation (0: staged)


def check_header(max_snapshot_bytes: int, name: str, part: Part, size: int, sha256: str,
                 meta: PartMeta, draft_follows: bool = False, target_sha256: str = "",
                 trailer: bool = False) -> UploadHeader:
    """A validated header. `trailer`: an empty sha256 is allowed (the digest comes in
    the Put's trailer, `PartUpload.expect_sha256`)."""
    validate_name(name)
    if size > max_snapshot_bytes:
        raise ResourceExhausted(f"{part.label} of {name!r} is {size} bytes, the limit is "
                                f"{max_snapshot_bytes}")
    if not (SHA256_HEX.fullmatch(sha256) or (trailer and sha256 == "")):
        raise InvalidArgument(f"sha256 must be 64 lowercase hex digits, got {sha256!r}")
    if part is Part.DRAFT:
        if not SHA256_HEX.fullmatch(target_sha256):
            raise InvalidArgument("a draft part needs the target_sha256 of its target, got "
                                  f"{target_sha256!r}")
        if draft_follows:
            raise InvalidArgument("draft_follows applies to target parts only")
    elif target_sha256:
        raise InvalidArgument("target_sha256 applies to draft parts only")
    return UploadHeader(name, part, size, sha256, meta, draft_follows, target_sha256)


def check_generation(header: UploadHeader, current: SnapshotInfo | None) -> int:
    """The generation a commit of `header` over `current` (the name's snapshot now, None
    when it has none) gets; GenerationConflict when the header expects another stored
    generation than `current`'s. Called with the name's commit serialized (a lock, or a
    conditional write of the manifest)."""
    stored = current.generation if current is not None else 0
    expected = header.expected_generation
    if expected is not None and expected != stored:
        raise GenerationConflict(header.name, expected, stored)
    return stored + 1


def claimed_target(name: str, part: Part, target_sha256: str) -> tuple[str, str] | None:
    """The staged target a Put's header claims, as (stored name, target digest), taken
    before any other check of the header; None for a target part, or for a name or
    digest no target can be staged under (nothing to drop, no key built from them)."""
    if part is not Part.DRAFT or not SHA256_HEX.fullmatch(target_sha256):
        return None
    return None if name_problem(name) is not None else (name, target_sha256)


def check_trailer_sha256(header: UploadHeader, sha256: str) -> None:
    """The checks on a digest sent in a Put's trailer (InvalidArgument)."""
    if header.sha256:
        raise InvalidArgument(f"the Put of {header.name!r} has a trailer, but its "
                              "header already named the sha256")
    if not SHA256_HEX.fullmatch(sha256):
        raise InvalidArgument(f"the trailer's sha256 must be 64 lowercase hex digits (Put "
                              f"of {header.name!r}), got {sha256!r}")


def check_received(header: UploadHeader, total: int, max_bytes: int) -> None:
    """The limits on a Put that has now received `total` bytes: RESOURCE_EXHAUSTED past
    the server's limit, INVALID_ARGUMENT past the declared size."""
    h = header
    if total > max_bytes:
        raise ResourceExhausted(f"{h.part.label} of {h.name!r} exceeds the limit of "
                                f"{max_bytes} bytes ({total} bytes received)")
    if total > h.size:
        raise InvalidArgument(f"{h.part.label} of {h.name!r}: received {total} bytes, "
                              f"more than the {h.size} declared")


def check_complete(header: UploadHeader, received: int, digest: Callable[[], str]) -> None:
    """The checks before a Put may commit: all the declared bytes arrived (DATA_LOSS),
    a digest was given (INVALID_ARGUMENT), theirs is it (`digest()`; DATA_LOSS)."""
    h = header
    if received != h.size:
        raise DataLoss(f"{h.part.label} of {h.name!r} truncated: received {received} "
                       f"of {h.size} bytes")
    if not h.sha256:
        raise InvalidArgument(f"the Put of {h.name!r} left the header's sha256 empty and "
                              "ended without a trailer")
    got = digest()
    if got != h.sha256:
        raise DataLoss(f"{h.part.label} of {h.name!r}: SHA-256 mismatch (header {h.sha256}, "
                       f"received bytes {got})")


def readable_part(snap: SnapshotInfo | None, name: str, part: Part,
                  target_sha256: str = "") -> PartInfo:
    """The part of a snapshot a Get may read: NotFound when the snapshot or the part is
    absent, or when its draft belongs to another target than the snapshot's (or than
    `target_sha256`, the target the reader already holds)."""
    if snap is None:
        raise NotFound(f"no snapshot named {name!r}")
    info = snap.part(part)
    if info is None:
        raise NotFound(f"snapshot {name!r} has no draft part")
    if part is Part.DRAFT:
        if info.target_sha256 != snap.target.sha256:
            raise NotFound(f"the draft of {name!r} belongs to another target")
        if target_sha256 and target_sha256 != snap.target.sha256:
            raise NotFound(f"the draft of {name!r} belongs to target "
                           f"{snap.target.sha256}, not {target_sha256}: a newer save "
                           "replaced the snapshot")
    return info


class HeaderChecks:
    """`check_header` against the backend's own part size limit (every backend)."""

    max_snapshot_bytes: int

    def check_header(self, name: str, part: Part, size: int, sha256: str, meta: PartMeta,
                     draft_follows: bool = False, target_sha256: str = "",
                     trailer: bool = False) -> UploadHeader:
        return check_header(self.max_snapshot_bytes, name, part, size, sha256, meta,
                            draft_follows, target_sha256, trailer)


class PartUpload(Protocol):
    """One part being received."""

    header: UploadHeader
    overwrites_spare: bool  # the local store overwrites a spare file (logged)

    def expect_sha256(self, sha256: str) -> None: ...
    def write(self, data: bytes | memoryview) -> None: ...
    def abort(self) -> None: ...  # idempotent; leaves nothing stored


class PartReader(Protocol):
    """The bytes of one committed part, read in order."""

    def read(self, n: int) -> bytes: ...  # b"" at the end
    def close(self) -> None: ...


class Backend(Protocol):
    max_snapshot_bytes: int
    conditional_writes: bool  # a commit can be conditional on the stored generation
    spares: SparePool | None  # the local store's spare files (metrics); None elsewhere

    def describe(self) -> str: ...  # where the snapshots are, for the log
    def check_header(self, name: str, part: Part, size: int, sha256: str, meta: PartMeta,
                     draft_follows: bool = False, target_sha256: str = "",
                     trailer: bool = False) -> UploadHeader: ...
    def begin_put(self, header: UploadHeader) -> PartUpload: ...
    def finish_put(self, upload: PartUpload) -> PutOutcome: ...
    def drop_staged(self, name: str, target_sha256: str) -> None: ...
    def open_part(self, name: str, part: Part,
                  target_sha256: str = "") -> tuple[SnapshotInfo, PartReader]: ...
    def stat(self, name: str) -> SnapshotInfo: ...
    def list(self, prefix: str = "") -> list[SnapshotInfo]: ...
    def delete(self, name: str) -> int: ...
    def usage(self) -> tuple[int, int]: ...
    def close(self) -> None: ...
