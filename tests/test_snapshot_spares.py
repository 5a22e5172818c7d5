"""Spare files: a deleted or replaced blob's file is overwritten by the next Put.

The bytes served must never depend on what a spare held before, a Get still reading a
blob must keep its bytes, the pool stays within --spare-bytes, and a full disk gets
the spares' space back before a Put is refused."""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshot_svc.client import SnapshotClient
from snapshot_svc.client.contract import MAX_CHUNK_BYTES
from snapshot_svc.client.records import Part
from snapshot_svc.config import parse_config
from snapshot_svc.errors import ResourceExhausted
from snapshot_svc.server import SnapshotServer
from snapshot_svc.spares import SparePool
from snapshot_svc.testing import running_server
from tests.snapkit import blob

pytestmark = pytest.mark.timeout(120)


def spare_sizes(server: SnapshotServer) -> list[int]:
    return sorted(p.stat().st_size for p in server.store.tmp.iterdir()
                  if p.name.startswith("spare-"))


def blob_files(server: SnapshotServer) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in server.store.blobs.iterdir()}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SnapshotServer]:
    with running_server(tmp_path / "data", max_snapshot_bytes=8 << 20,
                        spare_bytes=6 << 20) as srv:
        yield srv


@pytest.fixture
def client(server: SnapshotServer) -> Iterator[SnapshotClient]:
    with SnapshotClient(server.address, timeout=20) as c:
        yield c


@pytest.mark.parametrize("new_size", [2 * MAX_CHUNK_BYTES + 5,  # same size as the spare
                                      MAX_CHUNK_BYTES + 1,  # smaller: cut to size
                                      3 * MAX_CHUNK_BYTES + 77])  # larger: it grows
def test_a_put_overwrites_a_spare_and_stores_exactly_its_own_bytes(
        client: SnapshotClient, server: SnapshotServer, new_size: int) -> None:
    old = blob(1, 2 * MAX_CHUNK_BYTES + 5)
    client.put("a", old)
    assert client.delete("a") == len(old)
    assert spare_sizes(server) == [len(old)]
    assert server.store.spares.bytes == len(old)

    new = blob(2, new_size)
    client.put("b", new)
    assert server.store.spares.reused == 1
    assert spare_sizes(server) == []
    digest = hashlib.sha256(new).hexdigest()
    assert blob_files(server) == {digest: new_size}
    assert (server.store.blobs / digest).read_bytes() == new
    assert client.get("b").target == new


def test_a_replaced_snapshot_becomes_the_next_saves_spare(client: SnapshotClient,
                                                          server: SnapshotServer) -> None:
    """Saving one name again and again (as a slot's saves do) reuses one file."""
    sizes = []
    for i in range(4):
        data = blob(10 + i, MAX_CHUNK_BYTES + 3)
        client.put("slot", data)
        assert client.get("slot").target == data
        sizes.append(spare_sizes(server))
    assert sizes == [[], [MAX_CHUNK_BYTES + 3]] + [[MAX_CHUNK_BYTES + 3]] * 2
    assert server.store.spares.reused == 2


def test_an_upload_of_bytes_already_stored_becomes_a_spare(
        client: SnapshotClient, server: SnapshotServer) -> None:
    data = blob(1, MAX_CHUNK_BYTES + 9)
    client.put("a", data)
    client.put("b", data)  # same digest: one blob for both names
    assert spare_sizes(server) == [len(data)]
    assert len(list(server.store.blobs.iterdir())) == 1
    assert client.get("a").target == client.get("b").target == data
    client.delete("a")
    assert spare_sizes(server) == [len(data)]  # "b" still holds the blob
    assert client.get("b").target == data


def test_a_blob_being_read_is_not_reused(client: SnapshotClient, server: SnapshotServer) -> None:
    """A Get reads through the descriptor of the reader open_part gave it (the server's Get may have
    sent everything before the client reads it, so the store is driven directly)."""
    old = blob(1, 3 * MAX_CHUNK_BYTES)
    client.put("a", old)
    snap, reader = server.store.open_part("a", Part.TARGET)
    try:
        client.delete("a")
        assert spare_sizes(server) == []  # removed, not made a spare
        new = blob(2, len(old))
        client.put("b", new)
        assert server.store.spares.reused == 0
        assert os.pread(reader.fd, len(old) + 1, 0) == old
    finally:
        reader.close()
    assert client.get("b").target == new
    # once the reader is gone, the next unreferenced blob becomes a spare again
    client.delete("b")
    assert spare_sizes(server) == [len(new)]


def test_the_pool_keeps_at_most_spare_bytes(client: SnapshotClient,
                                            server: SnapshotServer) -> None:
    # 6 MiB allowed: a 7 MiB blob is removed at once, older spares make room for newer
    client.put("big", blob(1, 7 << 20))
    client.delete("big")
    assert spare_sizes(server) == []
    for i, mib in enumerate((3, 2, 2)):
        client.put(f"s{i}", blob(2 + i, mib << 20))
    for i in range(3):
        client.delete(f"s{i}")
    assert spare_sizes(server) == [2 << 20, 2 << 20]  # the 3 MiB one, oldest, went
    assert server.store.spares.bytes == 4 << 20


def test_spare_bytes_zero_keeps_none(tmp_path: Path) -> None:
    with running_server(tmp_path / "d", spare_bytes=0) as srv, \
            SnapshotClient(srv.address) as c:
        c.put("a", blob(1, 2 << 20))
        c.delete("a")
        assert list(srv.store.tmp.iterdir()) == []
        assert list(srv.store.blobs.iterdir()) == []


def test_a_full_disk_gets_the_spares_space_back_before_refusing(
        client: SnapshotClient, server: SnapshotServer) -> None:
    client.put("a", blob(1, 2 << 20))
    client.put("b", blob(2, 1 << 20))
    client.delete("a")
    client.delete("b")
    assert spare_sizes(server) == [1 << 20, 2 << 20]
    calls: list[int] = []

    def full_until_spares_go(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        if spare_sizes(server):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.posix_fallocate(fd, offset, length)

    server.store._allocate = full_until_spares_go
    data = blob(3, 4 << 20)  # larger than either spare: the 2 MiB one is taken and grown
    client.put("c", data)
    assert calls == [len(data), len(data)]  # refused, spares dropped, then reserved
    assert spare_sizes(server) == []
    assert client.get("c").target == data

    def always_full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    client.put("d", blob(4, 1 << 20))
    client.delete("d")
    assert spare_sizes(server) == [1 << 20]
    server.store._allocate = always_full
    with pytest.raises(ResourceExhausted, match="disk full"):
        client.put("e", blob(5, 3 << 20))
    assert list(server.store.tmp.iterdir()) == []  # no partial file, no spare left


def test_stop_removes_the_spares_and_start_sweeps_any_left(tmp_path: Path) -> None:
    data = blob(1, 5000)
    with running_server(tmp_path / "d") as srv, SnapshotClient(srv.address) as c:
        c.put("keep", data)
        c.put("gone", blob(2, 1 << 20))
        c.delete("gone")
        assert spare_sizes(srv) == [1 << 20]
    assert list((tmp_path / "d" / "tmp").iterdir()) == []  # removed at stop
    (tmp_path / "d" / "tmp" / "spare-0123").write_bytes(b"x" * 4096)  # a crash left one
    with running_server(tmp_path / "d") as srv, SnapshotClient(srv.address) as c:
        assert list(srv.store.tmp.iterdir()) == []
        assert c.get("keep").target == data


def test_small_files_are_neither_kept_nor_reused(client: SnapshotClient,
                                                 server: SnapshotServer) -> None:
    client.put("small", blob(1, (1 << 20) - 1))
    client.delete("small")
    assert spare_sizes(server) == []
    client.put("big", blob(2, 2 << 20))
    client.delete("big")
    client.put("tiny", blob(3, 100))  # does not cut the 2 MiB spare down to 100 bytes
    assert spare_sizes(server) == [2 << 20] and server.store.spares.reused == 0


def test_spare_flag_and_environment() -> None:
    assert parse_config(["--data-dir", "x"], env={}).spare_bytes == 1 << 30
    assert parse_config(["--data-dir", "x", "--spare-bytes", "512M"], env={}).spare_bytes \
        == 512 << 20
    env = {"WARMSLOT_SNAPSHOT_SPARE_BYTES": "0"}
    assert parse_config(["--data-dir", "x"], env=env).spare_bytes == 0
    with pytest.raises(SystemExit):
        parse_config(["--data-dir", "x", "--spare-bytes", "lots"], env={})


def test_pool_refuses_what_it_cannot_keep(tmp_path: Path) -> None:
    pool = SparePool(tmp_path, max_bytes=100, max_files=2, min_bytes=5)
    for i in range(4):
        (tmp_path / f"f{i}").write_bytes(b"x" * 10)
    assert not pool.offer(tmp_path / "missing", 10)  # nothing to move
    assert not pool.offer(tmp_path / "f0", 4)  # smaller than min_bytes
    assert not pool.offer(tmp_path / "f0", 101)  # larger than the pool
    assert (tmp_path / "f0").exists()
    assert pool.offer(tmp_path / "f1", 10) and pool.offer(tmp_path / "f2", 10)
    assert pool.offer(tmp_path / "f3", 10)  # a third file: the oldest goes
    assert pool.files == 2 and pool.bytes == 20
    assert pool.take(4, tmp_path / "t") is None  # an upload under min_bytes
    assert pool.take(5, tmp_path / "t") == 10 and (tmp_path / "t").stat().st_size == 10
    assert pool.drop_all() == 10 and pool.files == 0
    assert pool.take(5, tmp_path / "u") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f0", "t"]
    with pytest.raises(ValueError):
        SparePool(tmp_path, max_bytes=-1)
