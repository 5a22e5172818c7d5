"""The S3 backend: snapshots in a bucket of any S3 API (SeaweedFS, Ceph RGW, MinIO,
cloud object storage), shared by any number of snapshot-service replicas.

Layout under `s3://bucket/prefix/`:

    blobs/<replica>/<upload id>          the exact bytes of one uploaded part
    manifests/<sha256(name)>.json        the committed snapshot of a name
    staged/<sha256(name)>.<sha256>.json  a target waiting for its draft (expires)

- A part streams into a multipart upload of 8 MiB parts (one part uploading while the
  next is received: at most two parts in memory, whatever the snapshot's size); a part
  under 8 MiB is one PutObject. Its SHA-256 is computed as it arrives and checked
  before the upload is completed; on any failure the multipart upload is aborted (or
  the completed object deleted), so no part is left behind.
- Every upload has an object of its own, named by the replica and a random id, and
  the manifest records each part's SHA-256 (checked again on every Get, as on the
  local backend: by the client when it says it checks, else by the Get handler).
  Replicas therefore never write, overwrite or delete an object another
  replica's commit may still name.
- The manifest, one PutObject (atomic in S3), is the commit point: it names the
  target's and the draft's objects, so a reader sees both parts of one save or
  neither. A target whose draft follows is recorded in `staged/` until the draft
  put, on any replica, commits both.
- Every replica reads manifests from the bucket on every call (nothing cached but
  parsed manifests keyed by their ETag), so a name put through one replica is read
  through another at once.
- Garbage collection (every `gc_grace_s`/2, and `collect_garbage()`): an object under
  blobs/ that no manifest or staged record names, last modified more than
  `gc_grace_s` ago, and found so by two consecutive sweeps (the timer's are
  `gc_grace_s`/2 apart), is deleted; multipart uploads started more than `gc_grace_s`
  ago are aborted. The grace covers a replica between completing an upload and
  writing the manifest that names it, and the second sweep one that read a manifest
  (to add a draft to its target) just before another replica replaced it.
  `gc_grace_s` must exceed the longest Put (deadlines make that minutes; the default
  is one hour).
- Generations: every manifest carries the name's generation (1 for the first commit,
  +1 for each after; a manifest written before generations reads as 1). A commit reads
  the manifest and its ETag, and writes the next one with `If-Match: <ETag>` (or
  `If-None-Match: *` when the name has none): a conditional write, atomic in the store,
  so of two replicas committing over the same manifest exactly one succeeds. The loser
  (HTTP 412) reads again: a conditional Put (an expected generation) then fails with
  GenerationConflict, an unconditional one commits on top of the winner (at most
  `_CAS_ATTEMPTS` rounds). Within one replica, commits of one name also take turns
  (`NameLocks`): only replicas race in the store. Generations therefore grow by
  exactly one per commit across every replica sharing the bucket, and a conditional
  Put commits only over the generation it names. A draft added to the current
  target checks that target under the same condition, so it can no longer replace a
  newer save.
- At start-up a replica checks that the store honours conditional writes (an object
  written twice with `If-None-Match: *`: the second must fail). A store that ignores
  them leaves `conditional_writes` False: the last manifest written wins again, the
  generations are best effort, and conditional Puts are refused (FAILED_PRECONDITION).
- At start-up a replica aborts the multipart uploads it left behind (its id is in
  their keys: give each replica its own `--replica-id`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError, NoCredentialsError

from snapshot_svc.backend import (
    HeaderChecks,
    PutOutcome,
    UploadHeader,
    check_generation,
    readable_part,
)
from snapshot_svc.client.names import validate_name
from snapshot_svc.client.records import Part, PartInfo, SnapshotInfo
from snapshot_svc.errors import (
    DataLoss,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    SnapshotError,
    Unavailable,
)
from snapshot_svc.logs import log_event
from snapshot_svc.namelocks import NameLocks
from snapshot_svc.s3client import S3Location, is_missing, make_client, s3_error
from snapshot_svc.s3parts import Leftovers, S3Reader, S3Upload

log = logging.getLogger("snapshot_svc.s3store")

_CAS_ATTEMPTS = 16  # rounds of read-then-conditional-write of one manifest before UNAVAILABLE
_NAME_LOCK_S = 60.0  # longest wait for another commit of the same name in this server
# the store's answers to a conditional write that lost (AWS answers 409 to two racing)
_LOST = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


def _name_key(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class _Manifest:
    snap: SnapshotInfo
    target_key: str
    draft_key: str | None

    def to_json(self) -> dict[str, Any]:
        return {"snapshot": self.snap.to_json(), "target_key": self.target_key,
                "draft_key": self.draft_key}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _Manifest:
        snap = SnapshotInfo.from_json(d["snapshot"])
        draft_key = d.get("draft_key")
        if (snap.draft is None) != (draft_key is None):
            raise ValueError("draft and draft_key disagree")
        return cls(snap, str(d["target_key"]), None if draft_key is None else str(draft_key))


def _lost(exc: Exception) -> bool:
    """Whether a failed S3 call is a conditional write refused (another write came first)."""
    if not isinstance(exc, ClientError):
        return False
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code in _LOST or status in ("412", "409")


class S3Store(HeaderChecks):
    """The S3 backend of one replica. Thread-safe (boto3 clients are)."""

    spares = None

    def __init__(self, url: str, *, endpoint: str = "", region: str = "",
                 max_snapshot_bytes: int, stage_ttl_s: float = 300.0,
                 replica_id: str = "replica", gc_grace_s: float = 3600.0,
                 workers: int = 32, start_timeout_s: float = 30.0,
                 gc_interval_s: float | None = None) -> None:
        self.loc = S3Location.parse(url)
        self.endpoint = endpoint
        self.max_snapshot_bytes = max_snapshot_bytes
        self.stage_ttl_s = stage_ttl_s
        if not replica_id or "/" in replica_id:
            raise InvalidArgument(f"replica id must be non-empty without '/', got {replica_id!r}")
        self.replica_id = replica_id
        self.gc_grace_s = gc_grace_s
        self.s3 = make_client(endpoint, region, workers)
        self.pool = futures.ThreadPoolExecutor(max_workers=max(4, workers),
                                               thread_name_prefix="s3-part")
        self.leftovers = Leftovers(self.s3, self.loc.bucket)
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[str, _Manifest]] = {}  # manifest key -> (ETag, parsed)
        self._usage = (0, 0)
        self._gc_candidates: set[str] = set()
        self._gc_lock = threading.Lock()  # one sweep at a time (timer and callers)
        self._closed = threading.Event()
        self._names = NameLocks(_NAME_LOCK_S)
        self.conditional_writes = False  # set by the start-up check
        try:
            self._open_bucket(start_timeout_s)
            self.conditional_writes = self._check_conditional_writes()
            self._abort_own_uploads()
            self.list()  # usage figures from the start
        except BaseException:
            self.leftovers.close()
            self.pool.shutdown(wait=False)
            self.s3.close()
            raise
        interval = gc_grace_s / 2 if gc_interval_s is None else gc_interval_s
        self._gc_thread: threading.Thread | None = None
        if interval > 0:
            self._gc_thread = threading.Thread(target=self._gc_loop, args=(interval,),
                                               name="s3-gc", daemon=True)
            self._gc_thread.start()

    # --- start-up ---------------------------------------------------------------------

    def describe(self) -> str:
        return f"{self.loc} at {self.endpoint or 'the default S3 endpoint'}"

    def _open_bucket(self, timeout: float) -> None:
        """Checks the credentials and the bucket (created when missing); an unreachable
        store is retried for `timeout` seconds. FAILED_PRECONDITION / UNAVAILABLE with
        a message that says what to fix."""
        bucket = self.loc.bucket
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.s3.head_bucket(Bucket=bucket)
                return
            except Exception as exc:  # noqa: BLE001 - classified below
                err = exc
            if is_missing(err):
                break
            mapped = s3_error(f"opening bucket {bucket!r} at {self.describe()}", err)
            if isinstance(err, NoCredentialsError):
                raise FailedPrecondition(
                    "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                    "AWS_SHARED_CREDENTIALS_FILE (and AWS_PROFILE)") from err
            if not isinstance(mapped, Unavailable) or time.monotonic() > deadline:
                raise mapped from err
            log_event(log, logging.WARNING, "object_store_unreachable", store=str(self.loc),
                      error=str(err))
            time.sleep(1.0)
        try:
            self.s3.create_bucket(Bucket=bucket)
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                # another replica starting at the same time created it first: it is
                # usable when it answers, which the next call checks
                self.s3.head_bucket(Bucket=bucket)
                return
            raise FailedPrecondition(f"bucket {bucket!r} does not exist at {self.describe()} and "
                                     f"could not be created: {s3_error('', exc).message}") from exc
        log_event(log, logging.INFO, "bucket_created", bucket=bucket)

    def _check_conditional_writes(self) -> bool:
        """Whether the store honours `If-None-Match: *` on PutObject: a probe object
        written twice with it, the second write must be refused (then removed)."""
        key = f"{self.loc.prefix}probe/{self.replica_id}.{uuid.uuid4().hex}"
        try:
            self.s3.put_object(Bucket=self.loc.bucket, Key=key, Body=b"1", IfNoneMatch="*")
            try:
                self.s3.put_object(Bucket=self.loc.bucket, Key=key, Body=b"2",
                                   IfNoneMatch="*")
                honoured = False
            except Exception as exc:  # noqa: BLE001 - a refusal is the expected answer
                if not _lost(exc):
                    raise
                honoured = True
        except Exception as exc:  # noqa: BLE001 - any other answer: not supported
            log_event(log, logging.WARNING, "conditional_writes_unsupported",
                      store=str(self.loc), error=str(exc))
            honoured = False
        finally:
            try:
                self.s3.delete_object(Bucket=self.loc.bucket, Key=key)
            except Exception:  # noqa: BLE001, S110 - the probe is tiny; a leftover is harmless
                pass
        if not honoured:
            log_event(log, logging.WARNING, "conditional_writes_ignored", store=str(self.loc),
                      effect="last manifest written wins; conditional Puts are refused")
        return honoured

    def _uploads(self, prefix: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for page in self.s3.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.loc.bucket, Prefix=prefix):
            out += page.get("Uploads", [])
        return out

    def _abort_uploads(self, uploads: list[dict[str, Any]]) -> int:
        for u in uploads:
            self.s3.abort_multipart_upload(Bucket=self.loc.bucket, Key=u["Key"],
                                           UploadId=u["UploadId"])
        return len(uploads)

    def _abort_own_uploads(self) -> None:
        """Multipart uploads this replica left when it died: nobody else completes them."""
        try:
            n = self._abort_uploads(
                self._uploads(f"{self.loc.prefix}blobs/{self.replica_id}/"))
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            raise s3_error("aborting this replica's unfinished uploads", exc) from exc
        log_event(log, logging.INFO, "s3_store_opened", store=str(self.loc),
                  endpoint=self.endpoint, replica_id=self.replica_id, uploads_aborted=n)

    def close(self) -> None:
        self._closed.set()
        if self._gc_thread is not None:
            self._gc_thread.join(10)
        self.pool.shutdown(wait=True)
        self.leftovers.close()
        self.s3.close()

    # --- objects ----------------------------------------------------------------------

    def _manifest_key(self, name: str) -> str:
        return f"{self.loc.prefix}manifests/{_name_key(name)}.json"

    def _staged_key(self, name: str, target_sha256: str) -> str:
        return f"{self.loc.prefix}staged/{_name_key(name)}.{target_sha256}.json"

    def _get_json(self, key: str, what: str) -> tuple[dict[str, Any], str] | None:
        try:
            r = self.s3.get_object(Bucket=self.loc.bucket, Key=key)
            return json.loads(r["Body"].read()), str(r.get("ETag", ""))
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            if is_missing(exc):
                return None
            if isinstance(exc, ValueError):
                raise Internal(f"{what}: unreadable record {key}: {exc}") from exc
            raise s3_error(what, exc) from exc

    def _put_json(self, key: str, value: dict[str, Any], what: str) -> None:
        body = json.dumps(value, sort_keys=True).encode("utf-8")
        try:
            self.s3.put_object(Bucket=self.loc.bucket, Key=key, Body=body,
                               ContentType="application/json")
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            raise s3_error(what, exc) from exc

    def _delete(self, key: str, what: str) -> None:
        try:
            self.s3.delete_object(Bucket=self.loc.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            raise s3_error(what, exc) from exc

    def _manifest(self, name: str) -> _Manifest | None:
        return self._manifest_at(name)[0]

    def _manifest_at(self, name: str) -> tuple[_Manifest | None, str]:
        """The name's manifest and its ETag (None, "" when there is none)."""
        got = self._get_json(self._manifest_key(name), f"reading the manifest of {name!r}")
        if got is None:
            return None, ""
        try:
            m = _Manifest.from_json(got[0])
        except (ValueError, KeyError, TypeError) as exc:
            raise DataLoss(f"the manifest of {name!r} is unreadable: {exc}") from exc
        if m.snap.name != name:
            raise DataLoss(f"the manifest of {name!r} holds another name ({m.snap.name!r})")
        return m, got[1]

    # --- Put --------------------------------------------------------------------------

    def begin_put(self, header: UploadHeader) -> S3Upload:
        key = f"{self.loc.prefix}blobs/{self.replica_id}/{uuid.uuid4().hex}"
        return S3Upload(self.s3, self.loc.bucket, key, header, self.max_snapshot_bytes,
                        self.pool, self.leftovers)

    def finish_put(self, upload: S3Upload) -> PutOutcome:  # type: ignore[override]
        """Completes the object and commits (or stages) it; on any error nothing of the
        upload is left in the bucket."""
        try:
            upload.seal()
            out = self._commit(upload.header, upload.key)
            upload.committed()
            return out
        finally:
            upload.abort()

    def _commit(self, h: UploadHeader, key: str) -> PutOutcome:
        info = PartInfo(h.part, h.size, h.sha256, h.meta, h.target_sha256)
        now_ms = int(time.time() * 1000)
        if h.part is Part.TARGET:
            if h.draft_follows:
                if h.expected_generation is not None:  # early: the draft's commit decides
                    check_generation(h, self._current(h.name))
                commit_id = uuid.uuid4().hex
                self._put_json(self._staged_key(h.name, h.sha256), {
                    "name": h.name, "commit_id": commit_id, "key": key,
                    "target": info.to_json(),
                    "expires_unix_ms": now_ms + int(self.stage_ttl_s * 1000)},
                    f"staging the target of {h.name!r}")
                log_event(log, logging.INFO, "target_staged", name=h.name, sha256=h.sha256,
                          bytes=h.size, commit_id=commit_id, key=key)
                return PutOutcome(info, commit_id, committed=False, has_draft=False)
            commit_id = uuid.uuid4().hex

            def whole(current: _Manifest | None, generation: int) -> _Manifest:
                return _Manifest(SnapshotInfo(h.name, commit_id, now_ms, info, None,
                                              generation), key, None)

            m = self._commit_manifest(h, whole)
            return PutOutcome(info, commit_id, committed=True, has_draft=False,
                              generation=m.snap.generation)

        staged_key = self._staged_key(h.name, h.target_sha256)
        staged = self._get_json(staged_key, f"reading the staged target of {h.name!r}")
        if staged is not None and staged[0].get("expires_unix_ms", 0) <= now_ms:
            staged = None
        draft_commit = uuid.uuid4().hex

        def with_draft(current: _Manifest | None, generation: int) -> _Manifest:
            if staged is not None:
                rec = staged[0]
                target = PartInfo.from_json(Part.TARGET, rec["target"])
                target_key, commit_id = str(rec["key"]), str(rec["commit_id"])
            elif current is not None and current.snap.target.sha256 == h.target_sha256:
                target, target_key, commit_id = (current.snap.target, current.target_key,
                                                 draft_commit)
            else:
                have = current.snap.target.sha256 if current else "none"
                raise FailedPrecondition(
                    f"draft of {h.name!r} belongs to target {h.target_sha256}, which is "
                    f"neither staged nor the current target ({have}); upload the target first")
            return _Manifest(SnapshotInfo(h.name, commit_id, now_ms, target, info, generation),
                             target_key, key)

        m = self._commit_manifest(h, with_draft)
        if staged is not None:
            self._delete(staged_key, f"removing the staged target of {h.name!r}")
        return PutOutcome(info, m.snap.commit_id, committed=True, has_draft=True,
                          generation=m.snap.generation)

    def _current(self, name: str) -> SnapshotInfo | None:
        m = self._manifest(name)
        return None if m is None else m.snap

    def _commit_manifest(self, h: UploadHeader,
                         make: Callable[[_Manifest | None, int], _Manifest]) -> _Manifest:
        """The commit point: reads the name's manifest, checks the header's expected
        generation against it, and writes `make(current, next generation)` on condition
        that the manifest is still the one read (see the module docstring). A write that
        lost to another replica's is tried again from a fresh read, so a conditional Put
        then fails with GenerationConflict and an unconditional one goes on top."""
        if h.expected_generation is not None and not self.conditional_writes:
            raise FailedPrecondition(
                f"conditional Put of {h.name!r}: the object store at {self.describe()} "
                "ignores conditional writes")
        with self._names.hold(h.name):  # one commit of a name at a time in this server
            return self._commit_manifest_locked(h, make)

    def _commit_manifest_locked(self, h: UploadHeader,
                                make: Callable[[_Manifest | None, int], _Manifest]
                                ) -> _Manifest:
        for _ in range(_CAS_ATTEMPTS):
            current, etag = self._manifest_at(h.name)
            generation = check_generation(h, None if current is None else current.snap)
            m = make(current, generation)
            if self._put_manifest(m, etag):
                snap = m.snap
                log_event(log, logging.INFO, "snapshot_committed", name=snap.name,
                          commit_id=snap.commit_id, generation=snap.generation,
                          target_sha256=snap.target.sha256, target_bytes=snap.target.size,
                          draft_sha256=snap.draft.sha256 if snap.draft else "",
                          draft_bytes=snap.draft.size if snap.draft else 0)
                return m
            log_event(log, logging.INFO, "manifest_write_lost", name=h.name,
                      generation=generation)
        raise Unavailable(f"the manifest of {h.name!r} changed under {_CAS_ATTEMPTS} "
                          "commits in a row; try again")

    def _put_manifest(self, m: _Manifest, etag: str) -> bool:
        """Writes a manifest if the stored one still has ETag `etag` ("": if there is
        none); False when another write came first. Without conditional writes in the
        store, unconditionally (True)."""
        body = json.dumps(m.to_json(), sort_keys=True).encode("utf-8")
        cond: dict[str, str] = {}
        if self.conditional_writes:
            cond = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            self.s3.put_object(Bucket=self.loc.bucket, Key=self._manifest_key(m.snap.name),
                               Body=body, ContentType="application/json", **cond)
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            if cond and _lost(exc):
                return False
            raise s3_error(f"writing the manifest of {m.snap.name!r}", exc) from exc
        return True

    def drop_staged(self, name: str, target_sha256: str) -> None:
        """Removes the staged record of a failed paired save and its target's object."""
        key = self._staged_key(name, target_sha256)
        try:
            got = self._get_json(key, f"reading the staged target of {name!r}")
            if got is None:
                return
            self._delete(key, f"removing the staged target of {name!r}")
            self._delete(str(got[0]["key"]), f"removing the staged target of {name!r}")
        except SnapshotError as exc:  # the collector removes it later
            log_event(log, logging.WARNING, "staged_target_drop_failed", name=name,
                      error=exc.message)
            return
        log_event(log, logging.INFO, "staged_target_dropped", name=name, sha256=target_sha256)

    # --- reads ------------------------------------------------------------------------

    def open_part(self, name: str, part: Part,
                  target_sha256: str = "") -> tuple[SnapshotInfo, S3Reader]:
        validate_name(name)
        m = self._manifest(name)
        info = readable_part(None if m is None else m.snap, name, part, target_sha256)
        assert m is not None  # else readable_part raised NotFound
        key = m.target_key if part is Part.TARGET else m.draft_key
        try:
            r = self.s3.get_object(Bucket=self.loc.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            if is_missing(exc):
                raise DataLoss(f"the {part.label} of {name!r} is missing from the store") \
                    from None
            raise s3_error(f"opening {name!r}", exc) from exc
        if int(r.get("ContentLength", -1)) != info.size:
            r["Body"].close()
            raise DataLoss(f"the stored {part.label} of {name!r} is {r.get('ContentLength')} "
                           f"bytes, expected {info.size}")
        return m.snap, S3Reader(r["Body"], info, name)

    def stat(self, name: str) -> SnapshotInfo:
        validate_name(name)
        m = self._manifest(name)
        if m is None:
            raise NotFound(f"no snapshot named {name!r}")
        return m.snap

    def _all_manifests(self) -> list[_Manifest]:
        """Every committed manifest (GETs only those whose ETag changed since the last
        listing); refreshes the usage figures."""
        prefix = f"{self.loc.prefix}manifests/"
        listed: dict[str, str] = {}
        try:
            for page in self.s3.get_paginator("list_objects_v2").paginate(
                    Bucket=self.loc.bucket, Prefix=prefix):
                for o in page.get("Contents", []):
                    listed[o["Key"]] = str(o.get("ETag", ""))
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            raise s3_error("listing the manifests", exc) from exc
        with self._lock:
            cache = {k: v for k, v in self._cache.items() if k in listed}
        out: list[_Manifest] = []
        for key, etag in listed.items():
            hit = cache.get(key)
            if hit is not None and hit[0] == etag:
                out.append(hit[1])
                continue
            got = self._get_json(key, "reading a manifest")
            if got is None:
                continue  # deleted since the listing
            try:
                m = _Manifest.from_json(got[0])
            except (ValueError, KeyError, TypeError) as exc:
                log_event(log, logging.ERROR, "manifest_unreadable", key=key, error=str(exc))
                continue
            cache[key] = (got[1], m)
            out.append(m)
        with self._lock:
            self._cache = cache
            self._usage = (len(out), sum(m.snap.total_bytes for m in out))
        return out

    def list(self, prefix: str = "") -> list[SnapshotInfo]:
        return sorted((m.snap for m in self._all_manifests() if m.snap.name.startswith(prefix)),
                      key=lambda s: s.name)

    def delete(self, name: str) -> int:
        """Removes the name's manifest; returns the bytes it named (their objects go
        with the next garbage collection)."""
        validate_name(name)
        m = self._manifest(name)
        if m is None:
            raise NotFound(f"no snapshot named {name!r}")
        self._delete(self._manifest_key(name), f"deleting {name!r}")
        log_event(log, logging.INFO, "snapshot_deleted", name=name, commit_id=m.snap.commit_id,
                  bytes_freed=m.snap.total_bytes)
        return m.snap.total_bytes

    def usage(self) -> tuple[int, int]:
        """(snapshots, bytes they name) as of the last listing (no call to the store)."""
        with self._lock:
            return self._usage

    # --- garbage collection -----------------------------------------------------------

    def collect_garbage(self) -> dict[str, int]:
        """One sweep (see the module docstring); returns what it removed."""
        with self._gc_lock:
            return self._sweep()

    def _sweep(self) -> dict[str, int]:
        now = time.time()
        grace = self.gc_grace_s
        referenced = set()
        for m in self._all_manifests():
            referenced.add(m.target_key)
            if m.draft_key:
                referenced.add(m.draft_key)
        p = self.loc.prefix
        bucket = self.loc.bucket
        staged_removed = 0
        blobs: dict[str, float] = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                       Prefix=f"{p}staged/"):
            for o in page.get("Contents", []):
                got = self._get_json(o["Key"], "reading a staged record")
                if got is None:
                    continue
                if got[0].get("expires_unix_ms", 0) / 1000 + grace < now:
                    self._delete(o["Key"], "removing an expired staged record")
                    staged_removed += 1
                else:
                    referenced.add(str(got[0].get("key", "")))
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                       Prefix=f"{p}blobs/"):
            for o in page.get("Contents", []):
                blobs[o["Key"]] = o["LastModified"].timestamp()
        candidates = {k for k, t in blobs.items() if k not in referenced and t + grace <= now}
        doomed = candidates & self._gc_candidates
        for key in sorted(doomed):
            self._delete(key, "removing an unreferenced object")
        self._gc_candidates = candidates - doomed
        stale = [u for u in self._uploads(f"{p}blobs/")
                 if u["Initiated"].timestamp() + grace <= now]
        aborted = self._abort_uploads(stale)
        out = {"blobs_removed": len(doomed), "staged_removed": staged_removed,
               "uploads_aborted": aborted, "blobs_pending": len(self._gc_candidates)}
        log_event(log, logging.INFO, "garbage_collected", **out)
        return out

    def _gc_loop(self, interval: float) -> None:
        while not self._closed.wait(interval):
            try:
                self.collect_garbage()
            except Exception as exc:  # noqa: BLE001 - the next sweep tries again
                log_event(log, logging.WARNING, "garbage_collection_failed", error=str(exc))
