"""The tokenizer of a GGUF file: byte-level BPE for its `gpt2` tokenizer metadata, or
SentencePiece-style BPE with byte fallback for `llama` (spm.py, as llama.cpp runs it).

Byte-level BPE encoding goes through the `tokenizers` package (BPE model, GPT-2
pre-tokenizer regex), a piece of the text at a time (chunks.py): the package's
bookkeeping per token (strings, offsets) grows with the text it is given, and its
batch call tokenizes without holding the GIL. Decoding maps every token to its bytes,
so a stream of tokens can be turned into text incrementally and any list of ids
decodes without raising.
"""

from __future__ import annotations

import re
from array import array
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from .chunks import pieces
from .errors import ModelLoadError
from .gguf_file import TokenizerData

if TYPE_CHECKING:
    from .spm import SPMTokenizer

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-ins for the 256 bytes."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


class Tokenizer:
    """Text <-> token ids for one model."""

    def __init__(self, data: TokenizerData) -> None:
        if data.model not in ("gpt2", "llama"):
            raise ModelLoadError(
                f"tokenizer model {data.model!r} is not supported (byte-level BPE 'gpt2' or "
                "SentencePiece BPE 'llama')"
            )
        self.data = data
        self.n_vocab = len(data.tokens)
        self.bos_id = data.bos_id
        self.eos_id = data.eos_id
        self.add_bos = data.add_bos and data.bos_id is not None
        self._spm: SPMTokenizer | None = None
        if data.model == "llama":
            from .spm import SPMTokenizer  # the compiled core's encoder: loaded on use

            self._spm = SPMTokenizer(data.tokens, data.scores, data.token_types,
                                     data.add_space_prefix)
            self._bytes = [self._spm.token_bytes(i) for i in range(self.n_vocab)]
            return
        vocab = {tok: i for i, tok in enumerate(data.tokens)}
        merges = []
        for m in data.merges:
            left, sep, right = m.partition(" ")
            if not sep:
                raise ModelLoadError(f"malformed tokenizer merge {m!r}")
            merges.append((left, right))
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        self._hf = hf
        self._bytes = self._token_bytes(data)

    @staticmethod
    def _token_bytes(data: TokenizerData) -> list[bytes]:
        table = unicode_to_byte()
        out = []
        for tok, typ in zip(data.tokens, data.token_types or [1] * len(data.tokens), strict=False):
            if typ == TOKEN_TYPE_CONTROL:
                out.append(b"")  # control tokens (BOS/EOS) have no text
            elif all(c in table for c in tok):
                out.append(bytes(table[c] for c in tok))
            else:
                out.append(tok.encode("utf-8"))
        out.extend(b"" for _ in range(len(data.tokens) - len(out)))
        return out

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of text; special-token strings are encoded as plain text. add_bos:
        BOS first when the model's file asks for it (tokenizer.ggml.add_bos_token)."""
        ids = self.encode_ids(text)
        return ([self.bos_id] if add_bos and self.add_bos else []) + ids.tolist()

    def encode_ids(self, text: str, limit: int | None = None) -> array[int]:
        """Token ids of text (no BOS) in a compact array. With `limit`, tokenizing
        stops once more than `limit` ids are known: the array then holds more than
        `limit` ids, a prefix of the text's. Raises InvalidArgumentError for a text
        that cannot be cut into pieces (chunks.pieces). A 'llama' tokenizer takes
        the text whole."""
        if self._spm is not None:
            return array("i", self._spm.encode(text))
        out = array("i")
        for piece in pieces(text):
            out.extend(self._hf.encode_batch([piece], add_special_tokens=False)[0].ids)
            if limit is not None and len(out) > limit:
                break
        return out

    @cached_property
    def special_tokens(self) -> dict[str, int]:
        """The control and user-defined tokens by their text (`<|im_start|>`): the tokens
        `encode_special` reads as themselves."""
        types = self.data.token_types or []
        return {tok: i for i, (tok, typ) in enumerate(zip(self.data.tokens, types, strict=False))
                if typ in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED) and tok}

    @cached_property
    def _special_index(self) -> tuple[re.Pattern[str] | None, dict[str, list[int]]]:
        """A pattern of the first characters of the special tokens and, per first
        character, their lengths, longest first."""
        lengths: dict[str, set[int]] = {}
        for tok in self.special_tokens:
            lengths.setdefault(tok[0], set()).add(len(tok))
        if not lengths:
            return None, {}
        first = re.compile("[" + "".join(re.escape(c) for c in sorted(lengths)) + "]")
        return first, {c: sorted(ls, reverse=True) for c, ls in lengths.items()}

    def split_special(self, text: str) -> list[str | int]:
        """Text cut at its special-token strings (the longest one at the leftmost place
        first): the text between them and the ids of the special tokens, in order."""
        first, lengths = self._special_index
        special = self.special_tokens
        out: list[str | int] = []
        start = pos = 0
        while first is not None:
            m = first.search(text, pos)
            if m is None:
                break
            i = m.start()
            hit = next((text[i:i + n] for n in lengths[text[i]]
                        if text[i:i + n] in special), None)
            if hit is None:
                pos = i + 1
                continue
            if start < i:
                out.append(text[start:i])
            out.append(special[hit])
            start = pos = i + len(hit)
        if start < len(text):
            out.append(text[start:])
        return out

    def encode_special(self, text: str) -> list[int]:
        """Token ids of text in which special-token strings are those tokens and the text
        between them is encoded as `encode` does. For text a chat template wrote, never
        for what a user wrote."""
        return self.encode_parts(self.split_special(text))

    def encode_parts(self, parts: list[str | int]) -> list[int]:
        """Token ids of text pieces and token ids; adjacent pieces are encoded as one."""
        out: list[int] = []
        run: list[str] = []
        for p in [*parts, -1]:
            if isinstance(p, str):
                run.append(p)
                continue
            if run:
                out += self.encode("".join(run))
                run = []
            if p >= 0:
                out.append(p)
        return out

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token; b'' for control tokens and ids outside the vocabulary."""
        if 0 <= token_id < self.n_vocab:
            return self._bytes[token_id]
        return b""

    def decode_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self.token_bytes(int(i)) for i in ids)

    def decode(self, ids: list[int]) -> str:
        """Text of any ids: unknown ids are skipped, broken UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._pending = b""

    def push(self, token_id: int) -> str:
        self._pending += self._tok.token_bytes(token_id)
        return self._take(final=False)

    def flush(self) -> str:
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        data = self._pending
        if final:
            self._pending = b""
            return data.decode("utf-8", errors="replace")
        # keep at most 3 trailing bytes of an unfinished multi-byte sequence
        cut = len(data)
        for back in range(1, min(4, len(data)) + 1):
            b = data[-back]
            if b & 0xC0 == 0x80:
                continue  # a continuation byte: look further back for the lead
            if b & 0x80:
                need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4
                if need > back:
                    cut = len(data) - back
            break
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")
