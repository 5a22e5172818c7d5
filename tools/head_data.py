"""Training data of the feature head: the target's own generations with its hidden states.

One batched torch pass with a KV cache per shard: the target (the torch port of its GGUF,
checked against the C core by tools/train_draft.py's check) generates each row and keeps,
for every position i, ``h_i`` (the residual stream after the last layer, before
``output_norm``: HEAD_SPEC's definition) and the argmax of its full-vocabulary logits.
Generating in torch gives the features at no extra cost (no second forward pass).

Two kinds of rows:
- chat: the chat template with the SmolLM2 system turn and a user turn opened by a
  starter word; the target writes the question (sampled, at most 48 tokens), the
  assistant opening is forced, then the target answers;
- code: the first --prompt-tokens tokens of stdlib training-split files (the benchmark's
  code prompts are validation-split files), continued by the target.

A shard's answers are greedy or sampled (the benchmark's sampler: top-k 40, min-p 0.05,
top-p 0.95) at --temperature, by shard index; every shard is seeded by its kind and index.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from llama_torch import Llama
from teacher import Turn, _block_cached, advance

QUESTION_TOKENS = 48  # the cap on a question the target writes itself


@torch.no_grad()
def rollout_hidden(model: Llama, prompts: list[list[int]], n_total: int, temperature: float,
                   rng: np.random.Generator,
                   question: tuple[int, list[int], float] | None = None,
                   ) -> dict[str, torch.Tensor]:
    """Rows of n_total tokens: each prompt (all the same length) continued by the target.

    Returns tokens (B, n_total) int32, hidden (B, n_total, d) float32 (h_i of every
    token) and top1 (B, n_total)
    int32: the target's full-vocabulary argmax after token i (-1 for the last).

    question = (end id, opening, question temperature) as in teacher.core_rollouts: the
    prompt ends inside a user turn, the target writes the question first, the opening
    (assistant header) is forced after it, then the answer follows at temperature.
    """
    cfg = model.cfg
    n = len(prompts)
    plen = len(prompts[0])
    if any(len(p) != plen for p in prompts):
        raise ValueError("prompts of one rollout batch must have the same length")
    dtype = model.tok_embd.weight.dtype
    caches = [(torch.zeros(n, cfg.n_head_kv, n_total, cfg.head_dim, dtype=dtype),
               torch.zeros(n, cfg.n_head_kv, n_total, cfg.head_dim, dtype=dtype))
              for _ in model.blocks]
    hidden = torch.zeros(n, n_total, cfg.n_embd)
    top1 = torch.full((n, n_total), -1, dtype=torch.int32)
    turns = [Turn(list(p), [], question[2] if question else temperature,
                  QUESTION_TOKENS if question else 0) for p in prompts]
    x_in = torch.tensor(prompts, dtype=torch.long)
    pos = 0
    while True:
        x = model.tok_embd(x_in)
        for block, cache in zip(model.blocks, caches, strict=True):
            x = _block_cached(block, x, pos, model, cache)
        t = x_in.shape[1]
        hidden[:, pos : pos + t] = x.float()
        logits = F.linear(model.out_norm(x[:, -1]), model.tok_embd.weight).float()
        if t > 1:  # the prompt's argmax at every prompt position
            full = F.linear(model.out_norm(x[:, :-1]), model.tok_embd.weight)
            top1[:, pos : pos + t - 1] = full.argmax(-1).to(torch.int32)
        pos += t
        if pos == n_total:
            break
        top1[:, pos - 1] = logits.argmax(-1).to(torch.int32)
        last = logits.numpy()
        nxt = advance(turns, last, temperature, question, rng)
        x_in = torch.tensor(nxt, dtype=torch.long)[:, None]
    tokens = torch.tensor([tr.tokens for tr in turns], dtype=torch.int32)
    return {"tokens": tokens, "hidden": hidden, "top1": top1}


@torch.no_grad()
def hidden_states(model: Llama, tokens: list[int]) -> torch.Tensor:
    """h_i (T, d) of tokens at positions 0..T-1: the residual stream after the last
    layer, before output_norm (HEAD_SPEC's definition)."""
    t = len(tokens)
    x = model.tok_embd(torch.tensor([tokens]))
    for block in model.blocks:
        x = block(x, model.rope_cos[:t], model.rope_sin[:t])
    return x[0].float()
