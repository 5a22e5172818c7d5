"""Who may call what on the inference service. Keys of role `user` may generate,
chat, tokenize, detokenize, read the service's info and list and delete their own sessions
(inference_svc.sessions.host: a user key's sessions are its own); `admin` keys may call every method
(the slot operations as well: list, save, restore, erase). Methods not listed here,
now or added later, are admin-only until listed."""

from __future__ import annotations

from pathlib import Path

from snapshot_svc.clientlib import auth

SERVICE = "/warmslot.inference.v1.Inference/"
USER_METHODS = frozenset(SERVICE + m for m in ("Generate", "Chat", "Tokenize",
                                               "Detokenize", "GetInfo", "ListSessions",
                                               "DeleteSession"))
REFLECTION_PREFIX = "/grpc.reflection."
ROLES = (auth.USER, auth.ADMIN)


def allowed(method: str, principal: auth.Principal) -> bool:
    return (principal.is_admin or method in USER_METHODS
            or method.startswith(REFLECTION_PREFIX))


def key_ring(path: Path) -> auth.KeyRing:
    return auth.KeyRing(path, ROLES, namespaces=False)
