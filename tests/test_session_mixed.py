"""Requests with and without a session mixed on few slots (the bundled toy pair, greedy):
a request never fails or changes its output because of another request, whichever
slot it gets and whatever a session moved out of that slot before it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from inference_svc.client import InferenceClient, make_request
from inference_svc.pb import inference_pb2 as pb
from tests.fixtures.servicekit import running, service_config
from tests.resumekit import DRAFT, TARGET

pytestmark = pytest.mark.timeout(300)

N = 8  # tokens generated per request
BASE = "Once upon a time the little robot"  # every prompt shares its tokens


def config(tmp_path: Path, slots: int) -> object:
    return service_config(TARGET, DRAFT, slots=slots, ctx=256, session_ram_mb=64,
                          slot_save_path=tmp_path, instance_id="t")


def run(c: InferenceClient, prompt: list[int],
        session: str | None) -> tuple[list[int], pb.Timings]:
    rs = list(c.generate_stream(make_request(prompt, max_tokens=N, temperature=0.0,
                                             session=session)))
    assert rs[-1].done
    return [t for r in rs for t in r.tokens], rs[-1].timings


def test_a_request_without_a_session_in_the_slot_a_session_left(tmp_path: Path) -> None:
    """One slot: a session's turn, then a request without a session whose prompt shares
    the session's first tokens. The session moves out to RAM and empties the slot, so
    the request reuses nothing (before, it computed its prefix from a stale record of
    the slot's tokens and failed truncating the empty slot)."""
    with running(config(tmp_path, slots=1)) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}", timeout=60) as c:
        base = c.tokenize(BASE)
        p_session, p_plain = base + c.tokenize(" said"), base + c.tokenize(" saw")
        assert p_plain[:len(base)] == p_session[:len(base)]
        _, t = run(c, p_session, "a")
        assert (t.id_slot, t.cache_n, t.prompt_n) == (0, 0, len(p_session))
        toks, t = run(c, p_plain, None)
        assert (t.id_slot, t.cache_n, t.prompt_n) == (0, 0, len(p_plain))
        assert {s.name: (s.n_tokens, s.tier) for s in c.sessions()} == {
            "a": (len(p_session) + N, pb.SESSION_TIER_RAM)}
        # the same request alone, nothing reused: the same tokens
        rs, alone = c.generate(p_plain, max_tokens=N, temperature=0.0, cache_prompt=False)
        assert toks == [x for r in rs for x in r.tokens] and alone.timings.cache_n == 0
        # and the session continues from RAM with its own tokens
        _, t = run(c, c.tokenize(" again"), "a")
        assert (t.session_tier, t.cache_n) == (pb.SESSION_TIER_RAM, len(p_session) + N)


def test_mixed_load_matches_one_request_at_a_time(tmp_path: Path) -> None:
    """12 clients on 2 slots, 2 requests each: 6 with a session of their own (the second
    turn continues the first), 6 without; every prompt shares BASE's tokens. Each
    result is the one the same requests give one at a time."""
    clients = 12
    with running(config(tmp_path / "mixed", slots=2)) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}", timeout=120) as c:
        base = c.tokenize(BASE)
        words = [" said", " saw", " ran", " sang", " sat", " went", " lit", " hid"]
        plan = {i: [base + c.tokenize(words[(i + k) % len(words)]) if k == 0
                    else c.tokenize(words[(i + 3 * k) % len(words)]) for k in range(2)]
                for i in range(clients)}
        for i in range(clients):
            if i % 2:  # without a session every request carries the whole prompt
                plan[i][1] = base + plan[i][1]

        def session_of(i: int) -> str | None:
            return f"s{i}" if i % 2 == 0 else None

        got: dict[int, list[list[int]]] = {}
        errors: list[BaseException] = []
        start = threading.Barrier(clients)

        def client(i: int) -> None:
            try:
                with InferenceClient(f"127.0.0.1:{srv.port}", timeout=120) as ci:
                    start.wait(60)
                    got[i] = [run(ci, p, session_of(i))[0] for p in plan[i]]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert errors == [] and sorted(got) == list(range(clients))

    with running(config(tmp_path / "alone", slots=2)) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}", timeout=120) as c:
        for i in range(clients):
            want = [run(c, p, session_of(i))[0] for p in plan[i]]
            assert got[i] == want, f"client {i}"
