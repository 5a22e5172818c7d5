"""One lock per snapshot name, held while a commit of that name runs in this server, so
that concurrent Puts of one name take turns here instead of racing in the store (the
S3 backend's conditional manifest writes stay correct either way, but a store such as
SeaweedFS answers writers contending for one object in seconds rather than
milliseconds). Locks exist only while someone holds or waits for them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from snapshot_svc.errors import Unavailable


class NameLocks:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, list[int]]] = {}

    def users(self, name: str) -> int:
        """Commits of `name` holding or waiting for its lock now."""
        with self._lock:
            entry = self._locks.get(name)
            return entry[1][0] if entry else 0

    @contextmanager
    def hold(self, name: str) -> Iterator[None]:
        """The lock of `name`, waited for at most `timeout_s` (UNAVAILABLE after: the
        client retries)."""
        with self._lock:
            lock, users = self._locks.setdefault(name, (threading.Lock(), [0]))
            users[0] += 1
        try:
            if not lock.acquire(timeout=self.timeout_s):
                raise Unavailable(f"another commit of {name!r} held it for {self.timeout_s:g} s")
            try:
                yield
            finally:
                lock.release()
        finally:
            with self._lock:
                users[0] -= 1
                if not users[0]:
                    del self._locks[name]
