"""Generations and conditional Puts as the client library uses them: the Hello feature
that announces them, and the check before a conditional Put is sent."""

from __future__ import annotations

from collections.abc import Sequence

from snapshot_svc.clientlib.errors import FailedPrecondition, GenerationConflict, InvalidArgument

# Hello feature: every snapshot carries a generation and a Put may expect one
CONDITIONAL_PUT = "conditional-put"


def conditional_header(name: str, expected: int | None, features: Sequence[str],
                       server: str) -> dict[str, int] | None:
    """The PutHeader field of a Put that expects generation `expected` (None: an
    unconditional Put, no field). A server without the feature would ignore the field
    and write unconditionally, so such a Put is refused here (FailedPrecondition)."""
    if expected is None:
        return None
    if expected < 0:
        raise InvalidArgument(f"expected generation of {name!r} must be >= 0, got {expected}")
    if CONDITIONAL_PUT not in features:
        raise FailedPrecondition(
            f"conditional Put of {name!r} (expected generation {expected}): the snapshot "
            f"service at {server} has no conditional writes (no {CONDITIONAL_PUT!r} "
            "feature: an older server, or a store that ignores them); nothing was sent")
    return {"expected_generation": expected}


def is_own_commit(conflict: GenerationConflict, stored: tuple[int, str, str],
                  sent: tuple[str, str]) -> bool:
    """Whether a conflicting Put in fact committed: the stored snapshot, one generation
    past the expected one, holds exactly its bytes. `stored`: (generation, target
    SHA-256, draft SHA-256 or ""); `sent`: (target SHA-256, draft SHA-256 or "").

    That is the answer a retried conditional Put gets when its first attempt committed
    and the answer was lost (UNAVAILABLE): the retry finds its own commit. Another
    writer that stored the same bytes over the same generation leaves the same state,
    so either way the Put's state is the stored one, at `stored[0]`."""
    return (conflict.stored == conflict.expected + 1
            and stored == (conflict.stored, *sent))
