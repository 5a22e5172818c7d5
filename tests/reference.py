"""A numpy reference forward pass of the llama and gemma3 decoders (float64, short and
readable)."""

from __future__ import annotations

import numpy as np

from inference_svc.core.gguf_file import HParams


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, n_rot: int, theta: float) -> np.ndarray:
    """llama.cpp 'normal' RoPE: pairs (2i, 2i+1) of each head turn by pos * theta^(-2i/n_rot)."""
    # x: [T, heads, head_dim]
    freqs = theta ** (-np.arange(0, n_rot, 2) / n_rot)          # [n_rot/2]
    ang = positions[:, None] * freqs[None, :]                    # [T, n_rot/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    out[..., 0:n_rot:2] = a * cos - b * sin
    out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def rope_neox(x: np.ndarray, positions: np.ndarray, n_rot: int, theta: float) -> np.ndarray:
    """NeoX RoPE (llama.cpp's for gemma3): dims (i, i + n_rot/2) turn by pos * theta^(-2i/n_rot)."""
    half = n_rot // 2
    freqs = theta ** (-np.arange(0, n_rot, 2) / n_rot)
    ang = positions[:, None] * freqs[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    a, b = x[..., :half], x[..., half:n_rot]
    out[..., :half] = a * cos - b * sin
    out[..., half:n_rot] = a * sin + b * cos
    return out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


class _Float64(dict):
    """Read access to F32 weights as float64, widened on each use."""

    def __getitem__(self, key: str) -> np.ndarray:
        return super().__getitem__(key).astype(np.float64)

    def get(self, key: str, default: np.ndarray | None = None) -> np.ndarray | None:
        return self[key] if key in self else default


def roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf (halves away from zero) of float32 values."""
    a = np.abs(v)
    f = np.floor(a)
    return np.copysign(np.where(a - f >= np.float32(0.5), f + 1, f), v).astype(np.float32)


def q8_0_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_0_ref of float32 values in blocks of 32 along the last
    axis: (d as float16 [..., n/32], q as int8 [..., n]); d = amax / 127, q = round(x *
    (1 / d)) with the float32 d."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = roundf(blocks * inv[..., None]).astype(np.int8)
    return d.astype(np.float16), q.reshape(x.shape)


def kv_as_stored(x: np.ndarray, kv_type: str) -> np.ndarray:
    """Keys or values ([..., head_dim]) as a KV cache of `kv_type` holds them: an f16
    cache rounds the core's float32 values to float16 (nearest even) when it writes
    them, a q8_0 cache keeps d * q of each block of 32 (q8_0_quantize)."""
    if kv_type == "f32":
        return x
    if kv_type == "q8_0":
        d, q = q8_0_quantize(x)
        blocks = q.reshape(*x.shape[:-1], -1, 32).astype(np.float64)
        return (blocks * d.astype(np.float64)[..., None]).reshape(x.shape)
    return x.astype(np.float32).astype(np.float16).astype(np.float64)


def forward(hp: HParams, w: dict[str, np.ndarray], tokens: list[int],
            kv_type: str = "f16") -> np.ndarray:
    """Logits [T, n_vocab] of a whole sequence decoded from position 0 with a KV cache
    of `kv_type` ("f16", the core's default, or "f32"). Weights are widened to float64
    one at a time (a real model's would not fit at once)."""
    if hp.arch == "gemma3":
        return forward_gemma3(hp, w, tokens, kv_type)
    w = _Float64(w)
    T, hd = len(tokens), hp.head_dim
    pos = np.arange(T, dtype=np.float64)
    x = w["token_embd.weight"][tokens]                          # [T, E]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    group = hp.n_head // hp.n_head_kv
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        h = rmsnorm(x, w[b + "attn_norm.weight"], hp.rms_eps)
        q = (h @ w[b + "attn_q.weight"].T).reshape(T, hp.n_head, hd)
        k = (h @ w[b + "attn_k.weight"].T).reshape(T, hp.n_head_kv, hd)
        v = (h @ w[b + "attn_v.weight"].T).reshape(T, hp.n_head_kv, hd)
        q, k = rope(q, pos, hp.n_rot, hp.rope_theta), rope(k, pos, hp.n_rot, hp.rope_theta)
        k, v = kv_as_stored(k, kv_type), kv_as_stored(v, kv_type)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        att = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask  # [H, T, T]
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", att, v).reshape(T, hp.n_head * hd)
        x = x + o @ w[b + "attn_output.weight"].T
        h = rmsnorm(x, w[b + "ffn_norm.weight"], hp.rms_eps)
        g, u = h @ w[b + "ffn_gate.weight"].T, h @ w[b + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[b + "ffn_down.weight"].T
    # the output matrix is widened in blocks of rows: Gemma's 262144 x 640 at once would
    # take 1.3 GB in float64
    name = "output.weight" if "output.weight" in w else "token_embd.weight"
    out32 = dict.__getitem__(w, name)
    h = rmsnorm(x, w["output_norm.weight"], hp.rms_eps)
    return np.concatenate([h @ out32[r:r + 32768].astype(np.float64).T
                           for r in range(0, out32.shape[0], 32768)], axis=1)


def forward_gemma3(hp: HParams, w: dict[str, np.ndarray], tokens: list[int],
                   kv_type: str = "f16") -> np.ndarray:
    """The gemma3 decoder: embedding times sqrt(n_embd), per-head RMSNorm of q and k,
    NeoX RoPE (local layers with base rope_theta_swa), attention over the last n_swa
    positions in local layers, post-attention and post-FFN norms, GeGLU, tied output."""
    w = _Float64(w)
    T, hd = len(tokens), hp.head_dim
    pos = np.arange(T, dtype=np.float64)
    # the core rounds the scale to float, as llama.cpp does
    x = w["token_embd.weight"][tokens] * float(np.float32(np.sqrt(np.float32(hp.n_embd))))
    causal = np.triu(np.full((T, T), -np.inf), 1)
    dist = pos[:, None] - pos[None, :]
    window = np.where(dist >= hp.n_swa, -np.inf, 0.0) + causal if hp.n_swa else causal
    group = hp.n_head // hp.n_head_kv
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        local = hp.layer_is_local(i)
        theta = hp.rope_theta_swa if local else hp.rope_theta
        h = rmsnorm(x, w[b + "attn_norm.weight"], hp.rms_eps)
        q = (h @ w[b + "attn_q.weight"].T).reshape(T, hp.n_head, hd)
        k = (h @ w[b + "attn_k.weight"].T).reshape(T, hp.n_head_kv, hd)
        v = (h @ w[b + "attn_v.weight"].T).reshape(T, hp.n_head_kv, hd)
        q = rmsnorm(q, w[b + "attn_q_norm.weight"], hp.rms_eps)
        k = rmsnorm(k, w[b + "attn_k_norm.weight"], hp.rms_eps)
        q, k = rope_neox(q, pos, hp.n_rot, theta), rope_neox(k, pos, hp.n_rot, theta)
        k, v = kv_as_stored(k, kv_type), kv_as_stored(v, kv_type)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        mask = window if local else causal
        att = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", att, v).reshape(T, hp.n_head * hd)
        x = x + rmsnorm(o @ w[b + "attn_output.weight"].T, w[b + "post_attention_norm.weight"],
                        hp.rms_eps)
        h = rmsnorm(x, w[b + "ffn_norm.weight"], hp.rms_eps)
        g, u = h @ w[b + "ffn_gate.weight"].T, h @ w[b + "ffn_up.weight"].T
        y = (gelu_tanh(g) * u) @ w[b + "ffn_down.weight"].T
        x = x + rmsnorm(y, w[b + "post_ffw_norm.weight"], hp.rms_eps)
    # the output matrix is widened in blocks of rows: Gemma's 262144 x 640 at once would
    # take 1.3 GB in float64
    name = "output.weight" if "output.weight" in w else "token_embd.weight"
    out32 = dict.__getitem__(w, name)
    h = rmsnorm(x, w["output_norm.weight"], hp.rms_eps)
    return np.concatenate([h @ out32[r:r + 32768].astype(np.float64).T
                           for r in range(0, out32.shape[0], 32768)], axis=1)
