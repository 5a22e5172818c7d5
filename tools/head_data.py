"""Training data of the feature head: the target's own generations with its hidden states.

The C core generates every row (the service's own arithmetic and KV cache type, so the
head learns the features it will read when drafting) and returns, in the same pass, for
every position i, ``h_i`` (the residual stream after the last layer, before
``output_norm``: HEAD_SPEC's definition; ``ws_decode_ex``) and the argmax of the target's
full-vocabulary logits. The rows of a shard advance together, one token each per core pass.

Two kinds of rows:
- chat: the chat template with the SmolLM2 system turn and a user turn opened by a
  starter word; the target writes the question (sampled, at most 48 tokens), the
  assistant opening is forced, then the target answers;
- code: --prompt-tokens tokens of a stdlib training-split file (the benchmark's code
  prompts are validation-split files), continued by the target.

A shard's answers are greedy or sampled (the benchmark's sampler: top-k 40, min-p 0.05,
top-p 0.95) at --temperature, by shard index; every shard is seeded by its kind and index.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from rollout import Turn, advance

QUESTION_TOKENS = 48  # the cap on a question the target writes itself


def rollout_hidden(model: Any, prompts: list[list[int]], n_total: int, temperature: float,
                   rng: np.random.Generator,
                   question: tuple[int, list[int], float] | None = None,
                   n_threads: int = 2) -> dict[str, np.ndarray]:
    """Rows of n_total tokens: each prompt (all the same length) continued by the target
    (an inference_svc.core Model) in the C core.

    Returns tokens (B, n_total) int32, hidden (B, n_total, d) float32 (h_i of every
    token) and top1 (B, n_total) int32: the target's full-vocabulary argmax after
    token i (-1 for the last).

    question = (end id, opening, question temperature) as in teacher.core_rollouts: the
    prompt ends inside a user turn, the target writes the question first, the opening
    (assistant header) is forced after it, then the answer follows at temperature.
    """
    from inference_svc.core import Context

    n = len(prompts)
    plen = len(prompts[0])
    if any(len(p) != plen for p in prompts):
        raise ValueError("prompts of one rollout batch must have the same length")
    hidden = np.zeros((n, n_total, model.hparams.n_embd), dtype=np.float32)
    top1 = np.full((n, n_total), -1, dtype=np.int32)
    turns = [Turn(list(p), [], question[2] if question else temperature,
                  QUESTION_TOKENS if question else 0) for p in prompts]
    with Context(model, n_slots=n, n_ctx=n_total, n_threads=n_threads) as ctx:
        last = np.empty((n, model.n_vocab), dtype=np.float32)
        for s, p in enumerate(prompts):
            lg, h = ctx.decode_ex([s], [p], hidden=True)
            assert lg is not None and h is not None
            hidden[s, :plen], top1[s, :plen], last[s] = h, lg.argmax(-1), lg[-1]
        pos = plen
        while pos < n_total:
            nxt = advance(turns, last, temperature, question, rng)
            pos += 1
            lg, h = ctx.decode_ex(list(range(n)), [[t] for t in nxt], hidden=True,
                                  logits=pos < n_total)
            assert h is not None
            hidden[:, pos - 1] = h
            if lg is not None:
                top1[:, pos - 1], last = lg.argmax(-1), lg
    tokens = np.array([t.tokens for t in turns], dtype=np.int32)
    return {"tokens": tokens, "hidden": hidden, "top1": top1}
