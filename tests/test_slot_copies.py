"""Save and restore copy a slot's state once: the memory a save or restore allocates
(tracemalloc peak, numpy buffers included) stays within 1.1x the bytes of the slot
files, for the local store and the snapshot service (plus the few chunks a gRPC
stream holds in flight). A second full copy anywhere on
the path (joining the file's parts, copying the draft state out of its file) would
take it to 1.5x-2x. A sliding-window (gemma3) model's file has a window section more
between its tokens and KV: it too is sealed in the buffer the core wrote."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient
from inference_svc.config import Speculative
from inference_svc.storage import slotfile
from inference_svc.storage.snapshot_store import SnapshotStore
from inference_svc.storage.store import LocalStore
from inference_svc.types import DraftPolicy, RestoreResult, SaveResult
from snapshot_svc.client.contract import MAX_CHUNK_BYTES
from snapshot_svc.testing import ServerProcess
from tests.factory import Shape, write_model
from tests.fixtures.servicekit import fresh_client, model_pair, running, service_config

# 8 KiB of f16 KV per token in each model: 904 tokens make about 15 MB of slot files, far
# above what the rest of a save allocates (token lists, messages, log records)
SHAPE = Shape(n_vocab=300, n_embd=512, n_layer=4, n_head=8, n_head_kv=8, n_ff=64, n_ctx=1024)
PROMPT = [(31 * k + 7) % 290 + 1 for k in range(900)]
SLACK = 1.1
# a snapshot transfer also holds the framed messages gRPC has not sent or handed over yet
IN_FLIGHT = 4 * MAX_CHUNK_BYTES


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pair = model_pair(tmp_path_factory.getbasetemp(), "copies", shape=SHAPE)
    cfg = service_config(*pair, ctx=1024, batch=256,
                         slot_save_path=tmp_path_factory.mktemp("copies-slots"))
    with running(cfg) as srv:
        with fresh_client(srv) as c:
            _fill(c)
        yield srv


def _fill(c: InferenceClient) -> None:
    rs, last = c.generate(PROMPT, max_tokens=4, id_slot=0, temperature=0.0, speculative=True)
    assert last.done


def peak_of(fn: Callable[[], object]) -> tuple[object, int]:
    """fn's result and the most memory it held allocated at once, in bytes."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def check_round_trip(srv: Server, store: LocalStore | SnapshotStore, name: str,
                     in_flight: int = 0, *, draft: bool = True, n_bytes: int = 14_000_000
                     ) -> SaveResult:
    slots = srv._slots
    assert slots is not None
    saved, save_peak = peak_of(lambda: slots.save_on_engine(0, name, store=store))
    assert isinstance(saved, SaveResult)
    n = saved.n_written
    assert saved.draft_saved is draft and saved.n_saved == len(PROMPT) + 4
    assert n > n_bytes
    assert n <= save_peak < SLACK * n + in_flight, (save_peak, n)
    restored, restore_peak = peak_of(lambda: slots.restore(1, name, store=store))
    assert isinstance(restored, RestoreResult)
    assert restored.draft_policy is (DraftPolicy.SIDECAR if draft else DraftPolicy.NONE)
    assert restored.n_read == n
    assert restore_peak < SLACK * n + in_flight, (restore_peak, n)
    engine = srv._engine
    assert engine is not None
    assert engine.call(lambda: engine.owner.tokens(1) == engine.owner.tokens(0))
    return saved


def test_local_store_copies_the_state_once(server: Server, tmp_path: Path) -> None:
    check_round_trip(server, LocalStore(tmp_path / "slots"), "once")


def test_snapshot_store_copies_the_state_once(server: Server, tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "snap") as proc, SnapshotStore(proc.address) as store:
        check_round_trip(server, store, "once", IN_FLIGHT)


# gemma3: layers 5 and 11 keep every position, the other ten a ring of 32 + 16 rows; 4 KiB
# of f16 KV per token and layer: 904 tokens make a windowed slot file of about 9.4 MB
GEMMA_SHAPE = Shape(n_vocab=300, n_embd=64, n_layer=12, n_head=8, n_head_kv=8, n_ff=64,
                    n_ctx=1024, arch="gemma3", head_dim=128, n_swa=32, tied=True)
GEMMA_FILE = (128 + 16 + 4 * 904 + 16 + 4 + 12 + 16
              + 2 * 2 * 1024 * (2 * 904 + 10 * (32 + 16)) + 32)


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("copies-gemma3") / "gemma3.gguf"
    write_model(path, GEMMA_SHAPE, seed=5)
    cfg = service_config(path, None, ctx=1024, batch=256,
                         slot_save_path=tmp_path_factory.mktemp("copies-gemma3-slots"),
                         speculative=Speculative(enabled=False))
    with running(cfg) as srv:
        with fresh_client(srv) as c:
            rs, last = c.generate(PROMPT, max_tokens=4, id_slot=0, temperature=0.0)
            assert last.done
        yield srv


def test_local_store_copies_a_windowed_state_once(gemma_server: Server, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "slots")
    saved = check_round_trip(gemma_server, store, "once", draft=False, n_bytes=9_000_000)
    assert saved.n_written == GEMMA_FILE
    data = (tmp_path / "slots" / "once").read_bytes()
    assert slotfile.read_meta(data).version == slotfile.TARGET_VERSION_WINDOW


def test_snapshot_store_copies_a_windowed_state_once(gemma_server: Server,
                                                     tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "snap") as proc, SnapshotStore(proc.address) as store:
        saved = check_round_trip(gemma_server, store, "once", IN_FLIGHT, draft=False,
                                 n_bytes=9_000_000)
    assert saved.n_written == GEMMA_FILE
