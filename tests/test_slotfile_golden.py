"""Golden slot files (tests/fixtures/golden, written by tests/fixtures/make_golden.py),
one set per format version: version 1 (f32 KV, no longer written), version 2 (f16
KV) and version 3 (a sliding-window model's file, its local layers holding their
window only; target only). The writer still produces the current sets byte for byte
and the version-1 content bit for bit; every set still restores, through the
functions and through a real server, into a session that continues exactly like the
one that was saved; a file restores only into a context of its own KV type."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import grpc
import pytest

from inference_svc.client import InferenceClient
from inference_svc.config import Speculative
from inference_svc.core import Context, Model
from inference_svc.core.speculative import SpecDecoder
from inference_svc.pb import inference_pb2 as pb
from inference_svc.storage import slotfile
from inference_svc.storage.snapshots import context_spec, prepare_restore
from inference_svc.storage.store import LocalStore
from tests.fixtures import make_golden
from tests.fixtures.servicekit import running, service_config

GOLDEN = make_golden.GOLDEN
SETS = make_golden.SETS
TARGET, DRAFT = GOLDEN / "tiny-target.gguf", GOLDEN / "tiny-draft.gguf"
REGENERATE = ("regenerate with `.venv/bin/python -m tests.fixtures.make_golden` only if the "
              "format version changed (keep the old files) or the core's arithmetic changed "
              "on purpose")
# the WSKV version field inside a draft state: after the 304-byte WSSP header
WSKV_VERSION_AT = struct.calcsize("<4I4Q36Q") + 4


def meta(gs: make_golden.GoldenSet) -> dict:
    return json.loads((GOLDEN / gs.meta).read_text())


def files(gs: make_golden.GoldenSet) -> tuple[bytes, bytes]:
    return (GOLDEN / gs.target).read_bytes(), (GOLDEN / gs.draft).read_bytes()


def as_version_2(draft_state: bytes | memoryview) -> bytes:
    """A version-1 draft state as the core writes it now: the same bytes but the
    embedded WSKV version."""
    b = bytearray(draft_state)
    assert struct.unpack_from("<I", b, WSKV_VERSION_AT)[0] == 1
    struct.pack_into("<I", b, WSKV_VERSION_AT, 2)
    return bytes(b)


@pytest.mark.parametrize("version", sorted(SETS))
def test_decode_then_encode(version: int) -> None:
    gs = SETS[version]
    m = meta(gs)
    target, draft = files(gs)
    t, d = slotfile.decode_target(target), slotfile.decode_draft(draft)
    assert (t.version, d.version) == (version, version) == (m["format_version"],) * 2
    dtype = slotfile.DTYPE_BY_NAME[gs.kv_type]
    assert (t.layout.dtype, d.layout.dtype) == (dtype, dtype)
    assert m.get("kv_type", "f32") == gs.kv_type
    assert list(t.tokens) == m["tokens"]
    assert t.fingerprint == m["target_fingerprint"] and t.n_ctx == m["n_ctx"]
    assert d.fingerprint == m["draft_fingerprint"]
    assert d.target_digest == slotfile.digest(target) == m["target_sha256"]
    new_t = slotfile.encode_target(t)
    if version == slotfile.TARGET_VERSION:
        assert new_t == target
        assert slotfile.encode_draft(d) == draft
    else:  # an older file is rewritten in the current version with the same content
        again = slotfile.decode_target(new_t)
        assert again.version == slotfile.TARGET_VERSION
        assert (again.tokens, again.layout, bytes(again.kv)) == (t.tokens, t.layout, bytes(t.kv))


def test_models_still_have_their_fingerprints() -> None:
    m = meta(SETS[1])
    with Model.load(TARGET) as tm, Model.load(DRAFT) as dm:
        assert (tm.fingerprint, dm.fingerprint) == (m["target_fingerprint"],
                                                    m["draft_fingerprint"])
    assert all(meta(gs)["target_fingerprint"] == m["target_fingerprint"] for gs in SETS.values())


def test_writer_reproduces_the_current_golden_files() -> None:
    gs = SETS[make_golden.FORMAT_VERSION]
    m = meta(gs)
    g = make_golden.make(TARGET, DRAFT, gs.kv_type)
    assert g.tokens == m["tokens"], "the core now generates other tokens; " + REGENERATE
    target, draft = files(gs)
    if g.slot.target != target:
        t_new, t_old = slotfile.decode_target(g.slot.target), slotfile.decode_target(target)
        same_but_kv = (t_new.tokens, t_new.layout, t_new.fingerprint) == (
            t_old.tokens, t_old.layout, t_old.fingerprint)
        pytest.fail("the target file differs from the golden one"
                    + (" in its KV bytes only: " + REGENERATE if same_but_kv else
                       ": the writer changed, which breaks the format"))
    assert g.slot.draft == draft
    assert g.continuation == m["continuation"]


def test_f32_core_still_computes_the_version_1_content() -> None:
    """The f32 arithmetic is unchanged: the session of the version-1 files, computed
    again in f32 contexts, has the same tokens, KV bytes, draft state and continuation."""
    gs = SETS[1]
    m = meta(gs)
    g = make_golden.make(TARGET, DRAFT, "f32")
    target, draft = files(gs)
    t_new, t_old = slotfile.decode_target(g.slot.target), slotfile.decode_target(target)
    assert (t_new.tokens, t_new.layout, bytes(t_new.kv)) == (t_old.tokens, t_old.layout,
                                                               bytes(t_old.kv))
    assert g.slot.draft is not None
    assert bytes(slotfile.decode_draft(g.slot.draft).state) == as_version_2(
        slotfile.decode_draft(draft).state)
    assert (g.tokens, g.continuation) == (m["tokens"], m["continuation"])


@pytest.mark.parametrize("version", sorted(SETS))
def test_golden_files_restore_and_continue_like_the_saved_session(tmp_path: Path,
                                                                  version: int) -> None:
    gs = SETS[version]
    m = meta(gs)
    with Model.load(TARGET) as tm, Model.load(DRAFT) as dm, \
            Context(tm, n_slots=2, n_ctx=128, n_threads=1, kv_type=gs.kv_type) as tc, \
            Context(dm, n_slots=2, n_ctx=128, n_threads=1, kv_type=gs.kv_type) as dc, \
            SpecDecoder(tc, dc) as dec:
        store = LocalStore(tmp_path)
        shutil.copy(GOLDEN / gs.target, tmp_path / "slot")
        shutil.copy(GOLDEN / gs.draft, tmp_path / "slot.drft")
        p = prepare_restore(store, "slot", context_spec(tc), context_spec(dc))
        assert p.draft_state is not None and p.draft_note == ""
        dec.clear(1)
        tc.set_state_parts(1, *p.target_parts)
        dec.set_draft_state(1, p.draft_state)
        assert dec.tokens(1) == m["tokens"]
        # the KV is what a prefill of the tokens computes (bit for bit)
        tc.decode(0, m["tokens"])
        assert tc.get_state(0) == tc.get_state(1)
        cont = dec.generate(1, tm.tokenizer.encode(make_golden.NEXT), make_golden.N_GEN,
                            make_golden.SAMPLING, make_golden.SPEC)
        assert cont == m["continuation"]


@pytest.mark.parametrize("version", sorted(SETS))
def test_golden_files_of_another_kv_type_are_refused(tmp_path: Path, version: int) -> None:
    gs = SETS[version]
    other = "f32" if gs.kv_type == "f16" else "f16"
    with Model.load(TARGET) as tm, Model.load(DRAFT) as dm, \
            Context(tm, n_ctx=128, n_threads=1, kv_type=other) as tc, \
            Context(dm, n_ctx=128, n_threads=1, kv_type=other) as dc:
        shutil.copy(GOLDEN / gs.target, tmp_path / "slot")
        shutil.copy(GOLDEN / gs.draft, tmp_path / "slot.drft")
        with pytest.raises(slotfile.IncompatibleSlotFile) as exc:
            prepare_restore(LocalStore(tmp_path), "slot", context_spec(tc), context_spec(dc))
    assert str(exc.value) == (f"slot file holds an {gs.kv_type} KV cache, this server keeps "
                              f"{other}: restore it on a server started with --kv-type "
                              f"{gs.kv_type}")


@pytest.mark.parametrize("version", sorted(SETS))
def test_golden_files_restore_through_the_server(tmp_path: Path, version: int) -> None:
    gs = SETS[version]
    m = meta(gs)
    shutil.copy(GOLDEN / gs.target, tmp_path / "golden")
    shutil.copy(GOLDEN / gs.draft, tmp_path / "golden.drft")
    cfg = service_config(TARGET, DRAFT, ctx=m["n_ctx"], slot_save_path=tmp_path,
                         kv_type=gs.kv_type)
    with running(cfg) as srv, InferenceClient(f"127.0.0.1:{srv.port}") as c:
        r = c.restore(1, "golden")
        assert (r.n_restored, r.draft_restored) == (len(m["tokens"]), True)
        assert r.draft_policy_applied == pb.DRAFT_POLICY_SIDECAR
        s = make_golden.SAMPLING
        new = c.tokenize(make_golden.NEXT)
        rs, last = c.generate(m["tokens"] + new, max_tokens=make_golden.N_GEN, id_slot=1,
                              temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              min_p=s.min_p, n_max=make_golden.SPEC.n_max)
        assert (last.timings.prompt_n, last.timings.draft_prompt_n) == (len(new), len(new))
        assert [t for x in rs for t in x.tokens] == m["continuation"]
        # and saving it again (in a context of the same size) writes the golden content
        # in the current format version: the same bytes for the current set
        c.erase(1)
        c.restore(1, "golden")
        c.save(1, "again")
    target, draft = files(gs)
    again, again_drft = (tmp_path / "again").read_bytes(), (tmp_path / "again.drft").read_bytes()
    if version == slotfile.TARGET_VERSION:
        assert (again, again_drft) == (target, draft)
    else:
        assert again == slotfile.encode_target(slotfile.decode_target(target))
        d_old, d_new = slotfile.decode_draft(draft), slotfile.decode_draft(again_drft)
        assert d_new.version == slotfile.DRAFT_VERSION
        assert d_new.target_digest == slotfile.digest(again)
        assert bytes(d_new.state) == as_version_2(d_old.state)


def test_version_1_file_on_an_f16_server_is_failed_precondition(tmp_path: Path) -> None:
    gs = SETS[1]
    shutil.copy(GOLDEN / gs.target, tmp_path / "golden")
    shutil.copy(GOLDEN / gs.draft, tmp_path / "golden.drft")
    cfg = service_config(TARGET, DRAFT, ctx=64, slot_save_path=tmp_path)
    assert cfg.kv_type == "f16"  # the default
    with running(cfg) as srv, InferenceClient(f"127.0.0.1:{srv.port}") as c:
        with pytest.raises(grpc.RpcError) as exc:
            c.restore(1, "golden")
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "slot file holds an f32 KV cache, this server keeps f16: restore it on a " \
               "server started with --kv-type f32" in exc.value.details()
        assert [s.n_tokens for s in c.slots()] == [0, 0]  # the slot is left empty


# ---------------------------------------------------------------------- version 3
WGS = make_golden.WINDOW_SET
WMODEL = GOLDEN / make_golden.WINDOW_MODEL
RING = make_golden.WINDOW_SHAPE.n_swa + 16  # rows of a local layer (WS_SWA_SPARE = 16)


def test_window_golden_file_decodes_and_encodes_to_itself() -> None:
    m = meta(WGS)
    data = (GOLDEN / WGS.target).read_bytes()
    t = slotfile.decode_target(data)
    assert t.version == m["format_version"] == slotfile.TARGET_VERSION_WINDOW == 3
    assert t.layout == slotfile.KVLayout(6, 1, 8, slotfile.DTYPE_F16)
    # the rings wrapped: layers 0-4 hold their last RING positions, layer 5 all of them
    assert t.window == slotfile.Window(RING, (True,) * 5 + (False,))
    assert list(t.tokens) == m["tokens"] and len(m["tokens"]) > RING
    assert len(t.kv) == 2 * 2 * 8 * (5 * RING + len(m["tokens"]))
    assert (t.fingerprint, t.n_ctx) == (m["target_fingerprint"], m["n_ctx"])
    assert slotfile.digest(data) == m["target_sha256"]
    assert slotfile.encode_target(t) == data


def test_writer_reproduces_the_window_golden_file() -> None:
    m = meta(WGS)
    with Model.load(WMODEL) as wm:
        assert wm.fingerprint == m["target_fingerprint"]
    g = make_golden.make_window(WMODEL)
    assert g.tokens == m["tokens"], "the core now generates other tokens; " + REGENERATE
    assert bytes(g.slot.target) == (GOLDEN / WGS.target).read_bytes(), REGENERATE
    assert g.continuation == m["continuation"]


@pytest.mark.parametrize("swa_full", [False, True])
def test_window_golden_file_restores_and_continues(tmp_path: Path, swa_full: bool) -> None:
    """Into a ring context or one whose local layers keep every position (the file holds
    the window the next tokens read): the slot holds the saved tokens, and continues
    with the saved session's next turn."""
    m = meta(WGS)
    shutil.copy(GOLDEN / WGS.target, tmp_path / "slot")
    with Model.load(WMODEL) as wm, \
            Context(wm, n_slots=2, n_ctx=128, n_threads=1, kv_type=WGS.kv_type,
                    swa_full=swa_full) as ctx, SpecDecoder(ctx) as dec:
        p = prepare_restore(LocalStore(tmp_path), "slot", context_spec(ctx), None)
        assert (p.n_tokens, p.draft_state, p.draft_note) == (len(m["tokens"]), None,
                                                             "no draft model")
        ctx.set_state_parts(1, *p.target_parts)
        assert dec.tokens(1) == m["tokens"]
        if not swa_full:  # the rings hold what a prefill of the tokens leaves, bit for bit
            ctx.decode(0, m["tokens"])
            assert ctx.get_state(0) == ctx.get_state(1)
        cont = dec.generate(1, m["next"], make_golden.N_GEN, make_golden.GREEDY,
                            make_golden.NO_SPEC)
        assert cont == m["continuation"]


def test_window_golden_file_restores_through_the_server(tmp_path: Path) -> None:
    """Restored into a server slot, the next turn processes only its new tokens and
    generates the saved continuation; saved again, the file is the golden one."""
    m = meta(WGS)
    shutil.copy(GOLDEN / WGS.target, tmp_path / "golden")
    cfg = service_config(WMODEL, None, ctx=m["n_ctx"], slot_save_path=tmp_path,
                         kv_type=WGS.kv_type, speculative=Speculative(enabled=False))
    with running(cfg) as srv, InferenceClient(f"127.0.0.1:{srv.port}") as c:
        r = c.restore(1, "golden")
        assert (r.n_restored, r.draft_restored) == (len(m["tokens"]), False)
        rs, last = c.generate(m["tokens"] + m["next"], max_tokens=make_golden.N_GEN,
                              id_slot=1, temperature=0.0)
        assert last.timings.prompt_n == len(m["next"])
        assert [t for x in rs for t in x.tokens] == m["continuation"]
        c.erase(1)
        c.restore(1, "golden")
        c.save(1, "again")
    assert (tmp_path / "again").read_bytes() == (GOLDEN / WGS.target).read_bytes()
