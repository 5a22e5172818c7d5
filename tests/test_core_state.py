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


@pytest.fixture()
def ctx(small_model_path: Path) -> Ctx:
    model = Model.load(small_model_path)
    c = Ctx(model, n_slots=2, n_ctx=32, n_threads=2)
    yield c
    c.close()
    model.close()


def state_len(n_tokens: int) -> int:
    # small model: 2 layers, 2 kv heads x 16 dims
    return HEADER + 4 * n_tokens + 2 * 2 * n_tokens * 32 * 4


def test_state_roundtrip_is_bit_identical(ctx: Ctx) -> None:
    ctx.decode(0, PROMPT)
    expected = ctx.decode(0, [7])
    ctx.truncate(0, len(PROMPT))
    state = ctx.get_state(0)
    assert len(state) == ctx.state_size(0) == state_len(len(PROMPT))
    assert struct.unpack_from("<8I", state) == (0x564B5357, 1, 2, 32, 32, 0, len(PROMPT), 0)
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


def corruptions(good: bytes) -> dict[str, bytes]:
    def patch(offset: int, value: int) -> bytes:
        b = bytearray(good)
        struct.pack_into("<I", b, offset, value)
        return bytes(b)

    nan_kv = bytearray(good)
    struct.pack_into("<f", nan_kv, HEADER + 4 * len(PROMPT) + 8, float("nan"))
    return {
        "empty": b"",
        "short_header": good[:HEADER - 1],
        "truncated": good[:-1],
        "oversized": good + b"\0",
        "garbage": bytes(np.random.default_rng(1).integers(0, 256, len(good), dtype=np.uint8)),
        "bad_magic": patch(0, 0x12345678),
        "newer_version": patch(4, 2),
        "other_layers": patch(8, 3),
        "other_kv_dim": patch(12, 64),
        "dtype": patch(20, 1),
        "too_many_tokens": patch(24, 33),
        "token_count_mismatch": patch(24, len(PROMPT) - 1),
        "token_out_of_vocab": patch(HEADER, 300),
        "negative_token": patch(HEADER + 4, 0xFFFFFFFF),
        "nan_in_kv": bytes(nan_kv),
    }


@pytest.mark.parametrize("case", sorted(corruptions(b"\0" * state_len(len(PROMPT)))))
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


FIXED_SIZE_CORRUPTIONS = ["bad_magic", "newer_version", "other_layers", "other_kv_dim", "dtype",
                          "too_many_tokens", "token_count_mismatch", "token_out_of_vocab",
                          "negative_token", "nan_in_kv"]


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
    assert kv == 8 * 4096 * 2 * 2 * 32 * 4  # 16 MiB: slots x ctx x (K, V) x layers x dims
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
