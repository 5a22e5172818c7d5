"""The gRPC server: thin handlers over the Store, one interceptor for status codes.

    python -m snapshot_svc --data-dir DIR [--host 127.0.0.1] [--port 50052] ...

In-process (tests, tools):

    with SnapshotServer(SnapshotConfig(data_dir=d, port=0)) as srv:
        SnapshotClient(srv.address) ...
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import AbstractContextManager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from snapshot_svc import limits, tenants
from snapshot_svc.backend import Backend, UploadHeader, check_generation, claimed_target
from snapshot_svc.client.contract import MAX_CHUNK_BYTES, PROTOCOL_MIN, VERSION
from snapshot_svc.client.digest import StreamDigest
from snapshot_svc.client.records import Part, PartInfo, PartMeta, SnapshotInfo
from snapshot_svc.client.wire import SERVICE_NAME, add_snapshot_servicer
from snapshot_svc.clientlib import auth, metrics_http, tls
from snapshot_svc.clientlib.generations import CONDITIONAL_PUT
from snapshot_svc.clientlib.interceptor import StatusInterceptor
from snapshot_svc.config import SnapshotConfig, parse_config
from snapshot_svc.errors import (
    Cancelled,
    DataLoss,
    FailedPrecondition,
    GenerationConflict,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SnapshotError,
    Unavailable,
)
from snapshot_svc.logs import configure_logging, log_event
from snapshot_svc.metrics import Metrics
from snapshot_svc.pb import snapshot_pb2 as pb
from snapshot_svc.pb import snapshot_pb2_grpc as pb_grpc
from snapshot_svc.storage import Store

log = logging.getLogger("snapshot_svc.server")

STREAM_WAIT_MARGIN_S = 0.5  # a call waiting for a stream gives up this long before its deadline

FEATURES_V1 = ("sha256",)
# "sha256-trailer": a Put may leave the header's sha256 empty and end with a PutTrailer
# (the client hashes while sending). Not offered at --max-protocol 1, whose servers
# predate it.
FEATURES_V2 = ("draft-sidecar", "paired-commit", "sha256-trailer")
# CONDITIONAL_PUT ("conditional-put"): generations, and Puts conditional on one
# (PutHeader.expected_generation); offered at protocol 2 by a server whose store
# honours conditional writes


def server_features(protocol: int, conditional: bool = True) -> tuple[str, ...]:
    if protocol < 2:
        return FEATURES_V1
    return FEATURES_V1 + FEATURES_V2 + ((CONDITIONAL_PUT,) if conditional else ())


def negotiate(client_min: int, client_max: int, server_max: int) -> int:
    """The highest protocol both sides speak; FAILED_PRECONDITION when none."""
    client_min = client_min or PROTOCOL_MIN
    client_max = client_max or client_min
    if client_min > client_max:
        raise InvalidArgument(f"min_protocol {client_min} > max_protocol {client_max}")
    chosen = min(client_max, server_max)
    if chosen < max(client_min, PROTOCOL_MIN):
        raise FailedPrecondition(
            f"no common protocol version: the client speaks {client_min}..{client_max}, "
            f"the server speaks {PROTOCOL_MIN}..{server_max}")
    return chosen


class SnapshotServicer(pb_grpc.SnapshotServicer):
    """The Snapshot RPCs over a storage backend. Errors are raised as SnapshotError."""

    def __init__(self, config: SnapshotConfig, store: Backend, metrics: Metrics) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        # a caller's running and waiting streams together stay below the handler threads
        self.streams = limits.StreamLimit(
            config.max_streams_per_key, max_waiting=min(
                config.max_streams_per_key, config.workers - 1 - config.max_streams_per_key))

    @property
    def drafts(self) -> bool:
        return self.config.max_protocol >= 2

    @property
    def generations(self) -> bool:
        """Generations reported and expected generations honoured (a --max-protocol 1
        server behaves as an old one: neither)."""
        return self.config.max_protocol >= 2

    def _stream(self, context: grpc.ServicerContext) -> AbstractContextManager[None]:
        """A place among the caller's streams (its key's, else its host's), waited for
        at most --stream-wait seconds and never past the call's deadline."""
        wait = self.config.stream_wait_s
        left = context.time_remaining()
        if left is not None:
            wait = min(wait, left - STREAM_WAIT_MARGIN_S)
        return self.streams.hold(auth.CURRENT.get(), peer=context.peer(), wait_s=wait)

    def _part(self, value: int) -> Part:
        if value == pb.PART_TARGET:
            return Part.TARGET
        if value == pb.PART_DRAFT:
            if not self.drafts:
                raise FailedPrecondition("draft parts need protocol 2; this server speaks "
                                         f"protocol {self.config.max_protocol}")
            return Part.DRAFT
        raise InvalidArgument(f"part must be PART_TARGET or PART_DRAFT, got {value}")

    def _visible(self, snap: SnapshotInfo) -> SnapshotInfo:
        return snap if self.drafts else dataclasses.replace(snap.without_draft(), generation=0)

    def Hello(self, request: pb.HelloRequest, context: grpc.ServicerContext) -> pb.HelloResponse:
        protocol = negotiate(request.min_protocol, request.max_protocol, self.config.max_protocol)
        offered = server_features(protocol, self.store.conditional_writes)
        features = [f for f in offered if f in set(request.features)]
        log_event(log, logging.INFO, "hello", peer=context.peer(), protocol=protocol,
                  client_min=request.min_protocol, client_max=request.max_protocol,
                  client_version=request.client_version)
        return pb.HelloResponse(protocol=protocol, features=features, server_version=VERSION,
                                max_chunk_bytes=MAX_CHUNK_BYTES,
                                max_snapshot_bytes=self.config.max_snapshot_bytes,
                                server_min_protocol=PROTOCOL_MIN,
                                server_max_protocol=self.config.max_protocol)

    def Put(self, request_iterator: Iterator[pb.PutRequest],
            context: grpc.ServicerContext) -> pb.PutResponse:
        with self._stream(context):
            return self._put(limits.until_idle(request_iterator,
                                               self.config.stream_idle_timeout_s, "Put"),
                             context)

    def _expected(self, h: pb.PutHeader) -> int:
        """The header's expected generation; FAILED_PRECONDITION when the store cannot
        honour it (an S3 store that ignores conditional writes)."""
        if not self.store.conditional_writes:
            raise FailedPrecondition(f"conditional Put of {h.name!r}: the store "
                                     f"{self.store.describe()} ignores conditional writes")
        return h.expected_generation

    def _check_generation(self, header: UploadHeader) -> None:
        """The early check of a conditional Put (the commit checks again, atomically):
        a Put that would lose is refused before its data is sent."""
        try:
            current: SnapshotInfo | None = self.store.stat(header.name)
        except NotFound:
            current = None
        try:
            check_generation(header, current)
        except GenerationConflict as exc:
            raise GenerationConflict(tenants.caller_name(auth.CURRENT.get(), header.name)
                                     or header.name, exc.expected, exc.stored) from None

    def _check_quota(self, stored: str, size: int) -> None:
        """RESOURCE_EXHAUSTED when a namespaced key's Put of `size` bytes would take its
        namespace past --quota-bytes (what the name holds now is not counted)."""
        caller = auth.CURRENT.get()
        quota = self.config.quota_bytes
        if not quota or caller is None or caller.namespace is None or caller.is_admin:
            return
        used = sum(s.target.size + (s.draft.size if s.draft else 0)
                   for s in self.store.list(tenants.stored_prefix(caller, ""))
                   if s.name != stored)
        if used + size > quota:
            raise ResourceExhausted(f"namespace {caller.namespace!r} holds {used} bytes; "
                                    f"{size} more would pass its quota of {quota} bytes")

    def _put(self, request_iterator: Iterator[pb.PutRequest],
             context: grpc.ServicerContext) -> pb.PutResponse:
        t0 = time.perf_counter()
        label, code = "unknown", "OK"
        upload = None
        claimed: tuple[str, str] | None = None  # a draft's staged target, dropped on failure
        done = False
        try:
            first = next(request_iterator, None)
            if not isinstance(first, pb.PutRequest) or first.WhichOneof("msg") != "header":
                raise InvalidArgument("the first message of a Put must be its header")
            h = first.header
            part = self._part(h.part)
            label = part.label
            stored = tenants.stored_name(auth.CURRENT.get(), h.name)
            claimed = claimed_target(stored, part, h.target_sha256)
            header = self.store.check_header(
                stored, part, h.size, h.sha256,
                PartMeta(h.format_version, h.fingerprint, h.n_tokens),
                draft_follows=h.draft_follows and self.drafts,  # protocol 1: commit at once
                target_sha256=h.target_sha256, trailer=self.drafts)
            if h.HasField("expected_generation") and self.generations:
                header = dataclasses.replace(header, expected_generation=self._expected(h))
                self._check_generation(header)  # before a byte is received
            self._check_quota(header.name, h.size)
            upload = self.store.begin_put(header)
            trailer = None
            for msg in request_iterator:  # chunks arrive as memoryviews (wire.py)
                if trailer is not None:
                    raise InvalidArgument("the trailer must be the last message of the Put "
                                          f"of {header.name!r}")
                if isinstance(msg, memoryview):
                    chunk: memoryview | bytes = msg
                elif msg.WhichOneof("msg") == "chunk":
                    chunk = msg.chunk
                elif msg.WhichOneof("msg") == "trailer" and self.drafts:
                    trailer = msg.trailer.sha256
                    upload.expect_sha256(trailer)
                    continue
                else:
                    raise InvalidArgument("a Put carries one header, then only chunks"
                                          + (" and a trailer" if self.drafts else ""))
                if len(chunk) > MAX_CHUNK_BYTES:
                    raise InvalidArgument(f"chunk of {len(chunk)} bytes, the limit is "
                                          f"{MAX_CHUNK_BYTES}")
                upload.write(chunk)
            if not context.is_active():
                raise Cancelled("the client went away")
            spare = upload.overwrites_spare
            try:
                out = self.store.finish_put(upload)
            except GenerationConflict as exc:  # named as the caller names it
                raise GenerationConflict(h.name, exc.expected, exc.stored) from None
            upload = None
            done = True
            self.metrics.bytes_received.labels(label).inc(out.info.size)
            log_event(log, logging.INFO, "put", name=header.name, part=label,
                      bytes=out.info.size, sha256=out.info.sha256, commit_id=out.commit_id,
                      committed=out.committed, generation=out.generation, spare=spare,
                      ms=round((time.perf_counter() - t0) * 1e3, 2))
            return pb.PutResponse(name=h.name, part=int(part), bytes=out.info.size,
                                  sha256=out.info.sha256, commit_id=out.commit_id,
                                  committed=out.committed, has_draft=out.has_draft,
                                  generation=out.generation if self.generations else 0)
        except SnapshotError as exc:
            code = exc.code.name if context.is_active() else "CANCELLED"
            if isinstance(exc, DataLoss) and context.is_active():
                self.metrics.digest_failures.inc()
            raise
        except grpc.RpcError:
            code = "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            if upload is not None:
                upload.abort()
            if not done and claimed is not None:
                # the paired save failed, whatever the reason (its header refused too):
                # its staged target goes now, not at its expiry
                self.store.drop_staged(*claimed)
            self.metrics.puts.labels(label, code).inc()
            self.metrics.put_seconds.labels(label).observe(time.perf_counter() - t0)

    def Get(self, request: pb.GetRequest,
            context: grpc.ServicerContext) -> Iterator[pb.GetResponse | bytes]:
        with self._stream(context):
            yield from self._get(request, context)

    def _get(self, request: pb.GetRequest,
             context: grpc.ServicerContext) -> Iterator[pb.GetResponse | bytes]:
        t0 = time.perf_counter()
        label, code = "unknown", "OK"
        digest: StreamDigest | None = None
        try:
            part = self._part(request.part)
            label = part.label
            snap, reader = self.store.open_part(
                tenants.stored_name(auth.CURRENT.get(), request.name), part,
                request.target_sha256)
            info = snap.part(part)
            assert info is not None
            # the digest is checked once end to end: by a client that says it checks,
            # else here (protocol 1 knows no such client)
            if not (request.client_checks_sha256 and self.drafts):
                digest = StreamDigest()
            try:
                draft_sha = snap.draft.sha256 if (part is Part.TARGET and snap.draft
                                                  and self.drafts) else ""
                yield pb.GetResponse(header=pb.GetHeader(
                    name=request.name, commit_id=snap.commit_id,
                    created_unix_ms=snap.created_unix_ms, info=info.to_pb(),
                    draft_sha256=draft_sha,
                    generation=snap.generation if self.generations else 0))
                remaining = info.size
                while remaining:
                    data = reader.read(min(MAX_CHUNK_BYTES, remaining))
                    if not data:
                        raise DataLoss(f"the stored {label} of {snap.name!r} is truncated")
                    remaining -= len(data)
                    if digest is not None:
                        digest.update(data)
                        if not remaining:  # before the last chunk: a mismatch sends none
                            self._check_stored(digest, info, snap.name)
                    yield data  # framed as GetResponse{chunk} by wire.py
            finally:
                reader.close()
            self.metrics.bytes_sent.labels(label).inc(info.size)
            log_event(log, logging.INFO, "get", name=snap.name, part=label, bytes=info.size,
                      commit_id=snap.commit_id, ms=round((time.perf_counter() - t0) * 1e3, 2))
        except SnapshotError as exc:
            code = exc.code.name
            raise
        except GeneratorExit:
            code = "CANCELLED"
            raise
        finally:
            if digest is not None:
                digest.close()
            self.metrics.gets.labels(label, code).inc()
            self.metrics.get_seconds.labels(label).observe(time.perf_counter() - t0)

    def _check_stored(self, digest: StreamDigest, info: PartInfo, name: str) -> None:
        """DATA_LOSS (counted) when the bytes read from the store are not the ones the
        manifest names."""
        got = digest.hexdigest()
        if got != info.sha256:
            self.metrics.digest_failures.inc()
            raise DataLoss(f"the stored {info.part.label} of {name!r}: SHA-256 mismatch "
                           f"(manifest {info.sha256}, stored bytes {got})")

    def Stat(self, request: pb.StatRequest, context: grpc.ServicerContext) -> pb.StatResponse:
        info = self._visible(self.store.stat(tenants.stored_name(auth.CURRENT.get(),
                                                                 request.name))).to_pb()
        info.name = request.name
        return pb.StatResponse(snapshot=info)

    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        caller = auth.CURRENT.get()
        out = []
        for s in self.store.list(tenants.stored_prefix(caller, request.prefix)):
            name = tenants.caller_name(caller, s.name)
            if name is not None:
                info = self._visible(s).to_pb()
                info.name = name
                out.append(info)
        return pb.ListResponse(snapshots=out)

    def Delete(self, request: pb.DeleteRequest,
               context: grpc.ServicerContext) -> pb.DeleteResponse:
        return pb.DeleteResponse(bytes_freed=self.store.delete(
            tenants.stored_name(auth.CURRENT.get(), request.name)))


def open_backend(config: SnapshotConfig) -> Backend:
    """The configured storage backend: the S3 bucket of `--store`, else the data dir."""
    if config.store:
        from snapshot_svc.s3store import S3Store  # boto3 is imported only when used

        return S3Store(config.store, endpoint=config.s3_endpoint, region=config.s3_region,
                       max_snapshot_bytes=config.max_snapshot_bytes,
                       stage_ttl_s=config.stage_ttl_s,
                       replica_id=config.replica_id or socket.gethostname(),
                       gc_grace_s=config.gc_grace_s, workers=config.workers)
    assert config.data_dir is not None
    return Store(config.data_dir, max_snapshot_bytes=config.max_snapshot_bytes,
                 stage_ttl_s=config.stage_ttl_s, spare_bytes=config.spare_bytes)


class SnapshotServer:
    """One snapshot service: store, gRPC server (with health and reflection) and
    the optional metrics endpoint. `start()` returns the bound port."""

    def __init__(self, config: SnapshotConfig) -> None:
        self.config = config
        self.port = 0
        self._draining = threading.Event()
        self._stopped = threading.Event()
        # before the store opens: a wrong key file (ValueError) leaves nothing open
        self._keys = (auth.KeyRing(config.api_keys, (auth.ADMIN,), namespaces=True)
                      if config.api_keys is not None else None)
        self.store = open_backend(config)
        self.metrics = Metrics(self.store.usage, self.store.spares)
        self.unary = limits.StreamLimit(config.max_unary_per_key, "unary calls running",
                                        "--max-unary-per-key")
        # calls beyond `workers` wait for a thread (they are not refused)
        self._executor = futures.ThreadPoolExecutor(max_workers=config.workers,
                                                    thread_name_prefix="snapshot-rpc")
        self._grpc = grpc.server(
            self._executor, interceptors=[StatusInterceptor(
                lambda method, code: self.metrics.rpcs.labels(method, code).inc(), log,
                self._gate, unary_limit=self.unary)],
            options=[("grpc.max_receive_message_length", MAX_CHUNK_BYTES + (64 << 10)),
                     ("grpc.so_reuseport", 0)])
        self.servicer = SnapshotServicer(config, self.store, self.metrics)
        add_snapshot_servicer(self.servicer, self._grpc)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc)
        self.metrics_port = 0
        self._metrics_stop: Callable[[], None] | None = None

    def _gate(self, method: str, context: grpc.ServicerContext) -> auth.Principal | None:
        if self._draining.is_set():
            raise Unavailable("the snapshot service is shutting down")
        # every known key may call every method; its namespace limits the names
        return self._keys.authenticate(context.invocation_metadata()) if self._keys else None

    def reload_keys(self) -> None:
        """Rereads the API key file (SIGHUP); a wrong file keeps the old keys."""
        if self._keys is not None:
            self._keys.reload_logged(log)

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self) -> int:
        try:
            addr = f"{self.config.host}:{self.config.port}"
            c = self.config
            if c.tls_cert is not None and c.tls_key is not None:
                self.port = self._grpc.add_secure_port(addr, tls.server_credentials(
                    c.tls_cert, c.tls_key, c.tls_client_ca))
            else:
                self.port = self._grpc.add_insecure_port(addr)
        except (RuntimeError, ValueError) as exc:
            self.store.close()
            raise Unavailable(f"cannot listen on {self.config.host}:{self.config.port}: "
                              f"{exc}") from exc
        c = self.config
        if c.metrics_port:
            self.metrics_port, self._metrics_stop = metrics_http.serve(
                self.metrics.registry, c.metrics_host, c.metrics_port, cert=c.tls_cert,
                key=c.tls_key, client_ca=c.tls_client_ca, keys=self._keys)
        self._grpc.start()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log_event(log, logging.INFO, "serving", host=self.config.host, port=self.port,
                  max_protocol=self.config.max_protocol,
                  max_snapshot_bytes=self.config.max_snapshot_bytes,
                  store=self.store.describe(), metrics_port=self.metrics_port,
                  version=VERSION, tls=self.config.tls_cert is not None,
                  mtls=self.config.tls_client_ca is not None,
                  api_keys=len(self._keys) if self._keys is not None else None)
        return self.port

    def stop(self, grace: float | None = None) -> None:
        """Graceful stop: NOT_SERVING, new calls UNAVAILABLE, in-flight calls get `grace`
        seconds to finish (an unfinished Put is discarded whole), then the store closes."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.config.grace_s if grace is None else grace
        log_event(log, logging.INFO, "shutting_down", grace_s=grace)
        # refuse new calls before health says NOT_SERVING: a client that sees the
        # health change must not get a call through afterwards
        self._draining.set()
        self.health.enter_graceful_shutdown()
        self._grpc.stop(grace).wait()
        self._executor.shutdown(wait=True)
        if self._metrics_stop is not None:
            self._metrics_stop()
        self.store.close()
        log_event(log, logging.INFO, "stopped")

    def __enter__(self) -> SnapshotServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=0)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log_event(log, logging.INFO, "signal", signal=signal.Signals(signum).name)
        stop.set()

    # before "serving" is logged: from then on a signal means a graceful stop
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server = SnapshotServer(config)
        server.start()
    except SnapshotError as exc:
        log_event(log, logging.ERROR, "start_failed", error=exc.message)
        return 1
    except ValueError as exc:  # an unreadable or wrong key file
        log_event(log, logging.ERROR, "start_failed", error=str(exc))
        return 1
    signal.signal(signal.SIGHUP, lambda signum, frame: server.reload_keys())
    while not stop.wait(0.5):
        pass
    server.stop()
    # stopped cleanly: a repeated signal during interpreter exit must not kill us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
