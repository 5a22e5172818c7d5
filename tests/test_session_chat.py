"""A session keeps its chat conversation (the bundled toy pair, a --chat-template file,
real gRPC): an `append` Chat continues it, the command line's `chat --session`
continues it across invocations, a Chat whose messages drop turns the session held
says how many tokens it dropped, and the conversation goes with the session's state to
the store, across a restart, and back."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inference_svc import client as cli
from inference_svc.api.server import Server
from inference_svc.chat import Message
from inference_svc.client import InferenceClient, make_chat_request
from inference_svc.core import Model, Tokenizer
from inference_svc.engine.scheduler import common_prefix
from inference_svc.pb import inference_pb2 as pb
from inference_svc.sessions import chat_record
from inference_svc.storage.slotfile import CorruptSlotFile, Section
from inference_svc.storage.snapshots import model_spec, prepare_restore
from inference_svc.storage.store import LocalStore
from snapshot_svc.testing import running_server
from tests.enginekit import EngineHold
from tests.fixtures.servicekit import running, service_config
from tests.resumekit import DRAFT, TARGET, wait_until

pytestmark = pytest.mark.timeout(120)

# the generation prompt is how an assistant message starts, so a reply kept in the
# session renders as the tokens the slot already holds
TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m.role }}:{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}")
N = 6  # tokens generated per turn
GREEDY = {"temperature": 0.0, "max_tokens": N}


@pytest.fixture(scope="module")
def tok() -> Iterator[Tokenizer]:
    with Model.load(TARGET) as m:
        yield m.tokenizer


def config(tmp_path: Path, **kw: object) -> object:
    tmp_path.mkdir(parents=True, exist_ok=True)
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    base: dict[str, object] = dict(slots=2, ctx=256, session_ram_mb=64, instance_id="t",
                                   chat_template=template, slot_save_path=tmp_path / "slots")
    base.update(kw)
    return service_config(TARGET, DRAFT, **base)


def prompt_of(tok: Tokenizer, messages: list[tuple[str, str]]) -> list[int]:
    """The template's tokens of the conversation, with the generation prompt."""
    bos = tok.bos_id
    assert bos is not None
    out: list[int] = []
    for role, content in messages:
        out += [bos] + tok.encode(f"{role}:{content}\n")
    return out + [bos] + tok.encode("assistant:")


def chat(c: InferenceClient, messages: list[tuple[str, str]],
         **fields: object) -> tuple[str, list[int], pb.Timings]:
    rs, last = c.chat(messages, **GREEDY, **fields)  # type: ignore[arg-type]
    return "".join(r.text for r in rs), [x for r in rs for x in r.tokens], last.timings


def held(c: InferenceClient) -> dict[str, int]:
    return {s.name: s.n_tokens for s in c.sessions()}


def addr(srv: Server) -> str:
    return f"127.0.0.1:{srv.port}"


def cached(srv: Server) -> float:
    return srv.metrics.registry.get_sample_value("warmslot_tokens_total",
                                                 {"kind": "cached"}) or 0.0


def test_cli_chat_session_continues_across_invocations(
        tmp_path: Path, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    with running(config(tmp_path)) as srv:
        def invoke(line: str) -> str:
            monkeypatch.setattr(sys, "stdin", io.StringIO(line + "\n"))
            assert cli.main(["--addr", addr(srv), "chat", "--session", "me",
                             "--max-tokens", str(N), "--temperature", "0"]) == 0
            return capsys.readouterr().out.removesuffix("\n")

        q1, q2 = "Write a haiku about autumn.", "What did I ask you?"
        first = invoke(q1)
        ids1 = prompt_of(tok, [("user", q1)])
        with InferenceClient(addr(srv)) as c:
            n1 = held(c)["me"]
        assert n1 == len(ids1) + N
        before = cached(srv)
        second = invoke(q2)
        ids2 = prompt_of(tok, [("user", q1), ("assistant", first), ("user", q2)])
        with InferenceClient(addr(srv)) as c:
            # the second invocation's prompt holds both turns; all of the first turn
            # (its prompt and reply) was reused from the session
            assert held(c) == {"me": len(ids2) + N}
            assert cached(srv) - before == n1
            # and its answer is the one a Chat of the whole conversation gives
            c.delete_session("me")
            whole, _, t = chat(c, [("user", q1), ("assistant", first), ("user", q2)])
        assert (whole, t.cache_n + t.prompt_n) == (second, len(ids2))


def test_append_continues_and_a_replacing_chat_reports_what_it_dropped(
        tmp_path: Path, tok: Tokenizer) -> None:
    with running(config(tmp_path)) as srv, InferenceClient(addr(srv)) as c:
        u1, u2, u3, u4 = ("user", "hello there"), ("user", "and then"), \
            ("user", "start again"), ("user", "go on")
        r1, toks1, t = chat(c, [u1], session="a", append=True)
        ids1 = prompt_of(tok, [u1])
        assert (t.session_tier, t.cache_n, t.prompt_n, t.session_n_discarded) == (
            pb.SESSION_TIER_NEW, 0, len(ids1), 0)
        n1 = len(ids1) + len(toks1)
        assert held(c) == {"a": n1}

        r2, toks2, t = chat(c, [u2], session="a", append=True)
        ids2 = prompt_of(tok, [u1, ("assistant", r1), u2])
        assert (t.session_tier, t.cache_n, t.prompt_n, t.session_n_discarded) == (
            pb.SESSION_TIER_SLOT, n1, len(ids2) - n1, 0)
        n2 = len(ids2) + len(toks2)
        assert held(c) == {"a": n2}

        # messages that are the whole conversation replace the session's: the tokens
        # of the turns it held and they do not repeat are dropped, and said so
        r3, toks3, t = chat(c, [u3], session="a")
        ids3 = prompt_of(tok, [u3])
        kept = common_prefix(ids2 + toks2, ids3)
        assert 0 < kept < len(ids1)
        assert (t.cache_n, t.prompt_n, t.session_n_discarded) == (
            kept, len(ids3) - kept, n2 - kept)
        n3 = len(ids3) + len(toks3)
        assert held(c) == {"a": n3}

        # what the session keeps now is that conversation
        _, _, t = chat(c, [u4], session="a", append=True)
        ids4 = prompt_of(tok, [u3, ("assistant", r3), u4])
        assert (t.cache_n, t.prompt_n, t.session_n_discarded) == (n3, len(ids4) - n3, 0)

        # a Generate turn appends to the tokens; no Chat discards anything
        _, last = c.generate(tok.encode(" more"), max_tokens=2, temperature=0.0,
                             session="a")
        assert last.timings.session_n_discarded == 0

        with pytest.raises(grpc.RpcError) as err:
            chat(c, [u1], append=True)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "set session" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            chat(c, [], session="a", append=True)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages is empty" in err.value.details()


def test_the_conversation_goes_to_the_store_and_survives_a_restart(
        tmp_path: Path, tok: Tokenizer) -> None:
    u1, u2, u3 = ("user", "hello there"), ("user", "and then"), ("user", "one more")
    # one slot, no RAM tier: another session's turn writes this one to the store
    cfg = config(tmp_path, slots=1, session_ram_mb=0)
    with running(cfg) as srv, InferenceClient(addr(srv)) as c:
        r1, toks1, _ = chat(c, [u1], session="a", append=True)
        n1 = len(prompt_of(tok, [u1])) + len(toks1)
        chat(c, [u1], session="other", append=True)
        r2, toks2, t = chat(c, [u2], session="a", append=True)
        ids2 = prompt_of(tok, [u1, ("assistant", r1), u2])
        assert (t.session_tier, t.cache_n, t.prompt_n) == (
            pb.SESSION_TIER_STORE, n1, len(ids2) - n1)
        n2 = len(ids2) + len(toks2)
    # the stop wrote every session to the store, its conversation in the target file;
    # its draft sidecar names that file (with_chat sealed it again)
    with Model.load(TARGET) as t, Model.load(DRAFT) as d:
        prepared = prepare_restore(LocalStore(tmp_path / "slots"), "session~~a",
                                   model_spec(t, 256, "f16"), model_spec(d, 256, "f16"))
    assert prepared.chat == (Message(*u1), Message("assistant", r1), Message(*u2),
                             Message("assistant", r2))
    assert (prepared.n_tokens, prepared.draft_note) == (n2, "")
    assert prepared.draft_state is not None
    # a new server reads them back, each once: the conversation and the state the
    # turn continues are one read
    with running(cfg) as srv, InferenceClient(addr(srv)) as c:
        store = srv._store
        assert store is not None
        loads: list[str] = []
        load = store.load

        def counted(name: str, **kw: object) -> object:
            loads.append(name)
            return load(name, **kw)  # type: ignore[arg-type]

        store.load = counted  # type: ignore[method-assign]
        _, _, t = chat(c, [u3], session="a", append=True)
        assert loads == ["session~~a"]
        # a turn refused once its session was read keeps nothing of it
        with pytest.raises(grpc.RpcError) as err:
            c.chat([u3], session="other", append=True, max_tokens=10**6)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert loads[1:] == ["session~~other"] and srv._sessions._peeked == {}
        ids3 = prompt_of(tok, [u1, ("assistant", r1), u2, ("assistant", r2), u3])
        # the reply's text rendered again may end in other tokens than the ones
        # generated (here its last one merges with the template's newline): those
        # are re-processed, and counted as dropped
        kept = common_prefix(prompt_of(tok, [u1, ("assistant", r1), u2]) + toks2, ids3)
        assert n2 - 2 <= kept <= n2
        assert (t.session_tier, t.cache_n, t.prompt_n, t.session_n_discarded) == (
            pb.SESSION_TIER_STORE, kept, len(ids3) - kept, n2 - kept)
        # a deleted session's conversation goes with it
        c.delete_session("a")
        _, _, t = chat(c, [u3], session="a", append=True)
        assert (t.session_tier, t.cache_n + t.prompt_n) == (
            pb.SESSION_TIER_NEW, len(prompt_of(tok, [u3])))


def test_the_conversation_moves_to_another_replica_with_its_draft(
        tmp_path: Path, tok: Tokenizer) -> None:
    """Through a snapshot service: replica B continues the conversation replica A
    wrote, with A's draft state (the sidecar names the target file with its CHAT
    section), so its speculative counts are those of a session never moved."""
    u1, u2 = ("user", "hello there"), ("user", "and then")
    with running_server(tmp_path / "snap") as snap, \
            running(config(tmp_path / "a", slots=1, session_ram_mb=0, instance_id="a",
                           snapshot_addr=snap.address, slot_save_path=None)) as ra, \
            running(config(tmp_path / "b", instance_id="b", snapshot_addr=snap.address,
                           slot_save_path=None)) as rb, \
            running(config(tmp_path / "ref", instance_id="ref")) as ref, \
            InferenceClient(addr(ra)) as ca, InferenceClient(addr(rb)) as cb, \
            InferenceClient(addr(ref)) as cr:
        r1, toks1, _ = chat(ca, [u1], session="s", append=True)
        chat(ca, [u1], session="other", append=True)  # replica A writes s to the service
        wait_until(lambda: {x.name: x.tier for x in ca.sessions()}["s"] == pb.SESSION_TIER_STORE)
        n1 = len(prompt_of(tok, [u1])) + len(toks1)
        r2, toks2, t = chat(cb, [u2], session="s", append=True)
        assert (t.session_tier, t.cache_n, t.session_n_discarded) == (
            pb.SESSION_TIER_STORE, n1, 0)
        # the reference: the same two turns on a session that never left its slot
        chat(cr, [u1], session="s", append=True)
        want, want_toks, w = chat(cr, [u2], session="s", append=True)
        assert (r2, toks2) == (want, want_toks)
        assert (t.draft_n, t.draft_n_accepted, t.draft_prompt_n) == (
            w.draft_n, w.draft_n_accepted, w.draft_prompt_n)


def test_the_conversation_section_round_trips_and_refuses_what_is_not_one() -> None:
    msgs = (Message("system", "h\u00e9 \U0001f342 \"q\"\n"), Message("user", ""),
            Message("assistant", "<|endoftext|>"))
    assert chat_record.unpack((Section(b"XTRA", 0, b"x"), chat_record.pack(msgs))) == msgs
    assert chat_record.unpack(()) is None
    for junk in (b"{", b'{"a": 1}', b'[["user"]]', b'[["user", 3]]', b"\xff", b'["x"]'):
        with pytest.raises(CorruptSlotFile, match="CHAT section is not a conversation"):
            chat_record.unpack((Section(b"CHAT", 0, junk),))
    with pytest.raises(CorruptSlotFile, match="appears twice"):
        chat_record.unpack((chat_record.pack(msgs), chat_record.pack(msgs)))


def test_two_appends_at_once_never_drop_a_turn(tmp_path: Path, tok: Tokenizer) -> None:
    """Two `append` Chats of one session queued together are rendered after the same
    conversation: the one queued first runs, the other is refused (FAILED_PRECONDITION)
    rather than dropping the first's turn; sent again it continues both."""
    u1, u2, u3 = ("user", "hello there"), ("user", "and then"), ("user", "or else")
    with running(config(tmp_path)) as srv, InferenceClient(addr(srv)) as c:
        r1, _, _ = chat(c, [u1], session="a", append=True)
        engine = srv._engine
        assert engine is not None
        hold = EngineHold(engine)
        try:
            first = c.chat_stream(make_chat_request([u2], session="a", append=True, **GREEDY))
            second = c.chat_stream(make_chat_request([u3], session="a", append=True,
                                                     **GREEDY))
            wait_until(lambda: len(engine.sched.waiting) == 2)
        finally:
            hold.release()
        # the two calls' handler threads race to queue: either may run first
        outcomes: dict[tuple[str, str], list | grpc.RpcError] = {}
        for msg, stream in ((u2, first), (u3, second)):
            try:
                outcomes[msg] = list(stream)
            except grpc.RpcError as exc:
                outcomes[msg] = exc
        refused = [m for m, o in outcomes.items() if isinstance(o, grpc.RpcError)]
        assert len(refused) == 1
        lost = refused[0]
        won = u3 if lost == u2 else u2
        err = outcomes[lost]
        assert isinstance(err, grpc.RpcError)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "conversation changed" in (err.details() or "")
        rs = outcomes[won]
        assert isinstance(rs, list)
        r2, n2 = "".join(r.text for r in rs), rs[-1].timings
        toks2 = [x for r in rs for x in r.tokens]
        kept = held(c)["a"]
        assert kept == n2.cache_n + n2.prompt_n + n2.predicted_n
        _, _, t = chat(c, [lost], session="a", append=True)
        ids = prompt_of(tok, [u1, ("assistant", r1), won, ("assistant", r2), lost])
        same = common_prefix(prompt_of(tok, [u1, ("assistant", r1), won]) + toks2, ids)
        assert (t.cache_n, t.prompt_n, t.session_n_discarded) == (
            same, len(ids) - same, kept - same)
