"""SaveSlot / RestoreSlot of the inference service over a snapshot service: what the
responses and the log say matches what the store holds, the digest the encoder
computed reaches the store, and a restore whose caller gave up is not applied."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import grpc
import pytest

from inference_svc import log
from inference_svc.client import InferenceClient
from inference_svc.storage import slotfile
from snapshot_svc.client import SnapshotClient
from snapshot_svc.testing import running_server
from tests.fixtures.servicekit import model_pair, running, service_config

pytestmark = pytest.mark.timeout(120)
PROMPT = [5, 17, 250, 3, 99, 42, 7, 120, 64, 33]
N = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return model_pair(tmp_path_factory.getbasetemp())


def fields(caplog: pytest.LogCaptureFixture, msg: str) -> list[dict[str, object]]:
    """The structured fields of the service's log records with this message."""
    return [dict(getattr(r, "fields", {})) for r in caplog.records if r.getMessage() == msg]


def session(c: InferenceClient, slot: int) -> int:
    """A short session on `slot`; its token count."""
    _, last = c.generate(PROMPT, id_slot=slot, max_tokens=N, temperature=0.0)
    assert last.done
    return len(PROMPT) + N


@pytest.mark.parametrize("peer", ["client-max-protocol-1", "server-max-protocol-1"])
def test_draft_saved_false_when_the_store_kept_no_draft(pair: tuple[Path, Path], tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture,
                                                        peer: str) -> None:
    caplog.set_level(logging.INFO, logger=log.get().name)
    client_max = 1 if peer == "client-max-protocol-1" else 2
    server_max = 1 if peer == "server-max-protocol-1" else 2
    with running_server(tmp_path / "snap", max_protocol=server_max) as snap, \
            running(service_config(*pair, snapshot_addr=snap.address,
                                   snapshot_client_max_protocol=client_max)) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}", timeout=60) as c, \
            SnapshotClient(snap.address) as sc:
        n = session(c, 0)
        saved = c.save(0, "p1")
        info = sc.stat("p1")
    assert info.draft is None
    assert (saved.n_saved, saved.draft_saved, saved.n_written) == (n, False, info.target.size)
    logged = [f for f in fields(caplog, "slot saved") if f["filename"] == "p1"]
    assert [(f["draft_saved"], f["bytes"]) for f in logged] == [(False, info.target.size)]


def test_draft_saved_true_with_a_paired_save(pair: tuple[Path, Path], tmp_path: Path) -> None:
    with running_server(tmp_path / "snap") as snap, \
            running(service_config(*pair, snapshot_addr=snap.address)) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}", timeout=60) as c, \
            SnapshotClient(snap.address) as sc:
        session(c, 0)
        saved = c.save(0, "p2")
        info = sc.stat("p2")
    assert info.draft is not None
    assert (saved.draft_saved, saved.n_written) == (True, info.target.size + info.draft.size)


def test_the_encoders_digest_reaches_the_store(pair: tuple[Path, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot encoder computes the target's SHA-256 (the sidecar names it); the
    store gets it, so the target is not hashed a second time for the Put."""
    with running_server(tmp_path / "snap") as snap, \
            running(service_config(*pair, snapshot_addr=snap.address)) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}", timeout=60) as c:
        store = srv._store
        assert store is not None
        given: list[str | None] = []
        inner = store.save

        def save(name: str, target: bytes, draft: bytes | None, **kw: object) -> int:
            given.append(kw.get("target_sha256"))  # type: ignore[arg-type]
            return inner(name, target, draft, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(store, "save", save)
        session(c, 0)
        saved = c.save(0, "d")
        with SnapshotClient(snap.address) as sc:
            stored = sc.get("d").target
    assert given == [saved.target_sha256] * 2  # SaveSlot, then the auto-save at the stop
    assert saved.target_sha256 == slotfile.digest(bytes(stored))



def test_a_restore_whose_caller_gave_up_is_not_applied(pair: tuple[Path, Path], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The store answers after the RestoreSlot caller's deadline (here it ignores the
    deadline it is given, the worst case): the caller has DEADLINE_EXCEEDED, and the
    slot keeps the session it held."""
    with running(service_config(*pair, slot_save_path=tmp_path / "slots")) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}", timeout=60) as c, \
            InferenceClient(f"127.0.0.1:{srv.port}", timeout=0.5) as hasty:
        n = session(c, 0)
        c.generate([9, 8, 7], id_slot=1, max_tokens=2, temperature=0.0)
        other = c.save(1, "other")
        assert other.n_saved == 5 != n
        store = srv._store
        assert store is not None
        inner = store.load
        deadlines: list[float | None] = []

        def late_load(name: str, *, deadline: float | None = None) -> object:
            deadlines.append(deadline)
            time.sleep(1.0)
            return inner(name, deadline=deadline)

        slots = srv._slots
        assert slots is not None
        restore = slots.restore
        ended: list[BaseException | None] = []
        handler_done = threading.Event()

        def watched_restore(*a: object, **kw: object) -> object:
            try:
                res = restore(*a, **kw)  # type: ignore[arg-type]
                ended.append(None)
                return res
            except BaseException as exc:
                ended.append(exc)
                raise
            finally:
                handler_done.set()

        monkeypatch.setattr(store, "load", late_load)
        monkeypatch.setattr(slots, "restore", watched_restore)
        with pytest.raises(grpc.RpcError) as err:
            hasty.restore(0, "other")
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert handler_done.wait(10)  # the server's side of the call has ended
        assert [type(e).__name__ for e in ended] == ["DeadlineExceeded"]
        assert [s.n_tokens for s in c.slots()] == [n, 5]
        assert len(deadlines) == 1 and deadlines[0] is not None  # the store was told
