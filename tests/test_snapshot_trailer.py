"""The "sha256-trailer" feature: a Put may leave the header's sha256 empty and send the
digest last, so a client without the digest hashes while it sends instead of before.
Offered by protocol-2 servers only; older servers never see an empty sha256."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from snapshot_svc.client import SnapshotClient
from snapshot_svc.client import snapshot_client as client_mod
from snapshot_svc.client.contract import MAX_CHUNK_BYTES
from snapshot_svc.config import SnapshotConfig
from snapshot_svc.pb import snapshot_pb2 as pb
from snapshot_svc.pb import snapshot_pb2_grpc as pb_grpc
from snapshot_svc.server import SnapshotServer
from snapshot_svc.testing import free_port, running_server
from tests.snapkit import blob, sha

pytestmark = pytest.mark.timeout(120)
def leftovers(server: SnapshotServer) -> list[str]:
    """Files an upload left in tmp/ (spare files are the store's own)."""
    return [p.name for p in server.store.tmp.iterdir() if not p.name.startswith("spare-")]


@pytest.fixture
def v2(tmp_path: Path) -> Iterator[SnapshotServer]:
    with running_server(tmp_path / "v2", max_snapshot_bytes=8 << 20) as srv:
        yield srv


@pytest.fixture
def v1(tmp_path: Path) -> Iterator[SnapshotServer]:
    with running_server(tmp_path / "v1", max_protocol=1) as srv:
        yield srv


@pytest.fixture
def no_client_hashing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the client's hash-first calls (the trailer path never makes one)."""
    calls: list[int] = []
    real = client_mod._sha256

    def counting(data: bytes) -> str:
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(client_mod, "_sha256", counting)
    return calls


def put(server: SnapshotServer, msgs: list[pb.PutRequest]) -> pb.PutResponse:
    with grpc.insecure_channel(server.address) as ch:
        return pb_grpc.SnapshotStub(ch).Put(iter(msgs), timeout=10)


def put_code(server: SnapshotServer, msgs: list[pb.PutRequest]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        put(server, msgs)
    return err.value.code(), err.value.details()


def header(name: str, data: bytes, digest: str = "", **kw: object) -> pb.PutRequest:
    return pb.PutRequest(header=pb.PutHeader(name=name, part=pb.PART_TARGET, size=len(data),
                                             sha256=digest, **kw))  # type: ignore[arg-type]


def chunks(data: bytes) -> list[pb.PutRequest]:
    return [pb.PutRequest(chunk=data[i:i + MAX_CHUNK_BYTES])
            for i in range(0, len(data), MAX_CHUNK_BYTES)]


def trailer(digest: str) -> pb.PutRequest:
    return pb.PutRequest(trailer=pb.PutTrailer(sha256=digest))


@pytest.mark.parametrize("size", [0, 1, MAX_CHUNK_BYTES, 2 * MAX_CHUNK_BYTES + 7])
def test_client_without_a_digest_hashes_while_sending(v2: SnapshotServer, size: int,
                                                      no_client_hashing: list[int]) -> None:
    data = blob(1, size)
    with SnapshotClient(v2.address) as c:
        assert "sha256-trailer" in c.server_info().features
        res = c.put("s", data)
        assert (res.target.size, res.target.sha256) == (size, sha(data))
        assert c.get("s").target == data
    assert no_client_hashing == []
    assert (v2.store.blobs / sha(data)).read_bytes() == data


def test_a_pair_without_digests_uses_the_trailer_for_both(
        v2: SnapshotServer, no_client_hashing: list[int]) -> None:
    target, draft = blob(1, MAX_CHUNK_BYTES + 3), blob(2, 5000)
    with SnapshotClient(v2.address) as c:
        res = c.put("p", target, draft)
        assert res.draft is not None and res.draft.target_sha256 == sha(target)
        got = c.get("p")
        assert (got.target, got.draft) == (target, draft)
    assert no_client_hashing == []
    st = v2.store.stat("p")
    assert st.draft is not None and st.draft.target_sha256 == st.target.sha256 == sha(target)


def test_protocol_1_servers_get_the_digest_first(v1: SnapshotServer,
                                                 no_client_hashing: list[int]) -> None:
    data = blob(1, 3000)
    with SnapshotClient(v1.address) as c:
        assert "sha256-trailer" not in c.server_info().features
        c.put("s", data)
        assert c.get("s").target == data
    assert no_client_hashing == [3000]
    code, details = put_code(v1, [header("t", data), *chunks(data)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "64 lowercase hex" in details
    code, details = put_code(v1, [header("t", data, sha(data)), *chunks(data),
                                  trailer(sha(data))])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "only chunks" in details


def test_a_given_digest_is_sent_in_the_header(v2: SnapshotServer,
                                              no_client_hashing: list[int]) -> None:
    data = blob(1, 3000)
    with SnapshotClient(v2.address) as c:
        c.put("s", data, target_sha256=sha(data).upper())
    assert no_client_hashing == []
    assert v2.store.stat("s").target.sha256 == sha(data)


def test_raw_trailer_put(v2: SnapshotServer) -> None:
    data = blob(1, 2 * MAX_CHUNK_BYTES + 1)
    r = put(v2, [header("s", data), *chunks(data), trailer(sha(data))])
    assert (r.bytes, r.sha256, r.committed) == (len(data), sha(data), True)
    assert v2.store.stat("s").target.sha256 == sha(data)


def test_wrong_trailer_digest_is_data_loss_and_stores_nothing(v2: SnapshotServer) -> None:
    data = blob(1, MAX_CHUNK_BYTES + 10)
    code, details = put_code(v2, [header("s", data), *chunks(data), trailer(sha(b"other"))])
    assert code == grpc.StatusCode.DATA_LOSS and "SHA-256 mismatch" in details
    assert v2.store.list() == [] and leftovers(v2) == []
    assert list(v2.store.blobs.iterdir()) == []


@pytest.mark.parametrize("case, code, message", [
    ("missing", grpc.StatusCode.INVALID_ARGUMENT, "ended without a trailer"),
    ("both", grpc.StatusCode.INVALID_ARGUMENT, "header already named the sha256"),
    ("not last", grpc.StatusCode.INVALID_ARGUMENT, "trailer must be the last message"),
    ("twice", grpc.StatusCode.INVALID_ARGUMENT, "trailer must be the last message"),
    ("malformed", grpc.StatusCode.INVALID_ARGUMENT, "trailer's sha256 must be 64"),
    ("uppercase", grpc.StatusCode.INVALID_ARGUMENT, "trailer's sha256 must be 64"),
])
def test_bad_trailers_are_refused_and_store_nothing(v2: SnapshotServer, case: str,
                                                    code: grpc.StatusCode,
                                                    message: str) -> None:
    data = blob(1, MAX_CHUNK_BYTES + 10)
    good = sha(data)
    msgs = {
        "missing": [header("s", data), *chunks(data)],
        "both": [header("s", data, good), *chunks(data), trailer(good)],
        "not last": [header("s", data), chunks(data)[0], trailer(good), chunks(data)[1]],
        "twice": [header("s", data), *chunks(data), trailer(good), trailer(good)],
        "malformed": [header("s", data), *chunks(data), trailer("abc")],
        "uppercase": [header("s", data), *chunks(data), trailer(good.upper())],
    }[case]
    got_code, details = put_code(v2, msgs)
    assert got_code == code and message in details, details
    assert "'s'" in details  # names the snapshot
    assert v2.store.list() == [] and leftovers(v2) == []
    assert list(v2.store.blobs.iterdir()) == []


def test_a_server_replaced_by_one_without_the_trailer(tmp_path: Path,
                                                      no_client_hashing: list[int]) -> None:
    """The channel said Hello to a server with the feature; the one answering now
    refuses the empty header digest: the client sends the Put again, digest first."""
    port = free_port()

    def serve(max_protocol: int) -> SnapshotServer:
        srv = SnapshotServer(SnapshotConfig(data_dir=tmp_path / "d", port=port,
                                            max_protocol=max_protocol))
        srv.start()
        return srv

    data = blob(1, MAX_CHUNK_BYTES + 5)
    with SnapshotClient(f"127.0.0.1:{port}", timeout=10) as c:
        srv = serve(2)
        try:
            c.put("a", b"first")
            assert "sha256-trailer" in c.server_info().features
        finally:
            srv.stop(grace=0)
        srv = serve(1)
        try:
            res = c.put("b", data)
            assert (res.target.size, res.target.sha256) == (len(data), sha(data))
            assert srv.store.stat("b").target.sha256 == sha(data)
        finally:
            srv.stop(grace=0)
    assert no_client_hashing == [len(data)]
