"""SHA-256 of a stream of chunks, computed on a helper thread while the caller goes on.

Hashing (SHA-256) on the thread that receives the chunks would delay every next
chunk. hashlib releases the GIL, so a helper thread hashes while the receiving
thread waits for gRPC.

    with StreamDigest() as d:
        for chunk in chunks:
            d.update(chunk)        # the chunk must not change until it is hashed
        hex_digest = d.hexdigest()

`mark()` records the digest of everything so far while the stream goes on: one
pass also gives the digest of a prefix, e.g. of a file without its trailing
checksum.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from concurrent import futures


class StreamDigest:
    """In-order SHA-256 on one helper thread. At most `max_pending` chunks wait to be
    hashed (then `update` waits), so a slow hasher cannot make the caller hold
    unbounded memory."""

    def __init__(self, max_pending: int = 4) -> None:
        self._hash = hashlib.sha256()
        self._max_pending = max_pending
        self._pending: deque[futures.Future[None]] = deque()
        self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="sha256")
        self._marks: list[str] = []

    def _submit(self, fn: Callable[..., object], *args: object) -> None:
        while self._pending and (len(self._pending) >= self._max_pending
                                 or self._pending[0].done()):
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(fn, *args))

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._submit(self._hash.update, data)

    def mark(self) -> None:
        self._submit(lambda: self._marks.append(self._hash.copy().hexdigest()))

    def _drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def hexdigest(self) -> str:
        self._drain()
        return self._hash.hexdigest()

    def marks(self) -> list[str]:
        """The digests recorded by `mark`, in order."""
        self._drain()
        return list(self._marks)

    def close(self) -> None:
        """Stops the helper (idempotent): chunks not yet hashed are dropped."""
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> StreamDigest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
