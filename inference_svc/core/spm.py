"""SentencePiece-style BPE as llama.cpp runs it for a GGUF `llama` tokenizer (Gemma):
text split at user-defined tokens (longest first), spaces escaped to U+2581, then the
highest-scoring adjacent pair merged repeatedly (ties: leftmost); a character no token
holds becomes its UTF-8 bytes (<0xXX> tokens). The merging runs in the core
(native/spm.c) without the GIL: a long prompt takes no Python time in proportion to
its length, and the engine and gRPC threads keep running meanwhile."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import binding
from .errors import ModelLoadError

SPACE = "\u2581"
TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = range(1, 7)


class SPMTokenizer:
    def __init__(self, tokens: list[str], scores: list[float], types: list[int],
                 add_space_prefix: bool) -> None:
        if len(scores) != len(tokens) or len(types) != len(tokens):
            raise ModelLoadError("a 'llama' tokenizer needs a score and a type per token")
        self.tokens, self.scores, self.types = tokens, scores, types
        self.add_space_prefix = add_space_prefix
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.byte_ids = [self.vocab.get(f"<0x{b:02X}>", -1) for b in range(256)]
        if min(self.byte_ids) < 0:
            raise ModelLoadError("a 'llama' tokenizer needs the 256 byte tokens <0x00>..<0xFF>")
        # matched in the text whatever the caller asks about special tokens (llama.cpp
        # skips only control and unknown tokens when special tokens are not parsed)
        self.user_defined = sorted((t for t, ty in zip(tokens, types, strict=True)
                                    if ty == TYPE_USER_DEFINED and t), key=len, reverse=True)
        encoded = [t.encode("utf-8", "surrogatepass") for t in tokens]
        ends = np.cumsum([len(b) for b in encoded], dtype=np.uint64)
        self._native: Any = binding.spm_init(b"".join(encoded), ends,
                                             np.asarray(scores, dtype=np.float32),
                                             np.asarray(self.byte_ids, dtype=np.int32),
                                             len(tokens))

    def __del__(self) -> None:
        native, self._native = getattr(self, "_native", None), None
        if native is not None:
            binding.spm_free(native)

    def encode(self, text: str) -> list[int]:
        fragments: list[str | int] = [text]
        for tok in self.user_defined:
            split: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or tok not in frag:
                    split.append(frag)
                    continue
                parts = frag.split(tok)
                for i, part in enumerate(parts):
                    if i:
                        split.append(self.vocab[tok])
                    if part:
                        split.append(part)
            fragments = split
        out: list[int] = []
        for i, frag in enumerate(fragments):
            if isinstance(frag, int):
                out.append(frag)
            else:
                prefix = SPACE if self.add_space_prefix and i == 0 else ""
                out += self._bpe(prefix + frag.replace(" ", SPACE))
        return out

    def _bpe(self, text: str) -> list[int]:
        data = text.encode("utf-8", "surrogatepass")
        out = np.empty(len(data), dtype=np.int32)
        n = binding.spm_encode(self._native, data, out)
        return out[:n].tolist()

    def token_bytes(self, tid: int) -> bytes:
        typ, tok = self.types[tid], self.tokens[tid]
        if typ == TYPE_BYTE:
            return bytes([int(tok[3:5], 16)])
        if typ in (TYPE_CONTROL, TYPE_UNKNOWN, TYPE_UNUSED):
            return b""
        if typ == TYPE_USER_DEFINED:
            return tok.encode("utf-8")
        return tok.replace(SPACE, " ").encode("utf-8")
