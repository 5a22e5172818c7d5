"""Typed errors shared by the server and the client, one per status code.

The server raises them from anywhere below a handler; one interceptor turns them
into gRPC status codes. The client raises the same types from a failed call,
so callers catch `NotFound`, `DataLoss`... instead of inspecting RpcErrors.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import grpc


class SnapshotError(Exception):
    """Base class: a failed snapshot operation with its gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(SnapshotError):
    """Bad name, bad size, malformed stream."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SnapshotError):
    """No such snapshot or part."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(SnapshotError):
    """Incompatible protocol version, draft without its target."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DataLoss(SnapshotError):
    """Digest mismatch or truncation."""

    code = grpc.StatusCode.DATA_LOSS


class ResourceExhausted(SnapshotError):
    """Too big, or the disk is full."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(SnapshotError):
    """No answer within the call's deadline (the server may be hung)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(SnapshotError):
    """The server is shutting down or unreachable."""

    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(SnapshotError):
    """The caller went away (the server discards what it sent)."""

    code = grpc.StatusCode.CANCELLED


class Internal(SnapshotError):
    """A bug or an unexpected I/O error on the server."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: Mapping[grpc.StatusCode, type[SnapshotError]] = MappingProxyType({
    cls.code: cls
    for cls in (InvalidArgument, NotFound, FailedPrecondition, DataLoss, ResourceExhausted,
                DeadlineExceeded, Unavailable, Cancelled, Internal)
})


def from_rpc_error(err: grpc.RpcError) -> SnapshotError:
    """The typed error for a failed call (the base class for unmapped codes)."""
    code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (err.details() if isinstance(err, grpc.Call) else None) or str(code)
    cls = _BY_CODE.get(code, SnapshotError)
    exc = cls(details)
    exc.code = code
    return exc
