"""Random-weight `warmslot-head` GGUF files for a target model (docs/formats.md)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from inference_svc.core.gguf_file import load_gguf

ARCH = "warmslot-head"


def write_head(path: Path, target: Path, k: int, n_ff: int = 0, seed: int = 0,
               matrix_type: str = "f16", fingerprint: str | None = None,
               token_ids: np.ndarray | None = None, scale: float = 1.0,
               echo: bool = False) -> Path:
    """A head for `target` (its fingerprint, unless `fingerprint` says another) reading
    out k tokens (the first k ids, or `token_ids`), with random weights; matrices
    "f16" or "q8_0". `scale` multiplies the readout (large: confident drafts).
    echo: a head whose prediction is the hidden state it is given (fc = [0 | I], no
    attention or FFN output) read out by the target's own output_norm and output over
    the whole vocabulary: the pair (h_{n-1}, e_{x_n}) drafts the target's argmax after
    x_{n-1}, i.e. x_n again, so a target that repeats a token accepts its drafts."""
    content = load_gguf(target)
    try:
        hp = content.hparams
        fp = content.fingerprint if fingerprint is None else fingerprint
        if echo:
            k = hp.n_vocab
            t_out = content.tensors.get("output.weight", content.tensors["token_embd.weight"])
            echo_out = t_out.dequantize()
            echo_norm = content.tensors["output_norm.weight"].dequantize()
    finally:
        content.close()
    d, n_ff = hp.n_embd, n_ff or hp.n_ff
    rng = np.random.default_rng(seed)
    ids = np.arange(k, dtype=np.int32) if token_ids is None or echo else token_ids.astype(
        np.int32)

    def mat(rows: int, cols: int, s: float = 1.0) -> np.ndarray:
        return (s * rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    hd = d // hp.n_head
    tensors = {
        "fc.weight": mat(d, 2 * d),
        "blk.0.attn_norm.weight": norm(),
        "blk.0.attn_q.weight": mat(hp.n_head * hd, d),
        "blk.0.attn_k.weight": mat(hp.n_head_kv * hd, d),
        "blk.0.attn_v.weight": mat(hp.n_head_kv * hd, d),
        "blk.0.attn_output.weight": mat(d, d),
        "blk.0.ffn_norm.weight": norm(),
        "blk.0.ffn_gate.weight": mat(n_ff, d),
        "blk.0.ffn_up.weight": mat(n_ff, d),
        "blk.0.ffn_down.weight": mat(d, n_ff),
        "output_norm.weight": norm(),
        "output.weight": mat(int(ids.size), d, scale),
    }
    if echo:
        tensors["fc.weight"] = np.concatenate([np.zeros((d, d), np.float32),
                                               np.eye(d, dtype=np.float32)], 1)
        tensors["blk.0.attn_output.weight"][:] = 0.0
        tensors["blk.0.ffn_down.weight"][:] = 0.0
        tensors["output_norm.weight"] = echo_norm
        tensors["output.weight"] = echo_out
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("test head")
    p = ARCH + "."
    w.add_string(p + "target_fingerprint", fp)
    w.add_uint32(p + "embedding_length", d)
    w.add_uint32(p + "feed_forward_length", n_ff)
    w.add_uint32(p + "attention.head_count", hp.n_head)
    w.add_uint32(p + "attention.head_count_kv", hp.n_head_kv)
    w.add_float32(p + "rope.freq_base", hp.rope_theta)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", hp.rms_eps)
    w.add_uint32(p + "context_length", hp.n_ctx_train)
    w.add_array(p + "token_ids", [int(x) for x in ids])
    qtype = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[
        matrix_type]
    for name, arr in tensors.items():
        if arr.ndim == 1:
            w.add_tensor(name, arr)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
