"""A model's fingerprint: SHA-256 over its hyper-parameters and stored tensors, computed
without dequantizing anything and cached by file identity, so a second load of the same
file does not hash it again.

Two schemes. A model whose every tensor is F32 or F16 keeps the first scheme (the F32
bytes of every tensor; F16 widens exactly and cheaply), so slot files saved before
typed weights existed still match their model. Any other model hashes each tensor's
stored bytes with its type name.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .gguf_file import HParams, Tensor

# bumped when either scheme changes: cached values of another version are ignored
CACHE_VERSION = "1"
_LEGACY_TYPES = ("F32", "F16")


def cache_dir() -> Path:
    """WARMSLOT_CACHE_DIR, else $XDG_CACHE_HOME/warmslot, else ~/.cache/warmslot."""
    env = os.environ.get("WARMSLOT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "warmslot"


def compute(hp: HParams, tensors: Mapping[str, Tensor]) -> str:
    h = hashlib.sha256()
    legacy = all(t.type_name in _LEGACY_TYPES for t in tensors.values())
    h.update(b"warmslot-model-v1\0" if legacy else b"warmslot-model-v2\0")
    h.update(json.dumps(hp.identity(), sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode() + b"\0")
        if not legacy:
            h.update(t.type_name.encode() + b"\0")
        h.update(json.dumps(list(t.shape)).encode() + b"\0")
        if t.type_name == "F16":
            h.update(t.data.view(np.float16).astype(np.float32).tobytes())
        else:
            h.update(t.data)
    return h.hexdigest()


def _cache_key(path: Path) -> str:
    st = path.stat()
    ident = f"{CACHE_VERSION}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    return hashlib.sha256(ident.encode()).hexdigest()


def model_fingerprint(path: Path, hp: HParams, tensors: Mapping[str, Tensor],
                      directory: Path | None = None) -> str:
    """The cached fingerprint of the file at path (same path, size, mtime and inode),
    else computed and cached. A cache that cannot be read or written is skipped."""
    entry = (directory or cache_dir()) / "fingerprints" / _cache_key(path)
    try:
        cached = entry.read_text().strip()
        if len(cached) == 64 and all(c in "0123456789abcdef" for c in cached):
            return cached
    except OSError:
        pass
    value = compute(hp, tensors)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
        tmp.write_text(value + "\n")
        os.replace(tmp, entry)
    except OSError:
        pass
    return value
