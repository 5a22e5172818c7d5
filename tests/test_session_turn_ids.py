"""A session turn sent again with its id replaces itself (GenerateRequest.turn_id): the
bundled toy pair over real gRPC. The turn runs again from what the session held before
it, in a slot, the RAM tier or another replica's store copy, with the output of a turn
sent once; a Chat appended to a session keeps its messages once; the mark goes with the
state to the store (the TURN section); bad ids are refused; a server says in its
initial metadata that it keeps turn ids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient, make_request
from inference_svc.config import Speculative
from inference_svc.pb import inference_pb2 as pb
from inference_svc.sessions import turn_mark
from inference_svc.sessions.names import TURN_IDS_HEADER
from inference_svc.storage.slotfile import CorruptSlotFile, Section
from snapshot_svc.testing import running_server
from tests.factory import write_model
from tests.fixtures.servicekit import running, service_config
from tests.resumekit import wait_until
from tests.test_gemma3_service import SHAPE as GEMMA_SHAPE
from tests.test_session_chat import chat, held, prompt_of, tok  # noqa: F401 - a fixture
from tests.test_session_chat import config as chat_config
from tests.test_session_loss import fail_next_prefill
from tests.test_session_replicas import replica, store_generation
from tests.test_sessions import NEW, RAM, SLOT, STORE, N, client, config, prompts, reference, spec

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The reference: a slot for every session, every turn sent once."""
    with running(config(slots=4, slot_save_path=tmp_path_factory.mktemp("wide"))) as srv:
        yield srv


def turn(c: InferenceClient, session: str, prompt: list[int],
         turn_id: str) -> tuple[list[int], pb.Timings]:
    stream = c.generate_stream(make_request(prompt, max_tokens=N, temperature=0.0,
                                            session=session, turn_id=turn_id))
    rs = list(stream)
    assert rs[-1].done
    assert (TURN_IDS_HEADER, "1") in tuple(stream.initial_metadata())
    return [t for r in rs for t in r.tokens], rs[-1].timings


def tokens_held(c: InferenceClient, session: str) -> int:
    return {s.name: s.n_tokens for s in c.sessions()}[session]


def test_a_turn_sent_again_replaces_itself_in_its_slot_and_in_ram(
        wide: Server, tmp_path: Path) -> None:
    """Turn 2 sent again (same id) runs again from the end of turn 1: the same tokens,
    the session holds it once, and the drop is reported; sent once more after another
    session pushed it to the RAM tier, the same. A later turn continues as if turn 2
    had been sent once; an id that is not the last turn's adds a turn."""
    with running(config(slot_save_path=tmp_path / "slots")) as srv, client(srv) as c:
        p = prompts(c)
        first = turn(c, "s", p[0], "t1")
        n1 = len(p[0]) + N
        second = turn(c, "s", p[1], "t2")
        n2 = n1 + len(p[1]) + N
        toks, t = turn(c, "s", p[1], "t2")
        assert toks == second[0]
        assert (t.session_tier, t.cache_n, t.prompt_n, t.session_n_discarded) == (
            SLOT, n1, len(p[1]), len(p[1]) + N)
        assert tokens_held(c, "s") == n2

        turn(c, "other", p[3], "o1")  # the one slot: "s" goes to the RAM tier
        toks, t = turn(c, "s", p[1], "t2")
        assert toks == second[0]
        assert (t.session_tier, t.cache_n, t.session_n_discarded) == (
            RAM, n1, len(p[1]) + N)
        assert tokens_held(c, "s") == n2

        third = turn(c, "s", p[2], "t3")
        assert [spec(*x) for x in (first, second, third)] == reference(
            wide, "ref-resend", p[:3])
        # "t2" is no longer the last turn: sent again, it is a new turn
        _, t = turn(c, "s", p[1], "t2")
        assert (t.cache_n, t.session_n_discarded) == (n2 + len(p[2]) + N, 0)


def test_a_turn_kept_by_a_replica_then_sent_to_another_replaces_the_store_copy(
        wide: Server, tmp_path: Path) -> None:
    """Replica A runs turns 1 and 2 and writes them through (as when A is killed before
    turn 2's answer reaches the client); turn 2 sent again to replica B goes back to the
    store copy's turn 1 and runs again there: the same tokens, and turn 3 on B continues
    the session as if turn 2 had been sent once."""
    with running_server(tmp_path / "snap") as snap:
        with replica(snap.address, "a") as ra, client(ra) as ca:
            p = prompts(ca)
            first = turn(ca, "s", p[0], "t1")
            second = turn(ca, "s", p[1], "t2")
            wait_until(lambda: store_generation(snap.address, "s") == 2)
        with replica(snap.address, "b") as rb, client(rb) as cb:
            n1 = len(p[0]) + N
            toks, t = turn(cb, "s", p[1], "t2")
            assert toks == second[0]
            assert (t.session_tier, t.cache_n, t.prompt_n, t.session_n_discarded) == (
                STORE, n1, len(p[1]), len(p[1]) + N)
            third = turn(cb, "s", p[2], "t3")
            assert [spec(*x) for x in (first, second, third)] == reference(
                wide, "ref-resend-store", p[:3])
            wait_until(lambda: store_generation(snap.address, "s") == 4)


def test_an_appended_chat_sent_again_keeps_its_messages_once(
        tok: object, tmp_path: Path) -> None:  # noqa: F811 - the fixture
    with running(chat_config(tmp_path)) as srv, client(srv) as c:
        u1, u2, u3 = ("user", "hello there"), ("user", "and then"), ("user", "go on")
        r1, _, _ = chat(c, [u1], session="a", append=True, turn_id="c1")
        r2, toks2, t = chat(c, [u2], session="a", append=True, turn_id="c2")
        n2 = held(c)["a"]
        again, toks, t = chat(c, [u2], session="a", append=True, turn_id="c2")
        assert (again, toks) == (r2, toks2)
        ids2 = prompt_of(tok, [u1, ("assistant", r1), u2])  # type: ignore[arg-type]
        # the reply is dropped; the prompt's tokens are kept but the last (its logits)
        assert (t.cache_n, t.prompt_n, t.session_n_discarded) == (
            len(ids2) - 1, 1, n2 - len(ids2))
        assert held(c)["a"] == n2
        # the conversation holds turn 2 once: turn 3 continues as in session "b",
        # whose turns were each sent once
        r3, toks3, t = chat(c, [u3], session="a", append=True, turn_id="c3")
        for u in (u1, u2):
            chat(c, [u], session="b", append=True)
        ref3, ref_toks3, ref = chat(c, [u3], session="b", append=True)
        assert (r3, toks3) == (ref3, ref_toks3)
        assert (t.cache_n, t.prompt_n, t.session_n_discarded) == (
            ref.cache_n, ref.prompt_n, ref.session_n_discarded)
        assert held(c)["a"] == held(c)["b"]


@pytest.mark.parametrize("turn_id, session, message", [
    ("bad id", "s", "must be 1..64 characters"),
    ("x" * 65, "s", "must be 1..64 characters"),
    ("t1", None, "set session"),
])
def test_a_bad_turn_id_is_refused(turn_id: str, session: str | None, message: str,
                                  tmp_path: Path) -> None:
    with running(config(slot_save_path=tmp_path / "slots")) as srv, client(srv) as c:
        with pytest.raises(grpc.RpcError) as err:
            list(c.generate_stream(make_request([1, 2, 3], max_tokens=2, session=session,
                                                turn_id=turn_id)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or "")


def test_the_turn_section_round_trips_and_refuses_what_is_not_one() -> None:
    mark = turn_mark.TurnMark("a-1", 17, 2)
    section = turn_mark.pack(mark)
    assert section.tag == b"TURN"
    assert turn_mark.unpack([Section(b"CHAT", 0, b"[]"), section]) == mark
    assert turn_mark.unpack([]) is None
    for payload in (b"{", b"[]", b'{"id":"a","start":1}', b'{"id":"a b","start":1,"chat":0}',
                    b'{"id":"a","start":-1,"chat":0}', b'{"id":"a","start":1.5,"chat":0}',
                    b"\xff"):
        with pytest.raises(CorruptSlotFile, match="TURN"):
            turn_mark.unpack([Section(b"TURN", 0, payload)])
    with pytest.raises(CorruptSlotFile, match="twice"):
        turn_mark.unpack([section, section])


@pytest.mark.native
def test_a_window_model_turn_sent_again_reprocesses_what_its_rings_no_longer_hold(
        tmp_path: Path) -> None:
    """A sliding-window model (its local layers keep a ring of n_swa + 16 positions): going
    back past what the rings hold means processing the session's kept tokens again with
    the prompt, from position 0; the output is the first attempt's."""
    model = tmp_path / "gemma3.gguf"
    write_model(model, GEMMA_SHAPE, seed=21)
    cfg = service_config(model, None, slot_save_path=tmp_path / "slots", slots=1, ctx=1024,
                         session_ram_mb=64, instance_id="t", session_write_through=False,
                         speculative=Speculative(enabled=False))
    with running(cfg) as srv, client(srv) as c:
        ring = GEMMA_SHAPE.n_swa + 16
        p1 = c.tokenize("the quick brown fox jumps over the lazy dog " * 4)
        p2 = c.tokenize(" and then the lazy dog jumps over the quick brown fox " * 2)
        assert len(p1) > 2 * ring and len(p2) + N > ring
        turn(c, "w", p1, "w1")
        second = turn(c, "w", p2, "w2")
        start = len(p1) + N
        toks, t = turn(c, "w", p2, "w2")
        assert toks == second[0]
        assert (t.cache_n, t.prompt_n, t.session_n_discarded) == (
            0, start + len(p2), len(p2) + N)
        assert tokens_held(c, "w") == start + len(p2) + N


def test_an_id_names_one_turn_only(tmp_path: Path) -> None:
    """The last turn's id with another prompt is refused (nothing changes); after a turn
    without an id, or after the session was deleted, an old id is a new turn."""
    with running(config(slot_save_path=tmp_path / "slots")) as srv, client(srv) as c:
        p = prompts(c)
        turn(c, "s", p[0], "t1")
        n1 = len(p[0]) + N
        with pytest.raises(grpc.RpcError) as err:
            turn(c, "s", p[1], "t1")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details() == (
            "turn_id 't1' names the last turn of session 's', which had another prompt: an "
            "id names one turn (send a new turn with a new id)")
        assert tokens_held(c, "s") == n1
        # a turn without an id (as the HTTP door sends) leaves no turn to replace
        rs = list(c.generate_stream(make_request(p[1], max_tokens=N, temperature=0.0,
                                                 session="s")))
        n2 = n1 + len(p[1]) + N
        assert rs[-1].done and tokens_held(c, "s") == n2
        _, t = turn(c, "s", p[0], "t1")
        assert (t.cache_n, t.session_n_discarded) == (n2, 0)
        c.delete_session("s")
        _, t = turn(c, "s", p[0], "t1")
        assert (t.session_tier, t.cache_n, t.session_n_discarded) == (NEW, 0, 0)


def chat_reference(c: InferenceClient, users: tuple[tuple[str, str], ...]) -> tuple:
    """The last turn of appended Chats `users`, each sent once, on a new session."""
    for u in users[:-1]:
        chat(c, [u], session="ref", append=True)
    return chat(c, [users[-1]], session="ref", append=True)


def sent_once(turn_out: tuple) -> tuple:
    """A Chat turn's reply, tokens and what it kept and processed of the session."""
    reply, toks, t = turn_out
    return reply, toks, t.cache_n, t.prompt_n, t.session_n_discarded


def test_a_chat_sent_again_that_fails_leaves_the_conversation_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resend of an appended Chat read from the store fails in the core: the session
    continues from the store copy (turn 2 kept) with the conversation that copy holds, so
    the next turn renders after turn 2, as if the resend had never been sent."""
    with running(chat_config(tmp_path, slots=1, session_ram_mb=0)) as srv, \
            client(srv) as c:
        u1, u2, u3 = ("user", "hello there"), ("user", "and then"), ("user", "go on")
        chat(c, [u1], session="a", append=True, turn_id="c1")
        chat(c, [u2], session="a", append=True, turn_id="c2")
        n2 = held(c)["a"]
        chat(c, [u1], session="b", append=True)  # "a" goes to the store
        fail_next_prefill(srv, monkeypatch)
        with pytest.raises(grpc.RpcError) as err:
            chat(c, [u2], session="a", append=True, turn_id="c2")
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert held(c)["a"] == n2
        third = chat(c, [u3], session="a", append=True, turn_id="c3")
        assert sent_once(third) == sent_once(chat_reference(c, (u1, u2, u3)))


def test_an_appended_chat_kept_by_a_replica_is_replaced_from_the_store_elsewhere(
        tmp_path: Path) -> None:
    """Replica B reads the session's conversation and mark from A's store copy before it
    renders the resent Chat: the turn is replaced, the conversation holds it once."""
    with running_server(tmp_path / "snap") as snap:
        def on(name: str) -> object:
            return running(chat_config(tmp_path / name, slot_save_path=None,
                                       snapshot_addr=snap.address, instance_id=name,
                                       session_write_through=True))
        u1, u2, u3 = ("user", "hello there"), ("user", "and then"), ("user", "go on")
        with on("a") as ra, client(ra) as ca:
            chat(ca, [u1], session="s", append=True, turn_id="c1")
            r2, toks2, _ = chat(ca, [u2], session="s", append=True, turn_id="c2")
            n2 = held(ca)["s"]
            wait_until(lambda: store_generation(snap.address, "s") == 2)
        with on("b") as rb, client(rb) as cb:
            again, toks, t = chat(cb, [u2], session="s", append=True, turn_id="c2")
            assert (again, toks, t.session_tier) == (r2, toks2, STORE)
            assert held(cb)["s"] == n2
            third = chat(cb, [u3], session="s", append=True, turn_id="c3")
            assert sent_once(third) == sent_once(chat_reference(cb, (u1, u2, u3)))
