"""The per-caller limits of concurrent calls (streaming calls, and unary calls), used by
both services.

A caller is its API key; without keys, the host it connects from (`peer_host` of
gRPC's `context.peer()`), so that replicas on different hosts each get the limit
instead of sharing one. A call that finds its caller's limit reached may wait for a
free place (`wait_s`, bounded by the call's deadline); at most `max_waiting` calls of
one caller wait at once (each holds a handler thread while it waits), so that one
caller's running and waiting calls together leave threads to the others."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from snapshot_svc.clientlib.auth import Principal
from snapshot_svc.clientlib.errors import ResourceExhausted

# (condition, seconds): waits on the condition (held) at most that long. Replaced by a
# fake in tests that drive the clock themselves.
Wait = Callable[[threading.Condition, float], object]


def _wait(cond: threading.Condition, seconds: float) -> object:
    return cond.wait(seconds)


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string: "ipv4:10.0.0.5:4242" -> "10.0.0.5",
    "ipv6:[::1]:4242" -> "::1"; anything else (a unix socket...) as it is."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        host = rest.rsplit(":", 1)[0]
        return host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return peer


def caller_of(principal: Principal | None, peer: str = "") -> str:
    """Whose budget a call counts against: its key, else the host it comes from."""
    if principal is not None:
        return f"key {principal.key_id}"
    return f"peer {peer_host(peer)}" if peer else "keyless"


def _label(who: str) -> str:
    """How an error names the caller (a key is not named: the caller knows its own)."""
    if who.startswith("key "):
        return "this key"
    if who.startswith("peer "):
        return f"the keyless caller {who[5:]}"
    return "the keyless callers"


class StreamLimit:
    """At most `limit` calls at once per caller (`caller_of`); with fewer than the
    server's handler threads, another caller always finds a thread."""

    def __init__(self, limit: int, what: str = "streams open",
                 flag: str = "--max-streams-per-key", *, max_waiting: int | None = None,
                 clock: Callable[[], float] = time.monotonic, wait: Wait = _wait) -> None:
        self.limit = limit
        self.max_waiting = limit if max_waiting is None else max_waiting
        self._what, self._flag = what, flag
        self._clock, self._wait = clock, wait
        self._cond = threading.Condition()
        self._open: dict[str, int] = {}
        self._waiting: dict[str, int] = {}

    def held(self, who: str) -> int:
        """Calls the caller `who` (`caller_of`, or a bare key id) has running now."""
        with self._cond:
            return self._open.get(who, self._open.get(f"key {who}", 0))

    def waiting(self, who: str) -> int:
        """Calls of `who` waiting for a place now."""
        with self._cond:
            return self._waiting.get(who, 0)

    @contextmanager
    def hold(self, principal: Principal | None, *, peer: str = "",
             wait_s: float = 0.0) -> Iterator[None]:
        """A place for one call of the caller, waited for at most `wait_s` seconds;
        RESOURCE_EXHAUSTED naming the limit when none frees up by then."""
        who = caller_of(principal, peer)
        self._take(who, wait_s)
        try:
            yield
        finally:
            with self._cond:
                self._open[who] -= 1
                if not self._open[who]:
                    del self._open[who]
                self._cond.notify_all()

    def _take(self, who: str, wait_s: float) -> None:
        with self._cond:
            n = self._open.get(who, 0)
            if n < self.limit:
                self._open[who] = n + 1
                return
            if wait_s <= 0 or self._waiting.get(who, 0) >= self.max_waiting:
                raise ResourceExhausted(f"{_label(who)} has {n} {self._what}, the limit is "
                                        f"{self.limit} ({self._flag})")
            end = self._clock() + wait_s
            self._waiting[who] = self._waiting.get(who, 0) + 1
            try:
                while self._open.get(who, 0) >= self.limit:
                    left = end - self._clock()
                    if left <= 0:
                        raise ResourceExhausted(
                            f"{_label(who)} has {self._open.get(who, 0)} {self._what}, the "
                            f"limit is {self.limit} ({self._flag}); none became free within "
                            f"{wait_s:.3g} s")
                    self._wait(self._cond, left)
                self._open[who] = self._open.get(who, 0) + 1
            finally:
                self._waiting[who] -= 1
                if not self._waiting[who]:
                    del self._waiting[who]
