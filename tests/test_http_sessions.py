"""Sessions through the HTTP door survive a restart: the turn after it reuses exactly what
the session held (cache_n), from the store, and continues as a gRPC session that never
restarted does on the same server (same text, same counts)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.fixtures.servicekit import running
from tests.httpkit import MODEL_ID, client, grpc_client, http_config

P1, P2 = "def merge_sorted(a, b):", "\n    result = []"
CHAT1 = [{"role": "system", "content": "You write Python."},
         {"role": "user", "content": "Sort a list."}]


def _chat2(reply: str) -> list[dict[str, str]]:
    return [*CHAT1, {"role": "assistant", "content": reply},
            {"role": "user", "content": "Now reverse it."}]


def _t(answer: object) -> dict[str, object]:
    return (answer.model_extra or {})["timings"]  # type: ignore[attr-defined]


def test_sessions_continue_after_restart(tmp_path: Path) -> None:
    store = tmp_path / "slots"
    cfg = http_config(tmp_path, slot_save_path=store)
    with running(cfg) as srv:
        oa = client(srv)
        r1 = oa.completions.create(model=MODEL_ID, prompt=P1, max_tokens=8, temperature=0,
                                   extra_headers={"X-Session-Id": "conv"})
        t1 = _t(r1)
        assert (t1["session_tier"], t1["cache_n"], t1["predicted_n"]) == ("new", 0, 8)
        c1 = oa.chat.completions.create(model=MODEL_ID, messages=CHAT1,  # type: ignore[arg-type]
                                        max_tokens=8, temperature=0,
                                        extra_body={"session": "chat"})
        reply = c1.choices[0].message.content or ""
    with running(cfg) as srv:  # a new process's worth: models, engine, slots
        oa = client(srv)
        r2 = oa.completions.create(model=MODEL_ID, prompt=P2, max_tokens=8, temperature=0,
                                   extra_headers={"X-Session-Id": "conv"})
        t2 = _t(r2)
        assert t2["session_tier"] == "store"
        assert (t2["cache_n"], t2["prompt_n"]) == (t1["prompt_n"] + t1["predicted_n"],
                                                   r2.usage.prompt_tokens - t2["cache_n"])
        assert r2.usage.prompt_tokens_details.cached_tokens == t2["cache_n"]
        c2 = oa.chat.completions.create(model=MODEL_ID, messages=_chat2(reply),  # type: ignore[arg-type]
                                        max_tokens=8, temperature=0,
                                        extra_body={"session": "chat"})
        tc2 = _t(c2)
        assert tc2["session_tier"] == "store"
        # the same two turns through gRPC sessions that never restarted
        with grpc_client(srv) as g:
            g.generate(P1, session="ref", max_tokens=8, temperature=0.0)
            rs, last = g.generate(P2, session="ref", max_tokens=8, temperature=0.0)
            assert r2.choices[0].text == "".join(r.text for r in rs)
            assert (t2["cache_n"], t2["prompt_n"]) == (last.timings.cache_n,
                                                       last.timings.prompt_n)
            g.chat([(m["role"], m["content"]) for m in CHAT1], session="chatref",
                   max_tokens=8, temperature=0.0)
            rs, last = g.chat([(m["role"], m["content"]) for m in _chat2(reply)],
                              session="chatref", max_tokens=8, temperature=0.0)
            assert c2.choices[0].message.content == "".join(r.text for r in rs)
            assert (tc2["cache_n"], tc2["prompt_n"]) == (last.timings.cache_n,
                                                         last.timings.prompt_n)
            assert last.timings.cache_n > 0


def test_a_completion_sent_again_with_its_turn_id_replaces_itself(tmp_path: Path) -> None:
    """The `turn_id` extension: the same completion of a session sent again with it goes
    back to what the session held before it (the gRPC rules); a bad id is a 400."""
    with running(http_config(tmp_path, slot_save_path=tmp_path / "slots")) as srv:
        oa = client(srv)

        def complete(prompt: str, turn_id: object) -> object:
            return oa.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=8,
                                         temperature=0, extra_body={"session": "conv",
                                                                    "turn_id": turn_id})
        t1 = _t(complete(P1, "h1"))
        n1 = t1["prompt_n"] + t1["predicted_n"]
        r2 = complete(P2, "h2")
        again = complete(P2, "h2")
        t = _t(again)
        assert again.choices[0].text == r2.choices[0].text
        assert (t["cache_n"], t["session_n_discarded"]) == (n1, _t(r2)["prompt_n"] + 8)
        with pytest.raises(openai.BadRequestError) as err:
            complete(P2, "not an id")
        assert "turn_id 'not an id' must be 1..64 characters" in str(err.value)
