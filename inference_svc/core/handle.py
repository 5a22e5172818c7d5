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


Room = Callable[[int], memoryview]  # size -> a writable view of that many bytes


def new_room(size: int) -> memoryview:
    """A Room: a writable view of a new buffer (not zero-filled)."""
    return memoryview(np.empty(size, dtype=np.uint8))


def room_arg(view: memoryview | None, size: int) -> tuple[Any, int]:
    """A (pointer, capacity) pair for a C call writing at most `size` bytes into `view`
    (NULL, 0 for None or an empty view); a view shorter than `size` is refused."""
    if view is None or size == 0:
        return binding.ffi.NULL, 0
    if view.readonly or view.nbytes < size or not view.c_contiguous:
        raise InvalidArgumentError(f"a room for {size} bytes of state is "
                                   f"{view.nbytes} bytes, read-only or not contiguous")
    return binding.ffi.from_buffer(view, require_writable=True), size


def read_tokens(read: Callable[[Any, int, Any, int], int], handle: Any, slot: int,
                n: int) -> list[int]:
    """The first n tokens of a slot, read by `read(handle, slot, out, cap)` (it returns
    how many it wrote)."""
    buf = np.empty(max(n, 1), dtype=np.int32)
    return buf[:read(handle, slot, binding.ffi.from_buffer("int32_t[]", buf), n)].tolist()


def state_buffer(size: int, write: Callable[[Any], int]) -> memoryview:
    """Runs `write(pointer)` on a new room of `size` bytes (it returns the bytes it
    wrote) and returns a read-only view of them."""
    view = new_room(size)
    return view[:write(room_arg(view, size)[0])].toreadonly()
