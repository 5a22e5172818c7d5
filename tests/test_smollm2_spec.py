"""Speculative decoding on the real pair, SmolLM2-135M-Instruct and its committed draft
(models/smollm2-draft.gguf), through the batched path the engine takes: greedy output
is the target-only sequence for every n_max from 1 to 16 with several slots verified
in one target pass; slots stepped together give exactly what they give one at a time
(sampled ones included, through the engine with its draft-length controller); and the
sampled tokens at the first two positions follow the target's law (chi-square)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from inference_svc.config import Config
from inference_svc.core import Context, Model
from inference_svc.core.speculative import (
    NO_SPEC,
    SamplingParams,
    SpecDecoder,
    SpecParams,
)
from inference_svc.engine.executor import Engine, GenJob
from inference_svc.engine.slot_owner import SlotOwner
from inference_svc.metrics import Metrics
from inference_svc.types import GenerateParams
from tests.enginekit import EngineHold, record_step_batches
from tests.test_speculative import chi2_pvalue, exact_dist

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT = ROOT / "models" / "smollm2-draft.gguf"
GREEDY = SamplingParams()
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = ("How do I politely decline a meeting invitation from my manager?",
             "Write a short poem about the first snow of winter.")
CODE = ("import os\n\n\ndef list_python_files(root):\n    ",
        "for i in range(10):\n    print(")


@pytest.fixture(scope="module")
def models() -> Iterator[tuple[Model, Model]]:
    assert TARGET.exists(), f"{TARGET} is missing: `make fetch-models` (part of `make setup`)"
    with Model.load(TARGET) as tm, Model.load(DRAFT) as dm:
        yield tm, dm


def open_decoder(models: tuple[Model, Model], n_slots: int, n_ctx: int) -> Iterator[SpecDecoder]:
    tm, dm = models
    with Context(tm, n_slots=n_slots, n_ctx=n_ctx, n_threads=2) as tc, \
            Context(dm, n_slots=n_slots, n_ctx=n_ctx, n_threads=1) as dc:
        dec = SpecDecoder(tc, dc)
        yield dec
        dec.close()


def chat(tm: Model, question: str) -> list[int]:
    tok = tm.tokenizer
    start, end = tok.data.tokens.index("<|im_start|>"), tok.data.tokens.index("<|im_end|>")
    nl = tok.encode("\n")
    return [start, *tok.encode(f"system\n{SYSTEM}"), end, *nl, start,
            *tok.encode(f"user\n{question}"), end, *nl, start, *tok.encode("assistant\n")]


def prompts(tm: Model) -> list[list[int]]:
    return [chat(tm, QUESTIONS[0]), tm.tokenizer.encode(CODE[0]), chat(tm, QUESTIONS[1]),
            tm.tokenizer.encode(CODE[1])]


N_NEW = 8


def test_greedy_batched_speculation_is_target_greedy_for_every_n_max(
        models: tuple[Model, Model]) -> None:
    """Four slots (chat and code) verified in one target pass per step, each with its
    own n_max, 1 to 16 over four rounds: every slot's tokens are the target-only ones."""
    ps = prompts(models[0])
    for dec in open_decoder(models, n_slots=4, n_ctx=128):
        expected = []
        for s, p in enumerate(ps):
            expected.append(dec.generate(s, p, N_NEW, GREEDY, NO_SPEC))
            dec.clear(s)
        drafted = 0
        for group in range(4):
            specs = [SpecParams(n_max=4 * group + s + 1) for s in range(4)]
            outs = [[dec.prefill(s, p, GREEDY)] for s, p in enumerate(ps)]
            while any(len(o) < N_NEW for o in outs):
                live = [s for s in range(4) if len(outs[s]) < N_NEW]
                res = dec.step_batch(live, [GREEDY] * len(live), [specs[s] for s in live],
                                     [N_NEW - len(outs[s]) for s in live])
                for s, r in zip(live, res, strict=True):
                    outs[s] += r.tokens
                    drafted += r.drafted
            assert outs == expected, specs
            for s in range(4):
                dec.clear(s)
        assert drafted > 0


def collect(job: GenJob) -> list[int]:
    return job.collect(timeout=300)[0]


def test_engine_steps_slots_together_as_one_at_a_time(
        models: tuple[Model, Model], monkeypatch: pytest.MonkeyPatch) -> None:
    """Three speculative requests (one greedy, two seeded and sampled) on the engine
    with its default draft-length controller: run one at a time, then admitted together
    so that their decode steps share target passes; the same tokens both ways, and the
    greedy one is the target-only sequence."""
    tm, dm = models
    cfg = Config(model=TARGET, draft=DRAFT, slots=3, ctx=256, threads=2, draft_threads=1,
                 seed=1, log_level="warning", log_format="text")
    assert cfg.speculative.enabled and cfg.speculative.adaptive  # the defaults
    spec = SpecParams(cfg.speculative.n_max, cfg.speculative.n_min, cfg.speculative.p_min)
    hot = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    ps = prompts(tm)
    reqs = [GenerateParams(tuple(ps[0]), 16, 0, False, GREEDY, None, spec),
            GenerateParams(tuple(ps[1]), 16, 1, False, hot, 7, spec),
            GenerateParams(tuple(ps[2]), 16, 2, False, hot, 9, spec)]
    engine = Engine(cfg, SlotOwner(cfg, tm, dm), Metrics())
    try:
        alone = [collect(engine.generate(r)) for r in reqs]
        batches = record_step_batches(engine, monkeypatch)
        hold = EngineHold(engine)
        jobs = [engine.generate(r) for r in reqs]
        hold.release()
        together = [collect(j) for j in jobs]
    finally:
        engine.close()
    assert together == alone
    assert all(len(t) == 16 for t in together)
    assert [len(b) for b in batches].count(3) >= 8  # the three decoded in shared passes
    for dec in open_decoder(models, n_slots=1, n_ctx=256):
        assert dec.generate(0, ps[0], 16, GREEDY, NO_SPEC) == alone[0]


RUNS, LANES = 240, 8


def test_sampling_distribution_matches_target_on_the_real_pair(
        models: tuple[Model, Model]) -> None:
    """Pairs (t1, t2) on a chat prompt where draft and target agree about half the
    time: t1 from the prefill, t2 from a batched speculative step (eight slots per
    target pass) whose draft proposes one token, accepted or resampled. Their joint
    law must be the target's, and the draft's own law at t2 must be told apart."""
    tm, dm = models
    sp = SamplingParams(temperature=1.0, top_k=4)
    prompt = chat(tm, QUESTIONS[0])
    with Context(tm, n_ctx=128) as tc, Context(dm, n_ctx=128) as dc:
        p1 = exact_dist(tc.decode(0, prompt), sp)
        dc.decode(0, prompt)
        cand = [int(t) for t in np.flatnonzero(p1)]
        p2, q2 = {}, {}
        for t1 in cand:
            tc.truncate(0, len(prompt))
            dc.truncate(0, len(prompt))
            p2[t1] = exact_dist(tc.decode(0, [t1]), sp)
            q2[t1] = exact_dist(dc.decode(0, [t1]), sp)
    cells = [(a, b) for a in cand for b in np.flatnonzero(p2[a] + q2[a]).tolist()]
    index = {c: i for i, c in enumerate(cells)}
    expected = np.array([p1[a] * p2[a][b] for a, b in cells]) * RUNS
    counts = np.zeros(len(cells))
    for dec in open_decoder(models, n_slots=LANES, n_ctx=128):
        for s in range(LANES):
            dec.prefill(s, prompt[:-1], sp)
        accepted = 0
        for run in range(0, RUNS, LANES):
            t1s = []
            for s in range(LANES):
                dec.truncate(s, len(prompt) - 1)
                dec.seed(s, run + s)
                t1s.append(dec.prefill(s, prompt[-1:], sp))
            res = dec.step_batch(list(range(LANES)), [sp] * LANES,
                                 [SpecParams(n_max=1)] * LANES, [2] * LANES)
            for t1, r in zip(t1s, res, strict=True):
                assert r.drafted == 1
                accepted += len(r.tokens) - 1
                counts[index[(t1, r.tokens[0])]] += 1
    assert 0.2 * RUNS < accepted < 0.8 * RUNS  # both branches exercised
    assert chi2_pvalue(counts, expected) > 1e-3
    # the test can fail: t2 drawn from the draft instead is measurably different
    wrong = np.array([p1[a] * q2[a][b] for a, b in cells]) * RUNS
    assert chi2_pvalue(wrong, expected) < 1e-6
