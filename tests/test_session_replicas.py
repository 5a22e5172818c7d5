"""Replicas sharing sessions through one snapshot service: the store's generations decide.

Two inference replicas (one slot each) and one snapshot service, in-process, on a local
directory and on S3 (a real SeaweedFS: its conditional writes carry the generations). Each
scenario sends a session's turns to either replica and checks that a turn continues the
newest acknowledged state (its tokens equal a never-evicted server's for the same
turns), that no stop writes an older state over a newer one, and that a replica whose
own turns were overtaken reports it (ABORTED naming both generations) instead of
losing them silently."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient, make_chat_request, make_request
from snapshot_svc.client import SnapshotClient
from snapshot_svc.clientlib.errors import NotFound
from snapshot_svc.testing import running_server
from tests.fixtures.servicekit import running
from tests.fixtures.snapshot_backends import BACKENDS, serve_on
from tests.resumekit import wait_until
from tests.test_sessions import (
    SLOT,
    STORE,
    client,
    config,
    listed,
    prompts,
    reference,
    spec,
    turn,
)

TEXTS_WORDS = ("the robot looked at a small red door and then it said that they went home "
               "after a while").split()


def replica(snap_addr: str, name: str, **kw: object) -> object:
    base: dict[str, object] = dict(snapshot_addr=snap_addr, instance_id=name,
                                   session_write_through=True)
    base.update(kw)
    return running(config(**base))


def store_generation(snap_addr: str, name: str) -> int:
    """The snapshot service's generation of session `name` (0: none stored)."""
    with SnapshotClient(snap_addr) as c:
        try:
            return c.stat(f"session~~{name}").generation
        except NotFound:
            return 0


def stored_tokens(snap_addr: str, name: str) -> int:
    """The tokens of the state the snapshot service holds for session `name` (-1: none)."""
    with SnapshotClient(snap_addr) as c:
        try:
            return c.stat(f"session~~{name}").target.meta.n_tokens
        except NotFound:
            return -1


def generation(snap_addr: str) -> int:
    return store_generation(snap_addr, "s")


def written_through(srv: Server, n: int) -> bool:
    value = srv.metrics.registry.get_sample_value(
        "warmslot_session_store_writes_total", {"kind": "write_through"})
    return (value or 0) >= n


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The reference: one server with a slot for every session."""
    with running(config(slots=4, slot_save_path=tmp_path_factory.mktemp("wide"))) as srv:
        yield srv


@pytest.fixture(params=BACKENDS)
def snap(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The shared snapshot service, on a local directory and on S3 (SeaweedFS)."""
    with serve_on(request.param, request, tmp_path) as s:
        yield s.address


@pytest.fixture()
def local_snap(tmp_path: Path) -> Iterator[str]:
    with running_server(tmp_path / "snap") as s:
        yield s.address


def test_turns_alternating_between_replicas_continue_each_other(
        snap: str, wide: Server, tmp_path: Path) -> None:
    """Turn 1 on A, turn 2 on B, turn 3 on A, stop A then B, turn 4 on a new replica:
    every turn continues the one before it, and the last stop does not write an older
    copy over the newer one."""
    with replica(snap, "a") as ra, replica(snap, "b") as rb, \
            client(ra) as ca, client(rb) as cb:
        p = prompts(ca)
        out = [spec(*turn(ca, "s", p[0]))]
        wait_until(lambda: generation(snap) == 1)
        toks, t = turn(cb, "s", p[1])
        assert (t.session_tier, t.cache_n, t.prompt_n) == (STORE, len(p[0]) + 10, len(p[1]))
        out.append(spec(toks, t))
        wait_until(lambda: generation(snap) == 2)
        toks, t = turn(ca, "s", p[2])  # A's slot holds turn 1 only: the store's copy wins
        assert (t.session_tier, t.cache_n) == (STORE, len(p[0]) + len(p[1]) + 20)
        out.append(spec(toks, t))
        wait_until(lambda: generation(snap) == 3)
    # both stopped (A first, then B, whose slot held turn 2 only): generation 3 stays
    assert generation(snap) == 3
    with replica(snap, "c") as rc, client(rc) as cc:
        toks, t = turn(cc, "s", p[3])
        assert (t.session_tier, t.cache_n) == (STORE, sum(len(x) for x in p[:3]) + 30)
        out.append(spec(toks, t))
    assert out == reference(wide, "ref-alternate", p[:4])


def test_a_replica_lists_the_store_copy_of_a_session_another_replica_moved_on(
        local_snap: str) -> None:
    """Turn 1 on A, turn 2 on B: A's slot still holds turn 1, but A lists the session as
    the store holds it (B's state), and lists it from its slot again once it continues."""
    with replica(local_snap, "a") as ra, replica(local_snap, "b") as rb, \
            client(ra) as ca, client(rb) as cb:
        p = prompts(ca)
        turn(ca, "s", p[0])
        wait_until(lambda: generation(local_snap) == 1)
        assert listed(ca) == {"s": (len(p[0]) + 10, SLOT)}
        turn(cb, "s", p[1])
        wait_until(lambda: generation(local_snap) == 2)
        two = len(p[0]) + len(p[1]) + 20
        assert listed(cb) == {"s": (two, SLOT)}
        assert listed(ca) == {"s": (two, STORE)}  # not A's stale slot copy of turn 1
        _, t = turn(ca, "s", p[2])
        assert (t.session_tier, t.cache_n) == (STORE, two)
        assert listed(ca) == {"s": (two + len(p[2]) + 10, SLOT)}


def test_a_replica_that_stored_a_session_continues_from_the_other_replicas_turn(
        snap: str, wide: Server) -> None:
    """A evicts the session to the store, B continues it, A's next turn restores B's
    state, not the copy A wrote."""
    with replica(snap, "a", session_ram_mb=0, session_write_through=False) as ra, \
            replica(snap, "b") as rb, client(ra) as ca, client(rb) as cb:
        p = prompts(ca)
        out = [spec(*turn(ca, "s", p[0]))]
        turn(ca, "other", p[3])  # the one slot goes to "other": s goes to the store
        wait_until(lambda: generation(snap) == 1)
        out.append(spec(*turn(cb, "s", p[1])))
        wait_until(lambda: generation(snap) == 2)
        toks, t = turn(ca, "s", p[2])
        assert (t.session_tier, t.cache_n) == (STORE, len(p[0]) + len(p[1]) + 20)
        out.append(spec(toks, t))
    assert out == reference(wide, "ref-evicted", p[:3])


def test_overtaken_own_turns_are_reported_not_lost_silently(snap: str, wide: Server) -> None:
    """A without write-through holds turn 2 only in its slot over the store's turn 1;
    B continues from turn 1 and writes. A's next turn gets ABORTED naming the session
    and both generations; the turn after continues B's state, and A's turn 2 never
    comes back."""
    with replica(snap, "a", session_write_through=False, session_ram_mb=0) as ra, \
            replica(snap, "b") as rb, client(ra) as ca, client(rb) as cb:
        p = prompts(ca)
        turn(ca, "s", p[0])
        turn(ca, "other", p[3])  # s (turn 1) goes to the store: generation 1
        wait_until(lambda: generation(snap) == 1)
        turn(ca, "s", p[1])  # A: turn 2, in its slot only
        b_toks = spec(*turn(cb, "s", p[2]))  # B continues from turn 1: generation 2
        wait_until(lambda: generation(snap) == 2 and written_through(rb, 1))
        with pytest.raises(grpc.RpcError) as err:
            turn(ca, "s", p[3])
        assert err.value.code() == grpc.StatusCode.ABORTED
        msg = err.value.details() or ""
        assert "'s'" in msg and "generation 2" in msg and "generation 1" in msg, msg
        toks, t = turn(ca, "s", p[3])
        assert (t.session_tier, t.cache_n) == (STORE, len(p[0]) + len(p[2]) + 20)
        a_toks = spec(toks, t)
    # A's dropped turn 2 never came back: after both stops the session is turns 1, 3, 4
    with replica(snap, "c") as rc, client(rc) as cc:
        toks, t = turn(cc, "s", p[1])
        assert (t.session_tier, t.cache_n) == (STORE, len(p[0]) + len(p[2]) + len(p[3]) + 30)
        c_toks = spec(toks, t)
    assert [b_toks, a_toks, c_toks] == reference(wide, "ref-overtaken",
                                                 [p[0], p[2], p[3], p[1]])[1:]


def test_write_through_lets_another_replica_continue_and_a_late_stop_writes_nothing(
        snap: str, wide: Server) -> None:
    """Each turn is in the store once written through, so another replica continues
    from A's last turn while A still holds it (as after A is killed), and A's later stop
    does not write its older copy over the other replica's turn."""
    with replica(snap, "a") as ra, client(ra) as ca:
        p = prompts(ca)
        out = [spec(*turn(ca, "s", p[0])), spec(*turn(ca, "s", p[1]))]
        wait_until(lambda: generation(snap) == 2)
        with replica(snap, "b") as rb, client(rb) as cb:
            toks, t = turn(cb, "s", p[2])
            assert (t.session_tier, t.cache_n) == (STORE, len(p[0]) + len(p[1]) + 20)
            out.append(spec(toks, t))
            wait_until(lambda: generation(snap) == 3)
    assert generation(snap) == 3  # B's stop had nothing newer; A's lost the race
    assert out == reference(wide, "ref-crash", p[:3])


def test_an_older_snapshot_service_is_named_in_a_warning_and_sessions_still_work(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A snapshot service without generations (protocol 1 here, as an older version):
    the replica says at start that replicas sharing it can overwrite each other's
    sessions, and its own sessions are written unconditionally as before."""
    with running_server(tmp_path / "v1", max_protocol=1) as old, \
            replica(old.address, "a") as ra, client(ra) as ca:
        wait_until(lambda: any("keeps no generations" in r.getMessage()
                               for r in caplog.records))
        warning = next(r for r in caplog.records if "keeps no generations" in r.getMessage())
        assert warning.levelname == "WARNING"
        assert warning.getMessage().startswith(
            f"the store snapshot:{old.address} keeps no generations")
        p = prompts(ca)
        turn(ca, "s", p[0])
        wait_until(lambda: written_through(ra, 1))
        assert store_generation(old.address, "s") == 0  # an old service reports none


def test_random_turns_on_two_replicas_with_restarts_lose_nothing(local_snap: str) -> None:
    """8 sessions, 80 turns each sent to a random replica (seeded), each replica
    restarted once in the middle: every turn continues exactly the session's
    acknowledged history (its cache_n is that history's length) and the history's last
    turn is what a new replica finds. A client here moves to the other replica only once
    the previous turn's state is written through (the rules above say what happens in
    the milliseconds before)."""
    snap = local_snap
    rng = random.Random(20261203)
    names = [f"r{i}" for i in range(8)]
    history = dict.fromkeys(names, 0)  # tokens each session holds after its acked turns
    last = dict.fromkeys(names, "")  # the replica of each session's last turn
    with contextlib.ExitStack() as stack:
        servers = {r: stack.enter_context(replica(snap, r, ctx=2048)) for r in ("a", "b")}
        clients = {r: stack.enter_context(client(s)) for r, s in servers.items()}
        vocab = clients["a"].tokenize(" ".join(TEXTS_WORDS))
        for step in range(640):
            if step in (200, 400):  # a restart: its stop saves, its start finds them
                r = "a" if step == 200 else "b"
                clients[r].close()
                servers[r].stop(1.0)
                servers[r] = stack.enter_context(replica(snap, r, ctx=2048))
                clients[r] = stack.enter_context(client(servers[r]))
            name = rng.choice(names)
            r = rng.choice(("a", "b"))
            if last[name] not in ("", r):  # the other replica finds the last turn once written
                wait_until(lambda nm=name: stored_tokens(snap, nm) == history[nm])
            last[name] = r
            prompt = [rng.choice(vocab) for _ in range(rng.randint(1, 4))]
            toks, t = turn(clients[r], name, prompt, n=4)
            assert t.cache_n == history[name], (step, name, r)
            history[name] += len(prompt) + len(toks)
    with replica(snap, "c", ctx=2048) as rc, client(rc) as cc:
        for name in names:
            wait_until(lambda nm=name: stored_tokens(snap, nm) == history[nm])
            _, t = turn(cc, name, [vocab[0]], n=1)
            assert (t.session_tier, t.cache_n) == (STORE, history[name])


def test_the_client_names_the_session_for_a_router() -> None:
    """Generate and Chat of a session carry `x-session-id` metadata (what a router
    hashes); a request without a session carries none."""
    seen: list[dict[str, str]] = []

    def record(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        seen.append(dict(context.invocation_metadata()))
        return iter(())

    handler = grpc.method_handlers_generic_handler("warmslot.inference.v1.Inference", {
        m: grpc.unary_stream_rpc_method_handler(record) for m in ("Generate", "Chat")})
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with InferenceClient(f"127.0.0.1:{port}", timeout=10) as c:
            list(c.generate_stream(make_request("x", session="s-1")))
            list(c.chat_stream(make_chat_request([("user", "hi")], session="s-2")))
            list(c.generate_stream(make_request("x")))
    finally:
        server.stop(0)
    assert [d.get("x-session-id") for d in seen] == ["s-1", "s-2", None]


def test_with_ack_stored_a_turn_ends_only_once_its_state_is_stored(
        snap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--session-ack-stored: while the store holds the turn's write back, the turn's
    stream does not end; once the write is through, it ends and the store has the
    turn (so a replica killed after answering has lost nothing answered)."""
    from inference_svc.storage.snapshot_store import SnapshotStore

    entered, release = threading.Event(), threading.Event()
    save_if = SnapshotStore.save_if

    def held_back(self: SnapshotStore, *a: object, **kw: object) -> int:
        entered.set()
        assert release.wait(30)
        return save_if(self, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(SnapshotStore, "save_if", held_back)
    with replica(snap, "a", session_ack_stored=True) as ra, client(ra) as ca:
        p = prompts(ca)
        done: list[tuple[list[int], object]] = []
        t = threading.Thread(target=lambda: done.append(turn(ca, "s", p[0])))
        t.start()
        assert entered.wait(30)
        t.join(0.5)
        assert t.is_alive() and not done  # the answer waits for the write
        release.set()
        t.join(30)
        toks, _ = done[0]
        assert stored_tokens(snap, "s") == len(p[0]) + len(toks)  # no waiting here
