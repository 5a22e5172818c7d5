"""The inference service's slot store over the snapshot service (SnapshotStore).

Real slots (a target and a draft model decoding in the core), real snapshot
servers on 127.0.0.1: the bytes round-trip verbatim and are the bytes LocalStore
writes, files move between the two stores and restore, protocol-1 peers of every
kind save and restore the target, and every failure is the error LocalStore
raises for the same situation.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from inference_svc import errors
from inference_svc.core import Context, Model
from inference_svc.core.speculative import Counters, SamplingParams, SpecDecoder, SpecParams
from inference_svc.storage.slotfile import DRAFT_VERSION, TARGET_VERSION, CorruptSlotFile, ModelSpec
from inference_svc.storage.snapshot_store import SnapshotStore
from inference_svc.storage.snapshots import EncodedSlot, context_spec, encode_slot, prepare_restore
from inference_svc.storage.store import LocalStore, SlotStore, StoredSlot
from snapshot_svc import ctl
from snapshot_svc.client import SnapshotClient
from snapshot_svc.config import SnapshotConfig
from snapshot_svc.pb import snapshot_pb2 as pb
from snapshot_svc.server import SnapshotServer
from snapshot_svc.testing import ServerProcess, free_port, running_server
from tests.factory import Shape, write_model
from tests.test_snapshot_protocol import MinimalServer
from tests.test_speculative import perturbed_copy

pytestmark = pytest.mark.timeout(120)

TARGET = Shape(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)
SEED = 3
N_CTX = 256
PROMPT = [5, 17, 250, 3, 99, 42, 7, 120, 64, 33]
NEXT = [11, 12, 13]  # the next turn
GREEDY = SamplingParams()
SPEC = SpecParams(n_max=4)
N_GEN = 20  # tokens generated before the save
SAVE, CONTROL, RESTORED = 0, 1, 2  # slots


@dataclass
class Core:
    target: Model
    draft: Model
    dec: SpecDecoder
    tspec: ModelSpec
    dspec: ModelSpec
    saved: Counters | None = None  # the speculative counters of the saved session


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Core]:
    d = tmp_path_factory.mktemp("snapshot-store-models")
    write_model(d / "target.gguf", TARGET, SEED)
    perturbed_copy(d / "target.gguf", d / "draft.gguf", noise=0.35)  # right only sometimes
    tm, dm = Model.load(d / "target.gguf"), Model.load(d / "draft.gguf")
    tc, dc = Context(tm, n_slots=3, n_ctx=N_CTX), Context(dm, n_slots=3, n_ctx=N_CTX)
    dec = SpecDecoder(tc, dc)
    yield Core(tm, dm, dec, context_spec(tc), context_spec(dc))
    dec.close()
    for obj in (tc, dc, tm, dm):
        obj.close()


def build_session(c: Core, slot: int) -> None:
    """The session every test saves: a prompt and N_GEN tokens, speculative, greedy."""
    c.dec.clear(slot)
    c.dec.generate(slot, PROMPT, N_GEN, GREEDY, SPEC)
    c.dec.commit(slot)


@pytest.fixture(scope="module")
def slot(core: Core) -> EncodedSlot:
    """The slot files of a real session (the core's state, encoded as SaveSlot does)."""
    build_session(core, SAVE)
    core.saved = core.dec.counters(SAVE)
    assert 0 < core.saved.n_accepted < core.saved.n_drafted
    enc = encode_slot(core.dec.target.get_state(SAVE), core.dec.draft_state(SAVE),
                      core.tspec, core.dspec)
    assert enc.draft is not None and enc.n_tokens == len(PROMPT) + N_GEN
    return enc


def assert_resumes_like_control(c: Core, store: SlotStore, name: str, *,
                                with_draft: bool) -> None:
    """Restores `name` into a slot and checks the next turn against a session that was
    never saved: same tokens; with the sidecar the same drafting work, without it the
    draft re-prefilled (the default policy); then bit-identical logits."""
    prepared = prepare_restore(store, name, c.tspec, c.dspec)
    assert prepared.n_tokens == len(PROMPT) + N_GEN
    assert (prepared.draft_state is not None) is with_draft, prepared.draft_note
    dec = c.dec
    dec.clear(RESTORED)
    dec.target.set_state_parts(RESTORED, *prepared.target_parts)
    if prepared.draft_state is not None:
        dec.set_draft_state(RESTORED, prepared.draft_state)
    else:
        dec.draft_reset(RESTORED, 0)  # the "reprefill" policy
    build_session(c, CONTROL)
    c_before, r_before = dec.counters(CONTROL), dec.counters(RESTORED)
    if with_draft:
        assert r_before == c.saved  # the speculative counters are part of the draft state
    control = dec.generate(CONTROL, NEXT, 12, GREEDY, SPEC)
    assert dec.generate(RESTORED, NEXT, 12, GREEDY, SPEC) == control
    c_delta, r_delta = dec.counters(CONTROL) - c_before, dec.counters(RESTORED) - r_before
    assert c_delta.n_draft_prefill == len(NEXT)
    assert 0 < c_delta.n_accepted < c_delta.n_drafted
    if with_draft:
        assert r_delta == c_delta
    else:
        assert r_delta.n_draft_prefill == prepared.n_tokens + len(NEXT)
        assert (r_delta.n_drafted, r_delta.n_accepted) == (c_delta.n_drafted, c_delta.n_accepted)
    dec.commit(CONTROL)
    dec.commit(RESTORED)
    assert dec.target.tokens(RESTORED) == dec.target.tokens(CONTROL)
    want = dec.target.decode(CONTROL, [7]).tobytes()
    assert dec.target.decode(RESTORED, [7]).tobytes() == want
    for s in (CONTROL, RESTORED):
        dec.clear(s)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == logging.WARNING]


@pytest.fixture()
def logs(request: pytest.FixtureRequest) -> Iterator[tuple[logging.Logger, Records]]:
    logger = logging.getLogger(f"test.snapshot_store.{request.node.name}")
    logger.propagate = False
    handler = Records()
    logger.addHandler(handler)
    yield logger, handler
    logger.removeHandler(handler)


@pytest.fixture()
def v2(tmp_path: Path) -> Iterator[SnapshotServer]:
    with running_server(tmp_path / "snap") as srv:
        yield srv


def stored_blob(srv: SnapshotServer, sha: str) -> bytes:
    return (srv.config.data_dir / "blobs" / sha).read_bytes()


# --- round trips ------------------------------------------------------------------------


def test_real_slot_round_trip(core: Core, slot: EncodedSlot, v2: SnapshotServer,
                              logs: tuple[logging.Logger, Records]) -> None:
    assert slot.draft is not None
    with SnapshotStore(v2.address, timeout=10, logger=logs[0]) as store:
        assert store.describe() == f"snapshot:{v2.address}"
        assert store.negotiated_protocol is None
        assert store.save("chat-1", slot.target, slot.draft) == len(slot.target) + len(slot.draft)
        assert store.negotiated_protocol == 2
        got = store.load("chat-1")
        assert got == StoredSlot(slot.target, slot.draft, "")
        assert_resumes_like_control(core, store, "chat-1", with_draft=True)
    assert logs[1].warnings() == []
    # what the service recorded: the digests and the files' own metadata
    with SnapshotClient(v2.address, timeout=10) as client:
        info = client.stat("chat-1")
    assert info.draft is not None
    assert (info.target.size, info.target.sha256) == (len(slot.target), slot.target_sha256)
    assert (info.target.meta.format_version, info.target.meta.fingerprint,
            info.target.meta.n_tokens) == (TARGET_VERSION, core.target.fingerprint,
                                           len(PROMPT) + N_GEN)
    assert (info.draft.meta.format_version, info.draft.meta.fingerprint) == (
        DRAFT_VERSION, core.draft.fingerprint)
    assert info.draft.meta.n_tokens == core.dec.draft_n_tokens(SAVE) > 0
    assert info.draft.target_sha256 == slot.target_sha256
    assert stored_blob(v2, slot.target_sha256) == slot.target
    assert stored_blob(v2, info.draft.sha256) == slot.draft


def test_target_bytes_are_what_the_local_store_writes(slot: EncodedSlot, v2: SnapshotServer,
                                                      tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "local")
    with SnapshotStore(v2.address, timeout=10) as store:
        n = store.save("same", slot.target, slot.draft, target_sha256=slot.target_sha256)
        assert n == local.save("same", slot.target, slot.draft)
        assert store.load("same") == local.load("same")
    with SnapshotClient(v2.address, timeout=10) as client:
        got = client.get("same")
    assert got.target == (tmp_path / "local" / "same").read_bytes() == slot.target
    assert got.draft == (tmp_path / "local" / "same.drft").read_bytes() == slot.draft


def test_files_move_between_the_local_store_and_the_service(
        core: Core, slot: EncodedSlot, v2: SnapshotServer, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # local directory -> snapshot service (the ctl tool copies the two files as they are)
    src, dst = tmp_path / "src", tmp_path / "dst"
    LocalStore(src).save("moved", slot.target, slot.draft)
    assert ctl.main(["--addr", v2.address, "put", "moved", "--dir", str(src)]) == 0
    with SnapshotStore(v2.address, timeout=10) as store:
        assert store.load("moved") == StoredSlot(slot.target, slot.draft, "")
        assert_resumes_like_control(core, store, "moved", with_draft=True)
        # snapshot service -> local directory
        store.save("back", slot.target, slot.draft)
    dst.mkdir()
    assert ctl.main(["--addr", v2.address, "get", "back", "--dir", str(dst)]) == 0
    capsys.readouterr()
    assert (dst / "back").read_bytes() == slot.target
    assert (dst / "back.drft").read_bytes() == slot.draft
    assert_resumes_like_control(core, LocalStore(dst), "back", with_draft=True)


def test_save_without_draft_drops_the_earlier_draft(slot: EncodedSlot,
                                                    v2: SnapshotServer) -> None:
    with SnapshotStore(v2.address, timeout=10) as store:
        store.save("s", slot.target, slot.draft)
        assert store.save("s", slot.target, None) == len(slot.target)
        assert store.load("s") == StoredSlot(slot.target, None, "no draft stored")
        # a store keeps bytes, it does not judge them: restore does
        assert store.save("odd", b"not a slot file", None) == 15
        assert store.load("odd").target == b"not a slot file"
    with SnapshotClient(v2.address, timeout=10) as client:
        assert client.stat("odd").target.meta.format_version == 0


# --- protocol-1 peers -------------------------------------------------------------------


def check_protocol_1(core: Core, slot: EncodedSlot, store: SnapshotStore, records: Records,
                     reason: str) -> None:
    """Saves twice and loads twice through a protocol-1 peer: target only, one warning,
    no draft on load, and the restore applies the draft policy."""
    assert slot.draft is not None
    for _ in range(2):
        assert store.save("p1", slot.target, slot.draft) == len(slot.target)
    assert store.negotiated_protocol == 1
    for _ in range(2):
        got = store.load("p1")
        assert (got.target, got.draft) == (slot.target, None)
        assert "protocol 1" in got.draft_note and reason in got.draft_note
    assert_resumes_like_control(core, store, "p1", with_draft=False)
    warnings = records.warnings()
    assert len(warnings) == 1, warnings
    assert "drafts are not saved or restored" in warnings[0] and reason in warnings[0]


def test_new_store_with_a_max_protocol_1_server(core: Core, slot: EncodedSlot, tmp_path: Path,
                                                logs: tuple[logging.Logger, Records]) -> None:
    with ServerProcess(tmp_path / "snap", "--max-protocol", "1") as proc, \
            SnapshotStore(proc.address, timeout=10, logger=logs[0]) as store:
        check_protocol_1(core, slot, store, logs[1], "speaks protocol 1")
        with SnapshotClient(proc.address, timeout=10) as client:
            info = client.stat("p1")
        assert info.draft is None and info.target.sha256 == slot.target_sha256
        assert proc.terminate() == 0
    assert len(list((tmp_path / "snap" / "blobs").iterdir())) == 1  # the target only


def test_max_protocol_1_store_with_a_new_server(core: Core, slot: EncodedSlot,
                                                v2: SnapshotServer,
                                                logs: tuple[logging.Logger, Records]) -> None:
    with SnapshotStore(v2.address, timeout=10) as new:
        new.save("p1", slot.target, slot.draft)  # a paired save by a protocol-2 replica
    with SnapshotStore(v2.address, timeout=10, max_protocol=1, logger=logs[0]) as store:
        got = store.load("p1")  # the stored draft is not fetched
        assert (got.target, got.draft) == (slot.target, None)
        check_protocol_1(core, slot, store, logs[1], "--snapshot-client-max-protocol 1")
    with SnapshotClient(v2.address, timeout=10) as client:
        assert client.stat("p1").draft is None  # its own save replaced the pair


def test_hello_less_server(core: Core, slot: EncodedSlot,
                           logs: tuple[logging.Logger, Records]) -> None:
    with MinimalServer() as srv, SnapshotStore(srv.address, timeout=10, logger=logs[0]) as store:
        check_protocol_1(core, slot, store, logs[1], "answers Hello with UNIMPLEMENTED")
        assert srv.parts_received == [pb.PART_TARGET, pb.PART_TARGET]  # never a draft
        assert srv.store["p1"][1] == slot.target
        header = srv.store["p1"][0]
        assert (header.format_version, header.fingerprint, header.n_tokens) == (
            TARGET_VERSION, core.target.fingerprint, len(PROMPT) + N_GEN)
        assert srv.counter.calls["Hello"] == 1  # asked once per channel, never again


@contextmanager
def saved_with_protocol_2(slot: EncodedSlot, tmp_path: Path,
                          logger: logging.Logger) -> Iterator[tuple[SnapshotStore, int]]:
    """A store (and its port) whose channel negotiated protocol 2 with a server that
    has gone since, after a paired save of "d"."""
    port = free_port()
    with SnapshotStore(f"127.0.0.1:{port}", timeout=10, logger=logger) as store:
        with FixedPortServer(tmp_path / "snap", port):
            store.save("d", slot.target, slot.draft)
            assert store.negotiated_protocol == 2
        yield store, port


def test_server_downgraded_to_protocol_1_under_a_live_store(
        slot: EncodedSlot, tmp_path: Path, logs: tuple[logging.Logger, Records]) -> None:
    with saved_with_protocol_2(slot, tmp_path, logs[0]) as (store, port), \
            FixedPortServer(tmp_path / "snap", port, max_protocol=1):
        # the channel negotiated protocol 2: the draft is refused, the store says
        # Hello again on a new channel and saves the target alone
        assert store.save("d", slot.target, slot.draft) == len(slot.target)
        assert store.negotiated_protocol == 1
        assert store.load("d").draft is None
    assert len(logs[1].warnings()) == 1


def test_protocol_2_service_replaced_by_a_hello_less_one_at_the_same_address(
        slot: EncodedSlot, tmp_path: Path, logs: tuple[logging.Logger, Records]) -> None:
    # a server from before Hello refuses the draft part with INVALID_ARGUMENT, not
    # FAILED_PRECONDITION: the store says Hello again whatever the code, learns that
    # the service now speaks protocol 1, and saves the target alone
    with saved_with_protocol_2(slot, tmp_path, logs[0]) as (store, port):
        old = MinimalServer()
        old.server.add_insecure_port(f"127.0.0.1:{port}")
        with old:
            assert store.save("d", slot.target, slot.draft,
                              target_sha256=slot.target_sha256) == len(slot.target)
            assert store.negotiated_protocol == 1
            # the draft is refused twice (hashed in a trailer, then once more with the
            # digest in its header, as to any server that refuses an empty digest)
            assert old.parts_received == [pb.PART_TARGET, pb.PART_DRAFT, pb.PART_DRAFT,
                                          pb.PART_TARGET]
            assert old.store["d"][1] == slot.target
            assert old.counter.calls["Hello"] == 1  # the new channel's Hello (UNIMPLEMENTED)
            got = store.load("d")
            assert (got.target, got.draft) == (slot.target, None)
    assert len(logs[1].warnings()) == 1


# --- restarts and failures --------------------------------------------------------------


class FixedPortServer:
    """An in-process snapshot server on a fixed port and data directory, so that it
    can stop and come back where a store's channel expects it."""

    def __init__(self, data_dir: Path, port: int, max_protocol: int = 2) -> None:
        self.server = SnapshotServer(SnapshotConfig(data_dir=data_dir, port=port,
                                                    max_protocol=max_protocol))

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=0)

    def __enter__(self) -> SnapshotServer:
        self.start()
        return self.server

    def __exit__(self, *exc: object) -> None:
        self.stop()


def test_service_restarted_between_save_and_load(core: Core, slot: EncodedSlot,
                                                 tmp_path: Path) -> None:
    port = free_port()
    addr = f"127.0.0.1:{port}"
    with SnapshotStore(addr, timeout=10) as store, \
            SnapshotStore(addr, timeout=10, retries=1, backoff=0.05) as impatient:
        with FixedPortServer(tmp_path / "snap", port):
            store.save("r", slot.target, slot.draft)
        # down: a call gives up after its retries with the error LocalStore gives for I/O
        with pytest.raises(errors.Unavailable, match=addr):
            impatient.load("r")
        with pytest.raises(errors.Unavailable):
            impatient.save("r2", slot.target, slot.draft)
        with FixedPortServer(tmp_path / "snap", port):
            assert store.load("r") == StoredSlot(slot.target, slot.draft, "")
            assert impatient.load("r") == StoredSlot(slot.target, slot.draft, "")
            assert_resumes_like_control(core, store, "r", with_draft=True)
        # a call made while the service is down waits for it (retries with backoff)
        srv = FixedPortServer(tmp_path / "snap", port)
        back = threading.Timer(0.4, srv.start)
        t0 = time.monotonic()
        back.start()
        try:
            assert store.load("r") == StoredSlot(slot.target, slot.draft, "")
            assert time.monotonic() - t0 >= 0.4
        finally:
            back.join()
            srv.stop()


def test_not_found_bad_names_and_oversize_raise_what_local_store_raises(
        slot: EncodedSlot, tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "local")
    limit = len(slot.target) - 1
    with running_server(tmp_path / "snap", max_snapshot_bytes=limit) as srv, \
            SnapshotStore(srv.address, timeout=10) as store:
        for s in (store, local):
            with pytest.raises(errors.NotFound, match="no slot file 'missing'"):
                s.load("missing")
        bad = ["", "a/b", "a\\b", "..", "x..y", "tab\there", "del\x7f", " lead", "trail ",
               "dot.", "é" * 128]
        for name in bad:
            for s in (store, local):
                with pytest.raises(errors.InvalidArgument, match="bad slot file name"):
                    s.save(name, b"x", None)
                with pytest.raises(errors.InvalidArgument, match="bad slot file name"):
                    s.load(name)
        with pytest.raises(errors.ResourceExhausted, match=f"limit is {limit}"):
            store.save("big", slot.target, slot.draft)
        with pytest.raises(errors.NotFound):
            store.load("big")  # nothing of it stored
        assert store.save("small", slot.target[:limit], None) == limit
    assert sorted(p.name for p in (tmp_path / "snap" / "blobs").iterdir()) == [
        hashlib.sha256(slot.target[:limit]).hexdigest()]


def test_corrupt_parts_on_the_service(core: Core, slot: EncodedSlot, v2: SnapshotServer) -> None:
    with SnapshotStore(v2.address, timeout=10) as store:
        store.save("c", slot.target, slot.draft)
        with SnapshotClient(v2.address, timeout=10) as client:
            info = client.stat("c")
        assert info.draft is not None
        # a flipped bit in the stored draft costs the draft only
        path = v2.config.data_dir / "blobs" / info.draft.sha256
        flip(path, info.draft.size // 2)
        got = store.load("c")
        assert (got.target, got.draft) == (slot.target, None)
        assert got.draft_note == "cannot read the draft sidecar: draft of 'c': SHA-256 mismatch"
        assert_resumes_like_control(core, store, "c", with_draft=False)
        # in the target: DataLoss, as a corrupt local file is
        flip(v2.config.data_dir / "blobs" / slot.target_sha256, 200)
        with pytest.raises(errors.DataLoss, match="target of 'c': SHA-256 mismatch"):
            store.load("c")


def test_target_checked_against_its_own_trailer_after_a_get(core: Core, slot: EncodedSlot,
                                                          v2: SnapshotServer) -> None:
    """The Get computes the digest of the target without its trailer in the same pass;
    a file corrupted before it was saved (stored with the digest of its corrupt bytes,
    so the transfer checks pass) is still refused by the trailer check."""
    bad = bytearray(slot.target)
    bad[len(bad) // 2] ^= 0x01
    with SnapshotClient(v2.address, timeout=10) as client:
        client.put("bad", bytes(bad))
        got = client.get("bad", digest_tail=32)
        assert got.target_prefix_sha256 == hashlib.sha256(bad[:-32]).hexdigest()
    with SnapshotStore(v2.address, timeout=10) as store:
        stored = store.load("bad")
        assert stored.target_body_sha256 == hashlib.sha256(bad[:-32]).hexdigest()
        with pytest.raises(CorruptSlotFile, match="digest mismatch"):  # DATA_LOSS
            prepare_restore(store, "bad", core.tspec, core.dspec)
        store.save("good", slot.target, slot.draft)
        assert store.load("good").target_body_sha256 == hashlib.sha256(
            slot.target[:-32]).hexdigest()
        assert_resumes_like_control(core, store, "good", with_draft=True)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def test_deadline_on_every_call() -> None:
    # min_rate: no transfer allowance (a Get's allowance is for the largest snapshot)
    with MinimalServer() as srv, \
            SnapshotStore(srv.address, timeout=0.5, min_rate=1e12) as store:
        t0 = time.monotonic()
        with pytest.raises(errors.Unavailable, match="did not answer within the deadline"):
            store.load("slow")  # the server takes 3 s
        assert time.monotonic() - t0 < 2.5


def test_closed_store_and_bad_arguments(v2: SnapshotServer) -> None:
    store = SnapshotStore(v2.address)
    store.close()
    with pytest.raises(errors.Unavailable, match="closed"):
        store.load("x")
    for kw in ({"timeout": 0}, {"max_protocol": 3}, {"max_protocol": 0}):
        with pytest.raises(ValueError):
            SnapshotStore(v2.address, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="HOST:PORT"):
        SnapshotStore("localhost")
