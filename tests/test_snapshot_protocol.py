"""Protocol negotiation between old and new peers, deadlines and retries.

`MinimalServer` stands for a protocol-1 server from before Hello existed: it
implements Put and Get only (plain generated protobuf classes, no chunk codec),
so Hello and everything else answer UNIMPLEMENTED.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from snapshot_svc.client import SnapshotClient
from snapshot_svc.client.records import Part
from snapshot_svc.config import SnapshotConfig
from snapshot_svc.errors import FailedPrecondition, NotFound, SnapshotError, Unavailable
from snapshot_svc.pb import snapshot_pb2 as pb
from snapshot_svc.pb import snapshot_pb2_grpc as pb_grpc
from snapshot_svc.server import SnapshotServer
from snapshot_svc.testing import free_port, running_server
from tests.snapkit import sha

pytestmark = pytest.mark.timeout(120)


class CallCounter(grpc.ServerInterceptor):
    """Counts every call by method name, implemented or not."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        self.calls[handler_call_details.method.rsplit("/", 1)[-1]] += 1
        return continuation(handler_call_details)


class MinimalServer:
    """Put and Get of target parts, in memory; nothing else (Hello: UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.store: dict[str, tuple[pb.PutHeader, bytes]] = {}
        self.parts_received: list[int] = []
        self.counter = CallCounter()
        self.server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[self.counter])
        handlers = {
            "Put": grpc.stream_unary_rpc_method_handler(
                self.put, request_deserializer=pb.PutRequest.FromString,
                response_serializer=pb.PutResponse.SerializeToString),
            "Get": grpc.unary_stream_rpc_method_handler(
                self.get, request_deserializer=pb.GetRequest.FromString,
                response_serializer=pb.GetResponse.SerializeToString),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("warmslot.snapshot.v1.Snapshot", handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    def put(self, requests: Iterator[pb.PutRequest],
            context: grpc.ServicerContext) -> pb.PutResponse:
        header = next(requests).header
        self.parts_received.append(header.part)
        if header.part != pb.PART_TARGET:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unknown part")
        data = b"".join(r.chunk for r in requests)
        if len(data) != header.size or sha(data) != header.sha256:
            context.abort(grpc.StatusCode.DATA_LOSS, "digest mismatch")
        self.store[header.name] = (header, data)
        return pb.PutResponse(name=header.name, part=header.part, bytes=len(data),
                              sha256=sha(data), commit_id=f"c{len(self.parts_received)}",
                              committed=True)

    def get(self, request: pb.GetRequest,
            context: grpc.ServicerContext) -> Iterator[pb.GetResponse]:
        if request.name == "slow":
            time.sleep(3)
        if request.name not in self.store or request.part != pb.PART_TARGET:
            context.abort(grpc.StatusCode.NOT_FOUND, "no such snapshot")
        h, data = self.store[request.name]
        info = pb.PartInfo(part=h.part, size=h.size, sha256=h.sha256,
                           format_version=h.format_version, fingerprint=h.fingerprint,
                           n_tokens=h.n_tokens)
        yield pb.GetResponse(header=pb.GetHeader(name=h.name, commit_id="c", info=info))
        for i in range(0, len(data), 1 << 20):
            yield pb.GetResponse(chunk=data[i:i + (1 << 20)])

    def __enter__(self) -> MinimalServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)


@pytest.fixture
def v2(tmp_path: Path) -> Iterator[SnapshotServer]:
    with running_server(tmp_path / "data") as srv:
        yield srv


@pytest.fixture
def v1(tmp_path: Path) -> Iterator[SnapshotServer]:
    with running_server(tmp_path / "data", max_protocol=1) as srv:
        yield srv


def rpc_count(srv: SnapshotServer, method: str, code: str = "OK") -> float:
    value = srv.metrics.registry.get_sample_value("warmslot_snapshot_rpcs_total",
                                                  {"method": method, "code": code})
    return value or 0.0


def raw_put(stub: pb_grpc.SnapshotStub, name: str, part: int, data: bytes,
            **header: Any) -> pb.PutResponse:
    h = pb.PutHeader(name=name, part=part, size=len(data), sha256=sha(data), **header)
    return stub.Put(iter([pb.PutRequest(header=h), pb.PutRequest(chunk=data)]), timeout=10)


def test_new_peers_speak_protocol_2(v2: SnapshotServer) -> None:
    with SnapshotClient(v2.address) as c:
        info = c.server_info()
        assert (info.protocol, info.hello_supported) == (2, True)
        assert info.features == ("sha256", "draft-sidecar", "paired-commit",
                                 "sha256-trailer", "conditional-put")
        assert c.conditional_writes
        assert (info.max_chunk_bytes, info.max_snapshot_bytes) == (1 << 20, 2 << 30)
        res = c.put("s", b"target", b"draft")
        assert res.draft is not None and not res.draft_skipped
        c.get("s")
        c.stat("s")
    assert rpc_count(v2, "Hello") == 1


def test_new_client_with_protocol_1_server(v1: SnapshotServer) -> None:
    with SnapshotClient(v1.address) as c:
        info = c.server_info()
        assert (c.protocol, info.features, info.hello_supported) == (1, ("sha256",), True)
        res = c.put("s", b"target-bytes", b"draft-bytes")
        assert res.protocol == 1 and res.draft_skipped and res.draft is None
        assert "protocol 1" in res.note
        assert res.target.size == 12 and res.target.sha256 == sha(b"target-bytes")
        got = c.get("s")
        assert got.target == b"target-bytes" and got.draft is None
        assert got.draft_note.startswith("protocol 1")
        assert c.stat("s").draft is None
        with pytest.raises(FailedPrecondition):
            c.get_part("s", Part.DRAFT)
    assert v1.metrics.registry.get_sample_value(
        "warmslot_snapshot_puts_total", {"part": "draft", "code": "OK"}) is None
    with grpc.insecure_channel(v1.address) as ch:
        stub = pb_grpc.SnapshotStub(ch)
        hello = stub.Hello(pb.HelloRequest(min_protocol=1, max_protocol=2), timeout=10)
        assert (hello.protocol, hello.server_max_protocol) == (1, 1)
        with pytest.raises(grpc.RpcError) as err:
            raw_put(stub, "s", pb.PART_DRAFT, b"d", target_sha256=sha(b"target-bytes"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Get(pb.GetRequest(name="s", part=pb.PART_DRAFT), timeout=10))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # like an old server, a protocol-1 server commits a target at once
        r = raw_put(stub, "s", pb.PART_TARGET, b"t2", draft_follows=True)
        assert r.committed
    assert v1.store.stat("s").target.sha256 == sha(b"t2")


def test_protocol_1_server_on_a_protocol_2_data_dir(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running_server(data) as srv, SnapshotClient(srv.address) as c:
        c.put("pair", b"T", b"D")
        c.put("other", b"T2", b"D2")
    with running_server(data, max_protocol=1) as srv, SnapshotClient(srv.address) as c:
        assert c.stat("pair").draft is None
        assert all(s.draft is None for s in c.list())
        got = c.get("pair")
        assert (got.target, got.draft) == (b"T", None)
        c.put("pair", b"T-new")  # a protocol-1 save replaces the pair with a target
    with running_server(data) as srv, SnapshotClient(srv.address) as c:
        got = c.get("pair")
        assert (got.target, got.draft) == (b"T-new", None)
        got = c.get("other")  # untouched pairs keep their draft
        assert (got.target, got.draft) == (b"T2", b"D2")


def test_protocol_1_client_with_new_server(v2: SnapshotServer) -> None:
    with SnapshotClient(v2.address) as new:
        new.put("s", b"old-target", b"old-draft")
    with SnapshotClient(v2.address, max_protocol=1) as old:
        assert old.protocol == 1
        assert old.server_info().features == ("sha256",)
        res = old.put("s", b"new-target", b"new-draft")
        assert res.draft_skipped and res.draft is None
        got = old.get("s")
        assert (got.target, got.draft) == (b"new-target", None)
        with SnapshotClient(v2.address) as new:
            new.put("pair", b"T", b"D")
        got = old.get("pair")  # a protocol-1 client never asks for drafts
        assert (got.target, got.draft) == (b"T", None)
    st = v2.store.stat("s")
    assert st.target.sha256 == sha(b"new-target") and st.draft is None
    assert v2.metrics.registry.get_sample_value(
        "warmslot_snapshot_puts_total", {"part": "draft", "code": "OK"}) == 2.0  # "old", "pair"
    assert v2.metrics.registry.get_sample_value(
        "warmslot_snapshot_gets_total", {"part": "draft", "code": "OK"}) is None


def test_minimal_server_without_hello() -> None:
    with MinimalServer() as old:
        with SnapshotClient(old.address) as c:
            assert c.protocol == 1
            assert c.server_info().hello_supported is False
            big = bytes(range(256)) * 10_000  # 2.5 MB: several chunks
            for i in range(3):
                res = c.put(f"s{i}", big, b"draft")
                assert res.draft_skipped and res.protocol == 1
                got = c.get(f"s{i}")
                assert got.target == big and got.draft is None
            assert c.protocol == 1
            with pytest.raises(SnapshotError) as err:
                c.stat("s0")
            assert err.value.code == grpc.StatusCode.UNIMPLEMENTED
        assert old.counter.calls["Hello"] == 1  # once per channel, never retried
        assert old.counter.calls["Put"] == 3 and old.counter.calls["Get"] == 3
        assert old.parts_received == [pb.PART_TARGET] * 3  # no draft was ever sent
        with SnapshotClient(old.address) as c2:  # a new channel asks again
            assert c2.get("s1").target == big
        assert old.counter.calls["Hello"] == 2
        with SnapshotClient(old.address, min_protocol=2) as strict:
            for _ in range(2):
                with pytest.raises(FailedPrecondition, match="no common protocol"):
                    strict.put("x", b"t", b"d")
        assert old.counter.calls["Hello"] == 3


def test_no_common_protocol_version(v2: SnapshotServer, tmp_path: Path) -> None:
    with grpc.insecure_channel(v2.address) as ch:
        stub = pb_grpc.SnapshotStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Hello(pb.HelloRequest(min_protocol=3, max_protocol=4), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details() == ("no common protocol version: the client speaks 3..4, "
                                       "the server speaks 1..2")
        with pytest.raises(grpc.RpcError) as err:
            stub.Hello(pb.HelloRequest(min_protocol=2, max_protocol=1), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with running_server(tmp_path / "v1", max_protocol=1) as v1, \
            SnapshotClient(v1.address, min_protocol=2) as c:
        with pytest.raises(FailedPrecondition) as err:
            c.put("s", b"t", b"d")
        assert err.value.message == ("no common protocol version: the client speaks 2..2, "
                                     "the server speaks 1..1")
        assert v1.store.list() == []


def test_retries_unavailable_until_the_server_is_up(tmp_path: Path) -> None:
    port = free_port()
    servers: list[SnapshotServer] = []

    def start_later() -> None:
        time.sleep(0.6)
        srv = SnapshotServer(SnapshotConfig(data_dir=tmp_path / "d", port=port))
        srv.start()
        servers.append(srv)

    th = threading.Thread(target=start_later)
    th.start()
    try:
        with SnapshotClient(f"127.0.0.1:{port}", retries=8, backoff=0.05) as c:
            t0 = time.monotonic()
            assert c.put("s", b"t", b"d").draft is not None
            assert time.monotonic() - t0 >= 0.5
        th.join()
        assert rpc_count(servers[0], "Hello") == 1
    finally:
        th.join()
        for s in servers:
            s.stop(grace=0)


def test_gives_up_after_the_retries() -> None:
    with SnapshotClient(f"127.0.0.1:{free_port()}", retries=2, backoff=0.05) as c:
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            c.stat("s")
        assert time.monotonic() - t0 < 10


def test_other_errors_are_not_retried(v2: SnapshotServer) -> None:
    with SnapshotClient(v2.address, retries=5) as c:
        with pytest.raises(NotFound):
            c.get("missing")
        with pytest.raises(NotFound):
            c.delete("missing")
    assert rpc_count(v2, "Get", "NOT_FOUND") == 1
    assert rpc_count(v2, "Delete", "NOT_FOUND") == 1


def test_every_call_has_a_deadline() -> None:
    with MinimalServer() as old, SnapshotClient(old.address, timeout=0.5, min_rate=1e12) as c:
        c.put("slow", b"x")
        t0 = time.monotonic()
        with pytest.raises(SnapshotError) as err:
            c.get("slow")
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 2.5
        assert old.counter.calls["Get"] == 1  # not retried


def test_lost_staged_target_is_saved_again_once(tmp_path: Path) -> None:
    # a TTL of 0: every staged target is gone by the time its draft arrives,
    # as after a restart of the service between the two puts
    with running_server(tmp_path / "d", stage_ttl_s=0) as srv, SnapshotClient(srv.address) as c:
        with pytest.raises(FailedPrecondition, match="neither staged nor the current target"):
            c.put("s", b"target", b"draft")
        assert rpc_count(srv, "Put", "OK") == 2  # the target, twice
        assert rpc_count(srv, "Put", "FAILED_PRECONDITION") == 2
        assert srv.store.list() == []
