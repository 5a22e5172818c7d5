"""The C core's logits match the numpy reference forward pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import Context, Model
from tests.factory import Shape, write_model
from tests.int16_model import INT_TYPES
from tests.reference import forward

pytestmark = pytest.mark.native

SHAPES = {
    "mha": Shape(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=4, n_ff=96),
    "gqa": Shape(n_vocab=320, n_embd=96, n_layer=3, n_head=6, n_head_kv=2, n_ff=160),
    "mqa_tied": Shape(n_vocab=277, n_embd=48, n_layer=1, n_head=4, n_head_kv=1, n_ff=80,
                      tied=True),
    "odd": Shape(n_vocab=263, n_embd=36, n_layer=2, n_head=3, n_head_kv=3, n_ff=57,
                 rope_theta=500.0),
    "f16": Shape(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96, dtype="f16"),
    "bf16": Shape(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96,
                  dtype="bf16"),
    **{q: Shape(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96, dtype=q)
       for q in ("q8_0", "q4_0", "q4_1", "q5_0")},
    **{q: Shape(n_vocab=290, n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512, dtype=q)
       for q in ("q4_k", "q5_k", "q6_k")},
    # gemma3: head_dim != n_embd / n_head, 7 layers (layer 5 global), a window of 9 over
    # 40 tokens; tied (as Gemma 3) and untied
    "gemma3": Shape(n_vocab=300, n_embd=48, n_layer=7, n_head=4, n_head_kv=2, n_ff=80,
                    tied=True, arch="gemma3", head_dim=16, n_swa=9, rope_theta=1e6),
    "gemma3_mha_q8": Shape(n_vocab=300, n_embd=64, n_layer=6, n_head=2, n_head_kv=2, n_ff=96,
                           arch="gemma3", head_dim=32, n_swa=5, dtype="q8_0"),
}


# Integer weight types multiply activations quantized to 16 bits per block of 32 (a step
# of amax / 32767): on these random models that moves the logits by 1e-4..2e-4 of the
# largest (measured: q4_0 1.4e-4, q6_k 1.9e-4, q4_k 3e-6), where 8 bits would move them
# by ~3e-2. The bound sits between them and under the project's rule of 1e-3.
INT_BOUND = 5e-4


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_logits_match_reference(tmp_path: Path, name: str) -> None:
    shape = SHAPES[name]
    path = tmp_path / f"{name}.gguf"
    written = write_model(path, shape, seed=7)
    tokens = np.random.default_rng(3).integers(0, shape.n_vocab, 40).tolist()
    # the reference computes in float64 on gguf's dequantization of the stored weights
    with Model.load(path) as model, Context(model, n_slots=1, n_ctx=64, n_threads=2) as ctx:
        assert model.content.tied_output == shape.tied
        if shape.dtype in ("f32", "f16"):  # the loader hands the core exactly what was stored
            stored = written["blk.0.attn_q.weight"].astype(
                np.float16 if shape.dtype == "f16" else np.float32).astype(np.float32)
            assert np.array_equal(model.content.tensors["blk.0.attn_q.weight"].dequantize(),
                                  stored)
        assert model.content.tensors["blk.0.attn_q.weight"].type_name == shape.dtype.upper()
        ref = forward(model.hparams, model.content.dequantized(), tokens)
        got = ctx.decode(0, tokens, logits_all=True)
    assert got.shape == (40, shape.n_vocab)
    assert rel_err(got, ref) < (INT_BOUND if shape.dtype in INT_TYPES else 1e-4)


def test_last_logits_equal_last_row_of_all(small_model_path: Path) -> None:
    tokens = [5, 17, 250, 3, 99, 42]
    with Model.load(small_model_path) as model, Context(model, n_slots=2, n_ctx=32) as ctx:
        all_rows = ctx.decode(0, tokens, logits_all=True)
        last = ctx.decode(1, tokens)
    assert np.array_equal(all_rows[-1], last)
