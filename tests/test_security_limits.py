"""No client starves the others on the snapshot service: idle Put streams are
cancelled and give their disk reservation back, a key's streams are limited (another
key still gets through), a namespace's stored bytes have a quota."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from snapshot_svc.client import SnapshotClient
from snapshot_svc.clientlib.auth import bearer
from snapshot_svc.config import SnapshotConfig
from snapshot_svc.errors import ResourceExhausted
from snapshot_svc.pb import snapshot_pb2 as pb
from snapshot_svc.server import SnapshotServer
from tests.seckit import write_keys

A, B = "key-of-tenant-a-0123456789", "key-of-tenant-b-0123456789"
PUT = "/warmslot.snapshot.v1.Snapshot/Put"


def _disk_bytes(root: Path) -> int:
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512
               for d, _, files in os.walk(root) for f in files)


@pytest.fixture()
def srv(tmp_path: Path) -> Iterator[SnapshotServer]:
    keys = write_keys(tmp_path / "keys", {A: "namespace=a", B: "namespace=b"})
    cfg = SnapshotConfig(data_dir=tmp_path / "data", port=0, api_keys=keys, workers=4,
                         max_streams_per_key=2, max_unary_per_key=1, stream_idle_timeout_s=1.0,
                         stream_wait_s=0,  # a third stream is refused at once
                         spare_bytes=0,
                         quota_bytes=10_000 + (8 << 20))
    with SnapshotServer(cfg) as s:
        yield s


class _IdlePut:
    """A Put that sends its header (declaring `size` bytes) and then nothing."""

    def __init__(self, srv: SnapshotServer, key: str, name: str, size: int) -> None:
        self.release = threading.Event()
        self.channel = grpc.insecure_channel(srv.address)
        call = self.channel.stream_unary(PUT, request_serializer=pb.PutRequest.SerializeToString,
                                         response_deserializer=pb.PutResponse.FromString)
        header = pb.PutRequest(header=pb.PutHeader(name=name, part=pb.PART_TARGET, size=size,
                                                   sha256=hashlib.sha256(b"").hexdigest()))

        def requests() -> Iterator[pb.PutRequest]:
            yield header
            self.release.wait(30)

        self.future = call.future(requests(), metadata=bearer(key), timeout=30)

    def error(self) -> grpc.RpcError:
        err = self.future.exception(timeout=30)
        self.release.set()
        self.channel.close()
        assert isinstance(err, grpc.RpcError)
        return err


def test_idle_put_is_cancelled_and_its_reservation_freed(srv: SnapshotServer) -> None:
    base = _disk_bytes(srv.config.data_dir)
    idle = _IdlePut(srv, A, "big", 6 << 20)
    reserved = threading.Event()
    while not idle.future.done() and not reserved.wait(0.01):  # the header reserves it
        if _disk_bytes(srv.config.data_dir) >= base + (6 << 20):
            reserved.set()
    assert reserved.is_set()
    err = idle.error()  # waits for the idle timeout
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.details() == ("Put: no data for 1 s, the stream is cancelled "
                             "(--stream-idle-timeout)")
    assert _disk_bytes(srv.config.data_dir) == base
    assert srv.metrics.rpcs.labels("Put", "DEADLINE_EXCEEDED")._value.get() == 1


def test_one_keys_streams_leave_room_for_another_key(srv: SnapshotServer) -> None:
    idle = [_IdlePut(srv, A, f"idle{i}", 1 << 20) for i in range(2)]
    with SnapshotClient(srv.address, api_key=A, retries=0) as a, \
            SnapshotClient(srv.address, api_key=B, retries=0) as b:
        # wait until both idle streams hold their slot of key A (a third is refused)
        for _ in range(200):
            try:
                a.put("third", b"x")
            except ResourceExhausted as exc:
                assert str(exc) == ("this key has 2 streams open, the limit is 2 "
                                    "(--max-streams-per-key)")
                break
            a.delete("third")
        else:
            pytest.fail("key A's third stream was never refused")
        # key B: metadata calls and an 8 MiB Put go through meanwhile
        assert b.list() == []
        data = os.urandom(8 << 20)
        b.put("mine", data)
        assert bytes(b.get("mine").target) == data
    for put in idle:
        assert put.error().code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_namespace_quota(srv: SnapshotServer) -> None:
    with SnapshotClient(srv.address, api_key=A, retries=0) as a, \
            SnapshotClient(srv.address, api_key=B, retries=0) as b:
        a.put("one", b"1" * (8 << 20))
        a.put("two", b"2" * 6000)
        with pytest.raises(ResourceExhausted) as err:
            a.put("three", b"3" * 6000)
        assert err.value.message == (f"namespace 'a' holds {(8 << 20) + 6000} bytes; 6000 "
                                     f"more would pass its quota of {10_000 + (8 << 20)} bytes")
        a.put("two", b"2" * 9000)  # an overwrite counts the new size only
        b.put("three", b"3" * 6000)  # another namespace has its own quota
        assert sorted(s.name for s in a.list()) == ["one", "two"]
