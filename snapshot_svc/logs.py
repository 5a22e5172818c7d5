"""Structured logs: one JSON object per line, one line per event.

    log_event(log, logging.INFO, "snapshot_committed", name="a", target_bytes=123)
    -> {"ts": "2025-01-01T12:00:00.123Z", "level": "info", "logger": "snapshot_svc.storage",
        "event": "snapshot_committed", "name": "a", "target_bytes": 123}
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


def log_event(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    """Logs one event with its fields (rendered as JSON by JsonFormatter)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"event_fields": fields})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        out.update(getattr(record, "event_fields", {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure_logging(level: str = "info") -> None:
    """Sends every log record of the process to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
