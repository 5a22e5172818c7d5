"""The lifetime of a C object owned by a Python object: `handle` (raises once
closed), `close()` (idempotent), context-manager use, and a last-resort close
when the owner is collected."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import numpy as np

from . import binding
from .errors import InvalidArgumentError


class NativeHandle:
    """Subclasses set `_handle` and implement `_free(handle)`; `_what` names them."""

    _what = "object"
    _handle: Any = None

    @property
    def closed(self) -> bool:
        return self._handle is None

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise InvalidArgumentError(f"the {self._what} is closed")
        return self._handle

    def _free(self, handle: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._free(handle)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self._handle is not None:
            self.close()


def buffer_arg(data: bytes | bytearray | memoryview) -> tuple[Any, int]:
    """A (pointer, length) pair for a C call reading `data` (NULL when empty)."""
    view = memoryview(data).cast("B")
    return (binding.ffi.from_buffer(view) if len(view) else binding.ffi.NULL), len(view)


def new_buffer(size: int) -> tuple[np.ndarray, Any]:
    """A fresh buffer of `size` bytes for the core to write into, and its pointer (NULL
    when empty). It is not zero-filled: the core's write is the only pass over it."""
    buf = np.empty(size, dtype=np.uint8)
    return buf, (binding.ffi.from_buffer(buf) if size else binding.ffi.NULL)


def written_view(buf: np.ndarray, n: int) -> memoryview:
    """A read-only view of the first n bytes the core wrote into `buf` (no copy)."""
    buf.flags.writeable = False
    return memoryview(buf)[:n]


def state_buffer(size: int, write: Callable[[Any], int]) -> memoryview:
    """Runs `write(pointer)` on a new_buffer of `size` bytes (it returns the bytes it
    wrote) and returns a read-only view of them."""
    buf, ptr = new_buffer(size)
    return written_view(buf, write(ptr))
