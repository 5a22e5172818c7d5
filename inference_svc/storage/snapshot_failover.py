"""A slot store over several snapshot-service replicas that share one backend
(`--snapshot-addr a:1,b:2`, e.g. replicas on one S3 bucket): every call goes to the
replica that answered last, and a call that fails with Unavailable (unreachable,
shutting down, no answer within its deadline, after the per-replica retries) is
tried on the next replica, each at most once per call.

    store = FailoverStore(["10.0.0.1:50052", "10.0.0.2:50052"], lambda a: SnapshotStore(a))
    store.save("chat-42", target, draft); store.load("chat-42")

Saves and loads are idempotent, so retrying them is safe: a save stores the same bytes
under the same name (the paired commit is redone whole on the next replica), a load
reads, a delete removes the name (one whose answer was lost answers False on the next
replica). A `deadline` (time.monotonic()) bounds the call across all the replicas it
tries. Any other error (NotFound, DataLoss...) is
the answer of the shared store and raised at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from inference_svc import errors, log
from inference_svc.storage.snapshot_store import SnapshotStore
from inference_svc.storage.store import Buffer, StoredInfo, StoredSlot

T = TypeVar("T")


def parse_addrs(value: str) -> list[str]:
    """The addresses of `--snapshot-addr a,b` (spaces around commas allowed)."""
    return [a.strip() for a in value.split(",") if a.strip()]


class FailoverStore:
    """A `SlotStore` that fails over between snapshot-service replicas. Thread-safe."""

    def __init__(self, addrs: Sequence[str],
                 make_store: Callable[[str], SnapshotStore]) -> None:
        if len(addrs) < 2:
            raise ValueError("a failover store needs at least two snapshot addresses")
        self.addrs = list(addrs)
        self.stores = [make_store(a) for a in self.addrs]
        self._preferred = 0
        self._lock = threading.Lock()
        self.log = log.get()

    def describe(self) -> str:
        return "snapshot:" + ",".join(self.addrs)

    @property
    def negotiated_protocol(self) -> int | None:
        with self._lock:
            return self.stores[self._preferred].negotiated_protocol

    def _failover(self, op: str, fn: Callable[[SnapshotStore], T]) -> T:
        with self._lock:
            first = self._preferred
        last: errors.Unavailable | None = None
        for i in range(len(self.stores)):
            k = (first + i) % len(self.stores)
            try:
                result = fn(self.stores[k])
            except errors.Unavailable as exc:
                last = exc
                nxt = self.addrs[(k + 1) % len(self.addrs)]
                self.log.warning(f"snapshot replica {self.addrs[k]} unavailable for {op}; "
                                 f"trying {nxt}", extra=log.fields(
                                     snapshot_addr=self.addrs[k], error=exc.message))
                continue
            with self._lock:
                self._preferred = k
            return result
        assert last is not None
        raise errors.Unavailable(f"every snapshot replica ({', '.join(self.addrs)}) is "
                                 f"unavailable; last: {last.message}") from last

    def save(self, name: str, target: Buffer, draft: Buffer | None, *,
             target_sha256: str | None = None, deadline: float | None = None) -> int:
        return self._failover("save", lambda s: s.save(
            name, target, draft, target_sha256=target_sha256, deadline=deadline))

    def load(self, name: str, *, deadline: float | None = None) -> StoredSlot:
        return self._failover("load", lambda s: s.load(name, deadline=deadline))

    def conditional(self) -> bool:
        return self._failover("hello", lambda s: s.conditional())

    def generation(self, name: str, *, deadline: float | None = None) -> int:
        return self._failover("stat", lambda s: s.generation(name, deadline=deadline))

    def save_if(self, name: str, target: Buffer, draft: Buffer | None, expected: int, *,
                target_sha256: str | None = None, deadline: float | None = None) -> int:
        return self._failover("save", lambda s: s.save_if(
            name, target, draft, expected, target_sha256=target_sha256, deadline=deadline))

    def delete(self, name: str, *, deadline: float | None = None) -> bool:
        return self._failover("delete", lambda s: s.delete(name, deadline=deadline))

    def list(self, prefix: str) -> list[StoredInfo]:
        return self._failover("list", lambda s: s.list(prefix))

    def close(self) -> None:
        for s in self.stores:
            s.close()

    def __enter__(self) -> FailoverStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
