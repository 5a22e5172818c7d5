"""The Gemma 3 tokenizer (SentencePiece-style BPE with byte fallback) against
llama.cpp's ids for a test set of whitespace runs, emoji, code and other scripts
(expected ids in tests/fixtures/gemma3_oracle.json, from tools/gemma3_oracle.py)."""

from __future__ import annotations

from typing import Any

import pytest

from inference_svc.core import StreamDecoder, Tokenizer, load_gguf
from tests.gemma3kit import gemma_path, needs_gemma3, oracle

pytestmark = needs_gemma3


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(load_gguf(gemma_path()).tokenizer)


CASES: list[dict[str, Any]] = oracle()["tokenizer"] + [
    {"text": c["prompt"], "with_bos": c["ids"]} for c in oracle()["greedy"]]


@pytest.mark.parametrize("case", CASES, ids=lambda c: repr(c["text"][:24]))
def test_encode_matches_llama_cpp(tok: Tokenizer, case: dict[str, Any]) -> None:
    assert tok.encode(case["text"], add_bos=True) == case["with_bos"]
    if "ids" in case:
        assert tok.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("case", oracle()["tokenizer"], ids=lambda c: repr(c["text"][:24]))
def test_decode_matches_llama_cpp(tok: Tokenizer, case: dict[str, Any]) -> None:
    assert tok.decode(case["ids"]) == case["decoded"]
    stream = StreamDecoder(tok)
    assert "".join(stream.push(t) for t in case["ids"]) + stream.flush() == case["decoded"]


def test_bos_as_the_file_says(tok: Tokenizer) -> None:
    assert (tok.add_bos, tok.bos_id, tok.eos_id) == (True, 2, 1)
    assert tok.decode([2, 9259, 1]) == "Hello"  # control tokens have no text
