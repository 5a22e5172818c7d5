"""Friendly classes over the binding: `Model` (weights lent to the core from the
file's memory map) and `Context` (KV cache of n_slots x n_ctx positions). Both are
context managers; a model cannot be closed while one of its contexts is open."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import binding
from .binding import ffi
from .errors import CoreMemoryError, InvalidArgumentError
from .gguf_file import ARCH_IDS, GGUFModel, HParams, load_gguf
from .handle import NativeHandle, buffer_arg, read_tokens, state_buffer
from .header import DEFAULT_KV_TYPE
from .tokenizer import Tokenizer

# KV cache element types (ws_kv_type): name -> value, from the core
KV_TYPES = binding.KV_TYPES

_LAYER_NORMS = {"attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight"}
# gemma3's extra norms
_GEMMA3_NORMS = {"attn_q_norm": "attn_q_norm.weight", "attn_k_norm": "attn_k_norm.weight",
                 "post_attn_norm": "post_attention_norm.weight",
                 "post_ffn_norm": "post_ffw_norm.weight"}
_LAYER_MATRICES = {
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Model(NativeHandle):
    """A loaded model: the matrices lent to the C core in their stored type straight
    from the file's memory map, the norm weights as small F32 copies. Closing the
    model unmaps the file."""

    _what = "model"

    def __init__(self, content: GGUFModel) -> None:
        self.content = content
        self.hparams: HParams = content.hparams
        hp = self.hparams
        self._keep: list[Any] = []
        self._buffers: list[Any] = []  # views of the file's memory map
        c_hp = ffi.new("ws_hparams *")
        for name in ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "n_rot"):
            setattr(c_hp, name, getattr(hp, name))
        c_hp.rms_eps = hp.rms_eps
        c_hp.rope_theta = hp.rope_theta
        c_hp.arch = ARCH_IDS[hp.arch]
        c_hp.head_dim = hp.key_length
        c_hp.n_swa = hp.n_swa
        c_hp.swa_period = hp.swa_period
        c_hp.rope_theta_swa = hp.rope_theta_swa
        norms = _LAYER_NORMS | (_GEMMA3_NORMS if hp.arch == "gemma3" else {})
        layers = ffi.new("ws_layer_weights[]", hp.n_layer)
        for i in range(hp.n_layer):
            for field, suffix in norms.items():
                setattr(layers[i], field, self._norm(f"blk.{i}.{suffix}"))
            for field, suffix in _LAYER_MATRICES.items():
                self._matrix(getattr(layers[i], field), f"blk.{i}.{suffix}")
        w = ffi.new("ws_weights *")
        self._matrix(w.tok_embd, "token_embd.weight")
        w.output_norm = self._norm("output_norm.weight")
        if not content.tied_output:
            self._matrix(w.output, "output.weight")
        w.layers = layers
        self._keep += [c_hp, layers, w]
        self._handle: Any = binding.model_init(c_hp, w)
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()
        self._tokenizer: Tokenizer | None = None

    @classmethod
    def load(cls, path: str | Path) -> Model:
        return cls(load_gguf(path))

    def _norm(self, name: str) -> Any:
        arr = self.content.tensors[name].dequantize()
        self._keep.append(arr)
        return ffi.cast("const float *", ffi.from_buffer("float[]", arr))

    def _matrix(self, out: Any, name: str) -> None:
        """Fills a ws_tensor with the stored tensor (no copy)."""
        t = self.content.tensors[name]
        buf = ffi.from_buffer("uint8_t[]", t.data)
        self._buffers.append(buf)
        out.data = buf
        out.type = t.type
        out.rows, out.cols = t.shape

    @property
    def fingerprint(self) -> str:
        return self.content.fingerprint

    @property
    def name(self) -> str:
        return self.content.name

    @property
    def n_vocab(self) -> int:
        return self.hparams.n_vocab

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.content.tokenizer)
        return self._tokenizer

    def kv_bytes_per_token(self, kv_type: str = DEFAULT_KV_TYPE) -> int:
        hp = self.hparams
        return 2 * hp.n_layer * hp.n_head_kv * binding.kv_type_bytes(KV_TYPES[kv_type], hp.head_dim)

    def _open_contexts(self) -> bool:
        return any(not c.closed for c in getattr(self, "_contexts", ()))

    def _free(self, handle: Any) -> None:
        binding.model_free(handle)
        for buf in self._buffers:  # give the map's exports back now, not at collection
            ffi.release(buf)
        self._buffers.clear()
        self.content.close()

    def close(self) -> None:
        if self._handle is not None and self._open_contexts():
            raise InvalidArgumentError("close the model's contexts before the model")
        super().close()

    def __del__(self) -> None:
        if not self._open_contexts():  # else the contexts still borrow the weights
            super().__del__()


class Context(NativeHandle):
    """KV cache and thread pool for n_slots independent sequences of one model."""

    _what = "context"

    def __init__(self, model: Model, n_slots: int = 1, n_ctx: int | None = None,
                 n_threads: int = 2, n_batch: int = 512, reserve_kv: bool = False,
                 kv_type: str = DEFAULT_KV_TYPE, swa_full: bool = False) -> None:
        """reserve_kv: commit the KV cache's memory now (see ws_context_params) instead
        of on first use. kv_type: "f16" (keys and values rounded to half when
        written), "f32" or "q8_0" (quantized in blocks of 32 when written); a slot's
        state can only be set into a context of its type.
        swa_full: sliding-window layers keep every position instead of a ring of their
        window (the same logits; more memory, and any prefix can be kept)."""
        if kv_type not in KV_TYPES:
            raise InvalidArgumentError(f"KV type {kv_type!r} is not one of "
                                       f"{', '.join(KV_TYPES)}")
        n_ctx = model.hparams.n_ctx_train if n_ctx is None else n_ctx
        params = binding.context_default_params()
        params.n_slots = n_slots
        params.n_ctx = n_ctx
        params.n_threads = n_threads
        params.n_batch = n_batch
        params.reserve_kv = int(reserve_kv)
        params.kv_type = KV_TYPES[kv_type]
        params.swa_full = int(swa_full)
        # the bytes the core will allocate (a sliding-window layer: its ring's rows)
        need = binding.context_kv_bytes_needed(model.handle, params)
        avail = available_memory_bytes()
        if avail is not None and need > avail:
            raise CoreMemoryError(
                f"a context of {n_slots} slots x {n_ctx} positions needs "
                f"{need / 2**20:.1f} MiB of KV cache; only {avail / 2**20:.1f} MiB is available"
            )
        self.model, self.kv_type = model, kv_type
        self.n_slots, self.n_ctx = n_slots, n_ctx
        self.n_threads, self.n_batch = n_threads, n_batch
        self._n_vocab = model.n_vocab
        self._handle: Any = binding.context_init(model.handle, params)
        model._contexts.add(self)

    def _free(self, handle: Any) -> None:
        binding.context_free(handle)

    @property
    def kv_bytes(self) -> int:
        return binding.context_kv_bytes(self.handle)

    def decode(self, slot: int, tokens: Sequence[int] | np.ndarray,
               logits_all: bool = False) -> np.ndarray:
        """Appends tokens to a slot; the last token's logits, or every token's."""
        toks = np.ascontiguousarray(tokens, dtype=np.int32)
        if toks.ndim != 1:
            raise InvalidArgumentError("tokens must be a flat sequence of ids")
        n = int(toks.shape[0])
        rows = n if logits_all else 1
        logits = np.empty((rows, self._n_vocab), dtype=np.float32)
        tok_ptr = ffi.from_buffer("int32_t[]", toks) if n else ffi.NULL
        binding.decode(self.handle, slot, tok_ptr, n, logits_all,
                       ffi.from_buffer("float[]", logits), logits.size)
        return logits if logits_all else logits[0]

    def decode_multi(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One token for each of several distinct slots in one pass; logits [n][n_vocab],
        bit-identical to decoding each alone."""
        sl = np.ascontiguousarray(slots, dtype=np.int32)
        toks = np.ascontiguousarray(tokens, dtype=np.int32)
        if sl.ndim != 1 or toks.shape != sl.shape or sl.size == 0:
            raise InvalidArgumentError("decode_multi needs as many tokens as slots (>= 1)")
        logits = np.empty((sl.size, self._n_vocab), dtype=np.float32)
        binding.decode_multi(self.handle, ffi.from_buffer("int32_t[]", sl),
                             ffi.from_buffer("int32_t[]", toks), int(sl.size),
                             ffi.from_buffer("float[]", logits), logits.size)
        return logits

    def decode_ex(self, slots: Sequence[int], segments: Sequence[Sequence[int]], *,
                  features: np.ndarray | None = None, want: Sequence[bool] | None = None,
                  logits: bool = True, hidden: bool = False,
                  kv_only: bool = False) -> tuple[np.ndarray | None, np.ndarray | None]:
        """ws_decode_ex: segments[i] appended to slots[i] in one pass. (logits of the
        wanted tokens, packed [wanted][n_vocab] or None; hidden states [tokens][n_embd]
        or None). features: a feature head's [tokens][n_embd] inputs."""
        sl = np.ascontiguousarray(slots, dtype=np.int32)
        ntok = np.ascontiguousarray([len(s) for s in segments], dtype=np.int32)
        toks = np.ascontiguousarray([t for s in segments for t in s], dtype=np.int32)
        if sl.ndim != 1 or sl.size != ntok.size or sl.size == 0 or toks.size == 0:
            raise InvalidArgumentError("decode_ex needs one non-empty segment per slot")
        io = ffi.new("ws_decode_io *")
        keep: list[Any] = []
        e = self.model.hparams.n_embd
        if features is not None:
            feats = np.ascontiguousarray(features, dtype=np.float32)
            keep.append(feats)
            io.features = ffi.cast("const float *", ffi.from_buffer("float[]", feats))
            io.features_cap = feats.size
        n_want = int(toks.size)
        if want is not None:
            flags = np.ascontiguousarray(want, dtype=np.uint8)
            keep.append(flags)
            io.want = ffi.cast("const uint8_t *", ffi.from_buffer("uint8_t[]", flags))
            n_want = int(flags.sum())
        out_l = np.empty((n_want, self._n_vocab), dtype=np.float32) if logits else None
        if out_l is not None:
            io.logits = ffi.cast("float *", ffi.from_buffer("float[]", out_l))
            io.logits_cap = out_l.size
        out_h = np.empty((toks.size, e), dtype=np.float32) if hidden else None
        if out_h is not None:
            io.hidden = ffi.cast("float *", ffi.from_buffer("float[]", out_h))
            io.hidden_cap = out_h.size
        io.kv_only = int(kv_only)
        binding.decode_ex(self.handle, int(sl.size), ffi.from_buffer("int32_t[]", sl),
                          ffi.from_buffer("int32_t[]", ntok), ffi.from_buffer("int32_t[]", toks),
                          io)
        return out_l, out_h

    def n_tokens(self, slot: int) -> int:
        return binding.slot_n_tokens(self.handle, slot)

    def tokens(self, slot: int) -> list[int]:
        return read_tokens(binding.slot_tokens, self.handle, slot, self.n_tokens(slot))

    def truncate(self, slot: int, n: int) -> None:
        binding.slot_truncate(self.handle, slot, n)

    def keep_min(self, slot: int) -> int:
        """The shortest non-empty prefix the slot can be truncated to (ws_slot_keep_min):
        0 when any can; a shorter common prefix must be re-processed from position 0."""
        return binding.slot_keep_min(self.handle, slot)

    def clear(self, slot: int) -> None:
        binding.slot_clear(self.handle, slot)

    def state_size(self, slot: int) -> int:
        return binding.slot_state_size(self.handle, slot)

    def get_state(self, slot: int) -> memoryview:
        """The slot's state (ws_slot_state_get format): a read-only view of the one
        buffer the core wrote it into."""
        size = self.state_size(slot)
        return state_buffer(size, lambda ptr: binding.slot_state_get(self.handle, slot, ptr,
                                                                     size))

    def set_state(self, slot: int, data: bytes | bytearray | memoryview) -> int:
        """Loads a slot's state; on any error the slot is left empty and usable."""
        return binding.slot_state_set(self.handle, slot, *buffer_arg(data))

    def set_state_parts(self, slot: int, header: bytes | memoryview,
                        tokens: bytes | memoryview, kv: bytes | memoryview) -> int:
        """`set_state` of header + tokens + kv without joining them into one buffer."""
        return binding.slot_state_set_parts(self.handle, slot, *buffer_arg(header),
                                            *buffer_arg(tokens), *buffer_arg(kv))


def default_threads() -> int:
    return max(1, min(2, os.cpu_count() or 1))
