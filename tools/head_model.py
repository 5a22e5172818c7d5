"""The feature head in torch, exactly HEAD_SPEC's forward.

A pair at position p is (h_p, e_{p+1}); ``x = fc(concat(e_{p+1}, h_p))``, one llama
decoder layer over the pairs (causal, RoPE at position p), giving ĝ = the predicted
h_{p+1}; logits over the K readout tokens are ``output(output_norm(ĝ))``.

:meth:`Head.unrolled` runs the head as drafting does, for every start position at
once: step 1 sees the target's true hidden states; step s > 1 at position q gets the
head's own step s-1 prediction as its hidden input and attends to the true pairs
0..q-s+1 plus the drafted pairs of steps 2..s of its own chain (the head's KV cache
while drafting). The same function trains the multi-step unroll and measures the
chained agreement.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from llama_torch import Block, LlamaConfig, RMSNorm, apply_rope, rope_tables
from torch import nn


class Head(nn.Module):
    def __init__(self, cfg: LlamaConfig, k: int, n_pos: int = 4096) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.n_embd
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.block = Block(cfg)
        self.out_norm = RMSNorm(d, cfg.norm_eps)
        self.output = nn.Linear(d, k, bias=False)
        cos, sin = rope_tables(cfg, n_pos)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_from_target(self, out_norm: torch.Tensor, rows: torch.Tensor,
                         seed: int) -> None:
        """The readout from the target's (tied output rows of the K tokens, its
        output_norm), so ĝ = h_{p+1} would give the target's logits; fc starts as
        'x = h_p + a random projection of e_{p+1}'; the layer as a fresh llama layer
        (std 0.02, residual outputs scaled down)."""
        gen = torch.Generator().manual_seed(seed)
        d = self.cfg.n_embd
        with torch.no_grad():
            for name, p in self.block.named_parameters():
                if p.dim() < 2:
                    p.fill_(1.0)
                    continue
                std = 0.02 / (2 ** 0.5) if name in ("wo.weight", "w_down.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            fc = torch.zeros(d, 2 * d)
            fc[:, :d] = torch.randn(d, d, generator=gen) / d ** 0.5
            fc[:, d:] = torch.eye(d)
            self.fc.weight.copy_(fc)
            self.out_norm.weight.copy_(out_norm)
            self.output.weight.copy_(rows)

    def pairs(self, hidden: torch.Tensor, embd: torch.Tensor) -> torch.Tensor:
        """fc of concat(e_{p+1}, h_p): embedding first, then hidden (HEAD_SPEC)."""
        return self.fc(torch.cat((embd, hidden), dim=-1))

    def qkv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys, values (B, H, T, D) of layer inputs x at rope positions pos."""
        cfg, blk = self.cfg, self.block
        b, t, _ = x.shape
        h = blk.attn_norm(x)
        q = blk.wq(h).view(b, t, cfg.n_head, cfg.head_dim).transpose(1, 2)
        k = blk.wk(h).view(b, t, cfg.n_head_kv, cfg.head_dim).transpose(1, 2)
        v = blk.wv(h).view(b, t, cfg.n_head_kv, cfg.head_dim).transpose(1, 2)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """The rest of the layer: attention (mask None: causal), output, SwiGLU FFN."""
        cfg, blk = self.cfg, self.block
        b, t, _ = x.shape
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=True)
        y = x + blk.wo(y.transpose(1, 2).reshape(b, t, cfg.n_embd))
        h = blk.ffn_norm(y)
        return y + blk.w_down(F.silu(blk.w_gate(h)) * blk.w_up(h))

    def forward(self, hidden: torch.Tensor, embd: torch.Tensor) -> torch.Tensor:
        """Pairs (h_p, e_{p+1}) at positions 0..T-1 -> ĝ (B, T, d), causal."""
        x = self.pairs(hidden, embd)
        pos = torch.arange(x.shape[1])
        q, k, v = self.qkv(x, pos)
        return self.finish(x, q, k, v, None)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.output(self.out_norm(g))

    def unrolled(self, hidden: torch.Tensor, embd: torch.Tensor,
                 steps: int) -> list[torch.Tensor]:
        """ĝ of drafting steps 1..steps at every position q (B, T, d each).

        Step s at position q is the s-th draft of a chain whose first pair sits at
        q - s + 1: its hidden input is step s-1's output at q - 1 (positions q < s - 1 have
        no chain; their rows are garbage and must be masked by the caller).
        """
        t = hidden.shape[1]
        pos = torch.arange(t)
        x = self.pairs(hidden, embd)
        q, k1, v1 = self.qkv(x, pos)
        outs = [self.finish(x, q, k1, v1, None)]
        keys, values = [k1], [v1]
        qi, kj = pos[:, None], pos[None, :]
        for s in range(2, steps + 1):
            prev = torch.cat((torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]), dim=1)
            x = self.pairs(prev, embd)
            q, k, v = self.qkv(x, pos)
            keys.append(k)
            values.append(v)
            # true pairs j <= q-s+1; drafted pair of step s' (2..s) at j == q-s+s'
            blocks = [kj <= qi - s + 1] + [kj == qi - s + sp for sp in range(2, s + 1)]
            mask = torch.cat(blocks, dim=1)
            outs.append(self.finish(x, q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                    mask))
        return outs
