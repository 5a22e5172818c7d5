"""GGUF export/import of the llama models, and a numpy reference forward pass.

The numpy forward reads nothing but the GGUF file, so agreement with the torch
logits proves the tensor layout, names and RoPE convention of the export.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from bpe import EOT_ID, GgufVocab
from llama_config import LlamaConfig


def write_gguf(
    path: Path,
    cfg: LlamaConfig,
    tensors: dict[str, np.ndarray],
    vocab: GgufVocab | gguf.GGUFReader,
    description: str,
    matrix_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F16,
) -> None:
    """Write a llama.cpp-compatible ``llama`` GGUF: 2-D weights in matrix_type, norms F32.

    vocab is either our own byte-level BPE vocabulary or another GGUF whose
    ``tokenizer.*`` metadata is copied unchanged (a draft for that model).
    """
    file_types = {
        gguf.GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
        gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    }
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(cfg.name)
    writer.add_description(description)
    writer.add_file_type(file_types[matrix_type])
    writer.add_context_length(cfg.n_ctx)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_block_count(cfg.n_layer)
    writer.add_feed_forward_length(cfg.n_ff)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.n_head_kv)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_vocab_size(cfg.n_vocab)
    if isinstance(vocab, gguf.GGUFReader):
        copy_tokenizer(writer, vocab)
    else:
        add_gpt2_vocab(writer, vocab)
    for name, arr in tensors.items():
        if arr.ndim == 1:
            writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        elif matrix_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float16))
        else:
            packed = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), matrix_type)
            writer.add_tensor(name, packed, raw_dtype=matrix_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_gpt2_vocab(writer: gguf.GGUFWriter, vocab: GgufVocab) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(EOT_ID)
    writer.add_eos_token_id(EOT_ID)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def copy_tokenizer(writer: gguf.GGUFWriter, source: gguf.GGUFReader) -> None:
    """Every ``tokenizer.*`` key of source, same value and type (chat template included)."""
    copy_fields(writer, source, lambda key: key.startswith("tokenizer."))


def copy_fields(writer: gguf.GGUFWriter, source: gguf.GGUFReader,
                keep: Callable[[str], bool]) -> None:
    """Every metadata key of source for which keep(key) is true, same value and type."""
    for key, field in source.fields.items():
        if not keep(key):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[1])
        else:
            writer.add_key_value(key, field.contents(), vtype)


@dataclass(frozen=True)
class GgufModel:
    cfg: LlamaConfig
    tensors: dict[str, np.ndarray]  # float32, nn.Linear layout
    metadata: dict[str, object]


def field_value(reader: gguf.GGUFReader, key: str) -> object:
    field = reader.fields[key]
    return field.contents()


def f32_value(value: object) -> float:
    """A float32 metadata value as the shortest float that round-trips (1e-05, not 9.99e-06)."""
    return float(f"{float(value):.7g}")


def read_gguf(path: Path) -> GgufModel:
    reader = gguf.GGUFReader(str(path))
    meta = {key: field_value(reader, key) for key in reader.fields if not key.startswith("GGUF.")}
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}, expected 'llama'")
    cfg = LlamaConfig(
        name=str(meta["general.name"]),
        n_vocab=int(meta["llama.vocab_size"]),
        n_embd=int(meta["llama.embedding_length"]),
        n_layer=int(meta["llama.block_count"]),
        n_head=int(meta["llama.attention.head_count"]),
        n_head_kv=int(meta["llama.attention.head_count_kv"]),
        n_ff=int(meta["llama.feed_forward_length"]),
        n_ctx=int(meta["llama.context_length"]),
        rope_base=f32_value(meta["llama.rope.freq_base"]),
        norm_eps=f32_value(meta["llama.attention.layer_norm_rms_epsilon"]),
    )
    tensors = {t.name: dequantized(t) for t in reader.tensors}
    return GgufModel(cfg, tensors, meta)


def dequantized(tensor: gguf.ReaderTensor) -> np.ndarray:
    """Any GGML type (F16, Q8_0, Q4_1, ...) as float32 in nn.Linear layout (rows, cols)."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    arr = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return np.array(arr.reshape(shape), dtype=np.float32)  # a writable copy


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, base: float) -> np.ndarray:
    """x (T, H, D): rotate adjacent pairs by pos * base^(-2i/D) (complex form)."""
    t, _, d = x.shape
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.arange(t, dtype=np.float64)[:, None] * inv_freq[None, :]
    rot = np.exp(1j * angles)[:, None, :]
    pairs = x[..., 0::2].astype(np.float64) + 1j * x[..., 1::2].astype(np.float64)
    out = pairs * rot
    return np.stack((out.real, out.imag), axis=-1).reshape(x.shape).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q (T, H, D), k/v (T, Hkv, D) -> (T, H*D), causal, scale 1/sqrt(D)."""
    t, n_head, d = q.shape
    group = n_head // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    mask = np.triu(np.ones((t, t), dtype=bool), k=1)
    scores = np.where(mask[None], -np.inf, scores)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v).reshape(t, n_head * d)


def numpy_forward(model: GgufModel, tokens: list[int]) -> np.ndarray:
    """Logits (T, n_vocab) for tokens at positions 0..T-1, straight from GGUF tensors."""
    cfg, w = model.cfg, model.tensors
    t, hd = len(tokens), cfg.head_dim
    x = w["token_embd.weight"][np.asarray(tokens)]
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        h = rms_norm(x, w[p + "attn_norm.weight"], cfg.norm_eps)
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(t, cfg.n_head, hd), cfg.rope_base)
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(t, cfg.n_head_kv, hd), cfg.rope_base)
        v = (h @ w[p + "attn_v.weight"].T).reshape(t, cfg.n_head_kv, hd)
        x = x + attention(q, k, v) @ w[p + "attn_output.weight"].T
        h = rms_norm(x, w[p + "ffn_norm.weight"], cfg.norm_eps)
        gate = silu(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)
        x = x + gate @ w[p + "ffn_down.weight"].T
    x = rms_norm(x, w["output_norm.weight"], cfg.norm_eps)
    out = w.get("output.weight", w["token_embd.weight"])
    return x @ out.T
