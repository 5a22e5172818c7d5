"""The feature head's GGUF (HEAD_SPEC): write from nn.Linear-layout arrays, read back.

Matrices Q8_0, norms F32, architecture ``warmslot-head``; metadata under the
``warmslot-head.`` prefix, the readout vocabulary as the int32 array ``token_ids``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf_io import dequantized, f32_value
from llama_config import LlamaConfig

ARCH = "warmslot-head"
NORMS = ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight")
# GGUF name -> (rows, cols) in nn.Linear layout, as functions of d, ffn, kv width, K
SHAPES = {
    "fc.weight": lambda d, f, kv, k: (d, 2 * d),
    "blk.0.attn_norm.weight": lambda d, f, kv, k: (d,),
    "blk.0.attn_q.weight": lambda d, f, kv, k: (d, d),
    "blk.0.attn_k.weight": lambda d, f, kv, k: (kv, d),
    "blk.0.attn_v.weight": lambda d, f, kv, k: (kv, d),
    "blk.0.attn_output.weight": lambda d, f, kv, k: (d, d),
    "blk.0.ffn_norm.weight": lambda d, f, kv, k: (d,),
    "blk.0.ffn_gate.weight": lambda d, f, kv, k: (f, d),
    "blk.0.ffn_up.weight": lambda d, f, kv, k: (f, d),
    "blk.0.ffn_down.weight": lambda d, f, kv, k: (d, f),
    "output_norm.weight": lambda d, f, kv, k: (d,),
    "output.weight": lambda d, f, kv, k: (k, d),
}


@dataclass(frozen=True)
class HeadFile:
    cfg: LlamaConfig  # n_vocab = K; n_layer = 1
    fingerprint: str
    token_ids: np.ndarray  # (K,) int32
    tensors: dict[str, np.ndarray]  # float32, nn.Linear layout (rows, cols)
    metadata: dict[str, object]


def expected_shapes(cfg: LlamaConfig, k: int) -> dict[str, tuple[int, ...]]:
    kv = cfg.n_head_kv * cfg.head_dim
    return {name: f(cfg.n_embd, cfg.n_ff, kv, k) for name, f in SHAPES.items()}


def write_head(path: Path, target: LlamaConfig, fingerprint: str, token_ids: np.ndarray,
               tensors: dict[str, np.ndarray], name: str) -> None:
    """Write atomically (a temporary file renamed into place)."""
    ids = np.asarray(token_ids, dtype=np.int32)
    if len(set(ids.tolist())) != len(ids) or ids.min() < 0 or ids.max() >= target.n_vocab:
        raise ValueError("token_ids must be distinct ids of the target's vocabulary")
    shapes = expected_shapes(target, len(ids))
    if set(tensors) != set(shapes):
        raise ValueError(f"tensor names differ: {sorted(set(tensors) ^ set(shapes))}")
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    p = ARCH + "."
    w.add_string(p + "target_fingerprint", fingerprint)
    w.add_uint32(p + "embedding_length", target.n_embd)
    w.add_uint32(p + "feed_forward_length", target.n_ff)
    w.add_uint32(p + "attention.head_count", target.n_head)
    w.add_uint32(p + "attention.head_count_kv", target.n_head_kv)
    w.add_float32(p + "rope.freq_base", target.rope_base)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", target.norm_eps)
    w.add_uint32(p + "context_length", target.n_ctx)
    w.add_key_value(p + "token_ids", [int(i) for i in ids], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.INT32)
    for tname, shape in shapes.items():
        arr = np.ascontiguousarray(tensors[tname], dtype=np.float32)
        if arr.shape != shape:
            raise ValueError(f"{tname}: shape {arr.shape}, expected {shape}")
        if tname in NORMS:
            w.add_tensor(tname, arr)
        else:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(tname, gguf.quants.quantize(arr, q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def read_head(path: Path) -> HeadFile:
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    if meta.get("general.architecture") != ARCH:
        raise ValueError(f"{path}: architecture {meta.get('general.architecture')!r}, "
                         f"expected {ARCH!r}")
    p = ARCH + "."
    ids_field = reader.fields[p + "token_ids"]
    if ids_field.types != [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]:
        raise ValueError(f"{path}: token_ids is {ids_field.types}, expected an int32 array")
    token_ids = np.asarray(meta[p + "token_ids"], dtype=np.int32)
    d = int(meta[p + "embedding_length"])
    n_head = int(meta[p + "attention.head_count"])
    cfg = LlamaConfig(
        name=str(meta.get("general.name", "")), n_vocab=len(token_ids), n_embd=d, n_layer=1,
        n_head=n_head, n_head_kv=int(meta[p + "attention.head_count_kv"]),
        n_ff=int(meta[p + "feed_forward_length"]), n_ctx=int(meta[p + "context_length"]),
        rope_base=f32_value(meta[p + "rope.freq_base"]),
        norm_eps=f32_value(meta[p + "attention.layer_norm_rms_epsilon"]))
    tensors = {t.name: dequantized(t) for t in reader.tensors}
    return HeadFile(cfg, str(meta[p + "target_fingerprint"]), token_ids, tensors, meta)
