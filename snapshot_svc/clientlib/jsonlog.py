"""The log format of both services and the deploy entry point: one JSON object per
line on stderr (or plain text), with the same field names everywhere:

    {"ts": "2026-01-01T12:00:00.123Z", "level": "info", "logger": "snapshot_svc.server",
     "msg": "put", "name": "a", "bytes": 123}

`ts`, `level`, `logger`, `msg`, the event's own fields, and `exc` (a traceback).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


def fields(**kw: object) -> dict[str, dict[str, object]]:
    """`extra=` for a log call: log.info("slot restored", extra=fields(slot=1))."""
    return {"fields": kw}


def log_event(logger: logging.Logger, level: int, event: str, **kw: Any) -> None:
    """Logs one event with its fields."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra=fields(**kw))


def record(level: str, logger: str, msg: str, created: float | None = None,
           **kw: Any) -> dict[str, Any]:
    """One log line's object."""
    t = time.time() if created is None else created
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t))
    return {"ts": f"{ts}.{int(t * 1000) % 1000:03d}Z", "level": level, "logger": logger,
            "msg": msg, **kw}


class JsonFormatter(logging.Formatter):
    def format(self, rec: logging.LogRecord) -> str:
        out = record(rec.levelname.lower(), rec.name, rec.getMessage(), rec.created,
                     **getattr(rec, "fields", {}))
        if rec.exc_info:
            out["exc"] = self.formatException(rec.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def format(self, rec: logging.LogRecord) -> str:
        kv = " ".join(f"{k}={v}" for k, v in getattr(rec, "fields", {}).items())
        line = f"{rec.levelname.lower():7s} {rec.name}: {rec.getMessage()}"
        line = f"{line} {kv}" if kv else line
        if rec.exc_info:
            line += "\n" + self.formatException(rec.exc_info)
        return line


def setup(logger: logging.Logger, level: str = "info", fmt: str = "json") -> logging.Logger:
    """Sends `logger`'s records (the root logger: the whole process's) to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    return logger
