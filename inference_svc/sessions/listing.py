"""Which sessions a slot store holds, and the rows ListSessions returns.

The store's own `list` gives the names and token counts (SlotStore protocol).
"""

from __future__ import annotations

from dataclasses import dataclass

from inference_svc.pb import inference_pb2 as pb
from inference_svc.sessions.names import SESSION_PREFIX, SessionKey, from_store_name
from inference_svc.storage.store import SlotStore

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
    """The sessions a store holds under names starting with `prefix` (names that are not
    sessions', and files that are not slot files, left out)."""
    rows: list[SessionRow] = []
    for info in store.list(prefix):
        key = from_store_name(info.name)
        if key is not None and info.n_tokens >= 0:
            rows.append(SessionRow(key, info.n_tokens, TIER_STORE, info.modified_unix_ms))
    return rows
