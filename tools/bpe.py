"""Byte-level BPE tokenizer (GPT-2 style) trained with ``tokenizers``.

``<|endoftext|>`` is the only special token, at id 0, used as BOS and EOS.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
EOT_ID = 0


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.token_to_id(EOT) != EOT_ID:
        raise RuntimeError(f"{EOT} must have id {EOT_ID}")
    return tok


def encode_all(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def tokens_per_byte(tok: Tokenizer, texts: list[str]) -> float:
    n_tokens = sum(len(ids) for ids in encode_all(tok, texts))
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return n_tokens / n_bytes


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer as GGUF ``gpt2`` metadata wants it."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]


TOKEN_NORMAL = 1
TOKEN_CONTROL = 3


def gguf_vocab(tok: Tokenizer) -> GgufVocab:
    """Tokens in id order (byte-level unicode strings), types and ranked merges."""
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for text, idx in vocab.items():
        tokens[idx] = text
    if any(t == "" for t in tokens):
        raise RuntimeError("token ids are not dense")
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    types = [TOKEN_CONTROL if t in specials else TOKEN_NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return GgufVocab(tokens, types, merges)
