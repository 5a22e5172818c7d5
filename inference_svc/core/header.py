"""The core's constants read from its header (native/warmslot.h), without the compiled core.

The header is the one definition of the numbers Python shares with C: KV cache types,
state magics, versions and header sizes, drafter ids, limits. This module reads its
integer `#define`s and enum members as text, so the layers above the binding (the
engine, the sessions, the slot-file format) import without the compiled module; the
binding checks, when it loads the core, that the build it loads has the same values
(a stale build refuses to import). Standard library only.
"""

from __future__ import annotations

import re
from pathlib import Path

HEADER = Path(__file__).resolve().parents[2] / "native" / "warmslot.h"

# `#define WS_NAME 123` / `0x1fu` (an integer, optionally unsigned, then a comment or end)
_DEFINE = re.compile(r"^#define\s+(WS_[A-Z0-9_]+)\s+(0x[0-9a-fA-F]+|\d+)u?\s*(?:/\*.*)?$")
# an enum member `WS_NAME = 123,` on its own line
_MEMBER = re.compile(r"^\s+(WS_[A-Z0-9_]+)\s*=\s*(-?\d+)\s*,")


def _read(path: Path) -> dict[str, int]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ImportError(f"the core's header {path} cannot be read ({exc}): it is the "
                          "definition of the constants the service shares with the core") from exc
    values: dict[str, int] = {}
    for line in text.splitlines():
        m = _DEFINE.match(line) or _MEMBER.match(line)
        if m is not None:
            values[m.group(1)] = int(m.group(2), 0)
    return values


CONSTANTS: dict[str, int] = _read(HEADER)


def const(name: str) -> int:
    """The value of the header's integer constant `name` (ImportError when absent: the
    header and this code disagree)."""
    try:
        return CONSTANTS[name]
    except KeyError:
        raise ImportError(f"{HEADER} defines no integer constant {name}") from None


def _kv_types() -> dict[str, int]:
    """ws_kv_type: name -> value in value order, the name as ws_kv_type_name gives it
    (the member's suffix in lower case: WS_KV_Q8_0 -> "q8_0")."""
    types = {name[len("WS_KV_"):].lower(): value for name, value in CONSTANTS.items()
             if name.startswith("WS_KV_") and name != "WS_KV_N_TYPES"}
    if sorted(types.values()) != list(range(const("WS_KV_N_TYPES"))):
        raise ImportError(f"{HEADER}: the ws_kv_type members are not 0..WS_KV_N_TYPES-1")
    return dict(sorted(types.items(), key=lambda kv: kv[1]))


# the KV cache types, name -> ws_kv_type value
KV_TYPES: dict[str, int] = _kv_types()
DEFAULT_KV_TYPE = "f16"
