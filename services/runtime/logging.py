"""Structured logs: one JSON object per line on stderr, each carrying the service name and
the request id of the work in progress, so one request can be followed across services."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from services.runtime.context import current_request_id

__all__ = ["JsonFormatter", "configure_logging"]

# LogRecord attributes that are not user-supplied `extra` fields.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as a JSON line with ts, level, service, logger, msg and request_id."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or current_request_id()
        if request_id:
            entry["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value if isinstance(value, str | int | float | bool) else repr(value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(service: str, level: str = "INFO") -> None:
    """Sends every log record of this process to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
