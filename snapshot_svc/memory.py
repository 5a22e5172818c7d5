"""Process-wide allocator settings for moving large snapshots (glibc malloc).

A transfer allocates and frees a ~1 MiB buffer per chunk (gRPC's message bytes,
the framed chunk). glibc serves blocks above its mmap threshold (128 KiB at
start, adapting later) with a fresh mmap, and gives a free heap top above
128 KiB back to the kernel; either way the next chunk lands on pages the kernel
must fault in and zero again, for every chunk. With chunks served from the heap
and the heap top kept, each chunk reuses the memory the previous one freed.

`tune_malloc()` is called by the snapshot service's entry point (and by the snapshot
benchmark); the library modules never change process-wide settings on import.
"""

from __future__ import annotations

from snapshot_svc.clientlib.malloc import set_thresholds

MMAP_THRESHOLD_BYTES = 8 << 20  # > one 1 MiB chunk plus framing; glibc caps it at 32 MiB
TRIM_THRESHOLD_BYTES = 64 << 20  # free heap top kept before it is returned to the kernel


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD_BYTES,
                trim_threshold: int = TRIM_THRESHOLD_BYTES) -> bool:
    """Applies the settings above; False (and no change) where malloc is not glibc's."""
    return set_thresholds(mmap_threshold, trim_threshold)
