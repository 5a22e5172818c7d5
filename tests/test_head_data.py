"""The head's training rows (tools/head_data.py): a greedy row takes the target's argmax
at every generated position, a chat row's question ends with <|im_end|> and the forced
assistant header, and the hidden states kept while generating with the KV cache are the
ones a plain forward pass of the whole row computes (h_i before output_norm)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from inference_svc.core.gguf_file import load_gguf
from inference_svc.core.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_rollout_rows_are_the_targets_own_with_their_hidden_states() -> None:
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "tools"))
    from head_data import QUESTION_TOKENS, hidden_states, rollout_hidden
    from teacher import load_teacher

    content = load_gguf(TARGET)
    tok = Tokenizer(content.tokenizer)
    content.close()
    teacher = load_teacher(TARGET)
    start, end = tok.data.tokens.index("<|im_start|>"), tok.data.tokens.index("<|im_end|>")
    opening = [*tok.encode("\n"), start, *tok.encode("assistant\n")]
    prompt = [start, *tok.encode("user\nHow")]
    out = rollout_hidden(teacher, [prompt, prompt], 72, 0.0, np.random.default_rng(5),
                         (end, opening, 0.8))
    tokens, hidden, top1 = out["tokens"], out["hidden"], out["top1"]
    assert tokens.shape == (2, 72) and hidden.shape == (2, 72, 576) and top1.shape == (2, 72)
    assert top1[:, -1].tolist() == [-1, -1]
    for r, row in enumerate(tokens.tolist()):
        assert row[: len(prompt)] == prompt
        q_end = row.index(end, len(prompt))
        assert q_end - len(prompt) <= QUESTION_TOKENS
        answer = q_end + 1 + len(opening)
        assert row[q_end + 1 : answer] == opening
        assert row[answer:] == top1[r, answer - 1 : -1].tolist()  # greedy answer
        ref = hidden_states(teacher, row)
        assert torch.allclose(hidden[r], ref, rtol=1e-4, atol=1e-3 * float(ref.abs().max()))
        full = torch.nn.functional.linear(teacher.out_norm(ref), teacher.tok_embd.weight)
        assert (full[:-1].argmax(-1) == top1[r, :-1].long()).float().mean() > 0.99
    assert tokens[0].tolist() != tokens[1].tolist()  # the questions were sampled
