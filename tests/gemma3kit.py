"""Gemma 3 270M Q4_K_M for the tests that need a real second architecture: where it is,
and llama.cpp's answers on it (tests/fixtures/gemma3_oracle.json, written by
tools/gemma3_oracle.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

GEMMA = "gemma-3-270m-q4_k_m.gguf"
ORACLE = Path(__file__).resolve().parent / "fixtures" / "gemma3_oracle.json"


def gemma_path() -> Path | None:
    env = os.environ.get("WARMSLOT_GEMMA3")
    if env:
        return Path(env)
    found = sorted((Path(__file__).resolve().parent.parent / "models").rglob(GEMMA))
    return found[0] if found else None


def oracle() -> dict[str, Any]:
    return json.loads(ORACLE.read_text())


needs_gemma3 = pytest.mark.skipif(gemma_path() is None or not gemma_path().is_file(),
                                  reason=f"{GEMMA} is not present (set WARMSLOT_GEMMA3)")
