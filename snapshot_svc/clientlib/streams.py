"""The per-key limit of concurrent streaming calls, used by both services."""

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

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}

    @contextmanager
    def hold(self, principal: Principal | None) -> Iterator[None]:
        who = principal.key_id if principal is not None else ""
        with self._lock:
            n = self._open.get(who, 0)
            if n >= self.limit:
                raise ResourceExhausted(f"this key has {n} streams open, the limit is "
                                        f"{self.limit} (--max-streams-per-key)")
            self._open[who] = n + 1
        try:
            yield
        finally:
            with self._lock:
                self._open[who] -= 1
                if not self._open[who]:
                    del self._open[who]
