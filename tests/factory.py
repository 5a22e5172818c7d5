"""Random llama- or gemma3-architecture GGUF models for the tests, written with the gguf
writer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from inference_svc.core.tokenizer import unicode_to_byte


@dataclass(frozen=True)
class Shape:
    n_vocab: int = 300
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 96
    n_ctx: int = 256
    tied: bool = False
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    # f32 | f16 | bf16 | a quantized type: q8_0, q4_k... (QUANT_TYPES) | mixed (every
    # supported type, in turn over the matrices: widths must be multiples of 256)
    dtype: str = "f32"
    # "llama" or "gemma3" (then head_dim may differ from n_embd / n_head, and every
    # layer but each 6th attends to the last n_swa positions only)
    arch: str = "llama"
    head_dim: int = 0          # 0: n_embd // n_head
    n_swa: int = 0

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


def byte_tokens() -> list[str]:
    table = unicode_to_byte()
    by_byte = {b: c for c, b in table.items()}
    return [by_byte[b] for b in range(256)]


def tokenizer_vocab(n_vocab: int, seed: int = 0) -> tuple[list[str], list[str], list[int]]:
    """256 byte tokens, merges of existing tokens up to n_vocab-1, then <|endoftext|>."""
    if n_vocab < 257:
        raise ValueError("a byte-level vocabulary needs at least 257 tokens")
    rng = np.random.default_rng(seed)
    tokens = byte_tokens()
    seen = set(tokens)
    merges: list[str] = []
    common = list("etaoinshrdlu") + [byte_tokens()[32]]
    while len(tokens) < n_vocab - 1:
        if rng.random() < 0.5:
            a = tokens[int(rng.integers(len(tokens)))]
        else:
            a = str(rng.choice(common))
        b = str(rng.choice(common))
        if a + b in seen:
            continue
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        seen.add(a + b)
    tokens.append("<|endoftext|>")
    types = [1] * (len(tokens) - 1) + [3]
    return tokens, merges, types


def random_weights(shape: Shape, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hd = shape.hd

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((shape.n_vocab, shape.n_embd)).astype(np.float32)}
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        w[b + "attn_norm.weight"] = norm(shape.n_embd)
        w[b + "attn_q.weight"] = mat(shape.n_head * hd, shape.n_embd)
        w[b + "attn_k.weight"] = mat(shape.n_head_kv * hd, shape.n_embd)
        w[b + "attn_v.weight"] = mat(shape.n_head_kv * hd, shape.n_embd)
        w[b + "attn_output.weight"] = mat(shape.n_embd, shape.n_head * hd)
        w[b + "ffn_norm.weight"] = norm(shape.n_embd)
        w[b + "ffn_gate.weight"] = mat(shape.n_ff, shape.n_embd)
        w[b + "ffn_up.weight"] = mat(shape.n_ff, shape.n_embd)
        w[b + "ffn_down.weight"] = mat(shape.n_embd, shape.n_ff)
        if shape.arch == "gemma3":
            w[b + "attn_q_norm.weight"] = norm(hd)
            w[b + "attn_k_norm.weight"] = norm(hd)
            w[b + "post_attention_norm.weight"] = norm(shape.n_embd)
            w[b + "post_ffw_norm.weight"] = norm(shape.n_embd)
    w["output_norm.weight"] = norm(shape.n_embd)
    if not shape.tied:
        w["output.weight"] = mat(shape.n_vocab, shape.n_embd)
    return w


# quantized types the core supports: the first four through gguf's quantizer, the
# k-quants (which gguf cannot quantize) as random blocks with bounded scales
QUANT_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k")
# bytes per 256-element block of the k-quants, and where their f16 scales sit
_K_BLOCKS = {"q4_k": (144, (0, 2)), "q5_k": (176, (0, 2)), "q6_k": (210, (208,))}


def random_k_blocks(dtype: str, rows: int, cols: int, amplitude: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Random k-quant blocks ([rows][bytes]) whose values stay within ~amplitude: random
    quants and 6-bit scales, the f16 super-block scales set to amplitude over the largest
    product of a quant and a scale."""
    size, scale_at = _K_BLOCKS[dtype]
    if cols % 256:
        raise ValueError(f"{dtype} rows hold whole 256-element blocks, not {cols}")
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    top = 63 * 15 if dtype == "q4_k" else 63 * 31 if dtype == "q5_k" else 127 * 32
    for at in scale_at:
        d = (amplitude / top * rng.uniform(0.5, 1.0, (rows, cols // 256))).astype(np.float16)
        blocks[:, :, at:at + 2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def stored_bytes(arr: np.ndarray, dtype: str,
                 rng: np.random.Generator | None = None) -> np.ndarray:
    """The bytes of a 2-D float array stored as a quantized type ([rows][row bytes]);
    k-quants are random blocks of the same amplitude (arr gives only the shape)."""
    if dtype in _K_BLOCKS:
        rng = rng or np.random.default_rng(0)
        return random_k_blocks(dtype, arr.shape[0], arr.shape[1], float(np.abs(arr).max()), rng)
    qtype = gguf.GGMLQuantizationType[dtype.upper()]
    return gguf.quants.quantize(arr.astype(np.float32), qtype)


def _store(writer: gguf.GGUFWriter, name: str, arr: np.ndarray, dtype: str,
           rng: np.random.Generator) -> None:
    if arr.ndim == 1 or dtype == "f32":
        writer.add_tensor(name, arr.astype(np.float32))
    elif dtype == "f16":
        writer.add_tensor(name, arr.astype(np.float16))
    elif dtype == "bf16":
        bits = (arr.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        # raw types take the tensor's bytes; the writer derives the element shape
        writer.add_tensor(name, bits.view(np.uint8).reshape(arr.shape[0], -1),
                          raw_dtype=gguf.GGMLQuantizationType.BF16)
    elif dtype in QUANT_TYPES:
        writer.add_tensor(name, stored_bytes(arr, dtype, rng),
                          raw_dtype=gguf.GGMLQuantizationType[dtype.upper()])
    else:
        raise ValueError(dtype)


def write_weights(path: Path, shape: Shape, weights: dict[str, np.ndarray], tok_seed: int,
                  name: str, arch: str = "llama") -> None:
    """A GGUF file of these weights (stored as shape.dtype) with tokenizer_vocab's
    tokenizer for (n_vocab, tok_seed)."""
    tokens, merges, types = tokenizer_vocab(shape.n_vocab, tok_seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(shape.n_ctx)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_rope_dimension_count(shape.hd)
    if shape.head_dim:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.n_swa:
        writer.add_sliding_window(shape.n_swa)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_vocab_size(shape.n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    rng = np.random.default_rng(tok_seed)
    mixed = ("q4_1", "q8_0", "q4_k", "q6_k", "q5_0", "q4_0", "q5_k", "f16", "bf16", "f32")
    n_matrices = 0
    for tname, arr in weights.items():
        dtype = shape.dtype
        if dtype == "mixed":
            dtype = mixed[n_matrices % len(mixed)]
            n_matrices += arr.ndim == 2
        _store(writer, tname, arr, dtype, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_model(path: Path, shape: Shape = Shape(), seed: int = 0,
                arch: str | None = None) -> dict[str, np.ndarray]:
    """Writes a random model; returns its F32 weights (before any F16/BF16/quantized
    storage; k-quant tensors are random blocks of the same amplitude instead)."""
    weights = random_weights(shape, seed)
    write_weights(path, shape, weights, seed, f"random-{seed}", arch or shape.arch)
    return weights
