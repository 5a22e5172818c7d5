"""--kv-type: the flag (and WARMSLOT_KV_TYPE) reaches both contexts of the service; a
saved slot file holds exactly the KV a core context of that type computes, in that
type's size; a file of the other type is refused with FAILED_PRECONDITION."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest

from inference_svc import config
from inference_svc.client import InferenceClient
from inference_svc.core import Context, Model
from inference_svc.storage import slotfile
from tests.fixtures.servicekit import TARGET_SHAPE, Reference, model_pair, running, service_config

PROMPT = [5, 17, 250, 3, 99, 42, 8, 8, 120]
N_GEN = 6
# the service test pair with heads of 32 (whole q8_0 blocks; the default pair's are 16)
HD32 = dataclasses.replace(TARGET_SHAPE, n_embd=128)
# bytes of one token's K and V in every layer: K+V x 2 layers x 2 KV heads x one head
PER_TOKEN = {"f32": 2 * 2 * 2 * 16 * 4, "f16": 2 * 2 * 2 * 16 * 2, "q8_0": 2 * 2 * 2 * 34}


def pair(base: Path, kv_type: str) -> tuple[Path, Path]:
    """The service test pair, with heads of 32 for q8_0."""
    return model_pair(base, "hd32", shape=HD32) if kv_type == "q8_0" else model_pair(base)


def test_flag_and_variable() -> None:
    assert config.Config().kv_type == config.from_args([], {}).kv_type == "f16"
    assert config.from_args(["--kv-type", "f32"], {}).kv_type == "f32"
    assert config.from_args([], {"WARMSLOT_KV_TYPE": "f32"}).kv_type == "f32"
    assert config.from_args(["--kv-type", "f16"], {"WARMSLOT_KV_TYPE": "f32"}).kv_type == "f16"
    with pytest.raises(SystemExit):
        config.from_args(["--kv-type", "q8"], {})
    with pytest.raises(ValueError, match="--kv-type 'bf16' is not one of f16, f32"):
        config.Config(kv_type="bf16")


@pytest.mark.parametrize("kv_type", ["f16", "f32", "q8_0"])
def test_service_keeps_and_saves_the_configured_kv_type(tmp_path_factory: pytest.TempPathFactory,
                                                         tmp_path: Path, kv_type: str) -> None:
    target, draft = pair(tmp_path_factory.getbasetemp(), kv_type)
    cfg = service_config(target, draft, slot_save_path=tmp_path, kv_type=kv_type,
                         speculative=config.Speculative())
    with running(cfg) as srv, InferenceClient(f"127.0.0.1:{srv.port}") as c:
        rs, _ = c.generate(PROMPT, max_tokens=N_GEN, id_slot=0, temperature=0.0)
        got = [t for r in rs for t in r.tokens]
        c.save(0, "s")
    assert got == Reference(target, draft, kv_type=kv_type).generate(PROMPT, N_GEN)
    data = (tmp_path / "s").read_bytes()
    t = slotfile.decode_target(data)
    assert t.layout.dtype == slotfile.DTYPE_BY_NAME[kv_type]
    assert slotfile.decode_draft((tmp_path / "s.drft").read_bytes()).layout == t.layout
    n = len(PROMPT) + N_GEN  # a save decodes the pending last token into the KV
    per_token = PER_TOKEN[kv_type]
    assert t.n_tokens == n and len(data) == 128 + 16 + 4 * n + 16 + n * per_token + 32
    # the KV is what a core context of the same type computes for these tokens, bit for bit
    with Model.load(target) as m, Context(m, n_ctx=256, n_threads=1, kv_type=kv_type) as ctx:
        ctx.decode(0, list(t.tokens))
        assert bytes(t.kv) == ctx.get_state(0)[32 + 4 * n:]


def test_service_refuses_a_file_of_the_other_kv_type(tmp_path_factory: pytest.TempPathFactory,
                                                     tmp_path: Path) -> None:
    target, draft = model_pair(tmp_path_factory.getbasetemp())
    f32 = service_config(target, draft, slot_save_path=tmp_path, kv_type="f32")
    with running(f32) as srv, InferenceClient(f"127.0.0.1:{srv.port}") as c:
        c.generate(PROMPT, max_tokens=2, id_slot=0, temperature=0.0)
        c.save(0, "s32")
    f16 = service_config(target, draft, slot_save_path=tmp_path)
    with running(f16) as srv, InferenceClient(f"127.0.0.1:{srv.port}") as c:
        c.generate(PROMPT[:3], max_tokens=2, id_slot=1, temperature=0.0)
        with pytest.raises(grpc.RpcError) as exc:
            c.restore(1, "s32")
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert exc.value.details().endswith(
            "slot file holds an f32 KV cache, this server keeps f16: restore it on a server "
            "started with --kv-type f32")
        # the check fails before the slot is touched: it keeps its 3 + 2 tokens
        assert [s.n_tokens for s in c.slots()] == [0, 5]


@pytest.mark.slow
def test_auto_restore_of_another_kv_type_is_a_cold_start(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Slots auto-saved by an f32 service (set by WARMSLOT_KV_TYPE) start cold on an f16
    service, with one warning naming the flag, and restore on an f32 one."""
    from tests.resumekit import InferenceProcess, Session

    target, draft = model_pair(tmp_path_factory.getbasetemp())
    args = ("--model", str(target), "--draft", str(draft), "--slots", "2", "--ctx", "256",
            "--threads", "1", "--instance-id", "kv", "--slot-save-path", str(tmp_path))
    with InferenceProcess(*args, env={"WARMSLOT_KV_TYPE": "f32"}) as p:
        s = Session(max_tokens=5)
        s.turn(p, list(range(1, 30)))
        assert p.stop() == 0
    n = len(s.history)
    assert slotfile.decode_target((tmp_path / "auto-kv-slot0").read_bytes()).layout.dtype == 0
    with InferenceProcess(*args) as p:
        assert [x.n_tokens for x in p.client.slots()] == [0, 0]
        warn = [r for r in p.lines if r.get("level") == "warning"]
        assert [r["msg"] for r in warn] == ["auto-restore skipped: cold start of the slot"]
        assert "restore it on a server started with --kv-type f32" in warn[0]["error"]
        p.kill()  # no auto-save of the cold slots over the f32 files
    with InferenceProcess(*args, "--kv-type", "f32") as p:
        assert [x.n_tokens for x in p.client.slots()] == [n, 0]
        assert p.stop() == 0


def test_flag_takes_q8_0() -> None:
    assert config.from_args(["--kv-type", "q8_0"], {}).kv_type == "q8_0"
    assert config.from_args([], {"WARMSLOT_KV_TYPE": "q8_0"}).kv_type == "q8_0"
    assert config.KV_TYPES == ("f16", "f32", "q8_0")


def test_q8_0_session_restores_and_continues_exactly(tmp_path_factory: pytest.TempPathFactory,
                                                     tmp_path: Path) -> None:
    """A q8_0 slot saved, restored into another slot and into a new server, continues
    with the tokens of a context that decoded the whole history at once (the blocks are
    quantized per token, whatever the batch)."""
    target, draft = pair(tmp_path_factory.getbasetemp(), "q8_0")
    cfg = service_config(target, draft, slot_save_path=tmp_path, kv_type="q8_0")
    ref = Reference(target, draft, kv_type="q8_0")
    with running(cfg) as srv, InferenceClient(f"127.0.0.1:{srv.port}") as c:
        info = c.info()
        assert (info.slot_file_version, info.draft_file_version) == (4, 3)
        rs, _ = c.generate(PROMPT, max_tokens=N_GEN, id_slot=0, temperature=0.0)
        out = [t for r in rs for t in r.tokens]
        saved = c.save(0, "q8")
        assert slotfile.decode_target((tmp_path / "q8").read_bytes()).version == 4
        assert slotfile.decode_draft((tmp_path / "q8.drft").read_bytes()).version == 3
        assert saved.n_saved == len(PROMPT) + N_GEN
        history = PROMPT + out + [7, 77, 177]
        want = ref.generate(history, N_GEN)
        assert c.restore(1, "q8").n_restored == len(PROMPT) + N_GEN
        rs, _ = c.generate(history, max_tokens=N_GEN, id_slot=1, temperature=0.0)
        assert [t for r in rs for t in r.tokens] == want
    with running(cfg) as srv, InferenceClient(f"127.0.0.1:{srv.port}") as c:
        assert c.restore(0, "q8").n_restored == len(PROMPT) + N_GEN
        rs, last = c.generate(history, max_tokens=N_GEN, id_slot=0, temperature=0.0)
        assert [t for r in rs for t in r.tokens] == want
        assert last.timings.cache_n == len(PROMPT) + N_GEN  # nothing re-prefilled


@pytest.mark.parametrize("saved, running_as", [("q8_0", "f16"), ("f16", "q8_0")])
def test_q8_0_and_f16_files_do_not_cross(tmp_path_factory: pytest.TempPathFactory,
                                         tmp_path: Path, saved: str, running_as: str) -> None:
    target, draft = pair(tmp_path_factory.getbasetemp(), "q8_0")
    with running(service_config(target, draft, slot_save_path=tmp_path, kv_type=saved)) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}") as c:
        c.generate(PROMPT, max_tokens=2, id_slot=0, temperature=0.0)
        c.save(0, "s")
    with running(service_config(target, draft, slot_save_path=tmp_path,
                                kv_type=running_as)) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}") as c:
        with pytest.raises(grpc.RpcError) as exc:
            c.restore(1, "s")
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        article = "a" if saved == "q8_0" else "an"
        assert exc.value.details().endswith(
            f"slot file holds {article} {saved} KV cache, this server keeps {running_as}: "
            f"restore it on a server started with --kv-type {saved}")
        assert [s.n_tokens for s in c.slots()] == [0, 0]
