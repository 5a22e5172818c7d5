"""The local fallback of the auto-save: where a stop puts the slots it could not get
into the store (down, hung, or out of time), so no live session is lost.

    fb = Fallback(Path("~/.local/state/warmslot/fallback"), "host-1")   # .../fallback/host-1/
    fb.store.save("auto-host-1-slot0", target, draft)   # written by the stop's auto-save
    fb.pending()                  # ["auto-host-1-slot0"]: this instance's, not uploaded yet
    fb.upload(store, deadline)    # into the store, each removed here once it is there
    fb.start_uploader(store, 5.0, 10.0)   # retried in the background until none is left

A file here is newer than the store's copy of the same name: it was written by the
last stop, after the store's copy. So at start-up pending files go to the store first
(or, with the store still down, are restored from here), and a later successful save
of the name to the store, or a stop that finds the slot empty, removes the file here.
The stop also writes here the sessions (`session~<owner>~<name>`) the store did not
take; those are not `pending()` auto-saves: the session host (inference_svc.sessions.host)
reads them, lists them and uploads them itself, so that an older copy never lands in
the store after a newer state of the same session.
Files are slot files in a `LocalStore` (the same bytes, atomic writes) in a
subdirectory named after the instance, so replicas may share the directory (a
store's start-up sweep of temporary files never meets another replica's save).
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

from inference_svc import log
from inference_svc.errors import ServiceError
from inference_svc.storage.names import DRAFT_SUFFIX
from inference_svc.storage.store import LocalStore, SlotStore


class Fallback:
    """This instance's fallback slot files in `directory`/<instance_id>. Thread-safe."""

    def __init__(self, directory: Path, instance_id: str) -> None:
        # OSError when the directory cannot be made
        self.store = LocalStore(Path(directory) / instance_id)
        self._names = re.compile(rf"auto-{re.escape(instance_id)}-slot\d+")
        self._lock = threading.Lock()  # one upload or removal at a time
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.log = log.get()

    def describe(self) -> str:
        return self.store.describe()

    def pending(self) -> list[str]:
        """This instance's auto-save names held here, sorted ([] when the directory
        cannot be read: nothing to upload or restore from it)."""
        try:
            return sorted(p.name for p in self.store.dir.iterdir()
                          if self._names.fullmatch(p.name) and p.is_file())
        except OSError:
            return []

    def has(self, name: str) -> bool:
        return (self.store.dir / name).is_file()

    def discard(self, name: str) -> bool:
        """Removes a name's files (its store copy is newer, or its slot is empty);
        True when there was one."""
        with self._lock:
            return self._discard(name)

    def _discard(self, name: str) -> bool:
        target = self.store.dir / name
        existed = target.is_file()
        (self.store.dir / (name + DRAFT_SUFFIX)).unlink(missing_ok=True)
        target.unlink(missing_ok=True)
        return existed

    def upload(self, store: SlotStore, deadline: float | None = None) -> list[str]:
        """Copies every pending file into `store` (each by `deadline`, time.monotonic())
        and removes it here once it is there, unless a newer file replaced it meanwhile
        (a stop wrote it); stops at the first failure. The names uploaded."""
        done: list[str] = []
        for name in self.pending():
            with self._lock:
                if self._closed:
                    break
                try:
                    inode = (self.store.dir / name).stat().st_ino
                    stored = self.store.load(name)
                except (OSError, ServiceError):
                    continue  # removed or replaced meanwhile: the next round sees it
            try:  # no lock held while the store is called: a stop never waits on it
                store.save(name, stored.target, stored.draft, deadline=deadline)
            except ServiceError as exc:
                self.log.info("fallback upload failed, kept locally", extra=log.fields(
                    filename=name, fallback=self.describe(), error=str(exc)))
                break
            with self._lock:
                try:
                    same = (self.store.dir / name).stat().st_ino == inode
                except OSError:
                    same = False
                if same:  # files are replaced by rename: a new inode is a newer save
                    self._discard(name)
            self.log.info("fallback uploaded", extra=log.fields(
                filename=name, fallback=self.describe(), store=store.describe()))
            done.append(name)
        return done

    def start_uploader(self, store: SlotStore, interval: float, call_timeout: float) -> None:
        """Retries `upload` every `interval` seconds on a thread until nothing is pending
        or `close` is called; each round's calls end within `call_timeout` seconds."""
        def run() -> None:
            while self.pending() and not self._stop.wait(interval):
                self.upload(store, time.monotonic() + call_timeout)

        self._thread = threading.Thread(target=run, name="fallback-upload", daemon=True)
        self._thread.start()

    def close(self, timeout: float) -> bool:
        """Stops the uploader, waiting at most `timeout` seconds for an upload in
        progress. True when none runs any more; False when one is still waiting on the
        store: the caller must then not save to the store (that upload, of an older
        copy, could land after its save), only here (a newer file here is never
        removed by the late upload)."""
        self._stop.set()
        with self._lock:
            self._closed = True
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()
