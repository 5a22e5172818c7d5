"""Every snapshot call ends by its deadline, even when the service stops answering
in the middle of a transfer (a process frozen with SIGSTOP keeps its socket open:
the client's writes fill the HTTP/2 flow-control window and then wait)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from snapshot_svc.client import SnapshotClient
from snapshot_svc.errors import SnapshotError
from snapshot_svc.pb import snapshot_pb2 as pb
from snapshot_svc.testing import ServerProcess
from tests.snapkit import blob, sha

pytestmark = pytest.mark.timeout(120)
MIB = 1 << 20


@contextmanager
def frozen(proc: ServerProcess) -> Iterator[None]:
    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)


def bounded(fn: object, limit: float) -> tuple[BaseException | None, float]:
    """Runs fn() on a thread; (what it raised, seconds taken). Fails the test when fn
    is still running after `limit` seconds (the thread is left behind, daemonic)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()  # type: ignore[operator]
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t0 = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    assert not th.is_alive(), f"the call was still running after {limit} s"
    return out[0], time.monotonic() - t0


@pytest.mark.parametrize("mib", [1, 4, 12])
def test_put_to_a_frozen_service_ends_at_its_deadline(tmp_path: Path, mib: int) -> None:
    with ServerProcess(tmp_path / "snap") as proc, \
            SnapshotClient(proc.address, timeout=1.0, min_rate=1e12, retries=0) as client:
        assert client.protocol == 2  # Hello answered before the freeze
        data = blob(mib, mib * MIB)
        with frozen(proc):
            err, took = bounded(lambda: client.put("frozen", data, target_sha256=sha(data)),
                                limit=15.0)
    assert isinstance(err, SnapshotError), err
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 1.0 <= took < 3.0


def test_close_after_a_put_stuck_on_a_frozen_service_returns(tmp_path: Path) -> None:
    # the Put's last write never completes (the server stopped reading): grpcio's
    # channel close waits for it forever; the client's close gives up after 1 s
    data = blob(8, 8 * MIB)
    with ServerProcess(tmp_path / "snap") as proc:
        client = SnapshotClient(proc.address, timeout=1.0, min_rate=1e12, retries=0)
        assert client.protocol == 2
        with frozen(proc):
            err, _ = bounded(lambda: client.put("frozen", data, target_sha256=sha(data)), 15.0)
            assert isinstance(err, SnapshotError) and err.code == grpc.StatusCode.DEADLINE_EXCEEDED
            err, took = bounded(client.close, limit=15.0)
            assert err is None and took < 2.0, took


def test_get_from_a_frozen_service_ends_at_its_base_timeout(tmp_path: Path) -> None:
    # the gRPC deadline of a Get allows for the largest snapshot (2 GiB at 32 MiB/s:
    # 64 s more); before the header says the real size, the base timeout is the bound
    data = blob(7, 1 * MIB)
    with ServerProcess(tmp_path / "snap") as proc, \
            SnapshotClient(proc.address, timeout=1.0, retries=0) as client:
        client.put("kept", data)
        with frozen(proc):
            err, took = bounded(lambda: client.get("kept"), limit=15.0)
    assert isinstance(err, SnapshotError), err
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 1.0 <= took < 3.0


class StallingServer:
    """Hello (protocol 2, 2 GiB snapshots) and a Get that sends the header of a 1 KiB
    target, then nothing until the client goes away."""

    def __init__(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        handlers = {
            "Hello": grpc.unary_unary_rpc_method_handler(
                self.hello, request_deserializer=pb.HelloRequest.FromString,
                response_serializer=pb.HelloResponse.SerializeToString),
            "Get": grpc.unary_stream_rpc_method_handler(
                self.get, request_deserializer=pb.GetRequest.FromString,
                response_serializer=pb.GetResponse.SerializeToString),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("warmslot.snapshot.v1.Snapshot", handlers),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.gone = threading.Event()

    def hello(self, request: pb.HelloRequest, context: grpc.ServicerContext) -> pb.HelloResponse:
        return pb.HelloResponse(protocol=2, max_chunk_bytes=1 << 20,
                                max_snapshot_bytes=2 << 30, features=["sha256"])

    def get(self, request: pb.GetRequest,
            context: grpc.ServicerContext) -> Iterator[pb.GetResponse]:
        info = pb.PartInfo(part=pb.PART_TARGET, size=1024, sha256=sha(b"x" * 1024))
        yield pb.GetResponse(header=pb.GetHeader(name=request.name, commit_id="c", info=info))
        while context.is_active():
            time.sleep(0.05)
        self.gone.set()


def test_get_deadline_follows_the_size_in_the_header() -> None:
    # 1 KiB at 1 MB/s: the deadline is the base timeout plus 1 ms, not plus 2 GiB's worth
    srv = StallingServer()
    srv.server.start()
    try:
        with SnapshotClient(srv.address, timeout=1.0, min_rate=1e6, retries=0) as client:
            err, took = bounded(lambda: client.get("stalls"), limit=15.0)
            assert srv.gone.wait(5.0)  # the call was cancelled, not left running
    finally:
        srv.server.stop(0)
    assert isinstance(err, SnapshotError), err
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 1.0 <= took < 2.0


def test_a_deadline_bounds_the_retries_of_an_unreachable_service() -> None:
    # nothing listens there: each attempt fails at once with UNAVAILABLE, and the
    # client would retry 5 times with backoff (about 3 s) without a deadline
    from snapshot_svc.testing import free_port
    with SnapshotClient(f"127.0.0.1:{free_port()}", timeout=5.0, backoff=0.2) as client:
        err, took = bounded(lambda: client.get("x", deadline=time.monotonic() + 0.3), 15.0)
        assert isinstance(err, SnapshotError) and took < 0.3 + 0.2, (err, took)
        err, took = bounded(lambda: client.get("x", deadline=time.monotonic()), 15.0)
        assert isinstance(err, SnapshotError), err
        assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and took < 0.1
