"""The Context's memory check before it allocates: it asks for exactly the bytes of KV
cache the core then allocates, a sliding-window layer counting its ring (n_swa + 16
rows) and not n_ctx. With MemAvailable at exactly that many bytes the context opens;
one byte less and it is refused. Real models: Gemma 3 270M (3 global layers, 15 local
ones in rings of 528 rows) and SmolLM2 135M (30 global layers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_svc.core import Context, CoreMemoryError, Model
from inference_svc.core import model as core_model
from tests.gemma3kit import gemma_path, needs_gemma3
from tests.test_smollm2 import PATH as SMOLLM2_PATH

pytestmark = pytest.mark.native

needs_smollm2 = pytest.mark.skipif(SMOLLM2_PATH is None or not SMOLLM2_PATH.is_file(),
                                   reason="the SmolLM2 GGUF is not present")


def check_fits_exactly(monkeypatch: pytest.MonkeyPatch, path: Path, n_slots: int, n_ctx: int,
                       kv_type: str, want: int, swa_full: bool = False) -> None:
    """A context of these parameters allocates `want` bytes of KV cache, and the check
    before it asks for exactly those."""
    with Model.load(path) as m:
        monkeypatch.setattr(core_model, "available_memory_bytes", lambda: want)
        with Context(m, n_slots=n_slots, n_ctx=n_ctx, n_threads=1, kv_type=kv_type,
                     swa_full=swa_full) as ctx:
            assert ctx.kv_bytes == want
        monkeypatch.setattr(core_model, "available_memory_bytes", lambda: want - 1)
        with pytest.raises(CoreMemoryError, match=f"needs {want / 2**20:.1f} MiB of KV cache"):
            Context(m, n_slots=n_slots, n_ctx=n_ctx, n_threads=1, kv_type=kv_type,
                    swa_full=swa_full)


@needs_gemma3
@pytest.mark.parametrize(("n_slots", "n_ctx", "kv_type", "swa_full", "want"), [
    # K and V x 2 bytes x kv_dim 256 x (3 global layers x n_ctx + 15 rings x 528 rows)
    (1, 4096, "f16", False, 2 * 2 * 256 * (3 * 4096 + 15 * 528)),  # 20,692,992
    (2, 32768, "f16", False, 2 * 2 * 2 * 256 * (3 * 32768 + 15 * 528)),  # 217,546,752
    (1, 8192, "f32", False, 2 * 4 * 256 * (3 * 8192 + 15 * 528)),  # 66,551,808
    # a context no longer than a ring: every layer n_ctx rows
    (1, 500, "f16", False, 2 * 2 * 256 * 18 * 500),
    # swa_full: every layer keeps every position
    (1, 4096, "f16", True, 2 * 2 * 256 * 18 * 4096),  # 75,497,472
    # q8_0: a head of 256 is 8 blocks of 34 bytes
    (1, 4096, "q8_0", False, 2 * 8 * 34 * (3 * 4096 + 15 * 528)),  # 10,993,152
])
def test_gemma3_estimate_is_the_allocation(monkeypatch: pytest.MonkeyPatch, n_slots: int,
                                           n_ctx: int, kv_type: str, swa_full: bool,
                                           want: int) -> None:
    path = gemma_path()
    assert path is not None
    check_fits_exactly(monkeypatch, path, n_slots, n_ctx, kv_type, want, swa_full)


@needs_smollm2
@pytest.mark.parametrize(("n_slots", "n_ctx", "kv_type", "want"), [
    # K and V x 2 bytes x kv_dim 192 (3 kv heads x 64) x 30 layers x n_ctx x n_slots
    (1, 4096, "f16", 2 * 2 * 192 * 30 * 4096),  # 94,371,840
    (2, 2048, "f32", 2 * 4 * 192 * 30 * 2048 * 2),  # 188,743,680
    # q8_0: 3 kv heads x 2 blocks of 34 bytes
    (1, 4096, "q8_0", 2 * 3 * 2 * 34 * 30 * 4096),  # 50,135,040
])
def test_smollm2_estimate_is_the_allocation(monkeypatch: pytest.MonkeyPatch, n_slots: int,
                                            n_ctx: int, kv_type: str, want: int) -> None:
    assert SMOLLM2_PATH is not None
    check_fits_exactly(monkeypatch, SMOLLM2_PATH, n_slots, n_ctx, kv_type, want)
