"""A feature-level draft head (`warmslot-head` GGUF, docs/formats.md): read, checked
against its target, and lent to the C core as a one-layer model whose input is
fc . concat(token embedding, target hidden state) and whose readout covers the K
tokens of `token_ids`. The head borrows its target's token embedding, so the target
model must stay open while the head is."""

from __future__ import annotations

import struct
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import binding, fingerprint
from .binding import ffi
from .errors import ModelLoadError
from .gguf_file import HParams, Tensor, _field, _map, _stored_tensors, _unmap
from .gguf_parse import parse
from .handle import NativeHandle
from .model import _LAYER_MATRICES, _LAYER_NORMS, Context, Model

HEAD_ARCH = "warmslot-head"
_P = HEAD_ARCH + "."


@dataclass(frozen=True)
class HeadParams:
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    rope_theta: float
    rms_eps: float
    n_ctx: int
    target_fingerprint: str

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def _head_params(header: Any) -> HeadParams:
    n_embd = int(_field(header, _P + "embedding_length"))
    n_head = int(_field(header, _P + "attention.head_count"))
    n_head_kv = int(_field(header, _P + "attention.head_count_kv"))
    if n_embd <= 0 or n_head <= 0 or n_head_kv <= 0 or n_embd % n_head or n_head % n_head_kv:
        raise ModelLoadError(f"head widths do not fit: embedding_length {n_embd}, head_count "
                             f"{n_head}, head_count_kv {n_head_kv}")
    return HeadParams(
        n_embd=n_embd, n_ff=int(_field(header, _P + "feed_forward_length")), n_head=n_head,
        n_head_kv=n_head_kv, rope_theta=float(_field(header, _P + "rope.freq_base")),
        rms_eps=float(_field(header, _P + "attention.layer_norm_rms_epsilon")),
        n_ctx=int(_field(header, _P + "context_length")),
        target_fingerprint=str(_field(header, _P + "target_fingerprint")))


def _expected(hp: HeadParams, k: int) -> dict[str, tuple[int, ...]]:
    d, hd = hp.n_embd, hp.head_dim
    return {
        "fc.weight": (d, 2 * d), "blk.0.attn_norm.weight": (d,),
        "blk.0.attn_q.weight": (hp.n_head * hd, d), "blk.0.attn_k.weight": (hp.n_head_kv * hd, d),
        "blk.0.attn_v.weight": (hp.n_head_kv * hd, d), "blk.0.attn_output.weight": (d, d),
        "blk.0.ffn_norm.weight": (d,), "blk.0.ffn_gate.weight": (hp.n_ff, d),
        "blk.0.ffn_up.weight": (hp.n_ff, d), "blk.0.ffn_down.weight": (d, hp.n_ff),
        "output_norm.weight": (d,), "output.weight": (k, d),
    }


class Head(NativeHandle):
    """A loaded head for `target` (refused, naming both fingerprints, when it was
    trained for another model)."""

    _what = "head"

    def __init__(self, path: str | Path, target: Model) -> None:
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"head file not found: {path}")
        mapping = _map(path)
        try:
            header = parse(mapping)
            arch = header.fields.get("general.architecture")
            if arch != HEAD_ARCH:
                raise ModelLoadError(f"{path}: architecture {arch!r} is not {HEAD_ARCH!r}")
            hp = _head_params(header)
            if hp.target_fingerprint != target.fingerprint:
                raise ModelLoadError(
                    f"{path} is a head for the model of fingerprint {hp.target_fingerprint}, "
                    f"not for the loaded target {target.name} (fingerprint "
                    f"{target.fingerprint})")
            th = target.hparams
            if hp.n_embd != th.n_embd or th.arch != "llama":
                raise ModelLoadError(f"{path}: a head of width {hp.n_embd} does not fit the "
                                     f"{th.arch} target of width {th.n_embd}")
            ids = np.asarray(_field(header, _P + "token_ids"), dtype=np.int64)
            if (ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= th.n_vocab
                    or np.unique(ids).size != ids.size):
                raise ModelLoadError(f"{path}: token_ids must be distinct ids below "
                                     f"{th.n_vocab}")
            tensors = _stored_tensors(header, mapping)
            for name, shape in _expected(hp, int(ids.size)).items():
                t = tensors.get(name)
                if t is None:
                    raise ModelLoadError(f"{path}: tensor {name!r} is missing")
                if t.shape != shape:
                    raise ModelLoadError(f"{path}: tensor {name!r} has shape {t.shape}, "
                                         f"expected {shape}")
                if len(shape) == 1 and not np.isfinite(t.dequantize()).all():
                    raise ModelLoadError(f"{path}: tensor {name!r} holds NaN or infinite "
                                         "values")
        except ModelLoadError:
            _unmap(mapping)
            raise
        except (ValueError, struct.error, RecursionError, TypeError) as exc:
            _unmap(mapping)
            raise ModelLoadError(f"{path} is not a readable head GGUF file: {exc}") from exc
        self.path, self.params, self.target = path, hp, target
        self.token_ids = np.ascontiguousarray(ids, dtype=np.int32)
        self._map_obj = mapping
        self._tensors = tensors
        self._keep: list[Any] = []
        # the shape a Context of the head reads (n_vocab: the readout's K rows)
        self.hparams = HParams(n_vocab=int(ids.size), n_embd=hp.n_embd, n_layer=1,
                               n_head=hp.n_head, n_head_kv=hp.n_head_kv, n_ff=hp.n_ff,
                               n_rot=hp.head_dim, n_ctx_train=hp.n_ctx, rms_eps=hp.rms_eps,
                               rope_theta=hp.rope_theta)
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()
        self._fingerprint: str | None = None
        self._handle: Any = binding.model_init(*self._c_model(tensors))

    @property
    def n_vocab(self) -> int:
        return self.n_out

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def fingerprint(self) -> str:
        """The head's own fingerprint (its weights and shape): a draft sidecar holding
        the head's KV restores only into the same head."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint.compute(self.hparams, self._tensors)
        return self._fingerprint

    def close(self) -> None:
        if self._handle is not None and any(not c.closed for c in self._contexts):
            raise ModelLoadError("close the head's contexts before the head")
        super().close()

    @property
    def n_out(self) -> int:
        """K: the tokens the head reads out."""
        return int(self.token_ids.size)

    def _c_model(self, tensors: dict[str, Tensor]) -> tuple[Any, Any]:
        hp = self.params
        c_hp = ffi.new("ws_hparams *")
        c_hp.n_vocab, c_hp.n_embd, c_hp.n_layer = self.n_out, hp.n_embd, 1
        c_hp.n_head, c_hp.n_head_kv, c_hp.n_ff = hp.n_head, hp.n_head_kv, hp.n_ff
        c_hp.n_rot, c_hp.rms_eps, c_hp.rope_theta = hp.head_dim, hp.rms_eps, hp.rope_theta
        layer = ffi.new("ws_layer_weights[]", 1)
        for field, suffix in _LAYER_NORMS.items():
            setattr(layer[0], field, self._norm(tensors[f"blk.0.{suffix}"]))
        for field, suffix in _LAYER_MATRICES.items():
            self._matrix(getattr(layer[0], field), tensors[f"blk.0.{suffix}"])
        w = ffi.new("ws_weights *")
        self._matrix(w.tok_embd, self.target.content.tensors["token_embd.weight"])
        self._matrix(w.fc, tensors["fc.weight"])
        self._matrix(w.output, tensors["output.weight"])
        w.output_norm = self._norm(tensors["output_norm.weight"])
        w.layers = layer
        self._keep += [c_hp, layer, w]
        return c_hp, w

    def _norm(self, t: Tensor) -> Any:
        arr = t.dequantize()
        self._keep.append(arr)
        return ffi.cast("const float *", ffi.from_buffer("float[]", arr))

    def _matrix(self, out: Any, t: Tensor) -> None:
        buf = ffi.from_buffer("uint8_t[]", t.data)
        self._keep.append(buf)
        out.data = buf
        out.type = t.type
        out.rows, out.cols = t.shape

    def _free(self, handle: Any) -> None:
        binding.model_free(handle)
        self._keep.clear()
        self._tensors = {}
        _unmap(self._map_obj)
