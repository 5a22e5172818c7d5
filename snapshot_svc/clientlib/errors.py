"""Typed errors, one per gRPC status code, raised below a handler (mapped to its
status code by the interceptor) and by clients from a failed call."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import grpc

__all__ = ["Cancelled", "DataLoss", "DeadlineExceeded", "FailedPrecondition", "Internal",
           "InvalidArgument", "NotFound", "PermissionDenied", "ResourceExhausted",
           "StatusError", "Unauthenticated", "Unavailable", "from_rpc_error"]


class StatusError(Exception):
    """A failed call with its gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(StatusError):
    """Bad name, bad size, malformed request."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(StatusError):
    """No such snapshot, part or slot file."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(StatusError):
    """Incompatible protocol version or file, draft without its target."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DataLoss(StatusError):
    """Digest mismatch, truncation, corrupt state."""

    code = grpc.StatusCode.DATA_LOSS


class ResourceExhausted(StatusError):
    """Too big, a full disk or queue, a quota or limit reached."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(StatusError):
    """No answer within the call's deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(StatusError):
    """The server is starting, shutting down or unreachable."""

    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(StatusError):
    """The caller went away."""

    code = grpc.StatusCode.CANCELLED


class Unauthenticated(StatusError):
    """No key, or a key the server does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(StatusError):
    """A known key without the right to the call."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Internal(StatusError):
    """A bug or an unexpected I/O error on the server."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: Mapping[grpc.StatusCode, type[StatusError]] = MappingProxyType({
    cls.code: cls
    for cls in (InvalidArgument, NotFound, FailedPrecondition, DataLoss, ResourceExhausted,
                DeadlineExceeded, Unavailable, Cancelled, Unauthenticated, PermissionDenied,
                Internal)
})


def from_rpc_error(err: grpc.RpcError) -> StatusError:
    """The typed error for a failed call (the base class for unmapped codes)."""
    code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (err.details() if isinstance(err, grpc.Call) else None) or str(code)
    cls = _BY_CODE.get(code, StatusError)
    exc = cls(details)
    exc.code = code
    return exc
