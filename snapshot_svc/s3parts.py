"""The parts of a snapshot on S3, streamed: an upload in multipart parts of PART_BYTES
(two in memory at most), a read that reads ahead (s3store.py has the layout)."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from concurrent import futures
from typing import Any

from snapshot_svc.backend import (
    UploadHeader,
    check_complete,
    check_received,
    check_trailer_sha256,
)
from snapshot_svc.client.contract import MAX_CHUNK_BYTES
from snapshot_svc.client.digest import StreamDigest
from snapshot_svc.client.records import PartInfo
from snapshot_svc.errors import DataLoss, SnapshotError
from snapshot_svc.logs import log_event
from snapshot_svc.s3client import is_missing, s3_error

log = logging.getLogger("snapshot_svc.s3parts")

PART_BYTES = 8 << 20  # multipart part size (S3's minimum is 5 MiB, the last part excepted)
READ_AHEAD = 4  # chunks (of MAX_CHUNK_BYTES) a Get reads ahead of what it has sent


class S3Upload:
    """One part being received into the bucket (s3store.py describes the layout)."""

    overwrites_spare = False

    def __init__(self, s3: Any, bucket: str, key: str, header: UploadHeader, max_bytes: int,
                 pool: futures.Executor, leftovers: Leftovers) -> None:
        self.header = header
        self._leftovers = leftovers
        self.key = key
        self.received = 0
        self._s3 = s3
        self._bucket = bucket
        self._max_bytes = max_bytes
        self._pool = pool
        self._buf = bytearray()
        self._digest = StreamDigest()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._sending: futures.Future[dict[str, Any]] | None = None
        self._stored = False  # the object exists (completed): abort deletes it

    def expect_sha256(self, sha256: str) -> None:
        check_trailer_sha256(self.header, sha256)
        self.header = dataclasses.replace(self.header, sha256=sha256)

    def write(self, data: bytes | memoryview) -> None:
        total = self.received + len(data)
        check_received(self.header, total, self._max_bytes)
        self._digest.update(data)
        self._buf += data
        self.received = total
        if len(self._buf) >= PART_BYTES:
            self._send_part()

    def _send_part(self) -> None:
        """Starts uploading the buffered bytes as the next part (after the previous one
        finished: at most one part in flight and one being filled)."""
        if self._upload_id is None:
            try:
                self._upload_id = self._s3.create_multipart_upload(
                    Bucket=self._bucket, Key=self.key)["UploadId"]
            except Exception as exc:  # noqa: BLE001 - mapped to a status code
                raise s3_error(f"starting the upload of {self.header.name!r}", exc) from exc
        self._wait_part()
        number, body = len(self._parts) + 1, self._buf
        self._buf = bytearray()  # the part being sent keeps its buffer
        self._sending = self._pool.submit(self._upload_part, number, body)

    def _upload_part(self, number: int, body: bytearray) -> dict[str, Any]:
        r = self._s3.upload_part(Bucket=self._bucket, Key=self.key,
                                 UploadId=self._upload_id, PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": r["ETag"]}

    def _wait_part(self) -> None:
        if self._sending is not None:
            sending, self._sending = self._sending, None
            try:
                self._parts.append(sending.result())
            except Exception as exc:  # noqa: BLE001 - mapped to a status code
                raise s3_error(f"uploading {self.header.name!r}", exc) from exc

    def seal(self) -> None:
        """Checks size and digest, then completes the object (DATA_LOSS on mismatch)."""
        h = self.header
        try:
            check_complete(h, self.received, self._digest.hexdigest)
        finally:
            self._digest.close()
        bucket = self._bucket
        try:
            if self._upload_id is None:
                self._s3.put_object(Bucket=bucket, Key=self.key, Body=self._buf)
            else:
                if self._buf:
                    self._send_part()
                self._wait_part()
                self._s3.complete_multipart_upload(
                    Bucket=bucket, Key=self.key, UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts})
                self._upload_id = None
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            raise s3_error(f"storing {h.name!r}", exc) from exc
        finally:
            self._buf = bytearray()
        self._stored = True

    def committed(self) -> None:
        """The object is named by a manifest or staged record: abort keeps it."""
        self._stored = False

    def abort(self) -> None:
        """Leaves nothing in the bucket (idempotent): what cannot be removed now (the
        store unreachable) is removed by `leftovers` once it can."""
        self._digest.close()
        self._buf = bytearray()
        sending, self._sending = self._sending, None
        if sending is not None:
            futures.wait([sending])
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            self._leftovers.remove(self.key, upload_id)
        if self._stored:
            self._stored = False
            self._leftovers.remove(self.key, None)


class Leftovers:
    """What an abort could not remove from the bucket (an unfinished multipart upload,
    an object no manifest names), tried again every `retry_s` seconds until it is gone
    or the store closes (then the garbage collector, or this replica's next start,
    removes it)."""

    def __init__(self, s3: Any, bucket: str, retry_s: float = 2.0) -> None:
        self._s3 = s3
        self._bucket = bucket
        self._retry_s = retry_s
        self._items: list[tuple[str, str | None]] = []  # (key, upload id or None: object)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="s3-leftovers", daemon=True)
        self._thread.start()

    def remove(self, key: str, upload_id: str | None) -> None:
        """Aborts the upload (`upload_id`) or deletes the object now, or later."""
        try:
            self._remove(key, upload_id)
        except Exception as exc:  # noqa: BLE001 - kept and tried again
            log_event(log, logging.WARNING, "upload_abort_failed", key=key,
                      upload_id=upload_id or "", error=str(exc))
            with self._lock:
                self._items.append((key, upload_id))

    def _remove(self, key: str, upload_id: str | None) -> None:
        try:
            if upload_id is not None:
                self._s3.abort_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload_id)
            else:
                self._s3.delete_object(Bucket=self._bucket, Key=key)
        except Exception as exc:
            if not is_missing(exc):  # already gone: done
                raise

    def pending(self) -> int:
        with self._lock:
            return len(self._items)

    def _loop(self) -> None:
        while not self._closed.wait(self._retry_s):
            with self._lock:
                items, self._items = self._items, []
            for i, (key, upload_id) in enumerate(items):
                try:
                    self._remove(key, upload_id)
                except Exception:  # noqa: BLE001 - still unreachable: later
                    with self._lock:
                        self._items += items[i:]
                    break
                log_event(log, logging.INFO, "upload_aborted_later", key=key,
                          upload_id=upload_id or "")

    def close(self) -> None:
        self._closed.set()
        self._thread.join(10)


class S3Reader:
    """A committed part streamed from its object. A helper thread reads ahead (up to
    `READ_AHEAD` chunks) while the caller sends what it has, so the store's latency and
    the gRPC send overlap. A short object is DataLoss; the digest is checked by the
    client or the Get handler (server.py), as for every backend."""

    def __init__(self, body: Any, info: PartInfo, name: str) -> None:
        self._body = body
        self._info = info
        self._name = name
        self._chunks: queue.Queue[bytes | SnapshotError] = queue.Queue(READ_AHEAD)
        self._stop = threading.Event()
        self._pending = b""
        self._thread = threading.Thread(target=self._fetch, name="s3-read", daemon=True)
        self._thread.start()

    def _put(self, item: bytes | SnapshotError) -> bool:
        while not self._stop.is_set():
            try:
                self._chunks.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fetch(self) -> None:
        info, label = self._info, self._info.part.label
        received = 0
        try:
            while received < info.size and not self._stop.is_set():
                data = self._body.read(min(MAX_CHUNK_BYTES, info.size - received))
                if not data:
                    raise DataLoss(f"the stored {label} of {self._name!r} is truncated at "
                                   f"{received} of {info.size} bytes")
                received += len(data)
                if not self._put(data):
                    return
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            self._put(s3_error(f"reading {self._name!r}", exc))

    def read(self, n: int) -> bytes:
        """At most `n` bytes (a chunk as it was read ahead); b"" at the part's end."""
        while not self._pending:
            if not self._thread.is_alive() and self._chunks.empty():
                return b""
            try:
                item = self._chunks.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(item, SnapshotError):
                raise item
            self._pending = item
        data, self._pending = self._pending[:n], self._pending[n:]
        return data

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self._body.close()
