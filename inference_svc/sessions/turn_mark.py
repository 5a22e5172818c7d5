"""A session's last turn as its caller named it (GenerateRequest.turn_id): the id and
what the session held before that turn, so that the same request sent again (its
stream was cut: a replica killed behind a router) replaces the turn instead of adding
it twice. Kept with the session's state in the optional target section `TURN` of its
slot file, so it moves between tiers and replicas with the state (docs/formats.md);
a reader that does not know the section skips it."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from inference_svc.errors import InvalidArgument
from inference_svc.storage.slotfile import CorruptSlotFile, Section, optional_section

# target, optional: ASCII JSON {"id": str, "start": int, "chat": int, "prompt": str}
TAG_TURN = b"TURN"
MAX_TURN_ID = 64
_TURN_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_TURN_ID}}}")


@dataclass(frozen=True)
class TurnMark:
    """Turn `id` started from the session's first `start` tokens and the first `chat`
    messages of its conversation; `prompt`: its prompt's digest (prompt_digest), so that
    the id sent again with another prompt is refused rather than replacing the turn."""

    id: str
    start: int
    chat: int
    prompt: str = ""


def prompt_digest(tokens: Sequence[int]) -> str:
    """A turn's prompt tokens as 32 hex digits (SHA-256, int32 little-endian)."""
    return hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest()[:32]


def check_turn_id(turn_id: str) -> str:
    """The id as given; InvalidArgument naming the rule when it breaks it."""
    if not _TURN_ID.fullmatch(turn_id):
        raise InvalidArgument(f"turn_id {turn_id[:80]!r} must be 1..{MAX_TURN_ID} characters "
                              "of A-Z a-z 0-9 . _ : -")
    return turn_id


def pack(mark: TurnMark) -> Section:
    """The section holding a turn mark."""
    payload = json.dumps({"id": mark.id, "start": mark.start, "chat": mark.chat,
                          "prompt": mark.prompt}, separators=(",", ":")).encode("ascii")
    return Section(TAG_TURN, 0, payload)


def unpack(extra: Sequence[Section]) -> TurnMark | None:
    """The turn mark among a target file's optional sections; None when it has none.
    Keys it does not know are skipped (a later writer's); CorruptSlotFile (DATA_LOSS) for
    a section that is not a mark."""
    section = optional_section(extra, TAG_TURN)
    if section is None:
        return None
    try:
        row = json.loads(section.payload.decode("ascii"))
        if not isinstance(row, dict) or not {"id", "start", "chat"} <= set(row):
            raise ValueError(f"{row!r} is not {{id, start, chat, ...}}")
        mark = TurnMark(row["id"], row["start"], row["chat"], row.get("prompt", ""))
        if (not isinstance(mark.id, str) or not _TURN_ID.fullmatch(mark.id)
                or type(mark.start) is not int or type(mark.chat) is not int
                or mark.start < 0 or mark.chat < 0 or not isinstance(mark.prompt, str)):
            raise ValueError(f"{row!r} has a bad field")
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptSlotFile(f"slot file: the TURN section is not a turn mark: {exc}") from exc
    return mark
