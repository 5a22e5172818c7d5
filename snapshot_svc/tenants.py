"""Namespaces of the snapshot service's API keys. A key bound to namespace `ns` names
its snapshots as usual, and they are stored as `ns:<name>`: it can neither see nor
reach a name outside its namespace (such a name is simply absent, NOT_FOUND). An
`admin` key, or any caller when no keys are configured, uses stored names as they are
(`ns:<name>` included)."""

from __future__ import annotations

from snapshot_svc.client.names import MAX_NAME_BYTES, name_problem
from snapshot_svc.clientlib.auth import Principal
from snapshot_svc.errors import InvalidArgument

SEP = ":"


def _namespace(principal: Principal | None) -> str | None:
    return None if principal is None or principal.is_admin else principal.namespace


def stored_name(principal: Principal | None, name: str) -> str:
    """The stored name of a caller's name. Raises InvalidArgument for a bad name."""
    ns = _namespace(principal)
    if ns is None:
        return name
    problem = name_problem(name)
    if problem is not None:
        raise InvalidArgument(problem)
    limit = MAX_NAME_BYTES - len(ns) - len(SEP)
    if len(name.encode()) > limit:
        raise InvalidArgument(f"name is {len(name.encode())} bytes long, the limit is {limit}")
    return f"{ns}{SEP}{name}"


def caller_name(principal: Principal | None, stored: str) -> str | None:
    """The name a caller sees for a stored name; None when it is not the caller's."""
    ns = _namespace(principal)
    if ns is None:
        return stored
    prefix = ns + SEP
    return stored[len(prefix):] if stored.startswith(prefix) else None


def stored_prefix(principal: Principal | None, prefix: str) -> str:
    """The stored-name prefix of a List's prefix."""
    ns = _namespace(principal)
    return prefix if ns is None else f"{ns}{SEP}{prefix}"
