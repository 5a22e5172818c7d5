"""Golden slot files (tests/fixtures/golden, written by tests/fixtures/make_golden.py):
the writer still produces them byte for byte, and they still restore, through the
functions and through a real server, into a session that continues exactly like
the one that was saved."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from inference_svc import slotfile
from inference_svc.client import InferenceClient
from inference_svc.core import Context, Model
from inference_svc.core.speculative import SpecDecoder
from inference_svc.pb import inference_pb2 as pb
from inference_svc.snapshots import model_spec, prepare_restore
from inference_svc.store import LocalStore
from tests.fixtures import make_golden
from tests.fixtures.servicekit import running, service_config

GOLDEN = make_golden.GOLDEN
META = json.loads((GOLDEN / "golden.json").read_text())
TARGET, DRAFT = GOLDEN / "tiny-target.gguf", GOLDEN / "tiny-draft.gguf"
REGENERATE = ("regenerate with `.venv/bin/python -m tests.fixtures.make_golden` only if the "
              "format version changed (keep the old files) or the core's arithmetic changed "
              "on purpose")


def test_decode_then_encode_is_byte_identical() -> None:
    target = (GOLDEN / "slot").read_bytes()
    draft = (GOLDEN / "slot.drft").read_bytes()
    t = slotfile.decode_target(target)
    d = slotfile.decode_draft(draft)
    assert slotfile.encode_target(t) == target
    assert slotfile.encode_draft(d) == draft
    assert list(t.tokens) == META["tokens"]
    assert t.fingerprint == META["target_fingerprint"] and t.n_ctx == META["n_ctx"]
    assert d.fingerprint == META["draft_fingerprint"]
    assert d.target_digest == slotfile.digest(target) == META["target_sha256"]
    assert (t.version, d.version) == (META["format_version"], META["format_version"])


def test_models_still_have_their_fingerprints() -> None:
    with Model.load(TARGET) as tm, Model.load(DRAFT) as dm:
        assert (tm.fingerprint, dm.fingerprint) == (META["target_fingerprint"],
                                                    META["draft_fingerprint"])


def test_writer_reproduces_the_golden_files() -> None:
    g = make_golden.make(TARGET, DRAFT)
    assert g.tokens == META["tokens"], "the core now generates other tokens; " + REGENERATE
    target = (GOLDEN / "slot").read_bytes()
    if g.slot.target != target:
        t_new, t_old = slotfile.decode_target(g.slot.target), slotfile.decode_target(target)
        same_but_kv = (t_new.tokens, t_new.layout, t_new.fingerprint) == (
            t_old.tokens, t_old.layout, t_old.fingerprint)
        pytest.fail("the target file differs from the golden one"
                    + (" in its KV bytes only: " + REGENERATE if same_but_kv else
                       ": the writer changed, which breaks the format"))
    assert g.slot.draft == (GOLDEN / "slot.drft").read_bytes()
    assert g.continuation == META["continuation"]


def test_golden_files_restore_and_continue_like_the_saved_session(tmp_path: Path) -> None:
    with Model.load(TARGET) as tm, Model.load(DRAFT) as dm, \
            Context(tm, n_slots=2, n_ctx=128, n_threads=1) as tc, \
            Context(dm, n_slots=2, n_ctx=128, n_threads=1) as dc, SpecDecoder(tc, dc) as dec:
        store = LocalStore(tmp_path)
        shutil.copy(GOLDEN / "slot", tmp_path / "slot")
        shutil.copy(GOLDEN / "slot.drft", tmp_path / "slot.drft")
        p = prepare_restore(store, "slot", model_spec(tm, 128), model_spec(dm, 128))
        assert p.draft_state is not None and p.draft_note == ""
        dec.clear(1)
        tc.set_state_parts(1, *p.target_parts)
        dec.set_draft_state(1, p.draft_state)
        assert dec.tokens(1) == META["tokens"]
        # the KV is what a prefill of the tokens computes (bit for bit)
        tc.decode(0, META["tokens"])
        assert tc.get_state(0) == tc.get_state(1)
        cont = dec.generate(1, tm.tokenizer.encode(make_golden.NEXT), make_golden.N_GEN,
                            make_golden.SAMPLING, make_golden.SPEC)
        assert cont == META["continuation"]


def test_golden_files_restore_through_the_server(tmp_path: Path) -> None:
    shutil.copy(GOLDEN / "slot", tmp_path / "golden")
    shutil.copy(GOLDEN / "slot.drft", tmp_path / "golden.drft")
    cfg = service_config(TARGET, DRAFT, ctx=META["n_ctx"], slot_save_path=tmp_path)
    with running(cfg) as srv, InferenceClient(f"127.0.0.1:{srv.port}") as c:
        r = c.restore(1, "golden")
        assert (r.n_restored, r.draft_restored) == (len(META["tokens"]), True)
        assert r.draft_policy_applied == pb.DRAFT_POLICY_SIDECAR
        s = make_golden.SAMPLING
        new = c.tokenize(make_golden.NEXT)
        rs, last = c.generate(META["tokens"] + new, max_tokens=make_golden.N_GEN, id_slot=1,
                              temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              min_p=s.min_p, n_max=make_golden.SPEC.n_max)
        assert (last.timings.prompt_n, last.timings.draft_prompt_n) == (len(new), len(new))
        assert [t for x in rs for t in x.tokens] == META["continuation"]
        # and saving it again (in a context of the same size) writes the golden bytes
        c.erase(1)
        c.restore(1, "golden")
        c.save(1, "again")
        assert (tmp_path / "again").read_bytes() == (GOLDEN / "slot").read_bytes()
        assert (tmp_path / "again.drft").read_bytes() == (GOLDEN / "slot.drft").read_bytes()
