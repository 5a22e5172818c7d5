"""Slot state get/set, truncate, clear, and every validation of the core's inputs."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import (
    BadStateError,
    ContextFullError,
    CoreMemoryError,
    InvalidArgumentError,
    Model,
)
from inference_svc.core import Context as Ctx

pytestmark = pytest.mark.native

PROMPT = [10, 20, 30, 40, 50, 60, 70, 80, 90]
HEADER = 32
DTYPE = {"f32": 0, "f16": 1}
ELEM = {"f32": 4, "f16": 2}


@pytest.fixture(params=["f16", "f32"])
def ctx(request: pytest.FixtureRequest, small_model_path: Path) -> Ctx:
    model = Model.load(small_model_path)
    c = Ctx(model, n_slots=2, n_ctx=32, n_threads=2, kv_type=request.param)
    yield c
    c.close()
    model.close()


def state_len(n_tokens: int, kv_type: str) -> int:
    # small model: 2 layers, 2 kv heads x 16 dims
    return HEADER + 4 * n_tokens + 2 * 2 * n_tokens * 32 * ELEM[kv_type]


def test_state_roundtrip_is_bit_identical(ctx: Ctx) -> None:
    ctx.decode(0, PROMPT)
    expected = ctx.decode(0, [7])
    ctx.truncate(0, len(PROMPT))
    state = ctx.get_state(0)
    assert len(state) == ctx.state_size(0) == state_len(len(PROMPT), ctx.kv_type)
    assert struct.unpack_from("<8I", state) == (0x564B5357, 2, 2, 32, 32, DTYPE[ctx.kv_type],
                                                len(PROMPT), 0)
    assert list(struct.unpack_from(f"<{len(PROMPT)}i", state, HEADER)) == PROMPT
    ctx.clear(0)
    assert ctx.n_tokens(0) == 0
    assert ctx.set_state(1, state) == len(state)  # into another slot
    assert ctx.tokens(1) == PROMPT
    assert ctx.decode(1, [7]).tobytes() == expected.tobytes()


def test_empty_slot_state(ctx: Ctx) -> None:
    state = ctx.get_state(0)
    assert len(state) == HEADER
    assert ctx.set_state(1, state) == HEADER
    assert ctx.n_tokens(1) == 0


def test_state_kv_is_the_cache_as_stored(small_model_path: Path) -> None:
    """An f16 state holds the f32 context's keys and values rounded to half, no more."""
    with Model.load(small_model_path) as model, \
            Ctx(model, n_ctx=32, kv_type="f32") as c32, Ctx(model, n_ctx=32) as c16:
        assert c16.kv_type == "f16"
        assert c16.kv_bytes * 2 == c32.kv_bytes == 32 * 2 * 2 * 32 * 4
        # the first layer's K and V of the first token do not depend on the cache's type
        # (the later layers see the rounded values through the attention)
        c32.decode(0, PROMPT[:1])
        c16.decode(0, PROMPT[:1])
        kv32 = np.frombuffer(c32.get_state(0)[HEADER + 4:], dtype="<f4")[:64]
        kv16 = np.frombuffer(c16.get_state(0)[HEADER + 4:], dtype="<f2")[:64]
        assert kv16.tobytes() == kv32.astype(np.float16).tobytes()
        assert not np.array_equal(kv16.astype(np.float32), kv32)  # it did round


def test_state_of_another_kv_type_is_refused(small_model_path: Path) -> None:
    with Model.load(small_model_path) as model, \
            Ctx(model, n_ctx=32, kv_type="f32") as c32, Ctx(model, n_ctx=32) as c16:
        c32.decode(0, PROMPT)
        c16.decode(0, PROMPT)
        with pytest.raises(BadStateError, match="state holds an f32 KV cache, this context "
                                                "keeps f16"):
            c16.set_state(0, c32.get_state(0))
        with pytest.raises(BadStateError, match="state holds an f16 KV cache, this context "
                                                "keeps f32"):
            c32.set_state(0, c16.get_state(0))
        assert c16.n_tokens(0) == c32.n_tokens(0) == 0


def test_version_1_state_still_loads_into_an_f32_context(small_model_path: Path) -> None:
    """Version 1 (f32 only, what .drft files of earlier releases embed) is still read."""
    with Model.load(small_model_path) as model, Ctx(model, n_ctx=32, kv_type="f32") as c:
        c.decode(0, PROMPT)
        expected = c.decode(0, [7])
        c.truncate(0, len(PROMPT))
        v1 = bytearray(c.get_state(0))
        struct.pack_into("<I", v1, 4, 1)
        assert c.set_state(0, bytes(v1)) == len(v1)
        assert c.decode(0, [7]).tobytes() == expected.tobytes()
        v1_f16 = bytearray(v1)
        struct.pack_into("<I", v1_f16, 20, 1)  # version 1 knew no f16
    with Model.load(small_model_path) as model, Ctx(model, n_ctx=32) as c16:
        with pytest.raises(BadStateError, match="dtype 1 / reserved 0 not supported by state "
                                                "version 1"):
            c16.set_state(0, bytes(v1_f16))


def corruptions(good: bytes) -> dict[str, bytes]:
    def patch(offset: int, value: int) -> bytes:
        b = bytearray(good)
        struct.pack_into("<I", b, offset, value)
        return bytes(b)

    f16 = struct.unpack_from("<I", good, 20)[0] == 1
    kv_at = HEADER + 4 * len(PROMPT) + 8

    def bad_value(value: float) -> bytes:
        b = bytearray(good)
        struct.pack_into("<e" if f16 else "<f", b, kv_at, value)
        return bytes(b)

    return {
        "empty": b"",
        "short_header": good[:HEADER - 1],
        "truncated": good[:-1],
        "oversized": good + b"\0",
        "garbage": bytes(np.random.default_rng(1).integers(0, 256, len(good), dtype=np.uint8)),
        "bad_magic": patch(0, 0x12345678),
        "newer_version": patch(4, 3),
        "version_0": patch(4, 0),
        "other_layers": patch(8, 3),
        "other_kv_dim": patch(12, 64),
        "dtype": patch(20, 2),
        "other_kv_type": patch(20, 0 if f16 else 1),
        "too_many_tokens": patch(24, 33),
        "token_count_mismatch": patch(24, len(PROMPT) - 1),
        "token_out_of_vocab": patch(HEADER, 300),
        "negative_token": patch(HEADER + 4, 0xFFFFFFFF),
        "nan_in_kv": bad_value(float("nan")),
        "inf_in_kv": bad_value(float("-inf")),
    }


@pytest.mark.parametrize("case", sorted(corruptions(b"\0" * state_len(len(PROMPT), "f32"))))
def test_bad_state_leaves_slot_empty_and_usable(ctx: Ctx, case: str) -> None:
    ctx.decode(0, PROMPT)
    good = bytes(ctx.get_state(0))
    expected = ctx.decode(0, [7])
    ctx.decode(1, [1, 2, 3])  # the target slot holds something before the failed set
    with pytest.raises(BadStateError):
        ctx.set_state(1, corruptions(good)[case])
    assert ctx.n_tokens(1) == 0
    ctx.decode(1, [4, 5])  # usable
    assert ctx.set_state(1, good) == len(good)
    assert ctx.decode(1, [7]).tobytes() == expected.tobytes()


def split_state(state: bytes, n_tokens: int) -> tuple[bytes, bytes, bytes]:
    t_end = HEADER + 4 * n_tokens
    return state[:HEADER], state[HEADER:t_end], state[t_end:]


def test_state_from_parts_is_the_same_state(ctx: Ctx) -> None:
    ctx.decode(0, PROMPT)
    expected = ctx.decode(0, [7])
    ctx.truncate(0, len(PROMPT))
    state = ctx.get_state(0)
    header, tokens, kv = split_state(state, len(PROMPT))
    assert ctx.set_state_parts(1, memoryview(header), tokens, memoryview(kv)) == len(state)
    assert ctx.get_state(1) == state
    assert ctx.decode(1, [7]).tobytes() == expected.tobytes()
    ctx.clear(0)
    assert ctx.set_state_parts(1, ctx.get_state(0), b"", b"") == HEADER  # an empty slot
    assert ctx.n_tokens(1) == 0


FIXED_SIZE_CORRUPTIONS = ["bad_magic", "newer_version", "version_0", "other_layers",
                          "other_kv_dim", "dtype", "other_kv_type", "too_many_tokens",
                          "token_count_mismatch", "token_out_of_vocab", "negative_token",
                          "nan_in_kv", "inf_in_kv"]


@pytest.mark.parametrize("case", FIXED_SIZE_CORRUPTIONS + [
    "header_short", "header_long", "tokens_short", "kv_short", "kv_long", "kv_in_tokens"])
def test_bad_state_parts_leave_slot_empty_and_usable(ctx: Ctx, case: str) -> None:
    ctx.decode(0, PROMPT)
    good = bytes(ctx.get_state(0))
    expected = ctx.decode(0, [7])
    h, t, kv = split_state(good, len(PROMPT))
    if case in FIXED_SIZE_CORRUPTIONS:
        parts = split_state(corruptions(good)[case], len(PROMPT))
    else:
        parts = {"header_short": (h[:-1], t, kv), "header_long": (h + b"\0", t, kv),
                 "tokens_short": (h, t[:-4], kv), "kv_short": (h, t, kv[:-1]),
                 "kv_long": (h, t, kv + b"\0\0\0\0"), "kv_in_tokens": (h, t + kv, b"")}[case]
    ctx.decode(1, [1, 2, 3])
    with pytest.raises(BadStateError):
        ctx.set_state_parts(1, *parts)
    assert ctx.n_tokens(1) == 0
    assert ctx.set_state_parts(1, h, t, kv) == len(good)
    assert ctx.decode(1, [7]).tobytes() == expected.tobytes()


RSS_PROBE = """
import os
import sys
from inference_svc.core import Context, Model
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
m = Model.load(sys.argv[1])
before = rss()
c = Context(m, n_slots=8, n_ctx=4096, n_threads=1, reserve_kv=sys.argv[2] == "1")
grown = rss() - before
c.decode(0, [1, 2, 3])
print(grown, c.kv_bytes, c.n_tokens(0))
"""


def test_reserve_kv_commits_the_cache_up_front(small_model_path: Path) -> None:
    grown = {}
    for reserve in ("0", "1"):  # a fresh process each: RSS is not muddied by freed memory
        out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(small_model_path), reserve],
                             capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent.parent).stdout.split()
        grown[reserve], kv, n = map(int, out)
        assert n == 3  # decodes the same either way
    assert kv == 8 * 4096 * 2 * 2 * 32 * 2  # 8 MiB: slots x ctx x (K, V) x layers x dims x f16
    assert grown["1"] >= kv
    assert grown["0"] < kv // 4


def test_decode_validation_leaves_slot_unchanged(ctx: Ctx) -> None:
    ctx.decode(0, PROMPT)
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        ctx.decode(0, [1, 300])
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        ctx.decode(0, [-1])
    with pytest.raises(InvalidArgumentError, match="at least one token"):
        ctx.decode(0, [])
    with pytest.raises(ContextFullError, match="exceed its context of 32"):
        ctx.decode(0, list(range(32 - len(PROMPT) + 1)))
    with pytest.raises(InvalidArgumentError, match="slot 2 out of range"):
        ctx.decode(2, [1])
    with pytest.raises(InvalidArgumentError, match="slot -1 out of range"):
        ctx.n_tokens(-1)
    assert ctx.tokens(0) == PROMPT
    ctx.decode(0, list(range(32 - len(PROMPT))))  # exactly full is fine
    assert ctx.n_tokens(0) == 32


def test_truncate_validation(ctx: Ctx) -> None:
    ctx.decode(0, PROMPT)
    with pytest.raises(InvalidArgumentError, match="cannot truncate"):
        ctx.truncate(0, len(PROMPT) + 1)
    with pytest.raises(InvalidArgumentError, match="cannot truncate"):
        ctx.truncate(0, -1)
    ctx.truncate(0, 4)
    assert ctx.tokens(0) == PROMPT[:4]


def test_context_parameter_validation(small_model_path: Path) -> None:
    with Model.load(small_model_path) as model:
        with pytest.raises(InvalidArgumentError, match="n_slots 0"):
            Ctx(model, n_slots=0)
        with pytest.raises(InvalidArgumentError, match="n_threads 0"):
            Ctx(model, n_threads=0)
        with pytest.raises(InvalidArgumentError, match="n_ctx 0"):
            Ctx(model, n_ctx=0)
        with pytest.raises(InvalidArgumentError, match="KV type 'bf16' is not one of f32, f16"):
            Ctx(model, kv_type="bf16")
        with pytest.raises(CoreMemoryError, match="needs .* MiB of KV cache"):
            Ctx(model, n_slots=1000, n_ctx=1 << 20)


def test_model_outlives_its_contexts(small_model_path: Path) -> None:
    model = Model.load(small_model_path)
    ctx = Ctx(model, n_ctx=16)
    with pytest.raises(InvalidArgumentError, match="close the model's contexts"):
        model.close()
    ctx.close()
    model.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        ctx.decode(0, [1])


def test_draft_state_keeps_its_kv_type(small_model_path: Path) -> None:
    """The draft state (WSSP) embeds the draft context's state in its KV type: it round
    trips in a pair of its type and is refused, the draft left empty, in the other."""
    from inference_svc.core.speculative import SamplingParams, SpecDecoder, SpecParams

    states, tails = {}, {}
    with Model.load(small_model_path) as model:
        for kv in ("f16", "f32"):
            with Ctx(model, n_ctx=64, kv_type=kv) as tc, Ctx(model, n_ctx=64, kv_type=kv) as dc, \
                    SpecDecoder(tc, dc) as dec:
                dec.seed(0, 5)
                dec.generate(0, PROMPT, 6, SamplingParams(), SpecParams(n_max=3))
                dec.commit(0)
                states[kv] = (tc.get_state(0), dec.draft_state(0))
                tails[kv] = dec.generate(0, [1, 2], 6, SamplingParams(), SpecParams(n_max=3))
        assert len(states["f32"][1]) - len(states["f16"][1]) == 2 * 2 * 32 * 2 * ctx_tokens(
            states["f16"][0])
        for kv, other in (("f16", "f32"), ("f32", "f16")):
            with Ctx(model, n_ctx=64, kv_type=kv) as tc, Ctx(model, n_ctx=64, kv_type=kv) as dc, \
                    SpecDecoder(tc, dc) as dec:
                tc.set_state(0, states[kv][0])
                dec.set_draft_state(0, states[kv][1])
                assert dec.generate(0, [1, 2], 6, SamplingParams(),
                                    SpecParams(n_max=3)) == tails[kv]
                tc.set_state(0, states[kv][0])
                with pytest.raises(BadStateError, match=f"draft state: state holds an {other} "
                                                        f"KV cache, this context keeps {kv}"):
                    dec.set_draft_state(0, states[other][1])
                assert dec.draft_n_tokens(0) == 0


def ctx_tokens(state: bytes) -> int:
    return struct.unpack_from("<I", state, 24)[0]
