"""The inference service's logs: the shared format (snapshot_svc.clientlib.jsonlog),
one JSON object per line on stderr (or plain text).

    log.info("slot restored", extra=fields(slot=0, n_tokens=4000))
"""

from __future__ import annotations

import logging

from snapshot_svc.clientlib import jsonlog
from snapshot_svc.clientlib.jsonlog import JsonFormatter, TextFormatter, fields

__all__ = ["JsonFormatter", "TextFormatter", "fields", "get", "setup"]

LOGGER = "warmslot.inference"


def setup(level: str = "info", fmt: str = "json") -> logging.Logger:
    """Configures the service's logger (not the root logger) and returns it."""
    logger = logging.getLogger(LOGGER)
    logger.propagate = False
    return jsonlog.setup(logger, level, fmt)


def get() -> logging.Logger:
    return logging.getLogger(LOGGER)
