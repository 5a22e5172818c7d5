"""Batch invariance: a token's logits are bit-identical however it was decoded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import Context, Model
from tests.factory import Shape, write_model

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.native

N = 37
TOKENS = np.random.default_rng(11).integers(0, 300, N).tolist()


def one_by_one(ctx: Context, slot: int, tokens: list[int]) -> np.ndarray:
    return np.stack([ctx.decode(slot, [t]) for t in tokens])


def in_batches(ctx: Context, slot: int, tokens: list[int], size: int) -> np.ndarray:
    rows = [ctx.decode(slot, tokens[i:i + size], logits_all=True)
            for i in range(0, len(tokens), size)]
    return np.concatenate(rows)


@pytest.fixture(scope="module", params=["f16", "f32", "q8_0"])
def kv_type(request: pytest.FixtureRequest) -> str:
    """Every property holds for every KV cache type."""
    return request.param


def skip_unless_fits(model: Path, kv_type: str) -> None:
    """A q8_0 cache holds whole blocks of 32 per head: other head sizes are refused."""
    with Model.load(model) as m:
        if kv_type == "q8_0" and m.hparams.head_dim % 32:
            pytest.skip(f"q8_0 needs a head_dim multiple of 32, not {m.hparams.head_dim}")


# the small model's shape with heads of 32 (q8_0 blocks)
Q8_SHAPE = Shape(n_vocab=300, n_embd=128, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)


@pytest.fixture(scope="module")
def model_path(small_model_path: Path, kv_type: str,
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small model, or for q8_0 the same shape with heads of 32."""
    if kv_type != "q8_0":
        return small_model_path
    path = tmp_path_factory.mktemp("q8") / "small_hd32.gguf"
    write_model(path, Q8_SHAPE)
    return path


@pytest.fixture(scope="module")
def baseline(model_path: Path, kv_type: str) -> np.ndarray:
    with Model.load(model_path) as model, \
            Context(model, n_ctx=64, n_threads=1, kv_type=kv_type) as ctx:
        return one_by_one(ctx, 0, TOKENS)


def test_kv_types_give_different_logits(small_model_path: Path) -> None:
    """The f16 cache really rounds (else the f16 half of these tests would test f32)."""
    with Model.load(small_model_path) as model, \
            Context(model, n_ctx=64, kv_type="f32") as c32, Context(model, n_ctx=64) as c16:
        a, b = c32.decode(0, TOKENS), c16.decode(0, TOKENS)
    assert not np.array_equal(a, b)
    assert float(np.abs(a - b).max()) < 1e-2 * float(np.abs(a).max())


def test_q8_0_cache_quantizes(tmp_path: Path) -> None:
    """The q8_0 cache really quantizes (its logits are neither f16's nor f32's), close
    to f32's, in 34 bytes per 32 values."""
    path = tmp_path / "hd32.gguf"
    write_model(path, Q8_SHAPE)
    with Model.load(path) as model, Context(model, n_ctx=64, kv_type="f32") as c32, \
            Context(model, n_ctx=64) as c16, Context(model, n_ctx=64, kv_type="q8_0") as c8:
        a, b, q = c32.decode(0, TOKENS), c16.decode(0, TOKENS), c8.decode(0, TOKENS)
        assert c8.kv_bytes * 32 == c16.kv_bytes * 17 == 2 * 64 * 2 * 64 * 2 * 17
    assert not np.array_equal(a, q) and not np.array_equal(b, q)
    assert float(np.abs(a - q).max()) < 5e-2 * float(np.abs(a).max())


def test_q8_0_refuses_heads_of_partial_blocks(small_model_path: Path) -> None:
    """head_dim 16 is half a q8_0 block: refused at init, saying why."""
    from inference_svc.core import InvalidArgumentError

    with Model.load(small_model_path) as model:
        with pytest.raises(InvalidArgumentError,
                           match="a q8_0 KV cache needs a head_dim that is a multiple of 32; "
                                 "this model's is 16"):
            Context(model, n_ctx=64, kv_type="q8_0")


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 16, N])
def test_batch_size_and_threads(model_path: Path, baseline: np.ndarray, kv_type: str,
                                threads: int, batch: int) -> None:
    with Model.load(model_path) as model, \
            Context(model, n_slots=3, n_ctx=64, n_threads=threads, kv_type=kv_type) as ctx:
        got = in_batches(ctx, 2, TOKENS, batch)
    assert got.tobytes() == baseline.tobytes()


def test_internal_chunking(model_path: Path, baseline: np.ndarray, kv_type: str) -> None:
    """A prompt longer than n_batch is split inside the core; nothing changes."""
    with Model.load(model_path) as model, \
            Context(model, n_ctx=64, n_threads=2, n_batch=4, kv_type=kv_type) as ctx:
        got = ctx.decode(0, TOKENS, logits_all=True)
        ctx.clear(0)
        last = ctx.decode(0, TOKENS)
    assert got.tobytes() == baseline.tobytes()
    assert last.tobytes() == baseline[-1].tobytes()


def test_slots_are_independent(model_path: Path, baseline: np.ndarray,
                               kv_type: str) -> None:
    """Interleaving other slots' work does not change a slot's logits."""
    other = np.random.default_rng(5).integers(0, 300, N).tolist()
    with Model.load(model_path) as model, \
            Context(model, n_slots=4, n_ctx=64, n_threads=2, kv_type=kv_type) as ctx:
        rows = []
        for i, t in enumerate(TOKENS):
            ctx.decode(i % 3 + 1, [other[i]])
            rows.append(ctx.decode(0, [t]))
    assert np.stack(rows).tobytes() == baseline.tobytes()


def test_truncate_then_redecode(model_path: Path, baseline: np.ndarray,
                                kv_type: str) -> None:
    """Rolling a slot back and decoding again gives the same logits (speculative rollback)."""
    with Model.load(model_path) as model, Context(model, n_ctx=64, kv_type=kv_type) as ctx:
        ctx.decode(0, TOKENS[:20])
        ctx.decode(0, [1, 2, 3, 4, 5])
        ctx.truncate(0, 20)
        assert ctx.n_tokens(0) == 20
        got = ctx.decode(0, TOKENS[20:], logits_all=True)
    assert got.tobytes() == baseline[20:].tobytes()


def test_multi_slot_decode_is_bit_identical(model_path: Path, kv_type: str) -> None:
    """One pass over the next token of several slots gives each slot exactly the logits
    (and the cache) it gets alone."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 300, n).tolist() for n in (5, 11, 1, 23)]
    nxt = [[int(t) for t in rng.integers(0, 300, 6)] for _ in prompts]
    with Model.load(model_path) as model, \
            Context(model, n_slots=4, n_ctx=64, n_threads=2, kv_type=kv_type) as alone, \
            Context(model, n_slots=4, n_ctx=64, n_threads=2, kv_type=kv_type) as multi:
        expected = []
        for s, (p, n) in enumerate(zip(prompts, nxt, strict=True)):
            alone.decode(s, p)
            expected.append(np.stack([alone.decode(s, [t]) for t in n]))
        for s, p in enumerate(prompts):
            multi.decode(s, p)
        order = [2, 0, 3, 1]  # any order of slots
        got = [[None] * 6 for _ in prompts]
        for step in range(6):
            rows = multi.decode_multi(order, [nxt[s][step] for s in order])
            for i, s in enumerate(order):
                got[s][step] = rows[i]
        for s in range(4):
            assert np.stack(got[s]).tobytes() == expected[s].tobytes()
            assert multi.tokens(s) == prompts[s] + nxt[s]


def test_multi_slot_decode_validation(small_model_path: Path) -> None:
    from inference_svc.core import ContextFullError, InvalidArgumentError

    with Model.load(small_model_path) as model, Context(model, n_slots=2, n_ctx=4) as ctx:
        with pytest.raises(InvalidArgumentError, match="slot 1 appears twice"):
            ctx.decode_multi([1, 1], [3, 4])
        with pytest.raises(InvalidArgumentError, match="slot 2 out of range"):
            ctx.decode_multi([0, 2], [3, 4])
        with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
            ctx.decode_multi([0, 1], [3, 300])
        ctx.decode(1, [1, 2, 3, 4])
        with pytest.raises(ContextFullError, match="slot 1 is full"):
            ctx.decode_multi([0, 1], [3, 4])
        assert ctx.n_tokens(0) == 0 and ctx.n_tokens(1) == 4  # nothing changed


# Attention shapes: the head dimension in groups of 32, 8 and single values, and query
# heads per KV head in pairs and singles (hd 40 / 3 per KV head, hd 12 / 4, hd 36 / 1).
ATTENTION_SHAPES = {
    "hd40_rep3": Shape(n_vocab=300, n_embd=240, n_layer=2, n_head=6, n_head_kv=2, n_ff=96),
    "hd12_mqa": Shape(n_vocab=300, n_embd=48, n_layer=2, n_head=4, n_head_kv=1, n_ff=64),
    "hd36_mha": Shape(n_vocab=300, n_embd=108, n_layer=1, n_head=3, n_head_kv=3, n_ff=64),
    # gemma3: head_dim 40 (not n_embd / n_head), a window of 7 in layers 0-4, layer 5 global
    "gemma3": Shape(n_vocab=300, n_embd=48, n_layer=6, n_head=4, n_head_kv=2, n_ff=64,
                    tied=True, arch="gemma3", head_dim=40, n_swa=7),
    # heads of whole q8_0 blocks: hd 64 / 3 per KV head, hd 32 / 1, gemma3 with hd 64
    "hd64_rep3": Shape(n_vocab=300, n_embd=192, n_layer=2, n_head=3, n_head_kv=1, n_ff=96),
    "hd32_mha": Shape(n_vocab=300, n_embd=96, n_layer=1, n_head=3, n_head_kv=3, n_ff=64),
    "gemma3_hd64": Shape(n_vocab=300, n_embd=48, n_layer=6, n_head=4, n_head_kv=2, n_ff=64,
                         tied=True, arch="gemma3", head_dim=64, n_swa=7),
}


def gemma3_shape(kv_type: str) -> Shape:
    """The gemma3 test shape: heads of 40, or for q8_0 heads of 64 (whole blocks)."""
    return ATTENTION_SHAPES["gemma3_hd64" if kv_type == "q8_0" else "gemma3"]
LONG = np.random.default_rng(13).integers(0, 300, 70).tolist()


@pytest.fixture(scope="module", params=sorted(ATTENTION_SHAPES))
def shape_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("attn") / f"{request.param}.gguf"
    write_model(path, ATTENTION_SHAPES[request.param], seed=3)
    return path


def test_attention_shapes_are_batch_invariant(shape_model: Path, kv_type: str) -> None:
    skip_unless_fits(shape_model, kv_type)
    with Model.load(shape_model) as model, \
            Context(model, n_slots=2, n_ctx=128, n_threads=2, kv_type=kv_type) as ctx:
        alone = one_by_one(ctx, 0, LONG)
        for size in (4, 9, len(LONG)):
            ctx.clear(1)
            assert in_batches(ctx, 1, LONG, size).tobytes() == alone.tobytes()


PORTABLE_PROBE = """
import hashlib, sys
from inference_svc.core import Context, Model
from inference_svc.core.binding import NATIVE_VARIANT
tokens = [int(t) for t in sys.argv[2].split(",")]
with Model.load(sys.argv[1]) as model, \
        Context(model, n_ctx=256, n_threads=2, kv_type=sys.argv[3]) as ctx:
    batched = ctx.decode(0, tokens, logits_all=True)
    ctx.clear(0)
    single = [ctx.decode(0, [t]) for t in tokens[:8]]
    ctx.clear(0)
    _, hidden = ctx.decode_ex([0], [tokens], logits=False, hidden=True)
print(NATIVE_VARIANT, hashlib.sha256(batched.tobytes()).hexdigest(),
      hashlib.sha256(b"".join(s.tobytes() for s in single)).hexdigest(),
      hashlib.sha256(hidden.tobytes()).hexdigest())
"""


def logits_digests(model: Path, variant: str, kv_type: str) -> list[str]:
    env = {**os.environ, "WARMSLOT_NATIVE": variant}
    env.pop("LD_PRELOAD", None)  # the ASan run's preload does not apply to these builds
    out = subprocess.run([sys.executable, "-c", PORTABLE_PROBE, str(model),
                          ",".join(map(str, LONG)), kv_type], capture_output=True, text=True,
                         check=True, env=env, cwd=ROOT).stdout.split()
    assert out[0] == variant
    return out[1:]


@pytest.mark.skipif(os.environ.get("WARMSLOT_NATIVE", "release") != "release",
                    reason="compares the release build with the portable one")
def test_portable_build_gives_the_same_bits(shape_model: Path, kv_type: str) -> None:
    """The scalar build (no AVX2) and the release build produce identical logits."""
    skip_unless_fits(shape_model, kv_type)
    assert (logits_digests(shape_model, "portable", kv_type)
            == logits_digests(shape_model, "release", kv_type))


@pytest.mark.skipif(os.environ.get("WARMSLOT_NATIVE", "release") != "release",
                    reason="compares the release build with the portable one")
def test_portable_build_gives_the_same_bits_on_the_bundled_target(kv_type: str) -> None:
    target = ROOT / "models" / "target.gguf"
    assert (logits_digests(target, "portable", kv_type)
            == logits_digests(target, "release", kv_type))


def cpu_has(*flags: str) -> bool:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {f}" in info for f in flags)


# one model whose matrices cycle through every supported type
MIXED = Shape(n_vocab=300, n_embd=256, n_layer=3, n_head=4, n_head_kv=2, n_ff=512,
              dtype="mixed")


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    write_model(path, MIXED, seed=5)
    return path


def test_mixed_model_has_every_type(mixed_model: Path) -> None:
    with Model.load(mixed_model) as model:
        types = set(model.content.tensor_types.values())
    assert types == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K",
                     "Q6_K"}


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_quantized_batch_size_and_threads(mixed_model: Path, threads: int, kv_type: str) -> None:
    with Model.load(mixed_model) as model, \
            Context(model, n_slots=2, n_ctx=128, n_threads=1, kv_type=kv_type) as one, \
            Context(model, n_slots=2, n_ctx=128, n_threads=threads, kv_type=kv_type) as ctx:
        alone = one_by_one(one, 0, LONG)
        for size in (2, 5, 8, len(LONG)):
            ctx.clear(1)
            assert in_batches(ctx, 1, LONG, size).tobytes() == alone.tobytes()


@pytest.mark.skipif(os.environ.get("WARMSLOT_NATIVE", "release") != "release",
                    reason="compares the release build with the portable one")
def test_portable_build_gives_the_same_bits_on_every_type(mixed_model: Path,
                                                          kv_type: str) -> None:
    assert (logits_digests(mixed_model, "portable", kv_type)
            == logits_digests(mixed_model, "release", kv_type))


@pytest.mark.skipif(os.environ.get("WARMSLOT_NATIVE", "release") != "release",
                    reason="compares the release build with the AVX2 one")
@pytest.mark.skipif(not list((ROOT / "inference_svc" / "core").glob("_native_avx2*.so")),
                    reason="the AVX2 build is not built (make native-avx2)")
@pytest.mark.skipif(not cpu_has("avx2", "fma", "f16c"), reason="the CPU has no AVX2 + FMA")
def test_avx2_build_gives_the_same_bits_on_every_type(mixed_model: Path, kv_type: str) -> None:
    """On an AVX-512 machine the release build pairs rows in 16 lanes; the AVX2 build
    computes the same canonical 8-lane order in 8 lanes."""
    assert (logits_digests(mixed_model, "avx2", kv_type)
            == logits_digests(mixed_model, "release", kv_type))


def test_gemma3_threads_slots_and_multi_decode(tmp_path: Path, kv_type: str) -> None:
    """The gemma3 pass (sliding window, post-norms split over tokens) gives the same bits
    for every thread count, batch size, slot and multi-slot decode."""
    path = tmp_path / "gemma3.gguf"
    write_model(path, gemma3_shape(kv_type), seed=4)
    with Model.load(path) as model:
        assert model.hparams.arch == "gemma3" and model.hparams.head_dim == gemma3_shape(kv_type).hd
        with Context(model, n_ctx=128, n_threads=1, kv_type=kv_type) as ctx:
            alone = one_by_one(ctx, 0, LONG)
        for threads in (1, 2, 3):
            with Context(model, n_slots=3, n_ctx=128, n_threads=threads,
                         kv_type=kv_type) as ctx:
                for size in (2, 5, 16, len(LONG)):
                    ctx.clear(2)
                    assert in_batches(ctx, 2, LONG, size).tobytes() == alone.tobytes()
                ctx.clear(0)
                ctx.clear(1)
                ctx.decode(0, LONG[:30])
                ctx.decode(1, LONG[:50])
                rows = [ctx.decode_multi([1, 0], [LONG[50 + i], LONG[30 + i]])
                        for i in range(8)]
                assert np.stack([r[1] for r in rows]).tobytes() == alone[30:38].tobytes()
                assert np.stack([r[0] for r in rows]).tobytes() == alone[50:58].tobytes()


@pytest.mark.skipif(os.environ.get("WARMSLOT_NATIVE", "release") != "release",
                    reason="compares the release build with the portable and AVX2 ones")
def test_gemma3_builds_give_the_same_bits(tmp_path: Path, kv_type: str) -> None:
    path = tmp_path / "gemma3.gguf"
    write_model(path, gemma3_shape(kv_type), seed=4)
    release = logits_digests(path, "release", kv_type)
    assert logits_digests(path, "portable", kv_type) == release
    assert logits_digests(path, "avx2", kv_type) == release


# ---- hidden states (ws_decode_ex): the residual stream before output_norm ----


def hidden_one_by_one(ctx: Context, slot: int, tokens: list[int]) -> np.ndarray:
    return np.concatenate([ctx.decode_ex([slot], [[t]], logits=False, hidden=True)[1]
                           for t in tokens])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_hidden_states_are_batch_invariant(model_path: Path, kv_type: str, threads: int) -> None:
    """A token's hidden state has the same bits whatever the batch, slot, thread count
    and whether logits were asked for with it."""
    with Model.load(model_path) as model:
        with Context(model, n_ctx=64, n_threads=1, kv_type=kv_type) as one:
            alone = hidden_one_by_one(one, 0, TOKENS)
        with Context(model, n_slots=3, n_ctx=64, n_threads=threads, kv_type=kv_type) as ctx:
            for size in (2, 5, N):
                ctx.clear(2)
                got = np.concatenate([
                    ctx.decode_ex([2], [TOKENS[i:i + size]], hidden=True,
                                  logits=bool(i % 2))[1]
                    for i in range(0, N, size)])
                assert got.tobytes() == alone.tobytes()
            # two slots in one pass, with other slots' work in between
            ctx.clear(0)
            ctx.clear(1)
            ctx.decode(1, TOKENS[:7])
            ctx.decode_ex([0], [TOKENS[:20]], logits=False, hidden=True)
            logits, hid = ctx.decode_ex([1, 0], [TOKENS[7:10], TOKENS[20:24]], hidden=True)
            assert hid[:3].tobytes() == alone[7:10].tobytes()
            assert hid[3:].tobytes() == alone[20:24].tobytes()
            assert logits is not None and logits.shape == (7, 300)


def test_hidden_state_is_before_the_output_norm(small_model_path: Path) -> None:
    """The logits are output(output_norm(h)): recomputed in numpy from the hidden states
    (f32 weights) they agree to float rounding, and the wanted rows are packed."""
    with Model.load(small_model_path) as model, Context(model, n_ctx=64) as ctx:
        out_w = model.content.tensors["output.weight"].dequantize()
        norm_w = model.content.tensors["output_norm.weight"].dequantize()
        want = [i % 3 == 0 for i in range(N)]
        logits, hid = ctx.decode_ex([0], [TOKENS], want=want, hidden=True)
        eps = model.hparams.rms_eps
    assert hid is not None and logits is not None and logits.shape == (13, 300)
    h = hid.astype(np.float64)
    xn = h / np.sqrt((h * h).mean(axis=1, keepdims=True) + eps) * norm_w
    ref = xn @ out_w.T.astype(np.float64)
    np.testing.assert_allclose(logits, ref[::3], rtol=1e-4, atol=1e-4)


def test_decode_ex_validation(small_model_path: Path) -> None:
    from inference_svc.core import BufferTooSmallError, InvalidArgumentError

    with Model.load(small_model_path) as model, Context(model, n_ctx=64) as ctx:
        with pytest.raises(InvalidArgumentError, match="a language model takes no features"):
            ctx.decode_ex([0], [[1, 2]], features=np.zeros((2, 64), np.float32))
        with pytest.raises(InvalidArgumentError, match="keys-and-values-only"):
            ctx.decode_ex([0], [[1, 2]], kv_only=True)
        assert ctx.n_tokens(0) == 0
        from inference_svc.core import binding
        io = binding.ffi.new("ws_decode_io *")
        hid = np.zeros(64, np.float32)
        io.hidden = binding.ffi.cast("float *", binding.ffi.from_buffer("float[]", hid))
        io.hidden_cap = 64
        toks = binding.ffi.new("int32_t[]", [1, 2])
        with pytest.raises(BufferTooSmallError, match="hidden buffer holds 64 floats, 128"):
            binding.decode_ex(ctx.handle, 1, binding.ffi.new("int32_t[]", [0]),
                              binding.ffi.new("int32_t[]", [2]), toks, io)
        assert ctx.n_tokens(0) == 0
