"""Typed errors, one per gRPC status code, raised below a handler (mapped to its
status code by the interceptor) and by clients from a failed call."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import grpc

__all__ = ["Aborted", "Cancelled", "DataLoss", "DeadlineExceeded", "FailedPrecondition", "Internal",
           "InvalidArgument", "NotFound", "PermissionDenied", "ResourceExhausted",
           "GenerationConflict", "StatusError", "Unauthenticated", "Unavailable", "from_rpc_error"]


class StatusError(Exception):
    """A failed call with its gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def trailers(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata the server sends with the status (none by default)."""
        return ()


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
Aborted = _coded(_C.ABORTED, "A conditional write lost: another write came first.")

EXPECTED_KEY = "warmslot-expected-generation"  # trailing metadata of a GenerationConflict
STORED_KEY = "warmslot-stored-generation"


class GenerationConflict(Aborted):  # type: ignore[valid-type,misc]
    """A conditional Put refused: the snapshot `name` is at generation `stored` (0: it
    does not exist), the Put expected `expected`. Nothing of the Put was stored."""

    def __init__(self, name: str, expected: int, stored: int) -> None:
        have = f"stored {stored}" if stored else "stored 0: no such snapshot"
        super().__init__(f"snapshot {name!r} changed: expected generation {expected}, {have}")
        self.name, self.expected, self.stored = name, expected, stored

    def trailers(self) -> tuple[tuple[str, str], ...]:
        return ((EXPECTED_KEY, str(self.expected)), (STORED_KEY, str(self.stored)))

_BY_CODE: Mapping[grpc.StatusCode, type[StatusError]] = MappingProxyType({
    cls.code: cls
    for cls in (InvalidArgument, NotFound, FailedPrecondition, DataLoss, ResourceExhausted,
                DeadlineExceeded, Unavailable, Cancelled, Unauthenticated, PermissionDenied,
                Internal, Aborted)
})


def from_rpc_error(err: grpc.RpcError, name: str = "") -> StatusError:
    """The typed error for a failed call (the base class for unmapped codes); an
    ABORTED call whose trailers carry both generations is a GenerationConflict of
    `name` (the snapshot the call was about)."""
    code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (err.details() if isinstance(err, grpc.Call) else None) or str(code)
    if code == grpc.StatusCode.ABORTED and isinstance(err, grpc.Call):
        meta = dict(err.trailing_metadata() or ())
        try:
            return GenerationConflict(name, int(meta[EXPECTED_KEY]), int(meta[STORED_KEY]))
        except (KeyError, ValueError):
            pass
    cls = _BY_CODE.get(code, StatusError)
    exc = cls(details)
    exc.code = code
    return exc
