"""The typed weight kernels: for every type, the build's unpacking equals the scalar
unpacking and gguf's dequantizer bit for bit, and every product equals the canonical F32
dot product over the unpacked row bit for bit, for 1..9 tokens (the one-token register
path, the register path of 2..8 tokens and the unpacked-rows batch path), row counts
that are not a multiple of the tile, and plain rows whose length is not a multiple of the
SIMD width. The 8-bit-activation product (ws_tensor_matmul_q8: Q4_0, Q4_1, Q5_0, Q8_0) is
the reference's quantized activations times the unpacked rows, with the same bits for
every token count and build."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from inference_svc.core.binding import ffi, lib
from tests.factory import QUANT_TYPES, stored_bytes
from tests.gemma3kit import gemma_path, needs_gemma3
from tests.reference import INT8_ACTIVATION_TYPES, quantize_activations

pytestmark = pytest.mark.native

TYPE_IDS = {name: int(gguf.GGMLQuantizationType[name.upper()]) for name in
            ("f32", "f16", "bf16", *QUANT_TYPES)}
K_TYPES = ("q4_k", "q5_k", "q6_k")
INT_TYPES = sorted(t.lower() for t in INT8_ACTIVATION_TYPES)


def encode(values: np.ndarray, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """[rows][row bytes] of the values stored as dtype."""
    if dtype == "f32":
        return values.astype(np.float32).view(np.uint8)
    if dtype == "f16":
        return values.astype(np.float16).view(np.uint8)
    if dtype == "bf16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return stored_bytes(values, dtype, rng)


class Tensor:
    """A ws_tensor over a numpy buffer (kept alive with it)."""

    def __init__(self, raw: np.ndarray, dtype: str, rows: int, cols: int) -> None:
        self.raw = np.ascontiguousarray(raw)
        self.buf = ffi.from_buffer("uint8_t[]", self.raw)
        self.c = ffi.new("ws_tensor *")
        self.c.data, self.c.type, self.c.rows, self.c.cols = self.buf, TYPE_IDS[dtype], rows, cols
        self.rows, self.cols, self.dtype = rows, cols, dtype

    def row(self, r: int, reference: bool) -> np.ndarray:
        out = np.empty(self.cols, np.float32)
        assert lib.ws_tensor_dequantize(self.c, r, int(reference),
                                        ffi.from_buffer("float[]", out), out.size) == 0
        return out

    def rows_f32(self, reference: bool = False) -> np.ndarray:
        return np.stack([self.row(r, reference) for r in range(self.rows)])

    def matmul(self, x: np.ndarray, q8: bool = False) -> np.ndarray:
        """W . x by the forward pass's kernels, or (q8) over 8-bit activations."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.rows), np.float32)
        fn = lib.ws_tensor_matmul_q8 if q8 else lib.ws_tensor_matmul
        assert fn(self.c, ffi.from_buffer("float[]", x), x.shape[0],
                  ffi.from_buffer("float[]", out), out.size) == 0
        return out


def sizes(dtype: str) -> list[tuple[int, int]]:
    """(rows, cols): rows not a multiple of 4; plain types with tails of every kind."""
    if dtype in K_TYPES:
        return [(7, 256), (5, 768)]
    if dtype in QUANT_TYPES:
        return [(7, 32), (9, 96), (6, 160)]
    return [(7, 37), (5, 45), (9, 64), (6, 100), (3, 3)]


@pytest.mark.parametrize("dtype", sorted(TYPE_IDS))
def test_unpacking_matches_scalar_code_and_gguf(dtype: str) -> None:
    rng = np.random.default_rng(1)
    for rows, cols in sizes(dtype):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = encode(values, dtype, rng)
        t = Tensor(raw, dtype, rows, cols)
        got = t.rows_f32()
        assert got.tobytes() == t.rows_f32(reference=True).tobytes()
        qtype = gguf.GGMLQuantizationType[dtype.upper()]
        if dtype == "f32":
            expected = values
        elif dtype == "f16":
            expected = values.astype(np.float16).astype(np.float32)
        elif dtype == "bf16":
            expected = ((values.view(np.uint32) >> 16) << 16).view(np.float32)
        else:
            expected = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
        assert got.tobytes() == expected.astype(np.float32).tobytes(), dtype


@pytest.mark.parametrize("dtype", sorted(TYPE_IDS))
def test_products_are_the_canonical_dot_over_unpacked_rows(dtype: str) -> None:
    rng = np.random.default_rng(2)
    for rows, cols in sizes(dtype):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        t = Tensor(encode(values, dtype, rng), dtype, rows, cols)
        unpacked = t.rows_f32()
        plain = Tensor(unpacked.view(np.uint8), "f32", rows, cols)
        for nt in range(1, 10):
            x = rng.standard_normal((nt, cols)).astype(np.float32)
            got = t.matmul(x)
            assert got.tobytes() == plain.matmul(x).tobytes(), (dtype, rows, cols, nt)
            # each token alone (the one-token path) gives the batch's bits
            alone = np.concatenate([t.matmul(x[i:i + 1]) for i in range(nt)])
            assert alone.tobytes() == got.tobytes()
            ref = x.astype(np.float64) @ unpacked.astype(np.float64).T
            assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


def tie_blocks(cols: int, rng: np.random.Generator) -> np.ndarray:
    """Activations whose quantization is decided by the rounding rule: blocks with
    amax 127 (scale 1) holding exact halves (+-2.5, +-3.5, 0.5: nearest even rounds
    them to 2, 4, 0, away from zero would not), and one all-zero block."""
    x = rng.standard_normal(cols).astype(np.float32)
    x[:32] = 0.0
    for b in range(1, cols // 32, 2):
        x[32 * b:32 * b + 6] = [127.0, 2.5, -2.5, 3.5, -3.5, 0.5]
    return x


@pytest.mark.parametrize("dtype", INT_TYPES)
def test_int8_activation_products_match_the_quantized_reference(dtype: str) -> None:
    """W . x is computed over the activations as tests/reference.py quantizes them: the
    float64 product of its quantized activations with the unpacked rows, to float32
    rounding (one activation quantized differently would be off by ~1e-2 of the scale),
    with the bits of each token alone for every batch size (the one-token, verification
    and prefill paths), ties included."""
    rng = np.random.default_rng(2)
    for rows, cols in [(7, 32), (9, 96), (17, 160), (6, 128)]:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        t = Tensor(encode(values, dtype, rng), dtype, rows, cols)
        unpacked = t.rows_f32().astype(np.float64)
        for nt in (1, 2, 5, 8, 9, 20):
            x = rng.standard_normal((nt, cols)).astype(np.float32)
            x[0] = tie_blocks(cols, rng)
            got = t.matmul(x, q8=True)
            alone = np.concatenate([t.matmul(x[i:i + 1], q8=True) for i in range(nt)])
            assert alone.tobytes() == got.tobytes(), (dtype, rows, cols, nt)
            ref = quantize_activations(x) @ unpacked.T
            scale = np.abs(x).max(1, keepdims=True) * np.abs(unpacked).sum(1)[None, :]
            assert (np.abs(got - ref) <= 1e-6 * scale).all(), (dtype, rows, cols, nt)


def native_variants() -> list[tuple[str, object]]:
    """The builds present besides the loaded one: (name, module with ffi and lib)."""
    import importlib

    found = []
    for name in ("_native", "_native_portable", "_native_avx2"):
        try:
            found.append((name, importlib.import_module(f"inference_svc.core.{name}")))
        except ImportError:
            continue
    return found


@pytest.mark.parametrize("dtype", INT_TYPES)
def test_int8_activation_products_have_the_same_bits_in_every_build(dtype: str) -> None:
    """VNNI (vpdpbusd), AVX2 (maddubs) and the scalar build sum the same integers and
    combine the blocks in the same float order."""
    variants = native_variants()
    if len(variants) < 2:
        pytest.skip("only one native build is present (make native-portable native-avx2)")
    rng = np.random.default_rng(5)
    rows, cols = 19, 192
    raw = np.ascontiguousarray(encode(rng.standard_normal((rows, cols)).astype(np.float32),
                                      dtype, rng))
    x = rng.standard_normal((11, cols)).astype(np.float32)
    x[0] = tie_blocks(cols, rng)
    digests = {}
    for name, mod in variants:
        t = mod.ffi.new("ws_tensor *")
        buf = mod.ffi.from_buffer("uint8_t[]", raw)
        t.data, t.type, t.rows, t.cols = buf, TYPE_IDS[dtype], rows, cols
        for nt in (1, 4, 11):
            out = np.empty((nt, rows), np.float32)
            assert mod.lib.ws_tensor_matmul_q8(t, mod.ffi.from_buffer("float[]", x[:nt]), nt,
                                               mod.ffi.from_buffer("float[]", out),
                                               out.size) == 0
            digests.setdefault(nt, {})[name] = out.tobytes()
    for nt, by_build in digests.items():
        assert len(set(by_build.values())) == 1, (dtype, nt, sorted(by_build))


def test_int8_activation_product_refuses_other_types() -> None:
    t = Tensor(np.zeros((2, 64), np.uint8), "f16", 2, 32)
    out = np.empty(2, np.float32)
    x = np.ones(32, np.float32)
    assert lib.ws_tensor_matmul_q8(t.c, ffi.from_buffer("float[]", x), 1,
                                   ffi.from_buffer("float[]", out), out.size) == 1


def test_activation_quantization_rounds_to_nearest_even() -> None:
    x = np.zeros(64, np.float32)
    x[:6] = [127.0, 2.5, -2.5, 3.5, -3.5, 0.5]
    q = quantize_activations(x[None, :])[0]
    assert q[:6].tolist() == [127.0, 2.0, -2.0, 4.0, -4.0, 0.0]
    assert not q[32:].any()  # an all-zero block stays zero


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q5_0", "q8_0", *K_TYPES])
def test_random_blocks_every_bit_pattern(dtype: str) -> None:
    """Blocks of random bytes (every quant value, every packed scale and high bit) with
    finite f16 scales unpack as gguf's dequantizer does."""
    rng = np.random.default_rng(3)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[dtype.upper()]]
    rows, cols = 5, 4 * block
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if dtype not in K_TYPES:  # the block's f16 scale(s) lead: keep them finite
        nscales = 2 if dtype == "q4_1" else 1
        d = rng.uniform(-0.01, 0.01, (rows, cols // block, nscales)).astype(np.float16)
        raw[:, :, :2 * nscales] = d.view(np.uint8).reshape(rows, cols // block, 2 * nscales)
    else:
        raw = stored_bytes(np.ones((rows, cols), np.float32), dtype, rng).reshape(raw.shape)
    raw = raw.reshape(rows, -1)
    t = Tensor(raw, dtype, rows, cols)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[dtype.upper()])
    assert t.rows_f32().tobytes() == expected.reshape(rows, cols).astype(np.float32).tobytes()
    assert t.rows_f32(reference=True).tobytes() == t.rows_f32().tobytes()


def test_bad_arguments_are_refused() -> None:
    raw = np.zeros((2, 34), np.uint8)
    t = Tensor(raw, "q8_0", 2, 32)
    out = np.empty(32, np.float32)
    assert lib.ws_tensor_dequantize(t.c, 2, 0, ffi.from_buffer("float[]", out), 32) == 1
    assert lib.ws_tensor_dequantize(t.c, 0, 0, ffi.from_buffer("float[]", out), 31) == 3
    t.c.cols = 33  # not a whole number of blocks
    assert lib.ws_tensor_dequantize(t.c, 0, 0, ffi.from_buffer("float[]", out), 64) == 1
    assert lib.ws_type_row_bytes(TYPE_IDS["q4_k"], 512) == 288
    assert lib.ws_type_row_bytes(TYPE_IDS["q4_k"], 300) == 0
    assert lib.ws_type_row_bytes(7, 64) == 0  # Q5_1: not supported
    assert ffi.string(lib.ws_type_name(TYPE_IDS["q6_k"])) == b"Q6_K"


@needs_gemma3
def test_real_tensors_of_gemma3() -> None:
    """Real Q4_K, Q5_0, Q6_K, Q8_0 tensors (Gemma 3 270M Q4_K_M): the kernels unpack
    them as gguf does and multiply them in the canonical order."""
    from inference_svc.core.gguf_parse import parse

    data = np.fromfile(gemma_path(), dtype=np.uint8)
    header = parse(data)
    seen = set()
    rng = np.random.default_rng(4)
    for info in header.tensors:
        qtype = gguf.GGMLQuantizationType(info.type)
        name = qtype.name.lower()
        if len(info.dims) != 2 or name not in TYPE_IDS or name in seen:
            continue
        seen.add(name)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        cols, rows = info.dims[0], min(info.dims[1], 13)
        row_bytes = cols // block * size
        raw = data[info.offset:info.offset + rows * row_bytes].reshape(rows, row_bytes)
        t = Tensor(raw, name, rows, cols)
        unpacked = t.rows_f32()
        expected = gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
        assert unpacked.tobytes() == expected.tobytes(), info.name
        assert t.rows_f32(reference=True).tobytes() == unpacked.tobytes()
        plain = Tensor(unpacked.view(np.uint8), "f32", rows, cols)
        for nt in (1, 5):
            x = rng.standard_normal((nt, cols)).astype(np.float32)
            assert t.matmul(x).tobytes() == plain.matmul(x).tobytes(), (info.name, nt)
            if name in INT_TYPES:
                ref = quantize_activations(x) @ unpacked.astype(np.float64).T
                assert np.abs(t.matmul(x, q8=True) - ref).max() <= 1e-5 * np.abs(ref).max()
    assert {"q4_k", "q5_0", "q6_k", "q8_0"} <= seen
