"""A GGUF header parser over a memory map: the metadata as Python values and the tensor
table (name, shape, type id, absolute data offset). The `gguf` package's reader builds
an object per array element and takes seconds on a real tokenizer's 100k strings; this
reads them with one struct call each. Every malformed input raises ValueError."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: the row length first
    type: int
    offset: int            # absolute offset of the data in the file


@dataclass(frozen=True)
class Header:
    fields: dict[str, Any]
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"file ends inside the header (offset {self.pos})")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"string of {n} bytes runs past the end (offset {self.pos})")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype in _NUMPY:
                size = np.dtype(_NUMPY[etype]).itemsize * count
                if self.pos + size > len(self.buf):
                    raise ValueError(f"array of {count} runs past the end (offset {self.pos})")
                arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
                self.pos += size
                return arr.astype(bool).tolist() if etype == 7 else arr.tolist()
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            raise ValueError(f"unknown array element type {etype}")
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        raise ValueError(f"unknown metadata value type {vtype}")


def _start(buf: Any) -> tuple[_Cursor, int, int]:
    """A cursor past the fixed part of the header; the tensor and metadata counts."""
    cur = _Cursor(buf)
    if bytes(buf[:4]) != MAGIC:
        raise ValueError("no GGUF magic")
    cur.pos = len(MAGIC)
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    return cur, cur.take("<Q"), cur.take("<Q")


def peek_field(buf: Any, key: str) -> Any:
    """One metadata value, reading the header only up to it (writers put
    general.architecture first, before the vocabulary); None when there is no such key."""
    cur, _, n_kv = _start(buf)
    for _ in range(n_kv):
        k = cur.string()
        v = cur.value(cur.take("<I"))
        if k == key:
            return v
    return None


def parse(buf: Any) -> Header:
    """The header of the GGUF file whose bytes are buf (bytes, mmap...)."""
    cur, n_tensors, n_kv = _start(buf)
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        fields[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("<I")
        if n_dims > 4:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(cur.take("<Q") for _ in range(n_dims))
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    align = int(fields.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"alignment {align} is not a power of two")
    start = (cur.pos + align - 1) // align * align
    tensors = [TensorInfo(name, dims, ttype, start + off) for name, dims, ttype, off in infos]
    return Header(fields, tensors)
