"""The snapshot service's errors: the shared status errors (clientlib.errors), which
the server raises from anywhere below a handler and the client raises from a failed
call, so callers catch `NotFound`, `DataLoss`... instead of inspecting RpcErrors."""

from __future__ import annotations

from snapshot_svc.clientlib import errors as _errors
from snapshot_svc.clientlib.errors import *  # noqa: F403 (this module re-exports them)
from snapshot_svc.clientlib.errors import StatusError as SnapshotError

__all__ = [*_errors.__all__, "SnapshotError"]
