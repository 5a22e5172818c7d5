"""Generations and conditional Puts ("conditional-put"), on both backends (a local
directory and the S3 API on a real SeaweedFS): every commit of a name bumps its
generation by one; a Put that names the generation it expects commits only over that
one, else ABORTED with both generations and nothing stored; of racing conditional Puts
(threads of one server, or two servers on one bucket) exactly one wins. Then the
protocol both ways (old servers, old clients)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from snapshot_svc.client import SnapshotClient
from snapshot_svc.client.contract import MAX_CHUNK_BYTES
from snapshot_svc.errors import FailedPrecondition, GenerationConflict, Unavailable
from snapshot_svc.namelocks import NameLocks
from snapshot_svc.pb import snapshot_pb2 as pb
from snapshot_svc.pb import snapshot_pb2_grpc as pb_grpc
from snapshot_svc.server import SnapshotServer
from snapshot_svc.testing import ServerProcess, running_server
from tests.fixtures.snapshot_backends import BUCKET, s3_config
from tests.seaweed import SeaweedFS
from tests.snapkit import blob, sha
from tests.test_snapshot_s3 import stored, stored_blobs
from tests.test_snapshot_service import put_requests

pytestmark = pytest.mark.timeout(180)


@pytest.fixture()
def client(snapshot_client: SnapshotClient) -> SnapshotClient:
    """Here `client` is the snapshot service's (the suite's own `client` is the inference
    service's)."""
    return snapshot_client


def conflict_of(fn: Any) -> GenerationConflict:
    with pytest.raises(GenerationConflict) as err:
        fn()
    return err.value


def raw_put(address: str, msgs: list[pb.PutRequest]) -> tuple[grpc.StatusCode, str,
                                                              dict[str, str], int]:
    """(status, details, trailing metadata, generation answered) of a Put sent through
    generated stubs."""
    with grpc.insecure_channel(address) as ch:
        try:
            r = pb_grpc.SnapshotStub(ch).Put(iter(msgs), timeout=30)
        except grpc.RpcError as err:
            return err.code(), err.details(), dict(err.trailing_metadata() or ()), 0
    return grpc.StatusCode.OK, "", {}, r.generation


def with_expected(msgs: list[pb.PutRequest], expected: int) -> list[pb.PutRequest]:
    msgs[0].header.expected_generation = expected
    return msgs


# --- both backends ---------------------------------------------------------------------------


def test_every_commit_bumps_the_generation(client: SnapshotClient,
                                           server: SnapshotServer) -> None:
    assert client.conditional_writes
    res = client.put("a", b"first")
    assert res.generation == 1
    assert (client.stat("a").generation, client.get("a").info.generation) == (1, 1)
    assert client.put("a", blob(1, 3000), b"draft").generation == 2  # a paired save: one commit
    # a new draft for the current target is a commit of its own
    code, _, _, gen = raw_put(server.address, put_requests(
        "a", pb.PART_DRAFT, b"draft-2", target_sha256=sha(blob(1, 3000))))
    assert (code, gen) == (grpc.StatusCode.OK, 3)
    got = client.get("a")
    assert (got.info.generation, bytes(got.draft or b"")) == (3, b"draft-2")
    client.put("b", b"other")
    assert [(s.name, s.generation) for s in client.list()] == [("a", 3), ("b", 1)]
    # a deleted name starts again at 1
    client.delete("a")
    assert client.put("a", b"again").generation == 1


def test_a_conditional_put_commits_only_over_its_generation(client: SnapshotClient,
                                                            server: SnapshotServer) -> None:
    assert client.put("a", b"v1", expected_generation=0).generation == 1
    assert client.put("a", b"v2", b"d2", expected_generation=1).generation == 2
    before = client.stat("a")
    counts = stored(server)

    c = conflict_of(lambda: client.put("a", b"v3", expected_generation=1))
    assert (c.name, c.expected, c.stored, c.code) == ("a", 1, 2, grpc.StatusCode.ABORTED)
    assert c.message == "snapshot 'a' changed: expected generation 1, stored 2"
    c = conflict_of(lambda: client.put("a", b"v3", b"d3", expected_generation=0))
    assert (c.expected, c.stored) == (0, 2)
    c = conflict_of(lambda: client.put("new", b"x", expected_generation=4))
    assert c.message == "snapshot 'new' changed: expected generation 4, stored 0: no such snapshot"
    # nothing of the refused Puts was stored
    assert client.stat("a") == before
    got = client.get("a")
    assert (bytes(got.target), bytes(got.draft or b"")) == (b"v2", b"d2")
    assert stored(server) == counts
    assert [s.name for s in client.list()] == ["a"]
    assert client.put("a", b"v3", expected_generation=2).generation == 3


def test_a_put_that_loses_at_its_commit_stores_nothing(client: SnapshotClient,
                                                       server: SnapshotServer) -> None:
    """The early check passes; another commit lands while the data is still coming; the
    commit's own check refuses it (ABORTED, both generations in the trailers)."""
    client.put("a", b"v1")
    data = blob(7, 2 * MAX_CHUNK_BYTES + 5)
    msgs = with_expected(put_requests("a", pb.PART_TARGET, data), 1)
    halfway, go = threading.Event(), threading.Event()

    def requests() -> Iterator[pb.PutRequest]:
        yield from msgs[:2]
        halfway.set()
        assert go.wait(30)
        yield from msgs[2:]

    out: list[Any] = []

    def send() -> None:
        with grpc.insecure_channel(server.address) as ch:
            try:
                pb_grpc.SnapshotStub(ch).Put(requests(), timeout=60)
                out.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                out.append((err.code(), err.details(), dict(err.trailing_metadata())))

    t = threading.Thread(target=send)
    t.start()
    assert halfway.wait(30)
    assert client.put("a", b"v2").generation == 2  # unconditional: commits meanwhile
    go.set()
    t.join(60)
    assert out == [(grpc.StatusCode.ABORTED,
                    "snapshot 'a' changed: expected generation 1, stored 2",
                    {"warmslot-expected-generation": "1", "warmslot-stored-generation": "2"})]
    assert bytes(client.get("a").target) == b"v2" and client.stat("a").generation == 2
    assert stored(server) == {"blobs": stored(server)["blobs"], "manifests": 1, "staged": 0}
    assert stored_blobs(server) == [sha(b"v2")]  # the refused upload's bytes are nowhere


def test_racing_conditional_puts_in_one_server(server: SnapshotServer) -> None:
    """Eight writers expect the same generation at once: exactly one commits."""
    with SnapshotClient(server.address, timeout=30) as c:
        c.put("race", b"start")
    for rnd in range(3):
        results = race(server.address, "race", expected=rnd + 1, writers=8, seed=rnd)
        winners = [r for r in results if isinstance(r, int)]
        losers = [r for r in results if isinstance(r, GenerationConflict)]
        assert (winners, len(losers)) == ([rnd + 2], 7)
        assert {(x.expected, x.stored) for x in losers} == {(rnd + 1, rnd + 2)}
    with SnapshotClient(server.address, timeout=30) as c:
        assert c.stat("race").generation == 4


def race(addresses: str | list[str], name: str, *, expected: int, writers: int,
         seed: int) -> list[int | GenerationConflict]:
    """`writers` clients (each on its own channel, round robin over `addresses`) put
    `name` expecting `expected`, released together; each one's new generation or
    conflict."""
    addrs = [addresses] if isinstance(addresses, str) else addresses
    barrier = threading.Barrier(writers)
    out: list[int | GenerationConflict] = []
    lock = threading.Lock()

    def writer(w: int) -> None:
        with SnapshotClient(addrs[w % len(addrs)], timeout=60) as c:
            c.server_info()
            data = blob(1000 * seed + w, 20_000 + w)
            barrier.wait(30)
            try:
                r: int | GenerationConflict = c.put(name, data, b"draft-%d" % w,
                                                    expected_generation=expected).generation
            except GenerationConflict as exc:
                r = exc
            with lock:
                out.append(r)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert len(out) == writers
    return out


# --- what a backend keeps across restarts ----------------------------------------------------


def test_generations_survive_a_restart_local(tmp_path: Path) -> None:
    with running_server(tmp_path / "d") as srv, SnapshotClient(srv.address) as c:
        for i in range(3):
            c.put("a", b"v%d" % i)
    with running_server(tmp_path / "d") as srv, SnapshotClient(srv.address) as c:
        assert c.stat("a").generation == 3
        assert conflict_of(lambda: c.put("a", b"x", expected_generation=2)).stored == 3
        assert c.put("a", b"v3", expected_generation=3).generation == 4


def test_a_manifest_without_generation_reads_as_1_local(tmp_path: Path) -> None:
    """A snapshot stored before generations existed: generation 1 (it exists, so a Put
    expecting 0 is refused)."""
    with running_server(tmp_path / "d") as srv, SnapshotClient(srv.address) as c:
        c.put("old", b"v", b"d")
        c.put("old", b"v2")
    [path] = list((tmp_path / "d" / "manifests").iterdir())
    record = json.loads(path.read_text())
    assert record["generation"] == 2
    del record["generation"]
    path.write_text(json.dumps(record))
    with running_server(tmp_path / "d") as srv, SnapshotClient(srv.address) as c:
        assert c.stat("old").generation == 1
        assert conflict_of(lambda: c.put("old", b"x", expected_generation=0)).stored == 1
        assert c.put("old", b"v3", expected_generation=1).generation == 2


def test_generations_survive_a_restart_and_old_manifests_read_as_1_s3(
        s3env: SeaweedFS) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    with running_server(None, **s3_config(s3env, prefix)) as srv, \
            SnapshotClient(srv.address, timeout=30) as c:
        c.put("a", b"v1")
        c.put("a", b"v2", b"d2")
        c.put("old", b"o")
        s3 = srv.store.s3  # type: ignore[attr-defined]
        key = srv.store._manifest_key("old")  # type: ignore[attr-defined]
        record = json.loads(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        assert record["snapshot"]["generation"] == 1
        record["snapshot"]["generation"] = 7
        s3.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(record).encode())
        assert c.stat("old").generation == 7
        del record["snapshot"]["generation"]
        s3.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(record).encode())
    with running_server(None, **s3_config(s3env, prefix, "r2")) as srv, \
            SnapshotClient(srv.address, timeout=30) as c:
        assert [(s.name, s.generation) for s in c.list()] == [("a", 2), ("old", 1)]
        assert c.put("old", b"o2", expected_generation=1).generation == 2
        assert c.put("a", b"v3", expected_generation=2).generation == 3


# --- two servers on one bucket -------------------------------------------------------------


def test_two_servers_on_one_bucket_race_conditional_puts(
        s3env: SeaweedFS) -> None:
    """Conditional Puts through two snapshot services sharing a bucket: each round,
    exactly one of eight writers (four per server) commits, the others are ABORTED
    with the winner's generation; the stored snapshot is the winner's."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    assert s3env  # SeaweedFS answers conditional writes (checked at start-up)
    with running_server(None, **s3_config(s3env, prefix, "r1")) as a, \
            running_server(None, **s3_config(s3env, prefix, "r2")) as b:
        assert a.store.conditional_writes and b.store.conditional_writes
        with SnapshotClient(a.address, timeout=30) as c:
            assert c.put("shared", b"start", expected_generation=0).generation == 1
        for rnd in range(4):
            results = race([a.address, b.address], "shared", expected=rnd + 1, writers=8,
                           seed=rnd)
            winners = [i for i, r in enumerate(results) if isinstance(r, int)]
            assert [results[i] for i in winners] == [rnd + 2]
            assert sorted((r.expected, r.stored) for r in results
                          if isinstance(r, GenerationConflict)) == [(rnd + 1, rnd + 2)] * 7
        with SnapshotClient(b.address, timeout=30) as c:
            assert c.stat("shared").generation == 5
            got = c.get("shared")
            assert got.draft is not None and bytes(got.draft).startswith(b"draft-")


def test_unconditional_puts_through_two_servers_count_every_commit(
        s3env: SeaweedFS) -> None:
    """Unconditional Puts racing through two servers: a manifest write that loses is
    redone on top of the winner, so 12 saves make exactly generation 12."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    with running_server(None, **s3_config(s3env, prefix, "r1")) as a, \
            running_server(None, **s3_config(s3env, prefix, "r2")) as b:
        barrier = threading.Barrier(6)
        gens: list[int] = []

        def writer(w: int) -> None:
            with SnapshotClient((a, b)[w % 2].address, timeout=60) as c:
                c.server_info()
                barrier.wait(30)
                for i in range(2):
                    gens.append(c.put("n", blob(10 * w + i, 5000)).generation)

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert sorted(gens) == list(range(1, 13))
        with SnapshotClient(a.address) as c:
            assert c.stat("n").generation == 12


def test_a_store_without_conditional_writes_refuses_conditional_puts(
        s3env: SeaweedFS) -> None:
    """A store that ignores If-Match (the start-up check says so): the feature is not
    offered, the client refuses a conditional Put before sending it, and the server
    refuses one sent anyway (FAILED_PRECONDITION), storing nothing."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    with running_server(None, **s3_config(s3env, prefix)) as srv:
        srv.store.conditional_writes = False  # type: ignore[attr-defined]
        with SnapshotClient(srv.address, timeout=30) as c:
            assert not c.conditional_writes
            with pytest.raises(FailedPrecondition) as err:
                c.put("a", b"x", expected_generation=0)
            assert err.value.message == (
                f"conditional Put of 'a' (expected generation 0): the snapshot service at "
                f"{srv.address} has no conditional writes (no 'conditional-put' feature: an "
                "older server, or a store that ignores them); nothing was sent")
        code, details, _, _ = raw_put(srv.address,
                                      with_expected(put_requests("a", pb.PART_TARGET, b"x"), 0))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert details == (f"conditional Put of 'a': the store {srv.store.describe()} ignores "
                           "conditional writes")
        assert srv.store.list() == []


# --- the protocol both ways ------------------------------------------------------------------


def test_a_conditional_put_to_an_old_server_is_refused_not_sent(tmp_path: Path) -> None:
    """A --max-protocol 1 server behaves as an old one: it would ignore the expected
    generation and write unconditionally, so the client refuses."""
    with running_server(tmp_path / "v1", max_protocol=1) as v1, \
            SnapshotClient(v1.address) as c:
        assert (c.protocol, c.conditional_writes) == (1, False)
        c.put("a", b"v1")
        with pytest.raises(FailedPrecondition) as err:
            c.put("a", b"v2", expected_generation=1)
        assert "has no conditional writes" in err.value.message
        assert bytes(c.get("a").target) == b"v1"
        assert c.stat("a").generation == 0  # not reported
        # what the client protects against: the old server ignores the field
        code, _, _, gen = raw_put(v1.address,
                                  with_expected(put_requests("a", pb.PART_TARGET, b"v9"), 5))
        assert (code, gen) == (grpc.StatusCode.OK, 0)
        assert bytes(c.get("a").target) == b"v9"


def test_an_old_client_keeps_working_against_the_new_server(tmp_path: Path) -> None:
    """Clients that know nothing of generations (protocol 1; protocol 2 without the
    feature): their Puts commit unconditionally and still bump the generation."""
    with running_server(tmp_path / "v2") as srv:
        with SnapshotClient(srv.address, max_protocol=1) as old:
            assert not old.conditional_writes
            assert old.put("a", b"one", b"skipped").generation == 1
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SnapshotStub(ch)
            hello = stub.Hello(pb.HelloRequest(min_protocol=1, max_protocol=2,
                                               features=["sha256", "draft-sidecar",
                                                         "paired-commit", "sha256-trailer"]),
                               timeout=10)
            assert list(hello.features) == ["sha256", "draft-sidecar", "paired-commit",
                                            "sha256-trailer"]
            r = stub.Put(iter(put_requests("a", pb.PART_TARGET, b"two")), timeout=10)
            assert (r.committed, r.generation) == (True, 2)
            assert stub.Stat(pb.StatRequest(name="a"), timeout=10).snapshot.generation == 2
        with SnapshotClient(srv.address) as new:
            assert new.conditional_writes
            assert new.put("a", b"three", expected_generation=2).generation == 3


def test_a_staged_target_that_would_lose_is_refused_before_its_data(tmp_path: Path) -> None:
    """A paired save expecting a stale generation: its target is refused at the header
    (nothing staged, no byte received), the draft never sent."""
    with running_server(tmp_path / "d") as srv, SnapshotClient(srv.address) as c:
        c.put("a", b"v1")
        c.put("a", b"v2")
        big = blob(3, 3 * MAX_CHUNK_BYTES)
        with pytest.raises(GenerationConflict):
            c.put("a", big, b"draft", expected_generation=1)
        assert srv.metrics.bytes_received.labels("target")._value.get() == 4
        assert srv.store._staged == {}  # type: ignore[attr-defined]
        assert [p.name for p in srv.store.tmp.iterdir()  # type: ignore[attr-defined]
                if not p.name.startswith("spare-")] == []


@pytest.mark.parametrize("paired", [False, True])
def test_a_retried_put_that_had_committed_is_not_a_conflict(tmp_path: Path,
                                                            paired: bool) -> None:
    """The first attempt commits and its answer is lost (UNAVAILABLE): the retry finds
    the snapshot one generation on, holding exactly its bytes, and reports success."""
    with running_server(tmp_path / "d") as srv, \
            SnapshotClient(srv.address, backoff=0.01) as c:
        c.put("a", b"v1")
        real_finish = srv.store.finish_put
        lost: list[int] = []

        def finish_then_fail(upload: Any) -> Any:
            out = real_finish(upload)
            if out.committed and not lost:
                lost.append(out.generation)
                raise Unavailable("the answer was lost")
            return out

        srv.store.finish_put = finish_then_fail  # type: ignore[method-assign]
        draft = b"d2" if paired else None
        res = c.put("a", b"v2", draft, expected_generation=1)
        assert (lost, res.generation) == ([2], 2)
        assert (res.target.sha256, res.draft.sha256 if res.draft else "") == (
            sha(b"v2"), sha(b"d2") if paired else "")
        assert c.stat("a").generation == 2
        # different bytes over the same generation: a real conflict; the same bytes: the
        # state this Put wanted is the stored one
        assert conflict_of(lambda: c.put("a", b"v3", draft, expected_generation=1)).stored == 2
        assert c.put("a", b"v2", draft, expected_generation=1).generation == 2
        assert c.stat("a").generation == 2


def test_name_locks_take_turns_per_name_and_are_bounded() -> None:
    locks = NameLocks(timeout_s=0.2)
    with locks.hold("a"):
        with locks.hold("b"):  # another name: its own lock
            assert (locks.users("a"), locks.users("b")) == (1, 1)
        with pytest.raises(Unavailable) as err:
            with locks.hold("a"):
                pass
        assert err.value.message == "another commit of 'a' held it for 0.2 s"
    assert (locks.users("a"), locks.users("b")) == (0, 0)
    assert locks._locks == {}  # nothing kept for names nobody commits


def test_two_service_processes_on_one_bucket_race_conditional_puts(
        s3env: SeaweedFS) -> None:
    """The same race between two `python -m snapshot_svc` processes: one winner a round."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    args = ("--store", f"s3://{BUCKET}/{prefix}", "--s3-endpoint", s3env.endpoint)
    with ServerProcess(None, *args, "--replica-id", "p1", env=s3env.env()) as p1, \
            ServerProcess(None, *args, "--replica-id", "p2", env=s3env.env()) as p2:
        for rnd in range(2):
            results = race([p1.address, p2.address], "proc", expected=rnd, writers=6,
                           seed=10 + rnd)
            assert sorted(r for r in results if isinstance(r, int)) == [rnd + 1]
            assert sorted((r.expected, r.stored) for r in results
                          if isinstance(r, GenerationConflict)) == [(rnd, rnd + 1)] * 5
