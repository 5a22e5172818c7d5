"""A failed turn never silently takes a conversation back in time: when the failure
empties the session's slot, the session continues from the store's copy only if that
copy is the very state the turn started from; otherwise the older copy is removed and
the next turn gets DATA_LOSS naming the session, after which the name starts again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient
from tests.fixtures.servicekit import running
from tests.resumekit import wait_until
from tests.test_sessions import (
    NEW,
    RAM,
    SLOT,
    STORE,
    N,
    client,
    config,
    listed,
    prompts,
    reference,
    spec,
    store_files,
    turn,
)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(config(slots=4, slot_save_path=tmp_path_factory.mktemp("wide"))) as srv:
        yield srv


def fail_next_prefill(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next prefill of the core raises (the engine empties the turn's slot)."""
    eng = srv._engine
    assert eng is not None
    real = eng.owner.prefill

    def failing(*args: object, **kw: object) -> object:
        monkeypatch.setattr(eng.owner, "prefill", real)
        raise RuntimeError("injected core failure")

    monkeypatch.setattr(eng.owner, "prefill", failing)


def failed_turn(c: InferenceClient, name: str, prompt: list[int]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        turn(c, name, prompt)
    return err.value


def test_a_failed_turn_after_a_store_restore_does_not_resurrect_the_older_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with running(config(slot_save_path=tmp_path, session_ram_mb=0)) as srv, \
            client(srv) as c:
        p = prompts(c)
        turn(c, "a", p[0])
        turn(c, "b", p[1])  # a goes to the store: len(p0) + N tokens there
        wait_until(lambda: listed(c)["a"][1] == STORE)
        _, t = turn(c, "a", p[2])  # restored from the store and advanced
        assert t.session_tier == STORE
        n_newest = len(p[0]) + len(p[2]) + 2 * N
        fail_next_prefill(srv, monkeypatch)
        assert failed_turn(c, "a", p[3]).code() == grpc.StatusCode.INTERNAL
        # the store's copy lacks the second turn: removed, never continued
        wait_until(lambda: store_files(tmp_path) == ["session~~b", "session~~b.drft"])
        assert listed(c) == {"b": (len(p[1]) + N, STORE)}
        err = failed_turn(c, "a", p[3])
        assert err.code() == grpc.StatusCode.DATA_LOSS
        assert err.details() == (
            f"session 'a' lost its state of {n_newest} tokens: a turn of it failed in "
            f"slot 0 and emptied the slot, and the store held an older state of "
            f"{len(p[0]) + N} tokens, removed rather than continued; the conversation "
            "must start again (this turn was not run; the next one starts a new session "
            "of that name)")
        _, t = turn(c, "a", p[3])  # reported once: the name starts again
        assert (t.session_tier, t.cache_n, t.prompt_n) == (NEW, 0, len(p[3]))
        assert listed(c)["a"] == (len(p[3]) + N, SLOT)


def test_a_failed_turn_whose_start_is_the_store_copy_continues_from_it(
        wide: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with running(config(slot_save_path=tmp_path, session_ram_mb=0)) as srv, \
            client(srv) as c:
        p = prompts(c)
        a1, t1 = turn(c, "a", p[0])
        turn(c, "b", p[1])
        wait_until(lambda: listed(c)["a"][1] == STORE)
        fail_next_prefill(srv, monkeypatch)  # the turn right after the restore fails
        assert failed_turn(c, "a", p[2]).code() == grpc.StatusCode.INTERNAL
        assert srv._sessions is not None and srv._sessions.settle(30)  # b written down
        assert store_files(tmp_path) == ["session~~a", "session~~a.drft", "session~~b",
                                         "session~~b.drft"]
        assert listed(c)["a"] == (len(p[0]) + N, STORE)
        a2, t2 = turn(c, "a", p[3])  # as if the failed turn had never been sent
        assert (t2.session_tier, t2.cache_n, t2.prompt_n) == (STORE, len(p[0]) + N,
                                                              len(p[3]))
        got = [spec(a1, t1), spec(a2, t2)]
    assert got == reference(wide, "ref-kept", [p[0], p[3]])


def test_a_failed_turn_of_a_session_held_in_ram_only_reports_the_loss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with running(config(slot_save_path=tmp_path)) as srv, client(srv) as c:
        p = prompts(c)
        turn(c, "a", p[0])
        turn(c, "b", p[1])
        assert listed(c)["a"] == (len(p[0]) + N, RAM)
        fail_next_prefill(srv, monkeypatch)
        assert failed_turn(c, "a", p[2]).code() == grpc.StatusCode.INTERNAL
        assert listed(c) == {"b": (len(p[1]) + N, RAM)}  # moved out for a's turn
        err = failed_turn(c, "a", p[2])
        assert err.code() == grpc.StatusCode.DATA_LOSS
        assert err.details().startswith(
            f"session 'a' lost its state of {len(p[0]) + N} tokens: a turn of it failed "
            "in slot 0 and emptied the slot, and no other copy of it was kept;")
        _, t = turn(c, "a", p[2])
        assert (t.session_tier, t.cache_n) == (NEW, 0)
        assert store_files(tmp_path) == []


def test_a_failed_first_turn_loses_nothing(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with running(config(slot_save_path=tmp_path)) as srv, client(srv) as c:
        p = prompts(c)
        fail_next_prefill(srv, monkeypatch)
        assert failed_turn(c, "a", p[0]).code() == grpc.StatusCode.INTERNAL
        _, t = turn(c, "a", p[0])
        assert (t.session_tier, t.cache_n, t.prompt_n) == (NEW, 0, len(p[0]))


def test_deleting_a_lost_session_clears_its_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with running(config(slot_save_path=tmp_path)) as srv, client(srv) as c:
        p = prompts(c)
        turn(c, "a", p[0])
        fail_next_prefill(srv, monkeypatch)
        assert failed_turn(c, "a", p[1]).code() == grpc.StatusCode.INTERNAL
        r = c.delete_session("a")
        assert (r.n_tokens, list(r.removed_from)) == (0, [])
        _, t = turn(c, "a", p[2])
        assert (t.session_tier, t.cache_n) == (NEW, 0)


def test_a_session_that_cannot_be_moved_out_of_its_slot_reports_the_loss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with running(config(slot_save_path=tmp_path)) as srv, client(srv) as c:
        p = prompts(c)
        turn(c, "a", p[0])
        eng = srv._engine
        assert eng is not None
        real = eng.owner.capture

        def failing(slot: int) -> object:
            monkeypatch.setattr(eng.owner, "capture", real)
            raise RuntimeError("injected capture failure")

        monkeypatch.setattr(eng.owner, "capture", failing)
        assert failed_turn(c, "b", p[1]).code() == grpc.StatusCode.INTERNAL
        assert listed(c) == {}
        err = failed_turn(c, "a", p[2])
        assert err.code() == grpc.StatusCode.DATA_LOSS
        assert err.details().startswith(
            f"session 'a' lost its state of {len(p[0]) + N} tokens: moving it out of slot 0 "
            "failed (injected capture failure), and no other copy of it was kept;")
        _, t = turn(c, "b", p[1])
        assert (t.session_tier, t.cache_n) == (NEW, 0)


def test_a_refused_turn_keeps_the_store_copy_current(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn refused before it touched the slot (too long for the context) leaves the
    session at the store's state: a failure after it still continues from the store."""
    with running(config(slot_save_path=tmp_path, session_ram_mb=0)) as srv, \
            client(srv) as c:
        p = prompts(c)
        turn(c, "a", p[0])
        turn(c, "b", p[1])  # a to the store
        with pytest.raises(grpc.RpcError) as err:
            turn(c, "a", p[2], n=250)  # restored, then refused: it exceeds the context
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        fail_next_prefill(srv, monkeypatch)
        assert failed_turn(c, "a", p[2]).code() == grpc.StatusCode.INTERNAL
        _, t = turn(c, "a", p[3])
        assert (t.session_tier, t.cache_n, t.prompt_n) == (STORE, len(p[0]) + N, len(p[3]))
