"""Snapshot name rules: each rule on its own, locally and over the wire (INVALID_ARGUMENT)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from snapshot_svc.client import SnapshotClient
from snapshot_svc.client.names import name_problem, validate_name
from snapshot_svc.errors import InvalidArgument
from snapshot_svc.pb import snapshot_pb2 as pb
from snapshot_svc.pb import snapshot_pb2_grpc as pb_grpc
from snapshot_svc.server import SnapshotServer
from snapshot_svc.testing import running_server

pytestmark = pytest.mark.timeout(60)

GOOD = ["a", "auto-host-slot0", "slot 0.bin", "名前-ünïcødé", "x" * 255, "é" * 127 + "x",
        ".hidden", "a.b.c", "-", "a b"]

# (name, the rule it breaks)
BAD = [
    ("", "empty"),
    ("x" * 256, "256 bytes"),
    ("é" * 128, "256 bytes of UTF-8 (128 characters)"),
    ("a/b", "slash"),
    ("/abs", "leading slash"),
    ("a\\b", "backslash"),
    ("a\x00b", "NUL"),
    ("a\nb", "newline"),
    ("tab\t", "tab"),
    ("del\x7f", "DEL"),
    ("c1\x85", "C1 control"),
    ("..", "dot-dot alone"),
    ("a..b", "dot-dot inside"),
    ("../etc/passwd", "traversal"),
    (" lead", "leading space"),
    ("trail ", "trailing space"),
    ("end.", "trailing dot"),
    (".", "single dot"),
    ("\udc80", "lone surrogate (not encodable as UTF-8)"),
]


@pytest.mark.parametrize("name", GOOD)
def test_good_names(name: str) -> None:
    assert name_problem(name) is None
    assert validate_name(name) == name


@pytest.mark.parametrize(("name", "rule"), BAD)
def test_bad_names(name: str, rule: str) -> None:
    assert name_problem(name) is not None, rule
    with pytest.raises(InvalidArgument):
        validate_name(name)


def test_invalid_utf8_bytes() -> None:
    assert name_problem(b"ok") is None
    assert name_problem(b"\xff\xfe") == "name is not valid UTF-8"
    assert name_problem("é".encode()[:1]) == "name is not valid UTF-8"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SnapshotServer]:
    with running_server(tmp_path / "data") as srv:
        yield srv


def _raw_put(stub: pb_grpc.SnapshotStub, name: str) -> None:
    data = b"payload"
    header = pb.PutHeader(name=name, part=pb.PART_TARGET, size=len(data),
                          sha256=hashlib.sha256(data).hexdigest())
    stub.Put(iter([pb.PutRequest(header=header), pb.PutRequest(chunk=data)]), timeout=10)


@pytest.mark.parametrize(("name", "rule"), [b for b in BAD if b[0] != "\udc80"])
def test_server_refuses_bad_names(server: SnapshotServer, name: str, rule: str) -> None:
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.SnapshotStub(ch)
        calls = [
            lambda: _raw_put(stub, name),
            lambda: list(stub.Get(pb.GetRequest(name=name, part=pb.PART_TARGET), timeout=10)),
            lambda: stub.Stat(pb.StatRequest(name=name), timeout=10),
            lambda: stub.Delete(pb.DeleteRequest(name=name), timeout=10),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rule
            assert "bad snapshot name" in err.value.details()
    assert list((server.store.tmp).iterdir()) == []
    assert list((server.store.blobs).iterdir()) == []


def test_server_refuses_invalid_utf8_on_the_wire(server: SnapshotServer) -> None:
    # protobuf clients cannot even encode such a name: build the message by hand
    # (field 1, length-delimited, two bytes that are not UTF-8)
    raw = b"\x0a\x02\xff\xfe"
    with grpc.insecure_channel(server.address) as ch:
        stat = ch.unary_unary("/warmslot.snapshot.v1.Snapshot/Stat",
                              request_serializer=lambda b: b,
                              response_deserializer=pb.StatResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            stat(raw, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_client_checks_names_before_calling(server: SnapshotServer) -> None:
    with SnapshotClient(server.address) as client:
        for call in (lambda: client.put("a/b", b"x"), lambda: client.get("a/b"),
                     lambda: client.stat(".."), lambda: client.delete("x.")):
            with pytest.raises(InvalidArgument):
                call()
    assert server.metrics.registry.get_sample_value(
        "warmslot_snapshot_rpcs_total", {"method": "Put", "code": "OK"}) is None
