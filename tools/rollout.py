"""Where a batch of rollouts is and how each takes its next token (numpy only: the
C-core rollouts of the head's data and the torch teacher's share it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def pick(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; otherwise the benchmark's sampler settings: temperature,
    top-k 40, min-p 0.05, top-p 0.95."""
    if temperature == 0.0:
        return int(np.argmax(logits))
    cand = np.argpartition(-logits, 39)[:40]
    cand = cand[np.argsort(-logits[cand], kind="stable")]
    z = logits[cand].astype(np.float64) / temperature
    p = np.exp(z - z[0])
    p = p[p >= 0.05]
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), 0.95) + 1)
    p = p[:keep] / p[:keep].sum()
    return int(cand[rng.choice(len(p), p=p)])


@dataclass
class Turn:
    """Where one rollout is: tokens so far, tokens it must take next, sampling mode."""

    tokens: list[int]
    forced: list[int]
    temperature: float
    question_left: int = 0  # >0: still writing the user question (sampled, capped)


def advance(turns: list[Turn], last: Any, temperature: float,
            question: tuple[int, list[int], float] | None,
            rng: np.random.Generator) -> list[int]:
    """Each turn's next token from its row of `last` (logits), appended to the turn: a
    forced token first, else one picked at the turn's temperature; a question the target
    writes ends at its end id or its cap, then the opening is forced and the answer
    follows at `temperature`."""
    nxt = []
    for s, turn in enumerate(turns):
        if turn.forced:
            tok = turn.forced.pop(0)
        else:
            tok = pick(last[s], turn.temperature, rng)
            if turn.question_left > 0 and question is not None:
                turn.question_left -= 1
                end, opening, _ = question
                if tok == end or turn.question_left == 0:
                    turn.forced = ([] if tok == end else [end]) + list(opening)
                    turn.question_left, turn.temperature = 0, temperature
        turn.tokens.append(tok)
        nxt.append(tok)
    return nxt
