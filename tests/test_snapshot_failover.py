"""The inference service's slot store over several snapshot-service replicas
(`--snapshot-addr a,b`): replicas on one S3 bucket (a real SeaweedFS on 127.0.0.1)
serve each other's saves, and the store fails over when one goes away."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference_svc import errors
from inference_svc.config import Config
from inference_svc.storage.snapshot_failover import FailoverStore, parse_addrs
from inference_svc.storage.snapshot_store import SnapshotStore
from snapshot_svc.testing import free_port, running_server
from tests.fixtures.snapshot_backends import s3_config
from tests.seaweed import SeaweedFS
from tests.snapkit import blob

pytestmark = pytest.mark.timeout(180)


def open_store(addr: str) -> SnapshotStore:
    return SnapshotStore(addr, timeout=10, retries=1, backoff=0.05)


@pytest.fixture()
def prefix() -> str:
    return f"f-{uuid.uuid4().hex[:12]}"


@pytest.fixture()
def dead_addr() -> Iterator[str]:
    yield f"127.0.0.1:{free_port()}"  # nothing listens there


def test_parse_addrs_and_config() -> None:
    assert parse_addrs("a:1, b:2,") == ["a:1", "b:2"]
    assert Config(snapshot_addr="a:1,b:2").snapshot_addr == "a:1,b:2"
    for bad in ("a:1,b", ",a:1", "a:1,,b:2"):
        with pytest.raises(ValueError, match="comma-separated list"):
            Config(snapshot_addr=bad)
    with pytest.raises(ValueError, match="two snapshot addresses"):
        FailoverStore(["a:1"], open_store)


def test_a_replica_that_is_down_is_skipped(tmp_path: Path, dead_addr: str) -> None:
    with running_server(tmp_path / "d") as srv, \
            FailoverStore([dead_addr, srv.address], open_store) as store:
        target, draft = blob(1, 100_000), blob(2, 5000)
        assert store.save("s", target, draft) == 105_000
        got = store.load("s")
        assert (got.target, got.draft) == (target, draft)
        with pytest.raises(errors.NotFound):  # the shared store's answer: no failover
            store.load("missing")


class FakeReplica:
    """A replica whose every call fails with Unavailable when it is `down`."""

    def __init__(self, addr: str, down: set[str], calls: list[str]) -> None:
        self.addr, self.down, self.calls = addr, down, calls

    def delete(self, name: str, *, deadline: float | None = None) -> bool:
        self.calls.append(f"{self.addr}:{name}:{deadline}")
        if self.addr in self.down:
            raise errors.Unavailable(f"{self.addr} is down")
        return True


def test_delete_fails_over_with_its_deadline() -> None:
    calls: list[str] = []
    down = {"a:1"}
    store = FailoverStore(["a:1", "b:2"], lambda a: FakeReplica(a, down, calls))  # type: ignore[arg-type,return-value]
    assert store.delete("x", deadline=12.5) is True
    assert store.delete("y") is True  # b stays preferred
    assert calls == ["a:1:x:12.5", "b:2:x:12.5", "b:2:y:None"]
    down.add("b:2")
    with pytest.raises(errors.Unavailable, match="every snapshot replica"):
        store.delete("z")


def test_every_replica_down_is_unavailable(dead_addr: str) -> None:
    other = f"127.0.0.1:{free_port()}"
    with FailoverStore([dead_addr, other], open_store) as store, \
            pytest.raises(errors.Unavailable, match="every snapshot replica"):
        store.load("s")


def test_replicas_on_one_bucket_fail_over(s3env: SeaweedFS, prefix: str) -> None:
    a = running_server(None, **s3_config(s3env, prefix, "r1"))
    b = running_server(None, **s3_config(s3env, prefix, "r2"))
    srv_a, srv_b = a.__enter__(), b.__enter__()
    try:
        with FailoverStore([srv_a.address, srv_b.address], open_store) as store:
            sessions = {f"s{i}": (blob(10 + i, 30_000 + i), blob(20 + i, 700)) for i in range(4)}
            for name, (t, d) in list(sessions.items())[:2]:
                store.save(name, t, d)
            a.__exit__(None, None, None)  # replica 1 is lost
            for name, (t, d) in list(sessions.items())[2:]:
                store.save(name, t, d)  # through replica 2
            for name, (t, d) in sessions.items():
                got = store.load(name)
                assert (got.target, got.draft) == (t, d), name
            assert store.describe() == f"snapshot:{srv_a.address},{srv_b.address}"
    finally:
        a.__exit__(None, None, None)
        b.__exit__(None, None, None)


@pytest.mark.parametrize("method", ["save", "load", "delete"])
def test_failover_store_takes_what_every_slot_store_takes(method: str) -> None:
    """The service calls any store the same way (deadline, digest keywords): the
    failover store's methods have the SlotStore protocol's signatures."""
    import inspect

    from inference_svc.storage.store import SlotStore

    assert (inspect.signature(getattr(FailoverStore, method))
            == inspect.signature(getattr(SlotStore, method)))
