"""Process-wide allocator settings for moving large snapshots (glibc malloc).

A transfer allocates and frees a ~1 MiB buffer per chunk (gRPC's message bytes,
the framed chunk). glibc serves blocks above its mmap threshold (128 KiB at
start, adapting later) with a fresh mmap, and gives a free heap top above
128 KiB back to the kernel; either way the next chunk lands on pages the kernel
must fault in and zero again, for every chunk. With chunks served from the heap
and the heap top kept, each chunk reuses the memory the previous one freed.

`tune_malloc()` is called by the snapshot service's entry point (and by the snapshot
benchmark); the library modules never change process-wide settings on import.

The inference service's entry point calls it with lower thresholds
(`INFERENCE_THRESHOLDS`, overriding the image's GLIBC_TUNABLES): a request of a few
MiB of text (its message, its string, its token ids, its response) is then mapped and
unmapped on its own, and a thread's arena keeps at most a few MiB of free top, so the
memory of large requests goes back to the kernel when they end; the 1 MiB snapshot
chunks stay below the mmap threshold and are still reused.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 8 << 20  # > one 1 MiB chunk plus framing; glibc caps it at 32 MiB
TRIM_THRESHOLD_BYTES = 64 << 20  # free heap top kept before it is returned to the kernel
INFERENCE_THRESHOLDS = (2 << 20, 4 << 20)  # (mmap, trim) of the inference service


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD_BYTES,
                trim_threshold: int = TRIM_THRESHOLD_BYTES) -> bool:
    """Applies the settings above; False (and no change) where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)
                and mallopt(M_TRIM_THRESHOLD, trim_threshold))
