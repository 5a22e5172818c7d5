"""The snapshot service's logs: the shared JSON format (clientlib.jsonlog) for every
record of the process.

    log_event(log, logging.INFO, "snapshot_committed", name="a", target_bytes=123)
"""

from __future__ import annotations

import logging

from snapshot_svc.clientlib import jsonlog
from snapshot_svc.clientlib.jsonlog import JsonFormatter, log_event

__all__ = ["JsonFormatter", "configure_logging", "log_event"]


def configure_logging(level: str = "info") -> None:
    """Sends every log record of the process to stderr as JSON lines."""
    jsonlog.setup(logging.getLogger(), level, "json")
