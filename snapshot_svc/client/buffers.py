"""Receive buffers for large parts: mapped up front, recycled when released.

A Get returns each part as one contiguous buffer. Fresh memory is expensive: the
kernel zeroes and maps every 4 KiB page on first touch, which on a VM costs about
as long as the transfer itself. So:

- a new buffer is one anonymous mapping with all its pages mapped by a single
  mmap(MAP_POPULATE) call;
- when the last view of a buffer is released, the mapping goes back to a small
  pool (at most `IDLE_MAPPINGS`) after madvise(MADV_FREE): the kernel may take
  the pages back under memory pressure, otherwise the next Get of a similar size
  reuses them with no fault at all (a process restoring slot after slot, or a
  client fetching snapshot after snapshot, pays for fresh memory once);
- parts under `POOL_MIN_BYTES` are plain bytearrays.

Views are handed out only while nobody else can see the mapping: it returns to
the pool when the exporting object is destroyed, which CPython does only after
every memoryview (and slice of one) made from it is gone.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from collections.abc import Callable

POOL_MIN_BYTES = 1 << 20
IDLE_MAPPINGS = 2
_GRANULE = 2 << 20  # mapping sizes are rounded up to this, so sizes that differ a bit reuse
_PROT = mmap.PROT_READ | mmap.PROT_WRITE
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
_MADV_FREE = getattr(mmap, "MADV_FREE", 8)
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Libc:
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap: Callable[..., int | None] = libc.mmap
        self.munmap: Callable[..., int] = libc.munmap
        self.madvise: Callable[..., int] = libc.madvise
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long)
        for fn in (libc.munmap, libc.madvise):
            fn.restype = ctypes.c_int
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _load_libc() -> _Libc | None:
    try:
        return _Libc()
    except (OSError, AttributeError):
        return None


class BufferPool:
    """Anonymous mappings for receive buffers, recycled as described above. Thread-safe."""

    def __init__(self, idle_mappings: int = IDLE_MAPPINGS) -> None:
        self._libc = _load_libc()
        self._idle_max = idle_mappings
        self._idle: list[tuple[int, int]] = []  # (address, length), oldest first
        self._lock = threading.Lock()
        self.mapped = 0  # new mappings made (for tests and benchmarks)
        self.reused = 0

    def take(self, size: int) -> memoryview:
        """A writable buffer of exactly `size` bytes (format "B"); its content is
        unspecified (zero or an earlier part's bytes): the caller overwrites all of it.
        MemoryError when the kernel refuses a mapping."""
        if size < POOL_MIN_BYTES or self._libc is None:
            return memoryview(bytearray(size))
        addr, length = self._reuse(size) or self._map(size)
        array = (ctypes.c_ubyte * length).from_address(addr)
        # not at interpreter exit: a view still used by a later exit handler must keep
        # its bytes (MADV_FREE may zero them); the process unmaps everything anyway
        weakref.finalize(array, self._give_back, addr, length).atexit = False
        return memoryview(array).cast("B")[:size]

    def _reuse(self, size: int) -> tuple[int, int] | None:
        with self._lock:
            fits = [m for m in self._idle if size <= m[1] <= 2 * size]
            if not fits:
                return None
            best = min(fits, key=lambda m: m[1])
            self._idle.remove(best)
            self.reused += 1
            return best

    def _map(self, size: int) -> tuple[int, int]:
        assert self._libc is not None
        length = -(-size // _GRANULE) * _GRANULE
        addr = self._libc.mmap(None, length, _PROT, _FLAGS, -1, 0)
        if addr is None or addr == _MAP_FAILED:
            raise MemoryError(f"cannot map a receive buffer of {length} bytes "
                              f"(errno {ctypes.get_errno()})")
        self.mapped += 1
        return addr, length

    def _give_back(self, addr: int, length: int) -> None:
        """Runs when the last view of a mapping is gone."""
        assert self._libc is not None
        self._libc.madvise(addr, length, _MADV_FREE)  # reclaimable until reused
        with self._lock:
            self._idle.append((addr, length))
            evicted = self._idle[:-self._idle_max] if len(self._idle) > self._idle_max else []
            del self._idle[:len(evicted)]
        for a, n in evicted:
            self._libc.munmap(a, n)

    def idle(self) -> list[int]:
        """The lengths of the idle mappings, oldest first."""
        with self._lock:
            return [n for _, n in self._idle]


POOL = BufferPool()
