"""Structured logs: one JSON object per line on stderr, each carrying the service name and
the request id of the work in progress, so one request can be followed across services."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from services.runtime.context import current_request_id

__all__ = [
    "BatchingStreamHandler",
    "JsonFormatter",
    "RepeatedLines",
    "access_handler",
    "configure_logging",
    "log_info",
]

# The access log's logger: one INFO line per RPC (services.runtime.interceptors).
ACCESS_LOGGER = "system.rpc"

MAX_MESSAGE = 4096
"""Longest message a log line carries; a longer one is cut and ends in `…`, so no value a
caller echoes can make a line (or a log) grow without bound."""

# LogRecord attributes that are not user-supplied `extra` fields.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as a JSON line with ts, level, service, logger, msg and request_id.

    It runs once per RPC (the access log), so it avoids per-record work it can share: the
    timestamp's seconds part is formatted once per second and one encoder is reused.
    """

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service
        self._encode = json.JSONEncoder(ensure_ascii=False).encode
        self._service = self._encode(service)
        self._stamp = (-1, "")  # (second, its text): one tuple, so threads read a pair

    def _timestamp(self, created: float) -> str:
        second = int(created)
        cached, stamp = self._stamp
        if second != cached:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._stamp = (second, stamp)
        return f"{stamp}.{int((created - second) * 1000):03d}Z"

    def access_line(self, method: str, code: str, ms: float, request_id: str) -> str:
        """The line `format` makes of the access log's record of one RPC, built directly:
        no LogRecord, no dictionary, one string."""
        encode = self._encode
        rid = f', "request_id": {encode(request_id)}' if request_id else ""
        return (
            f'{{"ts": "{self._timestamp(time.time())}", "level": "INFO", '
            f'"service": {self._service}, "logger": "{ACCESS_LOGGER}", '
            f'"msg": {encode(f"rpc {method} {code}")}{rid}, "rpc": {encode(method)}, '
            f'"code": {encode(code)}, "ms": {ms!r}}}'
        )

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self._timestamp(record.created),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": _clipped(record.getMessage()),
        }
        request_id = getattr(record, "request_id", None) or current_request_id()
        if request_id:
            entry["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in entry:
                entry[key] = (
                    _clipped(value)
                    if isinstance(value, str)
                    else value
                    if isinstance(value, int | float | bool)
                    else _clipped(repr(value))
                )
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return self._encode(entry)


def _clipped(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "…"


class RepeatedLines:
    """Lines that can repeat fast (a refused frame, a BUSY answer), summarised: per kind, the
    first in an interval is logged at once and the rest only counted; the next one after the
    interval is logged with `repeated`, how many were left out before it. Kinds are the
    caller's few fixed names, never values from a request.

    Args:
        logger: where the lines go.
        interval: seconds one kind logs at most one line in.
        clock: the time in seconds (monotonic).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._kinds: dict[str, list[float]] = {}  # kind -> [logged at, left out since]

    def log(
        self,
        level: int,
        kind: str,
        msg: str,
        *args: Any,
        extra: dict[str, Any] | None = None,
    ) -> bool:
        """Logs the line unless one of `kind` was logged less than `interval` ago; returns
        whether it was logged."""
        now = self._clock()
        seen = self._kinds.get(kind)
        if seen is not None and now - seen[0] < self._interval:
            seen[1] += 1
            return False
        left_out = int(seen[1]) if seen is not None else 0
        self._kinds[kind] = [now, 0]
        if self._logger.isEnabledFor(level):
            fields = {**(extra or {}), "kind": kind, "repeated": left_out}
            self._logger.log(level, msg, *args, extra=fields)
        return True


class BatchingStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler that writes its lines in batches instead of one write per record.

    The access log writes a line per RPC; a write per line costs a system call, and in a
    server whose gRPC threads wait for the interpreter lock each such call also hands the
    lock over and back. Here lines wait in memory until `interval` seconds have passed (a
    background thread flushes them), `max_bytes` are pending, or a WARNING or worse arrives,
    which is written at once with everything before it. Closing (logging.shutdown at exit)
    writes what is left; a process killed outright loses at most `interval` of INFO lines.
    """

    def __init__(self, stream: TextIO, interval: float = 0.1, max_bytes: int = 64 * 1024) -> None:
        super().__init__(stream)
        self.interval = interval
        self.max_bytes = max_bytes
        self._pending: list[str] = []
        self._size = 0
        # Not `_closed`: logging.Handler.close sets that one to True.
        self._stopped = threading.Event()
        self._start_flusher()
        # A forked worker has no flusher thread; start its own.
        os.register_at_fork(after_in_child=self._start_flusher)

    def _start_flusher(self) -> None:
        if not self._stopped.is_set():
            threading.Thread(target=self._flush_periodically, name="log-flush", daemon=True).start()

    def _flush_periodically(self) -> None:
        while not self._stopped.wait(self.interval):
            self.flush()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        # Handler.handle holds the handler's lock around emit.
        self._pending.append(line)
        self._size += len(line)
        if record.levelno >= logging.WARNING or self._size >= self.max_bytes:
            self._write_pending()

    def append(self, line: str) -> None:
        """Adds a formatted INFO line (the access log's fast path: see `access_handler`)."""
        with self.lock:  # type: ignore[union-attr]
            self._pending.append(line + self.terminator)
            self._size += len(line) + 1
            if self._size >= self.max_bytes:
                self._write_pending()

    def _write_pending(self) -> None:
        if not self._pending:
            return
        text = "".join(self._pending)
        self._pending.clear()
        self._size = 0
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # stream closed or broken: nothing left to tell
            pass

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._write_pending()

    def close(self) -> None:
        self._stopped.set()
        self.flush()
        super().close()


def configure_logging(service: str, level: str = "INFO") -> None:
    """Sends every log record of this process to stderr as JSON lines (in batches: see
    `BatchingStreamHandler`)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, BatchingStreamHandler):
            handler.close()
    handler = BatchingStreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def log_info(
    logger: logging.Logger, msg: str, args: tuple[Any, ...], extra: dict[str, Any]
) -> None:
    """`logger.info(msg, *args, extra=extra)` without Logger.log's stack walk for the caller
    (file and line stay empty): for lines written once per call. The caller checks
    `isEnabledFor(INFO)` first."""
    logger.handle(logger.makeRecord(logger.name, logging.INFO, "", 0, msg, args, None, extra=extra))


def access_handler() -> BatchingStreamHandler | None:
    """The handler the access log can append its lines to directly, or None when records
    must go through `logging` as usual: only when INFO records of the access logger would
    reach exactly one handler, the batching JSON handler `configure_logging` installed, and
    nothing else (a test's capture handler, a filter) would see them."""
    handlers = logging.root.handlers
    if len(handlers) != 1:
        return None
    handler = handlers[0]
    if (
        type(handler) is not BatchingStreamHandler
        or type(handler.formatter) is not JsonFormatter
        or handler.filters
        or handler.level > logging.INFO
        or _ACCESS.handlers
        or _ACCESS.filters
        or not _ACCESS.propagate
        or logging.root.filters
    ):
        return None
    return handler


_ACCESS = logging.getLogger(ACCESS_LOGGER)
