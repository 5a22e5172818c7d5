"""Penalties and logprobs in the core's sampler: greedy decoding with penalties against a
numpy reimplementation over the core's own logits, the same tokens with and without
speculation and in multi-slot steps, and the logprobs' exact values against the
log-softmax of the core's logits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import Context, InvalidArgumentError, Model
from inference_svc.core.speculative import (
    NO_SPEC,
    SamplingParams,
    SpecDecoder,
    SpecParams,
    TokenLogprob,
)
from tests.factory import write_model
from tests.test_speculative import TARGET, open_decoder, perturbed_copy

pytestmark = pytest.mark.native

PROMPT = [5, 17, 250, 3, 99, 42, 7, 17, 17, 5]
N = 40
PENALTIES = {
    "repeat": dict(repeat_penalty=1.3, repeat_last_n=16),
    "repeat_weak_all": dict(repeat_penalty=0.7, repeat_last_n=4096),
    "presence": dict(presence_penalty=1.5, repeat_last_n=64),
    "frequency": dict(frequency_penalty=0.6, repeat_last_n=32),
    "negative": dict(presence_penalty=-0.5, frequency_penalty=-0.25, repeat_last_n=8),
    "all": dict(repeat_penalty=1.1, presence_penalty=0.4, frequency_penalty=0.3,
                repeat_last_n=24),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("penalties")
    target, draft = d / "target.gguf", d / "draft.gguf"
    write_model(target, TARGET, seed=3)
    perturbed_copy(target, draft, noise=0.35)
    return target, draft


@pytest.fixture()
def dec(pair: tuple[Path, Path]) -> Iterator[SpecDecoder]:
    yield from open_decoder(pair[0], pair[1])


def penalize(logits: np.ndarray, hist: list[int], sp: SamplingParams) -> np.ndarray:
    """llama.cpp's penalties, OpenAI's presence/frequency terms, in float32."""
    out = logits.astype(np.float32).copy()
    window = hist[-sp.repeat_last_n:] if sp.repeat_last_n else []
    rp = np.float32(sp.repeat_penalty)
    for t in dict.fromkeys(window):  # first-seen order; each token once
        c = window.count(t)
        x = out[t]
        if sp.repeat_penalty not in (0.0, 1.0):
            x = x * rp if x <= 0 else x / rp
        out[t] = np.float32(x - (np.float32(c) * np.float32(sp.frequency_penalty)
                                 + np.float32(sp.presence_penalty)))
    return out


def numpy_greedy(target: Path, prompt: list[int], n: int, sp: SamplingParams) -> list[int]:
    with Model.load(target) as m, Context(m, n_ctx=256) as ctx:
        hist = list(prompt)
        logits = ctx.decode(0, prompt)
        out: list[int] = []
        for _ in range(n):
            out.append(int(np.argmax(penalize(logits, hist, sp))))
            hist.append(out[-1])
            logits = ctx.decode(0, [out[-1]])
        return out


def with_(**kw: object) -> SamplingParams:
    return SamplingParams(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", PENALTIES)
def test_greedy_penalties_match_numpy(dec: SpecDecoder, pair: tuple[Path, Path],
                                      name: str) -> None:
    sp = with_(**PENALTIES[name])
    expected = numpy_greedy(pair[0], PROMPT, N, sp)
    assert expected != numpy_greedy(pair[0], PROMPT, N, SamplingParams())  # they do act
    assert dec.generate(0, PROMPT, N, sp) == expected
    dec.clear(0)
    # speculative: the draft applies the same penalties; greedy output stays the target's
    assert dec.generate(0, PROMPT, N, sp, SpecParams(n_max=4)) == expected
    c = dec.counters(0)
    assert c.n_accepted > 0
    dec.clear(1)
    assert dec.generate(1, PROMPT, N, sp, SpecParams(n_max=16)) == expected


def test_draft_applies_the_same_penalties(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """A draft that is the target itself: with the penalties applied alike on both
    sides, every proposal is accepted."""
    same = tmp_path / "same.gguf"
    perturbed_copy(pair[0], same, noise=0.0)
    for d in open_decoder(pair[0], same):
        sp = with_(**PENALTIES["all"])
        assert d.generate(0, PROMPT, N, sp, SpecParams(n_max=4)) == numpy_greedy(
            pair[0], PROMPT, N, sp)
        c = d.counters(0)
        assert c.n_drafted > 0 and c.n_accepted == c.n_drafted


def test_step_multi_penalties(dec: SpecDecoder, pair: tuple[Path, Path]) -> None:
    a, b = with_(**PENALTIES["all"]), with_(**PENALTIES["frequency"])
    ea = numpy_greedy(pair[0], PROMPT, 12, a)
    eb = numpy_greedy(pair[0], PROMPT[:5], 12, b)
    oa, ob = [dec.prefill(0, PROMPT, a)], [dec.prefill(1, PROMPT[:5], b)]
    while len(oa) < 12:
        x, y = dec.step_multi([0, 1], [a, b])
        oa.append(x)
        ob.append(y)
    assert (oa, ob) == (ea, eb)


def test_sampled_penalties_spec_is_deterministic(dec: SpecDecoder) -> None:
    sp = with_(temperature=0.9, **PENALTIES["all"])
    dec.seed(0, 7)
    first = dec.generate(0, PROMPT, N, sp, SpecParams(n_max=4))
    dec.clear(0)
    dec.seed(0, 7)
    assert dec.generate(0, PROMPT, N, sp, SpecParams(n_max=4)) == first


def expected_logprobs(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    x = logits.astype(np.float64)
    mx = x.max()
    lse = mx + np.log(np.sum(np.exp(x - mx)))
    order = sorted(range(len(x)), key=lambda i: (-logits[i], i))[:k]
    return TokenLogprob(token, float(np.float32(x[token] - lse)),
                        [(i, float(np.float32(x[i] - lse))) for i in order])


def reference_logits(target: Path, prompt: list[int], out: list[int]) -> np.ndarray:
    """The core's raw logits at every generated position, decoded by a plain context."""
    with Model.load(target) as m, Context(m, n_ctx=256) as ctx:
        rows = ctx.decode(0, prompt + out[:-1], logits_all=True)
        return rows[len(prompt) - 1:]


@pytest.mark.parametrize("k, spec", [(1, None), (5, None), (20, SpecParams(n_max=4)),
                                     (3, SpecParams(n_max=16))])
def test_logprobs_exact(dec: SpecDecoder, pair: tuple[Path, Path], k: int,
                        spec: SpecParams | None) -> None:
    sp = with_(temperature=0.8, logprobs=k, **PENALTIES["all"])
    dec.seed(0, 3)
    out = [dec.prefill(0, PROMPT, sp, with_draft=spec is not None)]
    got = dec.logprobs(0)
    while len(out) < N:
        step = dec.step(0, sp, spec or NO_SPEC, N - len(out))
        lps = dec.logprobs(0)
        assert [lp.token for lp in lps] == step
        out += step
        got += lps
    assert [lp.token for lp in got] == out
    rows = reference_logits(pair[0], PROMPT, out)
    want = [expected_logprobs(rows[i], out[i], k) for i in range(N)]
    assert got == want
    assert all(len(lp.top) == k for lp in got)


def test_logprobs_step_multi_and_off(dec: SpecDecoder, pair: tuple[Path, Path]) -> None:
    sp = with_(logprobs=4)
    t0 = dec.prefill(0, PROMPT, sp)
    dec.prefill(1, PROMPT[:5], SamplingParams())
    assert dec.logprobs(1) == []
    t1, _ = dec.step_multi([0, 1], [sp, SamplingParams()])
    lp = dec.logprobs(0)
    rows = reference_logits(pair[0], PROMPT, [t0, t1])
    assert lp == [expected_logprobs(rows[1], t1, 4)]
    assert dec.logprobs(1) == []


@pytest.mark.parametrize("field, value, message", [
    ("repeat_penalty", -0.1, "repeat_penalty -0.1 outside [0, 10]"),
    ("repeat_penalty", 10.5, "repeat_penalty 10.5 outside [0, 10]"),
    ("repeat_last_n", -1, "repeat_last_n -1 outside 0..4096"),
    ("repeat_last_n", 4097, "repeat_last_n 4097 outside 0..4096"),
    ("presence_penalty", 2.5, "presence_penalty 2.5 outside [-2, 2]"),
    ("frequency_penalty", float("nan"), "frequency_penalty nan outside [-2, 2]"),
    ("logprobs", 21, "n_logprobs 21 outside 0..20"),
    ("logprobs", -1, "n_logprobs -1 outside 0..20"),
])
def test_bad_parameters(dec: SpecDecoder, field: str, value: float, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("[", r"\[").replace(
            "(", r"\(")):
        dec.check(with_(**{field: value}))
