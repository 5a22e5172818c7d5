"""Session names and where a session lives in the slot store.

A session name follows the slot file name rules (inference_svc.storage.names). In the store
(local directory or snapshot service) a session is kept under
`session~<owner>~<name>`: `<owner>` is empty for callers without a key and for admin
keys, and the key id (first 8 hex digits of the key's SHA-256) for a `user` key, so
one key's sessions are invisible to another. Slot files may not start with
`session~` (SaveSlot and RestoreSlot refuse such names), so a session never collides
with a slot file or an auto-save (`auto-<instance>-slot<N>`).
"""

from __future__ import annotations

from dataclasses import dataclass

from inference_svc.errors import InvalidArgument
from inference_svc.storage.names import DRAFT_SUFFIX, name_problem

SESSION_PREFIX = "session~"
# the header (gRPC metadata) naming a request's session: a router in front of replicas
# hashes it to keep a session on one replica; the HTTP door also takes the session from it
SESSION_HEADER = "x-session-id"
# initial metadata of a Generate / Chat stream from a server that keeps turn ids
# (GenerateRequest.turn_id): a session turn cut mid-stream may be sent again
TURN_IDS_HEADER = "warmslot-turn-ids"
_OWNER_CHARS = 8  # auth.key_id: 8 hex digits
# the longest store name (owner included) must leave room for `<name>.drft` in a directory
MAX_SESSION_NAME_BYTES = 255 - len(DRAFT_SUFFIX) - len(SESSION_PREFIX) - _OWNER_CHARS - 1


@dataclass(frozen=True, order=True)
class SessionKey:
    """A session: its owner ("" or a key id) and its name."""

    owner: str
    name: str

    @property
    def store_name(self) -> str:
        return f"{SESSION_PREFIX}{self.owner}~{self.name}"


def check_session_name(name: str) -> str:
    """The name, or InvalidArgument saying what is wrong with it."""
    problem = name_problem(name)
    if problem is None and len(name.encode()) > MAX_SESSION_NAME_BYTES:
        problem = f"longer than {MAX_SESSION_NAME_BYTES} bytes"
    if problem is not None:
        raise InvalidArgument(f"bad session name {name!r}: {problem}")
    return name


def from_store_name(stored: str) -> SessionKey | None:
    """The session a store name holds; None when it is not a session's."""
    if not stored.startswith(SESSION_PREFIX) or stored.endswith(DRAFT_SUFFIX):
        return None
    owner, sep, name = stored[len(SESSION_PREFIX):].partition("~")
    if not sep or not name or (owner and len(owner) != _OWNER_CHARS):
        return None
    return SessionKey(owner, name)


def refuse_session_namespace(filename: str) -> None:
    """Slot files may not use the sessions' part of the store's name space."""
    if filename.startswith(SESSION_PREFIX):
        raise InvalidArgument(f"bad slot file name {filename!r}: names starting with "
                              f"{SESSION_PREFIX!r} are sessions' (DeleteSession, ListSessions)")
