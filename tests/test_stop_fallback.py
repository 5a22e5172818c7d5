"""The stop's auto-save when the snapshot service is down: every live session goes to
the local fallback, a restart with the service still down restores from there, and
the first start with the service back uploads the files (removing them locally) and
restores from the service."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient
from inference_svc.storage.fallback import Fallback
from snapshot_svc.client import SnapshotClient
from snapshot_svc.config import SnapshotConfig
from snapshot_svc.server import SnapshotServer
from snapshot_svc.testing import ServerProcess, free_port
from tests.fixtures.servicekit import model_pair, service_config
from tests.resumekit import InferenceProcess, Session

pytestmark = pytest.mark.timeout(180)
PROMPTS = ([5, 17, 250, 3, 99, 42, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12])
N = 5


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return model_pair(tmp_path_factory.getbasetemp())


@contextmanager
def inference(pair: tuple[Path, Path], addr: str, fallback: Path) -> Iterator[Server]:
    cfg = service_config(*pair, snapshot_addr=addr, fallback_save_path=fallback,
                         instance_id="fb", restore_timeout=0.5, snapshot_timeout=2.0,
                         auto_save_timeout=5.0)
    srv = Server(cfg)
    srv.start()
    try:
        srv.load()
        yield srv
    finally:
        srv.stop(1.0)


def tokens(srv: Server) -> list[list[int]]:
    """What each slot holds (the engine's own view)."""
    eng = srv._engine
    assert eng is not None
    return eng.call(lambda: [eng.owner.tokens(s) for s in range(eng.n_slots)])


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_sessions_survive_a_stop_with_the_store_down(pair: tuple[Path, Path],
                                                      tmp_path: Path) -> None:
    port = free_port()
    addr, fallback = f"127.0.0.1:{port}", tmp_path / "fallback"
    # 1. nothing listens at the store's address: the stop writes both sessions locally
    with inference(pair, addr, fallback) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}", timeout=60) as c:
        for slot, prompt in enumerate(PROMPTS):
            c.generate(prompt, id_slot=slot, max_tokens=N, temperature=0.0)
        held = tokens(srv)
        assert [len(t) for t in held] == [len(p) + N for p in PROMPTS]
        assert srv.stop(1.0) is True  # no session lost: exit status 0
    assert files(fallback / "fb") == ["auto-fb-slot0", "auto-fb-slot0.drft",
                               "auto-fb-slot1", "auto-fb-slot1.drft"]
    # 2. restart, the store still down: both slots come back from the fallback, which
    # keeps its files (they are not in the store yet)
    with inference(pair, addr, fallback) as srv:
        assert tokens(srv) == held
        assert srv.stop(1.0) is True
    assert files(fallback / "fb") == ["auto-fb-slot0", "auto-fb-slot0.drft",
                               "auto-fb-slot1", "auto-fb-slot1.drft"]
    # 3. the store is back: the start uploads both, removes them locally, and restores
    # them from the store
    snap = SnapshotServer(SnapshotConfig(data_dir=tmp_path / "snap", port=port))
    snap.start()
    try:
        with inference(pair, addr, fallback) as srv:
            assert files(fallback / "fb") == []
            assert tokens(srv) == held
            with SnapshotClient(addr) as sc:
                names = [i.name for i in sc.list("auto-fb-")]
            assert names == ["auto-fb-slot0", "auto-fb-slot1"]
        assert files(fallback / "fb") == []  # this stop reached the store
    finally:
        snap.stop(grace=0)



def test_the_fallback_is_uploaded_once_the_store_answers_again(
        pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from inference_svc.api import server

    monkeypatch.setattr(server, "FALLBACK_RETRY_S", 0.1)
    port = free_port()
    addr, fallback = f"127.0.0.1:{port}", tmp_path / "fallback"
    with inference(pair, addr, fallback) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}", timeout=60) as c:
        c.generate(PROMPTS[0], id_slot=0, max_tokens=N, temperature=0.0)
        held = tokens(srv)
    assert files(fallback / "fb") == ["auto-fb-slot0", "auto-fb-slot0.drft"]
    snap = SnapshotServer(SnapshotConfig(data_dir=tmp_path / "snap", port=port))
    with inference(pair, addr, fallback) as srv:  # restored from the fallback
        assert tokens(srv) == held
        snap.start()  # the store comes back while the service runs
        try:
            deadline = time.monotonic() + 20
            while files(fallback / "fb") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert files(fallback / "fb") == []
            with SnapshotClient(addr) as sc:
                got = sc.get("auto-fb-slot0")
            assert got.info.target.meta.n_tokens == len(held[0]) and got.draft is not None
        finally:
            snap.stop(grace=0)

# --- process level: SIGTERM with the snapshot service frozen (SIGSTOP) --------------------


def test_sigterm_with_a_frozen_store_ends_within_the_budget(pair: tuple[Path, Path],
                                                             tmp_path: Path) -> None:
    """The stop waits for the frozen service no longer than --auto-save-timeout (here
    the first save's own 3 s deadline ends it first), writes both sessions to the
    fallback, and exits 0; the next start with the service back uploads and restores
    them."""
    target, draft = pair
    fallback = tmp_path / "fallback"
    with ServerProcess(tmp_path / "snap") as snap:
        argv = ("--model", str(target), "--draft", str(draft), "--slots", "2", "--ctx", "256",
                "--threads", "1", "--instance-id", "hung", "--snapshot-addr", snap.address,
                "--fallback-save-path", str(fallback), "--shutdown-grace", "1",
                "--snapshot-timeout", "3", "--auto-save-timeout", "4")
        with InferenceProcess(*argv) as p:
            held = []
            for slot, prompt in enumerate(PROMPTS):
                s = Session(slot=slot, max_tokens=N)
                s.turn(p, prompt)
                held.append(len(s.history))
            os.kill(snap.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                assert p.stop(timeout=60) == 0
                took = time.monotonic() - t0
            finally:
                os.kill(snap.proc.pid, signal.SIGCONT)
        # grace 1 s (nothing runs) + gRPC stop <= 1 s + the first Put's 3 s deadline
        # (+1 s slack) + two local writes
        assert took < 1 + 1 + 4 + 1 + 3, took
        assert files(fallback / "hung") == ["auto-hung-slot0", "auto-hung-slot0.drft",
                                   "auto-hung-slot1", "auto-hung-slot1.drft"]
        rep = p.records("auto-save done")[0]
        assert (rep["saved"], rep["to_fallback"], rep["failed"]) == (0, 2, 0)
        with InferenceProcess(*argv) as p2:
            assert [s.n_tokens for s in p2.client.slots()] == held
            assert files(fallback / "hung") == []
            assert p2.records("auto-restore done")[0]["from_fallback"] == 0
            assert p2.stop() == 0


# --- the uploader against a stop ------------------------------------------------------


class BlockingStore:
    """A store whose save waits until released (a hung snapshot service)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.saved: list[tuple[str, bytes]] = []

    def describe(self) -> str:
        return "blocking"

    def save(self, name: str, target: bytes, draft: bytes | None, **kw: object) -> int:
        self.entered.set()
        assert self.release.wait(30)
        self.saved.append((name, bytes(target)))
        return len(target)


def test_a_late_upload_never_removes_a_newer_fallback_file(tmp_path: Path) -> None:
    """The stop waits 0.2 s for the uploader, which is stuck on the store: close says
    so (the stop then saves only to the fallback). The stop's newer file survives the
    late upload of the older one, which then finishes."""
    fb = Fallback(tmp_path / "fb", "i")
    fb.store.save("auto-i-slot0", b"old", None)
    store = BlockingStore()
    fb.start_uploader(store, interval=0.01, call_timeout=10.0)  # type: ignore[arg-type]
    assert store.entered.wait(10)
    assert fb.close(0.2) is False  # still waiting on the store
    fb.store.save("auto-i-slot0", b"new", None)  # the stop's save, not blocked
    store.release.set()
    assert fb._thread is not None
    fb._thread.join(10)
    assert not fb._thread.is_alive()
    assert store.saved == [("auto-i-slot0", b"old")]
    assert (tmp_path / "fb" / "i" / "auto-i-slot0").read_bytes() == b"new"
    assert fb.pending() == ["auto-i-slot0"]  # uploaded at the next start
