"""Snapshot name rules, the same as for slot files.

A name is 1-255 bytes of valid UTF-8 with no `/`, no `\\`, no control
character (Unicode category Cc: C0, DEL, C1), no `..` anywhere, no leading or
trailing space and no trailing dot. The service never uses a name as a path
(files are content-addressed), but a name must also be a valid file name for
the local store, where `<name>` and `<name>.drft` are files.
"""

from __future__ import annotations

import unicodedata

from snapshot_svc.clientlib.errors import InvalidArgument

MAX_NAME_BYTES = 255


def name_problem(name: str | bytes) -> str | None:
    """Why `name` is not a valid snapshot name, or None when it is."""
    if isinstance(name, bytes):
        raw = name
        try:
            name = raw.decode("utf-8", errors="strict")
        except UnicodeDecodeError:
            return "name is not valid UTF-8"
    else:
        try:
            raw = name.encode("utf-8", errors="strict")
        except UnicodeEncodeError:
            return "name is not valid UTF-8"
    if not raw:
        return "name is empty"
    if len(raw) > MAX_NAME_BYTES:
        return f"name is {len(raw)} bytes long, the limit is {MAX_NAME_BYTES}"
    for ch in name:
        if ch in "/\\":
            return f"name contains a path separator {ch!r}"
        if unicodedata.category(ch) == "Cc":
            return f"name contains the control character U+{ord(ch):04X}"
    if ".." in name:
        return "name contains '..'"
    if name[0] == " " or name[-1] == " ":
        return "name starts or ends with a space"
    if name[-1] == ".":
        return "name ends with a dot"
    return None


def validate_name(name: str | bytes) -> str:
    """Returns the name as str, or raises InvalidArgument saying what is wrong."""
    problem = name_problem(name)
    if problem is not None:
        raise InvalidArgument(f"bad snapshot name {name!r}: {problem}")
    return name.decode("utf-8") if isinstance(name, bytes) else name
