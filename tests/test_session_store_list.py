"""`SlotStore.list(prefix)` in every store: the local directory, the snapshot service,
the fail-over set of them, and the local fallback's; and session listing through that
protocol only (a store that is nothing but the protocol is listed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inference_svc import errors
from inference_svc.sessions.listing import TIER_STORE, list_stored
from inference_svc.sessions.names import SessionKey
from inference_svc.storage import slotfile
from inference_svc.storage.fallback import Fallback
from inference_svc.storage.snapshot_failover import FailoverStore
from inference_svc.storage.snapshot_store import SnapshotStore
from inference_svc.storage.store import LocalStore, SlotStore, StoredInfo
from snapshot_svc.testing import free_port, running_server

pytestmark = pytest.mark.timeout(120)


def target(n_tokens: int, size: int = 300) -> bytes:
    """Bytes whose fixed header is a target file's of `n_tokens` tokens (the rest filler:
    listing reads the header only)."""
    head = slotfile._TARGET_HEAD.pack(  # noqa: SLF001 - a header for the test
        slotfile.TARGET_MAGIC, 2, slotfile.HEADER_LEN, 0, b"\x01" * 32,
        0, 0, 0, 0, 0, 0, n_tokens, 0)
    return head + b"\0" * (size - len(head))


def fill(store: SlotStore) -> None:
    store.save("session~~a", target(7), b"draft")
    store.save("session~~b*?", target(9), None)
    store.save("session~k1~c", target(11), b"d")
    store.save("slot-x", target(3), None)


def names(infos: list[StoredInfo]) -> list[tuple[str, int]]:
    return [(i.name, i.n_tokens) for i in infos]


A, B, C = ("session~~a", 7), ("session~~b*?", 9), ("session~k1~c", 11)


def check(store: SlotStore) -> None:
    fill(store)
    assert names(store.list("session~")) == [C, A, B]  # sorted by name ("k" < "~")
    assert names(store.list("session~~")) == [A, B]
    assert names(store.list("session~~b*")) == [B]  # glob characters are literal
    assert names(store.list("session~~a")) == [A]
    assert names(store.list("")) == [C, A, B, ("slot-x", 3)]
    assert store.list("nothing") == []
    assert all(i.modified_unix_ms > 1_700_000_000_000 for i in store.list(""))
    store.delete("session~~a")
    assert names(store.list("session~~")) == [B]


def test_local_store_lists_names_not_its_own_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    check(store)
    (tmp_path / "session~~junk").write_bytes(b"not a slot file")
    (tmp_path / "session~~dir").mkdir()
    # a temporary file and a pending sidecar are the store's, never names
    (tmp_path / ".tmp-x").write_bytes(target(1))
    (tmp_path / ".pending-x-y").write_bytes(b"")
    assert names(store.list("session~~")) == [("session~~b*?", 9), ("session~~junk", -1)]
    assert names(store.list(".")) == []


def test_a_removed_local_directory_lists_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "d")
    os.rmdir(tmp_path / "d")
    assert store.list("") == []  # a directory that is gone holds nothing


def test_snapshot_store_lists_the_services_names(tmp_path: Path) -> None:
    with running_server(tmp_path / "d") as srv, SnapshotStore(srv.address) as store:
        check(store)


def test_snapshot_store_list_unreachable_is_unavailable() -> None:
    with SnapshotStore(f"127.0.0.1:{free_port()}", timeout=2, retries=0) as store, \
            pytest.raises(errors.Unavailable, match="cannot list 'session~\\*'"):
        store.list("session~")


def test_failover_store_lists_through_the_replica_that_answers(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with running_server(tmp_path / "d") as srv, FailoverStore(
            [dead, srv.address],
            lambda a: SnapshotStore(a, timeout=2, retries=0)) as store:
        check(store)
    with FailoverStore([dead, f"127.0.0.1:{free_port()}"],
                       lambda a: SnapshotStore(a, timeout=2, retries=0)) as store, \
            pytest.raises(errors.Unavailable, match="every snapshot replica"):
        store.list("session~")


def test_the_fallback_store_lists_its_files(tmp_path: Path) -> None:
    check(Fallback(tmp_path, "host-1").store)


class OnlyTheProtocol:
    """A store that is the SlotStore protocol and nothing else."""

    def __init__(self, infos: list[StoredInfo]) -> None:
        self.infos = infos
        self.prefixes: list[str] = []

    def list(self, prefix: str) -> list[StoredInfo]:
        self.prefixes.append(prefix)
        return [i for i in self.infos if i.name.startswith(prefix)]


def test_session_listing_uses_the_protocol_only() -> None:
    store = OnlyTheProtocol([StoredInfo("session~~a", 5, 1000),
                             StoredInfo("session~0123abcd~b", 6, 2000),
                             StoredInfo("session~~bad", -1, 3000),  # not a slot file
                             StoredInfo("session~no-owner-separator", 4, 4000),
                             StoredInfo("slot-1", 8, 5000)])
    rows = list_stored(store, "session~")  # type: ignore[arg-type]
    assert [(r.key, r.n_tokens, r.tier, r.last_used_ms) for r in rows] == [
        (SessionKey("", "a"), 5, TIER_STORE, 1000),
        (SessionKey("0123abcd", "b"), 6, TIER_STORE, 2000)]
    assert store.prefixes == ["session~"]
