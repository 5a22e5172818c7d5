"""Sliding-window layers in a ring of n_swa + WS_SWA_SPARE rows: the same bits as keeping
every position (swa_full), for every position, batch size, thread count and KV type; what
a slot can still be truncated to; and the slot state that holds only the rings' positions
(format version 3), restored into a ring or a full context."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import Context, Model
from inference_svc.core import model as core_model
from inference_svc.core.binding import kv_type_bytes, lib
from inference_svc.core.errors import BadStateError, CoreMemoryError, InvalidArgumentError
from inference_svc.core.speculative import SamplingParams, SpecDecoder, SpecParams
from tests.factory import Shape, random_weights, write_model, write_weights
from tests.test_core_determinism import in_batches, one_by_one

pytestmark = pytest.mark.native

# layers 0-4 attend to the last 7 positions, layer 5 to all: a ring of 7 + 16 = 23 rows
SHAPE = Shape(n_vocab=300, n_embd=48, n_layer=6, n_head=4, n_head_kv=2, n_ff=64, n_ctx=256,
              tied=True, arch="gemma3", head_dim=40, n_swa=7)
N_SWA, SPARE = 7, int(lib.WS_SWA_SPARE)
RING = N_SWA + SPARE
N_CTX = 160
SEQ = np.random.default_rng(21).integers(0, 300, 120).tolist()


# q8_0 holds whole blocks of 32 per head: the same model with heads of 64
SHAPE_Q8 = dataclasses.replace(SHAPE, head_dim=64)


@pytest.fixture(scope="module", params=["f16", "f32", "q8_0"])
def kv_type(request: pytest.FixtureRequest) -> str:
    return request.param


def shape_of(kv_type: str) -> Shape:
    return SHAPE_Q8 if kv_type == "q8_0" else SHAPE


def row_bytes(kv_type: str) -> int:
    """Bytes of one position's keys (or values) of one layer in a cache of kv_type."""
    sh = shape_of(kv_type)
    return sh.n_head_kv * kv_type_bytes(core_model.KV_TYPES[kv_type], sh.head_dim)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, kv_type: str) -> Iterator[Model]:
    path = tmp_path_factory.mktemp("ring") / "gemma3.gguf"
    write_model(path, shape_of(kv_type), seed=4)
    with Model.load(path) as m:
        yield m


@pytest.fixture(scope="module")
def full(model: Model, kv_type: str) -> np.ndarray:
    """Every position's logits with every position kept, one token at a time."""
    with Context(model, n_ctx=N_CTX, n_threads=1, kv_type=kv_type, swa_full=True) as ctx:
        return one_by_one(ctx, 0, SEQ)


def ring_ctx(model: Model, kv_type: str, **kw: int) -> Context:
    return Context(model, n_ctx=N_CTX, kv_type=kv_type, **kw)


def state_words(state: bytes | memoryview) -> tuple[int, ...]:
    return struct.unpack_from("<8I", state)


def test_ring_takes_less_memory(model: Model, kv_type: str) -> None:
    row = row_bytes(kv_type)
    with ring_ctx(model, kv_type, n_slots=2) as ring, \
            ring_ctx(model, kv_type, n_slots=2, swa_full=True) as whole:
        assert ring.kv_bytes == 2 * 2 * row * (1 * N_CTX + 5 * RING)
        assert whole.kv_bytes == 2 * 2 * row * 6 * N_CTX


def test_memory_check_asks_for_the_rings_only(model: Model, kv_type: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The check before a context allocates counts a local layer's ring, not n_ctx: with
    exactly the ring context's KV bytes available it opens, one byte less it does not."""
    want = 2 * 2 * row_bytes(kv_type) * (1 * N_CTX + 5 * RING)
    monkeypatch.setattr(core_model, "available_memory_bytes", lambda: want)
    with ring_ctx(model, kv_type, n_slots=2) as ring:
        assert ring.kv_bytes == want
    with pytest.raises(CoreMemoryError, match="KV cache"):
        ring_ctx(model, kv_type, n_slots=2, swa_full=True)
    monkeypatch.setattr(core_model, "available_memory_bytes", lambda: want - 1)
    with pytest.raises(CoreMemoryError, match="KV cache"):
        ring_ctx(model, kv_type, n_slots=2)
    # sizes the core refuses keep its message, not a memory error
    with pytest.raises(InvalidArgumentError, match="n_ctx -1 out of range"):
        Context(model, n_ctx=-1, kv_type=kv_type)
    with pytest.raises(InvalidArgumentError, match="n_slots 0 out of range"):
        Context(model, n_slots=0, n_ctx=N_CTX, kv_type=kv_type)


@pytest.mark.parametrize("threads", [1, 2])
def test_ring_gives_the_bits_of_the_full_cache(model: Model, kv_type: str, full: np.ndarray,
                                               threads: int) -> None:
    """Batches that cross the ring's end, one as long as the ring, one longer than it
    (its early positions are overwritten within the chunk), in a context whose n_batch
    splits a long decode: every position's logits are the full cache's."""
    for size in (1, 5, RING, RING + 9, len(SEQ)):
        with ring_ctx(model, kv_type, n_threads=threads) as ctx:
            assert in_batches(ctx, 0, SEQ, size).tobytes() == full.tobytes(), size
    with ring_ctx(model, kv_type, n_threads=threads, n_batch=RING - 3) as ctx:
        assert ctx.decode(0, SEQ, logits_all=True).tobytes() == full.tobytes()


def test_multi_slot_decode_in_rings(model: Model, kv_type: str, full: np.ndarray) -> None:
    with ring_ctx(model, kv_type, n_slots=3, n_threads=2) as ctx:
        ctx.decode(0, SEQ[:40])
        ctx.decode(2, SEQ[:70])
        rows = [ctx.decode_multi([2, 0], [SEQ[70 + i], SEQ[40 + i]]) for i in range(30)]
        assert np.stack([r[1] for r in rows]).tobytes() == full[40:70].tobytes()
        assert np.stack([r[0] for r in rows]).tobytes() == full[70:100].tobytes()


def test_truncate_within_the_spare_rows(model: Model, kv_type: str, full: np.ndarray) -> None:
    with ring_ctx(model, kv_type) as ctx:
        assert ctx.keep_min(0) == 0
        ctx.decode(0, SEQ[:RING])  # the rings are full, nothing overwritten yet
        assert ctx.keep_min(0) == 0
        ctx.decode(0, SEQ[RING:100])
        # the rings hold positions 100 - 23 = 77..99: a prefix of 77 + 6 = 83 keeps the
        # window of its next position
        assert ctx.keep_min(0) == 100 - RING + N_SWA - 1 == 100 - SPARE - 1
        with pytest.raises(InvalidArgumentError, match="keep 0 or at least 83"):
            ctx.truncate(0, 82)
        assert ctx.n_tokens(0) == 100  # refused: the slot is as it was
        ctx.truncate(0, 83)
        assert in_batches(ctx, 0, SEQ[83:], 4).tobytes() == full[83:].tobytes()
        ctx.truncate(0, 0)
        assert ctx.keep_min(0) == 0
        assert in_batches(ctx, 0, SEQ[:50], 50).tobytes() == full[:50].tobytes()


def test_swa_full_context_keeps_every_prefix(model: Model, kv_type: str,
                                             full: np.ndarray) -> None:
    with ring_ctx(model, kv_type, swa_full=True) as ctx:
        ctx.decode(0, SEQ)
        assert ctx.keep_min(0) == 0
        ctx.truncate(0, 10)
        assert in_batches(ctx, 0, SEQ[10:], 7).tobytes() == full[10:].tobytes()


def test_state_holds_the_rings_only(model: Model, kv_type: str, full: np.ndarray) -> None:
    with ring_ctx(model, kv_type) as src:
        src.decode(0, SEQ[:15])
        small = bytes(src.get_state(0))  # the rings never wrapped: every position, v2
        assert state_words(small)[1] == 2 and state_words(small)[7] == 0
        src.decode(0, SEQ[15:100])
        state = bytes(src.get_state(0))
    w = state_words(state)
    assert (w[1], w[6], w[7]) == (3, 100, RING)
    assert len(state) == 32 + 4 * 100 + 2 * row_bytes(kv_type) * (100 + 5 * RING)
    for swa_full in (False, True):
        with ring_ctx(model, kv_type, swa_full=swa_full) as dst:
            assert dst.set_state(0, state) == len(state)
            assert dst.keep_min(0) == 100 - RING + N_SWA - 1
            assert bytes(dst.get_state(0)) == state
            assert in_batches(dst, 0, SEQ[100:], 3).tobytes() == full[100:].tobytes()
    # a full state (swa_full) into rings: the rings take its last positions
    with ring_ctx(model, kv_type, swa_full=True) as src:
        src.decode(0, SEQ[:100])
        whole = bytes(src.get_state(0))
    assert state_words(whole)[1] == 2 and len(whole) > len(state)
    with ring_ctx(model, kv_type) as dst:
        dst.set_state(0, whole)
        assert bytes(dst.get_state(0)) == state
        assert in_batches(dst, 0, SEQ[100:], 20).tobytes() == full[100:].tobytes()


def test_state_window_must_cover_the_next_token(model: Model, kv_type: str) -> None:
    with ring_ctx(model, kv_type) as ctx:
        ctx.decode(0, SEQ[:100])
        state = bytearray(ctx.get_state(0))
        # a window of n_swa - 2 positions cannot give the next token its window
        short = bytearray(state[:32])
        struct.pack_into("<I", short, 28, N_SWA - 2)
        with pytest.raises(BadStateError, match="needs 6..100"):
            ctx.set_state(0, bytes(short) + bytes(state[32:]))
        assert ctx.n_tokens(0) == 0
        # the declared window must match the bytes that follow
        struct.pack_into("<I", state, 28, RING - 1)
        with pytest.raises(BadStateError, match="must be"):
            ctx.set_state(0, bytes(state))
        assert ctx.n_tokens(0) == 0


def test_speculative_rollback_stays_exact(model: Model, tmp_path: Path, kv_type: str) -> None:
    """A draft proposes, the target rolls back what it rejects: with the rings' spare
    rows every rollback is exact, past the window too: sampled output (seeded) is the
    same token for token as with every position kept."""
    draft_path = tmp_path / "draft.gguf"
    shape = Shape(n_vocab=300, n_embd=32, n_layer=6, n_head=2, n_head_kv=1, n_ff=48,
                  n_ctx=256, tied=True, arch="gemma3", head_dim=32 if kv_type == "q8_0" else 16,
                  n_swa=5)
    # other weights, the target's vocabulary (tokenizer seed 4)
    write_weights(draft_path, shape, random_weights(shape, 9), 4, "draft", "gemma3")
    sampling = SamplingParams(temperature=25.0)  # the random models' logits are peaked
    outs, counters = [], []
    with Model.load(draft_path) as dm:
        for swa_full in (True, False):
            with ring_ctx(model, kv_type, swa_full=swa_full) as t, \
                    ring_ctx(dm, kv_type, swa_full=swa_full) as d, SpecDecoder(t, d) as spec:
                spec.seed(0, 7)
                toks = [spec.prefill(0, SEQ[:10], sampling, with_draft=True)]
                while len(toks) < 100:
                    toks += spec.step(0, sampling, SpecParams(n_max=8), max_new=100 - len(toks))
                outs.append(toks)
                counters.append(spec.counters(0))
    assert outs[0] == outs[1] and counters[0] == counters[1]
    assert counters[1].n_drafted > counters[1].n_accepted + 20  # rollbacks happened
