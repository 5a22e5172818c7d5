"""The bundled target and draft (models/): they load, their fingerprints are the
recorded ones, greedy completions match the committed golden tokens (any change
in numerics or weights shows here), the C core matches the numpy reference on
them, and greedy speculative decoding with the pair is the target's output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import Context, Model
from inference_svc.core.speculative import SamplingParams, SpecDecoder, SpecParams
from tests.reference import forward

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = json.loads((ROOT / "tests" / "fixtures" / "bundled_golden.json").read_text())
TARGET, DRAFT = ROOT / "models" / "target.gguf", ROOT / "models" / "draft.gguf"


@pytest.fixture(scope="module")
def target() -> Model:
    m = Model.load(TARGET)
    yield m
    m.close()


@pytest.fixture(scope="module")
def draft() -> Model:
    m = Model.load(DRAFT)
    yield m
    m.close()


def test_fingerprints_are_the_recorded_ones(target: Model, draft: Model) -> None:
    assert target.fingerprint == GOLDEN["target"]["fingerprint"]
    assert draft.fingerprint == GOLDEN["draft"]["fingerprint"]
    assert target.content.n_params == GOLDEN["target"]["n_params"]
    assert draft.content.n_params == GOLDEN["draft"]["n_params"]
    assert target.hparams.n_ctx_train == draft.hparams.n_ctx_train == 4096
    assert target.content.tokenizer == draft.content.tokenizer  # one shared tokenizer


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", range(3))
def test_greedy_golden(target: Model, case: int, threads: int) -> None:
    g = GOLDEN["greedy"][case]
    with Context(target, n_ctx=256, n_threads=threads) as ctx:
        logits = ctx.decode(0, target.tokenizer.encode(g["prompt"]))
        out = []
        for _ in range(len(g["tokens"])):
            out.append(int(logits.argmax()))
            logits = ctx.decode(0, [out[-1]])
    assert out == g["tokens"]
    assert target.tokenizer.decode(out) == g["text"]


# a fixed input (a project source file would change the tokens whenever it is edited)
REFERENCE_TEXT = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merges two sorted lists into one sorted list."""
    out: list[int] = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out


class Counter:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, word: str) -> None:
        self.counts[word] = self.counts.get(word, 0) + 1
'''


# f32 KV: only the float32 arithmetic differs from the float64 reference; f16 KV: a
# key or value near a half-precision rounding boundary may round the other way in the
# reference, so the rule (1e-3 of the largest logit) applies; likewise to q8_0
# KV, where a value can round to the next step of its block's scale
@pytest.mark.parametrize("kv_type,tol", [("f32", 1e-4), ("f16", 1e-3), ("q8_0", 1e-3)])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_core_matches_reference(target: Model, draft: Model, role: str, kv_type: str,
                                tol: float) -> None:
    m = target if role == "target" else draft
    ids = m.tokenizer.encode(REFERENCE_TEXT)[:96]
    assert len(ids) == 96
    with Context(m, n_ctx=128, kv_type=kv_type) as ctx:
        got = ctx.decode(0, ids, logits_all=True)
    ref = forward(m.hparams, m.content.dequantized(), ids, kv_type)
    assert float(np.abs(got - ref).max() / np.abs(ref).max()) < tol


def test_speculative_greedy_is_target_greedy(target: Model, draft: Model) -> None:
    """Every n_max in 1..16 gives the target-only greedy sequence on the bundled pair."""
    prompt = target.tokenizer.encode(GOLDEN["greedy"][2]["prompt"])
    with Context(target, n_slots=1, n_ctx=256) as tc, Context(draft, n_slots=1, n_ctx=256) as dc:
        dec = SpecDecoder(tc, dc)
        expected = dec.generate(0, prompt, 64, SamplingParams())
        assert expected[:32] == GOLDEN["greedy"][2]["tokens"]
        accepted = 0
        for n_max in range(1, 17):
            dec.clear(0)
            before = dec.counters(0)
            assert dec.generate(0, prompt, 64, SamplingParams(), SpecParams(n_max=n_max)) \
                == expected
            accepted += (dec.counters(0) - before).n_accepted
        assert accepted > 0
        dec.close()
