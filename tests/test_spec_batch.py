"""Speculative steps of several slots in one target pass (SpecDecoder.step_batch):
every slot gets exactly the tokens, RNG draws, counters and caches of stepping it
alone, greedy and sampled, whatever each slot's draft length and token budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_svc.core import BadStateError, InvalidArgumentError
from inference_svc.core.speculative import SamplingParams, SpecDecoder, SpecParams
from tests.factory import write_model
from tests.test_speculative import PROMPT, TARGET, open_decoder, perturbed_copy

pytestmark = pytest.mark.native

GREEDY = SamplingParams()
SAMPLINGS = [GREEDY, SamplingParams(temperature=0.9, top_k=30), GREEDY,
             SamplingParams(temperature=0.7, min_p=0.05)]
SPECS = [SpecParams(n_max=4), SpecParams(n_max=3), SpecParams(n_max=0),
         SpecParams(n_max=16, p_min=0.2)]
PROMPTS = [PROMPT, [9, 8, 7], PROMPT[:3], [100, 200, 250, 5]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("specbatch")
    write_model(d / "target.gguf", TARGET, seed=3)
    perturbed_copy(d / "target.gguf", d / "draft.gguf", noise=0.35)
    return d / "target.gguf", d / "draft.gguf"


# each slot its own penalties (so its own history) and logprobs
PENALIZED = [SamplingParams(repeat_penalty=1.3, repeat_last_n=16, logprobs=3),
             SamplingParams(temperature=0.9, top_k=30, presence_penalty=0.5,
                            frequency_penalty=0.3, repeat_last_n=32, logprobs=2),
             SamplingParams(frequency_penalty=1.0, repeat_last_n=8),
             SamplingParams(temperature=0.7, min_p=0.05, repeat_penalty=1.1, repeat_last_n=64,
                            logprobs=5)]


def run_slots(dec: SpecDecoder, batched: bool, steps: int, budget: int,
              samplings: list[SamplingParams] = SAMPLINGS) -> list[object]:
    """Prefills four slots, then steps them (in one batch each round, or one by one in
    slot order) until each has `budget` new tokens; every slot's tokens, counters,
    KV tokens, draft state and the logprobs of every returned token."""
    outs: list[list[int]] = []
    lps: list[list[object]] = [[] for _ in PROMPTS]
    for s, p in enumerate(PROMPTS):
        dec.seed(s, 40 + s)
        outs.append([dec.prefill(s, p, samplings[s])])
        lps[s] += dec.logprobs(s)
    order = [3, 1, 0, 2]
    for _ in range(steps):
        live = [s for s in order if len(outs[s]) < budget]
        if not live:
            break
        left = [budget - len(outs[s]) for s in live]
        if batched:
            res = dec.step_batch(live, [samplings[s] for s in live], [SPECS[s] for s in live],
                                 left)
            for s, r in zip(live, res, strict=True):
                outs[s] += r.tokens
                lps[s] += dec.logprobs(s)
        else:
            for s, n in zip(live, left, strict=True):
                outs[s] += dec.step(s, samplings[s], SPECS[s], n)
                lps[s] += dec.logprobs(s)
    for s in range(4):
        dec.commit(s)
    return [outs, [dec.counters(s) for s in range(4)], [dec.tokens(s) for s in range(4)],
            [bytes(dec.draft_state(s)) for s in range(4)], lps]


def test_batched_steps_equal_steps_one_by_one(pair: tuple[Path, Path]) -> None:
    results = []
    for batched in (True, False):
        for dec in open_decoder(pair[0], pair[1], n_slots=4, n_ctx=128):
            results.append(run_slots(dec, batched, steps=40, budget=30))
    assert results[0] == results[1]
    outs, counters = results[0][0], results[0][1]
    assert all(len(o) == 30 for o in outs)  # max_new bounded every slot's last step
    assert counters[2].n_drafted == 0  # n_max 0: a target-only slot rides in the same pass
    assert all(0 < counters[s].n_accepted < counters[s].n_drafted for s in (0, 1, 3))


def test_batched_steps_with_penalties_and_logprobs_equal_steps_one_by_one(
        pair: tuple[Path, Path]) -> None:
    results = []
    for batched in (True, False):
        for dec in open_decoder(pair[0], pair[1], n_slots=4, n_ctx=128):
            results.append(run_slots(dec, batched, steps=40, budget=30, samplings=PENALIZED))
    assert results[0] == results[1]  # logprob values compared exactly, as floats
    outs, lps = results[0][0], results[0][4]
    for s, sp in enumerate(PENALIZED):
        # one logprob row per returned token, each with the asked alternatives
        assert len(lps[s]) == (len(outs[s]) if sp.logprobs else 0)
        assert all(r.token == t and len(r.top) == sp.logprobs
                   for r, t in zip(lps[s], outs[s], strict=False))
    for dec in open_decoder(pair[0], pair[1], n_slots=4, n_ctx=128):
        plain = run_slots(dec, True, steps=40, budget=30)
    assert plain[0][0] != outs[0]  # the penalties changed what the greedy slot generated


def test_batched_step_reports_what_was_drafted(pair: tuple[Path, Path]) -> None:
    for dec in open_decoder(pair[0], pair[1], n_slots=2, n_ctx=64):
        dec.prefill(0, PROMPT, GREEDY)
        dec.prefill(1, PROMPT, GREEDY)
        before = [dec.counters(s) for s in (0, 1)]
        res = dec.step_batch([1, 0], [GREEDY, GREEDY], [SpecParams(n_max=5), SpecParams(n_max=0)],
                             [3, 9])
        assert [r.drafted for r in res] == [2, 0]  # slot 1: max_new 3 allows 2 proposals
        assert len(res[1].tokens) == 1 and 1 <= len(res[0].tokens) <= 3
        assert [(dec.counters(s) - before[s]).n_drafted for s in (1, 0)] == [2, 0]


def test_batched_step_checks_everything_before_decoding(pair: tuple[Path, Path]) -> None:
    for dec in open_decoder(pair[0], pair[1], n_slots=3, n_ctx=64):
        dec.prefill(0, PROMPT, GREEDY)
        dec.prefill(1, PROMPT, GREEDY)
        spec = SpecParams(n_max=4)
        with pytest.raises(BadStateError, match="slot 2 has no pending token"):
            dec.step_batch([0, 2], [GREEDY] * 2, [spec] * 2, [5, 5])
        with pytest.raises(InvalidArgumentError, match="slot 0 appears twice"):
            dec.step_batch([0, 0], [GREEDY] * 2, [spec] * 2, [5, 5])
        with pytest.raises(InvalidArgumentError, match="n_max 17 outside"):
            dec.step_batch([0, 1], [GREEDY] * 2, [spec, SpecParams(n_max=17)], [5, 5])
        with pytest.raises(InvalidArgumentError, match="max_new 0 must be >= 1"):
            dec.step_batch([0, 1], [GREEDY] * 2, [spec] * 2, [5, 0])
        with pytest.raises(InvalidArgumentError, match="one sampling, spec and max_new"):
            dec.step_batch([0, 1], [GREEDY], [spec] * 2, [5, 5])
        assert [dec.n_tokens(s) for s in (0, 1, 2)] == [len(PROMPT) + 1] * 2 + [0]
        assert [dec.draft_n_tokens(s) for s in (0, 1)] == [len(PROMPT)] * 2
