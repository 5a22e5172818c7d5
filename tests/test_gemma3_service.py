"""A sliding-window (gemma3) model through the service. Its local layers keep a ring of
n_swa + 16 positions and its slot files hold only those (format version 3): a session
saved, erased and restored (local store, snapshot service, a restart of the process)
continues with only its new tokens processed; a prompt that diverges from it keeps the
common prefix when the rings still hold that prefix's window (the last 17 tokens), and
is re-processed from position 0 when they do not. The output is a cold run's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient
from inference_svc.config import Speculative
from inference_svc.storage import slotfile
from snapshot_svc.testing import ServerProcess, running_server
from tests.factory import Shape, write_model
from tests.fixtures.servicekit import Reference, fresh_client, running, service_config
from tests.resumekit import InferenceProcess

pytestmark = pytest.mark.native

# a window of 8 positions, far shorter than the session: layers 0-4 and 6 local
SHAPE = Shape(n_vocab=300, n_embd=64, n_layer=7, n_head=4, n_head_kv=2, n_ff=96,
              arch="gemma3", head_dim=32, n_swa=8, tied=True)
N = 12
RING = SHAPE.n_swa + 16  # rows of a local layer's ring (WS_SWA_SPARE = 16)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma3-svc") / "gemma3.gguf"
    write_model(path, SHAPE, seed=21)
    return path


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gemma3-slots")


@pytest.fixture(scope="module")
def server(model: Path, store_dir: Path) -> Iterator[Server]:
    cfg = service_config(model, None, slot_save_path=store_dir,
                         speculative=Speculative(enabled=False))
    with running(cfg) as srv:
        yield srv


def gen(c: InferenceClient, prompt: list[int], slot: int) -> tuple[list[int], object]:
    rs, last = c.generate(prompt, max_tokens=N, id_slot=slot, temperature=0.0)
    assert last.done
    return [t for r in rs for t in r.tokens], last


def session(c: InferenceClient, slot: int) -> tuple[list[int], list[int]]:
    """A session far longer than the ring on `slot`: its prompt and output."""
    a = c.tokenize("the quick brown fox jumps over the lazy dog " * 4)
    assert len(a) > 2 * RING
    out, last = gen(c, a, slot)
    assert (last.timings.prompt_n, last.timings.cache_n) == (len(a), 0)
    return a, out


@pytest.mark.parametrize("store", ["local", "snapshot"])
def test_restored_window_session_processes_only_new_tokens(model: Path, store_dir: Path,
                                                           tmp_path: Path, store: str) -> None:
    with running_server(tmp_path / "snap") as snap:
        where = ({"slot_save_path": store_dir} if store == "local"
                 else {"snapshot_addr": snap.address})
        cfg = service_config(model, None, speculative=Speculative(enabled=False), **where)
        with running(cfg) as srv, fresh_client(srv) as client:
            a, out = session(client, 1)
            n = len(a) + N
            saved = client.save(1, "window-session")
            assert saved.n_saved == n
            assert client.erase(1).n_erased == n
            new = client.tokenize(" and one more sentence after the restore")
            b = a + out + new
            expected = Reference(model, None).generate(b, N)  # a cold prefill of all of b
            for slot in (1, 0):
                r = client.restore(slot, "window-session")
                assert r.n_restored == n
                out_b, last = gen(client, b, slot)
                assert (last.timings.prompt_n, last.timings.cache_n) == (len(new), n)
                assert out_b == expected
    if store == "local":
        # the file holds the rings' positions only: global layer 5 x n, 6 local x RING
        t = slotfile.decode_target((store_dir / "window-session").read_bytes())
        assert (t.version, t.window.n_window) == (slotfile.TARGET_VERSION_WINDOW, RING)
        assert len(t.kv) == 2 * (n + 6 * RING) * SHAPE.n_head_kv * SHAPE.head_dim * 2


def test_divergence_inside_the_window(client: InferenceClient, model: Path) -> None:
    """After a restore the rings hold the session's last RING positions. A prompt whose
    common prefix with the session keeps the window of its next token (at most 17 tokens
    dropped) processes only what follows the prefix; one that diverges earlier, even
    inside the last window, is re-processed whole: the keys of the local layers older
    than the rings are gone, and rebuilding them needs every earlier position."""
    assert client.info().slot_file_version == 3  # what this model's long sessions write
    a, out = session(client, 1)
    hist = a + out
    n = len(hist)
    client.save(1, "diverge")
    other = client.tokenize(" but then something else happened")
    for drop, cached in ((1, n - 1), (16, n - 16), (17, n - 17), (18, 0),
                         (SHAPE.n_swa - 1 + 17, 0)):
        assert drop <= RING  # every case diverges inside the rings' span
        fork = 5 if hist[n - drop] != 5 else 6  # differs from the session's token there
        prompt = hist[:n - drop] + [fork] + other
        client.restore(1, "diverge")
        got, last = gen(client, prompt, 1)
        t = last.timings
        assert (t.cache_n, t.prompt_n) == (cached, len(prompt) - cached), drop
        assert got == Reference(model, None).generate(prompt, N), drop


def test_restart_resumes_the_window_session(model: Path, tmp_path: Path) -> None:
    """SIGTERM saves the slot (through the snapshot service), a new process restores it
    at start-up, and the next turn processes only its new tokens."""
    common = ("--model", str(model), "--draft", "none", "--slots", "2", "--ctx", "256",
              "--threads", "1", "--instance-id", "gemma-restart", "--shutdown-grace", "30")
    with ServerProcess(tmp_path / "snapshots") as snap:
        store = ("--snapshot-addr", snap.address)
        with InferenceProcess(*common, *store) as first:
            a, out = session(first.client, 0)
            n = len(a) + N
            new = first.client.tokenize(" and the next turn")
            assert first.stop() == 0
            assert [(r["slot"], r["n_tokens"]) for r in first.records("slot saved")] == [(0, n)]
        b = a + out + new
        with InferenceProcess(*common, *store) as second:
            assert [r["n_tokens"] for r in second.records("slot restored")] == [n]
            got, last = gen(second.client, b, 0)
            assert (last.timings.prompt_n, last.timings.cache_n) == (len(new), n)
            assert got == Reference(model, None).generate(b, N)
            assert second.stop() == 0
