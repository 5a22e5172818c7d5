"""The head's training rows (tools/head_data.py), generated in the C core: a greedy row
takes the target's argmax at every generated position, a chat row's question ends with
<|im_end|> and the forced assistant header, and the hidden states kept while the rows
advance together are, bit for bit, those one pass over the whole row computes
(h_i before output_norm), with the argmax of that pass's logits."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from inference_svc.core import Context, Model
from inference_svc.core.gguf_file import load_gguf
from inference_svc.core.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_rollout_rows_are_the_targets_own_with_their_hidden_states() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    from head_data import QUESTION_TOKENS, rollout_hidden

    content = load_gguf(TARGET)
    tok = Tokenizer(content.tokenizer)
    content.close()
    start, end = tok.data.tokens.index("<|im_start|>"), tok.data.tokens.index("<|im_end|>")
    opening = [*tok.encode("\n"), start, *tok.encode("assistant\n")]
    prompt = [start, *tok.encode("user\nHow")]
    with Model.load(TARGET) as model:
        out = rollout_hidden(model, [prompt, prompt, prompt], 72, 0.0,
                             np.random.default_rng(5), (end, opening, 0.8), n_threads=2)
        tokens, hidden, top1 = out["tokens"], out["hidden"], out["top1"]
        assert tokens.shape == (3, 72) and hidden.shape == (3, 72, 576)
        assert top1.shape == (3, 72) and top1[:, -1].tolist() == [-1, -1, -1]
        with Context(model, n_slots=1, n_ctx=72, n_threads=1) as ctx:
            for r, row in enumerate(tokens.tolist()):
                assert row[: len(prompt)] == prompt
                q_end = row.index(end, len(prompt))
                assert q_end - len(prompt) <= QUESTION_TOKENS
                answer = q_end + 1 + len(opening)
                assert row[q_end + 1 : answer] == opening
                assert row[answer:] == top1[r, answer - 1 : -1].tolist()  # greedy answer
                ctx.clear(0)
                logits, ref = ctx.decode_ex([0], [row], hidden=True)
                assert logits is not None and ref is not None
                assert np.array_equal(hidden[r], ref)
                assert np.array_equal(top1[r, :-1], logits[:-1].argmax(-1))
    assert len({tuple(r) for r in tokens.tolist()}) == 3  # the questions were sampled
