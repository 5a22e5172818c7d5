"""The on-disk store: content-addressed blobs plus one manifest per name.

Layout of the data directory:

    LOCK                          flock'ed by the one server that owns the directory
    blobs/<sha256>                the exact bytes of one uploaded part
    manifests/<sha256(name)>.json the committed snapshot of a name (SnapshotInfo)
    tmp/                          uploads in progress and spare files; swept at start-up

A Put streams into a temporary file in tmp/, checks size and SHA-256, fsyncs,
renames it into blobs/ and fsyncs that directory. The name's manifest, written
last (temporary file, fsync, rename, fsync of the directory), is the commit
point: it names the target digest and the optional draft digest, so readers
see both parts of one save or neither. A target that a draft will follow is
staged (kept in memory, its blob referenced) until the draft put naming its
digest commits both; a staged target that no draft claims expires.

Every manifest carries the name's generation (1 for its first commit, +1 for each
commit after; one written before generations reads as 1). A conditional Put (an
expected generation) is checked and committed under the store's lock, so of two
conditional Puts expecting the same generation exactly one commits; the other is
refused (GenerationConflict, ABORTED) before its blob is placed.

Blobs are reference-counted by the manifests and the staged targets, and
removed as soon as nothing references them (at start-up: everything not named
by a manifest). A Get opens its blob under the store's lock, so a blob removed
afterwards is still read whole through the open descriptor. An unreferenced blob
that no Get is reading becomes a spare file (spares.py, up to `spare_bytes`) that
the next Put overwrites instead of allocating a new file.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

from snapshot_svc.backend import (
    HeaderChecks,
    PutOutcome,
    UploadHeader,
    check_complete,
    check_generation,
    check_received,
    check_trailer_sha256,
    readable_part,
)
from snapshot_svc.client.digest import StreamDigest
from snapshot_svc.client.names import validate_name
from snapshot_svc.client.records import SHA256_HEX, Part, PartInfo, SnapshotInfo
from snapshot_svc.clientlib.files import fsync_dir
from snapshot_svc.errors import (
    DataLoss,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from snapshot_svc.logs import log_event
from snapshot_svc.spares import SparePool

log = logging.getLogger("snapshot_svc.storage")

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_WRITEBACK_BYTES = 16 << 20  # a large upload starts writeback every this many bytes


def _io_error(what: str, exc: OSError) -> Exception:
    """ENOSPC and friends are RESOURCE_EXHAUSTED; any other I/O error is INTERNAL."""
    if exc.errno in _DISK_FULL:
        return ResourceExhausted(f"{what}: disk full ({os.strerror(exc.errno)})")
    return Internal(f"{what}: {exc}")


def manifest_key(name: str) -> str:
    """The manifest file stem of a name (names never become paths themselves)."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


@dataclass
class _Staged:
    info: PartInfo
    commit_id: str
    expires_at: float


class Upload:
    """One part being received: a temporary file, a running digest, a byte count.

    Created by `Store.begin_put`; fed with `write`; ended by `Store.finish_put`
    or `abort` (which is idempotent and always leaves no file behind). The
    digest is computed on a helper thread while the caller receives the next
    chunk; the caller writes each chunk itself.
    """

    def __init__(self, header: UploadHeader, path: Path, max_bytes: int,
                 write: Callable[[int, memoryview], int],
                 flusher: futures.Executor | None = None,
                 allocate: Callable[[int, int, int], None] = os.posix_fallocate,
                 reuse_size: int | None = None,
                 on_disk_full: Callable[[], object] = lambda: None) -> None:
        self.header = header
        self.overwrites_spare = reuse_size is not None
        self._on_disk_full = on_disk_full  # the store gives its spare files back
        self.path = path
        self.received = 0
        self._max_bytes = max_bytes
        self._write = write
        self._flusher = flusher
        self._flushing: futures.Future[None] | None = None
        self._unflushed = 0
        if reuse_size is None:
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        else:  # a spare file (renamed to `path` by the store): overwritten in place
            self._fd = os.open(path, os.O_WRONLY)
        try:
            if reuse_size is not None and reuse_size > header.size:
                os.ftruncate(self._fd, header.size)
            if header.size:
                # the blocks up front: a full disk is refused before any byte is sent, and
                # the filesystem allocates once instead of chunk by chunk; a spare
                # already has them (up to its size)
                allocate(self._fd, 0, header.size)
        except OSError as exc:
            os.close(self._fd)
            os.unlink(path)
            raise _io_error(f"reserving {header.size} bytes for the {header.part.label} of "
                            f"{header.name!r}", exc) from exc
        self._digest = StreamDigest()

    def expect_sha256(self, sha256: str) -> None:
        """The digest of a Put whose header left it empty (sent in its trailer)."""
        check_trailer_sha256(self.header, sha256)
        self.header = dataclasses.replace(self.header, sha256=sha256)

    def write(self, data: bytes | memoryview) -> None:
        """Appends one chunk (which must not change afterwards: it is hashed later);
        RESOURCE_EXHAUSTED / INVALID_ARGUMENT past the limits."""
        if self._fd is None:
            raise Internal("write to a closed upload")
        n = len(data)
        total = self.received + n
        check_received(self.header, total, self._max_bytes)
        self._digest.update(data)
        view = memoryview(data)
        try:
            while view:
                view = view[self._write(self._fd, view):]
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                self._on_disk_full()
            raise _io_error(f"writing {self.header.name!r}", exc) from exc
        self.received = total
        # start writing back what arrived so far, so the fsync at the end has little left
        self._unflushed += n
        if (self._flusher is not None and self._unflushed >= _WRITEBACK_BYTES
                and (self._flushing is None or self._flushing.done())):
            self._wait_flush()  # a writeback error is raised, never dropped (fsync reports
            # it only once per file description)
            self._flushing = self._flusher.submit(os.fdatasync, self._fd)
            self._unflushed = 0

    def _wait_flush(self) -> None:
        if self._flushing is not None:
            try:
                self._flushing.result()
            except OSError as exc:
                raise _io_error(f"syncing {self.header.name!r}", exc) from exc
            finally:
                self._flushing = None

    def seal(self) -> None:
        """Checks size and digest, then fsyncs and closes the file (DATA_LOSS on mismatch)."""
        h = self.header
        check_complete(h, self.received, self._digest.hexdigest)
        assert self._fd is not None
        try:
            self._wait_flush()
            os.fsync(self._fd)
        except OSError as exc:
            raise _io_error(f"syncing {h.name!r}", exc) from exc
        finally:
            self._digest.close()
            os.close(self._fd)
            self._fd = None

    def abort(self) -> None:
        self._digest.close()
        try:
            self._wait_flush()
        except Exception:  # noqa: BLE001 - discarding the upload anyway
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class BlobReader:
    """A part's bytes through a descriptor on its blob (`Store.open_part`)."""

    def __init__(self, store: Store, sha256: str, fd: int) -> None:
        self._store = store
        self.sha256 = sha256
        self.fd = fd

    def read(self, n: int) -> bytes:
        return os.read(self.fd, n)

    def close(self) -> None:
        if self.fd >= 0:
            self._store.close_part(self.sha256, self.fd)
            self.fd = -1


class Store(HeaderChecks):
    """The data directory of one server (the local backend). Thread-safe."""

    conditional_writes = True  # every commit runs under the store's lock

    def __init__(self, root: Path, *, max_snapshot_bytes: int, stage_ttl_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic,
                 write: Callable[[int, memoryview], int] = os.write,
                 allocate: Callable[[int, int, int], None] = os.posix_fallocate,
                 spare_bytes: int = 1 << 30) -> None:
        self.root = Path(root)
        self.max_snapshot_bytes = max_snapshot_bytes
        self.stage_ttl_s = stage_ttl_s
        self._clock = clock
        self._write = write  # os.write; tests inject failures (ENOSPC)
        self._allocate = allocate  # os.posix_fallocate; likewise
        self._lock = threading.Lock()
        self._flusher = futures.ThreadPoolExecutor(max_workers=4,
                                                   thread_name_prefix="snapshot-writeback")
        self._index: dict[str, SnapshotInfo] = {}
        self._staged: dict[tuple[str, str], _Staged] = {}
        self._refs: Counter[str] = Counter()
        self._blob_sizes: dict[str, int] = {}
        self._readers: Counter[str] = Counter()  # open Get descriptors per blob
        self.blobs = self.root / "blobs"
        self.manifests = self.root / "manifests"
        self.tmp = self.root / "tmp"
        self.spares = SparePool(self.tmp, spare_bytes)
        for d in (self.root, self.blobs, self.manifests, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._acquire_dir_lock()
        try:
            self._recover()
        except BaseException:
            self.close()
            raise

    # --- start-up ---------------------------------------------------------------------

    def _acquire_dir_lock(self) -> int:
        fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FailedPrecondition(f"data dir {self.root} is in use by another server") from None
        return fd

    def _recover(self) -> None:
        """Sweeps temporary files, loads the manifests, removes unreferenced blobs."""
        swept = 0
        for p in self.tmp.iterdir():
            p.unlink()
            swept += 1
        for p in self.manifests.glob("*.tmp"):
            p.unlink()
            swept += 1
        bad = 0
        for p in sorted(self.manifests.glob("*.json")):
            try:
                info = SnapshotInfo.from_json(json.loads(p.read_text("utf-8")))
                validate_name(info.name)
                if p.stem != manifest_key(info.name):
                    raise ValueError(f"holds name {info.name!r}, another name's file")
            except (ValueError, KeyError, TypeError, OSError, InvalidArgument) as exc:
                bad += 1
                log_event(log, logging.ERROR, "manifest_unreadable", path=str(p), error=str(exc))
                continue
            self._index[info.name] = info
            for part in (info.target, info.draft):
                if part is not None:
                    self._refs[part.sha256] += 1
                    self._blob_sizes[part.sha256] = part.size
        orphans = 0
        for p in self.blobs.iterdir():
            if SHA256_HEX.fullmatch(p.name) and self._refs[p.name] == 0:
                p.unlink()
                orphans += 1
        missing = [s for s in self._refs if not (self.blobs / s).exists()]
        for s in missing:
            log_event(log, logging.ERROR, "blob_missing", sha256=s)
        log_event(log, logging.INFO, "store_opened", data_dir=str(self.root),
                  snapshots=len(self._index), temp_files_swept=swept, orphan_blobs_removed=orphans,
                  unreadable_manifests=bad, missing_blobs=len(missing))

    def close(self) -> None:
        self._flusher.shutdown(wait=True)
        self.spares.drop_all()  # a stopped server holds no disk space beyond its snapshots
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # --- Put --------------------------------------------------------------------------

    def describe(self) -> str:
        return str(self.root)

    def begin_put(self, header: UploadHeader) -> Upload:
        """The upload's temporary file: a spare overwritten in place if there is one.
        A disk too full for the declared size first gets the spares' space back."""
        try:
            return self._new_upload(header)
        except ResourceExhausted:
            if not self.spares.drop_all():
                raise
            return self._new_upload(header)

    def _new_upload(self, header: UploadHeader) -> Upload:
        path = self.tmp / f"put-{uuid.uuid4().hex}.tmp"
        reuse = self.spares.take(header.size, path)
        try:
            return Upload(header, path, self.max_snapshot_bytes, self._write, self._flusher,
                          self._allocate, reuse_size=reuse, on_disk_full=self.spares.drop_all)
        except OSError as exc:
            raise _io_error(f"creating a temporary file for {header.name!r}", exc) from exc

    def finish_put(self, upload: Upload) -> PutOutcome:
        """Verifies the upload and commits (or stages) it. The upload is consumed:
        on any error nothing of it is left on disk."""
        h = upload.header
        try:
            upload.seal()
            with self._lock:
                self._expire_staged()
                # a conditional Put that lost is refused before its blob is placed: the
                # commit below runs under the same lock, so the check holds for it
                check_generation(h, self._index.get(h.name))
                self._place_blob(upload.path, h.sha256, h.size)
                try:
                    return self._commit(h)
                finally:
                    self._drop_if_unreferenced(h.sha256)
        except ResourceExhausted:
            self.spares.drop_all()  # the disk is full: no space held in spare files
            raise
        finally:
            upload.abort()  # removes the temporary file unless it became the blob

    def _place_blob(self, tmp: Path, sha: str, size: int) -> None:
        dst = self.blobs / sha
        try:
            if dst.exists() and dst.stat().st_size == size:
                # same bytes already stored (the name is their digest): the upload's
                # file, written and cached, is the next Put's spare
                self.spares.offer(tmp, size)
                return
            os.rename(tmp, dst)
            fsync_dir(self.blobs)
        except OSError as exc:
            raise _io_error(f"storing blob {sha}", exc) from exc
        self._blob_sizes[sha] = size

    def _commit(self, h: UploadHeader) -> PutOutcome:
        """Commits (or stages) a placed upload; under the store's lock, which makes a
        conditional Put's check and its commit one step against every other Put."""
        info = PartInfo(h.part, h.size, h.sha256, h.meta, h.target_sha256)
        generation = check_generation(h, self._index.get(h.name))
        if h.part is Part.TARGET:
            if h.draft_follows:
                key = (h.name, h.sha256)
                staged = self._staged.get(key)
                if staged is None:
                    staged = self._staged[key] = _Staged(info, uuid.uuid4().hex, 0.0)
                    self._refs[h.sha256] += 1
                staged.info = info
                staged.expires_at = self._clock() + self.stage_ttl_s
                log_event(log, logging.INFO, "target_staged", name=h.name, sha256=h.sha256,
                          bytes=h.size, commit_id=staged.commit_id)
                return PutOutcome(info, staged.commit_id, committed=False, has_draft=False)
            snap = SnapshotInfo(h.name, uuid.uuid4().hex, int(time.time() * 1000), info, None,
                                generation)
            self._write_manifest(snap)
            return PutOutcome(info, snap.commit_id, committed=True, has_draft=False,
                              generation=generation)

        staged = self._staged.get((h.name, h.target_sha256))
        current = self._index.get(h.name)
        if staged is not None:
            target, commit_id = staged.info, staged.commit_id
        elif current is not None and current.target.sha256 == h.target_sha256:
            target, commit_id = current.target, uuid.uuid4().hex  # a new draft for the same target
        else:
            have = current.target.sha256 if current else "none"
            raise FailedPrecondition(
                f"draft of {h.name!r} belongs to target {h.target_sha256}, which is neither "
                f"staged nor the current target ({have}); upload the target first")
        snap = SnapshotInfo(h.name, commit_id, int(time.time() * 1000), target, info,
                            generation)
        self._write_manifest(snap)
        if staged is not None and self._staged.pop((h.name, h.target_sha256), None) is not None:
            self._release(h.target_sha256)
        return PutOutcome(info, commit_id, committed=True, has_draft=True,
                          generation=generation)

    def _write_manifest(self, snap: SnapshotInfo) -> None:
        """The commit point: replaces the name's manifest atomically and durably."""
        final = self.manifests / f"{manifest_key(snap.name)}.json"
        tmp = self.manifests / f"{final.stem}.{uuid.uuid4().hex}.tmp"
        data = json.dumps(snap.to_json(), sort_keys=True).encode("utf-8")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[self._write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            fsync_dir(self.manifests)
        except OSError as exc:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
            raise _io_error(f"writing the manifest of {snap.name!r}", exc) from exc
        old = self._index.get(snap.name)
        self._index[snap.name] = snap
        for p in (snap.target, snap.draft):
            if p is not None:
                self._refs[p.sha256] += 1
        if old is not None:
            for p in (old.target, old.draft):
                if p is not None:
                    self._release(p.sha256)
        log_event(log, logging.INFO, "snapshot_committed", name=snap.name,
                  commit_id=snap.commit_id, target_sha256=snap.target.sha256,
                  target_bytes=snap.target.size,
                  draft_sha256=snap.draft.sha256 if snap.draft else "",
                  draft_bytes=snap.draft.size if snap.draft else 0)

    # --- references -------------------------------------------------------------------

    def _release(self, sha: str) -> int:
        """Drops one reference; removes the blob at zero. Returns the bytes freed."""
        self._refs[sha] -= 1
        return self._drop_if_unreferenced(sha)

    def _drop_if_unreferenced(self, sha: str) -> int:
        if self._refs[sha] > 0:
            return 0
        del self._refs[sha]
        size = self._blob_sizes.pop(sha, 0)
        if self._readers[sha] == 0 and self.spares.offer(self.blobs / sha, size):
            return size  # a Get still reading it keeps its file unchanged: removed instead
        try:
            os.unlink(self.blobs / sha)
        except FileNotFoundError:
            return 0
        except OSError as exc:  # left for the next start-up's sweep
            log_event(log, logging.WARNING, "blob_remove_failed", sha256=sha, error=str(exc))
            return 0
        return size

    def drop_staged(self, name: str, target_sha256: str) -> None:
        """Forgets the staged target a failed draft was meant to commit, and its blob:
        a failed paired Put leaves nothing behind."""
        with self._lock:
            if self._staged.pop((name, target_sha256), None) is not None:
                log_event(log, logging.INFO, "staged_target_dropped", name=name,
                          sha256=target_sha256)
                self._release(target_sha256)

    def _expire_staged(self) -> None:
        now = self._clock()
        for key in [k for k, s in self._staged.items() if s.expires_at <= now]:
            self._staged.pop(key)
            log_event(log, logging.INFO, "staged_target_expired", name=key[0], sha256=key[1])
            self._release(key[1])

    # --- reads ------------------------------------------------------------------------

    def open_part(self, name: str, part: Part,
                  target_sha256: str = "") -> tuple[SnapshotInfo, BlobReader]:
        """The committed snapshot and a reader of the requested part's bytes (an open
        descriptor on its blob).

        For a draft, `target_sha256` (optional) is the target the reader holds: the
        draft is served only if it belongs to that target. The caller closes the reader
        (until then the blob's file is never reused as a spare).
        """
        validate_name(name)
        with self._lock:
            snap = self._index.get(name)
            info = readable_part(snap, name, part, target_sha256)
            try:
                fd = os.open(self.blobs / info.sha256, os.O_RDONLY)
            except FileNotFoundError:
                raise DataLoss(f"the {part.label} of {name!r} is missing from the store") from None
            except OSError as exc:
                raise _io_error(f"opening {name!r}", exc) from exc
            self._readers[info.sha256] += 1
        reader = BlobReader(self, info.sha256, fd)
        size = os.fstat(fd).st_size
        if size != info.size:
            reader.close()
            raise DataLoss(f"the stored {part.label} of {name!r} is {size} bytes, "
                           f"expected {info.size}")
        return snap, reader

    def close_part(self, sha256: str, fd: int) -> None:
        """Closes a descriptor from `open_part` (of the blob `sha256`)."""
        with self._lock:
            os.close(fd)
            self._readers[sha256] -= 1
            if self._readers[sha256] <= 0:
                del self._readers[sha256]

    def _indexed(self, name: str) -> SnapshotInfo:
        """The snapshot of a valid name (under the lock); NotFound when there is none."""
        snap = self._index.get(name)
        if snap is None:
            raise NotFound(f"no snapshot named {name!r}")
        return snap

    def stat(self, name: str) -> SnapshotInfo:
        validate_name(name)
        with self._lock:
            return self._indexed(name)

    def list(self, prefix: str = "") -> list[SnapshotInfo]:
        with self._lock:
            return sorted((s for n, s in self._index.items() if n.startswith(prefix)),
                          key=lambda s: s.name)

    def delete(self, name: str) -> int:
        """Removes both parts of a snapshot; returns the bytes freed on disk."""
        validate_name(name)
        with self._lock:
            snap = self._indexed(name)
            try:
                os.unlink(self.manifests / f"{manifest_key(name)}.json")
                fsync_dir(self.manifests)
            except OSError as exc:
                raise _io_error(f"deleting {name!r}", exc) from exc
            del self._index[name]
            freed = sum(self._release(p.sha256) for p in (snap.target, snap.draft) if p)
        log_event(log, logging.INFO, "snapshot_deleted", name=name, commit_id=snap.commit_id,
                  bytes_freed=freed)
        return freed

    def usage(self) -> tuple[int, int]:
        """(number of snapshots, bytes held by blobs); spare files not counted."""
        with self._lock:
            return len(self._index), sum(self._blob_sizes.values())
