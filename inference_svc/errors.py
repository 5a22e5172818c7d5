"""The service's errors (the shared status errors, snapshot_svc.clientlib.errors) and
the mapping of the core's and slot files' exceptions to status codes (used by the
shared interceptor)."""

from __future__ import annotations

import grpc

from inference_svc.core import errors as core_errors
from inference_svc.storage import slotfile
from snapshot_svc.clientlib import errors as _errors
from snapshot_svc.clientlib import interceptor
from snapshot_svc.clientlib.errors import *  # noqa: F403 (this module re-exports them)
from snapshot_svc.clientlib.errors import StatusError as ServiceError

__all__ = [*_errors.__all__, "ServiceError", "status_of"]


# checked in order: the first matching class wins
_MAPPING: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (slotfile.CorruptSlotFile, grpc.StatusCode.DATA_LOSS),
    (slotfile.UnsupportedSlotFile, grpc.StatusCode.FAILED_PRECONDITION),
    (slotfile.IncompatibleSlotFile, grpc.StatusCode.FAILED_PRECONDITION),
    (core_errors.BadStateError, grpc.StatusCode.DATA_LOSS),
    (core_errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (core_errors.ContextFullError, grpc.StatusCode.INVALID_ARGUMENT),
    (core_errors.CoreMemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call returns for an exception."""
    for cls, code in _MAPPING:
        if isinstance(exc, cls):
            return code, str(exc)
    return interceptor.status_of(exc)
