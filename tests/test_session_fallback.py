"""Sessions at a stop with the snapshot service down: every session, in a slot or in the
RAM tier, goes to the local fallback (nothing lost, exit status 0); a start with the
service still down lists them and continues them from there with only their new
tokens; once the service answers they are uploaded and removed locally, and a newer
state written to the service replaces the fallback's copy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from inference_svc.api.server import Server
from inference_svc.sessions import host
from snapshot_svc.client import SnapshotClient
from snapshot_svc.config import SnapshotConfig
from snapshot_svc.server import SnapshotServer
from snapshot_svc.testing import free_port
from tests.fixtures.servicekit import serve
from tests.resumekit import wait_until
from tests.test_sessions import RAM, SLOT, STORE, N, client, config, listed, prompts, turn

pytestmark = pytest.mark.timeout(180)


@contextmanager
def inference(addr: str, fallback: Path, auto_save: bool = True) -> Iterator[Server]:
    srv = serve(config(snapshot_addr=addr, fallback_save_path=fallback, instance_id="fb",
                       restore_timeout=0.5, snapshot_timeout=2.0, auto_save_timeout=5.0,
                       auto_save=auto_save))
    try:
        yield srv
    finally:
        srv.stop(1.0)


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def stored(addr: str) -> list[tuple[str, int]]:
    with SnapshotClient(addr) as sc:
        return [(i.name, i.target.meta.n_tokens) for i in sc.list("session~")]


def snapshot(tmp_path: Path, port: int) -> SnapshotServer:
    """The snapshot service of the test (not started); each one serves the same data."""
    return SnapshotServer(SnapshotConfig(data_dir=tmp_path / "snap", port=port))


def left_in_the_fallback(tmp_path: Path, port: int, fallback: Path,
                         names: list[str]) -> list[list[int]]:
    """One turn of each session of names (on the prompts in order) with the store up,
    then the store stops before the inference service does: their states go to the
    fallback. Returns the prompts."""
    snap = snapshot(tmp_path, port)
    with inference(f"127.0.0.1:{port}", fallback) as srv, client(srv) as c:
        snap.start()
        try:
            p = prompts(c)
            for name, prompt in zip(names, p[:len(names)], strict=True):
                turn(c, name, prompt)
        finally:
            snap.stop(grace=0)
    return p


SESSION_FILES = ["session~~a", "session~~a.drft", "session~~b", "session~~b.drft"]


@pytest.mark.parametrize("auto_save", [True, False])
def test_sessions_survive_a_stop_with_the_store_down(tmp_path: Path, auto_save: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "SPILL_RETRY_S", 0.1)
    port = free_port()
    addr, fallback = f"127.0.0.1:{port}", tmp_path / "fallback"
    local = fallback / "fb"
    # 1. the store goes down before the stop: a (RAM tier) and b (slot) go locally
    snap = snapshot(tmp_path, port)
    with inference(addr, fallback, auto_save) as srv, client(srv) as c:
        snap.start()
        try:
            p = prompts(c)
            turn(c, "a", p[0])
            turn(c, "b", p[1])
            assert listed(c) == {"a": (len(p[0]) + N, RAM), "b": (len(p[1]) + N, SLOT)}
        finally:
            snap.stop(grace=0)
        assert srv.stop(1.0) is True  # nothing lost
    assert files(local) == SESSION_FILES
    # 2. restart, the store still down: a continues from the fallback (a list of the
    # sessions needs the store: UNAVAILABLE, never a partial one)
    with inference(addr, fallback, auto_save) as srv, client(srv) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.sessions()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        _, t = turn(c, "a", p[2])
        assert (t.session_tier, t.cache_n, t.prompt_n) == (STORE, len(p[0]) + N, len(p[2]))
        assert srv.stop(1.0) is True
    n_a = len(p[0]) + len(p[2]) + 2 * N
    assert files(local) == SESSION_FILES  # a's newer state replaced its older file
    # 3. the store comes back while the service runs: both uploaded, removed locally
    snap = snapshot(tmp_path, port)
    with inference(addr, fallback, auto_save) as srv, client(srv) as c:
        snap.start()
        try:
            wait_until(lambda: files(local) == [], timeout=20)
            assert stored(addr) == [("session~~a", n_a), ("session~~b", len(p[1]) + N)]
            assert listed(c) == {"a": (n_a, STORE), "b": (len(p[1]) + N, STORE)}
            _, t = turn(c, "a", p[3])
            assert (t.session_tier, t.cache_n, t.prompt_n) == (STORE, n_a, len(p[3]))
            assert srv.stop(1.0) is True
            assert files(local) == []
            assert stored(addr) == [("session~~a", n_a + len(p[3]) + N),
                                    ("session~~b", len(p[1]) + N)]
        finally:
            snap.stop(grace=0)


def test_a_session_taken_from_the_fallback_is_never_overwritten_by_its_older_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session continued from the fallback while the store was down: when the store
    answers, the upload leaves its older fallback copy alone (another session's is
    uploaded), and its newer state reaches the store, the fallback copy removed."""
    monkeypatch.setattr(host, "SPILL_RETRY_S", 0.1)
    port = free_port()
    addr, fallback = f"127.0.0.1:{port}", tmp_path / "fallback"
    local = fallback / "fb"
    p = left_in_the_fallback(tmp_path, port, fallback, ["a", "z"])
    assert files(local) == ["session~~a", "session~~a.drft", "session~~z", "session~~z.drft"]
    snap = snapshot(tmp_path, port)
    with inference(addr, fallback) as srv, client(srv) as c:
        turn(c, "a", p[2])  # taken up from the fallback: this replica's state is newer
        snap.start()
        try:
            wait_until(lambda: files(local) == ["session~~a", "session~~a.drft"], timeout=20)
            assert stored(addr) == [("session~~z", len(p[1]) + N)]  # a's old copy: not sent
            assert srv.stop(1.0) is True
            assert stored(addr) == [("session~~a", len(p[0]) + len(p[2]) + 2 * N),
                                    ("session~~z", len(p[1]) + N)]
            assert files(local) == []
        finally:
            snap.stop(grace=0)


def test_deleting_a_session_held_in_the_fallback(tmp_path: Path) -> None:
    port = free_port()
    addr, fallback = f"127.0.0.1:{port}", tmp_path / "fallback"
    local = fallback / "fb"
    p = left_in_the_fallback(tmp_path, port, fallback, ["a"])
    assert files(local) == ["session~~a", "session~~a.drft"]
    with inference(addr, fallback) as srv, client(srv) as c:
        # the store down: the delete fails whole, the fallback copy stays for the retry
        with pytest.raises(grpc.RpcError) as err:
            c.delete_session("a")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert files(local) == ["session~~a", "session~~a.drft"]
        snap = snapshot(tmp_path, port)
        snap.start()
        try:
            r = c.delete_session("a")
            assert (r.n_tokens, list(r.removed_from)) == (len(p[0]) + N, [STORE])
            assert files(local) == [] and stored(addr) == []
            assert listed(c) == {}
        finally:
            snap.stop(grace=0)
