"""Spare files: blobs nothing references any more, kept to be overwritten by the next Put.

Writing a new file costs more than overwriting an old one of the same size: the
filesystem allocates (and, mounted with `discard`, later trims) its blocks, and the
kernel allocates fresh page-cache memory, which on a VM whose balloon reports free
pages to the host faults in again page by page. A Put that overwrites a file whose
blocks and cached pages already exist skips all of that. PostgreSQL recycles its WAL
segment files for the same reasons.

A spare lives in the store's tmp/ directory: the store removes its spares when it
closes, and a start after a crash sweeps them like any other temporary file. Its
bytes are old content of a deleted snapshot and are never served (a Put overwrites
the whole file and checks the digest before it becomes a blob).
The pool keeps at most `max_bytes` (and `max_files`) on disk; when the disk is full
the store gives them back before it refuses a Put.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import deque
from pathlib import Path

from snapshot_svc.logs import log_event

log = logging.getLogger("snapshot_svc.spares")


class SparePool:
    """Thread-safe; every method renames or removes files in `directory` only."""

    def __init__(self, directory: Path, max_bytes: int, max_files: int = 8,
                 min_bytes: int = 1 << 20) -> None:
        if max_bytes < 0 or max_files < 0 or min_bytes < 1:
            raise ValueError("max_bytes and max_files must be >= 0, min_bytes >= 1")
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.min_bytes = min_bytes  # smaller files are not kept, smaller uploads take none
        self._lock = threading.Lock()
        self._files: deque[tuple[Path, int]] = deque()  # oldest first
        self._bytes = 0
        self.reused = 0  # Puts that overwrote a spare (metrics, tests)

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def files(self) -> int:
        with self._lock:
            return len(self._files)

    def offer(self, path: Path, size: int) -> bool:
        """Moves the file at `path` (`size` bytes, no longer referenced) into the pool.
        False if the pool does not take it: the caller removes it as before."""
        if size < self.min_bytes or size > self.max_bytes or self.max_files == 0:
            return False
        spare = self.directory / f"spare-{uuid.uuid4().hex}"
        evicted: list[Path] = []
        with self._lock:
            try:
                os.rename(path, spare)
            except OSError:
                return False
            self._files.append((spare, size))
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._files) > self.max_files:
                old, old_size = self._files.popleft()
                self._bytes -= old_size
                evicted.append(old)
        for old in evicted:
            _remove(old)
        return True

    def take(self, size: int, path: Path) -> int | None:
        """Renames the best spare for an upload of `size` bytes to `path` and returns
        the spare's size (the smallest one that holds `size`, else the largest), or
        None when the pool is empty or the upload is smaller than `min_bytes`."""
        with self._lock:
            if not self._files or size < self.min_bytes:
                return None
            fits = [f for f in self._files if f[1] >= size]
            pick = min(fits, key=lambda f: f[1]) if fits else max(self._files, key=lambda f: f[1])
            self._files.remove(pick)
            self._bytes -= pick[1]
            try:
                os.rename(pick[0], path)
            except OSError as exc:
                log_event(log, logging.WARNING, "spare_lost", path=str(pick[0]), error=str(exc))
                _remove(pick[0])
                return None
            self.reused += 1
            return pick[1]

    def drop_all(self) -> int:
        """Removes every spare (the disk is full); returns the bytes given back."""
        with self._lock:
            files, self._files, freed, self._bytes = list(self._files), deque(), self._bytes, 0
        for p, _ in files:
            _remove(p)
        if files:
            log_event(log, logging.INFO, "spares_dropped", files=len(files), bytes=freed)
        return freed


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # left for the next start-up's sweep of tmp/
        log_event(log, logging.WARNING, "spare_remove_failed", path=str(path), error=str(exc))
