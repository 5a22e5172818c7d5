"""The byte-level BPE tokenizer built from GGUF metadata."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inference_svc.core import (
    InvalidArgumentError,
    ModelLoadError,
    StreamDecoder,
    Tokenizer,
    load_gguf,
)
from inference_svc.core.chunks import CHUNK_CHARS, MAX_RUN_CHARS, pieces
from inference_svc.core.gguf_file import TokenizerData

TEXTS = [
    "",
    "hello world",
    "def f(x):\n    return x ** 2\n\n\n",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nCRLF",
    "ünïcödé, 日本語のテキスト, emoji 🎉👩‍👩‍👧, combining e\u0301",
    "<|endoftext|> is plain text here",
    "\x00\x01 control \x7f bytes",
    "a" * 1000,
]


@pytest.fixture(scope="module")
def tok(small_model_path: Path) -> Tokenizer:
    return Tokenizer(load_gguf(small_model_path).tokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_identity(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.n_vocab for i in ids)
    assert tok.decode(ids) == text


def test_random_unicode_roundtrip(tok: Tokenizer) -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        cps = rng.integers(1, 0x10FFFF, rng.integers(1, 40))
        text = "".join(chr(c) for c in cps if not 0xD800 <= c <= 0xDFFF)
        assert tok.decode(tok.encode(text)) == text


def test_merges_are_used(tok: Tokenizer) -> None:
    text = "the tea ate in the sea " * 20
    assert len(tok.encode(text)) < len(text.encode())


def test_decode_arbitrary_ids_never_raises(tok: Tokenizer) -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        ids = rng.integers(-5, tok.n_vocab + 5, rng.integers(0, 30)).tolist()
        assert isinstance(tok.decode(ids), str)
    assert tok.decode([tok.eos_id]) == ""  # control tokens carry no text
    assert tok.decode([-1, 10**9]) == ""


def test_stream_decoder_matches_decode(tok: Tokenizer) -> None:
    text = "naïve café — 日本 🎉 done"
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_only_gpt2_and_llama_tokenizers() -> None:
    with pytest.raises(ModelLoadError, match="'bert' is not supported"):
        Tokenizer(TokenizerData("bert", ["a"], [1], [], None, None))
    with pytest.raises(ModelLoadError, match="needs a score and a type per token"):
        Tokenizer(TokenizerData("llama", ["a"], [1], [], None, None))
    with pytest.raises(ModelLoadError, match="needs the 256 byte tokens"):
        Tokenizer(TokenizerData("llama", ["a"], [1], [], None, None, scores=[0.0]))


def spm_vocab() -> TokenizerData:
    """A small SentencePiece-style vocabulary: control tokens, the 256 byte tokens, a
    user-defined run of two spaces, and pieces whose scores decide the merges."""
    pieces = {"a": -1.0, "b": -1.0, "c": -1.0, "\u2581": -1.0, "ab": -5.0, "bc": -2.0,
              "\u2581a": -4.0}
    tokens = ["<pad>", "<eos>", "<bos>"] + [f"<0x{b:02X}>" for b in range(256)] + ["  "]
    types = [3, 3, 3] + [6] * 256 + [4]
    tokens += list(pieces)
    types += [1] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + list(pieces.values())
    return TokenizerData("llama", tokens, types, [], 2, 1, scores=scores, add_bos=True,
                         add_space_prefix=False)


def test_spm_merges_by_score_with_byte_fallback() -> None:
    tok = Tokenizer(spm_vocab())
    ids = {t: i for i, t in enumerate(tok.data.tokens)}
    # "abc": b+c (score -2) before a+b (-5), then a+bc is not a piece: a, bc
    assert tok.encode("abc") == [ids["a"], ids["bc"]]
    # a space becomes U+2581; the user-defined "  " is split out before the merges
    assert tok.encode("ab a  c") == [ids["ab"], ids["\u2581a"], ids["  "], ids["c"]]
    # a character no piece holds: its UTF-8 bytes
    assert tok.encode("é") == [ids["<0xC3>"], ids["<0xA9>"]]
    assert tok.encode("a", add_bos=True) == [2, ids["a"]]
    assert tok.decode(tok.encode("ab a  cé")) == "ab a  cé"
    assert tok.decode([2, 1, ids["a"]]) == "a"


# characters where the pre-tokenizer's classes meet: letters, digits, spaces of several
# kinds (also those Python and the regex engine disagree about), apostrophes of
# contractions, combining marks, numerals that are letters
NASTY = [*"abcXYZ019 '\t\n\r.,;:!?-_()[]\"", "é", "日", "本", "🎉", "\u00a0", "\u2003",
         "\x1c", "\u0301", "²", "一", "Ⅷ", "’", "\x85", "  ", "'s", "'ll", " 's"]


def test_pieces_tokenize_as_the_whole_text(tok: Tokenizer) -> None:
    rng = np.random.default_rng(2)
    for _ in range(400):
        text = "".join(NASTY[i] for i in rng.integers(0, len(NASTY), rng.integers(1, 200)))
        whole = tok.encode_ids(text).tolist()  # shorter than a piece: tokenized whole
        for size in (1, 2, 3, 7):
            parts = list(pieces(text, size, 10**9))
            assert "".join(parts) == text
            assert [t for p in parts for t in tok.encode_ids(p)] == whole, (text, size)


def test_encode_ids_of_a_long_text(tok: Tokenizer) -> None:
    unit = "Naïve café, it's 42 o'clock:\n\tdef f(x): return x ** 2  # 日本語 🎉\n"
    text = unit * (3 * CHUNK_CHARS // len(unit) + 2)
    assert len(list(pieces(text))) == 4
    ids = tok.encode_ids(text)
    assert ids.tolist() == [t for p in pieces(text, 101, 10**9) for t in tok.encode_ids(p)]
    assert tok.decode(ids.tolist()) == text
    assert tok.encode(text) == ids.tolist()
    first = tok.encode_ids(text, limit=10)  # stops after the first piece
    assert 10 < len(first) < len(ids) and first.tolist() == ids[:len(first)].tolist()


def test_a_run_that_cannot_be_cut_is_refused(tok: Tokenizer) -> None:
    n = MAX_RUN_CHARS  # the last piece may be up to this long
    assert len(list(pieces("a" * n))) == 1
    with pytest.raises(InvalidArgumentError, match=f"more than {n - CHUNK_CHARS} characters"):
        tok.encode_ids("a" * (n + 1))
    assert len(tok.encode_ids("a " * n)) > 0  # as long, with spaces: in pieces
