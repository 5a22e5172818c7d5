"""Typed service errors, one per gRPC status code, and the one mapping from any
exception raised below a handler to a status code (used by the interceptor)."""

from __future__ import annotations

import grpc

from inference_svc import slotfile
from inference_svc.core import errors as core_errors


class ServiceError(Exception):
    """A failed request with its gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class DataLoss(ServiceError):
    code = grpc.StatusCode.DATA_LOSS


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL


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
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    for cls, code in _MAPPING:
        if isinstance(exc, cls):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
