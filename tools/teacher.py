"""A llama GGUF (SmolLM2-135M-Instruct) as a torch teacher for draft training.

The GGUF's weights are dequantized once into :class:`llama_torch.Llama` (the
GGUF ``llama`` layout: adjacent-pair RoPE, so no Q/K permutation is involved).
Besides the plain forward it offers batched sampling with a KV cache, keeping
the teacher's top-k log-probabilities at every position, so that generated text
comes with its soft labels at no extra cost. :func:`core_rollouts` runs the
target in the C core instead (the service's own arithmetic, f16 KV cache
included): the on-policy data, continuations exactly as speculation will verify
them, several rows per core pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from gguf_io import read_gguf
from llama_torch import Block, Llama, apply_rope, load_gguf_tensors
from rollout import Turn, advance


def load_teacher(path: Path, dtype: torch.dtype = torch.float32) -> Llama:
    gg = read_gguf(path)
    model = Llama(gg.cfg)
    load_gguf_tensors(model, {k: torch.from_numpy(v) for k, v in gg.tensors.items()})
    return model.to(dtype).eval()


@dataclass
class TopK:
    """The teacher's k most likely next tokens at each position, as log-probabilities."""

    ids: torch.Tensor  # (B, T, k) int32
    logp: torch.Tensor  # (B, T, k) float16


def top_k(logits: torch.Tensor, k: int) -> TopK:
    logp = F.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(k, dim=-1)
    return TopK(ids.to(torch.int32), values.to(torch.float16))


def _block_cached(block: Block, x: torch.Tensor, pos: int, model: Llama,
                  cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One block over x at positions pos.. with its keys/values kept in cache."""
    cfg = block.cfg
    b, t, _ = x.shape
    cos, sin = model.rope_cos[pos : pos + t], model.rope_sin[pos : pos + t]
    h = block.attn_norm(x)
    q = block.wq(h).view(b, t, cfg.n_head, cfg.head_dim).transpose(1, 2)
    k = block.wk(h).view(b, t, cfg.n_head_kv, cfg.head_dim).transpose(1, 2)
    v = block.wv(h).view(b, t, cfg.n_head_kv, cfg.head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    ck, cv = cache
    ck[:, :, pos : pos + t] = k
    cv[:, :, pos : pos + t] = v
    if pos != 0 and t != 1:
        raise ValueError("cached forward takes a prefill at 0 or one token at a time")
    # grouped-query attention without copying the cache per query head
    y = F.scaled_dot_product_attention(q, ck[:, :, : pos + t], cv[:, :, : pos + t],
                                       is_causal=t > 1, enable_gqa=True)
    x = x + block.wo(y.transpose(1, 2).reshape(b, t, cfg.n_embd))
    h = block.ffn_norm(x)
    return x + block.w_down(F.silu(block.w_gate(h)) * block.w_up(h))


@torch.no_grad()
def sample_batch(model: Llama, prefix: list[int], batch: int, n_new: int, temperature: float,
                 k_keep: int, generator: torch.Generator) -> tuple[torch.Tensor, TopK]:
    """batch continuations of one shared prefix, sampled at temperature.

    Returns tokens (batch, len(prefix) + n_new) and the teacher's top-k at every
    position but the last (position i predicts token i + 1).
    """
    cfg = model.cfg
    total = len(prefix) + n_new
    dtype = model.tok_embd.weight.dtype
    caches = [(torch.zeros(batch, cfg.n_head_kv, total, cfg.head_dim, dtype=dtype),
               torch.zeros(batch, cfg.n_head_kv, total, cfg.head_dim, dtype=dtype))
              for _ in model.blocks]
    tokens = torch.empty(batch, total, dtype=torch.long)
    tokens[:, : len(prefix)] = torch.tensor(prefix)
    ids: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    x_in = tokens[:1, : len(prefix)]
    pos = 0
    while True:
        x = model.tok_embd(x_in)
        if pos == 0:  # the shared prefix once, its cache copied to every row
            for block, cache in zip(model.blocks, caches, strict=True):
                one = (cache[0][:1], cache[1][:1])
                x = _block_cached(block, x, 0, model, one)
                cache[0][:, :, : len(prefix)] = one[0][:, :, : len(prefix)]
                cache[1][:, :, : len(prefix)] = one[1][:, :, : len(prefix)]
            x = x.expand(batch, -1, -1)
        else:
            for block, cache in zip(model.blocks, caches, strict=True):
                x = _block_cached(block, x, pos, model, cache)
        logits = F.linear(model.out_norm(x), model.tok_embd.weight).float()
        tk = top_k(logits, k_keep)
        ids.append(tk.ids)
        logps.append(tk.logp)
        pos += x_in.shape[1]
        if pos == total:
            break
        probs = F.softmax(logits[:, -1] / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)
        tokens[:, pos] = nxt[:, 0]
        x_in = nxt
    top = TopK(torch.cat(ids, dim=1)[:, :-1], torch.cat(logps, dim=1)[:, :-1])
    return tokens, top


@torch.no_grad()
def teacher_top_k(model: Llama, windows: torch.Tensor, k_keep: int) -> TopK:
    """Top-k next-token log-probabilities at every position of each window (B, T)."""
    x = windows.long()
    dtype = model.tok_embd.weight.dtype
    t = x.shape[1]
    cos, sin = model.rope_cos[:t].to(dtype), model.rope_sin[:t].to(dtype)
    h = model.tok_embd(x)
    for block in model.blocks:
        h = block(h, cos, sin)
    return top_k(F.linear(model.out_norm(h), model.tok_embd.weight), k_keep)


# ------------------------------------------------ on-policy rollouts with the C core


def top_k_np(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise k most likely ids (most likely first) and their log-probabilities."""
    logits = logits.astype(np.float64)
    lse = logits.max(-1, keepdims=True)
    lse = lse + np.log(np.exp(logits - lse).sum(-1, keepdims=True))
    part = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logits, part, -1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    ids = np.take_along_axis(part, order, -1)
    return ids.astype(np.int32), (np.take_along_axis(vals, order, -1) - lse).astype(np.float16)


def core_rollouts(model: Any, prompts: list[list[int]], n_total: int, temperature: float,
                  k_keep: int, rng: np.random.Generator, n_threads: int = 1,
                  question: tuple[int, list[int], float] | None = None) -> tuple[
                      torch.Tensor, TopK]:
    """Continuations of prompts by the target as the C core computes it (the benchmark's
    arithmetic), n_total tokens per row, with its top-k log-probabilities at every
    position but the last. The rows advance together, one token each per core pass.

    question = (end id, opening, question temperature): each prompt ends inside a user
    turn; the target first writes the question at that temperature (at most 48
    tokens, closed by the end id), then the opening (the assistant header) is forced,
    then the answer follows at temperature.
    """
    from inference_svc.core import Context

    n = len(prompts)
    ids = np.zeros((n, n_total, k_keep), dtype=np.int32)
    logp = np.zeros((n, n_total, k_keep), dtype=np.float16)
    turns = [Turn(list(p), [], question[2] if question else temperature,
                  48 if question else 0) for p in prompts]
    with Context(model, n_slots=n, n_ctx=n_total + 8, n_threads=n_threads) as ctx:
        last = np.empty((n, model.n_vocab), dtype=np.float32)
        for s, p in enumerate(prompts):
            lg = ctx.decode(s, p, logits_all=True)
            ids[s, : len(p)], logp[s, : len(p)] = top_k_np(lg, k_keep)
            last[s] = lg[-1]
        pos = len(prompts[0])
        if any(len(p) != pos for p in prompts):
            raise ValueError("prompts of one rollout batch must have the same length")
        while pos < n_total:
            nxt = advance(turns, last, temperature, question, rng)
            pos += 1
            if pos == n_total:
                break
            last = ctx.decode_multi(list(range(n)), nxt)
            ids[:, pos - 1], logp[:, pos - 1] = top_k_np(last, k_keep)
    tokens = torch.tensor([t.tokens for t in turns], dtype=torch.int32)
    return tokens, TopK(torch.from_numpy(ids[:, : n_total - 1]),
                        torch.from_numpy(logp[:, : n_total - 1]))


@torch.no_grad()
def hidden_states(model: Llama, tokens: list[int]) -> torch.Tensor:
    """h_i (T, d) of tokens at positions 0..T-1: the residual stream after the last
    layer, before output_norm (HEAD_SPEC's definition)."""
    t = len(tokens)
    x = model.tok_embd(torch.tensor([tokens]))
    for block in model.blocks:
        x = block(x, model.rope_cos[:t], model.rope_sin[:t])
    return x[0].float()
