"""Runs blocking database work off the event loop and turns "the database is not there" into
`Unavailable`, so clients see UNAVAILABLE (retry with the same request id) instead of INTERNAL.

Which failures count as unavailability:

- SQLAlchemy `OperationalError`: the server went away, refused the connection, shut down
  (PostgreSQL `AdminShutdown`), a serialization failure or deadlock rolled the transaction
  back. All of them leave nothing behind, so a retry is safe. The group committer runs a
  transaction that met a deadlock or serialization failure (`is_conflict`) again itself
  before it gives up with UNAVAILABLE (decision 0027).
- any `DBAPIError` with `connection_invalidated` (the pool saw the connection die).
- SQLAlchemy `InterfaceError` (psycopg: "the connection is closed") and pool `TimeoutError`
  (every connection busy for `pool_timeout`).
- psycopg `OperationalError` raised outside SQLAlchemy (a raw connection).
- SQLite "database is locked" / "database is busy" (another writer held the lock past
  `busy_timeout`), "unable to open database file" and "disk I/O error".

SQLite also reports mistakes in our own SQL as `OperationalError` ("no such table",
"syntax error"). Those are bugs, not outages: they stay as they are and become INTERNAL,
which is logged with a traceback, rather than UNAVAILABLE, which clients would retry forever.

A failure while COMMIT is in flight leaves the outcome unknown to us; that is why the message
tells the client to retry with the *same* request id: Commit is idempotent by request id, so a
batch that did land is answered as replayed and never applied twice.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from sqlalchemy import exc as sa_exc

from services.runtime.errors import Unavailable

__all__ = [
    "UNAVAILABLE_MESSAGE",
    "is_conflict",
    "is_unavailable",
    "map_unavailable",
    "run_db",
    "use_executor",
]

log = logging.getLogger("system.storage.db")

P = ParamSpec("P")
T = TypeVar("T")

UNAVAILABLE_MESSAGE = "the database is unavailable; retry with the same request id"

try:  # psycopg is a dependency, but the SQLite-only path must not need it to import.
    from psycopg import OperationalError as _PsycopgOperationalError
except ImportError:  # pragma: no cover - psycopg is installed everywhere we run
    _PsycopgOperationalError = None  # type: ignore[assignment,misc]

# Substrings of sqlite3.OperationalError messages that mean "not now", not "wrong SQL".
_SQLITE_TRANSIENT = (
    "database is locked",
    "database table is locked",
    "database is busy",
    "unable to open database file",
    "disk i/o error",
)


# Where run_db runs its work: None is the loop's default executor (asyncio.to_thread's), whose
# size has nothing to do with the database pool; the service sets one sized to it.
_executor: ThreadPoolExecutor | None = None


def use_executor(executor: ThreadPoolExecutor | None, replacing: object = ...) -> None:
    """Runs database work on `executor` from now on (None: the loop's default executor).
    Size it to the engine's pool: more threads than connections only queue for one. With
    `replacing`, only when that is the executor in use (a closing app leaves another's)."""
    global _executor
    if replacing is ... or _executor is replacing:
        _executor = executor


def _sqlite_transient(error: BaseException) -> bool:
    return any(text in str(error).lower() for text in _SQLITE_TRANSIENT)


# PostgreSQL's "the transaction was rolled back, run it again": deadlock_detected and
# serialization_failure. Both end the whole transaction (or the savepoint it was in) and
# leave nothing of it behind.
_CONFLICT_SQLSTATES = frozenset({"40P01", "40001"})


def is_conflict(error: BaseException) -> bool:
    """Whether `error` is a deadlock or a serialization failure (SQLSTATE 40P01 or 40001):
    safe to run the whole transaction again, which storage_service.group_commit does. Left
    alone, it is unavailability like the others (see the module docstring)."""
    found = error.orig if isinstance(error, sa_exc.DBAPIError) else error
    return getattr(found, "sqlstate", None) in _CONFLICT_SQLSTATES


def is_unavailable(error: BaseException) -> bool:
    """Whether `error` means the database could not be reached or used just now."""
    if isinstance(error, sa_exc.DBAPIError):
        if error.connection_invalidated:
            return True
        if isinstance(error.orig, sqlite3.Error):
            return _sqlite_transient(error.orig)
        return isinstance(error, sa_exc.OperationalError | sa_exc.InterfaceError)
    if isinstance(error, sa_exc.TimeoutError):  # QueuePool exhausted
        return True
    if isinstance(error, sqlite3.OperationalError):
        return _sqlite_transient(error)
    return _PsycopgOperationalError is not None and isinstance(error, _PsycopgOperationalError)


def map_unavailable(error: Exception, where: str) -> Exception:
    """`Unavailable` (the original chained, one warning logged) when `error` means the database
    could not be reached or used (see the module docstring); `error` itself otherwise."""
    if not is_unavailable(error):
        return error
    # One line, no traceback: an outage makes many of these and the cause is the same.
    log.warning(
        "database unavailable in %s: %s: %s",
        where,
        type(error).__name__,
        str(error).splitlines()[0] if str(error) else "",
    )
    unavailable = Unavailable(UNAVAILABLE_MESSAGE)
    unavailable.__cause__ = error
    return unavailable


async def run_db(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`await asyncio.to_thread(fn, *args, **kwargs)` (on the executor given to
    `use_executor`, if any), with unavailability mapped.

    Raises:
        Unavailable: the database could not be reached or used (see the module docstring);
            the original error is chained and logged as a warning, never sent to the client.
        Exception: anything else `fn` raises, unchanged (typed `ServiceError`s included).
    """
    try:
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(_executor, call)
    except Exception as error:
        mapped = map_unavailable(error, getattr(fn, "__qualname__", repr(fn)))
        if mapped is error:
            raise
        raise mapped from error
