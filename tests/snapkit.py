"""Test data for the snapshot service tests: digests and deterministic blobs."""

from __future__ import annotations

import hashlib


def sha(data: bytes) -> str:
    """Lowercase hex SHA-256, as the protocol spells digests."""
    return hashlib.sha256(data).hexdigest()


def blob(seed: int, size: int) -> bytes:
    """Deterministic pseudo-random bytes (distinct per seed)."""
    out = bytearray()
    block = hashlib.sha256(seed.to_bytes(8, "little")).digest()
    while len(out) < size:
        block = hashlib.sha256(block).digest()
        out += block * 64
    return bytes(out[:size])
