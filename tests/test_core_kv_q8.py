"""The q8_0 KV cache: llama.cpp's block_q8_0 of each head's keys and values, the slot
state that holds those blocks (exact size, bit-identical continuation after a restore),
and the refusal of a state of another KV type."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import BadStateError, Model
from inference_svc.core import Context as Ctx
from inference_svc.core.binding import KV_TYPES, kv_type_bytes
from tests.factory import Shape, write_model
from tests.reference import q8_0_quantize

pytestmark = pytest.mark.native

PROMPT = [10, 20, 30, 40, 50, 60, 70, 80, 90]
HEADER = 32
# 2 layers, 2 KV heads of 32 dims: one q8_0 block (34 bytes) per head and position
SHAPE = Shape(n_vocab=300, n_embd=128, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)
BLOCK = 34


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = tmp_path_factory.mktemp("q8") / "hd32.gguf"
    write_model(path, SHAPE, seed=2)
    with Model.load(path) as m:
        yield m


def state_len(n_tokens: int) -> int:
    """header, tokens, then K and V of 2 layers x 2 heads x one block per position"""
    return HEADER + 4 * n_tokens + 2 * 2 * 2 * BLOCK * n_tokens


def q8_0_blocks(x: np.ndarray) -> bytes:
    """The bytes of llama.cpp's block_q8_0 of float32 rows of 32: d, then the 32 q."""
    d, q = q8_0_quantize(x.reshape(-1, 32))
    return b"".join(d[i].tobytes() + q[i].tobytes() for i in range(len(d)))


def test_type_list_and_sizes_come_from_the_core() -> None:
    assert KV_TYPES == {"f32": 0, "f16": 1, "q8_0": 2}
    assert [kv_type_bytes(KV_TYPES["q8_0"], n) for n in (0, 32, 64, 256, 16, 40)] == [
        0, 34, 68, 272, 0, 0]


def test_cache_and_memory_check_count_the_blocks(model: Model) -> None:
    with Ctx(model, n_slots=3, n_ctx=40, kv_type="q8_0") as c:
        # slots x positions x (K, V) x layers x heads x a block
        assert c.kv_bytes == 3 * 40 * 2 * 2 * 2 * BLOCK == 32640
    assert model.kv_bytes_per_token("q8_0") == 2 * 2 * 2 * BLOCK
    assert model.kv_bytes_per_token("f16") == 2 * 2 * 64 * 2


def test_cache_holds_llama_cpp_blocks_of_the_keys(model: Model) -> None:
    """The first layer's K and V of the first token do not depend on the cache type: the
    q8_0 state holds exactly the f32 context's values quantized as llama.cpp does."""
    with Ctx(model, n_ctx=32, kv_type="f32") as c32, Ctx(model, n_ctx=32, kv_type="q8_0") as c8:
        c32.decode(0, PROMPT[:1])
        c8.decode(0, PROMPT[:1])
        k32 = np.frombuffer(c32.get_state(0)[HEADER + 4:], dtype="<f4")[:64]
        v32 = np.frombuffer(c32.get_state(0)[HEADER + 4:], dtype="<f4")[64:128]
        q8 = bytes(c8.get_state(0)[HEADER + 4:])
    assert q8[:2 * BLOCK] == q8_0_blocks(k32)
    assert q8[2 * BLOCK:4 * BLOCK] == q8_0_blocks(v32)


def test_state_round_trip_continues_exactly(model: Model) -> None:
    with Ctx(model, n_slots=2, n_ctx=64, n_threads=2, kv_type="q8_0") as c:
        c.decode(0, PROMPT)
        state = bytes(c.get_state(0))
        assert len(state) == c.state_size(0) == state_len(len(PROMPT)) == 2516
        assert struct.unpack_from("<8I", state) == (0x564B5357, 2, 2, 64, 64, 2, 9, 0)
        expected = [c.decode(0, [t]) for t in (7, 8, 9)]
        assert c.set_state(1, state) == len(state)
        assert c.tokens(1) == PROMPT
        assert bytes(c.get_state(1)) == state
        got = [c.decode(1, [t]) for t in (7, 8, 9)]
    with Ctx(model, n_ctx=64, n_threads=1, kv_type="q8_0") as fresh:  # another context
        fresh.set_state(0, state)
        again = fresh.decode(0, [7, 8, 9], logits_all=True)
    assert np.stack(got).tobytes() == np.stack(expected).tobytes() == again.tobytes()


@pytest.mark.parametrize("other", ["f16", "f32"])
def test_state_of_another_kv_type_is_refused(model: Model, other: str) -> None:
    with Ctx(model, n_ctx=32, kv_type=other) as co, Ctx(model, n_ctx=32, kv_type="q8_0") as c8:
        co.decode(0, PROMPT)
        c8.decode(0, PROMPT)
        with pytest.raises(BadStateError, match=f"state holds an {other} KV cache, this context "
                                                "keeps q8_0"):
            c8.set_state(0, co.get_state(0))
        with pytest.raises(BadStateError, match=f"state holds a q8_0 KV cache, this context "
                                                f"keeps {other}: restore it into a context of "
                                                "KV type q8_0"):
            co.set_state(0, c8.get_state(0))
        assert co.n_tokens(0) == c8.n_tokens(0) == 0


def test_state_with_a_scale_that_is_not_finite_is_refused(model: Model) -> None:
    with Ctx(model, n_ctx=32, kv_type="q8_0") as c:
        c.decode(0, PROMPT)
        state = bytearray(c.get_state(0))
        struct.pack_into("<H", state, HEADER + 4 * len(PROMPT) + 5 * BLOCK, 0x7C00)  # +inf
        with pytest.raises(BadStateError, match="state KV value 5 is not finite"):
            c.set_state(0, bytes(state))
        assert c.n_tokens(0) == 0
        # a block's int8 values are any byte: 0x80 (-128) loads and decodes
        struct.pack_into("<H", state, HEADER + 4 * len(PROMPT) + 5 * BLOCK, 0x3C00)
        state[HEADER + 4 * len(PROMPT) + 5 * BLOCK + 2] = 0x80
        assert c.set_state(0, bytes(state)) == len(state)
        assert np.isfinite(c.decode(0, [7])).all()


def test_head_dim_of_partial_blocks_is_refused_before_allocation(tmp_path: Path) -> None:
    from inference_svc.core import InvalidArgumentError

    path = tmp_path / "hd40.gguf"
    write_model(path, Shape(n_vocab=300, n_embd=80, n_layer=1, n_head=2, n_head_kv=1, n_ff=64))
    with Model.load(path) as m:
        with pytest.raises(InvalidArgumentError, match="a q8_0 KV cache needs a head_dim that "
                                                       "is a multiple of 32; this model's is 40"):
            Ctx(m, n_ctx=32, kv_type="q8_0")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_logits_match_the_reference_with_q8_0_blocks(tmp_path: Path, arch: str) -> None:
    """The float64 reference forward pass with its keys and values quantized the same way
    (tests/reference.py), llama and gemma3 (sliding window of 7 over 40 tokens)."""
    from tests.reference import forward

    shape = (Shape(n_vocab=320, n_embd=192, n_layer=3, n_head=6, n_head_kv=2, n_ff=160)
             if arch == "llama" else
             Shape(n_vocab=300, n_embd=48, n_layer=6, n_head=4, n_head_kv=2, n_ff=64,
                   tied=True, arch="gemma3", head_dim=64, n_swa=7))
    write_model(tmp_path / "m.gguf", shape, seed=7)
    tokens = np.random.default_rng(3).integers(0, shape.n_vocab, 40).tolist()
    with Model.load(tmp_path / "m.gguf") as m, Ctx(m, n_ctx=64, kv_type="q8_0") as ctx:
        got = ctx.decode(0, tokens, logits_all=True)
        ref = forward(m.hparams, m.content.dequantized(), tokens, "q8_0")
        f16 = forward(m.hparams, m.content.dequantized(), tokens, "f16")
    scale = float(np.abs(ref).max())
    assert float(np.abs(got - ref).max()) / scale < 1e-3
    # the quantization shows: the f16 reference is further away than the q8_0 one
    assert float(np.abs(got - f16).max()) > 10 * float(np.abs(got - ref).max())
