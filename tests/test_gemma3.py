"""Gemma 3 270M Q4_K_M (a real gemma3 model): the core against the float64 reference and
against llama.cpp's greedy continuations (ids in tests/fixtures/gemma3_oracle.json)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from inference_svc.core import Context, Model
from tests.gemma3kit import gemma_path, needs_gemma3, oracle
from tests.reference import forward

pytestmark = [pytest.mark.native, needs_gemma3]

N_GREEDY = 32


@pytest.fixture(scope="module")
def gemma() -> Iterator[Model]:
    with Model.load(gemma_path()) as model:
        yield model


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    return oracle()["greedy"]


def test_hparams_from_the_file(gemma: Model) -> None:
    hp = gemma.hparams
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv) == (
        "gemma3", 18, 640, 256, 4, 1)
    assert (hp.n_swa, hp.rope_theta, hp.rope_theta_swa) == (512, 1e6, 1e4)
    assert [i for i in range(hp.n_layer) if not hp.layer_is_local(i)] == [5, 11, 17]
    assert gemma.content.tied_output


def test_logits_match_the_float64_reference(gemma: Model, cases: list[dict[str, Any]]) -> None:
    """Every position of the five prompts: max |core - reference| <= 1e-3 max |logit|, and
    the same argmax wherever the reference's top two are further apart than that."""
    weights = gemma.content.dequantized()
    with Context(gemma, n_ctx=64, n_threads=2) as ctx:
        for case in cases:
            ctx.clear(0)
            got = ctx.decode(0, case["ids"], logits_all=True)
            ref = forward(gemma.hparams, weights, case["ids"])
            tol = 1e-3 * float(np.abs(ref).max())
            assert float(np.abs(got - ref).max()) <= tol, case["prompt"]
            top2 = np.sort(ref, axis=1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 2 * tol
            assert clear[-1], case["prompt"]  # the next token is not a near-tie
            assert np.array_equal(got.argmax(1)[clear], ref.argmax(1)[clear]), case["prompt"]


def greedy(ctx: Context, prompt: list[int], n: int) -> list[int]:
    ctx.clear(0)
    tok = int(np.argmax(ctx.decode(0, prompt)))
    out = [tok]
    while len(out) < n:
        tok = int(np.argmax(ctx.decode(0, [tok])))
        out.append(tok)
    return out


def top2_margin(logits: np.ndarray) -> float:
    a, b = np.sort(logits)[-2:]
    return float(b - a)


def test_greedy_against_llama_cpp(gemma: Model, cases: list[dict[str, Any]]) -> None:
    """32 greedy tokens after each of five prompts against llama.cpp's. They agree up to
    a near-tie: where they part, both sides' top two are within 0.5 of each other, while
    llama.cpp sits 2.5-5.6% of the largest logit (0.6-1.9) from the float64 reference
    there (it rounds activations to 8 bits for its quantized products; on an F32 copy of
    the weights it agrees with the core for 40 tokens on every prompt:
    tools/gemma3_agreement.py); the core is within 1e-3 of that reference."""
    with Context(gemma, n_ctx=128, n_threads=2) as ctx:
        for case in cases:
            expected = case["continuation"][:N_GREEDY]
            ctx.clear(0)
            logits = ctx.decode(0, case["ids"])
            got: list[int] = []
            while len(got) < N_GREEDY and int(np.argmax(logits)) == expected[len(got)]:
                got.append(int(np.argmax(logits)))
                logits = ctx.decode(0, [got[-1]])
            if len(got) == N_GREEDY:
                continue
            at = len(got)
            assert at >= 3, (case["prompt"], at)
            assert top2_margin(logits) < 0.5, (case["prompt"], at)
            assert case["margins"][at] < 0.5, (case["prompt"], at)
