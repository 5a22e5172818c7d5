"""The transfer helpers of the snapshot service: in-order helper threads, the
streamed SHA-256, the recycled receive buffers and the allocator settings."""

from __future__ import annotations

import gc
import hashlib
import os
import threading
import time

import pytest

from snapshot_svc.buffers import POOL_MIN_BYTES, BufferPool
from snapshot_svc.memory import tune_malloc
from snapshot_svc.pipeline import OrderedWorker, StreamDigest

MIB = 1 << 20


def test_worker_runs_calls_in_order_on_one_other_thread() -> None:
    seen: list[tuple[int, str]] = []
    with OrderedWorker("t", max_pending=3) as w:
        for i in range(50):
            w.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
        w.drain()
    assert [i for i, _ in seen] == list(range(50))
    names = {n for _, n in seen}
    assert len(names) == 1 and threading.current_thread().name not in names


def test_worker_raises_the_first_failure_and_skips_the_rest() -> None:
    ran: list[int] = []

    def step(i: int) -> None:
        if i == 2:
            raise OSError(28, "disk full")
        ran.append(i)

    w = OrderedWorker("t", max_pending=8)
    for i in range(5):
        w.submit(step, i)
    with pytest.raises(OSError, match="disk full"):
        w.drain()
    assert ran == [0, 1]  # 3 and 4 came after the failure: skipped
    w.close()


def test_failure_surfaces_at_a_later_submit() -> None:
    w = OrderedWorker("t", max_pending=1)
    w.submit(lambda: (_ for _ in ()).throw(ValueError("bad chunk")))
    with pytest.raises(ValueError, match="bad chunk"):
        for _ in range(3):  # the queue holds one call: the second submit waits for it
            w.submit(lambda: None)
    w.close()


def test_worker_bounds_what_is_queued() -> None:
    gate = threading.Event()
    w = OrderedWorker("t", max_pending=2)
    w.submit(gate.wait)
    w.submit(lambda: None)
    blocked = threading.Thread(target=w.submit, args=(lambda: None,))
    blocked.start()
    time.sleep(0.2)
    assert blocked.is_alive()  # a third call waits until the first is done
    gate.set()
    blocked.join(5)
    assert not blocked.is_alive()
    w.drain()
    w.close()


def test_close_drops_what_has_not_started() -> None:
    gate = threading.Event()
    ran: list[int] = []
    w = OrderedWorker("t", max_pending=8)
    w.submit(gate.wait)
    for i in range(4):
        w.submit(ran.append, i)
    threading.Timer(0.1, gate.set).start()
    w.close()
    w.close()  # idempotent
    assert ran == []


@pytest.mark.parametrize("sizes", [[], [0], [1, 2, 3], [MIB, 7, MIB + 1, 0, 5000]])
def test_stream_digest_is_sha256_of_the_concatenation(sizes: list[int]) -> None:
    chunks = [os.urandom(n) for n in sizes]
    with StreamDigest(max_pending=2) as d:
        for c in chunks:
            d.update(memoryview(c))
        assert d.hexdigest() == hashlib.sha256(b"".join(chunks)).hexdigest()


def test_stream_digest_marks_prefixes() -> None:
    a, b, c = os.urandom(100), os.urandom(MIB), os.urandom(7)
    with StreamDigest() as d:
        d.mark()
        d.update(a)
        d.mark()
        d.update(b)
        d.update(c)
        d.mark()
        assert d.marks() == [hashlib.sha256(x).hexdigest() for x in (b"", a, a + b + c)]
        assert d.hexdigest() == hashlib.sha256(a + b + c).hexdigest()


def test_small_buffers_are_bytearrays() -> None:
    pool = BufferPool()
    view = pool.take(POOL_MIN_BYTES - 1)
    assert isinstance(view.obj, bytearray) and len(view) == POOL_MIN_BYTES - 1
    assert pool.mapped == 0


def test_buffers_are_recycled_only_after_the_last_view_is_gone() -> None:
    pool = BufferPool(idle_mappings=2)
    a = pool.take(3 * MIB + 5)
    assert (len(a), a.format, a.readonly) == (3 * MIB + 5, "B", False)
    a[:] = b"\x01" * len(a)
    held = a[10:20].toreadonly()  # a slice keeps the mapping alive
    del a
    gc.collect()
    assert pool.idle() == []
    b = pool.take(3 * MIB)
    assert pool.mapped == 2 and pool.reused == 0
    assert held == b"\x01" * 10  # untouched by the new buffer
    b[:] = b"\x02" * len(b)
    assert held == b"\x01" * 10
    del held
    assert pool.idle() == [4 * MIB]  # sizes are rounded up to 2 MiB
    c = pool.take(4 * MIB)  # fits in the idle mapping
    assert pool.reused == 1 and pool.idle() == []
    c[:] = os.urandom(len(c))
    del b, c
    assert sorted(pool.idle()) == [4 * MIB, 4 * MIB]


def test_a_much_smaller_part_does_not_take_a_big_mapping() -> None:
    pool = BufferPool()
    pool.take(64 * MIB)  # released at once
    assert pool.idle() == [64 * MIB]
    small = pool.take(2 * MIB)
    assert pool.reused == 0 and pool.idle() == [64 * MIB] and len(small) == 2 * MIB


def test_idle_mappings_are_capped() -> None:
    pool = BufferPool(idle_mappings=2)
    views = [pool.take(n * MIB) for n in (2, 4, 6)]
    while views:
        views.pop(0)  # released in the order taken
    assert pool.idle() == [4 * MIB, 6 * MIB]  # the oldest was unmapped


def test_tune_malloc_applies_on_glibc() -> None:
    assert tune_malloc() is True
