"""Structured logs: one JSON object per line on stderr (or plain text).

    log.info("slot restored", extra={"fields": {"slot": 0, "n_tokens": 4000}})
"""

from __future__ import annotations

import json
import logging
import sys
import time

LOGGER = "warmslot.inference"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        kv = " ".join(f"{k}={v}" for k, v in fields.items())
        line = f"{record.levelname.lower():7s} {record.name}: {record.getMessage()}"
        line = f"{line} {kv}" if kv else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(level: str = "info", fmt: str = "json") -> logging.Logger:
    """Configures the service's logger (not the root logger) and returns it."""
    logger = logging.getLogger(LOGGER)
    logger.setLevel(level.upper())
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger.addHandler(handler)
    return logger


def get() -> logging.Logger:
    return logging.getLogger(LOGGER)


def fields(**kw: object) -> dict[str, dict[str, object]]:
    """`extra=` for a log call: log.info("msg", extra=fields(slot=1))."""
    return {"fields": kw}
