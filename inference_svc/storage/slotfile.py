"""Slot files: the target file `<name>` and its draft sidecar `<name>.drft`.

Pure functions between bytes and objects: no I/O and no decoding-core calls
(the core's state constants are read from its binding), so the local store, the
snapshot client and tools share them. The byte layout
is specified in docs/formats.md; keep the two in step.

Checks are split in two:
- `decode_target` / `decode_draft` check a file on its own (magic, format
  version, digest trailer, structure) and raise `CorruptSlotFile` (DATA_LOSS)
  or `UnsupportedSlotFile` (FAILED_PRECONDITION, a newer format);
- `check_target` / `check_draft` check it against the running models and
  context and raise `IncompatibleSlotFile` (FAILED_PRECONDITION) or
  `CorruptSlotFile` (token ids outside the vocabulary).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from inference_svc.core import header as _core

TARGET_MAGIC = b"WSLT"
DRAFT_MAGIC = b"WSLD"
# the versions this code writes and the newest it reads; version 2 added the f16 KV
# dtype (a version-1 file is f32 and still reads); version 3 (target) the SWIN section:
# sliding-window layers that hold their last n_window positions only; target version 4
# and draft version 3 the q8_0 dtype (with or without SWIN). Each file is written in the
# oldest version that can hold it: a target file of f16 or f32 whose every layer holds
# every position is still version 2.
TARGET_VERSION = 2
TARGET_VERSION_WINDOW = 3
TARGET_VERSION_Q8_0 = 4
TARGET_NEWEST = 4
DRAFT_VERSION = 2
DRAFT_VERSION_Q8_0 = 3
DRAFT_VERSION_HEAD = 4  # the core's draft state is WSSP version 2 (a feature head's part)
DRAFT_NEWEST = 4
HEADER_LEN = 128  # v1 header length of both files (a reader trusts the file's own)
DIGEST_LEN = 32
SECTION_HEADER = struct.Struct("<4sIQ")  # tag, flags, payload length
FLAG_REQUIRED = 1  # a reader that does not know the section must refuse the file

TAG_TOKENS = b"TOKS"  # target: int32[n_tokens]
TAG_KV = b"KVCA"  # target: per layer K dtype[n_l][kv_dim] then V dtype[n_l][kv_dim]
TAG_WINDOW = b"SWIN"  # target (version 3): u32 n_window, u8[n_layer] 1 = sliding-window layer
TAG_DRAFT_STATE = b"DSTA"  # draft: the core's draft state (WSSP), verbatim

# the KV dtype is the core's ws_kv_type (format version 2 on; version 1 is f32 only)
DTYPE_F32 = _core.const("WS_KV_F32")
DTYPE_F16 = _core.const("WS_KV_F16")  # IEEE half, the KV cache's values as stored
DTYPE_Q8_0 = _core.const("WS_KV_Q8_0")  # blocks of 32 int8 values with a half scale, as stored
DTYPE_BY_NAME = dict(_core.KV_TYPES)
DTYPE_NAMES = {code: name for name, code in DTYPE_BY_NAME.items()}


def target_version(dtype: int, windowed: bool) -> int:
    """The version a target file of this KV dtype is written in (windowed: it has a SWIN
    section): an older reader refuses a dtype it does not know by the version."""
    if dtype == DTYPE_Q8_0:
        return TARGET_VERSION_Q8_0
    return TARGET_VERSION_WINDOW if windowed else TARGET_VERSION


def draft_version(dtype: int, head: bool = False) -> int:
    """The version a draft sidecar of this KV dtype is written in; head: its core state
    has the feature head's part (WSSP version 2)."""
    if head:
        return DRAFT_VERSION_HEAD
    return DRAFT_VERSION_Q8_0 if dtype == DTYPE_Q8_0 else DRAFT_VERSION

# target header after the magic: version, header_len, flags, fingerprint, n_layer,
# n_head_kv, head_dim, dtype, n_ctx, n_vocab, n_tokens, n_sections
_TARGET_HEAD = struct.Struct("<4sIII32s8I")
# draft header: version, header_len, flags, target digest, fingerprint, n_layer,
# n_head_kv, head_dim, dtype, n_ctx, n_vocab, n_tokens, offset, n_sections
_DRAFT_HEAD = struct.Struct("<4sIII32s32s9I")
_PREFIX = struct.Struct("<4sII")  # magic, version, header_len: common to every version

# the decoding core's slot state (ws_slot_state_get): 8 x u32 header; its magic and
# version (2: dtype f32 or f16; 1 is still read) are the core's own constants
# (native/warmslot.h), read through the binding
CORE_KV_MAGIC = _core.const("WS_STATE_MAGIC")  # "WSKV"
CORE_KV_VERSION = _core.const("WS_STATE_VERSION")  # 3: word 7 is n_window
CORE_KV_VERSION_FULL = 2  # what the core writes when every layer holds every position
_CORE_KV_HEAD = struct.Struct("<8I")
# the core's draft state (ws_spec_state_get): magic, version, d_off, lag_ok,
# rng[4] u64, counters (4 + 2 x WS_SPEC_MAX_DRAFT) u64, then the draft's WSKV slot state
CORE_SPEC_MAGIC = _core.const("WS_SPEC_STATE_MAGIC")  # "WSSP"
CORE_SPEC_VERSION = _core.const("WS_SPEC_STATE_VERSION")  # 2: with a feature head's part
CORE_SPEC_EXT = struct.Struct("<IIQQII")  # version 2: parts, h_ok, bytes of each, K, width
if CORE_SPEC_EXT.size != _core.const("WS_SPEC_STATE_EXT_BYTES"):
    raise ImportError("the core's draft state extension differs from the fields read here")
SPEC_MAX_DRAFT = _core.const("WS_SPEC_MAX_DRAFT")  # drafted_at / accepted_at entries
_CORE_SPEC_HEAD = struct.Struct(f"<4I4Q{4 + 2 * SPEC_MAX_DRAFT}Q")
# the header sizes are the core's (a core whose layout changed refuses to import)
for _what, _head, _size in (
        ("slot state", _CORE_KV_HEAD, _core.const("WS_STATE_HEADER_BYTES")),
        ("draft state", _CORE_SPEC_HEAD, _core.const("WS_SPEC_STATE_HEADER_BYTES"))):
    if _head.size != _size:
        raise ImportError(f"the core's {_what} header is {_size} bytes, the fields read "
                          f"here {_head.size}")
# largest counter a restored draft state may hold: centuries of steps at any speed, and far
# enough below 2^64 that no later step of the core can overflow it
MAX_COUNTER = 2**53 - 1


class SlotFileError(ValueError):
    """A slot file that cannot be restored; the message says why."""


class CorruptSlotFile(SlotFileError):
    """Truncated, bit-flipped or malformed (DATA_LOSS)."""


class UnsupportedSlotFile(SlotFileError):
    """A newer format version or an unknown required section (FAILED_PRECONDITION)."""


class IncompatibleSlotFile(SlotFileError):
    """Made by another model, with another KV type, or too big for the context
    (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class KVLayout:
    """Shape of a model's KV cache: per layer, per token, K and V of kv_dim values."""

    n_layer: int
    n_head_kv: int
    head_dim: int
    dtype: int = DTYPE_F32

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one position's K (or V) of one layer: kv_dim values of the dtype."""
        from inference_svc.core.binding import kv_type_bytes  # the core's own rule

        return self.n_head_kv * kv_type_bytes(self.dtype, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.n_layer * self.row_bytes

    def __str__(self) -> str:
        return (f"{self.n_layer} layers x {self.n_head_kv} kv heads x {self.head_dim} "
                f"{DTYPE_NAMES.get(self.dtype, f'dtype {self.dtype}')}")


@dataclass(frozen=True)
class Section:
    """A tagged section this reader does not know (kept so it can be written back)."""

    tag: bytes
    flags: int
    payload: bytes


def optional_section(extra: Sequence[Section], tag: bytes) -> Section | None:
    """The one optional section `tag` among a file's others (None when absent);
    CorruptSlotFile when it appears twice."""
    found = [s for s in extra if s.tag == tag]
    if len(found) > 1:
        raise CorruptSlotFile(f"slot file: section {tag!r} appears twice")
    return found[0] if found else None


@dataclass(frozen=True)
class Window:
    """Sliding-window layers that hold only the last n_window positions of the tokens."""

    n_window: int
    local: tuple[bool, ...]  # per layer: True for a sliding-window layer

    def pack(self) -> bytes:
        return struct.pack(f"<I{len(self.local)}B", self.n_window, *map(int, self.local))


def kv_bytes(layout: KVLayout, n_tokens: int, window: Window | None) -> int:
    """Bytes of the KV of n_tokens: per layer, n_tokens positions or (a sliding-window
    layer of a windowed file) n_window."""
    if window is None:
        return n_tokens * layout.bytes_per_token
    rows = sum(window.n_window if loc else n_tokens for loc in window.local)
    return 2 * rows * layout.row_bytes


@dataclass(frozen=True)
class TargetFile:
    """The target file's content. `kv` holds per layer K then V for the tokens (a
    sliding-window layer of a windowed file: for its last `window.n_window` tokens)."""

    fingerprint: str  # hex SHA-256 of the target model
    layout: KVLayout
    n_ctx: int  # context size of the process that wrote it
    n_vocab: int
    tokens: tuple[int, ...]
    kv: bytes | memoryview
    extra: tuple[Section, ...] = ()
    version: int = TARGET_VERSION
    window: Window | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class DraftFile:
    """The draft sidecar's content: the core's draft state for one target file."""

    target_digest: str  # hex SHA-256 of the whole target file it belongs to
    fingerprint: str  # hex SHA-256 of the draft model
    layout: KVLayout
    n_ctx: int
    n_vocab: int
    n_tokens: int  # tokens in the draft's KV
    offset: int  # target position of the draft's first token
    state: bytes | memoryview  # ws_spec_state_get bytes (WSSP)
    extra: tuple[Section, ...] = ()
    version: int = DRAFT_VERSION


@dataclass(frozen=True)
class SlotFileMeta:
    """What the fixed header says, without verifying the file (listings, snapshots)."""

    kind: str  # "target" or "draft"
    version: int
    fingerprint: str
    n_tokens: int
    target_digest: str = ""  # draft only


def digest(data: bytes | memoryview) -> str:
    """Hex SHA-256 of a whole file: the target digest a sidecar records."""
    return hashlib.sha256(data).hexdigest()


def file_digests(data: bytes | memoryview) -> tuple[str, str]:
    """(digest(data), the hex SHA-256 of data without its trailer) in one pass."""
    view = memoryview(data).cast("B")
    h = hashlib.sha256(view[:-DIGEST_LEN])
    body = h.hexdigest()
    h.update(view[-DIGEST_LEN:])
    return h.hexdigest(), body


def _fp_bytes(fingerprint: str, what: str) -> bytes:
    try:
        raw = bytes.fromhex(fingerprint)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"{what} {fingerprint!r} is not a hex SHA-256")
    return raw


def _sections(parts: list[tuple[bytes, int, bytes | memoryview]]) -> list[bytes | memoryview]:
    out: list[bytes | memoryview] = []
    for tag, flags, payload in parts:
        out += [SECTION_HEADER.pack(tag, flags, len(payload)), payload]
    return out


def _seal(chunks: list[bytes | memoryview]) -> bytes:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return b"".join([*chunks, h.digest()])


def _target_head(fingerprint: str, lay: KVLayout, n_ctx: int, n_vocab: int, n_tokens: int,
                 n_sections: int, version: int = TARGET_VERSION) -> bytes:
    head = _TARGET_HEAD.pack(TARGET_MAGIC, version, HEADER_LEN, 0,
                             _fp_bytes(fingerprint, "fingerprint"), lay.n_layer, lay.n_head_kv,
                             lay.head_dim, lay.dtype, n_ctx, n_vocab, n_tokens, n_sections)
    return head + bytes(HEADER_LEN - len(head))


def _draft_head(target_digest: str, fingerprint: str, lay: KVLayout, n_ctx: int, n_vocab: int,
                n_tokens: int, offset: int, n_sections: int, head_part: bool = False) -> bytes:
    head = _DRAFT_HEAD.pack(DRAFT_MAGIC, draft_version(lay.dtype, head_part), HEADER_LEN, 0,
                            _fp_bytes(target_digest, "target digest"),
                            _fp_bytes(fingerprint, "fingerprint"), lay.n_layer, lay.n_head_kv,
                            lay.head_dim, lay.dtype, n_ctx, n_vocab, n_tokens, offset, n_sections)
    return head + bytes(HEADER_LEN - len(head))


def encode_target(t: TargetFile) -> bytes:
    """The bytes of a target file: version TARGET_VERSION, or TARGET_VERSION_WINDOW
    when its sliding-window layers hold only their last positions, or
    TARGET_VERSION_Q8_0 for a q8_0 KV (target_version)."""
    lay = t.layout
    if len(t.kv) != kv_bytes(lay, t.n_tokens, t.window):
        raise ValueError(f"KV of {len(t.kv)} bytes does not hold {t.n_tokens} tokens of {lay}")
    sections = [(TAG_TOKENS, FLAG_REQUIRED, struct.pack(f"<{t.n_tokens}i", *t.tokens))]
    if t.window is not None:
        sections.append((TAG_WINDOW, FLAG_REQUIRED, t.window.pack()))
    sections.append((TAG_KV, FLAG_REQUIRED, t.kv))
    sections += [(s.tag, s.flags, s.payload) for s in t.extra]
    version = target_version(lay.dtype, t.window is not None)
    head = _target_head(t.fingerprint, lay, t.n_ctx, t.n_vocab, t.n_tokens, len(sections),
                        version)
    return _seal([head, *_sections(sections)])


def encode_draft(d: DraftFile) -> bytes:
    """The bytes of a draft sidecar (version draft_version(dtype))."""
    sections = [(TAG_DRAFT_STATE, FLAG_REQUIRED, d.state)]
    sections += [(s.tag, s.flags, s.payload) for s in d.extra]
    head = _draft_head(d.target_digest, d.fingerprint, d.layout, d.n_ctx, d.n_vocab, d.n_tokens,
                       d.offset, len(sections), _core_spec_version(d.state) == 2)
    return _seal([head, *_sections(sections)])


# --------------------------------------------------------------------------------------
# slot files built in place around the core's state: the core writes its state into a
# file-sized buffer at the offset below, and only headers and the digest trailer are
# written around it (the state is not copied again)

# a target file holds the core's tokens and KV in two sections: the core's state
# (32-byte header, tokens, KV) goes where its KV ends up in place, and the tokens
# move SECTION_HEADER.size bytes down to make room for the KV section's header
TARGET_STATE_AT = HEADER_LEN + 2 * SECTION_HEADER.size - _CORE_KV_HEAD.size
# a draft sidecar holds the core's draft state verbatim in its one section
DRAFT_STATE_AT = HEADER_LEN + SECTION_HEADER.size


def window_room(model: ModelSpec) -> int:
    """Bytes a target file of this model may need before its KV beyond a version-2 file's:
    the SWIN section (header, n_window, one flag per layer) of a model with
    sliding-window layers, else 0."""
    return SECTION_HEADER.size + 4 + len(model.local_layers) if model.local_layers else 0


def target_state_at(model: ModelSpec) -> int:
    """Where the core writes its slot state in a target file buffer of this model: the
    tokens then move down and the section headers fill the gap, so that the KV is in
    place whichever version the state turns out to be (see seal_target)."""
    return TARGET_STATE_AT + window_room(model)


def sections_size(sections: Sequence[Section]) -> int:
    """The bytes sections take in a file (headers and payloads)."""
    return sum(SECTION_HEADER.size + len(s.payload) for s in sections)


def target_file_size(state_len: int, model: ModelSpec, tail: int = 0) -> int:
    """The size of the target file buffer of a core state of `state_len` bytes of this
    model: the file itself, or for a model with sliding-window layers, room for the
    longer of its two versions. `tail`: bytes of optional sections after the KV
    (sections_size)."""
    return target_state_at(model) + state_len + tail + DIGEST_LEN


def draft_file_size(state_len: int) -> int:
    """The size of the draft sidecar of a core draft state of `state_len` bytes."""
    return DRAFT_STATE_AT + state_len + DIGEST_LEN


def _trailer(buf: memoryview) -> str:
    """Writes the digest trailer (the last DIGEST_LEN bytes of buf) and returns the hex
    SHA-256 of the whole file, both from one pass over the body."""
    h = hashlib.sha256(buf[:-DIGEST_LEN])
    body = h.digest()
    buf[-DIGEST_LEN:] = body
    h.update(body)
    return h.hexdigest()


def seal_target(buf: memoryview, model: ModelSpec,
                tail: Sequence[Section] = ()) -> tuple[memoryview, int, str]:
    """Turns `buf` (target_file_size(n, model, sections_size(tail)) bytes holding n
    bytes of core slot state at target_state_at(model), the bytes target_from_core
    reads) into the target file that encode_target of target_from_core(state, model)
    with `tail` as its extra (optional) sections writes, in place: (the file, a view of
    buf; n_tokens; hex SHA-256 of the file). The KV stays where the core wrote it; only
    the tokens move (down, over the core's header) and headers are written around
    them, the tail sections after the KV. A windowed state (sliding-window layers
    holding their window only) fills the whole buffer, with the SWIN section between
    tokens and KV; any other state of a windowed model is a version-2 file that starts
    window_room(model) bytes in."""
    room = window_room(model)
    after = sections_size(tail)
    if len(buf) < target_file_size(_CORE_KV_HEAD.size, model, after):
        raise ValueError(f"a target file buffer of {len(buf)} bytes holds no core state")
    n, window = _core_kv_head(buf[TARGET_STATE_AT + room:len(buf) - DIGEST_LEN - after],
                              model)
    if window is None:
        buf = buf[room:]  # a version-2 file: no window section, the room unused
    toks = TARGET_STATE_AT + (room if window is not None else 0) + _CORE_KV_HEAD.size
    pos = HEADER_LEN + SECTION_HEADER.size  # where the file's tokens go
    buf[pos:pos + 4 * n] = buf[toks:toks + 4 * n]  # an overlapping move: memmove
    SECTION_HEADER.pack_into(buf, HEADER_LEN, TAG_TOKENS, FLAG_REQUIRED, 4 * n)
    pos += 4 * n
    if window is not None:
        swin = window.pack()
        SECTION_HEADER.pack_into(buf, pos, TAG_WINDOW, FLAG_REQUIRED, len(swin))
        pos += SECTION_HEADER.size
        buf[pos:pos + len(swin)] = swin
        pos += len(swin)
    # the KV section's header ends where the core wrote the KV: toks + 4 * n
    end = len(buf) - DIGEST_LEN - after  # where the core's state ends
    SECTION_HEADER.pack_into(buf, pos, TAG_KV, FLAG_REQUIRED, end - pos - SECTION_HEADER.size)
    for s in tail:
        SECTION_HEADER.pack_into(buf, end, s.tag, s.flags, len(s.payload))
        end += SECTION_HEADER.size
        buf[end:end + len(s.payload)] = s.payload
        end += len(s.payload)
    version = target_version(model.layout.dtype, window is not None)
    n_sections = 2 if window is None else 3
    buf[:HEADER_LEN] = _target_head(model.fingerprint, model.layout, model.n_ctx,
                                    model.n_vocab, n, n_sections + len(tail), version)
    return buf, n, _trailer(buf)


def seal_draft(buf: memoryview, target_digest: str, model: ModelSpec) -> None:
    """Turns `buf` (draft_file_size(n) bytes holding n bytes of core draft state at
    DRAFT_STATE_AT) into the sidecar that encode_draft(draft_from_core(state,
    target_digest, model)) writes, in place."""
    state = buf[DRAFT_STATE_AT:-DIGEST_LEN]
    d = draft_from_core(state, target_digest, model)
    SECTION_HEADER.pack_into(buf, HEADER_LEN, TAG_DRAFT_STATE, FLAG_REQUIRED, len(state))
    buf[:HEADER_LEN] = _draft_head(target_digest, d.fingerprint, d.layout, d.n_ctx, d.n_vocab,
                                   d.n_tokens, d.offset, 1, _core_spec_version(state) == 2)
    _trailer(buf)


def _open(data: bytes | memoryview, magic: bytes, newest: int, kind: str,
          head: struct.Struct, body_sha256: str | None = None) -> memoryview:
    """Checks magic, digest, version and header length; returns the file without trailer.
    `body_sha256`: the hex SHA-256 of the file without its trailer when the caller
    computed it while reading the bytes (it is checked against the trailer instead of
    hashing the body again)."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        raise CorruptSlotFile(f"{kind} is {len(view)} bytes long: truncated")
    got_magic, version, header_len = _PREFIX.unpack_from(view)
    if got_magic != magic:
        other = {TARGET_MAGIC: "a target file", DRAFT_MAGIC: "a draft sidecar"}.get(got_magic)
        what = f"it is {other}" if other else f"magic {got_magic!r} is not {magic!r}"
        raise CorruptSlotFile(f"not a warmslot {kind}: {what}")
    # the trailer (SHA-256 of everything before it, the last 32 bytes in every version) is
    # checked before any header field is trusted: a bit flip in the version field is
    # corruption, not a newer format
    if len(view) < _PREFIX.size + DIGEST_LEN:
        raise CorruptSlotFile(f"{kind} is {len(view)} bytes long: truncated")
    body = view[:-DIGEST_LEN]
    got = bytes.fromhex(body_sha256) if body_sha256 else hashlib.sha256(body).digest()
    if got != bytes(view[-DIGEST_LEN:]):
        raise CorruptSlotFile(f"{kind} digest mismatch: the file is truncated or corrupt")
    if version > newest:
        raise UnsupportedSlotFile(
            f"{kind} format version {version} is newer than this server reads ({newest}); "
            f"restore it with a newer warmslot")
    if version < 1:
        raise CorruptSlotFile(f"{kind} format version {version} is invalid")
    if header_len < head.size or len(view) < header_len + DIGEST_LEN:
        raise CorruptSlotFile(f"{kind} of {len(view)} bytes with a header of {header_len} bytes: "
                              f"truncated or corrupt")
    return body


def _read_sections(body: memoryview, start: int, count: int, known: set[bytes],
                   kind: str, optional: frozenset[bytes] = frozenset()
                   ) -> tuple[dict[bytes, memoryview], tuple[Section, ...]]:
    """The sections: `known` ones by tag (each required unless in `optional`), the
    others kept unless REQUIRED."""
    found: dict[bytes, memoryview] = {}
    extra: list[Section] = []
    pos = start
    for _ in range(count):
        if pos + SECTION_HEADER.size > len(body):
            raise CorruptSlotFile(f"{kind}: section header at byte {pos} past the end")
        tag, flags, length = SECTION_HEADER.unpack_from(body, pos)
        pos += SECTION_HEADER.size
        if pos + length > len(body):
            raise CorruptSlotFile(f"{kind}: section {tag!r} of {length} bytes past the end")
        payload = body[pos:pos + length]
        pos += length
        if tag in known:
            if tag in found:
                raise CorruptSlotFile(f"{kind}: section {tag!r} appears twice")
            found[tag] = payload
        elif flags & FLAG_REQUIRED:
            raise UnsupportedSlotFile(f"{kind} has a required section {tag!r} this server does "
                                      f"not know; restore it with a newer warmslot")
        else:
            extra.append(Section(bytes(tag), flags, bytes(payload)))
    if pos != len(body):
        raise CorruptSlotFile(f"{kind}: {len(body) - pos} stray bytes after the sections")
    missing = known - optional - found.keys()
    if missing:
        raise CorruptSlotFile(f"{kind} lacks section(s) {sorted(missing)}")
    return found, tuple(extra)


def _check_dtype(kind: str, version: int, dtype: int, q8_0_from: int) -> None:
    """f32 in every version, f16 from version 2, q8_0 from version q8_0_from."""
    if (dtype not in DTYPE_NAMES or (version < 2 and dtype != DTYPE_F32)
            or (dtype == DTYPE_Q8_0 and version < q8_0_from)):
        raise CorruptSlotFile(f"{kind}: unknown KV dtype {dtype} in a version {version} file")


def decode_target(data: bytes | memoryview, body_sha256: str | None = None) -> TargetFile:
    """Parses and verifies a target file on its own (not against a model).
    `body_sha256`: see `_open`."""
    kind = "slot file"
    body = _open(data, TARGET_MAGIC, TARGET_NEWEST, kind, _TARGET_HEAD, body_sha256)
    (_, version, header_len, _flags, fp, n_layer, n_head_kv, head_dim, dtype, n_ctx, n_vocab,
     n_tokens, n_sections) = _TARGET_HEAD.unpack_from(body)
    _check_dtype(kind, version, dtype, TARGET_VERSION_Q8_0)
    layout = KVLayout(n_layer, n_head_kv, head_dim, dtype)
    # SWIN: required in version 3, optional from version 4 (a q8_0 file of any window)
    known = {TAG_TOKENS, TAG_KV} | ({TAG_WINDOW} if version >= TARGET_VERSION_WINDOW else set())
    optional = frozenset({TAG_WINDOW}) if version >= TARGET_VERSION_Q8_0 else frozenset()
    found, extra = _read_sections(body, header_len, n_sections, known, kind, optional)
    toks, kv = found[TAG_TOKENS], found[TAG_KV]
    if len(toks) != 4 * n_tokens:
        raise CorruptSlotFile(f"{kind}: {len(toks)} token bytes for {n_tokens} tokens")
    window = _window(found[TAG_WINDOW], n_layer, n_tokens, kind) if TAG_WINDOW in found else None
    need = kv_bytes(layout, n_tokens, window)
    if len(kv) != need:
        raise CorruptSlotFile(f"{kind}: KV of {len(kv)} bytes, {n_tokens} tokens of {layout} "
                              f"need {need}")
    tokens = struct.unpack(f"<{n_tokens}i", toks)
    return TargetFile(fp.hex(), layout, n_ctx, n_vocab, tokens, kv, extra, version, window)


def _window(payload: bytes | memoryview, n_layer: int, n_tokens: int, kind: str) -> Window:
    """The SWIN section: n_window below n_tokens, one 0/1 flag per layer, some set."""
    if len(payload) != 4 + n_layer:
        raise CorruptSlotFile(f"{kind}: window section of {len(payload)} bytes, {n_layer} layers "
                              f"need {4 + n_layer}")
    n_window, *flags = struct.unpack(f"<I{n_layer}B", payload)
    if n_window >= n_tokens or any(f > 1 for f in flags) or not any(flags):
        raise CorruptSlotFile(f"{kind}: window of {n_window} positions of {n_tokens} tokens, "
                              f"layer flags {flags} are not valid")
    return Window(n_window, tuple(bool(f) for f in flags))


def decode_draft(data: bytes | memoryview) -> DraftFile:
    """Parses and verifies a draft sidecar on its own (not against a model)."""
    kind = "draft sidecar"
    body = _open(data, DRAFT_MAGIC, DRAFT_NEWEST, kind, _DRAFT_HEAD)
    (_, version, header_len, _flags, tdig, fp, n_layer, n_head_kv, head_dim, dtype, n_ctx,
     n_vocab, n_tokens, offset, n_sections) = _DRAFT_HEAD.unpack_from(body)
    _check_dtype(kind, version, dtype, DRAFT_VERSION_Q8_0)
    found, extra = _read_sections(body, header_len, n_sections, {TAG_DRAFT_STATE}, kind)
    state = found[TAG_DRAFT_STATE]
    _check_core_spec_counters(state, kind)
    inner = _core_spec_fields(state)
    if inner is not None and inner != (offset, n_tokens):
        raise CorruptSlotFile(f"{kind}: header says {n_tokens} tokens from {offset}, its state "
                              f"{inner[1]} from {inner[0]}")
    return DraftFile(tdig.hex(), fp.hex(), KVLayout(n_layer, n_head_kv, head_dim, dtype), n_ctx,
                     n_vocab, n_tokens, offset, state, extra, version)


def read_meta(data: bytes | memoryview) -> SlotFileMeta:
    """The fixed header of either file, unverified (for listings and snapshot metadata)."""
    view = memoryview(data).cast("B")
    if len(view) >= _TARGET_HEAD.size and bytes(view[:4]) == TARGET_MAGIC:
        f = _TARGET_HEAD.unpack_from(view)
        return SlotFileMeta("target", f[1], f[4].hex(), f[11])
    if len(view) >= _DRAFT_HEAD.size and bytes(view[:4]) == DRAFT_MAGIC:
        f = _DRAFT_HEAD.unpack_from(view)
        return SlotFileMeta("draft", f[1], f[5].hex(), f[12], target_digest=f[4].hex())
    raise CorruptSlotFile("not a warmslot slot file")


# --------------------------------------------------------------------------------------
# checks against the running models


@dataclass(frozen=True)
class ModelSpec:
    """What a slot file must match: one loaded model in a context of n_ctx."""

    fingerprint: str
    name: str
    layout: KVLayout
    n_vocab: int
    n_ctx: int
    local_layers: tuple[bool, ...] = ()  # per layer: a sliding-window layer (gemma3)


def _short(fp: str) -> str:
    return fp[:12]


def _check_kv_type(kind: str, got: KVLayout, want: KVLayout) -> None:
    """The KV type of a file must be the running context's: values are never converted
    (f32 -> f16 would round them, and the session would no longer continue exactly)."""
    if got.dtype != want.dtype:
        name = DTYPE_NAMES[got.dtype]
        article = "an" if name.startswith("f") else "a"  # "an f16", "a q8_0"
        raise IncompatibleSlotFile(
            f"{kind} holds {article} {name} KV cache, this server keeps {DTYPE_NAMES[want.dtype]}: "
            f"restore it on a server started with --kv-type {name}")


def _check_model(kind: str, made_by: str, fingerprint: str, layout: KVLayout, n_vocab: int,
                 model: ModelSpec) -> None:
    """A file made by `model` (`made_by` names it in the message) with its KV layout."""
    if fingerprint != model.fingerprint:
        raise IncompatibleSlotFile(
            f"{kind} was made by another {made_by} (fingerprint {_short(fingerprint)}...), "
            f"this server runs {model.name!r} ({_short(model.fingerprint)}...)")
    _check_kv_type(kind, layout, model.layout)
    if layout != model.layout or n_vocab != model.n_vocab:
        raise CorruptSlotFile(f"{kind} KV layout {layout} / vocabulary {n_vocab} does not "
                              f"match its model's {model.layout} / {model.n_vocab}")


def check_target(t: TargetFile, model: ModelSpec) -> None:
    """Raises unless the target file restores into a slot of this model and context."""
    _check_model("slot file", "model", t.fingerprint, t.layout, t.n_vocab, model)
    if t.window is not None and t.window.local != model.local_layers:
        raise CorruptSlotFile("slot file's sliding-window layers do not match its model's")
    if t.n_tokens > model.n_ctx:
        raise IncompatibleSlotFile(f"slot file holds {t.n_tokens} tokens (made with n_ctx "
                                   f"{t.n_ctx}), the context here is {model.n_ctx}")
    bad = next((x for x in t.tokens if not 0 <= x < model.n_vocab), None)
    if bad is not None:
        raise CorruptSlotFile(f"slot file holds token id {bad}, outside the vocabulary of "
                              f"{model.n_vocab}")


def check_draft(d: DraftFile, target_digest: str, target: TargetFile, draft: ModelSpec) -> None:
    """Raises unless the sidecar belongs to this target file and fits this draft model."""
    if d.target_digest != target_digest:
        raise IncompatibleSlotFile("draft sidecar belongs to another save of the target file")
    _check_model("draft sidecar", "draft model", d.fingerprint, d.layout, d.n_vocab, draft)
    if d.offset + d.n_tokens > target.n_tokens:
        raise CorruptSlotFile(f"draft sidecar holds {d.n_tokens} tokens from position "
                              f"{d.offset}, past the target's {target.n_tokens}")


# --------------------------------------------------------------------------------------
# conversion from and to the decoding core's state bytes


def _core_kv_head(view: memoryview, model: ModelSpec) -> tuple[int, Window | None]:
    """(n_tokens, window) of core slot state of this model's layout, its length checked:
    WSKV v2, or v3 when the sliding-window layers hold their last n_window positions
    only (window: those layers and n_window; None for v2)."""
    magic, version, n_layer, n_embd_k, n_embd_v, dtype, n, n_window = \
        _CORE_KV_HEAD.unpack_from(view)
    lay = model.layout
    if magic != CORE_KV_MAGIC or version not in (CORE_KV_VERSION_FULL, CORE_KV_VERSION):
        raise ValueError(f"core state magic 0x{magic:08x} version {version} is not "
                         f"WSKV v{CORE_KV_VERSION_FULL} or v{CORE_KV_VERSION}")
    if (n_layer, n_embd_k, n_embd_v, dtype) != (lay.n_layer, lay.kv_dim, lay.kv_dim, lay.dtype):
        raise ValueError(f"core state layout ({n_layer}, {n_embd_k}, {n_embd_v}, {dtype}) is not "
                         f"the model's {lay}")
    window = None
    if version == CORE_KV_VERSION:
        if not model.local_layers:
            raise ValueError("core state holds a window, its model has no sliding-window layers")
        window = Window(n_window, model.local_layers)
    if len(view) != _CORE_KV_HEAD.size + 4 * n + kv_bytes(lay, n, window):
        raise ValueError(f"core state of {len(view)} bytes does not hold {n} tokens of {lay}")
    return n, window


def target_from_core(state: bytes | memoryview, model: ModelSpec) -> TargetFile:
    """A target file from `Context.get_state(slot)` bytes (WSKV v2 or v3)."""
    view = memoryview(state).cast("B")
    n, window = _core_kv_head(view, model)
    start = _CORE_KV_HEAD.size
    tokens = struct.unpack_from(f"<{n}i", view, start)
    kv = view[start + 4 * n:]
    return TargetFile(model.fingerprint, model.layout, model.n_ctx, model.n_vocab, tokens, kv,
                      window=window)


def core_parts_from_target(t: TargetFile) -> tuple[bytes, bytes, bytes | memoryview]:
    """`Context.set_state_parts` pieces (WSKV v2 header, tokens, KV) of a target file of
    either version; the KV is the file's own bytes, not a copy."""
    lay = t.layout
    version, n_window = ((CORE_KV_VERSION_FULL, 0) if t.window is None
                         else (CORE_KV_VERSION, t.window.n_window))
    head = _CORE_KV_HEAD.pack(CORE_KV_MAGIC, version, lay.n_layer, lay.kv_dim,
                              lay.kv_dim, lay.dtype, t.n_tokens, n_window)
    return head, struct.pack(f"<{t.n_tokens}i", *t.tokens), t.kv


def _core_spec_version(state: bytes | memoryview) -> int:
    """The WSSP version of a core draft state (0: not one)."""
    if len(state) < _CORE_SPEC_HEAD.size:
        return 0
    magic, version = struct.unpack_from("<II", state)
    return version if magic == CORE_SPEC_MAGIC and 1 <= version <= CORE_SPEC_VERSION else 0


def _core_spec_fields(state: bytes | memoryview) -> tuple[int, int] | None:
    """(offset, n_tokens) of a WSSP draft state: the draft model's KV (version 1, or
    version 2 with that part), else the head's pairs (version 2 of a head alone, offset
    0); None for another format."""
    version = _core_spec_version(state)
    at = _CORE_SPEC_HEAD.size
    if version == 0:
        return None
    head = _CORE_SPEC_HEAD.unpack_from(state)
    if version == 2:
        if len(state) < at + CORE_SPEC_EXT.size:
            return None
        parts, _, draft_bytes, head_bytes, _, width = CORE_SPEC_EXT.unpack_from(state, at)
        at += CORE_SPEC_EXT.size
        if not parts & 1:
            if not parts & 2:
                return 0, 0
            at += 4 * width  # the head's h, then its KV state
            if len(state) < at + _CORE_KV_HEAD.size:
                return None
            return 0, _CORE_KV_HEAD.unpack_from(state, at)[6]
    if len(state) < at + _CORE_KV_HEAD.size:
        return None
    return head[2], _CORE_KV_HEAD.unpack_from(state, at)[6]


def _check_core_spec_counters(state: bytes | memoryview, kind: str) -> None:
    """Refuses counters of a WSSP v1 draft state that the core never writes: a value past
    MAX_COUNTER (the next step would overflow), per-position counts that do not add up to
    the totals, or more accepted than drafted at a position."""
    if _core_spec_fields(state) is None:
        return
    c = _CORE_SPEC_HEAD.unpack_from(state)[8:]
    names = ["n_steps", "n_drafted", "n_accepted", "n_draft_prefill"]
    names += [f"drafted_at[{i}]" for i in range(SPEC_MAX_DRAFT)]
    names += [f"accepted_at[{i}]" for i in range(SPEC_MAX_DRAFT)]
    for name, v in zip(names, c, strict=True):
        if v > MAX_COUNTER:
            raise CorruptSlotFile(f"{kind}: counter {name} = {v} is out of range "
                                  f"(at most {MAX_COUNTER})")
    n_drafted, n_accepted = c[1], c[2]
    drafted_at, accepted_at = c[4:4 + SPEC_MAX_DRAFT], c[4 + SPEC_MAX_DRAFT:]
    if sum(drafted_at) != n_drafted or sum(accepted_at) != n_accepted:
        raise CorruptSlotFile(f"{kind}: per-position counters add up to {sum(drafted_at)} drafted "
                              f"/ {sum(accepted_at)} accepted, the totals say {n_drafted} / "
                              f"{n_accepted}")
    bad = next((i for i in range(SPEC_MAX_DRAFT) if accepted_at[i] > drafted_at[i]), None)
    if bad is not None:
        raise CorruptSlotFile(f"{kind}: {accepted_at[bad]} tokens accepted at draft position "
                              f"{bad}, only {drafted_at[bad]} drafted there")


def draft_from_core(state: bytes | memoryview, target_digest: str,
                    model: ModelSpec) -> DraftFile:
    """A draft sidecar from `SpecDecoder.draft_state(slot)` bytes (WSSP)."""
    view = memoryview(state).cast("B")
    fields = _core_spec_fields(view)
    if fields is None:
        raise ValueError("draft state is not WSSP")
    return DraftFile(target_digest, model.fingerprint, model.layout, model.n_ctx, model.n_vocab,
                     fields[1], fields[0], view)
