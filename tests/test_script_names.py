"""A script run as `python bench/x.py` has its folder first on sys.path: a neighbour
named like a standard-library module (bench/http.py once) replaces that module for
every script there and for everything they import."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_script_folder_shadows_the_standard_library() -> None:
    shadowing = sorted(str(p.relative_to(ROOT)) for folder in ("bench", "tools")
                       for p in (ROOT / folder).glob("*.py")
                       if p.stem in sys.stdlib_module_names)
    assert shadowing == []
