"""The snapshot service on its local backend against a real server on 127.0.0.1: what
only that backend does or what needs no second backend (receive buffers, the stream
checks, limits and disk full, concurrent writers, shared content, start-up sweep,
shutdown, operations). What both backends must do alike is the conformance suite in
test_snapshot_s3.py, run on each."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from snapshot_svc.client import SnapshotClient
from snapshot_svc.client.contract import MAX_CHUNK_BYTES
from snapshot_svc.client.records import Part, PartMeta
from snapshot_svc.config import SnapshotConfig, parse_config, parse_size
from snapshot_svc.errors import (
    DataLoss,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    SnapshotError,
    Unavailable,
)
from snapshot_svc.logs import JsonFormatter
from snapshot_svc.pb import snapshot_pb2 as pb
from snapshot_svc.pb import snapshot_pb2_grpc as pb_grpc
from snapshot_svc.server import SnapshotServer
from snapshot_svc.testing import free_port, running_server
from tests.snapkit import blob, sha

pytestmark = pytest.mark.timeout(120)
def put_requests(name: str, part: int, data: bytes, *, digest: str | None = None,
                 size: int | None = None, chunk: int = MAX_CHUNK_BYTES,
                 draft_follows: bool = False, target_sha256: str = "",
                 meta: PartMeta = PartMeta()) -> list[pb.PutRequest]:
    header = pb.PutHeader(name=name, part=part, size=len(data) if size is None else size,
                          sha256=sha(data) if digest is None else digest,
                          format_version=meta.format_version, fingerprint=meta.fingerprint,
                          n_tokens=meta.n_tokens, draft_follows=draft_follows,
                          target_sha256=target_sha256)
    return [pb.PutRequest(header=header)] + [pb.PutRequest(chunk=data[i:i + chunk])
                                             for i in range(0, len(data), chunk)]


def stage_target(stub: pb_grpc.SnapshotStub, name: str, target: bytes,
                 timeout: float) -> None:
    """Puts a target that waits for its draft (staged, not yet visible)."""
    stub.Put(iter(put_requests(name, pb.PART_TARGET, target, draft_follows=True)),
             timeout=timeout)


def commit_draft(stub: pb_grpc.SnapshotStub, name: str, draft: bytes, target: bytes,
                 timeout: float) -> None:
    """Puts the draft that commits the staged `target` with it."""
    stub.Put(iter(put_requests(name, pb.PART_DRAFT, draft, target_sha256=sha(target))),
             timeout=timeout)


def status_of(fn: object) -> grpc.StatusCode:
    try:
        fn()  # type: ignore[operator]
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SnapshotServer]:
    with running_server(tmp_path / "data", max_snapshot_bytes=8 << 20) as srv:
        yield srv


@pytest.fixture
def client(server: SnapshotServer) -> Iterator[SnapshotClient]:
    with SnapshotClient(server.address, timeout=20) as c:
        yield c


@pytest.fixture
def stub(server: SnapshotServer) -> Iterator[pb_grpc.SnapshotStub]:
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.SnapshotStub(ch)


def stored_files(server: SnapshotServer) -> dict[str, list[str]]:
    """The store's files; tmp/ without the spare files (see test_snapshot_spares.py)."""
    s = server.store
    return {d.name: sorted(p.name for p in d.iterdir() if not p.name.startswith("spare-"))
            for d in (s.blobs, s.manifests, s.tmp)}


# --- round trips -------------------------------------------------------------------------


def test_get_results_are_read_only_and_never_reused_while_held(
        client: SnapshotClient) -> None:
    a, b = blob(1, 3 * MAX_CHUNK_BYTES + 1), blob(2, 3 * MAX_CHUNK_BYTES + 1)
    client.put("a", a)
    client.put("b", b)
    held = client.get("a").target
    assert isinstance(held, memoryview) and held.readonly
    for _ in range(3):  # each Get's buffer goes back to the pool and is refilled
        got = client.get("b")
        assert got.target == b
        del got
    assert held == a


@pytest.mark.parametrize(("size", "tail"), [
    (3 * MAX_CHUNK_BYTES + 100, 32),  # the cut inside the last chunk
    (3 * MAX_CHUNK_BYTES + 100, 100),  # the cut on a chunk boundary
    (3 * MAX_CHUNK_BYTES + 100, MAX_CHUNK_BYTES + 7),  # the cut in an earlier chunk
    (1000, 1000),  # the whole part is tail: the digest of nothing
    (1000, 1001),  # more tail than bytes: not computed
    (1000, 0),  # not asked
])
def test_get_digests_all_but_the_tail_in_the_same_pass(client: SnapshotClient, size: int,
                                                       tail: int) -> None:
    data = blob(5, size)
    client.put("t", data)
    got = client.get("t", digest_tail=tail)
    assert got.target == data
    want = sha(data[:size - tail]) if 0 < tail <= size else ""
    assert got.target_prefix_sha256 == want


def test_get_without_memory_for_the_part_is_resource_exhausted(
        client: SnapshotClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from snapshot_svc.client import buffers

    client.put("big", blob(3, 2 * MAX_CHUNK_BYTES))

    def no_memory(size: int) -> memoryview:
        raise MemoryError

    monkeypatch.setattr(buffers.POOL, "take", no_memory)
    with pytest.raises(ResourceExhausted, match=f"cannot allocate {2 * MAX_CHUNK_BYTES} bytes"):
        client.get("big")
    monkeypatch.undo()
    assert client.get("big").target == blob(3, 2 * MAX_CHUNK_BYTES)  # the channel is fine


def test_negative_digest_tail_is_refused(client: SnapshotClient) -> None:
    with pytest.raises(ValueError, match="digest_tail must be >= 0, got -1"):
        client.get("t", digest_tail=-1)


def test_put_with_the_callers_digests(client: SnapshotClient, server: SnapshotServer) -> None:
    t, d = blob(1, 3 * MAX_CHUNK_BYTES), blob(2, 500)
    res = client.put("s", t, d, target_sha256=sha(t), draft_sha256=sha(d))
    assert res.target.sha256 == sha(t) and res.draft is not None
    before = stored_files(server)
    with pytest.raises(DataLoss):  # a wrong digest from the caller is caught by the server
        client.put("s", blob(3, 1000), target_sha256=sha(b"something else"))
    assert stored_files(server) == before
    got = client.get("s")
    assert (got.target, got.draft) == (t, d)


def test_target_only_save_replaces_the_pair(client: SnapshotClient,
                                            server: SnapshotServer) -> None:
    old_t, old_d, new_t = blob(1, 5000), blob(2, 700), blob(3, 6000)
    client.put("s", old_t, old_d)
    res = client.put("s", new_t)
    assert res.draft is None and not res.draft_skipped
    got = client.get("s")
    assert got.target == new_t and got.draft is None and got.draft_note == "no draft stored"
    assert client.stat("s").draft is None
    with pytest.raises(NotFound):
        client.get_part("s", Part.DRAFT)
    # the old save's blobs are garbage-collected
    assert stored_files(server)["blobs"] == [sha(new_t)]


def test_raw_protobuf_client_interoperates(stub: pb_grpc.SnapshotStub,
                                           client: SnapshotClient) -> None:
    """Plain generated stubs (no chunk codec) put and get the same bytes."""
    data = blob(9, 2 * MAX_CHUNK_BYTES + 5)
    r = stub.Put(iter(put_requests("raw", pb.PART_TARGET, data)), timeout=20)
    assert (r.bytes, r.sha256, r.committed, r.has_draft) == (len(data), sha(data), True, False)
    assert client.get("raw").target == data
    msgs = list(stub.Get(pb.GetRequest(name="raw", part=pb.PART_TARGET), timeout=20))
    assert msgs[0].WhichOneof("msg") == "header" and msgs[0].header.info.size == len(data)
    assert b"".join(m.chunk for m in msgs[1:]) == data
    assert max(len(m.chunk) for m in msgs[1:]) == MAX_CHUNK_BYTES


# --- integrity ---------------------------------------------------------------------------


def test_truncated_and_overlong_streams(client: SnapshotClient, server: SnapshotServer,
                                        stub: pb_grpc.SnapshotStub) -> None:
    client.put("s", b"old")
    before = stored_files(server)
    data = blob(5, 10_000)
    short = put_requests("s", pb.PART_TARGET, data[:9_999], size=10_000, digest=sha(data))
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(iter(short), timeout=20)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert "received 9999 of 10000 bytes" in err.value.details()
    long = put_requests("s", pb.PART_TARGET, data + b"x", size=10_000, digest=sha(data))
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(iter(long), timeout=20)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than the 10000 declared" in err.value.details()
    assert stored_files(server) == before
    assert client.get("s").target == b"old"


def test_malformed_put_streams(stub: pb_grpc.SnapshotStub, server: SnapshotServer) -> None:
    data = b"abc"
    hdr = put_requests("s", pb.PART_TARGET, data)[0]
    cases = {
        "no header": [pb.PutRequest(chunk=data)],
        "empty stream": [],
        "two headers": [hdr, hdr, pb.PutRequest(chunk=data)],
        "no part": put_requests("s", pb.PART_UNSPECIFIED, data),
        "bad digest text": put_requests("s", pb.PART_TARGET, data, digest="XYZ"),
        "draft without target digest": put_requests("s", pb.PART_DRAFT, data),
        "target with target digest": put_requests("s", pb.PART_TARGET, data,
                                                  target_sha256=sha(b"t")),
        "oversized chunk": put_requests("s", pb.PART_TARGET, blob(1, MAX_CHUNK_BYTES + 1),
                                        chunk=MAX_CHUNK_BYTES + 1),
    }
    for what, reqs in cases.items():
        code = status_of(lambda reqs=reqs: stub.Put(iter(reqs), timeout=20))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, what
    assert stored_files(server) == {"blobs": [], "manifests": [], "tmp": []}


# --- limits ------------------------------------------------------------------------------


def test_oversize_is_resource_exhausted(client: SnapshotClient, server: SnapshotServer,
                                        stub: pb_grpc.SnapshotStub) -> None:
    limit = server.config.max_snapshot_bytes
    assert client.server_info().max_snapshot_bytes == limit
    client.put("s", b"old")
    before = stored_files(server)
    # the client refuses before sending
    with pytest.raises(ResourceExhausted):
        client.put("s", blob(1, limit + 1))
    # the header's size is checked up front...
    reqs = put_requests("s", pb.PART_TARGET, b"", size=limit + 1, digest=sha(b""))
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(iter(reqs), timeout=20)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"the limit is {limit}" in err.value.details()
    # ...and the streamed total, whatever the header said
    big = blob(2, limit + 1)
    reqs = put_requests("s", pb.PART_TARGET, big, size=limit, digest=sha(big[:limit]))
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(iter(reqs), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"({limit + 1} bytes received)" in err.value.details()
    # exactly the limit is fine
    assert client.put("max", blob(3, limit)).target.size == limit
    assert stored_files(server)["tmp"] == []
    assert client.get("s").target == b"old"
    del before


def test_disk_full_is_resource_exhausted_and_leaves_nothing(client: SnapshotClient,
                                                            server: SnapshotServer) -> None:
    old = blob(1, 4000)
    client.put("s", old)
    before = stored_files(server)
    written = [0]

    def write_until_full(fd: int, data: memoryview) -> int:
        if written[0] + len(data) > 1_500_000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += len(data)
        return os.write(fd, data)

    server.store._write = write_until_full
    with pytest.raises(ResourceExhausted, match="disk full"):
        client.put("s", blob(2, 3 * MAX_CHUNK_BYTES))
    assert stored_files(server) == before
    # full while writing the manifest (the commit point): the blob is removed again
    written[0] = -10**9
    server.store._write = lambda fd, data: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "full")) if data[:1] == b"{" else os.write(fd, data)
    with pytest.raises(ResourceExhausted):
        client.put("s", blob(3, 1000))
    assert stored_files(server) == before
    assert list(server.store.tmp.iterdir()) == []  # not kept as a spare on a full disk
    server.store._write = os.write
    assert client.get("s").target == old


def test_disk_too_full_for_the_declared_size_is_refused_before_the_data(
        client: SnapshotClient, server: SnapshotServer) -> None:
    old = blob(1, 4000)
    client.put("s", old)
    before = stored_files(server)
    asked: list[int] = []
    written = [0]

    def no_room(fd: int, offset: int, length: int) -> None:
        asked.append(length)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def counting_write(fd: int, data: memoryview) -> int:
        written[0] += len(data)
        return os.write(fd, data)

    server.store._allocate = no_room
    server.store._write = counting_write
    big = blob(2, 3 * MAX_CHUNK_BYTES)
    with pytest.raises(ResourceExhausted, match=f"reserving {len(big)} bytes .*disk full"):
        client.put("s", big)
    assert asked == [len(big)] and written[0] == 0  # refused before any chunk was written
    assert stored_files(server) == before
    server.store._allocate = os.posix_fallocate
    server.store._write = os.write
    assert client.get("s").target == old


# --- paired commit -----------------------------------------------------------------------


def test_concurrent_saves_of_one_name_leave_a_consistent_pair(
        server: SnapshotServer) -> None:
    """Four writers save pairs under one name while a reader checks every read."""

    def pair(writer: int, i: int) -> tuple[bytes, bytes]:
        t = blob(1000 * writer + i, 50_000 + 997 * i)
        return t, b"draft-of:" + sha(t).encode() + blob(7 * writer + i, 3000)

    errors: list[str] = []
    pairs_read = [0]
    done = threading.Event()
    saved: list[tuple[bytes, bytes]] = []

    def writer(w: int) -> None:
        with SnapshotClient(server.address, timeout=30) as c:
            for i in range(6):
                t, d = pair(w, i)
                c.put("shared", t, d)
                saved.append((t, d))

    def reader() -> None:
        with SnapshotClient(server.address, timeout=30) as c:
            while not done.is_set() or pairs_read[0] < 3:
                try:
                    got = c.get("shared")
                except NotFound:
                    continue
                if got.draft is None:  # every save has a draft: only a busy name skips it
                    if "kept changing" not in got.draft_note:
                        errors.append(f"draft missing: {got.draft_note}")
                    continue
                pairs_read[0] += 1
                if got.draft[9:73] != sha(got.target).encode():
                    errors.append("a target was served with another save's draft")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    rt = threading.Thread(target=reader)
    rt.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    done.set()
    rt.join(60)
    assert not errors and pairs_read[0] > 0
    with SnapshotClient(server.address) as c:
        got = c.get("shared")
    assert got.draft is not None and (got.target, got.draft) in saved
    # nothing but the surviving pair is left on disk
    assert stored_files(server) == {
        "blobs": sorted([sha(got.target), sha(got.draft)]),
        "manifests": [p.name for p in server.store.manifests.iterdir()],
        "tmp": []}


def test_staged_target_expires(tmp_path: Path) -> None:
    with running_server(tmp_path / "d", stage_ttl_s=0.2) as srv, \
            grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.SnapshotStub(ch)
        t = blob(1, 1000)
        stub.Put(iter(put_requests("s", pb.PART_TARGET, t, draft_follows=True)), timeout=20)
        time.sleep(0.3)
        reqs = put_requests("s", pb.PART_DRAFT, b"d", target_sha256=sha(t))
        assert status_of(lambda: stub.Put(iter(reqs), timeout=20)) \
            == grpc.StatusCode.FAILED_PRECONDITION
        assert stored_files(srv) == {"blobs": [], "manifests": [], "tmp": []}


# How a paired save's draft Put can fail (header fields of a draft for a 5000-byte limit):
# each must free the staged target at once, whatever the reason.
FAILED_DRAFTS = {
    "declared size over the limit": ({"size": 9000}, grpc.StatusCode.RESOURCE_EXHAUSTED),
    "bad sha256 in the header": ({"digest": "not-hex"}, grpc.StatusCode.INVALID_ARGUMENT),
    "draft_follows on a draft": ({"draft_follows": True}, grpc.StatusCode.INVALID_ARGUMENT),
    "digest mismatch": ({"digest": sha(b"other")}, grpc.StatusCode.DATA_LOSS),
}


@pytest.mark.parametrize("why", list(FAILED_DRAFTS))
def test_failed_draft_frees_its_staged_target_at_once(tmp_path: Path, why: str) -> None:
    """Limit 5000 bytes, no spare files, a stage TTL of 300 s: a staged 3000-byte target
    whose draft Put is refused is gone right after the refusal, not at its expiry."""
    fields, code = FAILED_DRAFTS[why]
    with running_server(tmp_path / "d", max_snapshot_bytes=5000, spare_bytes=0,
                        stage_ttl_s=300.0) as srv, grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.SnapshotStub(ch)
        t = blob(1, 3000)
        stage_target(stub, "s", t, timeout=20)
        assert stored_files(srv)["blobs"] == [sha(t)]
        assert srv.store.usage() == (0, 3000)
        reqs = put_requests("s", pb.PART_DRAFT, blob(2, 100), target_sha256=sha(t),
                            **fields)  # type: ignore[arg-type]
        assert status_of(lambda: stub.Put(iter(reqs), timeout=20)) == code
        assert stored_files(srv) == {"blobs": [], "manifests": [], "tmp": []}
        assert srv.store.usage() == (0, 0)
        assert status_of(lambda: stub.Stat(pb.StatRequest(name="s"), timeout=20)) \
            == grpc.StatusCode.NOT_FOUND
        # the failed save is over: a valid draft for that target has nothing to commit
        assert status_of(lambda: commit_draft(stub, "s", blob(2, 100), t, timeout=20)) \
            == grpc.StatusCode.FAILED_PRECONDITION


def test_cancelled_draft_frees_its_staged_target_at_once(tmp_path: Path) -> None:
    """The same when the client cancels the draft's stream halfway."""
    with running_server(tmp_path / "d", max_snapshot_bytes=5000, spare_bytes=0,
                        stage_ttl_s=300.0) as srv, grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.SnapshotStub(ch)
        t = blob(1, 3000)
        stage_target(stub, "s", t, timeout=20)
        release = threading.Event()

        def halfway() -> Iterator[pb.PutRequest]:
            yield from put_requests("s", pb.PART_DRAFT, blob(2, 100), size=200,
                                    target_sha256=sha(t))
            release.wait(20)  # the rest never comes

        call = stub.Put.future(halfway(), timeout=20)
        try:
            _wait_until(lambda: any(srv.store.tmp.iterdir()))  # the draft is arriving
            call.cancel()
            _wait_until(lambda: stored_files(srv) == {"blobs": [], "manifests": [],
                                                      "tmp": []})
        finally:
            release.set()
        assert srv.store.usage() == (0, 0)
        assert status_of(lambda: stub.Stat(pb.StatRequest(name="s"), timeout=20)) \
            == grpc.StatusCode.NOT_FOUND


# --- shared content ------------------------------------------------------------------------


def test_shared_content_is_freed_with_its_last_reference(client: SnapshotClient,
                                                         server: SnapshotServer) -> None:
    same = blob(1, 5000)
    client.put("one", same)
    client.put("two", same)
    assert stored_files(server)["blobs"] == [sha(same)]
    assert client.delete("one") == 0
    assert client.get("two").target == same
    assert client.delete("two") == 5000
    assert stored_files(server)["blobs"] == []


# --- start-up, restart, shutdown -------------------------------------------------------------


def test_restart_keeps_snapshots_and_sweeps_stale_files(tmp_path: Path) -> None:
    data = tmp_path / "d"
    t, d = blob(1, 3 * MAX_CHUNK_BYTES + 1), blob(2, 1000)
    with running_server(data) as srv, SnapshotClient(srv.address) as c:
        res = c.put("keep", t, d)
    # debris of a crash: an upload in progress, a manifest being written, an orphan blob
    (data / "tmp" / "put-dead.tmp").write_bytes(b"partial")
    (data / "manifests" / "abc.0123.tmp").write_bytes(b"{")
    orphan = blob(3, 10)
    (data / "blobs" / sha(orphan)).write_bytes(orphan)
    with running_server(data) as srv, SnapshotClient(srv.address) as c:
        got = c.get("keep")
        assert (got.target, got.draft, got.info.commit_id) == (t, d, res.commit_id)
        assert stored_files(srv) == {"blobs": sorted([sha(t), sha(d)]),
                                     "manifests": [p.name for p in srv.store.manifests.iterdir()
                                                   if p.suffix == ".json"],
                                     "tmp": []}
        assert len(stored_files(srv)["manifests"]) == 1


def test_one_server_per_data_dir(server: SnapshotServer) -> None:
    with pytest.raises(FailedPrecondition, match="in use by another server"):
        SnapshotServer(SnapshotConfig(data_dir=server.config.data_dir, port=0))


def _stalled_put(address: str, name: str, data: bytes, release: threading.Event,
                 result: dict[str, object]) -> threading.Thread:
    """A Put that sends its header and first chunk, then waits for `release`."""

    def requests() -> Iterator[pb.PutRequest]:
        reqs = put_requests(name, pb.PART_TARGET, data, chunk=len(data) // 2 + 1)
        yield reqs[0]
        yield reqs[1]
        result["sent_first"] = True
        release.wait(30)
        yield from reqs[2:]

    def run() -> None:
        with grpc.insecure_channel(address) as ch:
            try:
                result["response"] = pb_grpc.SnapshotStub(ch).Put(requests(), timeout=60)
            except grpc.RpcError as err:
                result["code"] = err.code()

    th = threading.Thread(target=run)
    th.start()
    return th


def _wait_until(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_shutdown_lets_an_inflight_put_finish(tmp_path: Path) -> None:
    srv = SnapshotServer(SnapshotConfig(data_dir=tmp_path / "d", port=0))
    srv.start()
    addr = srv.address
    data = blob(1, 200_000)
    release, result = threading.Event(), {}
    th = _stalled_put(addr, "s", data, release, result)
    _wait_until(lambda: any(srv.store.tmp.iterdir()))
    with grpc.insecure_channel(addr) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""),
                                                     timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stopper = threading.Thread(target=srv.stop, kwargs={"grace": 20})
        stopper.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    # new calls are refused while in-flight ones finish
    with SnapshotClient(addr, retries=0) as c:
        with pytest.raises(Unavailable):
            c.stat("s")
    release.set()
    th.join(30)
    stopper.join(30)
    assert isinstance(result.get("response"), pb.PutResponse), result
    with running_server(tmp_path / "d") as srv2, SnapshotClient(srv2.address) as c:
        assert c.get("s").target == data


def test_shutdown_discards_an_unfinished_put_whole(tmp_path: Path) -> None:
    srv = SnapshotServer(SnapshotConfig(data_dir=tmp_path / "d", port=0))
    srv.start()
    with SnapshotClient(srv.address) as c:
        c.put("s", b"old")
    release, result = threading.Event(), {}
    th = _stalled_put(srv.address, "s", blob(1, 200_000), release, result)
    _wait_until(lambda: any(srv.store.tmp.iterdir()))
    srv.stop(grace=0.3)
    release.set()
    th.join(30)
    assert result.get("code") in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), result
    assert list(srv.store.tmp.iterdir()) == []
    with running_server(tmp_path / "d") as srv2, SnapshotClient(srv2.address) as c:
        assert c.get("s").target == b"old"


# --- operations --------------------------------------------------------------------------


def test_health_and_reflection(server: SnapshotServer) -> None:
    with grpc.insecure_channel(server.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "warmslot.snapshot.v1.Snapshot"):
            r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        names = {s.name for s in resp.list_services_response.service}
        assert {"warmslot.snapshot.v1.Snapshot", "grpc.health.v1.Health"} <= names


def test_metrics_endpoint(tmp_path: Path) -> None:
    port = free_port()
    with running_server(tmp_path / "d", metrics_port=port) as srv, \
            SnapshotClient(srv.address) as c:
        t, d = blob(1, 12345), blob(2, 678)
        c.put("s", t, d)
        c.get("s")
        with pytest.raises(NotFound):
            c.get("missing")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    lines = set(text.decode().splitlines())
    for want in [
        'warmslot_snapshot_puts_total{code="OK",part="target"} 1.0',
        'warmslot_snapshot_puts_total{code="OK",part="draft"} 1.0',
        'warmslot_snapshot_received_bytes_total{part="target"} 12345.0',
        'warmslot_snapshot_received_bytes_total{part="draft"} 678.0',
        'warmslot_snapshot_sent_bytes_total{part="target"} 12345.0',
        'warmslot_snapshot_sent_bytes_total{part="draft"} 678.0',
        'warmslot_snapshot_gets_total{code="NOT_FOUND",part="target"} 1.0',
        'warmslot_snapshot_rpcs_total{code="OK",method="Hello"} 1.0',
        'warmslot_snapshot_put_seconds_count{part="target"} 1.0',
        'warmslot_snapshot_get_seconds_count{part="draft"} 1.0',
        "warmslot_snapshot_digest_failures_total 0.0",
        "warmslot_snapshot_stored_snapshots 1.0",
        "warmslot_snapshot_stored_bytes 13023.0",
    ]:
        assert want in lines, want


def test_log_lines_are_json_events() -> None:
    rec = logging.LogRecord("snapshot_svc.storage", logging.INFO, __file__, 1,
                            "snapshot_committed", None, None)
    rec.fields = {"name": "s", "target_bytes": 10}
    out = json.loads(JsonFormatter().format(rec))
    assert out["msg"] == "snapshot_committed" and out["level"] == "info"
    assert out["name"] == "s" and out["target_bytes"] == 10 and out["ts"].endswith("Z")


def test_config_from_flags_and_environment(tmp_path: Path) -> None:
    env = {"WARMSLOT_SNAPSHOT_DATA_DIR": str(tmp_path), "WARMSLOT_SNAPSHOT_PORT": "7000",
           "WARMSLOT_SNAPSHOT_MAX_PROTOCOL": "1", "WARMSLOT_SNAPSHOT_MAX_SNAPSHOT_BYTES": "64M"}
    cfg = parse_config([], env)
    assert (cfg.data_dir, cfg.port, cfg.max_protocol, cfg.max_snapshot_bytes, cfg.host) == (
        tmp_path, 7000, 1, 64 << 20, "127.0.0.1")
    cfg = parse_config(["--port", "7001", "--max-protocol", "2", "--metrics-port", "9100"], env)
    assert (cfg.port, cfg.max_protocol, cfg.metrics_port) == (7001, 2, 9100)
    with pytest.raises(AttributeError):
        cfg.port = 1  # type: ignore[misc]
    with pytest.raises(SystemExit):
        parse_config([], {})  # no data dir
    with pytest.raises(SystemExit):
        parse_config(["--max-protocol", "3"], env)
    with pytest.raises(SystemExit):
        parse_config([], {**env, "WARMSLOT_SNAPSHOT_PORT": "nope"})
    assert [parse_size(s) for s in ("10", "1k", "2M", "3GiB", "1mb")] == [
        10, 1024, 2 << 20, 3 << 30, 1 << 20]


def test_ctl_moves_files_between_stores(server: SnapshotServer, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from snapshot_svc import ctl

    local, other = tmp_path / "slots", tmp_path / "restored"
    local.mkdir()
    other.mkdir()
    t, d = blob(1, 2 * MAX_CHUNK_BYTES + 3), blob(2, 999)
    (local / "chat 1").write_bytes(t)
    (local / "chat 1.drft").write_bytes(d)
    addr = ["--addr", server.address]
    assert ctl.main(addr + ["put", "chat 1", "--dir", str(local), "--n-tokens", "12"]) == 0
    put = json.loads(capsys.readouterr().out)
    assert put["target"]["size"] == len(t) and put["draft"]["size"] == len(d)
    assert put["generation"] == 1
    # a conditional put that lost: ABORTED, both generations named, nothing stored
    (tmp_path / "newer").mkdir()
    (tmp_path / "newer" / "chat 1").write_bytes(b"another state")
    assert ctl.main(addr + ["put", "chat 1", "--dir", str(tmp_path / "newer"),
                            "--expected-generation", "0"]) == 1
    assert json.loads(capsys.readouterr().err) == {
        "error": "ABORTED",
        "message": "snapshot 'chat 1' changed: expected generation 0, stored 1"}
    assert ctl.main(addr + ["get", "chat 1", "--dir", str(other)]) == 0
    capsys.readouterr()
    assert (other / "chat 1").read_bytes() == t and (other / "chat 1.drft").read_bytes() == d
    assert sorted(p.name for p in other.iterdir()) == ["chat 1", "chat 1.drft"]
    assert ctl.main(addr + ["ls", "chat"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(s["name"], s["generation"]) for s in listed] == [("chat 1", 1)]
    assert listed[0]["target"]["meta"]["n_tokens"] == 12
    assert ctl.main(addr + ["rm", "chat 1"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_freed"] == len(t) + len(d)
    assert ctl.main(addr + ["stat", "chat 1"]) == 1
    assert json.loads(capsys.readouterr().err)["error"] == "NOT_FOUND"


def test_writeback_error_is_not_lost(server: SnapshotServer, client: SnapshotClient,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed background fdatasync fails the Put even if the final fsync succeeds."""
    from snapshot_svc import storage

    client.put("s", b"old")
    before = stored_files(server)
    monkeypatch.setattr(storage, "_WRITEBACK_BYTES", MAX_CHUNK_BYTES)
    calls = [0]

    def failing_fdatasync(fd: int) -> None:
        calls[0] += 1
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(storage.os, "fdatasync", failing_fdatasync)
    with pytest.raises(SnapshotError) as err:
        client.put("s", blob(1, 4 * MAX_CHUNK_BYTES))
    assert err.value.code == grpc.StatusCode.INTERNAL and "I/O error" in err.value.message
    assert calls[0] >= 1
    assert stored_files(server) == before
    assert client.get("s").target == b"old"
