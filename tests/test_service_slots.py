"""Slots through real gRPC, in the spirit of llama.cpp's server slot tests: prompt
reuse counts, save / erase / restore into the same and another slot, the draft
restore policies, and restores that fail their checks (the slot keeps what it held)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient
from inference_svc.pb import inference_pb2 as pb
from inference_svc.storage import slotfile
from tests.fixtures.servicekit import Reference, model_pair, running, service_config

TEXT_A = "the quick brown fox jumps over the lazy dog and then"
TEXT_NEW = " a second turn that adds some new words"
N = 12  # tokens generated per turn


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return model_pair(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def ref(pair: tuple[Path, Path]) -> Reference:
    return Reference(*pair)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def server(pair: tuple[Path, Path], store_dir: Path) -> Iterator[Server]:
    with running(service_config(*pair, slot_save_path=store_dir)) as srv:
        yield srv


def gen(c: InferenceClient, prompt: list[int], slot: int, n: int = N,
        **kw: object) -> tuple[list[int], pb.GenerateResponse]:
    rs, last = c.generate(prompt, max_tokens=n, id_slot=slot, temperature=0.0, **kw)
    assert last.done and all(not r.done for r in rs[:-1])
    return [t for r in rs for t in r.tokens], last


def n_tokens(c: InferenceClient, slot: int) -> int:
    return c.slots()[slot].n_tokens


def test_first_prompt_processes_all_then_one(client: InferenceClient, ref: Reference) -> None:
    a = client.tokenize(TEXT_A)
    out, last = gen(client, a, 1)
    assert (last.timings.prompt_n, last.timings.cache_n) == (len(a), 0)
    assert last.timings.id_slot == 1 and last.id_slot == 1
    assert out == ref.generate(a, N)
    assert last.stop_reason == pb.STOP_REASON_MAX_TOKENS
    assert last.timings.predicted_n == N
    assert n_tokens(client, 1) == len(a) + N
    out2, last2 = gen(client, a, 1)  # the same prompt again: only the last token
    assert (last2.timings.prompt_n, last2.timings.cache_n) == (1, len(a) - 1)
    assert out2 == out


def test_continuation_processes_only_new_tokens(client: InferenceClient, ref: Reference) -> None:
    a = client.tokenize(TEXT_A)
    out, _ = gen(client, a, 0)
    new = client.tokenize(TEXT_NEW)
    b = a + out + new
    out_b, last = gen(client, b, 0)
    assert (last.timings.prompt_n, last.timings.cache_n) == (len(new), len(a) + N)
    assert out_b == ref.generate(b, N)


def test_cache_prompt_false_processes_everything(client: InferenceClient) -> None:
    a = client.tokenize(TEXT_A)
    gen(client, a, 0)
    _, last = gen(client, a, 0, cache_prompt=False)
    assert (last.timings.prompt_n, last.timings.cache_n) == (len(a), 0)


def test_erase_makes_the_next_request_process_everything(client: InferenceClient) -> None:
    a = client.tokenize(TEXT_A)
    _, last = gen(client, a, 1)
    assert last.timings.prompt_n == len(a)
    _, last = gen(client, a, 1)
    assert last.timings.prompt_n == 1
    assert client.erase(1).n_erased == len(a) + N
    assert n_tokens(client, 1) == 0
    _, last = gen(client, a, 1)
    assert (last.timings.prompt_n, last.timings.cache_n) == (len(a), 0)


def test_save_erase_restore_same_and_other_slot(client: InferenceClient, ref: Reference,
                                                store_dir: Path) -> None:
    a = client.tokenize(TEXT_A)
    out, _ = gen(client, a, 1)
    saved = client.save(1, "session-1")
    assert (saved.n_saved, saved.draft_saved, saved.id_slot) == (len(a) + N, True, 1)
    target = (store_dir / "session-1").read_bytes()
    sidecar = (store_dir / "session-1.drft").read_bytes()
    assert saved.n_written == len(target) + len(sidecar)
    assert saved.target_sha256 == slotfile.digest(target)
    assert slotfile.decode_target(target).tokens == tuple(a + out)
    assert slotfile.decode_draft(sidecar).target_digest == saved.target_sha256

    b = a + out + client.tokenize(TEXT_NEW)
    expected = ref.generate(b, N)
    assert client.erase(1).n_erased == len(a) + N
    for slot in (1, 0):  # into the same slot, then into another one
        r = client.restore(slot, "session-1")
        assert (r.n_restored, r.n_read, r.id_slot) == (len(a) + N, saved.n_written, slot)
        assert r.draft_restored and r.draft_policy_applied == pb.DRAFT_POLICY_SIDECAR
        assert n_tokens(client, slot) == len(a) + N
        out_b, last = gen(client, b, slot)
        assert (last.timings.prompt_n, last.timings.cache_n) == (len(b) - len(a) - N, len(a) + N)
        assert out_b == expected
    # restoring over a slot replaces its content
    r = client.restore(0, "session-1")
    assert n_tokens(client, 0) == r.n_restored == len(a) + N


def test_restored_draft_matches_a_never_saved_control(client: InferenceClient,
                                                      store_dir: Path) -> None:
    """The turn after a restore with the sidecar drafts exactly like a slot that was
    never saved; without it, 'reprefill' re-decodes the whole context in the draft."""
    a = client.tokenize(TEXT_A)
    out, _ = gen(client, a, 0)
    client.save(0, "ctl")
    b = a + out + client.tokenize(TEXT_NEW)
    control_out, control = gen(client, b, 0)  # slot 0 never left the process
    client.restore(1, "ctl")
    out1, side = gen(client, b, 1)
    assert out1 == control_out
    assert side.timings.draft_n > 0
    for f in ("prompt_n", "cache_n", "draft_n", "draft_n_accepted", "draft_prompt_n", "n_steps"):
        assert getattr(side.timings, f) == getattr(control.timings, f), f
    assert control.timings.draft_prompt_n == len(b) - len(a) - N

    (store_dir / "ctl.drft").unlink()
    r = client.restore(1, "ctl")
    assert (r.draft_restored, r.draft_policy_applied) == (False, pb.DRAFT_POLICY_REPREFILL)
    assert "no draft sidecar" in r.draft_note
    out2, re = gen(client, b, 1)
    assert out2 == control_out
    assert re.timings.draft_prompt_n == len(b)  # the draft re-prefilled everything
    assert (re.timings.draft_n, re.timings.draft_n_accepted) == (
        control.timings.draft_n, control.timings.draft_n_accepted)


def test_restored_lookup_matches_a_never_saved_control(client: InferenceClient,
                                                       store_dir: Path) -> None:
    """The lookup drafter's state is the slot's tokens: the turn after a restore, with
    or without the draft sidecar, looks up and accepts exactly as a slot never saved."""
    a = client.tokenize(" ".join([TEXT_A] * 3))
    out, _ = gen(client, a, 0)
    client.save(0, "look")
    b = a + out + client.tokenize(TEXT_A)
    control_out, control = gen(client, b, 0, n=40)
    assert control.timings.lookup_n > 0
    fields = ("prompt_n", "cache_n", "draft_n", "draft_n_accepted", "lookup_n",
              "lookup_n_accepted", "n_steps")
    for drop_sidecar in (False, True):
        if drop_sidecar:
            (store_dir / "look.drft").unlink()
        client.restore(1, "look")
        out1, restored = gen(client, b, 1, n=40)
        assert out1 == control_out
        for f in fields:
            assert getattr(restored.timings, f) == getattr(control.timings, f), (f, drop_sidecar)


def test_sidecar_of_another_save_is_not_used(client: InferenceClient, store_dir: Path) -> None:
    a = client.tokenize(TEXT_A)
    gen(client, a, 0)
    client.save(0, "x")
    old_sidecar = (store_dir / "x.drft").read_bytes()
    gen(client, a + client.tokenize(TEXT_NEW), 0)
    client.save(0, "x")
    (store_dir / "x.drft").write_bytes(old_sidecar)
    r = client.restore(1, "x")
    assert r.n_restored == n_tokens(client, 0)
    assert (r.draft_restored, r.draft_policy_applied) == (False, pb.DRAFT_POLICY_REPREFILL)
    assert "another save" in r.draft_note


def test_empty_draft_policy(pair: tuple[Path, Path], tmp_path: Path, ref: Reference) -> None:
    cfg = service_config(*pair, slot_save_path=tmp_path, draft_restore_policy="empty")
    with running(cfg) as srv, InferenceClient(f"127.0.0.1:{srv.port}") as c:
        a = c.tokenize(TEXT_A)
        out, _ = gen(c, a, 0)
        saved = c.save(0, "e")
        (tmp_path / "e.drft").unlink()
        r = c.restore(1, "e")
        assert (r.draft_restored, r.draft_policy_applied) == (False, pb.DRAFT_POLICY_EMPTY)
        assert c.slots()[1].draft_offset == saved.n_saved
        b = a + out + c.tokenize(TEXT_NEW)
        out_b, last = gen(c, b, 1)
        assert out_b == ref.generate(b, N)
        assert last.timings.draft_prompt_n == len(b) - saved.n_saved  # only the new tokens


def test_sidecar_with_counters_out_of_range_is_not_used(client: InferenceClient,
                                                       store_dir: Path, ref: Reference) -> None:
    """A sidecar whose n_steps is 2^64-1 (digest recomputed) restores the target without
    it, and the next turn generates (the core would overflow the counter: INTERNAL)."""
    a = client.tokenize(TEXT_A)
    out, _ = gen(client, a, 0)
    client.save(0, "ctr")
    d = slotfile.decode_draft((store_dir / "ctr.drft").read_bytes())
    state = bytearray(d.state)
    state[48:56] = (2**64 - 1).to_bytes(8, "little")  # WSSP v1 n_steps
    (store_dir / "ctr.drft").write_bytes(
        slotfile.encode_draft(dataclasses.replace(d, state=bytes(state))))
    r = client.restore(1, "ctr")
    assert (r.draft_restored, r.draft_policy_applied) == (False, pb.DRAFT_POLICY_REPREFILL)
    assert "counter n_steps = 18446744073709551615 is out of range" in r.draft_note
    b = a + out + client.tokenize(TEXT_NEW)
    out_b, last = gen(client, b, 1, speculative=True)
    assert out_b == ref.generate(b, N)
    assert last.timings.draft_prompt_n == len(b)  # the draft re-prefilled everything


def test_names_of_the_local_store_own_files_are_refused(client: InferenceClient,
                                                        store_dir: Path) -> None:
    """'.tmp-*' would be swept at the next start as a temporary file; 'good.drft' would
    overwrite the sidecar of 'good'."""
    a = client.tokenize(TEXT_A)
    gen(client, a, 0)
    client.save(0, "good")
    sidecar = (store_dir / "good.drft").read_bytes()
    gen(client, a + client.tokenize(TEXT_NEW), 1)
    for name in (".tmp-keepme", "good.drft"):
        with pytest.raises(grpc.RpcError) as err:
            client.save(1, name)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"bad slot file name {name!r}" in err.value.details()
        assert "the local store's own files" in err.value.details()
    assert not (store_dir / ".tmp-keepme").exists()
    assert (store_dir / "good.drft").read_bytes() == sidecar
    assert client.restore(1, "good").draft_restored


def _rewrite(path: Path, **changes: object) -> None:
    t = slotfile.decode_target(path.read_bytes())
    path.write_bytes(slotfile.encode_target(dataclasses.replace(t, **changes)))


@pytest.mark.parametrize("case, code", [
    ("missing", grpc.StatusCode.NOT_FOUND),
    ("bit flip", grpc.StatusCode.DATA_LOSS),
    ("truncated", grpc.StatusCode.DATA_LOSS),
    ("empty file", grpc.StatusCode.DATA_LOSS),
    ("a sidecar", grpc.StatusCode.DATA_LOSS),
    ("other model", grpc.StatusCode.FAILED_PRECONDITION),
    ("context too small", grpc.StatusCode.FAILED_PRECONDITION),
    ("newer version", grpc.StatusCode.FAILED_PRECONDITION),
    ("token outside vocabulary", grpc.StatusCode.DATA_LOSS),
    ("bad name", grpc.StatusCode.INVALID_ARGUMENT),
])
def test_failed_restore_leaves_the_slot_as_it_was(
        client: InferenceClient, store_dir: Path, ref: Reference, case: str,
        code: grpc.StatusCode) -> None:
    a = client.tokenize(TEXT_A)
    gen(client, a, 0)
    client.save(0, "good")
    good = (store_dir / "good").read_bytes()
    path = store_dir / "bad"
    path.write_bytes(good)
    name = "bad"
    if case == "missing":
        path.unlink()
    elif case == "bit flip":
        data = bytearray(good)
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif case == "truncated":
        path.write_bytes(good[:-100])
    elif case == "empty file":
        path.write_bytes(b"")
    elif case == "a sidecar":
        path.write_bytes((store_dir / "good.drft").read_bytes())
    elif case == "other model":
        _rewrite(path, fingerprint="ab" * 32)
    elif case == "context too small":
        t = slotfile.decode_target(good)
        k = 300 // t.n_tokens + 1  # more tokens than the context of 256
        _rewrite(path, tokens=t.tokens * k, kv=bytes(t.kv) * k)
    elif case == "newer version":
        data = bytearray(good)
        data[4] = slotfile.TARGET_NEWEST + 1
        data[-32:] = bytes.fromhex(slotfile.digest(bytes(data[:-32])))
        path.write_bytes(bytes(data))
    elif case == "token outside vocabulary":
        t = slotfile.decode_target(good)
        _rewrite(path, tokens=(5000,) + t.tokens[1:])
    elif case == "bad name":
        name = "../good"
    live, _ = gen(client, a, 1)
    assert n_tokens(client, 1) == len(a) + N
    with pytest.raises(grpc.RpcError) as err:
        client.restore(1, name)
    assert err.value.code() == code, err.value.details()
    if case == "newer version":
        assert "newer" in err.value.details()
    if case == "context too small":
        assert "256" in err.value.details()
    # every check runs before the slot is touched: the live session is still there
    assert n_tokens(client, 1) == len(a) + N
    cont = client.tokenize(TEXT_NEW)
    out, last = gen(client, a + live + cont, 1)  # only the new tokens are processed
    assert (last.timings.prompt_n, last.timings.cache_n) == (len(cont), len(a) + N)
    assert out == ref.generate(a + live + cont, N)


def test_save_needs_a_store(pair: tuple[Path, Path]) -> None:
    with running(service_config(*pair)) as srv, InferenceClient(f"127.0.0.1:{srv.port}") as c:
        assert not c.info().store_configured
        for call in (lambda: c.save(0, "x"), lambda: c.restore(0, "x")):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--slot-save-path" in err.value.details()


def test_without_draft_model(pair: tuple[Path, Path], tmp_path: Path, ref: Reference) -> None:
    """Server without a draft model: no sidecar written; restore reports policy NONE;
    only the lookup drafter proposes, and turning it off leaves no drafter."""
    with running(service_config(pair[0], None, slot_save_path=tmp_path)) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}") as c:
        a = c.tokenize(TEXT_A)
        out, last = gen(c, a, 0)
        t = last.timings
        assert out == ref.generate(a, N)
        assert (t.draft_n, t.draft_n_accepted) == (t.lookup_n, t.lookup_n_accepted)
        s = c.save(0, "t")
        assert not s.draft_saved and not (tmp_path / "t.drft").exists()
        r = c.restore(1, "t")
        assert (r.draft_restored, r.draft_policy_applied) == (False, pb.DRAFT_POLICY_NONE)
        with pytest.raises(grpc.RpcError) as err:
            gen(c, a, 0, speculative=True, lookup=False)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "needs a drafter" in (err.value.details() or "")


def test_draft_reprefill_catches_up_in_bounded_units(client: InferenceClient, server: Server,
                                                     store_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A restored slot whose draft re-prefills catches up at most `batch` tokens per
    engine unit (so other slots keep stepping in between), then generates exactly as
    a slot that kept its draft."""
    engine = server._engine
    assert engine is not None
    batch = server.cfg.batch
    a = [(13 * k) % 290 + 1 for k in range(2 * batch + 20)]
    out, _ = gen(client, a, 0)
    client.save(0, "catch")
    b = a + out + [7, 8, 9]
    control_out, control = gen(client, b, 0)
    (store_dir / "catch.drft").unlink()
    assert client.restore(1, "catch").draft_policy_applied == pb.DRAFT_POLICY_REPREFILL
    calls: list[tuple[int, int, int]] = []
    catch_up = engine.owner.draft_catch_up

    def recorded(slot: int, max_tokens: int) -> tuple[int, int]:
        done, left = catch_up(slot, max_tokens)
        calls.append((max_tokens, done, left))
        return done, left

    monkeypatch.setattr(engine.owner, "draft_catch_up", recorded)
    out1, re = gen(client, b, 1)
    n = len(a) + N  # the restored context, the draft's lag
    assert calls == [(batch, batch, n - batch), (batch, batch, n - 2 * batch),
                     (batch, n - 2 * batch, 0)]
    assert out1 == control_out
    assert re.timings.draft_prompt_n == len(b)
    assert (re.timings.draft_n, re.timings.draft_n_accepted) == (
        control.timings.draft_n, control.timings.draft_n_accepted)
