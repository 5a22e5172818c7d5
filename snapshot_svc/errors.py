"""The snapshot service's errors: the shared status errors (clientlib.errors), which
the server raises from anywhere below a handler and the client raises from a failed
call, so callers catch `NotFound`, `DataLoss`... instead of inspecting RpcErrors."""

from __future__ import annotations

from snapshot_svc.clientlib.errors import (
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from snapshot_svc.clientlib.errors import StatusError as SnapshotError

__all__ = ["Cancelled", "DataLoss", "DeadlineExceeded", "FailedPrecondition", "Internal",
           "InvalidArgument", "NotFound", "PermissionDenied", "ResourceExhausted",
           "SnapshotError", "Unauthenticated", "Unavailable", "from_rpc_error"]
