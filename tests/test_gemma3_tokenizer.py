"""The Gemma 3 tokenizer (SentencePiece-style BPE with byte fallback) against
llama.cpp's ids for a test set of whitespace runs, emoji, code and other scripts
(expected ids in tests/fixtures/gemma3_oracle.json, from tools/gemma3_oracle.py)."""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np
import pytest

from inference_svc.core import StreamDecoder, Tokenizer, load_gguf
from inference_svc.core.spm import SPMTokenizer
from tests.gemma3kit import gemma_path, needs_gemma3, oracle


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(load_gguf(gemma_path()).tokenizer)


CASES: list[dict[str, Any]] = oracle()["tokenizer"] + [
    {"text": c["prompt"], "with_bos": c["ids"]} for c in oracle()["greedy"]]


@needs_gemma3
@pytest.mark.parametrize("case", CASES, ids=lambda c: repr(c["text"][:24]))
def test_encode_matches_llama_cpp(tok: Tokenizer, case: dict[str, Any]) -> None:
    assert tok.encode(case["text"], add_bos=True) == case["with_bos"]
    if "ids" in case:
        assert tok.encode(case["text"]) == case["ids"]


@needs_gemma3
@pytest.mark.parametrize("case", oracle()["tokenizer"], ids=lambda c: repr(c["text"][:24]))
def test_decode_matches_llama_cpp(tok: Tokenizer, case: dict[str, Any]) -> None:
    assert tok.decode(case["ids"]) == case["decoded"]
    stream = StreamDecoder(tok)
    assert "".join(stream.push(t) for t in case["ids"]) + stream.flush() == case["decoded"]


@needs_gemma3
def test_bos_as_the_file_says(tok: Tokenizer) -> None:
    assert (tok.add_bos, tok.bos_id, tok.eos_id) == (True, 2, 1)
    assert tok.decode([2, 9259, 1]) == "Hello"  # control tokens have no text


def reference_bpe(spm: SPMTokenizer, text: str) -> list[int]:
    """llama.cpp's SentencePiece merge loop in Python (what the core's native/spm.c
    runs): merge the highest-scoring adjacent pair whose concatenation is a token,
    leftmost first among equal scores; a symbol that is no token becomes its bytes."""
    sym = list(text)
    nxt, prv = list(range(1, len(sym) + 1)), list(range(-1, len(sym) - 1))
    heap: list[tuple[float, int, int, str]] = []

    def add(left: int, right: int) -> None:
        if 0 <= left and right < len(sym):
            tid = spm.vocab.get(sym[left] + sym[right])
            if tid is not None:
                heapq.heappush(heap, (-spm.scores[tid], left, right, sym[left] + sym[right]))

    for i in range(len(sym) - 1):
        add(i, i + 1)
    while heap:
        _, left, right, merged = heapq.heappop(heap)
        if not sym[left] or not sym[right] or nxt[left] != right or \
                sym[left] + sym[right] != merged:
            continue  # stale: a side changed since the pair was queued
        sym[left], sym[right] = merged, ""
        nxt[left] = nxt[right]
        if nxt[right] < len(sym):
            prv[nxt[right]] = left
        add(prv[left], left)
        add(left, nxt[left])
    out: list[int] = []
    i = 0
    while i < len(sym):
        tid = spm.vocab.get(sym[i])
        out += [tid] if tid is not None else [spm.byte_ids[b] for b in sym[i].encode()]
        i = nxt[i]
    return out


# whitespace runs, code, emoji (also joined ones), other scripts, characters Gemma's
# vocabulary has no token for (byte fallback), combining marks
ALPHABET = [*"abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 \t\n\r.,;:!?-_()[]{}<>=+*/'\"#",
            "  ", "    ", "\n\n", "é", "ü", "日", "本", "語", "한", "д", "ж", "α", "🎉", "👍🏽",
            "👨‍👩‍👧", "\u0301", "\u00a0", "\u2003", "\x00", "\x7f", "\U0010fffd", "\ufeff",
            "def ", "return ", "self.", "the ", "ing", "<start_of_turn>", "<b>"]


@needs_gemma3
def test_native_merges_are_the_reference_loop(tok: Tokenizer) -> None:
    """The core's merge loop gives the reference loop's ids on 300 random texts."""
    spm = tok._spm
    assert spm is not None
    rng = np.random.default_rng(7)
    for _ in range(300):
        text = "".join(ALPHABET[i] for i in rng.integers(0, len(ALPHABET),
                                                         rng.integers(1, 120)))
        escaped = text.replace(" ", "\u2581")
        assert spm._bpe(escaped) == reference_bpe(spm, escaped), text


def test_equal_scores_merge_leftmost_first() -> None:
    """'aaa' with 'aa' a token: the pair at 0 merges first (aa, a), as in llama.cpp."""
    tokens = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + ["a", "aa"]
    types = [2] + [6] * 256 + [1, 1]
    scores = [0.0] * 257 + [-1.0, -2.0]
    spm = SPMTokenizer(tokens, scores, types, add_space_prefix=False)
    assert spm.encode("aaa") == [258, 257]
    assert spm.encode("aaaa") == [258, 258]
    assert spm.encode("") == []
