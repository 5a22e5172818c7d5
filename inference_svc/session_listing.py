"""Which sessions a slot store holds, and the rows ListSessions returns.

The SlotStore interface has no listing: a local directory is read (each target file's
fixed header gives its token count), a snapshot service (or a fail-over set of them)
is asked for its List.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from inference_svc import slotfile
from inference_svc.pb import inference_pb2 as pb
from inference_svc.session_names import SESSION_PREFIX, SessionKey, from_store_name
from inference_svc.store import LocalStore, SlotStore

TIER_NEW, TIER_SLOT, TIER_RAM, TIER_STORE = (pb.SESSION_TIER_NEW, pb.SESSION_TIER_SLOT,
                                            pb.SESSION_TIER_RAM, pb.SESSION_TIER_STORE)
TIER_LABEL = {TIER_NEW: "new", TIER_SLOT: "slot", TIER_RAM: "ram", TIER_STORE: "store"}


@dataclass(frozen=True)
class SessionRow:
    key: SessionKey
    n_tokens: int
    tier: int
    last_used_ms: int
    id_slot: int = -1
    busy: bool = False

    def to_pb(self) -> pb.SessionInfo:
        return pb.SessionInfo(name=self.key.name, n_tokens=self.n_tokens, tier=self.tier,
                              last_used_unix_ms=self.last_used_ms, id_slot=self.id_slot,
                              busy=self.busy, owner=self.key.owner)


def list_stored(store: SlotStore, prefix: str = SESSION_PREFIX) -> list[SessionRow]:
    """The sessions a store holds under names starting with `prefix`. The SlotStore
    interface has no listing: the local directory is read, a snapshot service (or a
    fail-over set of them) asked for its List."""
    rows: list[SessionRow] = []
    for name, n_tokens, ms in _stored_names(store, prefix):
        key = from_store_name(name)
        if key is not None:
            rows.append(SessionRow(key, n_tokens, TIER_STORE, ms))
    return rows


def _stored_names(store: object, prefix: str) -> list[tuple[str, int, int]]:
    if isinstance(store, LocalStore):
        return _local_names(store.dir, prefix)
    failover = getattr(store, "_failover", None)
    if failover is not None:  # FailoverStore: the first replica that answers
        return failover("list", lambda s: _stored_names(s, prefix))
    current = getattr(store, "_current", None)
    if current is not None:  # SnapshotStore
        return [(i.name, i.target.meta.n_tokens, i.created_unix_ms)
                for i in current().list(prefix)]
    return []


def _local_names(directory: Path, prefix: str) -> list[tuple[str, int, int]]:
    out = []
    for p in directory.glob(f"{glob_escape(prefix)}*"):
        if p.name.endswith(".drft") or not p.is_file():
            continue
        try:
            with open(p, "rb") as f:
                head = f.read(4096)
            n = slotfile.read_meta(head).n_tokens
            ms = int(p.stat().st_mtime * 1000)
        except (OSError, slotfile.SlotFileError):
            continue
        out.append((p.name, n, ms))
    return out


def glob_escape(s: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in s)
