"""Sessions through real gRPC with the bundled toy pair: a session's turn after it was
moved to the RAM tier or the store processes exactly its new tokens, with the output and
the speculative acceptance of a session that never left its slot; concurrent turns of
one session; deletion from every tier; restart; another replica through a snapshot
service; per-key isolation; metrics; and every bad input."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient, make_request
from inference_svc.pb import inference_pb2 as pb
from snapshot_svc.clientlib.auth import key_id
from snapshot_svc.testing import running_server
from tests.fixtures.servicekit import SLOW, model_pair, running, service_config
from tests.resumekit import DRAFT, TARGET, wait_until
from tests.seckit import write_keys

N = 10  # tokens generated per turn
TEXTS = ("The little robot looked at the", " and then it said that", " so they went to",
         " after a while the")
SLOT, RAM, STORE, NEW = (pb.SESSION_TIER_SLOT, pb.SESSION_TIER_RAM, pb.SESSION_TIER_STORE,
                         pb.SESSION_TIER_NEW)


def config(**kw: object) -> object:
    # write-through off: these tests follow a session down the tiers (it has its own tests)
    base: dict[str, object] = dict(slots=1, ctx=256, session_ram_mb=64, instance_id="t",
                                   session_write_through=False)
    base.update(kw)
    return service_config(TARGET, DRAFT, **base)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The reference: a slot for every session, nothing ever leaves its slot."""
    with running(config(slots=4, slot_save_path=tmp_path_factory.mktemp("wide"))) as srv:
        yield srv


def client(srv: Server, key: str | None = None) -> InferenceClient:
    return InferenceClient(f"127.0.0.1:{srv.port}", timeout=60, api_key=key)


def turn(c: InferenceClient, session: str, prompt: list[int],
         n: int = N) -> tuple[list[int], pb.Timings]:
    rs = list(c.generate_stream(make_request(prompt, max_tokens=n, temperature=0.0,
                                             session=session)))
    assert rs[-1].done
    return [t for r in rs for t in r.tokens], rs[-1].timings


def listed(c: InferenceClient) -> dict[str, tuple[int, int]]:
    return {s.name: (s.n_tokens, s.tier) for s in c.sessions()}


def reference(wide: Server, name: str, prompts: list[list[int]]) -> list[tuple]:
    """spec(tokens, timings) of each turn on the never-evicted server."""
    out = []
    with client(wide) as c:
        for p in prompts:
            out.append(spec(*turn(c, name, p)))
        c.delete_session(name)
    return out


def spec(tokens: list[int], tm: pb.Timings) -> tuple:
    """A turn's output and speculative counts (the draft's catch-up tokens included:
    a draft restored with its session has none to catch up)."""
    return tokens, tm.draft_n, tm.draft_n_accepted, tm.draft_prompt_n


def prompts(c: InferenceClient) -> list[list[int]]:
    return [c.tokenize(t) for t in TEXTS]


def code(fn: object, *args: object) -> grpc.StatusCode:
    try:
        fn(*args)  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def store_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("session~"))


def sample(srv: Server, name: str, **labels: str) -> float:
    return srv.metrics.registry.get_sample_value(name, labels) or 0.0


# ------------------------------------------------------------------ eviction and return

@pytest.mark.parametrize("tier", ["ram", "store"])
def test_a_session_comes_back_with_only_its_new_tokens(tier: str, wide: Server,
                                                       tmp_path: Path) -> None:
    ram_mb = 64 if tier == "ram" else 0
    with running(config(slot_save_path=tmp_path, session_ram_mb=ram_mb)) as srv, \
            client(srv) as c:
        p = prompts(c)
        a1, t1 = turn(c, "a", p[0])
        assert (t1.session_tier, t1.prompt_n, t1.cache_n) == (NEW, len(p[0]), 0)
        b1, tb = turn(c, "b", p[1])  # the one slot goes to b: a moves down
        assert tb.session_tier == NEW and tb.id_slot == t1.id_slot
        want = RAM if tier == "ram" else STORE
        wait_until(lambda: listed(c)["a"][1] == want)
        assert listed(c) == {"a": (len(p[0]) + N, want), "b": (len(p[1]) + N, SLOT)}
        assert store_files(tmp_path) == ([] if tier == "ram" else ["session~~a",
                                                                   "session~~a.drft"])
        gauges = {"slot": 1.0, "ram": 1.0 if tier == "ram" else 0.0,
                  "store": 0.0 if tier == "ram" else 1.0}
        wait_until(lambda: {k: sample(srv, "warmslot_sessions", tier=k) for k in gauges}
                   == gauges)
        a2, t2 = turn(c, "a", p[2])
        assert (t2.session_tier, t2.prompt_n, t2.cache_n) == (want, len(p[2]),
                                                               len(p[0]) + N)
        wait_until(lambda: listed(c)["b"][1] == want)
        b2, tb2 = turn(c, "b", p[3])
        assert (tb2.session_tier, tb2.prompt_n) == (want, len(p[3]))
        got_a = [spec(a1, t1), spec(a2, t2)]
        got_b = [spec(b1, tb), spec(b2, tb2)]
        assert sample(srv, "warmslot_session_evictions_total", kind="slot_to_ram") == 3
        assert sample(srv, "warmslot_session_restores_total", tier=tier) == 2
        assert sample(srv, "warmslot_session_restore_seconds_count", tier=tier) == 2
        if tier == "store":
            assert sample(srv, "warmslot_session_evictions_total", kind="ram_to_store") >= 2
    assert got_a == reference(wide, "ref-a-" + tier, [p[0], p[2]])
    assert got_b == reference(wide, "ref-b-" + tier, [p[1], p[3]])
    assert all(g[1] > 0 for g in got_a + got_b)  # speculation ran on every turn


def test_without_a_store_the_ram_tier_is_the_last(tmp_path: Path) -> None:
    with running(config(session_ram_mb=0)) as srv, client(srv) as c:
        p = prompts(c)
        turn(c, "a", p[0])
        turn(c, "b", p[1])
        wait_until(lambda: "a" not in listed(c))
        assert sample(srv, "warmslot_session_evictions_total", kind="dropped") == 1
        _, t = turn(c, "a", p[2])
        assert (t.session_tier, t.cache_n, t.prompt_n) == (NEW, 0, len(p[2]))


def test_requests_without_a_session_keep_their_behaviour_and_displace_none(
        tmp_path: Path) -> None:
    with running(config(slots=2, slot_save_path=tmp_path)) as srv, client(srv) as c:
        p = prompts(c)
        turn(c, "a", p[0])
        rs, last = c.generate(p[1], max_tokens=N, temperature=0.0)
        assert last.timings.session_tier == pb.SESSION_TIER_UNSPECIFIED
        assert last.timings.id_slot == 1  # the free slot, not the session's
        rs, again = c.generate(p[1], max_tokens=N, temperature=0.0)
        assert (again.timings.id_slot, again.timings.cache_n) == (1, len(p[1]) - 1)
        # a request for the session's slot by number moves the session to RAM first
        rs, pinned = c.generate(p[2], max_tokens=N, temperature=0.0, id_slot=0)
        assert (pinned.timings.cache_n, pinned.timings.prompt_n) == (0, len(p[2]))
        assert listed(c) == {"a": (len(p[0]) + N, RAM)}
        _, t = turn(c, "a", p[3])
        assert (t.session_tier, t.prompt_n, t.cache_n) == (RAM, len(p[3]), len(p[0]) + N)


# ------------------------------------------------------------------ concurrency

def test_concurrent_turns_of_one_session_run_one_after_the_other(tmp_path: Path) -> None:
    with running(config(slots=2, slot_save_path=tmp_path)) as srv, client(srv) as c:
        p = prompts(c)
        turn(c, "a", p[0])
        n0 = len(p[0]) + N
        results: dict[int, tuple[list[int], pb.Timings]] = {}
        start = threading.Barrier(2)

        def run(i: int) -> None:
            with client(srv) as ci:
                start.wait()
                results[i] = turn(ci, "a", p[1 + i], n=40)

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        (_, x), (_, y) = results[0], results[1]
        assert x.id_slot == y.id_slot  # one slot for the session
        first, second = (x, y) if x.cache_n < y.cache_n else (y, x)
        assert first.cache_n == n0 and first.session_tier == SLOT
        assert second.cache_n == n0 + first.prompt_n + 40 and second.session_tier == SLOT
        assert listed(c) == {"a": (n0 + len(p[1]) + len(p[2]) + 80, SLOT)}


# ------------------------------------------------------------------ deletion

def test_deletion_removes_a_session_from_every_tier(tmp_path: Path) -> None:
    with running(config(slots=1, session_ram_mb=0, slot_save_path=tmp_path)) as srv, \
            client(srv) as c:
        p = prompts(c)
        turn(c, "a", p[0])
        turn(c, "b", p[1])  # a goes to the store
        wait_until(lambda: listed(c)["a"][1] == STORE)
        turn(c, "a", p[2])  # back in the slot; its older copy stays in the store
        wait_until(lambda: listed(c)["b"][1] == STORE)
        assert store_files(tmp_path) == ["session~~a", "session~~a.drft", "session~~b",
                                         "session~~b.drft"]
        r = c.delete_session("a")
        assert (r.name, r.n_tokens) == ("a", len(p[0]) + len(p[2]) + 2 * N)
        assert list(r.removed_from) == [SLOT, STORE]
        assert c.slots()[0].n_tokens == 0
        assert store_files(tmp_path) == ["session~~b", "session~~b.drft"]
        assert code(c.delete_session, "a") == grpc.StatusCode.NOT_FOUND
        r = c.delete_session("b")
        assert list(r.removed_from) == [STORE] and r.n_tokens == len(p[1]) + N
        assert listed(c) == {} and store_files(tmp_path) == []
        _, t = turn(c, "a", p[3])  # a deleted session never comes back
        assert (t.session_tier, t.cache_n) == (NEW, 0)
    # nor after a restart
    assert store_files(tmp_path) == ["session~~a", "session~~a.drft"]
    with running(config(slot_save_path=tmp_path)) as srv, client(srv) as c:
        assert listed(c) == {"a": (len(p[3]) + N, STORE)}
        assert list(c.delete_session("a").removed_from) == [STORE]
    assert store_files(tmp_path) == []


def test_deleting_a_session_held_in_ram(tmp_path: Path) -> None:
    with running(config(slot_save_path=tmp_path)) as srv, client(srv) as c:
        p = prompts(c)
        turn(c, "a", p[0])
        turn(c, "b", p[1])
        assert listed(c)["a"] == (len(p[0]) + N, RAM)
        r = c.delete_session("a")
        assert list(r.removed_from) == [RAM] and r.n_tokens == len(p[0]) + N
        assert listed(c) == {"b": (len(p[1]) + N, SLOT)}
    assert store_files(tmp_path) == ["session~~b", "session~~b.drft"]  # saved at stop


# ------------------------------------------------------------------ restart, replicas

def test_sessions_survive_a_restart(wide: Server, tmp_path: Path) -> None:
    with running(config(slot_save_path=tmp_path)) as srv, client(srv) as c:
        p = prompts(c)
        a1, _ = turn(c, "a", p[0])
        turn(c, "b", p[1])  # a in RAM, b in the slot
    # both saved under their names; the slot's own auto-save does not keep b twice
    assert sorted(x.name for x in tmp_path.iterdir()) == [
        "session~~a", "session~~a.drft", "session~~b", "session~~b.drft"]
    with running(config(slot_save_path=tmp_path)) as srv, client(srv) as c:
        assert listed(c) == {"a": (len(p[0]) + N, STORE), "b": (len(p[1]) + N, STORE)}
        a2, t = turn(c, "a", p[2])
        assert (t.session_tier, t.prompt_n, t.cache_n) == (STORE, len(p[2]), len(p[0]) + N)
        got = [a1, spec(a2, t)]
    ref = reference(wide, "ref-restart", [p[0], p[2]])
    assert got[0] == ref[0][0] and got[1] == ref[1]


def test_a_session_moves_to_another_replica_through_the_snapshot_service(
        wide: Server, tmp_path: Path) -> None:
    with running_server(tmp_path / "snap") as snap, \
            running(config(snapshot_addr=snap.address, session_ram_mb=0,
                           instance_id="a")) as ra, \
            running(config(snapshot_addr=snap.address, instance_id="b")) as rb, \
            client(ra) as ca, client(rb) as cb:
        p = prompts(ca)
        s1, _ = turn(ca, "s", p[0])
        turn(ca, "other", p[1])  # replica A writes s to the snapshot service
        wait_until(lambda: listed(ca)["s"][1] == STORE)
        assert listed(cb)["s"] == (len(p[0]) + N, STORE)
        s2, t = turn(cb, "s", p[2])
        assert (t.session_tier, t.prompt_n, t.cache_n) == (STORE, len(p[2]), len(p[0]) + N)
        got = [s1, spec(s2, t)]
    ref = reference(wide, "ref-replica", [p[0], p[2]])
    assert got[0] == ref[0][0] and got[1] == ref[1]


# ------------------------------------------------------------------ keys

def test_a_user_key_sees_only_its_own_sessions(tmp_path: Path) -> None:
    u1, u2, admin = "user-one-0123456789", "user-two-0123456789", "the-admin-0123456789"
    keys = write_keys(tmp_path / "keys", {u1: "user", u2: "user", admin: "admin"})
    with running(config(slots=2, slot_save_path=tmp_path / "s", api_keys=keys)) as srv, \
            client(srv, u1) as c1, client(srv, u2) as c2, client(srv, admin) as ca:
        p = prompts(c1)
        turn(c1, "chat", p[0])
        _, t = turn(c2, "chat", p[1])  # the same name: another key's own session
        assert (t.session_tier, t.cache_n) == (NEW, 0)
        assert listed(c1) == {"chat": (len(p[0]) + N, SLOT)}
        assert listed(c2) == {"chat": (len(p[1]) + N, SLOT)}
        assert sorted((s.owner, s.name) for s in ca.sessions()) == sorted(
            [(key_id(u1), "chat"), (key_id(u2), "chat")])
        assert code(c2.delete_session, "chat", key_id(u1)) == grpc.StatusCode.NOT_FOUND
        assert list(c2.delete_session("chat").removed_from) == [SLOT]
        assert code(c2.delete_session, "chat") == grpc.StatusCode.NOT_FOUND
        assert listed(c1) == {"chat": (len(p[0]) + N, SLOT)}
        assert list(ca.delete_session("chat", key_id(u1)).removed_from) == [SLOT]
        assert ca.sessions() == []


# ------------------------------------------------------------------ bad input

@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(config(slot_save_path=tmp_path_factory.mktemp("plain"))) as srv:
        yield srv


@pytest.mark.parametrize(("fields", "needle"), [
    ({"session": ""}, "bad session name ''"),
    ({"session": "a/b"}, "bad session name 'a/b'"),
    ({"session": ".."}, "bad session name '..'"),
    ({"session": "x" * 234}, "longer than 233 bytes"),
    ({"session": "s", "id_slot": 0}, "cannot set id_slot"),
    ({"session": "s", "truncate_prompt": True}, "cannot set truncate_prompt"),
    ({"session": "s", "cache_prompt": False}, "cannot set cache_prompt false"),
])
def test_bad_session_requests(plain: Server, fields: dict, needle: str) -> None:
    with client(plain) as c:
        req = make_request([1, 2, 3], max_tokens=2, **fields)
        with pytest.raises(grpc.RpcError) as err:
            list(c.generate_stream(req))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details()
        assert c.sessions() == []


def test_bad_delete_and_slot_file_names(plain: Server) -> None:
    with client(plain) as c:
        for name, want in (("nope", grpc.StatusCode.NOT_FOUND),
                           ("a/b", grpc.StatusCode.INVALID_ARGUMENT),
                           ("", grpc.StatusCode.INVALID_ARGUMENT)):
            assert code(c.delete_session, name) == want, name
        turn(c, "s", [5, 6, 7])
        for op in (c.save, c.restore):
            with pytest.raises(grpc.RpcError) as err:
                op(0, "session~~s")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "are sessions'" in err.value.details()
        c.delete_session("s")


def test_a_turn_that_does_not_fit_is_refused_and_the_session_kept(plain: Server) -> None:
    with client(plain) as c:
        prompt = list(range(10, 110))
        turn(c, "full", prompt, n=100)
        with pytest.raises(grpc.RpcError) as err:
            turn(c, "full", [7] * 50, n=20)  # 200 + 50 + 20 > 256
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "session 'full' holds 200 tokens" in err.value.details()
        assert listed(c)["full"] == (200, SLOT)
        _, t = turn(c, "full", [7] * 5, n=5)
        assert (t.prompt_n, t.cache_n) == (5, 200)
        c.delete_session("full")


def test_the_command_line_continues_lists_and_deletes_sessions(
        plain: Server, capsys: pytest.CaptureFixture[str]) -> None:
    from inference_svc import client as cli

    addr = ["--addr", f"127.0.0.1:{plain.port}"]
    for text, tier in (("Once upon a time", "new"), (" there was", "slot")):
        assert cli.main([*addr, "generate", text, "--session", "cli", "--max-tokens", "4",
                         "--temperature", "0"]) == 0
        err = capsys.readouterr().err
        assert f"session from {tier}]" in err
    with client(plain) as c:
        n = listed(c)["cli"][0]
    assert cli.main([*addr, "sessions"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["name"], r["nTokens"], r["tier"], r["idSlot"], r["busy"], r["owner"])
            for r in rows] == [("cli", n, "SESSION_TIER_SLOT", 0, False, "")]
    assert cli.main([*addr, "delete-session", "cli"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["name"], out["nTokens"], out["removedFrom"]) == ("cli", n,
                                                                 ["SESSION_TIER_SLOT"])
    assert cli.main([*addr, "delete-session", "cli"]) == 1
    assert capsys.readouterr().err == "error: NOT_FOUND: no session 'cli'\n"


def test_a_session_is_not_deleted_while_a_turn_of_it_runs(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    # a slow model and a turn of seconds (cancelled once checked): it still runs when
    # the deletion comes
    slow = model_pair(tmp_path_factory.getbasetemp(), "slow-2k",
                      shape=dataclasses.replace(SLOW, n_ctx=2048))
    with running(service_config(*slow, slots=1, ctx=2048, slot_save_path=tmp_path)) as srv, \
            client(srv) as c:
        stream = c.generate_stream(make_request([5, 6, 7], max_tokens=1900, temperature=0.0,
                                                session="busy"))
        next(stream)  # the turn runs
        with pytest.raises(grpc.RpcError) as err:
            c.delete_session("busy")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "a turn of the session is running or waiting" in err.value.details()
        stream.cancel()
        wait_until(lambda: not c.sessions()[0].busy)
        n = c.sessions()[0].n_tokens
        assert n >= 4
        r = c.delete_session("busy")
        assert (list(r.removed_from), r.n_tokens) == ([SLOT], n)
        assert c.slots()[0].n_tokens == 0 and c.sessions() == []


def test_a_stored_session_of_another_model_is_refused_and_kept(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    with running(config(slot_save_path=tmp_path)) as srv, client(srv) as c:
        turn(c, "toy", [5, 6, 7])
    other = model_pair(tmp_path_factory.getbasetemp())
    with running(service_config(*other, slots=1, ctx=256, slot_save_path=tmp_path)) as srv, \
            client(srv) as c:
        with pytest.raises(grpc.RpcError) as err:
            turn(c, "toy", [8, 9])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "model" in err.value.details()
        assert c.slots()[0].n_tokens == 0
    assert store_files(tmp_path) == ["session~~toy", "session~~toy.drft"]


def test_the_ram_tier_flag_and_its_variable() -> None:
    from inference_svc.config import from_args

    assert from_args([]).session_ram_mb == 1024
    assert from_args([], env={"WARMSLOT_SESSION_RAM_MB": "5"}).session_ram_mb == 5
    assert from_args(["--session-ram-mb", "0"],
                     env={"WARMSLOT_SESSION_RAM_MB": "5"}).session_ram_mb == 0
    with pytest.raises(SystemExit):
        from_args(["--session-ram-mb", "-1"])
