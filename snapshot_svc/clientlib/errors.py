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


def _coded(code: grpc.StatusCode, doc: str) -> type[StatusError]:
    """The StatusError subclass of one code, named after it (NOT_FOUND -> NotFound)."""
    name = "".join(word.capitalize() for word in code.name.split("_"))
    return type(name, (StatusError,), {"code": code, "__doc__": doc, "__module__": __name__})


_C = grpc.StatusCode
InvalidArgument = _coded(_C.INVALID_ARGUMENT, "Bad name, bad size, malformed request.")
NotFound = _coded(_C.NOT_FOUND, "No such snapshot, part or slot file.")
FailedPrecondition = _coded(_C.FAILED_PRECONDITION, "Incompatible protocol or file; a lone draft.")
DataLoss = _coded(_C.DATA_LOSS, "Digest mismatch, truncation, corrupt state.")
ResourceExhausted = _coded(_C.RESOURCE_EXHAUSTED, "Too big; a full disk or queue; a quota reached.")
DeadlineExceeded = _coded(_C.DEADLINE_EXCEEDED, "No answer within the call's deadline.")
Unavailable = _coded(_C.UNAVAILABLE, "The server is starting, stopping or unreachable.")
Cancelled = _coded(_C.CANCELLED, "The caller went away.")
Unauthenticated = _coded(_C.UNAUTHENTICATED, "No key, or a key the server does not know.")
PermissionDenied = _coded(_C.PERMISSION_DENIED, "A known key without the right to the call.")
Internal = _coded(_C.INTERNAL, "A bug or an unexpected I/O error on the server.")

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
