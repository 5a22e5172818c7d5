"""Stream limits that fit a fleet: keyless callers are counted per host (not as one
caller), and a Put or Get beyond the limit waits for a free stream within its deadline
instead of failing at once. The limiter with a fake clock, then the service: four
replicas of four slots saving at once without keys."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from snapshot_svc.client import SnapshotClient
from snapshot_svc.clientlib.auth import Principal
from snapshot_svc.clientlib.streams import StreamLimit, caller_of, peer_host
from snapshot_svc.config import SnapshotConfig, parse_config
from snapshot_svc.errors import ResourceExhausted
from snapshot_svc.server import SnapshotServer
from snapshot_svc.testing import running_server
from tests.snapkit import blob

pytestmark = pytest.mark.timeout(120)

A1 = "ipv4:10.0.0.1:40001"  # replica 1, two connections
A1B = "ipv4:10.0.0.1:40002"
A2 = "ipv4:10.0.0.2:40001"  # replica 2


class FakeClock:
    """A clock that moves only when a waiter times out (`wait` advances it by the whole
    timeout) or when `nudge` says a real wake-up is due (a release in another thread)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.waits: list[float] = []
        self.real = False  # True: wait for a real notify (a few ms) instead of jumping

    def __call__(self) -> float:
        return self.now

    def wait(self, cond: threading.Condition, seconds: float) -> object:
        self.waits.append(seconds)
        if self.real:
            return cond.wait(0.01)
        self.now += seconds
        return False


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


def limit(clock: FakeClock, n: int = 2, max_waiting: int | None = None) -> StreamLimit:
    return StreamLimit(n, clock=clock, wait=clock.wait, max_waiting=max_waiting)


def test_peer_hosts_and_callers() -> None:
    assert peer_host(A1) == peer_host(A1B) == "10.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "::1"
    assert peer_host("ipv6:[fe80::1%eth0]:7") == "fe80::1%eth0"
    assert peer_host("unix:/tmp/s") == "unix:/tmp/s"
    assert caller_of(None, A1) == caller_of(None, A1B) == "peer 10.0.0.1"
    assert caller_of(None, "") == "keyless"
    # a key counts as itself wherever it calls from
    assert caller_of(Principal("namespace", "ns", "k1"), A1) == "key k1"


def test_keyless_callers_are_limited_per_host(clock: FakeClock) -> None:
    lim = limit(clock)
    with lim.hold(None, peer=A1), lim.hold(None, peer=A1B):
        with pytest.raises(ResourceExhausted) as err:
            with lim.hold(None, peer=A1):
                pass
        assert err.value.message == ("the keyless caller 10.0.0.1 has 2 streams open, the "
                                     "limit is 2 (--max-streams-per-key)")
        with lim.hold(None, peer=A2), lim.hold(None, peer=A2):  # another host: its own 2
            assert (lim.held("peer 10.0.0.1"), lim.held("peer 10.0.0.2")) == (2, 2)
    assert (lim.held("peer 10.0.0.1"), lim.held("peer 10.0.0.2")) == (0, 0)
    assert clock.waits == []  # wait_s 0: refused at once


def test_a_waiter_past_its_bound_gets_an_error_naming_the_limit(clock: FakeClock) -> None:
    lim = limit(clock)
    with lim.hold(None, peer=A1), lim.hold(None, peer=A1):
        with pytest.raises(ResourceExhausted) as err:
            with lim.hold(None, peer=A1B, wait_s=7.5):
                pass
    assert err.value.message == ("the keyless caller 10.0.0.1 has 2 streams open, the limit "
                                 "is 2 (--max-streams-per-key); none became free within 7.5 s")
    assert (clock.now, clock.waits) == (107.5, [7.5])
    assert lim.waiting("peer 10.0.0.1") == 0


def test_a_waiter_takes_the_stream_released_first(clock: FakeClock) -> None:
    lim = limit(clock, n=1)
    clock.real = True  # the release comes from this thread; the clock does not move
    first = lim.hold(None, peer=A1)
    first.__enter__()
    got = threading.Event()
    done = threading.Event()

    def waiter() -> None:
        with lim.hold(None, peer=A1, wait_s=30):
            got.set()
            done.wait(10)

    t = threading.Thread(target=waiter)
    t.start()
    for _ in range(1000):
        if lim.waiting("peer 10.0.0.1") == 1:
            break
        time.sleep(0.005)
    assert (lim.waiting("peer 10.0.0.1"), got.is_set()) == (1, False)
    first.__exit__(None, None, None)
    assert got.wait(10)
    assert (lim.held("peer 10.0.0.1"), lim.waiting("peer 10.0.0.1")) == (1, 0)
    done.set()
    t.join(10)
    assert clock.now == 100.0  # served before any bound passed


def test_waiters_are_bounded_per_caller(clock: FakeClock) -> None:
    """At most `max_waiting` calls of one caller wait (each holds a handler thread); one
    more is refused at once. Another host waits in a queue of its own."""
    lim = limit(clock, n=1, max_waiting=1)
    clock.real = True
    with lim.hold(None, peer=A1), lim.hold(None, peer=A2):

        def waiter(peer: str) -> None:
            with pytest.raises(ResourceExhausted):
                with lim.hold(None, peer=peer, wait_s=30):
                    pass

        threads = [threading.Thread(target=waiter, args=(p,)) for p in (A1, A2)]
        for t in threads:
            t.start()
        for _ in range(1000):
            if lim.waiting("peer 10.0.0.1") == lim.waiting("peer 10.0.0.2") == 1:
                break
            time.sleep(0.005)
        with pytest.raises(ResourceExhausted) as err:
            with lim.hold(None, peer=A1B, wait_s=30):
                pass
        assert err.value.message == ("the keyless caller 10.0.0.1 has 1 streams open, the "
                                     "limit is 1 (--max-streams-per-key)")
        clock.real = False  # the two waiters now time out (their bound passes)
        for t in threads:
            t.join(10)
    assert (lim.held("peer 10.0.0.1"), lim.waiting("peer 10.0.0.1")) == (0, 0)


def test_keys_keep_their_message(clock: FakeClock) -> None:
    lim = limit(clock, n=1)
    with lim.hold(Principal("namespace", "a", "k1"), peer=A1):
        with pytest.raises(ResourceExhausted) as err:
            with lim.hold(Principal("namespace", "a", "k1"), peer=A2):
                pass
        assert err.value.message == ("this key has 1 streams open, the limit is 1 "
                                     "(--max-streams-per-key)")
        with lim.hold(None, peer=A1):  # a keyless caller on the same host: its own budget
            pass


# --- the service ----------------------------------------------------------------------------


def _fleet_saves(srv: SnapshotServer, replicas: int, slots: int) -> list[Any]:
    """`replicas` clients (one channel each, as inference replicas) saving `slots`
    paired snapshots at once; every Put is held in the store until the service holds
    as many streams as it will admit, so the saves overlap for certain. Returns each
    save's generation or error."""
    gate = threading.Event()
    real_finish = srv.store.finish_put

    def held_finish(upload: Any) -> Any:
        gate.wait(30)
        return real_finish(upload)

    srv.store.finish_put = held_finish  # type: ignore[method-assign]
    out: list[Any] = []
    lock = threading.Lock()
    clients = [SnapshotClient(srv.address, timeout=30, retries=0) for _ in range(replicas)]
    for c in clients:
        c.server_info()

    def save(r: int, s: int) -> None:
        try:
            res: Any = clients[r].put(f"r{r}-slot{s}", blob(100 * r + s, 300_000),
                                      blob(7 + 100 * r + s, 20_000)).generation
        except ResourceExhausted as exc:
            res = exc
        with lock:
            out.append(res)

    threads = [threading.Thread(target=save, args=(r, s))
               for r in range(replicas) for s in range(slots)]
    for t in threads:
        t.start()
    streams = srv.servicer.streams
    total = replicas * slots
    admitted = min(total, streams.limit)
    waiting = min(total - admitted, streams.max_waiting) if srv.config.stream_wait_s else 0
    for _ in range(3000):  # every save has its stream, or is waiting, or was refused
        if (streams.held("peer 127.0.0.1") == admitted
                and streams.waiting("peer 127.0.0.1") == waiting
                and len(out) == total - admitted - waiting):
            break
        time.sleep(0.01)
    assert (streams.held("peer 127.0.0.1"), streams.waiting("peer 127.0.0.1")) == (admitted,
                                                                                   waiting)
    gate.set()
    for t in threads:
        t.join(60)
    for c in clients:
        c.close()
    return out


@pytest.fixture()
def fleet_server(tmp_path: Path) -> Iterator[SnapshotServer]:
    with running_server(tmp_path / "d") as srv:  # the default limits
        yield srv


def test_four_replicas_of_four_slots_save_without_keys(fleet_server: SnapshotServer) -> None:
    srv = fleet_server
    assert (srv.config.max_streams_per_key, srv.config.stream_wait_s) == (8, 30.0)
    out = _fleet_saves(srv, replicas=4, slots=4)
    failed = [r for r in out if not isinstance(r, int)]
    assert (len(out), failed) == (16, [])
    assert sorted(out) == [1] * 16
    assert len(srv.store.list()) == 16
    assert srv.metrics.rpcs.labels("Put", "RESOURCE_EXHAUSTED")._value.get() == 0


def test_without_waiting_the_same_saves_fail(tmp_path: Path) -> None:
    """The control: --stream-wait 0 refuses at once what the limit does not admit."""
    with running_server(tmp_path / "d", stream_wait_s=0) as srv:
        out = _fleet_saves(srv, replicas=4, slots=4)
    failed = [r for r in out if isinstance(r, ResourceExhausted)]
    assert (len(out), len(failed)) == (16, 8)
    assert {f.message for f in failed} == {"the keyless caller 127.0.0.1 has 8 streams open, "
                                           "the limit is 8 (--max-streams-per-key)"}


def test_a_wait_ends_with_the_calls_deadline(tmp_path: Path) -> None:
    """A Put that finds no stream waits no longer than its deadline allows, and its error
    names the limit."""
    cfg = SnapshotConfig(data_dir=tmp_path / "d", port=0, workers=4, max_streams_per_key=1,
                         stream_wait_s=60)
    with SnapshotServer(cfg) as srv:
        gate = threading.Event()
        real_finish = srv.store.finish_put
        srv.store.finish_put = lambda u: (gate.wait(30), real_finish(u))[1]  # type: ignore[method-assign]
        with SnapshotClient(srv.address, timeout=30, retries=0) as first, \
                SnapshotClient(srv.address, timeout=1.5, retries=0) as second:
            t = threading.Thread(target=first.put, args=("one", b"1"))
            t.start()
            streams = srv.servicer.streams
            for _ in range(1000):
                if streams.held("peer 127.0.0.1") == 1:
                    break
                time.sleep(0.005)
            t0 = time.monotonic()
            with pytest.raises(ResourceExhausted) as err:
                second.put("two", b"2")
            elapsed = time.monotonic() - t0
            gate.set()
            t.join(30)
        assert err.value.message.startswith(
            "the keyless caller 127.0.0.1 has 1 streams open, the limit is 1 "
            "(--max-streams-per-key); none became free within ")
        assert 0.8 < elapsed < 1.5  # the deadline (1.5 s) less the margin (0.5 s)
        assert srv.store.stat("one").generation == 1
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_stream_wait_flag_and_variable(tmp_path: Path) -> None:
    d = str(tmp_path)
    assert parse_config(["--data-dir", d]).stream_wait_s == 30.0
    assert parse_config(["--data-dir", d, "--stream-wait", "2.5"]).stream_wait_s == 2.5
    assert parse_config(["--data-dir", d], env={"WARMSLOT_SNAPSHOT_STREAM_WAIT": "0"}
                        ).stream_wait_s == 0.0
    with pytest.raises(ValueError, match="--stream-wait must be >= 0"):
        SnapshotConfig(data_dir=tmp_path, stream_wait_s=-1)
