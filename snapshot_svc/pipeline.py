"""Work handed to a helper thread in order, so a transfer's thread can go on.

A 64 MiB transfer on 2 cores spends ~37 ms hashing (SHA-256); done on the thread
that receives the chunks, it delays every next chunk. hashlib releases the GIL,
so a helper thread hashes while the receiving thread waits for gRPC (a Put of
64 MiB: +17-19 % throughput, measured A/B with the server hashing inline).

    with StreamDigest() as d:                  # SHA-256 on a helper thread
        for chunk in chunks:
            d.update(chunk)                    # the chunk must not change until hashed
        hex_digest = d.hexdigest()

`OrderedWorker` is the general form: calls run one at a time in submission
order; the first one to fail stops the rest, and its exception is raised by
the next `submit` or by `drain`.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from concurrent import futures
from typing import Any


class OrderedWorker:
    """One helper thread running calls in order; at most `max_pending` queued (then
    `submit` waits), so a slow helper cannot make its caller hold unbounded memory."""

    def __init__(self, name: str, max_pending: int = 4) -> None:
        self._max_pending = max_pending
        self._pending: deque[futures.Future[None]] = deque()
        self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._failed = False

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if self._failed:  # an earlier call failed: the rest would act on a broken state
            return
        try:
            fn(*args)
        except BaseException:
            self._failed = True
            raise

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queues fn(*args); raises the exception of an earlier call that failed."""
        while self._pending and (len(self._pending) >= self._max_pending
                                 or self._pending[0].done()):
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._run, fn, args))

    def drain(self) -> None:
        """Waits for every queued call; raises the first failure."""
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        """Stops the helper (idempotent): calls not started are dropped, a running one
        is waited for."""
        self._failed = True
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> OrderedWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamDigest:
    """SHA-256 of a stream of chunks, computed in order on a helper thread.

    `mark()` records the digest of everything so far (the stream goes on): one pass
    gives the digest of a prefix too, e.g. of a file without its trailing checksum."""

    def __init__(self, max_pending: int = 4) -> None:
        self._hash = hashlib.sha256()
        self._worker = OrderedWorker("sha256", max_pending)
        self._marks: list[str] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._worker.submit(self._hash.update, data)

    def mark(self) -> None:
        self._worker.submit(lambda: self._marks.append(self._hash.copy().hexdigest()))

    def hexdigest(self) -> str:
        self._worker.drain()
        return self._hash.hexdigest()

    def marks(self) -> list[str]:
        """The digests recorded by `mark`, in order."""
        self._worker.drain()
        return list(self._marks)

    def close(self) -> None:
        self._worker.close()

    def __enter__(self) -> StreamDigest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
