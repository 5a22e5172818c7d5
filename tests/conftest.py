"""Shared fixtures: random GGUF models written once per session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.factory import Shape, write_model

# the snapshot service on both backends (`seaweed`, `s3env`, `server`, `snapshot_client`)
pytest_plugins = ["tests.fixtures.snapshot_backends"]

if TYPE_CHECKING:
    from inference_svc.api.server import Server
    from inference_svc.client import InferenceClient

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


@pytest.fixture(scope="session", autouse=True)
def _state_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The services' default state directory (the auto-save's local fallback) is a
    temporary one: tests never read or write the user's ~/.local/state."""
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state-home"))


@pytest.fixture(scope="session", autouse=True)
def fingerprint_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Model fingerprints are cached in a directory of this session, not the user's."""
    path = tmp_path_factory.mktemp("cache")
    old = os.environ.get("WARMSLOT_CACHE_DIR")
    os.environ["WARMSLOT_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("WARMSLOT_CACHE_DIR", None)
    else:
        os.environ["WARMSLOT_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def small_model_path(model_dir: Path) -> Path:
    path = model_dir / "small.gguf"
    write_model(path, Shape(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96))
    return path


@pytest.fixture()
def client(server: Server) -> Iterator[InferenceClient]:
    """A client of the test module's `server` fixture (a shared, module-scoped server),
    every slot erased first."""
    from tests.fixtures.servicekit import fresh_client

    with fresh_client(server) as c:
        yield c
