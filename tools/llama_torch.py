"""A small llama-family decoder in PyTorch, laid out as GGUF ``llama`` stores it.

RoPE is Meta's original interleaved-pair rotation: pairs (x[2i], x[2i+1]) turn
by pos * base^(-2i/head_dim). That is llama.cpp's "normal" RoPE for the
``llama`` architecture, so Q and K weights are written to GGUF unpermuted.
No biases; RMSNorm is x * rsqrt(mean(x^2) + eps) * weight; SwiGLU FFN; output
weights tied to the token embedding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812
from llama_config import LlamaConfig
from torch import nn


def rope_tables(cfg: LlamaConfig, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (n_pos, head_dim/2) for pair i at each position."""
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_base ** (-torch.arange(0, half, dtype=torch.float64) * 2 / cfg.head_dim)
    angles = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); rotate adjacent pairs (x[2i], x[2i+1])."""
    pairs = x.unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out0 = x0 * cos - x1 * sin
    out1 = x0 * sin + x1 * cos
    return torch.stack((out0, out1), dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kv_dim = cfg.n_head_kv * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wk = nn.Linear(cfg.n_embd, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.n_embd, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.ffn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.w_gate = nn.Linear(cfg.n_embd, cfg.n_ff, bias=False)
        self.w_up = nn.Linear(cfg.n_embd, cfg.n_ff, bias=False)
        self.w_down = nn.Linear(cfg.n_ff, cfg.n_embd, bias=False)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, cfg.n_head, cfg.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, cfg.n_head_kv, cfg.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, cfg.n_head_kv, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = cfg.n_head // cfg.n_head_kv
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, cfg.n_embd))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embd = nn.Embedding(cfg.n_vocab, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.out_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        cos, sin = rope_tables(cfg, cfg.n_ctx)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            is_resid_out = name.endswith("wo.weight") or name.endswith("w_down.weight")
            nn.init.normal_(p, mean=0.0, std=resid_std if is_resid_out else std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) token ids at positions 0..T-1 -> logits (B, T, n_vocab)."""
        t = idx.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.tok_embd(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.linear(self.out_norm(x), self.tok_embd.weight)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def macs_per_token(cfg: LlamaConfig) -> int:
    """Weight multiply-accumulates per decoded token (attention over context excluded)."""
    kv_dim = cfg.n_head_kv * cfg.head_dim
    attn = cfg.n_embd * (2 * cfg.n_embd + 2 * kv_dim)
    ffn = 3 * cfg.n_embd * cfg.n_ff
    return cfg.n_layer * (attn + ffn) + cfg.n_embd * cfg.n_vocab


def gguf_tensors(model: Llama) -> dict[str, torch.Tensor]:
    """GGUF tensor name -> weight in nn.Linear layout (n_out, n_in)."""
    out: dict[str, torch.Tensor] = {"token_embd.weight": model.tok_embd.weight}
    names = {
        "attn_norm": "attn_norm.weight",
        "attn_q": "wq.weight",
        "attn_k": "wk.weight",
        "attn_v": "wv.weight",
        "attn_output": "wo.weight",
        "ffn_norm": "ffn_norm.weight",
        "ffn_gate": "w_gate.weight",
        "ffn_up": "w_up.weight",
        "ffn_down": "w_down.weight",
    }
    for i, block in enumerate(model.blocks):
        params = dict(block.named_parameters())
        for gguf_name, torch_name in names.items():
            out[f"blk.{i}.{gguf_name}.weight"] = params[torch_name]
    out["output_norm.weight"] = model.out_norm.weight
    return out


def load_gguf_tensors(model: Llama, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`gguf_tensors` (copies in place)."""
    targets = gguf_tensors(model)
    if set(targets) != set(tensors):
        raise ValueError(f"tensor names differ: {sorted(set(targets) ^ set(tensors))}")
    with torch.no_grad():
        for name, param in targets.items():
            param.copy_(tensors[name].reshape(param.shape).to(param.dtype))
