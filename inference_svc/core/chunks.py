"""Cutting a text into pieces that tokenize, one after the other, into exactly the
tokens of the whole text, for byte-level BPE behind the GPT-2 pre-tokenizer regex

    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+

BPE merges only inside one regex match, and the matches tile the text, so a cut where
a match always ends and the next one always starts changes nothing. Between
characters a and b that is the case when a is not white space, a is not an
apostrophe (it may start a contraction: 's), and a and b are of different classes
(letter, number, white space, other): no alternative of the regex runs on from a
letter, a number or an `other` character into a character of another class, and
none starts with a non-space character followed by a space. A white-space b must be
one of space, tab, CR or LF (white space by any definition), so that Python's and
the regex engine's ideas of white space cannot disagree at a cut."""

from __future__ import annotations

from collections.abc import Iterator

from .errors import InvalidArgumentError

CHUNK_CHARS = 32 << 10  # characters per piece, about; a piece's tokenizing memory
MAX_RUN_CHARS = 256 << 10  # a piece may grow to this while no cut is found
_LETTER, _NUMBER, _SPACE, _OTHER = range(4)
_CUT_SPACES = frozenset(" \t\n\r")


def _kind(c: str) -> int:
    if c.isalpha():  # the categories L* = \p{L}
        return _LETTER
    if c.isnumeric():  # Nd, Nl, No (and numerals that are not letters) = \p{N}
        return _NUMBER
    if c.isspace():  # a superset of Unicode White_Space (= the regex's \s)
        return _SPACE
    return _OTHER


def cut_after(text: str, pos: int, end: int) -> int | None:
    """The first index i in [pos, end) where the text can be cut (text[:i], text[i:]),
    or None."""
    pos = max(pos, 1)
    if pos >= end:
        return None
    prev = _kind(text[pos - 1])
    for i in range(pos, end):
        a, b = text[i - 1], text[i]
        kind = _kind(b)
        if (prev != _SPACE and prev != kind and a != "'"
                and (kind != _SPACE or b in _CUT_SPACES)):
            return i
        prev = kind
    return None


def pieces(text: str, size: int = CHUNK_CHARS,
           max_run: int = MAX_RUN_CHARS) -> Iterator[str]:
    """The text in pieces of about `size` characters, cut where the tokens do not
    change. Raises InvalidArgumentError for a stretch of more than `max_run`
    characters with no place to cut (one character class throughout, e.g. 300 000
    letters without a space): tokenizing it would take memory in proportion to it."""
    start, n = 0, len(text)
    while n - start > size:
        cut = cut_after(text, start + size, min(n, start + max_run))
        if cut is None:
            if n - start <= max_run:
                break
            raise InvalidArgumentError(
                f"the text holds a run of more than {max_run - size} characters with no "
                "space, punctuation or change between letters and digits (after "
                f"character {start + size}); it cannot be tokenized in bounded memory")
        yield text[start:cut]
        start = cut
    yield text[start:]
