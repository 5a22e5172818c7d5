"""A numpy reference of HEAD_SPEC's head forward and drafting, from the GGUF file alone.

    head = load_head(Path("models/smollm2-head.gguf"))
    embd = target_embeddings(Path("models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    cache = KVCache()
    g, logits = forward(head, cache, hidden[:n - 1], embd[tokens[1:n]], start=0)
    drafts = draft(head, cache, hidden[n - 1], tokens[n], n - 1, embd, steps=4)

Float64 throughout: it is the value an implementation is compared with, not a fast path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf_io import dequantized
from head_gguf import HeadFile, read_head


def load_head(path: Path) -> HeadFile:
    return read_head(path)


def target_embeddings(target: Path) -> np.ndarray:
    """The target's token_embd.weight dequantized to float32 (n_vocab, d)."""
    reader = gguf.GGUFReader(str(target))
    (t,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    return dequantized(t)


@dataclass
class KVCache:
    """The head's keys and values (T, n_head_kv, head_dim) of pairs 0..T-1."""

    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)

    def truncate(self, n: int) -> None:
        """Drop the entries of pairs n.. (drafted pairs after verification)."""
        del self.keys[n:]
        del self.values[n:]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_at(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
    """x (T, H, D): adjacent pairs (x[2i], x[2i+1]) rotated by pos * base^(-2i/D)."""
    d = x.shape[-1]
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos.astype(np.float64)[:, None, None] * inv_freq[None, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * np.cos(ang) - x1 * np.sin(ang)
    out[..., 1::2] = x0 * np.sin(ang) + x1 * np.cos(ang)
    return out


def forward(head: HeadFile, cache: KVCache, hidden: np.ndarray, embd: np.ndarray,
            start: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (hidden[i], embd[i]) at positions start+i, after the cache's start pairs.

    Each attends to the cached pairs and to the new ones up to itself. Returns ĝ
    (T, d), the predicted next hidden states, and the K logits (T, K) (logit k for
    vocabulary token head.token_ids[k]); the new keys and values join the cache.
    """
    if len(cache) != start:
        raise ValueError(f"cache holds {len(cache)} pairs, the new ones start at {start}")
    cfg, w = head.cfg, {k: v.astype(np.float64) for k, v in head.tensors.items()}
    hd, t = cfg.head_dim, len(hidden)
    pos = np.arange(start, start + t)
    x = np.concatenate((embd, hidden), axis=-1).astype(np.float64) @ w["fc.weight"].T
    a = rms_norm(x, w["blk.0.attn_norm.weight"], cfg.norm_eps)
    q = rope_at((a @ w["blk.0.attn_q.weight"].T).reshape(t, cfg.n_head, hd), pos,
                cfg.rope_base)
    k = rope_at((a @ w["blk.0.attn_k.weight"].T).reshape(t, cfg.n_head_kv, hd), pos,
                cfg.rope_base)
    v = (a @ w["blk.0.attn_v.weight"].T).reshape(t, cfg.n_head_kv, hd)
    cache.keys.extend(k)
    cache.values.extend(v)
    keys, values = np.stack(cache.keys), np.stack(cache.values)  # (S, Hkv, D)
    group = cfg.n_head // cfg.n_head_kv
    keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, keys) / np.sqrt(hd)
    allowed = np.arange(len(keys))[None, :] <= pos[:, None]
    scores = np.where(allowed[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    att = np.einsum("hts,shd->thd", probs, values).reshape(t, cfg.n_embd)
    y = x + att @ w["blk.0.attn_output.weight"].T
    f = rms_norm(y, w["blk.0.ffn_norm.weight"], cfg.norm_eps)
    gate = f @ w["blk.0.ffn_gate.weight"].T
    g = y + ((gate / (1.0 + np.exp(-gate))) * (f @ w["blk.0.ffn_up.weight"].T)) \
        @ w["blk.0.ffn_down.weight"].T
    logits = rms_norm(g, w["output_norm.weight"], cfg.norm_eps) @ w["output.weight"].T
    return g, logits


def draft(head: HeadFile, cache: KVCache, h_last: np.ndarray, token: int, pos: int,
          embd_table: np.ndarray, steps: int) -> list[int]:
    """Greedy drafting after the target produced `token` at position pos + 1 with
    hidden state h_last of token pos (the cache holds pairs 0..pos-1): pair
    (h_last, e_token) at pos gives d_1, then (ĝ, e_{d_1}) at pos + 1 gives d_2, ...
    The drafted pairs stay in the cache (truncate(pos) drops them)."""
    out: list[int] = []
    hidden, tok = h_last, token
    for s in range(steps):
        g, logits = forward(head, cache, hidden[None], embd_table[[tok]], pos + s)
        tok = int(head.token_ids[int(np.argmax(logits[0]))])
        out.append(tok)
        hidden = g[0]
    return out
