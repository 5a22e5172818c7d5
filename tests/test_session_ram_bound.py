"""The RAM tier never holds more bytes than `--session-ram-mb` allows, not even for an
instant: a session goes in only after the least recently used ones went to the store,
and one that cannot fit goes to the store itself. Every insertion into the tier is
watched, and the bytes it holds are counted exactly. The store writes that make room run
on the session writer, never on the engine thread: each check waits for the writer to
settle (SessionHost.settle, bounded) before it looks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient
from inference_svc.errors import Unavailable
from inference_svc.sessions import host as session_host
from inference_svc.sessions.host import Held, SessionHost
from tests.fixtures.servicekit import running
from tests.resumekit import wait_until
from tests.test_sessions import RAM, SLOT, STORE, N, client, config, listed, store_files, turn

PROMPT_LEN = 12
PROMPT = list(range(10, 10 + PROMPT_LEN))


class Watched(dict[str, Held]):
    """The RAM tier's dict, recording the bytes it holds after every insertion."""

    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        self.seen = seen

    def __setitem__(self, key: str, value: Held) -> None:
        super().__setitem__(key, value)
        self.seen.append(sum(h.size for h in self.values()))


def host(srv: Server) -> SessionHost:
    h = srv._sessions
    assert h is not None
    return h


def watch(srv: Server, ram_bytes: int) -> list[int]:
    h = host(srv)
    seen: list[int] = []
    with h._lock:
        assert not h._ram
        h.ram_bytes = ram_bytes
        h._ram = Watched(seen)
    return seen


def session_size(tmp_path: Path) -> int:
    """The bytes of one session of PROMPT_LEN + N tokens in the tier."""
    with running(config(slot_save_path=tmp_path / "probe")) as srv, client(srv) as c:
        prompt = list(range(10, 10 + PROMPT_LEN))
        turn(c, "x", prompt)
        turn(c, "y", prompt)
        h = host(srv)
        (held,) = h._ram.values()
        assert h._ram_used == held.size > 0
        return held.size


def three_sessions(tmp_path: Path, ram_bytes: int) -> tuple[list[int], dict, int, list[str]]:
    """a, b, c in turn through one slot: a and b are moved out. What the tier held after
    each insertion, the listing, the tier's bytes and the store's files at the end."""
    with running(config(slot_save_path=tmp_path / "s")) as srv, client(srv) as c:
        seen = watch(srv, ram_bytes)
        prompt = list(range(10, 10 + PROMPT_LEN))
        for name in "abc":
            turn(c, name, prompt)
            assert host(srv).settle(30)
        return list(seen), listed(c), host(srv)._ram_used, store_files(tmp_path / "s")


def test_the_tier_holds_exactly_what_fits(tmp_path: Path) -> None:
    size = session_size(tmp_path)
    n = PROMPT_LEN + N
    seen, rows, used, files = three_sessions(tmp_path, 2 * size)  # room for two
    assert (seen, used) == ([size, 2 * size], 2 * size)
    assert rows == {"a": (n, RAM), "b": (n, RAM), "c": (n, SLOT)}
    assert files == []


def test_the_least_recently_used_goes_to_the_store_before_the_next_comes_in(
        tmp_path: Path) -> None:
    size = session_size(tmp_path)
    n = PROMPT_LEN + N
    seen, rows, used, files = three_sessions(tmp_path, 2 * size - 1)  # room for one
    assert (seen, used) == ([size, size], size)  # never 2 * size, not even briefly
    assert rows == {"a": (n, STORE), "b": (n, RAM), "c": (n, SLOT)}
    assert files == ["session~~a", "session~~a.drft"]


def test_a_session_bigger_than_the_tier_goes_to_the_store_itself(tmp_path: Path) -> None:
    size = session_size(tmp_path)
    n = PROMPT_LEN + N
    seen, rows, used, files = three_sessions(tmp_path, size - 1)
    assert (seen, used) == ([], 0)
    assert rows == {"a": (n, STORE), "b": (n, STORE), "c": (n, SLOT)}
    assert files == ["session~~a", "session~~a.drft", "session~~b",
                                           "session~~b.drft"]


@dataclass
class Refusing:
    """A service whose store refuses every write until accept() is called."""

    c: InferenceClient
    host: SessionHost
    seen: list[int]  # the tier's bytes after each insertion
    calls: list[str]  # the names the refused writes were for, in order
    threads: set[str]  # the threads that tried them
    accept: Callable[[], None]  # the store takes writes again

    def turn(self, name: str) -> None:
        """A turn of session `name`, then the writer settled."""
        turn(self.c, name, PROMPT)
        assert self.host.settle(30)


@contextmanager
def refused_after_two_sessions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               size: int) -> Iterator[Refusing]:
    """A tier with room for one session of size bytes; sessions a and b (a turn each)
    while the store takes writes, then the store refuses them."""
    with running(config(slot_save_path=tmp_path / "s")) as srv, client(srv) as c:
        seen = watch(srv, 2 * size - 1)
        h = host(srv)
        store = h.store
        assert store is not None
        real = store.save
        calls: list[str] = []
        threads: set[str] = set()

        def refused(name: str, *args: object, **kw: object) -> int:
            calls.append(name)
            threads.add(threading.current_thread().name)
            raise Unavailable("injected: the store is down")

        turn(c, "a", PROMPT)
        turn(c, "b", PROMPT)
        assert h.settle(30)
        monkeypatch.setattr(store, "save", refused)
        yield Refusing(c, h, seen, calls, threads,
                       lambda: monkeypatch.setattr(store, "save", real))


def test_a_session_the_store_refuses_is_kept_beyond_the_bound_until_it_takes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one exception: a full tier and a store that refuses writes keep the session in
    RAM (never lost); once the store takes writes again the tier is back within bound."""
    monkeypatch.setattr(session_host, "SPILL_RETRY_S", 0.05)
    size = session_size(tmp_path)
    n = PROMPT_LEN + N
    with refused_after_two_sessions(tmp_path, monkeypatch, size) as r:
        r.turn("c")
        assert (r.seen, r.host._ram_used) == ([size, 2 * size], 2 * size)
        assert listed(r.c) == {"a": (n, RAM), "b": (n, RAM), "c": (n, SLOT)}
        r.accept()
        wait_until(lambda: r.host._ram_used == size)
        assert listed(r.c) == {"a": (n, STORE), "b": (n, RAM), "c": (n, SLOT)}
        assert store_files(tmp_path / "s") == ["session~~a", "session~~a.drft"]


def test_no_store_write_is_tried_on_the_engine_thread_nor_right_after_a_failed_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer makes room, not the engine thread; after a failed write, sessions
    displaced within SPILL_RETRY_S try no store write: they are kept beyond the bound at
    once."""
    monkeypatch.setattr(session_host, "SPILL_RETRY_S", 600.0)  # the writer does not retry
    size = session_size(tmp_path)
    with refused_after_two_sessions(tmp_path, monkeypatch, size) as r:
        r.turn("c")  # one write tried (a, to make room for b), refused
        r.turn("d")  # none tried: c is kept at once
        assert r.calls == ["session~~a"]
        assert r.threads == {"warmslot-sessions"}
        assert (r.seen, r.host._ram_used) == ([size, 2 * size, 3 * size], 3 * size)
        r.accept()
