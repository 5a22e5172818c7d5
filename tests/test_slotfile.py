"""The slot file format on its own (inference_svc.storage.slotfile) and the local store:
round trips, every corruption caught, versions, tagged sections, checks against
a model, atomic writes."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from inference_svc.errors import InvalidArgument, NotFound
from inference_svc.storage import slotfile as sf
from inference_svc.storage.names import name_problem
from inference_svc.storage.snapshots import SlotFileBuffers, encode_slot
from inference_svc.storage.store import LocalStore

LAYOUT = sf.KVLayout(n_layer=2, n_head_kv=1, head_dim=4)
FP_T, FP_D = "11" * 32, "22" * 32
SPEC_T = sf.ModelSpec(FP_T, "t", LAYOUT, n_vocab=100, n_ctx=64)
SPEC_D = sf.ModelSpec(FP_D, "d", sf.KVLayout(1, 1, 4), n_vocab=100, n_ctx=64)


def kv_bytes(n: int, layout: sf.KVLayout = LAYOUT, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n * layout.bytes_per_token // 4).astype("<f4").tobytes()


def target(n: int = 5) -> sf.TargetFile:
    return sf.TargetFile(FP_T, LAYOUT, 64, 100, tuple(range(3, 3 + n)), kv_bytes(n))


def core_kv(tokens: list[int], layout: sf.KVLayout, seed: int = 0) -> bytes:
    n = len(tokens)
    head = struct.pack("<8I", sf.CORE_KV_MAGIC, sf.CORE_KV_VERSION_FULL, layout.n_layer,
                       layout.kv_dim, layout.kv_dim, layout.dtype, n, 0)
    return head + struct.pack(f"<{n}i", *tokens) + kv_bytes(n, layout, seed)


# counters as the core keeps them: n_steps, n_drafted, n_accepted, n_draft_prefill, then
# drafted_at[16] (adding up to n_drafted) and accepted_at[16] (adding up to n_accepted)
COUNTERS = (4, 6, 3, 2, 3, 2, 1, *[0] * 13, 2, 1, *[0] * 14)


def core_spec(tokens: list[int], offset: int, counters: tuple[int, ...] = COUNTERS) -> bytes:
    head = struct.pack("<4I4Q36Q", sf.CORE_SPEC_MAGIC, 1, offset, 0, 1, 2, 3, 4, *counters)
    return head + core_kv(tokens, SPEC_D.layout, seed=1)


def draft_for(tbytes: bytes, n: int = 5, offset: int = 0) -> bytes:
    toks = list(range(3, 3 + n))[offset:]
    d = sf.draft_from_core(core_spec(toks, offset), sf.digest(tbytes), SPEC_D)
    return sf.encode_draft(d)


def with_digest(data: bytes | bytearray) -> bytes:
    data = bytearray(data)
    data[-32:] = hashlib.sha256(bytes(data[:-32])).digest()
    return bytes(data)


def test_target_round_trip_and_layout() -> None:
    t = target()
    data = sf.encode_target(t)
    assert data[:4] == b"WSLT" and struct.unpack_from("<II", data, 4) == (sf.TARGET_VERSION, 128)
    assert len(data) == 128 + 16 + 4 * 5 + 16 + 5 * LAYOUT.bytes_per_token + 32
    assert hashlib.sha256(data[:-32]).digest() == data[-32:]
    back = sf.decode_target(data)
    assert (back.fingerprint, back.layout, back.n_ctx, back.n_vocab, back.tokens) == (
        FP_T, LAYOUT, 64, 100, t.tokens)
    assert bytes(back.kv) == t.kv
    assert sf.encode_target(back) == data
    meta = sf.read_meta(data)
    assert (meta.kind, meta.version, meta.fingerprint, meta.n_tokens) == (
        "target", sf.TARGET_VERSION, FP_T, 5)


def test_empty_slot_round_trip() -> None:
    t = dataclasses.replace(target(0), tokens=(), kv=b"")
    assert sf.decode_target(sf.encode_target(t)).n_tokens == 0


def test_core_state_conversion_round_trip() -> None:
    state = core_kv([5, 6, 7], LAYOUT)
    t = sf.target_from_core(state, SPEC_T)
    assert t.tokens == (5, 6, 7) and t.fingerprint == FP_T and t.n_ctx == 64
    assert b"".join(sf.core_parts_from_target(sf.decode_target(sf.encode_target(t)))) == state
    with pytest.raises(ValueError, match="layout"):
        sf.target_from_core(core_kv([1], sf.KVLayout(1, 1, 4)), SPEC_T)


@pytest.mark.parametrize("n", [0, 1, 7, 300])
def test_files_built_in_place_are_the_encoded_files(n: int) -> None:
    """encode_slot builds both files around the core's state in place: byte for byte
    what encode_target / encode_draft write from the same state, digests included."""
    toks = [(11 * k + 3) % 100 for k in range(n)]
    state, dstate = core_kv(toks, LAYOUT, seed=n), core_spec(toks[n // 2:], n // 2)
    enc = encode_slot(state, dstate, SPEC_T, SPEC_D)
    want_t = sf.encode_target(sf.target_from_core(state, SPEC_T))
    want_d = sf.encode_draft(sf.draft_from_core(dstate, sf.digest(want_t), SPEC_D))
    assert (bytes(enc.target), enc.target_sha256, enc.n_tokens) == (want_t, sf.digest(want_t), n)
    assert enc.draft is not None and bytes(enc.draft) == want_d
    assert sf.file_digests(enc.target) == (sf.digest(want_t),
                                           hashlib.sha256(want_t[:-sf.DIGEST_LEN]).hexdigest())
    assert encode_slot(state, None, SPEC_T, None).draft is None


# a model whose layer 0 attends to a window of positions (gemma3), layer 1 to all
SPEC_W = dataclasses.replace(SPEC_T, local_layers=(True, False))


def core_kv_window(tokens: list[int], n_window: int, seed: int = 0) -> bytes:
    """WSKV v3 state of SPEC_W: layer 0 holds the last n_window positions only."""
    n, kv_dim = len(tokens), LAYOUT.kv_dim
    head = struct.pack("<8I", sf.CORE_KV_MAGIC, sf.CORE_KV_VERSION, LAYOUT.n_layer, kv_dim,
                       kv_dim, LAYOUT.dtype, n, n_window)
    rows = n_window + n
    kv = np.random.default_rng(seed).standard_normal(2 * rows * kv_dim).astype("<f4")
    return head + struct.pack(f"<{n}i", *tokens) + kv.tobytes()


@pytest.mark.parametrize(("n", "n_window"), [(0, None), (3, None), (5, 4), (40, 23), (300, 23)])
def test_files_of_a_windowed_model_are_built_in_place(n: int, n_window: int | None) -> None:
    """A model with sliding-window layers: its target file buffer has room for the SWIN
    section, so a windowed state (version 3) and a full one (version 2, rings never
    wrapped) are both sealed in the buffer the core wrote, the file a view of it, byte
    for byte what encode_target writes."""
    toks = [(7 * k + 1) % 100 for k in range(n)]
    state = core_kv(toks, LAYOUT, seed=n) if n_window is None else core_kv_window(toks, n_window)
    bufs = SlotFileBuffers(SPEC_W)
    room = bufs.target(len(state))
    room[:] = state
    enc = bufs.encode(room, None, None)
    want = sf.encode_target(sf.target_from_core(state, SPEC_W))
    assert (bytes(enc.target), enc.target_sha256, enc.n_tokens) == (want, sf.digest(want), n)
    assert enc.target.obj is room.obj  # the core's buffer, not a copy
    swin = 16 + 4 + 2
    assert len(room.obj) == len(want) + (0 if n_window else swin)
    got = sf.decode_target(enc.target)
    version = sf.TARGET_VERSION if n_window is None else sf.TARGET_VERSION_WINDOW
    assert got.version == version
    assert got.window == (None if n_window is None else sf.Window(n_window, (True, False)))
    assert b"".join(sf.core_parts_from_target(got)) == state


TAIL = (sf.Section(b"CHAT", 0, b'[["user","hi"]]'), sf.Section(b"XTRA", 0, b""))


@pytest.mark.parametrize(("spec", "n", "n_window"),
                         [(SPEC_T, 0, None), (SPEC_T, 7, None), (SPEC_W, 3, None),
                          (SPEC_W, 40, 23)])
def test_optional_sections_after_the_kv_are_written_in_place(
        spec: sf.ModelSpec, n: int, n_window: int | None) -> None:
    """Optional sections after the KV (a session's conversation) go into room left in the
    buffer the core writes: byte for byte what encode_target writes with them as its
    extra sections, the sidecar naming that file, the sections read back."""
    toks = [(5 * k + 2) % 100 for k in range(n)]
    state = core_kv(toks, LAYOUT, seed=n) if n_window is None else core_kv_window(toks, n_window)
    dstate = core_spec(toks[n // 2:], n // 2) if spec is SPEC_T else None
    enc = encode_slot(state, dstate, spec, SPEC_D if dstate is not None else None, TAIL)
    want = sf.encode_target(dataclasses.replace(sf.target_from_core(state, spec), extra=TAIL))
    assert (bytes(enc.target), enc.target_sha256, enc.n_tokens) == (want, sf.digest(want), n)
    got = sf.decode_target(enc.target)
    assert (got.extra, got.tokens) == (TAIL, tuple(toks))
    assert b"".join(sf.core_parts_from_target(got)) == state
    if dstate is not None:
        assert enc.draft is not None
        assert sf.decode_draft(enc.draft).target_digest == sf.digest(want)
    bufs = SlotFileBuffers(spec, TAIL)
    room = bufs.target(len(state))
    room[:] = state
    assert bytes(bufs.encode(room, None, None).target) == want


def test_files_built_in_place_refuse_a_state_that_is_not_the_models() -> None:
    with pytest.raises(ValueError, match="layout"):
        encode_slot(core_kv([1], sf.KVLayout(1, 1, 4)), None, SPEC_T, None)
    with pytest.raises(ValueError, match="does not hold 2 tokens"):
        encode_slot(core_kv([1, 2], LAYOUT)[:-4], None, SPEC_T, None)
    with pytest.raises(ValueError, match="WSSP"):
        encode_slot(core_kv([1], LAYOUT), b"nope" * 20, SPEC_T, SPEC_D)


def test_draft_round_trip() -> None:
    tbytes = sf.encode_target(target())
    data = draft_for(tbytes, offset=2)
    d = sf.decode_draft(data)
    assert (d.fingerprint, d.target_digest, d.n_tokens, d.offset) == (FP_D, sf.digest(tbytes),
                                                                      3, 2)
    assert sf.encode_draft(d) == data
    assert sf.read_meta(data).kind == "draft"
    sf.check_draft(d, sf.digest(tbytes), sf.decode_target(tbytes), SPEC_D)


@pytest.mark.parametrize("which", ["target", "draft"])
def test_every_bit_flip_and_truncation_is_caught(which: str) -> None:
    tbytes = sf.encode_target(target(3))
    data = tbytes if which == "target" else draft_for(tbytes, n=3)
    decode = sf.decode_target if which == "target" else sf.decode_draft
    for i in range(len(data)):
        for bit in (0x01, 0x80):
            bad = bytearray(data)
            bad[i] ^= bit
            with pytest.raises(sf.SlotFileError):
                decode(bytes(bad))
    for n in range(len(data)):
        with pytest.raises(sf.CorruptSlotFile):
            decode(data[:n])
    with pytest.raises(sf.CorruptSlotFile):
        decode(data + b"\0")


def test_version_byte_flips_say_newer() -> None:
    data = bytearray(sf.encode_target(target()))
    data[4] = sf.TARGET_NEWEST + 1
    with pytest.raises(sf.UnsupportedSlotFile, match="version 5 is newer than this server"):
        sf.decode_target(with_digest(data))
    data[4] = 0
    with pytest.raises(sf.CorruptSlotFile):
        sf.decode_target(with_digest(data))


@pytest.mark.parametrize("which", ["target", "draft"])
def test_corrupt_version_field_is_data_loss(which: str) -> None:
    """The trailer is verified before the version is trusted: a flipped version bit, or the
    right magic followed by random bytes, is corruption (DATA_LOSS), never "newer"."""
    tbytes = sf.encode_target(target())
    data = tbytes if which == "target" else draft_for(tbytes)
    decode = sf.decode_target if which == "target" else sf.decode_draft
    for i in range(4, 8):
        for bit in range(8):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            with pytest.raises(sf.CorruptSlotFile, match="digest mismatch"):
                decode(bytes(bad))
    rng = np.random.default_rng(11)
    for n in (12, 100, len(data)):
        junk = data[:4] + rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        with pytest.raises(sf.CorruptSlotFile):
            decode(junk)


def test_wrong_kind_of_file() -> None:
    tbytes = sf.encode_target(target())
    with pytest.raises(sf.CorruptSlotFile, match="it is a target file"):
        sf.decode_draft(tbytes)
    with pytest.raises(sf.CorruptSlotFile, match="it is a draft sidecar"):
        sf.decode_target(draft_for(tbytes))
    with pytest.raises(sf.CorruptSlotFile, match="not a warmslot"):
        sf.decode_target(b"GGUF" + bytes(200))


def test_unknown_optional_section_is_skipped_and_kept() -> None:
    extra = sf.Section(b"NOTE", 0, b"written by a newer warmslot")
    data = sf.encode_target(dataclasses.replace(target(), extra=(extra,)))
    t = sf.decode_target(data)
    assert t.extra == (extra,) and t.tokens == target().tokens
    assert sf.encode_target(t) == data


def test_unknown_required_section_is_refused() -> None:
    extra = sf.Section(b"QKV8", sf.FLAG_REQUIRED, b"\0" * 8)
    data = sf.encode_target(dataclasses.replace(target(), extra=(extra,)))
    with pytest.raises(sf.UnsupportedSlotFile, match="required section"):
        sf.decode_target(data)


def test_longer_header_of_a_later_minor_revision_is_skipped() -> None:
    data = sf.encode_target(target())
    grown = bytearray(data[:128] + b"\x7f" * 32 + data[128:])
    struct.pack_into("<I", grown, 8, 160)
    t = sf.decode_target(with_digest(grown))
    assert t.tokens == target().tokens


def test_checks_against_the_model() -> None:
    t = target()
    sf.check_target(t, SPEC_T)
    with pytest.raises(sf.IncompatibleSlotFile, match="another model"):
        sf.check_target(t, dataclasses.replace(SPEC_T, fingerprint="33" * 32))
    with pytest.raises(sf.IncompatibleSlotFile, match="holds 5 tokens .* context here is 4"):
        sf.check_target(t, dataclasses.replace(SPEC_T, n_ctx=4))
    with pytest.raises(sf.CorruptSlotFile, match="token id 100"):
        sf.check_target(dataclasses.replace(t, tokens=(1, 2, 3, 4, 100)), SPEC_T)
    with pytest.raises(sf.CorruptSlotFile, match="layout"):
        sf.check_target(t, dataclasses.replace(SPEC_T, layout=sf.KVLayout(2, 2, 4)))


def test_draft_checks() -> None:
    tbytes = sf.encode_target(target())
    t = sf.decode_target(tbytes)
    d = sf.decode_draft(draft_for(tbytes))
    with pytest.raises(sf.IncompatibleSlotFile, match="another save"):
        sf.check_draft(d, "00" * 32, t, SPEC_D)
    with pytest.raises(sf.IncompatibleSlotFile, match="another draft model"):
        sf.check_draft(d, sf.digest(tbytes), t, dataclasses.replace(SPEC_D, fingerprint="4" * 64))
    short = dataclasses.replace(t, tokens=t.tokens[:3], kv=bytes(t.kv)[:3 * 64])
    with pytest.raises(sf.CorruptSlotFile, match="past the target"):
        sf.check_draft(d, sf.digest(tbytes), short, SPEC_D)


@pytest.mark.parametrize("index, value, message", [
    (0, 2**64 - 1, r"counter n_steps = 18446744073709551615 is out of range"),
    (3, 2**53, r"counter n_draft_prefill = 9007199254740992 is out of range"),
    (1, 2**64 - 1, r"counter n_drafted = 18446744073709551615 is out of range"),
    (1, 7, r"add up to 6 drafted / 3 accepted, the totals say 7 / 3"),
    (2, 4, r"add up to 6 drafted / 3 accepted, the totals say 6 / 4"),
    (22, 2, r"add up to 6 drafted / 5 accepted, the totals say 6 / 3"),
])
def test_draft_counters_out_of_range_are_refused(index: int, value: int, message: str) -> None:
    """A sidecar whose counters the core never writes (digest recomputed) is corrupt."""
    tbytes = sf.encode_target(target())
    counters = list(COUNTERS)
    counters[index] = value
    d = sf.draft_from_core(core_spec(list(range(3, 8)), 0, tuple(counters)), sf.digest(tbytes),
                           SPEC_D)
    with pytest.raises(sf.CorruptSlotFile, match=message):
        sf.decode_draft(sf.encode_draft(d))


def test_more_accepted_than_drafted_at_a_position_is_refused() -> None:
    tbytes = sf.encode_target(target())
    counters = list(COUNTERS)
    counters[20:23] = [1, 0, 2]  # accepted_at: still 3 in all, but 2 where 1 was drafted
    d = sf.draft_from_core(core_spec(list(range(3, 8)), 0, tuple(counters)), sf.digest(tbytes),
                           SPEC_D)
    with pytest.raises(sf.CorruptSlotFile, match="2 tokens accepted at draft position 2, only 1"):
        sf.decode_draft(sf.encode_draft(d))


def test_draft_header_must_agree_with_its_state() -> None:
    tbytes = sf.encode_target(target())
    d = sf.decode_draft(draft_for(tbytes))
    lying = sf.encode_draft(dataclasses.replace(d, n_tokens=4))
    with pytest.raises(sf.CorruptSlotFile, match="header says 4 tokens"):
        sf.decode_draft(lying)


@pytest.mark.parametrize("name, ok", [
    ("a", True), ("session 1", True), (".x", True), ("é" * 127, True), ("x" * 255, True),
    ("", False), ("x" * 256, False), ("a/b", False), ("a\\b", False), ("..", False),
    ("a..b", False), ("\x00", False), ("a\tb", False), ("\x85", False), (" a", False),
    ("a ", False), ("a.", False), ("\ud800", False),
])
def test_name_rules(name: str, ok: bool) -> None:
    assert (name_problem(name) is None) == ok


def test_local_store(tmp_path: Path) -> None:
    (tmp_path / ".tmp-stale").write_bytes(b"half a file")
    store = LocalStore(tmp_path)
    assert not (tmp_path / ".tmp-stale").exists()  # swept at start-up
    with pytest.raises(NotFound):
        store.load("nope")
    assert store.save("s", b"T1", b"D1") == 4
    assert store.load("s") == store.load("s") and store.load("s").draft == b"D1"
    assert sorted(os.listdir(tmp_path)) == ["s", "s.drft"]
    store.save("s", b"T2", None)  # a save without a draft drops the old sidecar
    got = store.load("s")
    assert (got.target, got.draft, got.draft_note) == (b"T2", None, "no draft sidecar")
    assert sorted(os.listdir(tmp_path)) == ["s"]
    with pytest.raises(InvalidArgument, match="250 bytes"):
        store.save("x" * 251, b"T", b"D")
    store.save("x" * 250, b"T", b"D")
    (tmp_path / "dir").mkdir()
    with pytest.raises(NotFound):
        store.load("dir")


def test_local_store_delete(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.save("a", b"T", b"D")
    store.save("b", b"T", None)
    assert store.delete("a") is True
    assert sorted(os.listdir(tmp_path)) == ["b"]
    with pytest.raises(NotFound):
        store.load("a")
    assert store.delete("a") is False  # nothing left to remove: not an error
    assert store.delete("b") is True
    assert os.listdir(tmp_path) == []
    with pytest.raises(InvalidArgument):
        store.delete("../b")
