"""glibc's allocator knobs, for the process entry points of both services: each sets
its own thresholds where it starts (no library module changes them on import)."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def set_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """Blocks above `mmap_threshold` get their own mapping; a free heap top above
    `trim_threshold` goes back to the kernel. False (and no change) where malloc is
    not glibc's."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)
                and mallopt(M_TRIM_THRESHOLD, trim_threshold))


def trimmer() -> Callable[[], None]:
    """A call that returns free heap memory to the kernel (malloc_trim(0)); a no-op
    where malloc is not glibc's."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return lambda: None
    trim.argtypes = (ctypes.c_size_t,)

    def run() -> None:
        trim(0)

    return run
