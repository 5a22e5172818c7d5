"""The feature head in the core: loading (and refusing) a warmslot-head GGUF, its
forward pass against a numpy reference of the contract, and its bits across batches,
threads and builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import Context, Model, ModelLoadError
from inference_svc.core.head import Head
from tests.headkit import write_head

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "models" / "target.gguf"
TOKENS = np.random.default_rng(21).integers(0, 2048, 24).tolist()

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def head_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("head") / "head.gguf", TARGET, k=96, n_ff=128,
                      seed=1, token_ids=np.random.default_rng(2).permutation(2048)[:96])


def target_hidden(model: Model, tokens: list[int]) -> np.ndarray:
    with Context(model, n_ctx=64, n_threads=1) as ctx:
        _, h = ctx.decode_ex([0], [tokens], logits=False, hidden=True)
    assert h is not None
    return h


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, base: float) -> np.ndarray:
    """(T, H, D): adjacent pairs turned by pos * base^(-2i/D) (GGUF's llama layout)."""
    t, _, d = x.shape
    ang = np.arange(t)[:, None] * base ** (-np.arange(0, d, 2) / d)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    return np.stack((a * c - b * s, a * s + b * c), -1).reshape(x.shape)


def reference(head: Head, emb: np.ndarray, hid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HEAD_SPEC's forward of the pairs (hid[p], emb[p]) at positions 0..T-1 in float64:
    (logits over token_ids, predicted hidden states)."""
    w = {n: t.dequantize().astype(np.float64) for n, t in head._tensors.items()}
    hp = head.params
    t, hd = emb.shape[0], hp.head_dim
    x = np.concatenate([emb, hid], 1) @ w["fc.weight"].T
    h = rms(x, w["blk.0.attn_norm.weight"], hp.rms_eps)
    q = rope((h @ w["blk.0.attn_q.weight"].T).reshape(t, hp.n_head, hd), hp.rope_theta)
    k = rope((h @ w["blk.0.attn_k.weight"].T).reshape(t, hp.n_head_kv, hd), hp.rope_theta)
    v = (h @ w["blk.0.attn_v.weight"].T).reshape(t, hp.n_head_kv, hd)
    rep = hp.n_head // hp.n_head_kv
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    sc = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
    sc = np.where(np.triu(np.ones((t, t), bool), 1)[None], -np.inf, sc)
    pr = np.exp(sc - sc.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    y = x + np.einsum("hts,shd->thd", pr, v).reshape(t, -1) @ w["blk.0.attn_output.weight"].T
    f = rms(y, w["blk.0.ffn_norm.weight"], hp.rms_eps)
    g = f @ w["blk.0.ffn_gate.weight"].T
    g = y + (g / (1 + np.exp(-g)) * (f @ w["blk.0.ffn_up.weight"].T)) @ w[
        "blk.0.ffn_down.weight"].T
    return rms(g, w["output_norm.weight"], hp.rms_eps) @ w["output.weight"].T, g


def test_head_forward_is_the_contract(head_path: Path) -> None:
    """Pairs (h_p, e_{p+1}) through the core's head give HEAD_SPEC's logits over the
    token_ids and predicted hidden states (f32 KV: only float rounding differs)."""
    with Model.load(TARGET) as target, Head(head_path, target) as head:
        hid = target_hidden(target, TOKENS)
        emb = target.content.tensors["token_embd.weight"].dequantize()[TOKENS[1:]]
        with Context(head, n_ctx=64, n_threads=2, kv_type="f32") as hctx:
            logits, g = hctx.decode_ex([0], [TOKENS[1:]], features=hid[:-1], hidden=True)
            assert hctx.tokens(0) == TOKENS[1:]
        ref_l, ref_g = reference(head, emb.astype(np.float64), hid[:-1].astype(np.float64))
        assert logits is not None and logits.shape == (len(TOKENS) - 1, 96)
        np.testing.assert_allclose(g, ref_g, rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(logits, ref_l, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_head_is_batch_invariant(head_path: Path, threads: int) -> None:
    """The head's logits and predicted hidden states have the same bits pair by pair or
    in batches, in any slot, with any thread count; a keys-only catch-up leaves the
    same KV as a full pass."""
    with Model.load(TARGET) as target, Head(head_path, target) as head:
        hid = target_hidden(target, TOKENS)
        toks, feats = TOKENS[1:], hid[:-1]
        with Context(head, n_ctx=64, n_threads=1) as one:
            alone = [one.decode_ex([0], [[t]], features=feats[i:i + 1], hidden=True)
                     for i, t in enumerate(toks)]
        al = np.concatenate([a[0] for a in alone])
        ag = np.concatenate([a[1] for a in alone])
        with Context(head, n_slots=3, n_ctx=64, n_threads=threads) as ctx:
            for size in (3, 7, len(toks)):
                ctx.clear(2)
                parts = [ctx.decode_ex([2], [toks[i:i + size]], features=feats[i:i + size],
                                       hidden=True) for i in range(0, len(toks), size)]
                assert np.concatenate([p[0] for p in parts]).tobytes() == al.tobytes()
                assert np.concatenate([p[1] for p in parts]).tobytes() == ag.tobytes()
            # keys and values only for the first 10 pairs, then the rest with logits
            ctx.clear(1)
            ctx.decode_ex([1], [toks[:10]], features=feats[:10], logits=False, kv_only=True)
            rest, _ = ctx.decode_ex([1], [toks[10:]], features=feats[10:])
            assert rest is not None and rest.tobytes() == al[10:].tobytes()


def test_head_refuses_another_target(tmp_path: Path) -> None:
    other = "ab" * 32
    path = write_head(tmp_path / "other.gguf", TARGET, k=8, fingerprint=other)
    with Model.load(TARGET) as target:
        with pytest.raises(ModelLoadError) as err:
            Head(path, target)
        assert f"fingerprint {other}" in str(err.value)
        assert f"(fingerprint {target.fingerprint})" in str(err.value)


def test_head_file_errors(tmp_path: Path, head_path: Path) -> None:
    with Model.load(TARGET) as target:
        with pytest.raises(ModelLoadError, match="head file not found"):
            Head(tmp_path / "none.gguf", target)
        bad = tmp_path / "cut.gguf"
        bad.write_bytes(head_path.read_bytes()[:3000])
        with pytest.raises(ModelLoadError, match="not a readable head GGUF file|past the end"):
            Head(bad, target)
        with pytest.raises(ModelLoadError, match="architecture 'llama' is not 'warmslot-head'"):
            Head(TARGET, target)


HEAD_PROBE = """
import hashlib, sys
import numpy as np
from inference_svc.core import Context, Model
from inference_svc.core.binding import NATIVE_VARIANT
from inference_svc.core.head import Head
toks = [int(t) for t in sys.argv[3].split(",")]
with Model.load(sys.argv[1]) as target, Head(sys.argv[2], target) as head:
    with Context(target, n_ctx=64, n_threads=2) as ctx:
        _, hid = ctx.decode_ex([0], [toks], logits=False, hidden=True)
    with Context(head, n_ctx=64, n_threads=2) as hctx:
        logits, g = hctx.decode_ex([0], [toks[1:]], features=hid[:-1], hidden=True)
print(NATIVE_VARIANT, hashlib.sha256(hid.tobytes() + logits.tobytes() + g.tobytes()).hexdigest())
"""


def head_digest(head: Path, variant: str) -> str:
    env = {**os.environ, "WARMSLOT_NATIVE": variant}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", HEAD_PROBE, str(TARGET), str(head),
                          ",".join(map(str, TOKENS))], capture_output=True, text=True,
                         check=True, env=env, cwd=ROOT).stdout.split()
    assert out[0] == variant
    return out[1]


@pytest.mark.skipif(os.environ.get("WARMSLOT_NATIVE", "release") != "release",
                    reason="compares the release build with the portable and AVX2 ones")
@pytest.mark.parametrize("matrix_type", ["f16", "q8_0"])
def test_head_builds_give_the_same_bits(tmp_path: Path, matrix_type: str) -> None:
    path = write_head(tmp_path / "h.gguf", TARGET, k=64, n_ff=128, seed=3,
                      matrix_type=matrix_type)
    release = head_digest(path, "release")
    assert head_digest(path, "portable") == release
    if list((ROOT / "inference_svc" / "core").glob("_native_avx2*.so")):
        assert head_digest(path, "avx2") == release
