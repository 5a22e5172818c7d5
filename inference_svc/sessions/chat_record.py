"""A session's conversation (the messages and replies of its Chats) in its slot file:
the optional target section `CHAT`, so the conversation is saved, moved between tiers
and replicas and restored with the session's tokens. A reader that does not know the
section skips it (and keeps the tokens); see docs/formats.md."""

from __future__ import annotations

import json
from collections.abc import Sequence

from inference_svc.chat import Message
from inference_svc.storage.slotfile import CorruptSlotFile, Section, optional_section

TAG_CHAT = b"CHAT"  # target, optional: UTF-8 JSON [[role, content], ...]


def pack(messages: Sequence[Message]) -> Section:
    """The section holding a conversation."""
    payload = json.dumps([[m.role, m.content] for m in messages], ensure_ascii=False,
                         separators=(",", ":")).encode("utf-8", "surrogatepass")
    return Section(TAG_CHAT, 0, payload)


def unpack(extra: Sequence[Section]) -> tuple[Message, ...] | None:
    """The conversation among a target file's optional sections; None when it has
    none. CorruptSlotFile (DATA_LOSS) for a section that is not one."""
    section = optional_section(extra, TAG_CHAT)
    if section is None:
        return None
    try:
        rows = json.loads(section.payload.decode("utf-8", "surrogatepass"))
        if not isinstance(rows, list):
            raise ValueError("not a list")
        out = []
        for row in rows:
            if (not isinstance(row, list) or len(row) != 2
                    or not all(isinstance(x, str) for x in row)):
                raise ValueError(f"a message is {row!r}, not [role, content]")
            out.append(Message(row[0], row[1]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptSlotFile(f"slot file: the CHAT section is not a conversation: "
                              f"{exc}") from exc
    return tuple(out)


def others(extra: Sequence[Section]) -> tuple[Section, ...]:
    """The optional sections but the conversation."""
    return tuple(s for s in extra if s.tag != TAG_CHAT)
