"""The thin 1:1 layer over the compiled cffi module.

Each function maps one C call; a non-zero status becomes a typed exception
carrying the core's message (the one helper `_check`). Set
WARMSLOT_NATIVE=asan to load the AddressSanitizer/UBSan build instead, or
WARMSLOT_NATIVE=portable for the scalar build (no AVX2; the same bits), or
WARMSLOT_NATIVE=avx2 for the AVX2 build on a machine whose release build uses AVX-512.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from .errors import error_for_status


def _load() -> Any:
    variant = os.environ.get("WARMSLOT_NATIVE", "release")
    name = {"release": "_native", "asan": "_native_asan",
            "portable": "_native_portable", "avx2": "_native_avx2"}.get(variant)
    if name is None:
        raise ImportError("WARMSLOT_NATIVE must be 'release', 'asan', 'portable' or 'avx2', "
                          f"not {variant!r}")
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError as exc:
        raise ImportError(
            f"the native core ({name}) is not built: run `make native` "
            f"(`make native-{variant}` for this variant) ({exc})"
        ) from exc


_mod = _load()
ffi = _mod.ffi
lib = _mod.lib
NATIVE_VARIANT = os.environ.get("WARMSLOT_NATIVE", "release")


def _message(ctx: Any = None) -> str:
    ptr = lib.ws_context_last_error(ctx) if ctx is not None else lib.ws_last_error()
    return ffi.string(ptr).decode("utf-8", "replace") if ptr != ffi.NULL else ""


def _check(status: int, ctx: Any = None) -> None:
    if status != 0:
        raise error_for_status(status, _message(ctx))


def _out(check: Callable[[int, Any], None], ctype: str, fn: Callable[..., int], handle: Any,
         *args: Any) -> int:
    """fn(handle, *args, out) for a C call that writes one `ctype` result to `out`;
    check(status, handle) raises on failure."""
    out = ffi.new(f"{ctype} *")
    check(fn(handle, *args, out), handle)
    return int(out[0])


def model_init(hparams: Any, weights: Any) -> Any:
    out = ffi.new("ws_model **")
    _check(lib.ws_model_init(hparams, weights, out))
    return out[0]


def model_free(model: Any) -> None:
    lib.ws_model_free(model)


def context_default_params() -> Any:
    return lib.ws_context_default_params()


def context_init(model: Any, params: Any) -> Any:
    out = ffi.new("ws_context **")
    _check(lib.ws_context_init(model, params, out))
    return out[0]


def context_free(ctx: Any) -> None:
    lib.ws_context_free(ctx)


def context_kv_bytes(ctx: Any) -> int:
    return int(lib.ws_context_kv_bytes(ctx))


def context_kv_bytes_needed(model: Any, params: Any) -> int:
    out = ffi.new("uint64_t *")
    _check(lib.ws_context_kv_bytes_needed(model, params, out))
    return int(out[0])


def fp16_from_fp32(src: Any, dst: Any, n: int) -> None:
    lib.ws_fp16_from_fp32(src, dst, n)


def fp32_from_fp16(src: Any, dst: Any, n: int) -> None:
    lib.ws_fp32_from_fp16(src, dst, n)


def slot_n_tokens(ctx: Any, slot: int) -> int:
    return _out(_check, "int32_t", lib.ws_slot_n_tokens, ctx, slot)


def slot_tokens(ctx: Any, slot: int, out: Any, cap: int) -> int:
    return _out(_check, "int32_t", lib.ws_slot_tokens, ctx, slot, out, cap)


def decode(ctx: Any, slot: int, tokens: Any, n_tokens: int, logits_all: bool, logits: Any,
           logits_cap: int) -> None:
    _check(lib.ws_decode(ctx, slot, tokens, n_tokens, int(logits_all), logits, logits_cap), ctx)


def decode_multi(ctx: Any, slots: Any, tokens: Any, n: int, logits: Any, logits_cap: int) -> None:
    _check(lib.ws_decode_multi(ctx, slots, tokens, n, logits, logits_cap), ctx)


def slot_truncate(ctx: Any, slot: int, n: int) -> None:
    _check(lib.ws_slot_truncate(ctx, slot, n), ctx)


def slot_keep_min(ctx: Any, slot: int) -> int:
    n = ffi.new("int32_t *")
    _check(lib.ws_slot_keep_min(ctx, slot, n), ctx)
    return int(n[0])


def slot_clear(ctx: Any, slot: int) -> None:
    _check(lib.ws_slot_clear(ctx, slot), ctx)


def slot_state_size(ctx: Any, slot: int) -> int:
    return _out(_check, "size_t", lib.ws_slot_state_size, ctx, slot)


def slot_state_get(ctx: Any, slot: int, buf: Any, cap: int) -> int:
    return _out(_check, "size_t", lib.ws_slot_state_get, ctx, slot, buf, cap)


def slot_state_set_parts(ctx: Any, slot: int, header: Any, header_len: int, tokens: Any,
                         tokens_len: int, kv: Any, kv_len: int) -> int:
    return _out(_check, "size_t", lib.ws_slot_state_set_parts, ctx, slot, header, header_len,
                tokens, tokens_len, kv, kv_len)


def slot_state_set(ctx: Any, slot: int, buf: Any, length: int) -> int:
    return _out(_check, "size_t", lib.ws_slot_state_set, ctx, slot, buf, length)


# ---- speculative decoding (ws_spec_*) ----

def _check_spec(status: int, spec: Any) -> None:
    if status != 0:
        ptr = lib.ws_spec_last_error(spec)
        msg = ffi.string(ptr).decode("utf-8", "replace") if ptr != ffi.NULL else ""
        raise error_for_status(status, msg)


def spec_init(target: Any, draft: Any) -> Any:
    out = ffi.new("ws_spec **")
    status = lib.ws_spec_init(target, draft, out)
    if status != 0:
        try:
            _check_spec(status, out[0] if out[0] != ffi.NULL else ffi.NULL)
        finally:
            lib.ws_spec_free(out[0])
    return out[0]


def spec_free(spec: Any) -> None:
    lib.ws_spec_free(spec)


def spec_check_params(spec: Any, sp: Any, pp: Any) -> None:
    _check_spec(lib.ws_spec_check_params(spec, sp, pp), spec)


def spec_seed(spec: Any, slot: int, seed: int) -> None:
    _check_spec(lib.ws_spec_seed(spec, slot, seed), spec)


def spec_n_tokens(spec: Any, slot: int) -> int:
    return _out(_check_spec, "int32_t", lib.ws_spec_n_tokens, spec, slot)


def spec_tokens(spec: Any, slot: int, out: Any, cap: int) -> int:
    return _out(_check_spec, "int32_t", lib.ws_spec_tokens, spec, slot, out, cap)


def spec_draft_n_tokens(spec: Any, slot: int) -> int:
    return _out(_check_spec, "int32_t", lib.ws_spec_draft_n_tokens, spec, slot)


def spec_draft_offset(spec: Any, slot: int) -> int:
    return _out(_check_spec, "int32_t", lib.ws_spec_draft_offset, spec, slot)


def spec_prefill(spec: Any, slot: int, tokens: Any, n: int, sp: Any, with_draft: bool) -> int:
    return _out(_check_spec, "int32_t", lib.ws_spec_prefill, spec, slot, tokens, n, sp,
                int(with_draft))


def spec_step(spec: Any, slot: int, sp: Any, pp: Any, max_new: int, out: Any, cap: int) -> int:
    return _out(_check_spec, "int32_t", lib.ws_spec_step, spec, slot, sp, pp, max_new, out, cap)


def spec_step_batch(spec: Any, n: int, slots: Any, sps: Any, pps: Any, max_new: Any, out: Any,
                    n_out: Any, n_drafted: Any) -> None:
    _check_spec(lib.ws_spec_step_batch(spec, n, slots, sps, pps, max_new, out, n_out, n_drafted),
                spec)


def spec_step_multi(spec: Any, slots: Any, sps: Any, n: int, out: Any) -> None:
    _check_spec(lib.ws_spec_step_multi(spec, slots, sps, n, out), spec)


def spec_logprobs(spec: Any, slot: int, ids: Any, lps: Any, cap: int) -> tuple[int, int]:
    rows, top = ffi.new("int32_t *"), ffi.new("int32_t *")
    _check_spec(lib.ws_spec_logprobs(spec, slot, ids, lps, cap, rows, top), spec)
    return int(rows[0]), int(top[0])


def spec_commit(spec: Any, slot: int) -> None:
    _check_spec(lib.ws_spec_commit(spec, slot), spec)


def spec_truncate(spec: Any, slot: int, n: int) -> None:
    _check_spec(lib.ws_spec_truncate(spec, slot, n), spec)


def spec_clear(spec: Any, slot: int) -> None:
    _check_spec(lib.ws_spec_clear(spec, slot), spec)


def spec_draft_reset(spec: Any, slot: int, offset: int) -> None:
    _check_spec(lib.ws_spec_draft_reset(spec, slot, offset), spec)


def spec_draft_sync(spec: Any, slot: int) -> int:
    return _out(_check_spec, "int32_t", lib.ws_spec_draft_sync, spec, slot)


def spec_prefill_chunk(spec: Any, slot: int, tokens: Any, n: int, with_draft: bool) -> None:
    _check_spec(lib.ws_spec_prefill_chunk(spec, slot, tokens, n, int(with_draft)), spec)


def spec_draft_catch_up(spec: Any, slot: int, max_tokens: int) -> tuple[int, int]:
    done, left = ffi.new("int32_t *"), ffi.new("int32_t *")
    _check_spec(lib.ws_spec_draft_catch_up(spec, slot, max_tokens, done, left), spec)
    return int(done[0]), int(left[0])


def spec_counters_get(spec: Any, slot: int, out: Any) -> None:
    _check_spec(lib.ws_spec_counters_get(spec, slot, out), spec)


def spec_state_size(spec: Any, slot: int) -> int:
    return _out(_check_spec, "size_t", lib.ws_spec_state_size, spec, slot)


def spec_state_get(spec: Any, slot: int, buf: Any, cap: int) -> int:
    return _out(_check_spec, "size_t", lib.ws_spec_state_get, spec, slot, buf, cap)


def spec_state_set(spec: Any, slot: int, buf: Any, length: int) -> int:
    return _out(_check_spec, "size_t", lib.ws_spec_state_set, spec, slot, buf, length)


def spec_slot_state_prepare(spec: Any, slot: int) -> tuple[int, int]:
    t, d = ffi.new("size_t *"), ffi.new("size_t *")
    _check_spec(lib.ws_spec_slot_state_prepare(spec, slot, t, d), spec)
    return int(t[0]), int(d[0])


def spec_slot_state_get(spec: Any, slot: int, tbuf: Any, tcap: int, dbuf: Any,
                        dcap: int) -> tuple[int, int]:
    t, d = ffi.new("size_t *"), ffi.new("size_t *")
    _check_spec(lib.ws_spec_slot_state_get(spec, slot, tbuf, tcap, t, dbuf, dcap, d), spec)
    return int(t[0]), int(d[0])


def spec_slot_state_set(spec: Any, slot: int, header: Any, header_len: int, tokens: Any,
                        tokens_len: int, kv: Any, kv_len: int, dbuf: Any, dlen: int,
                        draft_offset: int) -> tuple[bool, str]:
    """(draft state loaded, why it was refused: "" when it was loaded or absent)."""
    loaded = ffi.new("int *")
    _check_spec(lib.ws_spec_slot_state_set(spec, slot, header, header_len, tokens, tokens_len,
                                           kv, kv_len, dbuf, dlen, draft_offset, loaded), spec)
    if loaded[0] or dbuf == ffi.NULL:
        return bool(loaded[0]), ""
    return False, ffi.string(lib.ws_spec_last_error(spec)).decode("utf-8", "replace")


def spm_init(blob: bytes, ends: Any, scores: Any, byte_ids: Any, n_tokens: int) -> Any:
    out = ffi.new("ws_spm **")
    _check(lib.ws_spm_init(blob, ffi.from_buffer("uint64_t[]", ends),
                           ffi.from_buffer("float[]", scores),
                           ffi.from_buffer("int32_t[]", byte_ids), n_tokens, out))
    return out[0]


def spm_free(spm: Any) -> None:
    lib.ws_spm_free(spm)


def spm_encode(spm: Any, text: bytes, out: Any) -> int:
    """Ids of UTF-8 text into the int32 array out (len(text) entries); their count.
    The call does not hold the GIL."""
    n = ffi.new("size_t *")
    _check(lib.ws_spm_encode(spm, text, len(text), ffi.from_buffer("int32_t[]", out),
                             len(out), n))
    return int(n[0])
