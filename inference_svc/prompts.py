"""Tokenization of request text, bounded: a text over --max-prompt-bytes is refused
before it is tokenized, tokenization runs on a small pool of its own threads (not on
the gRPC handler threads, so a flood of large prompts cannot hold up other calls; the
tokenizer works a piece of the text at a time without holding the GIL, so its memory
does not grow with the text and the handlers keep running), a bounded number of texts
wait for it, and the memory a large text took is given back to the system
afterwards."""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING, Any, TypeVar

from inference_svc.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from snapshot_svc.clientlib import malloc

if TYPE_CHECKING:
    from inference_svc.core import Tokenizer

TRIM_ABOVE_BYTES = 256 << 10  # texts at least this large: malloc_trim afterwards
WAIT_S = 120.0  # longest a text waits for and takes in the pool

T = TypeVar("T")


class BoundedTokenizer:
    """A Tokenizer whose `encode` and `encode_ids` are bounded as above; everything else
    is the wrapped tokenizer's."""

    def __init__(self, tokenizer: Tokenizer, max_bytes: int, threads: int,
                 max_waiting: int) -> None:
        self._tok = tokenizer
        self.max_bytes = max_bytes
        self._pool = futures.ThreadPoolExecutor(max_workers=threads,
                                                thread_name_prefix="tokenize")
        self._admitted = threading.BoundedSemaphore(threads + max_waiting)
        self._trim = malloc.trimmer()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def _call(self, fn: Callable[[], T], size: int) -> T:
        try:
            return fn()
        finally:
            if size >= TRIM_ABOVE_BYTES:
                self._trim()

    def run(self, fn: Callable[[], T], size: int) -> T:
        """fn() on the tokenizing pool, bounded as `encode`: for work that tokenizes
        `size` bytes of request text in several pieces (a chat conversation)."""
        if size > self.max_bytes:
            raise InvalidArgument(f"the text is {size} bytes, the limit is {self.max_bytes} "
                                  "(--max-prompt-bytes)")
        if not self._admitted.acquire(blocking=False):
            raise ResourceExhausted("too many texts waiting to be tokenized; retry later")
        try:
            return self._pool.submit(self._call, fn, size).result(timeout=WAIT_S)
        except futures.TimeoutError:
            raise DeadlineExceeded(f"tokenizing took longer than {WAIT_S:g} s") from None
        finally:
            self._admitted.release()

    def encode(self, text: str) -> list[int]:
        return self.encode_ids(text).tolist()

    def encode_ids(self, text: str, limit: int | None = None) -> array[int]:
        """The text's token ids (Tokenizer.encode_ids: with `limit`, more than `limit`
        ids means the text has more than `limit` tokens)."""
        size = len(text.encode("utf-8", "surrogatepass"))
        return self.run(lambda: self._tok.encode_ids(text, limit), size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
