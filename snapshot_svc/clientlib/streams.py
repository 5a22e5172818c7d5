"""The per-key limits of concurrent calls (streaming calls, and unary calls), used by
both services."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from snapshot_svc.clientlib.auth import Principal
from snapshot_svc.clientlib.errors import ResourceExhausted


class StreamLimit:
    """At most `limit` streaming calls at once per API key (all callers share one count
    when no keys are configured); with fewer than the server's handler threads, another
    key always finds a thread."""

    def __init__(self, limit: int, what: str = "streams open",
                 flag: str = "--max-streams-per-key") -> None:
        self.limit = limit
        self._what, self._flag = what, flag
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}

    def held(self, key_id: str) -> int:
        """Calls the key `key_id` has running now."""
        with self._lock:
            return self._open.get(key_id, 0)

    @contextmanager
    def hold(self, principal: Principal | None) -> Iterator[None]:
        who = principal.key_id if principal is not None else ""
        with self._lock:
            n = self._open.get(who, 0)
            if n >= self.limit:
                raise ResourceExhausted(f"this key has {n} {self._what}, the limit is "
                                        f"{self.limit} ({self._flag})")
            self._open[who] = n + 1
        try:
            yield
        finally:
            with self._lock:
                self._open[who] -= 1
                if not self._open[who]:
                    del self._open[who]
