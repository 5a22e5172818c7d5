"""Scheduling wired through real gRPC: concurrent clients on fewer slots, busy slots,
cancellation and disconnects, EOS, long prompts. The scheduling decisions themselves
(orders, counts, limits, deadlines) are tested exactly in tests/test_scheduler.py."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient, make_request
from inference_svc.pb import inference_pb2 as pb
from tests.enginekit import EngineHold, record_step_batches
from tests.fixtures.servicekit import (
    SLOW,
    Reference,
    fresh_client,
    model_pair,
    running,
    service_config,
)

CTX = 2048
# tokens of a generation that must still be running when we look: a few seconds, many
# times what the busy-slot checks take (450 tokens finished during them on a loaded
# machine once, 1 run in 30)
LONG = 1900


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return model_pair(tmp_path_factory.getbasetemp(), "slow-2k",
                      shape=dataclasses.replace(SLOW, n_ctx=CTX))


@pytest.fixture(scope="module")
def ref(pair: tuple[Path, Path]) -> Reference:
    return Reference(*pair, n_ctx=CTX)


@pytest.fixture(scope="module")
def server(pair: tuple[Path, Path]) -> Iterator[Server]:
    with running(service_config(*pair, ctx=CTX, max_queue_wait=0.15, max_queue=3)) as srv:
        yield srv


def prompt_of(i: int) -> list[int]:
    return [(31 * i + 7 * k) % 250 + 1 for k in range(10 + i)]


def tokens_of(rs: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in rs for t in r.tokens]


def wait_idle(c: InferenceClient, slot: int, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while c.slots()[slot].busy:
        assert time.monotonic() - t0 < timeout, f"slot {slot} still busy"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_four_clients_on_two_slots(client: InferenceClient, ref: Reference,
                                   server: Server) -> None:
    results: dict[int, tuple[list[int], pb.GenerateResponse] | BaseException] = {}

    def run(i: int) -> None:
        # waiting for a slot may take a while: this server's max_queue_wait is short, so
        # the clients retry on RESOURCE_EXHAUSTED, as a client of a busy server should
        with InferenceClient(f"127.0.0.1:{server.port}", timeout=60) as c:
            for _ in range(100):
                try:
                    rs, last = c.generate(prompt_of(i), max_tokens=24, temperature=0.0)
                    results[i] = (tokens_of(rs), last)
                    return
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        results[i] = exc
                        return
                    time.sleep(0.01)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    for i, res in results.items():
        assert not isinstance(res, BaseException), res
        toks, last = res
        assert toks == ref.generate(prompt_of(i), 24), i
        assert last.timings.id_slot in (0, 1)
        assert last.timings.prompt_n + last.timings.cache_n == len(prompt_of(i))


def test_concurrent_requests_interleave(client: InferenceClient, server: Server,
                                        ref: Reference) -> None:
    events: dict[int, list[float]] = {0: [], 1: []}
    toks: dict[int, list[int]] = {}

    clients = [InferenceClient(f"127.0.0.1:{server.port}", timeout=60) for _ in (0, 1)]
    # both calls start here, back to back (a thread that started late could otherwise find
    # the other's 200 tokens already done on a loaded machine)
    streams = [c.generate_stream(make_request(prompt_of(slot), max_tokens=200, id_slot=slot,
                                              temperature=0.0, speculative=False))
               for slot, c in enumerate(clients)]

    def run(slot: int) -> None:
        out = []
        for r in streams[slot]:
            events[slot].append(time.monotonic())
            out += r.tokens
        toks[slot] = out

    threads = [threading.Thread(target=run, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in clients:
        c.close()
    for s in (0, 1):
        assert toks[s] == ref.generate(prompt_of(s), 200)
    # each stream's first output arrived before the other one finished
    assert events[1][0] < events[0][-1] and events[0][0] < events[1][-1]


def test_busy_slot_waits_then_resource_exhausted(client: InferenceClient) -> None:
    stream = client.generate_stream(make_request(prompt_of(0), max_tokens=LONG, id_slot=0,
                                                 temperature=0.0, speculative=False))
    next(stream)  # slot 0 is busy now
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt_of(1), max_tokens=4, id_slot=0)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "slot 0 stayed busy" in err.value.details()
    # slot ops wait for the slot too
    with pytest.raises(grpc.RpcError) as err:
        client.erase(0)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # with a deadline shorter than the server's wait: one of the two codes
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt_of(1), max_tokens=4, id_slot=0, timeout=0.05)
    assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                grpc.StatusCode.DEADLINE_EXCEEDED)
    assert client.slots()[0].busy, "the long generation should still be running"
    # another slot is free meanwhile
    _, last = client.generate(prompt_of(1), max_tokens=4, id_slot=-1)
    assert last.timings.id_slot == 1
    stream.cancel()
    wait_idle(client, 0)


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_cancellation_frees_the_slot(client: InferenceClient, server: Server, how: str) -> None:
    p = prompt_of(4)
    c2 = InferenceClient(f"127.0.0.1:{server.port}", timeout=60)
    stream = c2.generate_stream(make_request(p, max_tokens=LONG, id_slot=0, temperature=0.0))
    got = tokens_of([next(stream), next(stream)])
    if how == "cancel":
        stream.cancel()
    else:
        c2.close()
    wait_idle(client, 0)  # the scheduler stops it at the next unit (tests/test_scheduler.py)
    if how == "cancel":
        c2.close()
    kept = client.slots()[0].n_tokens
    assert len(p) + len(got) <= kept < len(p) + LONG  # what was processed stays
    # the continuation reuses it
    _, last = client.generate(p + got, max_tokens=4, id_slot=0, temperature=0.0)
    assert (last.timings.prompt_n, last.timings.cache_n) == (1, len(p) + len(got) - 1)


def test_busy_slots_gauge_follows_the_slots(client: InferenceClient, server: Server) -> None:
    """warmslot_slots_busy counts the busy slots after a generation ends while another
    one keeps running (nothing admitted in between)."""
    def busy_gauge() -> float | None:
        return server.metrics.registry.get_sample_value("warmslot_slots_busy")

    long = client.generate_stream(make_request(prompt_of(0), max_tokens=LONG, id_slot=0,
                                               temperature=0.0, speculative=False))
    next(long)
    _, last = client.generate(prompt_of(1), max_tokens=4, id_slot=1, temperature=0.0)
    assert last.done
    # ListSlots runs on the engine thread between rounds, after the gauge is published
    assert [s.busy for s in client.slots()] == [True, False]
    assert busy_gauge() == 1
    long.cancel()
    wait_idle(client, 0)
    assert busy_gauge() == 0


def sample(srv: Server, name: str, **labels: str) -> float:
    return srv.metrics.registry.get_sample_value(name, labels) or 0.0


def wait_for(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_request_cancelled_while_waiting(pair: tuple[Path, Path]) -> None:
    """A request cancelled while it waits for a busy slot leaves the queue at once (the
    slot's generation still running), with CANCELLED, and never runs. Its own server
    lets requests wait 30 s, so nothing but the cancel can take it out of the queue."""
    with running(service_config(*pair, ctx=CTX, max_queue_wait=30.0, max_queue=3)) as srv, \
            fresh_client(srv) as client:
        long = client.generate_stream(make_request(prompt_of(0), max_tokens=LONG, id_slot=0,
                                                   speculative=False))
        next(long)
        waiting = client.generate_stream(make_request(prompt_of(1), max_tokens=4, id_slot=0))
        wait_for(lambda: sample(srv, "warmslot_queue_depth") == 1, "the request never queued")
        waiting.cancel()
        wait_for(lambda: sample(srv, "warmslot_requests_total", method="Generate",
                                code="CANCELLED") == 1, "the cancel was not seen")
        # the handler counts the cancel at once; the engine takes the request out of
        # the queue at its next unit boundary, while the slot's generation still runs
        wait_for(lambda: sample(srv, "warmslot_queue_depth") == 0, "the request stayed queued")
        assert client.slots()[0].busy, "the slot freed: the request left by admission"
        long.cancel()
        wait_idle(client, 0)
        # only the long generation's prompt was ever processed
        assert sample(srv, "warmslot_tokens_total", kind="prompt") == len(prompt_of(0))
        # its handler counts the cancel when its stream ends, which may be just after the
        # engine has freed the slot
        wait_for(lambda: sample(srv, "warmslot_requests_total", method="Generate",
                                code="CANCELLED") == 2,
                 "the long generation's cancel was not counted")
        _, last = client.generate(prompt_of(1), max_tokens=4, id_slot=0)
        assert last.done and last.timings.predicted_n == 4


def test_long_prompt_in_chunks(client: InferenceClient, ref: Reference, server: Server) -> None:
    p = [(13 * k) % 290 + 1 for k in range(server.cfg.batch * 3 + 5)]
    rs, last = client.generate(p, max_tokens=16, id_slot=0, temperature=0.0)
    assert last.timings.prompt_n == len(p)
    assert last.timings.draft_prompt_n == len(p)
    assert tokens_of(rs) == ref.generate(p, 16)


def test_eos_stops_and_is_not_kept(tmp_path_factory: pytest.TempPathFactory) -> None:
    pair = model_pair(tmp_path_factory.getbasetemp(), "eos", eos_scale=3.0)
    ref = Reference(*pair)
    with running(service_config(*pair)) as srv, InferenceClient(f"127.0.0.1:{srv.port}") as c:
        eos = c.info().eos_id
        n_eos = 0
        for i in range(12):
            p = prompt_of(i)
            expected = ref.generate(p, 30)
            rs, last = c.generate(p, max_tokens=30, id_slot=0, temperature=0.0)
            assert tokens_of(rs) == expected and eos not in expected
            if len(expected) < 30:
                n_eos += 1
                assert last.stop_reason == pb.STOP_REASON_EOS
                assert last.timings.predicted_n == len(expected)
            else:
                assert last.stop_reason == pb.STOP_REASON_MAX_TOKENS
            assert c.slots()[0].n_tokens == len(p) + len(expected)
        assert n_eos >= 3


def test_batched_sampled_steps_match_single_runs(client: InferenceClient, server: Server,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two seeded, sampled, non-speculative streams that the engine steps in one forward
    pass give the same tokens as each request run alone. The engine is held while both
    queue, so both are admitted in one round and every decoding step after the prefill
    is one batched pass for the two slots (counted on the decoder)."""
    def req(slot: int) -> pb.GenerateRequest:
        return make_request(prompt_of(slot), max_tokens=60, id_slot=slot, temperature=0.9,
                            top_k=40, seed=1000 + slot, speculative=False, cache_prompt=False)

    alone = {s: [t for r in client.generate_stream(req(s)) for t in r.tokens] for s in (0, 1)}
    assert len(alone[0]) == len(alone[1]) == 60

    engine = server._engine
    assert engine is not None
    batched = record_step_batches(engine, monkeypatch)
    hold = EngineHold(engine)
    together: dict[int, list[int]] = {}
    try:
        streams = {s: client.generate_stream(req(s)) for s in (0, 1)}
        wait_for(lambda: sample(server, "warmslot_queue_depth") == 2, "the requests never queued")
    finally:
        hold.release()

    def run(slot: int) -> None:
        together[slot] = [t for r in streams[slot] for t in r.tokens]

    threads = [threading.Thread(target=run, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert together == alone
    # the first token of each comes from its prefill, the other 59 from batched steps
    assert batched == [[0, 1]] * 59
