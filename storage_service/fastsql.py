"""Hot statements run straight on the database driver's cursor, rendered once.

SQLAlchemy spends about 120 us of Python per `Connection.execute` of a cached Core statement
(execution context, parameter processing, result setup); the psycopg cursor itself about 45
us. On the Commit path (two or three statements per batch) that was most of the storage
service's own CPU, so the few statements on it are rendered once per dialect with positional
parameters and executed on the cursor of the session's own connection, inside the session's
transaction. Everything else keeps using SQLAlchemy as usual.

What SQLAlchemy would have done and still happens here: its bind processors (SQLite stores
datetimes as text) and result processors run on parameters and returned rows, and a driver
error becomes the same `sqlalchemy.exc.DBAPIError` subclass, with the connection invalidated
when the dialect says it was lost, so `storage_service.dbcall` maps it as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.orm import Session
from sqlalchemy.sql import ClauseElement

__all__ = ["FastResult", "FastStatement"]


@dataclasses.dataclass(frozen=True)
class FastResult:
    """What a statement returned: its affected-row count and any rows (tuples, in the order
    of the statement's columns)."""

    rowcount: int
    rows: list[tuple[Any, ...]]

    def first(self) -> tuple[Any, ...] | None:
        return self.rows[0] if self.rows else None


@dataclasses.dataclass(frozen=True)
class _Rendered:
    sql: str
    names: tuple[str, ...]
    defaults: Mapping[str, Any]
    binds: Mapping[str, Callable[[Any], Any]]
    results: tuple[Callable[[Any], Any] | None, ...]
    returns_rows: bool


def _positional_dialect(dialect: Dialect) -> Dialect:
    """The dialect to render with: psycopg's own renders `%(name)s`, which the driver parses
    on every execution; the same dialect class with `format` renders `%s`."""
    if dialect.positional:
        return dialect
    return type(dialect)(paramstyle="format")


class FastStatement:
    """A Core statement executed on the raw cursor (see the module docstring).

    Args:
        statement: the statement, with `bindparam`s for what changes per execution.
        column_keys: for an INSERT without `.values()`, the columns every execution gives.
    """

    def __init__(self, statement: ClauseElement, column_keys: Sequence[str] | None = None) -> None:
        self._statement = statement
        self._column_keys = list(column_keys) if column_keys is not None else None
        self._rendered: dict[str, _Rendered] = {}

    def _render(self, dialect: Dialect) -> _Rendered:
        rendered = self._rendered.get(dialect.name)
        if rendered is not None:
            return rendered
        target = _positional_dialect(dialect)
        compiled = self._statement.compile(dialect=target, column_keys=self._column_keys)
        assert compiled.positiontup is not None
        binds = {
            name: processor
            for name, processor in (compiled._bind_processors or {}).items()  # noqa: SLF001
            if processor is not None
        }
        results = tuple(
            column[3].dialect_impl(dialect).result_processor(dialect, None)
            for column in compiled._result_columns  # noqa: SLF001
        )
        rendered = _Rendered(
            sql=compiled.string,
            names=tuple(compiled.positiontup),
            defaults=dict(compiled.params),
            binds=binds,
            results=results,
            returns_rows=bool(compiled._result_columns),  # noqa: SLF001
        )
        self._rendered[dialect.name] = rendered
        return rendered

    def execute(self, session: Session, params: Mapping[str, Any]) -> FastResult:
        """Runs the statement in the session's current transaction."""
        connection = session.connection()
        rendered = self._render(connection.dialect)
        args = []
        for name in rendered.names:
            value = params[name] if name in params else rendered.defaults[name]
            bind = rendered.binds.get(name)
            args.append(bind(value) if bind is not None else value)
        cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(rendered.sql, args)
            rows = cursor.fetchall() if rendered.returns_rows else []
            rowcount = cursor.rowcount
        except connection.dialect.loaded_dbapi.Error as error:
            raise _wrapped(connection, rendered.sql, args, error, cursor) from error
        finally:
            cursor.close()
        if rows and any(rendered.results):
            rows = [
                tuple(
                    process(value) if process is not None else value
                    for process, value in zip(rendered.results, row, strict=True)
                )
                for row in rows
            ]
        return FastResult(rowcount, rows)


def _wrapped(
    connection: Connection, sql: str, args: list[Any], error: Exception, cursor: Any
) -> sa_exc.DBAPIError:
    """The error SQLAlchemy would have raised for `error`; a lost connection is invalidated
    so the pool does not hand it out again."""
    dialect = connection.dialect
    dbapi_connection = connection.connection
    lost = dialect.is_disconnect(error, dbapi_connection.dbapi_connection, cursor)
    if lost:
        # As SQLAlchemy does on a disconnect: the pool's other connections were most likely
        # lost too (a server restart), so the pool replaces every connection it has handed
        # out so far instead of failing one call on each of them.
        connection.engine.pool._invalidate(dbapi_connection, error)  # noqa: SLF001
        connection.invalidate(error)
    return sa_exc.DBAPIError.instance(
        sql,
        args,
        error,
        dialect.loaded_dbapi.Error,
        connection_invalidated=lost,
        dialect=dialect,
    )
