"""The f16 KV cache's conversions: float -> half rounds to nearest even exactly as
numpy's float16 does (subnormals, ties, overflow, infinities), half -> float is exact
for all 65536 halves, NaNs stay NaNs; the vector (F16C) and scalar paths and the
portable build give the same bits."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import binding
from inference_svc.core.binding import ffi

pytestmark = pytest.mark.native

ROOT = Path(__file__).resolve().parent.parent
ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def to_half(x: np.ndarray, step: int = 0) -> np.ndarray:
    """The core's float -> half of x; step > 0 converts in calls of `step` values (7:
    the scalar tail only; 0: one call, 8 lanes at a time where the build has F16C)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(x.shape, dtype=np.uint16)
    step = step or max(x.size, 1)
    for i in range(0, x.size, step):
        n = min(step, x.size - i)
        binding.fp16_from_fp32(ffi.from_buffer("float[]", x[i:i + n]),
                               ffi.from_buffer("uint16_t[]", out[i:i + n]), n)
    return out


def to_float(h: np.ndarray, step: int = 0) -> np.ndarray:
    h = np.ascontiguousarray(h, dtype=np.uint16)
    out = np.zeros(h.shape, dtype=np.float32)
    step = step or max(h.size, 1)
    for i in range(0, h.size, step):
        n = min(step, h.size - i)
        binding.fp32_from_fp16(ffi.from_buffer("uint16_t[]", h[i:i + n]),
                               ffi.from_buffer("float[]", out[i:i + n]), n)
    return out


def float_probes() -> np.ndarray:
    """Floats around every half: each half's value, the midpoints to its neighbours
    (ties), one float ulp either side of them, and random bit patterns; NaNs removed."""
    h = ALL_HALVES.view(np.float16).astype(np.float64)
    h = np.sort(h[np.isfinite(h)])
    mids = (h[:-1] + h[1:]) / 2  # exact in float32: a half has 11 significant bits
    exact = np.concatenate([h, mids, [65520.0, -65520.0, 65519.99, 2.0 ** -25, 2.0 ** -26,
                                       3 * 2.0 ** -26, 1e-40, -1e-45, 7e4, np.inf, -np.inf]])
    f = exact.astype(np.float32)
    assert np.array_equal(f.astype(np.float64)[:len(h) + len(mids)],
                          exact[:len(h) + len(mids)])
    bits = f.view(np.uint32)
    rng = np.random.default_rng(5)
    rand = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    probes = np.concatenate([bits, bits + 1, bits - 1, rand]).view(np.float32)
    return probes[~np.isnan(probes)]


@pytest.mark.parametrize("step", [0, 7])
def test_half_to_float_is_exact_for_every_half(step: int) -> None:
    got = to_float(ALL_HALVES, step)
    want = ALL_HALVES.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert nan.sum() == 2046  # 2 signs x 1023 payloads
    assert got[~nan].view(np.uint32).tolist() == want[~nan].view(np.uint32).tolist()
    # a NaN stays a NaN of the same sign, made quiet, its payload kept in the top bits
    g, w = got[nan].view(np.uint32), want[nan].view(np.uint32)
    assert np.isnan(got[nan]).all()
    assert (g == (w | 0x0040_0000)).all()


@pytest.mark.parametrize("step", [0, 7])
def test_float_to_half_rounds_like_numpy(step: int) -> None:
    f = float_probes()
    got = to_half(f, step)
    with np.errstate(over="ignore"):  # numpy warns on the values that round to infinity
        want = f.astype(np.float16).view(np.uint16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(float(f[i]), hex(int(got[i])), hex(int(want[i]))) for i in bad[:5]]


def test_float_to_half_edges() -> None:
    cases = {
        65504.0: 0x7BFF, 65519.0: 0x7BFF, 65520.0: 0x7C00, 1e9: 0x7C00, -np.inf: 0xFC00,
        2.0 ** -24: 0x0001, 2.0 ** -25: 0x0000, 1.5 * 2.0 ** -24: 0x0002,  # ties to even
        2.5 * 2.0 ** -24: 0x0002, 2.0 ** -14: 0x0400, 1.0 + 2.0 ** -11: 0x3C00,
        1.0 + 3 * 2.0 ** -11: 0x3C02, -0.0: 0x8000, 1e-30: 0x0000,
    }
    f = np.array(list(cases), dtype=np.float32)
    assert [hex(v) for v in to_half(f).tolist()] == [hex(v) for v in cases.values()]


@pytest.mark.parametrize("step", [0, 7])
def test_nan_stays_a_quiet_nan_of_its_sign(step: int) -> None:
    bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF],
                    dtype=np.uint32)
    got = to_half(bits.view(np.float32), step)
    assert [hex(v) for v in got.tolist()] == ["0x7e00", "0xfe00", "0x7e00", "0xfe09", "0x7fff"]


PORTABLE_PROBE = """
import hashlib
import numpy as np
from inference_svc.core.binding import NATIVE_VARIANT
from tests.test_core_fp16 import ALL_HALVES, float_probes, to_float, to_half
print(NATIVE_VARIANT, hashlib.sha256(to_half(float_probes()).tobytes()).hexdigest(),
      hashlib.sha256(to_float(ALL_HALVES).tobytes()).hexdigest())
"""


@pytest.mark.skipif(os.environ.get("WARMSLOT_NATIVE", "release") != "release",
                    reason="compares the release build with the portable one")
def test_portable_build_converts_to_the_same_bits() -> None:
    env = {**os.environ, "WARMSLOT_NATIVE": "portable"}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", PORTABLE_PROBE], capture_output=True, text=True,
                         check=True, env=env, cwd=ROOT).stdout.split()
    assert out == ["portable", hashlib.sha256(to_half(float_probes()).tobytes()).hexdigest(),
                   hashlib.sha256(to_float(ALL_HALVES).tobytes()).hexdigest()]


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_both_kv_types_match_the_reference_with_their_rounding(tmp_path: Path,
                                                               kv_type: str) -> None:
    from inference_svc.core import Context, Model
    from tests.factory import Shape, write_model
    from tests.reference import forward

    shape = Shape(n_vocab=320, n_embd=96, n_layer=3, n_head=6, n_head_kv=2, n_ff=160)
    write_model(tmp_path / "m.gguf", shape, seed=7)
    tokens = np.random.default_rng(3).integers(0, shape.n_vocab, 40).tolist()
    with Model.load(tmp_path / "m.gguf") as model, \
            Context(model, n_ctx=64, kv_type=kv_type) as ctx:
        got = ctx.decode(0, tokens, logits_all=True)
        ref = forward(model.hparams, model.content.dequantized(), tokens, kv_type)
    assert float(np.abs(got - ref).max() / np.abs(ref).max()) < 1e-4
