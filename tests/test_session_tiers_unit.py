"""The RAM tier of SessionHost on a fake engine and slot owner, without the compiled core:
a displaced session goes in when it fits; when it does not, the session writer makes room
(without a store, by dropping the least recently used) or drops the one that can never fit;
the engine thread only hands the state over. Exact bytes, order and counts; the writer's
work is awaited with SessionHost.settle (bounded), never with a sleep."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from inference_svc.metrics import Metrics
from inference_svc.sessions.host import SessionHost
from inference_svc.sessions.listing import TIER_RAM

T = TypeVar("T")


@dataclass(frozen=True)
class FakeState:
    """What SlotOwner.capture returns, for a state of `size` bytes."""

    size: int
    n_tokens: int

    @property
    def target(self) -> memoryview:
        return memoryview(bytes(self.size))

    @property
    def draft(self) -> None:
        return None

    def target_parts(self) -> tuple[bytes, bytes, bytes]:
        return b"", b"", bytes(self.size)


class FakeOwner:
    """Slots holding a state of a given size; capture records the thread it ran on."""

    def __init__(self) -> None:
        self.states: dict[int, FakeState] = {}
        self.captured_on: list[str] = []

    def n_tokens(self, slot: int) -> int:
        state = self.states.get(slot)
        return state.n_tokens if state is not None else 0

    def capture(self, slot: int) -> FakeState:
        self.captured_on.append(threading.current_thread().name)
        return self.states[slot]

    def clear(self, slot: int) -> int:
        state = self.states.pop(slot, None)
        return state.n_tokens if state is not None else 0


class FakeEngine:
    """The engine's side SessionHost uses: no slot bound to a session, calls run inline."""

    def __init__(self) -> None:
        self.owner = FakeOwner()
        self.last_used: dict[int, int] = {}

    def call(self, fn: Callable[[], T]) -> T:
        return fn()

    def session_resident(self, key: str) -> bool:
        return False

    def resident_keys(self) -> set[str]:
        return set()

    def resident_sessions(self) -> list[Any]:
        return []

    def slot_last_used_ms(self, slot: int) -> int:
        return self.last_used[slot]


@dataclass
class FakeSlots:
    """SlotManager's side SessionHost uses: no store."""

    store: None = None
    target_spec: None = None
    draft_spec: None = None


@contextmanager
def host(ram_bytes: int) -> Iterator[tuple[SessionHost, FakeEngine, Metrics]]:
    engine, metrics = FakeEngine(), Metrics()
    h = SessionHost(engine, FakeSlots(), ram_bytes, metrics)  # type: ignore[arg-type]
    try:
        yield h, engine, metrics
    finally:
        h.close()


def displace(h: SessionHost, engine: FakeEngine, name: str, size: int, used_ms: int) -> None:
    """Session `name` (a state of `size` bytes, last used at `used_ms`) moved out of slot 0
    as the engine thread does, then the writer settled."""
    engine.owner.states[0] = FakeState(size, n_tokens=size // 10)
    engine.last_used[0] = used_ms
    h.evict(0, f"session~~{name}")
    engine.owner.clear(0)
    assert h.settle(10)


def tier(h: SessionHost) -> dict[str, int]:
    with h._lock:
        return {k.removeprefix("session~~"): v.size for k, v in h._ram.items()}


def dropped(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value(
        "warmslot_session_evictions_total", {"kind": "dropped"}) or 0.0


def test_sessions_that_fit_go_in_as_they_come() -> None:
    with host(ram_bytes=300) as (h, engine, metrics):
        displace(h, engine, "a", 100, used_ms=1)
        displace(h, engine, "b", 200, used_ms=2)
        assert tier(h) == {"a": 100, "b": 200} and h._ram_used == 300
        assert dropped(metrics) == 0
        rows = {r.key.name: (r.n_tokens, r.tier, r.last_used_ms) for r in h.list(None)}
        assert rows == {"a": (10, TIER_RAM, 1), "b": (20, TIER_RAM, 2)}


def test_without_a_store_the_least_recently_used_makes_room() -> None:
    with host(ram_bytes=300) as (h, engine, metrics):
        displace(h, engine, "a", 100, used_ms=5)
        displace(h, engine, "b", 150, used_ms=1)  # older than a
        displace(h, engine, "c", 100, used_ms=9)
        assert tier(h) == {"a": 100, "c": 100} and h._ram_used == 200
        assert dropped(metrics) == 1


def test_a_session_bigger_than_the_tier_is_dropped_itself() -> None:
    with host(ram_bytes=300) as (h, engine, metrics):
        displace(h, engine, "a", 100, used_ms=1)
        displace(h, engine, "big", 301, used_ms=2)
        assert tier(h) == {"a": 100} and h._ram_used == 100
        assert dropped(metrics) == 1
        assert {r.key.name for r in h.list(None)} == {"a"}


def test_the_engine_thread_only_captures_the_writer_makes_room() -> None:
    """The capture runs on the caller (the engine thread); the drop that makes room runs
    on the session writer: the caller returns before it with the session beside the tier,
    where listing and a turn of it find it."""
    with host(ram_bytes=100) as (h, engine, metrics):
        displace(h, engine, "a", 100, used_ms=1)
        with h._lock:  # the writer cannot take the lock: it makes no room meanwhile
            engine.owner.states[0] = FakeState(100, n_tokens=10)
            engine.last_used[0] = 2
            h.evict(0, "session~~b")
            assert set(h._ram) == {"session~~a"} and h._ram_used == 100
            assert h._staged["session~~b"].awaiting
        assert h.settle(10)
        assert tier(h) == {"b": 100} and dropped(metrics) == 1
        assert engine.owner.captured_on == [threading.current_thread().name] * 2
