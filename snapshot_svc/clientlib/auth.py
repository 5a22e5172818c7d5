"""API keys: the key file both services read, and who a call's key is.

The file has one key per line, then its scope, separated by white space; blank lines
and lines starting with `#` are ignored:

    # inference service          # snapshot service
    k3Yf0r4lic3...  user         r1-key...  namespace=replica-1
    4dm1nK3y...     admin        adminkey... admin

A client sends `authorization: Bearer <key>`. Keys are at least 16 characters without
white space; they are compared in constant time (every key, digests of equal length)
and never logged: logs name a key by `key_id`, the first 8 hex digits of its SHA-256.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
from collections.abc import Callable, Collection, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from snapshot_svc.clientlib.errors import PermissionDenied, Unauthenticated
from snapshot_svc.clientlib.jsonlog import log_event

MIN_KEY_CHARS = 16
ADMIN = "admin"
USER = "user"
NAMESPACE = "namespace="
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class Principal:
    """Who a call's key is: its role (`admin`, `user`, or `namespace` for a snapshot
    key bound to one namespace) and that namespace."""

    role: str
    namespace: str | None
    key_id: str

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN


# the caller of the call being served (set by the interceptor before the handler runs;
# gRPC runs a call's handler, its response stream included, on one thread)
CURRENT: ContextVar[Principal | None] = ContextVar("principal", default=None)


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def parse_keys(lines: Iterable[str], roles: Collection[str],
               namespaces: bool) -> list[tuple[bytes, Principal]]:
    """(SHA-256 of the key, principal) per key line. Raises ValueError naming the line
    (never the key)."""
    out: list[tuple[bytes, Principal]] = []
    seen: set[bytes] = set()
    for n, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) != 2:
            raise ValueError(f"line {n}: expected '<key> <scope>', got {len(words)} fields")
        key, scope = words
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"line {n}: the key is shorter than {MIN_KEY_CHARS} characters")
        digest = hashlib.sha256(key.encode()).digest()
        if digest in seen:
            raise ValueError(f"line {n}: the key of an earlier line again")
        seen.add(digest)
        if namespaces and scope.startswith(NAMESPACE):
            ns = scope[len(NAMESPACE):]
            if not _NAMESPACE_RE.fullmatch(ns):
                raise ValueError(f"line {n}: namespace {ns!r} must be 1-64 letters, digits, "
                                 "'_', '-' or '.'")
            out.append((digest, Principal("namespace", ns, key_id(key))))
        elif scope in roles:
            out.append((digest, Principal(scope, None, key_id(key))))
        else:
            allowed = sorted(roles) + ([NAMESPACE + "NAME"] if namespaces else [])
            raise ValueError(f"line {n}: scope {scope!r} is not one of {', '.join(allowed)}")
    return out


class KeyRing:
    """The keys of a key file; `reload()` (on SIGHUP) rereads it, keeping the old keys
    when the new file is wrong."""

    def __init__(self, path: Path, roles: Collection[str], namespaces: bool) -> None:
        self.path = path
        self._roles = roles
        self._namespaces = namespaces
        self._lock = threading.Lock()
        self._keys = self._read()

    def _read(self) -> list[tuple[bytes, Principal]]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the key file {self.path}: {exc}") from exc
        try:
            keys = parse_keys(text.splitlines(), self._roles, self._namespaces)
        except ValueError as exc:
            raise ValueError(f"key file {self.path}: {exc}") from exc
        if not keys:
            raise ValueError(f"key file {self.path} holds no key")
        return keys

    def reload(self) -> int:
        """Rereads the file; the number of keys. Raises ValueError (keys unchanged)."""
        keys = self._read()
        with self._lock:
            self._keys = keys
        return len(keys)

    def reload_logged(self, logger: logging.Logger) -> None:
        """reload() on SIGHUP: logs the outcome; a wrong file keeps the old keys."""
        try:
            n = self.reload()
        except ValueError as exc:
            log_event(logger, logging.ERROR, "api_keys_not_reloaded", error=str(exc))
            return
        log_event(logger, logging.INFO, "api_keys_reloaded", keys=n)

    def __len__(self) -> int:
        return len(self._keys)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Principal:
        """The principal of the `authorization: Bearer <key>` metadata. Raises
        Unauthenticated when it is missing or the key is unknown."""
        header = next((v for k, v in metadata if k == "authorization"), None)
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        if header is None or not header.startswith("Bearer "):
            raise Unauthenticated("this service needs an API key: send the metadata "
                                  "'authorization: Bearer <key>'")
        digest = hashlib.sha256(header[len("Bearer "):].strip().encode()).digest()
        found: Principal | None = None
        for stored, principal in self._keys:  # every key: the time does not say which
            if hmac.compare_digest(stored, digest):
                found = principal
        if found is None:
            raise Unauthenticated("unknown API key")
        return found


def bearer(key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries a key (none without a key)."""
    return (("authorization", f"Bearer {key}"),) if key else ()


def gate(ring: KeyRing, allowed: Callable[[str, Principal], bool]
         ) -> Callable[[str, grpc.ServicerContext], Principal]:
    """The interceptor's gate for a key ring: the caller of a call to `method` (its full
    name, /package.Service/Method) when its key has the right; raises Unauthenticated
    (no or unknown key) or PermissionDenied."""

    def check(method: str, context: grpc.ServicerContext) -> Principal:
        principal = ring.authenticate(context.invocation_metadata())
        if not allowed(method, principal):
            raise PermissionDenied(f"this API key ({principal.role}) may not call "
                                   f"{method.rsplit('/', 1)[-1]}")
        return principal

    return check


class _Call(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <key>` to every call of a channel."""

    def __init__(self, key: str) -> None:
        self._metadata = bearer(key)

    def _details(self, d: Any) -> _Call:
        return _Call(d.method, d.timeout, [*(d.metadata or ()), *self._metadata],
                     d.credentials, getattr(d, "wait_for_ready", None),
                     getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def read_key_file(path: Path) -> str:
    """A client's key: the first word of a file (so it is not on a command line)."""
    try:
        words = path.read_text(encoding="utf-8").split()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the key file {path}: {exc}") from exc
    if not words:
        raise ValueError(f"key file {path} is empty")
    return words[0]
