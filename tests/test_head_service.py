"""The service with a feature head (--head): the head drafts through the engine and the
greedy output is the target-only one; a head that is missing, corrupt or trained for
another target stops the start with a clear error, the default one is skipped when it
does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest

import inference_svc.config as config_module
from inference_svc.api.server import serve
from inference_svc.client import InferenceClient
from inference_svc.config import Config, Speculative
from inference_svc.core import Model, ModelLoadError
from tests.fixtures.servicekit import model_pair, running, service_config
from tests.headkit import write_head

pytestmark = pytest.mark.native

PROMPT = [56] * 12  # the target repeats itself now and then after it


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target, _ = model_pair(tmp_path_factory.getbasetemp())
    head = write_head(tmp_path_factory.mktemp("svc-head") / "head.gguf", target, k=0,
                      echo=True)
    return target, head


def config(target: Path, head: Path | None, **kw: object) -> Config:
    spec = Speculative(enabled=True, n_max=4, p_min=0.0, adaptive=False, lookup=False)
    return service_config(target, None, head=head, speculative=spec, **kw)


def generate(cfg: Config, n: int = 40) -> tuple[list[int], object]:
    with running(cfg) as srv, InferenceClient(f"127.0.0.1:{srv.port}", timeout=60) as c:
        _, last = c.generate(PROMPT, max_tokens=n, temperature=0.0)
        toks = [t for r in c.generate(PROMPT, max_tokens=n, temperature=0.0,
                                      id_slot=1)[0] for t in r.tokens]
        return toks, last.timings


def test_head_drafts_through_the_service(models: tuple[Path, Path]) -> None:
    target, head = models
    plain, t0 = generate(config(target, None))
    with_head, t1 = generate(config(target, head))
    assert with_head == plain and len(plain) == 40
    assert t0.draft_n == 0 and t0.head_n == 0  # type: ignore[attr-defined]
    assert t1.head_n == t1.draft_n > 0  # type: ignore[attr-defined]
    assert 0 < t1.head_n_accepted == t1.draft_n_accepted < t1.draft_n  # type: ignore[attr-defined]


def test_head_errors_at_start(models: tuple[Path, Path], tmp_path: Path) -> None:
    target, head = models
    with pytest.raises(ModelLoadError, match="head file not found"):
        serve(config(target, tmp_path / "missing.gguf"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head.read_bytes()[:2000])
    with pytest.raises(ModelLoadError, match="not a readable head GGUF file|past the end"):
        serve(config(target, cut))
    other = write_head(tmp_path / "other.gguf", target, k=16, fingerprint="cd" * 32)
    with Model.load(target) as m:
        fp = m.fingerprint
    with pytest.raises(ModelLoadError, match=f"fingerprint {'cd' * 32}.*fingerprint {fp}"):
        serve(config(target, other))


def test_default_head_for_another_target_is_skipped(models: tuple[Path, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    target, _ = models
    other = write_head(tmp_path / "default.gguf", target, k=16, fingerprint="ef" * 32)
    monkeypatch.setattr(config_module, "DEFAULT_HEAD", other)
    cfg = config(target, other)
    assert cfg.head_is_default and cfg.head_to_load == other
    with running(cfg) as srv:
        assert srv._engine is not None and srv._engine.owner.head is None


def turn(c: InferenceClient, slot: int, prompt: list[int]) -> tuple[list[int], object]:
    responses, last = c.generate(prompt, max_tokens=30, temperature=0.0, id_slot=slot,
                                 cache_prompt=True)
    return [t for r in responses for t in r.tokens], last.timings


def test_head_state_survives_save_erase_restore(models: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    """The turn after SaveSlot -> EraseSlot -> RestoreSlot drafts and accepts exactly
    what a never-saved slot's does: the .drft (sidecar version 4) holds the head's KV
    and h_{n-1}. Without the sidecar the head cannot draft for the restored slot."""
    target, head = models
    with running(config(target, head, slot_save_path=tmp_path)) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}", timeout=60) as c:
        first, _ = turn(c, 0, PROMPT)
        turn(c, 1, PROMPT)
        saved = c.save(0, "s")
        assert (tmp_path / "s.drft").exists()
        assert (tmp_path / "s.drft").read_bytes()[4:8] == (4).to_bytes(4, "little")
        c.erase(0)
        restored = c.restore(0, "s")
        assert restored.draft_restored and saved.draft_saved
        assert saved.n_saved == restored.n_restored
        follow = PROMPT + first + [56, 56, 56]
        never, t_never = turn(c, 1, follow)
        again, t_again = turn(c, 0, follow)
        assert again == never
        assert t_never.head_n > 0  # type: ignore[attr-defined]
        for f in ("draft_n", "draft_n_accepted", "head_n", "head_n_accepted", "cache_n",
                  "n_steps"):
            assert getattr(t_again, f) == getattr(t_never, f), f
        # the same save without its sidecar: the head sits the turn out
        (tmp_path / "s.drft").unlink()
        c.erase(0)
        assert not c.restore(0, "s").draft_restored
        cold, t_cold = turn(c, 0, follow)
        assert cold == never and t_cold.head_n == 0  # type: ignore[attr-defined]


def test_head_flag_and_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from inference_svc.config import DEFAULT_HEAD, from_args

    assert from_args(["--head", "none"]).head is None
    assert from_args([]).head == DEFAULT_HEAD
    monkeypatch.setenv("WARMSLOT_HEAD", str(tmp_path / "h.gguf"))
    assert from_args([]).head == tmp_path / "h.gguf"
    assert from_args(["--head", "none"]).head is None  # the flag wins
    with pytest.raises(ModelLoadError, match="head file not found"):
        from_args([]).check_models()
