"""Client library of the snapshot service (what the inference service uses).

    from snapshot_svc.client import SnapshotClient
    from snapshot_svc.client.records import PartMeta

    with SnapshotClient("127.0.0.1:50052") as snap:
        res = snap.put("auto-host-slot0", target_bytes, draft_bytes,
                       target_meta=PartMeta(format_version=1, fingerprint=fp, n_tokens=n),
                       draft_meta=PartMeta(format_version=1, fingerprint=draft_fp, n_tokens=n))
        if res.draft_skipped:          # protocol-1 server: the target alone was saved
            log.warning(res.note)
        got = snap.get("auto-host-slot0")   # got.target: memoryview, got.draft: memoryview | None
        snap.stat(name); snap.list(prefix="auto-"); snap.delete(name)

Behaviour:

- Protocol: `Hello` is called once per client (one channel), lazily, on first
  use; `client.protocol` is the negotiated version. A server that answers Hello
  with UNIMPLEMENTED is a protocol-1 server; Hello is never retried then.
  `max_protocol=1` makes the client a protocol-1 peer: it never sends or
  fetches drafts.
- Paired save (protocol 2): the target is uploaded staged, then the draft,
  naming the target's SHA-256, commits both at once; readers never see one
  without the other. Without a draft the target replaces the snapshot alone.
- Every byte is checked: the client sends size and SHA-256, the server verifies
  before it commits; `get` verifies what it receives (DataLoss on mismatch), at
  protocol 2 in place of the server (GetRequest.client_checks_sha256).
- Every call has a deadline: `timeout` seconds, plus size / `min_rate` for data
  transfers (a Get learns its size from its header: until then `timeout` alone),
  and it ends by it even when the server stopped reading or sending (DeadlineExceeded).
  Calls are retried with exponential backoff on UNAVAILABLE only (`retries` times);
  any other failure raises at once. `put` and `get` also take an overall `deadline`
  (time.monotonic()) that bounds every attempt, retry and pause.
- Generations (feature "conditional-put", `client.conditional_writes`): every
  snapshot has one (`stat(name).generation`, `PutResult.generation`, 1 on the first
  commit, +1 per commit). `put(..., expected_generation=g)` commits only over
  generation g (0: only a new name), else raises `GenerationConflict` (ABORTED;
  `.name`, `.expected`, `.stored`) with nothing stored; against a server without
  the feature it raises FailedPrecondition and sends nothing.
- Errors are `snapshot_svc.errors` types (`NotFound`, `DataLoss`,
  `FailedPrecondition`, `ResourceExhausted`, `InvalidArgument`, `Unavailable`...),
  each with the gRPC `.code`.

The client is thread-safe.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from snapshot_svc.client import buffers
from snapshot_svc.client.contract import MAX_CHUNK_BYTES, PROTOCOL_MAX, PROTOCOL_MIN, VERSION
from snapshot_svc.client.digest import StreamDigest
from snapshot_svc.client.names import validate_name
from snapshot_svc.client.records import (
    Part,
    PartInfo,
    PartMeta,
    PutResult,
    ServerInfo,
    Snapshot,
    SnapshotInfo,
)
from snapshot_svc.client.wire import SnapshotStub
from snapshot_svc.clientlib.auth import BearerInterceptor
from snapshot_svc.clientlib.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    GenerationConflict,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    from_rpc_error,
)
from snapshot_svc.clientlib.errors import (
    StatusError as SnapshotError,
)
from snapshot_svc.clientlib.generations import (
    CONDITIONAL_PUT,
    conditional_header,
    is_own_commit,
)
from snapshot_svc.pb import snapshot_pb2 as pb

T = TypeVar("T")

CLIENT_FEATURES = ("sha256", "draft-sidecar", "paired-commit", "sha256-trailer",
                   "conditional-put")
DEFAULT_MAX_SNAPSHOT_BYTES = 2 << 30  # deadline basis when the server does not say (protocol 1)
CHANNEL_OPTIONS = (
    # reconnect quickly after a restart of the service (the defaults back off to minutes)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", MAX_CHUNK_BYTES + (64 << 10)),
)


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


# how long past its gRPC deadline a call may take to report it before it is cancelled
DEADLINE_SLACK_S = 1.0
CLOSE_TIMEOUT_S = 1.0  # longest wait for a channel to close (see SnapshotClient.close)


def _put_within(stub: SnapshotStub, requests: Iterator[object],
                timeout: float) -> pb.PutResponse:
    """A Put that ends within `timeout` (+ DEADLINE_SLACK_S) seconds.

    Not the blocking call: grpcio's blocking stream-unary call waits until every
    operation it started has completed, and a request write blocked on HTTP/2 flow
    control (a hung server that stopped reading) never completes, so the call outlived
    its deadline indefinitely. The future's own deadline applies, and a result that
    does not come is cancelled."""
    fut = stub.Put.future(requests, timeout=timeout)
    try:
        return fut.result(timeout=timeout + DEADLINE_SLACK_S)
    except grpc.FutureTimeoutError:
        fut.cancel()
        raise DeadlineExceeded(f"no answer to the Put within {timeout:.3g} s") from None


class _Watchdog:
    """Cancels a call at a limit (time.monotonic()) that may be moved once the call has
    said how much it will transfer; `fired` tells a cancel of ours from others."""

    def __init__(self, call: grpc.Future, at: float) -> None:
        self._call = call
        self.fired = False
        self._timer: threading.Timer | None = None
        self.move(at)

    def move(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(max(0.0, at - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        self._call.cancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class _PartSink:
    """Where the chunks of one part go: one result buffer (buffers.POOL: pages mapped up
    front, recycled when released) and a SHA-256 computed on a helper thread.

    Each chunk is hashed and copied into the buffer as it arrives, so its own memory
    is reused for the next one (keeping all chunks and joining them at the end would
    touch twice as much fresh memory)."""

    def __init__(self, size: int, tail: int = 0) -> None:
        self.size = size
        self.received = 0
        self._view = buffers.POOL.take(size)
        self._digest = StreamDigest()
        # the digest is also marked where the last `tail` bytes begin (0: not at all)
        self._cut = size - tail if 0 < tail <= size else -1

    def add(self, chunk: memoryview | bytes) -> bool:
        """Takes the next chunk; False (and nothing taken) if it overflows the size."""
        start, end = self.received, self.received + len(chunk)
        if end > self.size:
            return False
        self._view[start:end] = chunk
        if start <= self._cut < end:
            self._digest.update(self._view[start:self._cut])
            self._digest.mark()
            self._digest.update(self._view[self._cut:end])
        else:
            self._digest.update(self._view[start:end])
        self.received = end
        return True

    def finish(self) -> tuple[memoryview, int, str, str]:
        """(the bytes received as a read-only view, their count, their hex SHA-256, the
        hex SHA-256 of all but the last `tail` bytes or "" when not asked or not reached)."""
        sha = self._digest.hexdigest()
        marks = self._digest.marks()
        prefix_sha = marks[0] if marks else ""
        return self._view[:self.received].toreadonly(), self.received, sha, prefix_sha

    def close(self) -> None:
        self._digest.close()
        self._view.release()


class SnapshotClient:
    """A connection to one snapshot service. See the module docstring.

    addr:        "host:port" of the service.
    max_protocol: highest protocol spoken; 1 = never send or fetch drafts.
    min_protocol: lowest protocol accepted (2: fail rather than save without drafts).
    timeout:     deadline of each call in seconds (transfers get size / min_rate more).
    min_rate:    slowest transfer rate in bytes/s the deadline allows for.
    retries:     how many times an UNAVAILABLE call is retried (backoff from `backoff` s).
    credentials: TLS (clientlib.tls.channel_credentials); None: plaintext.
    api_key:     sent as `authorization: Bearer <key>` with every call.
    """

    def __init__(self, addr: str, *, max_protocol: int = PROTOCOL_MAX,
                 min_protocol: int = PROTOCOL_MIN, timeout: float = 30.0,
                 min_rate: float = 32 << 20, retries: int = 5, backoff: float = 0.1,
                 max_backoff: float = 2.0, channel: grpc.Channel | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 api_key: str | None = None) -> None:
        if not PROTOCOL_MIN <= min_protocol <= max_protocol <= PROTOCOL_MAX:
            raise ValueError(f"need {PROTOCOL_MIN} <= min_protocol <= max_protocol <= "
                             f"{PROTOCOL_MAX}")
        self.addr = addr
        self.min_protocol, self.max_protocol = min_protocol, max_protocol
        self.timeout, self.min_rate = timeout, min_rate
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        if channel is None:
            channel = (grpc.insecure_channel(addr, options=list(CHANNEL_OPTIONS))
                       if credentials is None else
                       grpc.secure_channel(addr, credentials, options=list(CHANNEL_OPTIONS)))
        if api_key:
            channel = grpc.intercept_channel(channel, BearerInterceptor(api_key))
        self._channel = channel
        self._stub = SnapshotStub(self._channel)  # chunks without extra copies
        self._lock = threading.Lock()
        self._info: ServerInfo | SnapshotError | None = None  # Hello's answer, once

    # --- connection -------------------------------------------------------------------

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Closes the channel, waiting at most `timeout` seconds. grpcio's close waits
        for every call on the channel to complete, and a Put whose write is stuck on
        flow control to a hung server never does, even cancelled: the close then goes
        on on a daemon thread (it does not keep the process from exiting)."""
        closer = threading.Thread(target=self._channel.close, name="snapshot-close",
                                  daemon=True)
        closer.start()
        closer.join(timeout)

    def __enter__(self) -> SnapshotClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[[float], T], size: int = 0,
              deadline: float | None = None, name: str = "") -> T:
        """Runs fn(timeout_seconds), retrying on UNAVAILABLE only, with backoff. Each
        attempt gets `timeout` + size / `min_rate` seconds, cut to what is left before
        `deadline` (time.monotonic()), which also bounds the retries and their pauses.
        `name`: the snapshot the call is about (named by a GenerationConflict)."""
        per_attempt = self.timeout + size / self.min_rate
        delay = self.backoff
        for attempt in range(self.retries + 1):
            timeout = per_attempt
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    raise DeadlineExceeded("the caller's deadline passed before the call")
            try:
                return fn(timeout)
            except grpc.RpcError as err:
                code = err.code() if isinstance(err, grpc.Call) else None
                if code != grpc.StatusCode.UNAVAILABLE or attempt == self.retries:
                    raise from_rpc_error(err, name) from None
                pause = delay * random.uniform(0.5, 1.0)
                if deadline is not None and time.monotonic() + pause >= deadline:
                    raise from_rpc_error(err, name) from None  # no time left to try again
            time.sleep(pause)
            delay = min(delay * 2, self.max_backoff)
        raise AssertionError("unreachable")

    def server_info(self, deadline: float | None = None) -> ServerInfo:
        """What Hello negotiated (Hello runs once, on first use, by `deadline`)."""
        with self._lock:
            if self._info is None:
                self._info = self._hello(deadline)
            info = self._info
        if isinstance(info, SnapshotError):
            raise info
        return info

    @property
    def protocol(self) -> int:
        """The negotiated protocol version: 1 (target only) or 2 (target + draft)."""
        return self.server_info().protocol

    def _hello(self, deadline: float | None) -> ServerInfo | SnapshotError:
        req = pb.HelloRequest(min_protocol=self.min_protocol, max_protocol=self.max_protocol,
                              features=list(CLIENT_FEATURES), client_version=VERSION)
        try:
            r = self._call(lambda t: self._stub.Hello(req, timeout=t), deadline=deadline)
        except SnapshotError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            if self.min_protocol > 1:  # cached like any answer: Hello is not asked again
                return FailedPrecondition(
                    "no common protocol version: the client speaks "
                    f"{self.min_protocol}..{self.max_protocol}, the server 1..1 (no Hello)")
            return ServerInfo(protocol=1, max_chunk_bytes=MAX_CHUNK_BYTES,
                              hello_supported=False)
        if not self.min_protocol <= r.protocol <= self.max_protocol:
            raise FailedPrecondition(f"the server chose protocol {r.protocol}, outside "
                                     f"{self.min_protocol}..{self.max_protocol}")
        return ServerInfo(protocol=r.protocol, features=tuple(r.features),
                          server_version=r.server_version, max_chunk_bytes=r.max_chunk_bytes,
                          max_snapshot_bytes=r.max_snapshot_bytes)

    @property
    def conditional_writes(self) -> bool:
        """Whether the server has generations and conditional Puts (the feature
        "conditional-put"): False for an older server, or one whose store cannot."""
        return CONDITIONAL_PUT in self.server_info().features

    @property
    def _chunk_bytes(self) -> int:
        return min(self.server_info().max_chunk_bytes or MAX_CHUNK_BYTES, MAX_CHUNK_BYTES)

    # --- put --------------------------------------------------------------------------

    def put(self, name: str, target: bytes | memoryview, draft: bytes | memoryview | None = None,
            target_meta: PartMeta | None = None, draft_meta: PartMeta | None = None, *,
            target_sha256: str | None = None, draft_sha256: str | None = None,
            deadline: float | None = None,
            expected_generation: int | None = None) -> PutResult:
        """Saves a snapshot: the target bytes and, with protocol 2, the draft sidecar,
        committed together. With protocol 1 the draft is skipped (`draft_skipped`).

        `target_sha256` / `draft_sha256`: the hex SHA-256 of the bytes when the caller
        already has it (the slot encoder computes the target's for the sidecar). Without
        it the bytes are hashed while they are sent when the server offers the
        "sha256-trailer" feature, before otherwise. The server verifies the digest
        either way (DataLoss if wrong). `deadline` (time.monotonic()): the whole save
        ends by then (DeadlineExceeded), whatever the per-call deadlines allow.

        `expected_generation`: commit only if the snapshot is at this generation now (0:
        only if there is none); GenerationConflict (name, expected, stored) otherwise,
        with nothing stored. Needs `conditional_writes` (FailedPrecondition, nothing
        sent, against a server without). `PutResult.generation` is the new one. A
        conflict that finds exactly this Put's bytes stored one generation on (its first
        attempt committed, the answer was lost and the retry found it) is a success."""
        validate_name(name)
        info = self.server_info(deadline)
        cond = conditional_header(name, expected_generation, info.features, self.addr)
        try:
            return self._put(name, target, draft, target_meta, draft_meta, info, cond,
                             target_sha256, draft_sha256, deadline)
        except GenerationConflict as exc:
            own = self._own_commit(exc, target, draft, info.protocol)
            if own is None:
                raise
            return own

    def _own_commit(self, exc: GenerationConflict, target: bytes | memoryview,
                    draft: bytes | memoryview | None, protocol: int) -> PutResult | None:
        """The stored snapshot when it is what this Put would have committed
        (`is_own_commit`); None: a real conflict."""
        if exc.stored != exc.expected + 1:
            return None
        try:
            snap = self.stat(exc.name)
        except SnapshotError:
            return None
        stored = (snap.generation, snap.target.sha256, snap.draft.sha256 if snap.draft else "")
        sent = (_sha256(target), _sha256(draft) if draft is not None and protocol >= 2 else "")
        if not is_own_commit(exc, stored, sent):
            return None
        return PutResult(exc.name, snap.commit_id, protocol, snap.target, snap.draft,
                         generation=snap.generation)

    def _put(self, name: str, target: bytes | memoryview, draft: bytes | memoryview | None,
             target_meta: PartMeta | None, draft_meta: PartMeta | None, info: ServerInfo,
             cond: dict[str, int] | None, target_sha256: str | None,
             draft_sha256: str | None, deadline: float | None) -> PutResult:
        target_meta = target_meta or PartMeta()
        trailer = "sha256-trailer" in info.features

        def digest_of(data: bytes | memoryview, given: str | None) -> str | None:
            return given.lower() if given else (None if trailer else _sha256(data))

        t_sha = digest_of(target, target_sha256)
        if draft is None or info.protocol < 2:
            skipped = draft is not None
            r = self._put_part(name, Part.TARGET, target, t_sha, target_meta, deadline=deadline,
                               cond=cond)
            t_info = PartInfo(Part.TARGET, r.bytes, r.sha256, target_meta)
            note = (f"draft not saved: the snapshot service speaks protocol {info.protocol} "
                    "(target files only)" if skipped else "")
            return PutResult(name, r.commit_id, info.protocol, t_info, None, skipped, note,
                             r.generation)
        draft_meta = draft_meta or PartMeta()
        d_sha = digest_of(draft, draft_sha256)
        for attempt in range(2):
            t_sha = self._put_part(name, Part.TARGET, target, t_sha, target_meta,
                                   draft_follows=True, deadline=deadline, cond=cond).sha256
            try:
                r = self._put_part(name, Part.DRAFT, draft, d_sha, draft_meta,
                                   target_sha256=t_sha, deadline=deadline, cond=cond)
                break
            except FailedPrecondition:
                if attempt:  # the staged target was lost (server restarted): save again once
                    raise
        t_info = PartInfo(Part.TARGET, len(target), t_sha, target_meta)
        d_info = PartInfo(Part.DRAFT, r.bytes, r.sha256, draft_meta, target_sha256=t_sha)
        return PutResult(name, r.commit_id, info.protocol, t_info, d_info,
                         generation=r.generation)

    def _put_part(self, name: str, part: Part, data: bytes | memoryview, sha: str | None,
                  meta: PartMeta,
                  *, draft_follows: bool = False, target_sha256: str = "",
                  deadline: float | None = None, cond: dict[str, int] | None = None
                  ) -> pb.PutResponse:
        """One part. `sha` None: hashed while sent, the digest goes in the trailer
        (the server must offer "sha256-trailer"). `cond`: the header's
        expected_generation, when conditional."""
        limit = self.server_info().max_snapshot_bytes
        if limit and len(data) > limit:
            raise ResourceExhausted(f"{part.label} of {name!r} is {len(data)} bytes, the "
                                    f"server's limit is {limit}")
        header = pb.PutHeader(name=name, part=int(part), size=len(data), sha256=sha or "",
                              format_version=meta.format_version, fingerprint=meta.fingerprint,
                              n_tokens=meta.n_tokens, draft_follows=draft_follows,
                              target_sha256=target_sha256, **(cond or {}))
        chunk = self._chunk_bytes
        sent: list[str] = []  # the trailer's digest, of the attempt that answered last

        def requests() -> Iterator[pb.PutRequest | memoryview]:
            yield pb.PutRequest(header=header)
            view = memoryview(data)
            if sha is not None:
                for off in range(0, len(view), chunk):
                    yield view[off:off + chunk]  # framed as PutRequest{chunk} by wire.py
                return
            with StreamDigest() as digest:  # hashes on a helper thread as chunks go out
                for off in range(0, len(view), chunk):
                    digest.update(view[off:off + chunk])
                    yield view[off:off + chunk]
                sent.append(digest.hexdigest())
            yield pb.PutRequest(trailer=pb.PutTrailer(sha256=sent[-1]))

        try:
            r = self._call(lambda t: _put_within(self._stub, requests(), t), size=len(data),
                           deadline=deadline, name=name)
        except InvalidArgument:
            if sha is not None:
                raise
            # the server behind this channel was replaced by one without the trailer
            # (it refuses the empty sha256 in the header): once more, digest first
            return self._put_part(name, part, data, _sha256(data), meta,
                                  draft_follows=draft_follows, target_sha256=target_sha256,
                                  deadline=deadline, cond=cond)
        want = sha if sha is not None else (sent[-1] if sent else "")
        if r.bytes != len(data) or r.sha256 != want:
            raise DataLoss(f"the server stored {r.bytes} bytes ({r.sha256}) of {name!r}, "
                           f"sent {len(data)} ({want})")
        return r

    # --- get --------------------------------------------------------------------------

    def get(self, name: str, *, with_draft: bool = True, digest_tail: int = 0,
            deadline: float | None = None) -> Snapshot:
        """The exact bytes of a snapshot's target and, when one belongs to it, its draft.

        The draft returned always belongs to the target returned; when a newer save
        replaces the snapshot between the two reads, both are read again.

        `digest_tail`: also compute, in the same pass, the SHA-256 of the target without
        its last `digest_tail` bytes (`Snapshot.target_prefix_sha256`): a format that
        ends with a digest of the rest (slot files do) is checked without hashing twice.

        `deadline` (time.monotonic()): the whole read ends by then (DeadlineExceeded)."""
        validate_name(name)
        if digest_tail < 0:
            raise ValueError(f"digest_tail must be >= 0, got {digest_tail}")
        protocol = self.server_info(deadline).protocol
        for _ in range(3):
            target, th, prefix_sha = self._get_part(name, Part.TARGET, tail=digest_tail,
                                                    deadline=deadline)
            t_info = PartInfo.from_pb(th.info)
            snap = SnapshotInfo(th.name, th.commit_id, th.created_unix_ms, t_info,
                                generation=th.generation)
            if protocol < 2 or not with_draft or not th.draft_sha256:
                note = ("protocol 1: drafts are not supported" if protocol < 2
                        else "draft not requested" if not with_draft else "no draft stored")
                return Snapshot(name, target, None, snap, protocol, note,
                                target_prefix_sha256=prefix_sha)
            try:
                draft, dh, _ = self._get_part(name, Part.DRAFT, target_sha256=t_info.sha256,
                                              deadline=deadline)
            except NotFound:
                continue  # replaced by a newer save between the two reads: read both again
            snap = SnapshotInfo(th.name, th.commit_id, th.created_unix_ms, t_info,
                                PartInfo.from_pb(dh.info), generation=th.generation)
            return Snapshot(name, target, draft, snap, protocol,
                            target_prefix_sha256=prefix_sha)
        return Snapshot(name, target, None, snap, protocol,
                        "the snapshot kept changing while it was read; draft left out",
                        target_prefix_sha256=prefix_sha)

    def get_part(self, name: str, part: Part, *,
                 target_sha256: str = "") -> tuple[memoryview, PartInfo]:
        """One part's verified bytes and info (for a draft, optionally only if it belongs
        to the target whose digest is `target_sha256`)."""
        validate_name(name)
        if part is Part.DRAFT and self.protocol < 2:
            raise FailedPrecondition("drafts need protocol 2; the server speaks protocol 1")
        data, header, _ = self._get_part(name, part, target_sha256=target_sha256)
        return data, PartInfo.from_pb(header.info)

    def _get_part(self, name: str, part: Part, *, target_sha256: str = "",
                  tail: int = 0, deadline: float | None = None
                  ) -> tuple[memoryview, pb.GetHeader, str]:
        """(the verified bytes, the header, the SHA-256 of all but the last `tail` bytes
        or "" when tail is 0 or more than the part's size).

        The size is known only once the header arrives, so the gRPC deadline allows for
        the largest snapshot; a watchdog holds the call to `timeout` until the header
        and to `timeout` + its real size / `min_rate` after it."""
        info = self.server_info(deadline)
        # this client checks every part's digest (below); at protocol 2 it says so and
        # the server does not hash the part a second time
        req = pb.GetRequest(name=name, part=int(part), target_sha256=target_sha256,
                            client_checks_sha256=info.protocol >= 2)
        size_bound = info.max_snapshot_bytes or DEFAULT_MAX_SNAPSHOT_BYTES

        def fetch(timeout: float) -> tuple[memoryview, pb.GetHeader, str]:
            start = time.monotonic()
            end = start + timeout  # the gRPC deadline (already cut to `deadline`)
            stream = self._stub.Get(req, timeout=timeout)
            watch = _Watchdog(stream, min(start + self.timeout, end))
            try:
                return receive(stream, start, end, watch)
            except grpc.RpcError:
                if watch.fired:
                    raise DeadlineExceeded(
                        f"Get of {name!r}: no complete answer within "
                        f"{time.monotonic() - start:.3g} s") from None
                raise
            finally:
                watch.stop()

        def receive(stream: Any, start: float, end: float,
                    watch: _Watchdog) -> tuple[memoryview, pb.GetHeader, str]:
            header: pb.GetHeader | None = None
            sink: _PartSink | None = None
            try:
                for msg in stream:  # chunks arrive as memoryviews (wire.py)
                    if sink is not None:
                        chunk = msg if isinstance(msg, memoryview) else msg.chunk
                        if not sink.add(chunk):
                            stream.cancel()
                            raise DataLoss(f"Get of {name!r}: more than the "
                                           f"{sink.size} bytes announced")
                        continue
                    if isinstance(msg, memoryview) or msg.WhichOneof("msg") != "header":
                        raise DataLoss(f"Get of {name!r}: the stream did not start with a "
                                       "header")
                    header = msg.header
                    watch.move(min(start + self.timeout + header.info.size / self.min_rate,
                                   end))
                    if header.info.size > size_bound:
                        stream.cancel()
                        raise DataLoss(f"Get of {name!r}: the header announces "
                                       f"{header.info.size} bytes, more than the "
                                       f"{size_bound} a snapshot may have")
                    try:
                        sink = _PartSink(header.info.size, tail)
                    except MemoryError:
                        stream.cancel()
                        raise ResourceExhausted(
                            f"Get of {name!r}: cannot allocate {header.info.size} bytes to "
                            "receive it") from None
                if header is None or sink is None:
                    raise DataLoss(f"Get of {name!r}: empty stream")
                data, received, sha, prefix_sha = sink.finish()
            finally:
                if sink is not None:
                    sink.close()
            if received != header.info.size:
                raise DataLoss(f"{part.label} of {name!r} truncated: received {received} of "
                               f"{header.info.size} bytes")
            if sha != header.info.sha256:
                raise DataLoss(f"{part.label} of {name!r}: SHA-256 mismatch")
            return data, header, prefix_sha

        return self._call(fetch, size=size_bound, deadline=deadline)

    # --- metadata ---------------------------------------------------------------------

    def stat(self, name: str, deadline: float | None = None) -> SnapshotInfo:
        """Metadata of both parts of one snapshot and its generation (0 from a server
        without `conditional_writes`); NotFound if there is none. `deadline`
        (time.monotonic()): the call and its retries end by then."""
        validate_name(name)
        r = self._call(lambda t: self._stub.Stat(pb.StatRequest(name=name), timeout=t),
                       deadline=deadline)
        return SnapshotInfo.from_pb(r.snapshot)

    def list(self, prefix: str = "") -> list[SnapshotInfo]:
        """Every snapshot whose name starts with `prefix`, sorted by name."""
        r = self._call(lambda t: self._stub.List(pb.ListRequest(prefix=prefix), timeout=t))
        return [SnapshotInfo.from_pb(s) for s in r.snapshots]

    def delete(self, name: str, deadline: float | None = None) -> int:
        """Removes both parts of a snapshot (NotFound if there is none); the bytes freed.
        `deadline` (time.monotonic()): the call and its retries end by then."""
        validate_name(name)
        r = self._call(lambda t: self._stub.Delete(pb.DeleteRequest(name=name), timeout=t),
                       deadline=deadline)
        return r.bytes_freed


__all__ = ["SnapshotClient", "PartMeta", "Part", "SnapshotError", "InvalidArgument",
           "GenerationConflict"]
