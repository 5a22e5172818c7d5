"""The typed weight kernels: for every type, the build's unpacking equals the scalar
unpacking and gguf's dequantizer bit for bit. F32/F16/BF16 products equal the canonical
F32 dot product over the row bit for bit, for 1..9 tokens (the one-token register path,
the register path of 2..8 tokens and the unpacked-rows batch path), row counts that are
not a multiple of the tile, and rows whose length is not a multiple of the SIMD width.
Every integer type's product (16-bit activations) equals tests/int16_model.py's scalar
model bit for bit, for every token count (decode, verification, prefill) and build."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from inference_svc.core.binding import ffi, lib
from tests.factory import QUANT_TYPES, stored_bytes
from tests.gemma3kit import gemma_path, needs_gemma3
from tests.int16_model import INT_TYPES, dequantize_activations, fmaf32, product, quantize

pytestmark = pytest.mark.native

TYPE_IDS = {name: int(gguf.GGMLQuantizationType[name.upper()]) for name in
            ("f32", "f16", "bf16", *QUANT_TYPES)}
K_TYPES = ("q4_k", "q5_k", "q6_k")
PLAIN_TYPES = ("f32", "f16", "bf16")


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

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """W . x by the forward pass's kernels."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.rows), np.float32)
        assert lib.ws_tensor_matmul(self.c, ffi.from_buffer("float[]", x), x.shape[0],
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


@pytest.mark.parametrize("dtype", PLAIN_TYPES)
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
    amax 32767 (scale 1) holding exact halves (+-2.5, +-3.5, 0.5: nearest even rounds
    them to 2, 4, 0, away from zero would not), and one all-zero block."""
    x = rng.standard_normal(cols).astype(np.float32)
    x[:32] = 0.0
    for b in range(1, cols // 32, 2):
        x[32 * b:32 * b + 6] = [32767.0, 2.5, -2.5, 3.5, -3.5, 0.5]
    return x


def int_sizes(dtype: str) -> list[tuple[int, int]]:
    """(rows, cols): row counts that are not a multiple of the 8-row tile."""
    return [(7, 256), (5, 768), (17, 512)] if dtype in K_TYPES else [(7, 32), (9, 96),
                                                                      (17, 160), (6, 128)]


@pytest.mark.parametrize("dtype", INT_TYPES)
def test_integer_products_match_the_scalar_model(dtype: str) -> None:
    """W . x is the scalar model's integer product bit for bit, for one token (decode),
    2..8 (verification) and more (prefill, several groups of tokens), ties of the
    activations' rounding included; each token alone gives the batch's bits; and the
    result is the float64 product of the quantized activations with the unpacked rows
    to float32 rounding."""
    rng = np.random.default_rng(2)
    for rows, cols in int_sizes(dtype):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = encode(values, dtype, rng).reshape(rows, -1)
        t = Tensor(raw, dtype, rows, cols)
        unpacked = t.rows_f32().astype(np.float64)
        for nt in (1, 2, 3, 5, 8, 9, 20):
            x = rng.standard_normal((nt, cols)).astype(np.float32)
            x[0] = tie_blocks(cols, rng)
            got = t.matmul(x)
            assert got.tobytes() == product(raw, dtype, cols, x).tobytes(), (dtype, rows, nt)
            alone = np.concatenate([t.matmul(x[i:i + 1]) for i in range(nt)])
            assert alone.tobytes() == got.tobytes(), (dtype, rows, cols, nt)
            ref = dequantize_activations(x) @ unpacked.T
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
def test_integer_products_have_the_same_bits_in_every_build(dtype: str) -> None:
    """AVX-512 VNNI (vpdpwssd), AVX2 (vpmaddwd) and the scalar build sum the same
    integers and combine the blocks in the same float order. 19 rows: AVX-512 16-row
    tiles and a short tail, AVX2 8-row decode tiles and a short tail; 24 rows: an
    AVX-512 16-row tile then a whole 8-row tile; tokens 1 (decode), 4 and 5
    (verification), 11 (8 + 3)."""
    variants = native_variants()
    if len(variants) < 2:
        pytest.skip("only one native build is present (make native-portable native-avx2)")
    rng = np.random.default_rng(5)
    cols = 512
    for rows in (19, 24):
        raw = np.ascontiguousarray(encode(rng.standard_normal((rows, cols)).astype(np.float32),
                                          dtype, rng))
        x = rng.standard_normal((11, cols)).astype(np.float32)
        x[0] = tie_blocks(cols, rng)
        digests: dict[int, dict[str, bytes]] = {}
        for name, mod in variants:
            t = mod.ffi.new("ws_tensor *")
            buf = mod.ffi.from_buffer("uint8_t[]", raw)
            t.data, t.type, t.rows, t.cols = buf, TYPE_IDS[dtype], rows, cols
            for nt in (1, 2, 3, 4, 5, 11):
                out = np.empty((nt, rows), np.float32)
                assert mod.lib.ws_tensor_matmul(t, mod.ffi.from_buffer("float[]", x[:nt]), nt,
                                                mod.ffi.from_buffer("float[]", out),
                                                out.size) == 0
                digests.setdefault(nt, {})[name] = out.tobytes()
        assert len(digests[1]) == len(variants)
        for nt, by_build in digests.items():
            assert len(set(by_build.values())) == 1, (dtype, rows, nt, sorted(by_build))


def test_activation_quantization_rounds_to_nearest_even() -> None:
    x = np.zeros(64, np.float32)
    x[:6] = [32767.0, 2.5, -2.5, 3.5, -3.5, 0.5]
    q, dx = quantize(x[None, :])
    assert q[0, 0, :6].tolist() == [32767, 2, -2, 4, -4, 0]
    assert dx[0].tolist() == [1.0, 0.0]
    assert not q[0, 1].any()  # an all-zero block stays zero


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q5_0", "q8_0", *K_TYPES])
def test_random_blocks_every_bit_pattern(dtype: str) -> None:
    """Blocks of random bytes (every quant value, every packed scale and high bit) with
    finite f16 scales unpack as gguf's dequantizer does."""
    rng = np.random.default_rng(3)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[dtype.upper()]]
    rows, cols = 21, 4 * block  # a 16-row tile and a tail
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
    # the largest integers (Q8_0's -128, the ends of every range) against activations
    # of +-32767: the integer sums stay exact
    x = np.where(rng.random((3, cols)) < 0.5, -1.0, 1.0).astype(np.float32)
    x[1] = rng.standard_normal(cols)
    assert t.matmul(x).tobytes() == product(raw, dtype, cols, x).tobytes()


def test_the_models_fused_multiply_add_rounds_once() -> None:
    """(1 + 2^-23) * 2^-24 * (1 - 2^-23) + (1 + 2^-23) lies just below a float32
    midpoint; in float64 it rounds onto the midpoint, and rounding that to float32
    (ties to even) would give 1 + 2^-22. One rounding gives 1 + 2^-23."""
    a, b, c = np.float32(1 + 2**-23), np.float32(2**-24 * (1 - 2**-23)), np.float32(1 + 2**-23)
    assert np.float32(np.float64(a) * np.float64(b) + np.float64(c)) == np.float32(1 + 2**-22)
    assert fmaf32(a, b, c) == np.float32(1 + 2**-23)
    assert fmaf32(np.float32(3), np.float32(5), np.float32(-1)) == np.float32(14)


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
    them as gguf does and multiply them as the scalar model does."""
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
        for nt in (1, 5, 12):
            x = rng.standard_normal((nt, cols)).astype(np.float32)
            assert t.matmul(x).tobytes() == product(raw, name, cols, x).tobytes(), info.name
    assert {"q4_k", "q5_0", "q6_k", "q8_0"} <= seen
