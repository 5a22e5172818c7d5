"""The slot store over the snapshot service (`--snapshot-addr HOST:PORT`).

    store = SnapshotStore("127.0.0.1:50052", timeout=30.0)
    n = store.save("chat-42", enc.target, enc.draft)     # bytes stored
    slot = store.load("chat-42")                          # StoredSlot(target, draft, note)
    store.close()

It implements `inference_svc.storage.store.SlotStore` over `snapshot_svc.client.SnapshotClient`:

- The bytes are stored verbatim, so a target file is the same whichever store holds
  it. Each part is sent with the metadata the service records (format version,
  model fingerprint, token count), read from the file's fixed header.
- Target and draft of one save are committed together (protocol 2). With a
  protocol-1 peer (a server started with `--max-protocol 1`, a server without
  `Hello`, or `max_protocol=1` here) only the target is stored, one warning per
  store says so, and `load` returns no draft: the restore applies its draft policy.
- Errors are the inference service's own (`inference_svc.errors`), the same types
  `LocalStore` raises for the same situations: NotFound, InvalidArgument (bad name),
  ResourceExhausted (too big, disk full), DataLoss, Unavailable (unreachable,
  shutting down, or no answer within the deadline), FailedPrecondition (no common
  protocol version).
- Every call has a deadline (`timeout` seconds, plus the transfer time at
  `min_rate` bytes/s) and is retried with backoff on UNAVAILABLE only (`retries`
  times); both are the client's.
"""

from __future__ import annotations

import functools
import logging
import threading

import grpc

from inference_svc import errors, log
from inference_svc.storage import slotfile
from inference_svc.storage.names import validate_name
from inference_svc.storage.store import Buffer, StoredInfo, StoredSlot
from snapshot_svc.client import SnapshotClient
from snapshot_svc.client.contract import PROTOCOL_MAX, PROTOCOL_MIN
from snapshot_svc.client.records import PartMeta
from snapshot_svc.clientlib import errors as snap_errors

# snapshot service error -> the inference service's error for the same situation
_ERRORS: tuple[tuple[type[snap_errors.StatusError], type[errors.ServiceError]], ...] = (
    (snap_errors.NotFound, errors.NotFound),
    (snap_errors.InvalidArgument, errors.InvalidArgument),
    (snap_errors.ResourceExhausted, errors.ResourceExhausted),
    (snap_errors.DataLoss, errors.DataLoss),
    (snap_errors.FailedPrecondition, errors.FailedPrecondition),
    (snap_errors.Unavailable, errors.Unavailable),
    (snap_errors.Cancelled, errors.Cancelled),
)
MAX_RETIRED = 4  # replaced clients kept open for their calls in flight
# failures that are no answer from the service (it may be the same one, busy or down)
_NO_ANSWER = (snap_errors.Unavailable, snap_errors.DeadlineExceeded, snap_errors.Cancelled)
# a draft that cannot be read costs the draft only (the target is fetched alone)
_DRAFT_ONLY_ERRORS = (snap_errors.DataLoss, snap_errors.FailedPrecondition,
                      snap_errors.Internal)


def part_meta(data: bytes | memoryview) -> PartMeta:
    """What the snapshot service records about a slot file, from its fixed header
    (unverified). Bytes that are not a slot file get empty metadata: the store
    keeps bytes, it does not judge them (restore does)."""
    try:
        m = slotfile.read_meta(data)
    except slotfile.SlotFileError:
        return PartMeta()
    return PartMeta(format_version=m.version, fingerprint=m.fingerprint, n_tokens=m.n_tokens)


class SnapshotStore:
    """A `SlotStore` on a snapshot service. Thread-safe. See the module docstring.

    addr:         "host:port" of the snapshot service (`--snapshot-addr`).
    timeout:      deadline of each call in seconds (`--snapshot-timeout`); transfers
                  get size / min_rate more.
    max_protocol: 2 (target + draft) or 1 (behave as a protocol-1 peer, never send
                  or fetch drafts; `--snapshot-client-max-protocol`).
    retries, backoff: retries of an UNAVAILABLE call, and the first backoff in seconds
                  (doubling up to 2 s); with the defaults a call waits about 3 s for a
                  restarting service before it raises Unavailable.
    min_rate:     slowest transfer rate in bytes/s the deadlines allow for.
    logger:       where the one protocol-1 warning goes (default: the service's logger).
    credentials, api_key: TLS and the key of the snapshot client (SnapshotClient).
    """

    def __init__(self, addr: str, *, timeout: float = 30.0, max_protocol: int = PROTOCOL_MAX,
                 retries: int = 5, backoff: float = 0.1, min_rate: float = 32 << 20,
                 logger: logging.Logger | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 api_key: str | None = None) -> None:
        if not addr or ":" not in addr:
            raise ValueError(f"snapshot service address {addr!r} is not HOST:PORT")
        if timeout <= 0:
            raise ValueError(f"snapshot timeout must be positive, got {timeout}")
        if not PROTOCOL_MIN <= max_protocol <= PROTOCOL_MAX:
            raise ValueError(f"snapshot max protocol must be in {PROTOCOL_MIN}..{PROTOCOL_MAX}, "
                             f"got {max_protocol}")
        self.addr, self.timeout, self.max_protocol = addr, timeout, max_protocol
        # a client on a new channel (each says Hello on its first call)
        self._new_client = functools.partial(
            SnapshotClient, addr, max_protocol=max_protocol, timeout=timeout, retries=retries,
            backoff=backoff, min_rate=min_rate, credentials=credentials, api_key=api_key)
        self.log = logger or log.get()
        self._lock = threading.Lock()
        self._client = self._new_client()
        self._retired: list[SnapshotClient] = []  # replaced after a downgrade; closed last
        self._protocol: int | None = None  # as of the last call that reached the service
        self._warned = False
        self._closed = False

    # --- SlotStore --------------------------------------------------------------------

    def describe(self) -> str:
        return f"snapshot:{self.addr}"

    @property
    def negotiated_protocol(self) -> int | None:
        """The protocol of the last save or load (1: target files only), None before
        the first one; never calls the service (for GetInfo)."""
        return self._protocol

    def save(self, name: str, target: Buffer, draft: Buffer | None, *,
             target_sha256: str | None = None, deadline: float | None = None) -> int:
        """Stores both files as one save; returns the bytes stored (the target's alone
        when a protocol-1 peer left the draft out). Without a draft, any draft of an
        earlier save under the name is dropped. `target_sha256`: the target's hex
        SHA-256 when the caller has it (EncodedSlot.target_sha256), saves hashing it.
        `deadline` (time.monotonic()): the save ends by then (Unavailable)."""
        validate_name(name)
        client = self._current()
        t_meta = part_meta(target)
        d_meta = part_meta(draft) if draft is not None else None
        try:
            try:
                res = client.put(name, target, draft, t_meta, d_meta,
                                 target_sha256=target_sha256, deadline=deadline)
            except snap_errors.StatusError as exc:
                if draft is None:
                    raise
                client = self._renegotiated(client, exc, deadline)
                res = client.put(name, target, draft, t_meta, d_meta,
                                 target_sha256=target_sha256, deadline=deadline)
        except snap_errors.StatusError as exc:
            raise self._error(exc, name, "save") from exc
        self._protocol = res.protocol
        if res.draft_skipped:
            self._warn_protocol_1(client)
        return res.target.size + (res.draft.size if res.draft is not None else 0)

    def conditional(self) -> bool:
        """Whether the snapshot service has generations and conditional Puts (its Hello
        names the feature; asked once per connection)."""
        try:
            return self._current().conditional_writes
        except snap_errors.StatusError as exc:
            raise self._error(exc, "*", "ask for the features of") from exc

    def generation(self, name: str, *, deadline: float | None = None) -> int:
        """The snapshot's generation by Stat, 0 when there is none."""
        validate_name(name)
        try:
            return self._current().stat(name, deadline=deadline).generation
        except snap_errors.NotFound:
            return 0
        except snap_errors.StatusError as exc:
            raise self._error(exc, name, "stat") from exc

    def save_if(self, name: str, target: Buffer, draft: Buffer | None, expected: int, *,
                target_sha256: str | None = None, deadline: float | None = None) -> int:
        """A conditional Put; the new generation. GenerationConflict as it comes."""
        validate_name(name)
        client = self._current()
        try:
            res = client.put(name, target, draft, part_meta(target),
                             part_meta(draft) if draft is not None else None,
                             target_sha256=target_sha256, deadline=deadline,
                             expected_generation=expected)
        except snap_errors.GenerationConflict:
            raise
        except snap_errors.StatusError as exc:
            raise self._error(exc, name, "save") from exc
        self._protocol = res.protocol
        return res.generation

    def load(self, name: str, *, deadline: float | None = None) -> StoredSlot:
        """The stored bytes. A draft that cannot be read (corrupt, or a protocol-1
        peer) leaves draft None with the reason in draft_note; NotFound when there is
        no snapshot of that name. `deadline` (time.monotonic()): the load ends by then
        (Unavailable)."""
        validate_name(name)
        client = self._current()
        try:
            try:
                snap = client.get(name, digest_tail=slotfile.DIGEST_LEN, deadline=deadline)
                note = snap.draft_note
            except _DRAFT_ONLY_ERRORS as exc:
                # the target alone may still be good: fetch it without the draft
                snap = client.get(name, with_draft=False, digest_tail=slotfile.DIGEST_LEN,
                                  deadline=deadline)
                note = f"cannot read the draft sidecar: {exc.message}"
        except snap_errors.StatusError as exc:
            raise self._error(exc, name, "load") from exc
        self._protocol = snap.protocol
        if snap.protocol < 2:
            self._warn_protocol_1(client)
            note = f"no draft: {self._protocol_1_reason(client)}"
        return StoredSlot(snap.target, snap.draft, note if snap.draft is None else "",
                          target_sha256=snap.info.target.sha256,  # verified by the Get
                          target_body_sha256=snap.target_prefix_sha256 or None,
                          generation=snap.info.generation)

    def delete(self, name: str, *, deadline: float | None = None) -> bool:
        """Removes the snapshot (both parts); False when there was none. `deadline`
        (time.monotonic()): the call ends by then."""
        validate_name(name)
        client = self._current()
        try:
            client.delete(name, deadline)
        except snap_errors.NotFound:
            return False
        except snap_errors.StatusError as exc:
            raise self._error(exc, name, "delete") from exc
        return True

    def list(self, prefix: str) -> list[StoredInfo]:
        """The service's List of names starting with `prefix`, with the token count the
        service recorded for each target (bounded by the client's timeout and retries)."""
        client = self._current()
        try:
            infos = client.list(prefix)
        except snap_errors.StatusError as exc:
            raise self._error(exc, prefix + "*", "list") from exc
        return [StoredInfo(i.name, i.target.meta.n_tokens, i.created_unix_ms) for i in infos]

    # --- lifecycle --------------------------------------------------------------------

    def close(self) -> None:
        """Closes the connection; calls in flight fail (Unavailable or Cancelled)."""
        with self._lock:
            self._closed = True
            clients = [self._client, *self._retired]
            self._retired.clear()
        for c in clients:
            c.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals --------------------------------------------------------------------

    def _current(self) -> SnapshotClient:
        with self._lock:
            if self._closed:
                raise errors.Unavailable(f"the snapshot store for {self.addr} is closed")
            return self._client

    def _renegotiate(self, old: SnapshotClient) -> SnapshotClient:
        """A client on a new channel (a new Hello), unless another thread made one."""
        with self._lock:
            if self._closed:
                raise errors.Unavailable(f"the snapshot store for {self.addr} is closed")
            if self._client is old:
                self._retired.append(old)  # calls in flight on it may still finish
                self._client = self._new_client()
            stale = self._retired[:-MAX_RETIRED]
            del self._retired[:-MAX_RETIRED]
            client = self._client
        for c in stale:  # long replaced: nothing runs on them any more
            c.close()
        return client

    def _renegotiated(self, client: SnapshotClient, refusal: snap_errors.StatusError,
                      deadline: float | None) -> SnapshotClient:
        """After a paired save was refused: the service behind the address may have been
        replaced by one that no longer speaks the negotiated protocol, and its refusal
        can carry any status code (FAILED_PRECONDITION from a protocol-1 server of ours,
        INVALID_ARGUMENT "unknown part" or a digest mismatch from older ones). A new
        channel says Hello again; the refusal is raised unless the protocol changed.
        No answer at all (unreachable, deadline) is not a refusal: it is raised."""
        if isinstance(refusal, _NO_ANSWER):
            raise refusal
        new = self._renegotiate(client)
        if new.server_info(deadline).protocol == client.protocol:
            raise refusal
        return new

    def _protocol_1_reason(self, client: SnapshotClient) -> str:
        if self.max_protocol < 2:
            return ("this service is configured with --snapshot-client-max-protocol 1 "
                    "(snapshot protocol 1: target files only)")
        info = client.server_info()  # known by now: no call
        if not info.hello_supported:
            return (f"the snapshot service at {self.addr} answers Hello with UNIMPLEMENTED "
                    "(protocol 1: target files only)")
        return f"the snapshot service at {self.addr} speaks protocol 1 (target files only)"

    def _warn_protocol_1(self, client: SnapshotClient) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        reason = self._protocol_1_reason(client)
        self.log.warning(
            f"drafts are not saved or restored: {reason}; restored slots rebuild their "
            "draft by the draft restore policy", extra=log.fields(
                snapshot_addr=self.addr, snapshot_protocol=1))

    def _error(self, exc: snap_errors.StatusError, name: str,
               op: str) -> errors.ServiceError:
        """The inference service's error for a failed snapshot call."""
        if isinstance(exc, snap_errors.NotFound):
            return errors.NotFound(f"no slot file {name!r} in the snapshot service at "
                                   f"{self.addr}")
        where = f"snapshot service at {self.addr}"
        for snap_cls, cls in _ERRORS:
            if isinstance(exc, snap_cls):
                return cls(f"cannot {op} {name!r}: {where}: {exc.message}")
        if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return errors.Unavailable(f"cannot {op} {name!r}: the {where} did not answer "
                                      f"within the deadline ({self.timeout:g} s and the "
                                      f"transfer time): {exc.message}")
        return errors.Internal(f"cannot {op} {name!r}: {where}: {exc.code.name}: "
                               f"{exc.message}")
