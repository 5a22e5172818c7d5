"""A sliding-window (gemma3) model through the service: a session saved, erased and
restored continues with only its new tokens processed. The slot state keeps every
position of every layer (a local layer's attention is masked to its window, its keys
and values are not dropped), so a restore leaves nothing to re-compute."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inference_svc.client import InferenceClient
from inference_svc.config import Speculative
from inference_svc.server import Server
from tests.factory import Shape, write_model
from tests.fixtures.servicekit import Reference, fresh_client, running, service_config

pytestmark = pytest.mark.native

# a window of 8 positions, far shorter than the session: layers 0-4 and 6 local
SHAPE = Shape(n_vocab=300, n_embd=64, n_layer=7, n_head=4, n_head_kv=2, n_ff=96,
              arch="gemma3", head_dim=32, n_swa=8, tied=True)
N = 12


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


@pytest.fixture()
def client(server: Server) -> Iterator[InferenceClient]:
    with fresh_client(server) as c:
        yield c


def gen(c: InferenceClient, prompt: list[int], slot: int) -> tuple[list[int], object]:
    rs, last = c.generate(prompt, max_tokens=N, id_slot=slot, temperature=0.0)
    assert last.done
    return [t for r in rs for t in r.tokens], last


def test_restored_window_session_processes_only_new_tokens(client: InferenceClient,
                                                           model: Path) -> None:
    a = client.tokenize("the quick brown fox jumps over the lazy dog " * 2)
    assert len(a) > 4 * SHAPE.n_swa
    out, last = gen(client, a, 1)
    assert (last.timings.prompt_n, last.timings.cache_n) == (len(a), 0)
    saved = client.save(1, "window-session")
    assert saved.n_saved == len(a) + N
    assert client.erase(1).n_erased == len(a) + N
    new = client.tokenize(" and one more sentence after the restore")
    b = a + out + new
    expected = Reference(model, None).generate(b, N)  # a cold prefill of all of b
    for slot in (1, 0):
        r = client.restore(slot, "window-session")
        assert r.n_restored == len(a) + N
        out_b, last = gen(client, b, slot)
        assert (last.timings.prompt_n, last.timings.cache_n) == (len(new), len(a) + N)
        assert out_b == expected
