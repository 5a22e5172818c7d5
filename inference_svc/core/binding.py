"""The thin 1:1 layer over the compiled cffi module.

Each function maps one C call; a non-zero status becomes a typed exception
carrying the core's message (`_check`, `_check_spec`). Most are made by `_checked`
(a call that returns only its status) or `_counted` (one that also writes one or
two numbers to trailing out-parameters); their arguments are the C call's. Set
WARMSLOT_NATIVE=asan to load the AddressSanitizer/UBSan build instead, or
WARMSLOT_NATIVE=portable for the scalar build (no AVX2; the same bits), or
WARMSLOT_NATIVE=avx2 for the AVX2 build on a machine whose release build uses AVX-512.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from . import header
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


def _checked(check: Callable[[int, Any], None], fn: Callable[..., int]) -> Callable[..., None]:
    """The wrapper of a C call `fn(handle, *args)` that returns only its status."""
    def call(handle: Any, *args: Any) -> None:
        check(fn(handle, *args), handle)
    return call


def _counted(check: Callable[[int, Any], None], ctype: str,
             fn: Callable[..., int]) -> Callable[..., int]:
    """The wrapper of a C call `fn(handle, *args, out)` that writes one `ctype` to out."""
    def call(handle: Any, *args: Any) -> int:
        return _out(check, ctype, fn, handle, *args)
    return call


def _counted_pair(check: Callable[[int, Any], None], ctype: str,
                  fn: Callable[..., int]) -> Callable[..., tuple[int, int]]:
    """The wrapper of a C call `fn(handle, *args, out1, out2)` writing two `ctype`s."""
    def call(handle: Any, *args: Any) -> tuple[int, int]:
        a, b = ffi.new(f"{ctype} *"), ffi.new(f"{ctype} *")
        check(fn(handle, *args, a, b), handle)
        return int(a[0]), int(b[0])
    return call


def _created(ctype: str, fn: Callable[..., int], *args: Any) -> Any:
    """fn(*args, out) for a C constructor that writes a new `ctype *` to out."""
    out = ffi.new(f"{ctype} **")
    _check(fn(*args, out))
    return out[0]


def model_init(hparams: Any, weights: Any) -> Any:
    return _created("ws_model", lib.ws_model_init, hparams, weights)


def context_init(model: Any, params: Any) -> Any:
    return _created("ws_context", lib.ws_context_init, model, params)


# the calls that cannot fail
model_free = lib.ws_model_free
context_free = lib.ws_context_free
context_default_params = lib.ws_context_default_params
context_kv_bytes = lib.ws_context_kv_bytes
fp16_from_fp32 = lib.ws_fp16_from_fp32
fp32_from_fp16 = lib.ws_fp32_from_fp16
spec_free = lib.ws_spec_free
spm_free = lib.ws_spm_free


def _kv_types() -> dict[str, int]:
    """The compiled core's KV cache types (ws_kv_type): name -> value, in value order."""
    types = {}
    for value in range(int(lib.WS_KV_N_TYPES)):
        name = lib.ws_kv_type_name(value)
        if name == ffi.NULL:
            raise ImportError(f"the core names no KV type {value} below WS_KV_N_TYPES")
        types[ffi.string(name).decode("ascii")] = value
    return types


def _check_header() -> None:
    """The build loaded has the header's values (a build older than the header, or a
    header the reader misreads, refuses to import rather than mis-encode states)."""
    stale = [f"{name} = {getattr(lib, name)} in the build, {value} in the header"
             for name, value in header.CONSTANTS.items()
             if hasattr(lib, name) and int(getattr(lib, name)) != value]
    if _kv_types() != header.KV_TYPES:
        stale.append(f"KV types {_kv_types()} in the build, {header.KV_TYPES} in the header")
    if stale:
        raise ImportError(f"the native core ({NATIVE_VARIANT}) differs from {header.HEADER}: "
                          + "; ".join(stale) + ": rebuild it (`make native`)")


_check_header()
# the one list of KV types: the core's own (native/warmslot.h), as the build has it
KV_TYPES: dict[str, int] = header.KV_TYPES


def kernel_path() -> str:
    """The matrix-product kernels the loaded build compiled (instruction set, tile shape)."""
    return ffi.string(lib.ws_kernel_path()).decode("ascii")


def kv_type_bytes(kv_type: int, n: int) -> int:
    """Bytes n values of a KV type take (0: not a whole number of its blocks)."""
    return int(lib.ws_kv_type_bytes(kv_type, n))


def context_kv_bytes_needed(model: Any, params: Any) -> int:
    """The KV bytes a context of these params would allocate for the model."""
    out = ffi.new("uint64_t *")
    _check(lib.ws_context_kv_bytes_needed(model, params, out))
    return int(out[0])


def spec_lookup(toks: Any, n: int, min_match: int, k: int, drafts: Any) -> int:
    """ws_spec_lookup: the lookup drafter's proposals for toks[0..n) into drafts."""
    out = ffi.new("int32_t *")
    status = lib.ws_spec_lookup(toks, n, min_match, k, drafts, out)
    if status != 0:
        raise error_for_status(status, f"lookup of {k} tokens after a match of >= "
                                       f"{min_match} in {n} tokens is out of range")
    return int(out[0])


def spm_init(blob: bytes, ends: Any, scores: Any, byte_ids: Any, n_tokens: int) -> Any:
    out = ffi.new("ws_spm **")
    _check(lib.ws_spm_init(blob, ffi.from_buffer("uint64_t[]", ends),
                           ffi.from_buffer("float[]", scores),
                           ffi.from_buffer("int32_t[]", byte_ids), n_tokens, out))
    return out[0]


def spm_encode(spm: Any, text: bytes, out: Any) -> int:
    """Ids of UTF-8 text into the int32 array out (len(text) entries); their count.
    The call does not hold the GIL."""
    n = ffi.new("size_t *")
    _check(lib.ws_spm_encode(spm, text, len(text), ffi.from_buffer("int32_t[]", out),
                             len(out), n))
    return int(n[0])


# ---- speculative decoding (ws_spec_*) ----

def _check_spec(status: int, spec: Any) -> None:
    if status != 0:
        ptr = lib.ws_spec_last_error(spec)
        msg = ffi.string(ptr).decode("utf-8", "replace") if ptr != ffi.NULL else ""
        raise error_for_status(status, msg)


# the calls that return a status only, then those writing one or two numbers too
decode = _checked(_check, lib.ws_decode)
decode_multi = _checked(_check, lib.ws_decode_multi)
decode_ex = _checked(_check, lib.ws_decode_ex)
slot_truncate = _checked(_check, lib.ws_slot_truncate)
slot_clear = _checked(_check, lib.ws_slot_clear)
spec_check_params = _checked(_check_spec, lib.ws_spec_check_params)
spec_seed = _checked(_check_spec, lib.ws_spec_seed)
spec_commit = _checked(_check_spec, lib.ws_spec_commit)
spec_truncate = _checked(_check_spec, lib.ws_spec_truncate)
spec_clear = _checked(_check_spec, lib.ws_spec_clear)
spec_set_head = _checked(_check_spec, lib.ws_spec_set_head)
spec_head_status = _checked(_check_spec, lib.ws_spec_head_status)
spec_draft_reset = _checked(_check_spec, lib.ws_spec_draft_reset)
spec_counters_get = _checked(_check_spec, lib.ws_spec_counters_get)
spec_prefill_chunk = _checked(_check_spec, lib.ws_spec_prefill_chunk)
spec_step_batch = _checked(_check_spec, lib.ws_spec_step_batch)
spec_step_multi = _checked(_check_spec, lib.ws_spec_step_multi)
slot_keep_min = _counted(_check, "int32_t", lib.ws_slot_keep_min)
slot_n_tokens = _counted(_check, "int32_t", lib.ws_slot_n_tokens)
slot_tokens = _counted(_check, "int32_t", lib.ws_slot_tokens)
slot_state_size = _counted(_check, "size_t", lib.ws_slot_state_size)
slot_state_get = _counted(_check, "size_t", lib.ws_slot_state_get)
slot_state_set = _counted(_check, "size_t", lib.ws_slot_state_set)
slot_state_set_parts = _counted(_check, "size_t", lib.ws_slot_state_set_parts)
spec_n_tokens = _counted(_check_spec, "int32_t", lib.ws_spec_n_tokens)
spec_tokens = _counted(_check_spec, "int32_t", lib.ws_spec_tokens)
spec_draft_n_tokens = _counted(_check_spec, "int32_t", lib.ws_spec_draft_n_tokens)
spec_draft_offset = _counted(_check_spec, "int32_t", lib.ws_spec_draft_offset)
spec_draft_sync = _counted(_check_spec, "int32_t", lib.ws_spec_draft_sync)
spec_prefill = _counted(_check_spec, "int32_t", lib.ws_spec_prefill)
spec_step = _counted(_check_spec, "int32_t", lib.ws_spec_step)
spec_state_size = _counted(_check_spec, "size_t", lib.ws_spec_state_size)
spec_state_get = _counted(_check_spec, "size_t", lib.ws_spec_state_get)
spec_state_set = _counted(_check_spec, "size_t", lib.ws_spec_state_set)
spec_logprobs = _counted_pair(_check_spec, "int32_t", lib.ws_spec_logprobs)
spec_draft_catch_up = _counted_pair(_check_spec, "int32_t", lib.ws_spec_draft_catch_up)
spec_slot_state_prepare = _counted_pair(_check_spec, "size_t", lib.ws_spec_slot_state_prepare)


def spec_init(target: Any, draft: Any) -> Any:
    out = ffi.new("ws_spec **")
    status = lib.ws_spec_init(target, draft, out)
    if status != 0:
        try:
            _check_spec(status, out[0] if out[0] != ffi.NULL else ffi.NULL)
        finally:
            lib.ws_spec_free(out[0])
    return out[0]


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
