"""Slot files and KV cache types: version 2 records f16 or f32 in the header's dtype
field, version 1 files (f32 only) still read, and a file restores only into a context
of its own KV type (FAILED_PRECONDITION naming --kv-type)."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import numpy as np
import pytest

from inference_svc.storage import slotfile as sf

F32 = sf.KVLayout(n_layer=2, n_head_kv=1, head_dim=4)
F16 = dataclasses.replace(F32, dtype=sf.DTYPE_F16)
# q8_0: heads of whole 32-value blocks, 34 bytes each
Q8 = sf.KVLayout(n_layer=2, n_head_kv=1, head_dim=32, dtype=sf.DTYPE_Q8_0)
FP_T, FP_D = "11" * 32, "22" * 32
DTYPE_AT = 4 + 4 * 3 + 32 + 4 * 3  # magic, version, header_len, flags, fingerprint, 3 dims


def target(layout: sf.KVLayout, n: int = 5) -> sf.TargetFile:
    if layout.dtype == sf.DTYPE_Q8_0:
        kv = np.random.default_rng(0).bytes(n * layout.bytes_per_token)
    else:
        kv = np.random.default_rng(0).standard_normal(2 * layout.n_layer * layout.kv_dim * n)
        kv = kv.astype("<f2" if layout.dtype == sf.DTYPE_F16 else "<f4").tobytes()
    return sf.TargetFile(FP_T, layout, 64, 100, tuple(range(3, 3 + n)), kv)


def spec(layout: sf.KVLayout, fingerprint: str = FP_T) -> sf.ModelSpec:
    return sf.ModelSpec(fingerprint, "m", layout, n_vocab=100, n_ctx=64)


def with_version(data: bytes, version: int) -> bytes:
    b = bytearray(data)
    struct.pack_into("<I", b, 4, version)
    b[-32:] = hashlib.sha256(bytes(b[:-32])).digest()
    return bytes(b)


def test_layout_sizes_and_names() -> None:
    assert (F32.bytes_per_token, F16.bytes_per_token) == (2 * 2 * 4 * 4, 2 * 2 * 4 * 2)
    assert (str(F32), str(F16)) == ("2 layers x 1 kv heads x 4 f32",
                                    "2 layers x 1 kv heads x 4 f16")
    assert sf.DTYPE_BY_NAME == {"f32": 0, "f16": 1, "q8_0": 2}
    assert Q8.bytes_per_token == 2 * 2 * 34 and str(Q8) == "2 layers x 1 kv heads x 32 q8_0"


@pytest.mark.parametrize("layout", [F32, F16, Q8], ids=["f32", "f16", "q8_0"])
def test_version_2_round_trip(layout: sf.KVLayout) -> None:
    t = target(layout)
    data = sf.encode_target(t)
    version = 4 if layout is Q8 else 2  # q8_0: a version an older reader refuses
    assert struct.unpack_from("<II", data, 4) == (version, 128)
    assert struct.unpack_from("<I", data, DTYPE_AT)[0] == layout.dtype
    assert len(data) == 128 + 16 + 4 * 5 + 16 + 5 * layout.bytes_per_token + 32
    back = sf.decode_target(data)
    assert (back.version, back.layout, bytes(back.kv)) == (version, layout, t.kv)
    sf.check_target(back, spec(layout))
    head, toks, kv = sf.core_parts_from_target(back)
    assert struct.unpack("<8I", head) == (sf.CORE_KV_MAGIC, 2, 2, layout.kv_dim, layout.kv_dim,
                                          layout.dtype, 5, 0)
    assert bytes(kv) == t.kv


def test_version_1_f32_file_still_reads() -> None:
    v1 = with_version(sf.encode_target(target(F32)), 1)
    t = sf.decode_target(v1)
    assert (t.version, t.layout) == (1, F32)
    sf.check_target(t, spec(F32))
    # restored through the core's version-2 header, with the file's own KV bytes
    head, _, kv = sf.core_parts_from_target(t)
    assert struct.unpack_from("<2I", head, 0)[1] == 2 and bytes(kv) == bytes(t.kv)


def test_version_1_knew_no_f16() -> None:
    v1 = with_version(sf.encode_target(target(F16)), 1)
    with pytest.raises(sf.CorruptSlotFile, match="unknown KV dtype 1 in a version 1 file"):
        sf.decode_target(v1)


def test_unknown_dtype_is_corrupt() -> None:
    b = bytearray(sf.encode_target(target(F32)))
    struct.pack_into("<I", b, DTYPE_AT, 7)
    b[-32:] = hashlib.sha256(bytes(b[:-32])).digest()
    with pytest.raises(sf.CorruptSlotFile, match="unknown KV dtype 7 in a version 2 file"):
        sf.decode_target(bytes(b))


@pytest.mark.parametrize("saved, running", [(F32, F16), (F16, F32)], ids=["f32-in-f16",
                                                                          "f16-in-f32"])
def test_other_kv_type_is_incompatible_and_names_the_flag(saved: sf.KVLayout,
                                                          running: sf.KVLayout) -> None:
    t = sf.decode_target(sf.encode_target(target(saved)))
    a, b = sf.DTYPE_NAMES[saved.dtype], sf.DTYPE_NAMES[running.dtype]
    with pytest.raises(sf.IncompatibleSlotFile) as exc:
        sf.check_target(t, spec(running))
    assert str(exc.value) == (f"slot file holds an {a} KV cache, this server keeps {b}: "
                              f"restore it on a server started with --kv-type {a}")
    # the fingerprint is checked first: a file of another model says so whatever its type
    with pytest.raises(sf.IncompatibleSlotFile, match="another model"):
        sf.check_target(t, spec(running, fingerprint="33" * 32))


def test_draft_sidecar_of_another_kv_type_is_incompatible() -> None:
    tbytes = sf.encode_target(target(F16))
    t = sf.decode_target(tbytes)
    d = sf.DraftFile(sf.digest(tbytes), FP_D, F16, 64, 100, 0, 0, b"")
    d = sf.decode_draft(sf.encode_draft(d))
    assert (d.version, d.layout) == (2, F16)
    sf.check_draft(d, sf.digest(tbytes), t, spec(F16, FP_D))
    with pytest.raises(sf.IncompatibleSlotFile,
                       match="draft sidecar holds an f16 KV cache, this server keeps f32: "
                             "restore it on a server started with --kv-type f16"):
        sf.check_draft(d, sf.digest(tbytes), t, spec(F32, FP_D))


def test_q8_0_file_in_an_f16_server_is_incompatible() -> None:
    """A q8_0 file (its own layout) checked against an f16 model of the same shape."""
    t = sf.decode_target(sf.encode_target(target(Q8)))
    with pytest.raises(sf.IncompatibleSlotFile) as exc:
        sf.check_target(t, spec(dataclasses.replace(Q8, dtype=sf.DTYPE_F16)))
    assert str(exc.value) == ("slot file holds a q8_0 KV cache, this server keeps f16: "
                              "restore it on a server started with --kv-type q8_0")


@pytest.mark.parametrize("version", [1, 2, 3])
def test_versions_before_4_knew_no_q8_0(version: int) -> None:
    old = with_version(sf.encode_target(target(Q8)), version)
    with pytest.raises(sf.CorruptSlotFile,
                       match=f"unknown KV dtype 2 in a version {version} file"):
        sf.decode_target(old)


def test_newer_target_version_is_unsupported() -> None:
    """What a reader of version 3 saw of a q8_0 file: a newer format, not corruption."""
    assert sf.TARGET_NEWEST == 4
    with pytest.raises(sf.UnsupportedSlotFile, match="format version 5 is newer"):
        sf.decode_target(with_version(sf.encode_target(target(Q8)), 5))


def test_q8_0_draft_sidecar_is_version_3() -> None:
    tbytes = sf.encode_target(target(Q8))
    t = sf.decode_target(tbytes)
    d = sf.DraftFile(sf.digest(tbytes), FP_D, Q8, 64, 100, 0, 0, b"")
    data = sf.encode_draft(d)
    assert struct.unpack_from("<I", data, 4)[0] == 3
    back = sf.decode_draft(data)
    assert (back.version, back.layout) == (3, Q8)
    sf.check_draft(back, sf.digest(tbytes), t, spec(Q8, FP_D))
    with pytest.raises(sf.CorruptSlotFile, match="unknown KV dtype 2 in a version 2 file"):
        sf.decode_draft(with_version(data, 2))
    with pytest.raises(sf.UnsupportedSlotFile, match="format version 5 is newer"):
        sf.decode_draft(with_version(data, 5))
    # an f16 sidecar stays version 2
    f16 = sf.DraftFile(sf.digest(tbytes), FP_D, F16, 64, 100, 0, 0, b"")
    assert struct.unpack_from("<I", sf.encode_draft(f16), 4)[0] == 2
