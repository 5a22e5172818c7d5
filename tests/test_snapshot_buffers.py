"""The transfer helpers of the snapshot service: the streamed SHA-256 on a helper
thread, the recycled receive buffers and the allocator settings."""

from __future__ import annotations

import gc
import hashlib
import os
import threading
import time

import pytest

from snapshot_svc.client.buffers import POOL_MIN_BYTES, BufferPool
from snapshot_svc.client.digest import StreamDigest
from snapshot_svc.memory import tune_malloc

MIB = 1 << 20


def test_stream_digest_hashes_on_one_other_thread_and_bounds_the_queue() -> None:
    gate = threading.Event()
    seen: list[tuple[bytes, str]] = []

    class SlowHash:  # stands in for hashlib's object: blocks until the gate opens
        def update(self, data: bytes) -> None:
            gate.wait()
            seen.append((bytes(data), threading.current_thread().name))

        def hexdigest(self) -> str:
            return "done"

    d = StreamDigest(max_pending=2)
    d._hash = SlowHash()  # type: ignore[assignment]
    d.update(b"a")
    d.update(b"b")
    third = threading.Thread(target=d.update, args=(b"c",))
    third.start()
    time.sleep(0.2)
    assert third.is_alive()  # two chunks wait to be hashed: the third waits for room
    gate.set()
    third.join(5)
    assert not third.is_alive()
    assert d.hexdigest() == "done"
    assert [c for c, _ in seen] == [b"a", b"b", b"c"]  # in order
    names = {n for _, n in seen}
    assert len(names) == 1 and threading.current_thread().name not in names
    d.close()
    d.close()  # idempotent


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
