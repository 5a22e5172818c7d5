"""Typed exceptions for the decoding core; one per C status code."""

from __future__ import annotations


class CoreError(Exception):
    """Base class of every error raised by the decoding core or its loaders."""


class InvalidArgumentError(CoreError, ValueError):
    """WS_ERR_INVALID_ARGUMENT: a parameter is out of range."""


class CoreMemoryError(CoreError, MemoryError):
    """WS_ERR_OUT_OF_MEMORY: an allocation failed or would not fit in memory."""


class BufferTooSmallError(CoreError, ValueError):
    """WS_ERR_BUFFER_TOO_SMALL: a caller buffer is smaller than needed."""


class ContextFullError(CoreError, ValueError):
    """WS_ERR_CONTEXT_FULL: the slot has no room for the tokens."""


class BadStateError(CoreError, ValueError):
    """WS_ERR_BAD_STATE: a state buffer is truncated, corrupt or does not match."""


class ThreadError(CoreError, RuntimeError):
    """WS_ERR_THREAD: a worker thread could not be started."""


class ModelLoadError(CoreError):
    """A model file is missing, unreadable, not GGUF, or uses something unsupported."""


STATUS_ERRORS: dict[int, type[CoreError]] = {
    1: InvalidArgumentError,
    2: CoreMemoryError,
    3: BufferTooSmallError,
    4: ContextFullError,
    5: BadStateError,
    6: ThreadError,
}


def error_for_status(status: int, message: str) -> CoreError:
    """The exception for a non-zero C status, carrying the core's message."""
    cls = STATUS_ERRORS.get(status, CoreError)
    return cls(message or f"decoding core failed with status {status}")
