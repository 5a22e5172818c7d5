"""Slot file name rules: the snapshot service's name rules (one definition, in
snapshot_svc.client.names), raised as this service's InvalidArgument.

A name is 1-255 bytes of valid UTF-8 with no `/`, no `\\`, no control
character (Unicode category Cc: C0, DEL, C1), no `..` anywhere, no leading or
trailing space and no trailing dot.
"""

from __future__ import annotations

from inference_svc.errors import InvalidArgument
from snapshot_svc.client.names import MAX_NAME_BYTES, name_problem

__all__ = ["DRAFT_SUFFIX", "MAX_NAME_BYTES", "name_problem", "validate_name"]

DRAFT_SUFFIX = ".drft"


def validate_name(name: str) -> str:
    """Returns the name, or raises InvalidArgument saying what is wrong with it."""
    problem = name_problem(name)
    if problem is not None:
        raise InvalidArgument(f"bad slot file name {name!r}: {problem}")
    return name
