"""Domain types shared by the server, the store and the client.

Each converts to and from its protobuf message (`to_pb` / `from_pb`); the
store also writes `SnapshotInfo` as the JSON manifest of a name.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from snapshot_svc.pb import snapshot_pb2 as pb

SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class Part(enum.IntEnum):
    """The two parts of a snapshot (values are the protobuf enum's)."""

    TARGET = pb.PART_TARGET  # `<name>`
    DRAFT = pb.PART_DRAFT  # `<name>.drft`

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class PartMeta:
    """Metadata the client attaches to a part; the service only stores it."""

    format_version: int = 0
    fingerprint: str = ""
    n_tokens: int = 0


@dataclass(frozen=True)
class PartInfo:
    """One stored part: its size, digest and metadata."""

    part: Part
    size: int
    sha256: str
    meta: PartMeta = field(default_factory=PartMeta)
    target_sha256: str = ""  # DRAFT only: the target file it belongs to

    def to_pb(self) -> pb.PartInfo:
        return pb.PartInfo(part=int(self.part), size=self.size, sha256=self.sha256,
                           format_version=self.meta.format_version,
                           fingerprint=self.meta.fingerprint, n_tokens=self.meta.n_tokens,
                           target_sha256=self.target_sha256)

    @classmethod
    def from_pb(cls, m: pb.PartInfo) -> PartInfo:
        return cls(part=Part(m.part), size=m.size, sha256=m.sha256,
                   meta=PartMeta(m.format_version, m.fingerprint, m.n_tokens),
                   target_sha256=m.target_sha256)

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256,
                "format_version": self.meta.format_version,
                "fingerprint": self.meta.fingerprint, "n_tokens": self.meta.n_tokens,
                "target_sha256": self.target_sha256}

    @classmethod
    def from_json(cls, part: Part, d: dict[str, Any]) -> PartInfo:
        info = cls(part=part, size=int(d["size"]), sha256=str(d["sha256"]),
                   meta=PartMeta(int(d.get("format_version", 0)), str(d.get("fingerprint", "")),
                                 int(d.get("n_tokens", 0))),
                   target_sha256=str(d.get("target_sha256", "")))
        if info.size < 0 or not SHA256_HEX.fullmatch(info.sha256):
            raise ValueError(f"bad {part.label} record {d!r}")
        return info


@dataclass(frozen=True)
class SnapshotInfo:
    """A committed snapshot: the target, the optional draft, and the commit.

    `generation` counts the commits of the name: 1 for the first, +1 for each one after
    (a manifest written before generations existed reads as 1). From a server without
    the "conditional-put" feature it is 0 (not reported)."""

    name: str
    commit_id: str
    created_unix_ms: int
    target: PartInfo
    draft: PartInfo | None = None
    generation: int = 1

    def part(self, part: Part) -> PartInfo | None:
        return self.target if part is Part.TARGET else self.draft

    def without_draft(self) -> SnapshotInfo:
        return SnapshotInfo(self.name, self.commit_id, self.created_unix_ms, self.target,
                            generation=self.generation)

    @property
    def total_bytes(self) -> int:
        return self.target.size + (self.draft.size if self.draft else 0)

    def to_pb(self) -> pb.SnapshotInfo:
        m = pb.SnapshotInfo(name=self.name, commit_id=self.commit_id,
                            created_unix_ms=self.created_unix_ms, target=self.target.to_pb(),
                            generation=self.generation)
        if self.draft is not None:
            m.draft.CopyFrom(self.draft.to_pb())
        return m

    @classmethod
    def from_pb(cls, m: pb.SnapshotInfo) -> SnapshotInfo:
        return cls(name=m.name, commit_id=m.commit_id, created_unix_ms=m.created_unix_ms,
                   target=PartInfo.from_pb(m.target),
                   draft=PartInfo.from_pb(m.draft) if m.HasField("draft") else None,
                   generation=m.generation)

    def to_json(self) -> dict[str, Any]:
        return {"manifest_version": 1, "name": self.name, "commit_id": self.commit_id,
                "created_unix_ms": self.created_unix_ms, "target": self.target.to_json(),
                "draft": self.draft.to_json() if self.draft else None,
                "generation": self.generation}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SnapshotInfo:
        if d.get("manifest_version") != 1:
            raise ValueError(f"unknown manifest version {d.get('manifest_version')!r}")
        draft = d.get("draft")
        return cls(name=str(d["name"]), commit_id=str(d["commit_id"]),
                   created_unix_ms=int(d["created_unix_ms"]),
                   target=PartInfo.from_json(Part.TARGET, d["target"]),
                   draft=PartInfo.from_json(Part.DRAFT, draft) if draft else None,
                   generation=_generation(d))


def _generation(d: dict[str, Any]) -> int:
    """The generation of a JSON manifest; 1 for one written before generations."""
    g = d.get("generation", 1)
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ValueError(f"bad generation {g!r}")
    return g


@dataclass(frozen=True)
class ServerInfo:
    """What `Hello` negotiated with a server."""

    protocol: int
    features: tuple[str, ...] = ()
    server_version: str = ""
    max_chunk_bytes: int = 0
    max_snapshot_bytes: int = 0
    hello_supported: bool = True  # False: Hello was UNIMPLEMENTED (a protocol-1 server)


@dataclass(frozen=True)
class PutResult:
    """The outcome of `SnapshotClient.put`."""

    name: str
    commit_id: str
    protocol: int
    target: PartInfo
    draft: PartInfo | None  # None: no draft stored by this save
    draft_skipped: bool = False  # a draft was given but not sent (protocol 1)
    note: str = ""  # why the draft was skipped
    generation: int = 0  # the snapshot's new generation; 0: the server does not report it


@dataclass(frozen=True)
class Snapshot:
    """The outcome of `SnapshotClient.get`: the exact bytes of both parts, as read-only
    memoryviews of the buffers they were received into (a view compares equal to
    bytes with the same content; `bytes(view)` makes a copy)."""

    name: str
    target: memoryview
    draft: memoryview | None  # None: no usable draft (see draft_note)
    info: SnapshotInfo  # describes what was returned (info.draft is None iff draft is None)
    protocol: int
    draft_note: str = ""  # why draft is None: "protocol 1", "no draft stored", ...
    # hex SHA-256 of the target without its last `digest_tail` bytes (get's argument)
    target_prefix_sha256: str = ""
