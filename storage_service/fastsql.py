"""Hot statements run straight on the database driver's cursor, rendered once.

SQLAlchemy spends about 120 us of Python per `Connection.execute` of a cached Core statement
(execution context, parameter processing, result setup); the psycopg cursor itself about 45
us. On the Commit path (two or three statements per batch) that was most of the storage
service's own CPU, so the few statements on it are rendered once per dialect with positional
parameters and executed on the cursor of the session's own connection, inside the session's
transaction. Everything else keeps using SQLAlchemy as usual.

Statements may also be *sent* ahead (`FastStatement.send`) and their results read later
(`Sent.result`): inside `pipelined(session)` psycopg queues them and sends them together, so
a group of writes (storage_service.group_commit) costs one round trip to the server instead
of one per statement, and one wake-up of the writer thread instead of one per statement
(each of which waits for the GIL the event loop holds). Outside a pipeline, and on SQLite, a
sent statement runs at once.

What SQLAlchemy would have done and still happens here: its bind processors (SQLite stores
datetimes as text) and result processors run on parameters and returned rows, and a driver
error becomes the same `sqlalchemy.exc.DBAPIError` subclass, with the connection invalidated
when the dialect says it was lost, so `storage_service.dbcall` maps it as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.engine.default import DefaultDialect
from sqlalchemy.engine.interfaces import DBAPIModule
from sqlalchemy.orm import Session
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

from storage_service.dialect import POSTGRESQL

__all__ = ["FastResult", "FastStatement", "Sent", "pipelined"]


class FastResult(NamedTuple):
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

    def args(self, params: Mapping[str, Any]) -> list[Any]:
        """The positional parameters of one execution, bind processors applied."""
        args = []
        for name in self.names:
            value = params[name] if name in params else self.defaults[name]
            bind = self.binds.get(name)
            args.append(bind(value) if bind is not None else value)
        return args

    def rows(self, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """`rows` with the result processors applied."""
        if not rows or not any(self.results):
            return rows
        return [
            tuple(
                process(value) if process is not None else value
                for process, value in zip(self.results, row, strict=True)
            )
            for row in rows
        ]


def _positional_dialect(dialect: Dialect) -> Dialect:
    """The dialect to render with: psycopg's own renders `%(name)s`, which the driver parses
    on every execution; the same dialect class with `format` renders `%s`."""
    if dialect.positional:
        return dialect
    # Every dialect SQLAlchemy ships is a DefaultDialect; the Dialect interface declares no
    # constructor.
    return cast(type[DefaultDialect], type(dialect))(paramstyle="format")


class FastStatement:
    """A Core statement executed on the raw cursor (see the module docstring).

    Args:
        statement: the statement, with `bindparam`s for what changes per execution.
        column_keys: for an INSERT without `.values()`, the columns every execution gives.
        planned_each_time: never a prepared statement on PostgreSQL (psycopg prepares a
            statement run five times, and the server may then keep one generic plan for
            it). For a statement whose right plan depends on its arguments or on how much
            the tables have grown since they were last analyzed: a generic plan made while
            they were nearly empty scans them whole, and stays.
    """

    def __init__(
        self,
        statement: ClauseElement,
        column_keys: Sequence[str] | None = None,
        planned_each_time: bool = False,
    ) -> None:
        self._statement = statement
        self._column_keys = list(column_keys) if column_keys is not None else None
        self._rendered: dict[str, _Rendered] = {}
        self._planned_each_time = planned_each_time

    def _render(self, dialect: Dialect) -> _Rendered:
        rendered = self._rendered.get(dialect.name)
        if rendered is not None:
            return rendered
        target = _positional_dialect(dialect)
        # A statement (not DDL) compiles to an SQLCompiler, whose positional names, bind and
        # result processors this reads.
        compiled = cast(
            SQLCompiler,
            self._statement.compile(dialect=target, column_keys=self._column_keys),
        )
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
            # A processor is a sequence only for a tuple_() IN-list, which no fast statement
            # uses.
            binds=cast(Mapping[str, Callable[[Any], Any]], binds),
            results=results,
            returns_rows=bool(compiled._result_columns),  # noqa: SLF001
        )
        self._rendered[dialect.name] = rendered
        return rendered

    def execute(self, session: Session | Connection, params: Mapping[str, Any]) -> FastResult:
        """Runs the statement in the session's current transaction (or on the connection)."""
        return self.send(session, params).result()

    def send(self, session: Session | Connection, params: Mapping[str, Any]) -> Sent:
        """Sends the statement in the session's current transaction (or on the connection,
        as it is: one in autocommit runs it as a transaction of its own): inside
        `pipelined`, it is queued and its result comes with the pipeline's; otherwise it runs
        at once, and its result is read at once too (SQLite keeps a statement whose rows are
        not all read in use, and prepares the same SQL again for the next cursor)."""
        connection = session if isinstance(session, Connection) else session.connection()
        rendered = self._render(connection.dialect)
        args = rendered.args(params)
        cursor = _cursor(connection)
        try:
            if self._planned_each_time and connection.dialect.name == POSTGRESQL:
                cursor.execute(rendered.sql, args, prepare=False)  # psycopg: never prepare
            else:
                cursor.execute(rendered.sql, args)
        except connection.dialect.loaded_dbapi.Error as error:
            cursor.close()
            raise _wrapped(connection, rendered.sql, args, error, cursor) from error
        sent = Sent(connection, rendered, args, cursor)
        if not connection.connection.info.get(_PIPELINED):
            sent.result()
        return sent


# Where a connection keeps its idle cursors, and whether it is in a pipeline: in the pool's
# info of the DBAPI connection, which is dropped with the connection.
_IDLE_CURSORS = "storage_service.fastsql.idle_cursors"
_PIPELINED = "storage_service.fastsql.pipelined"


def _cursor(connection: Connection) -> Any:
    """A cursor on the connection, reused when one is idle: a new psycopg cursor starts with
    no cached parameter dumpers, and looking them up again costs about a third of what
    sending a statement costs in a pipeline."""
    pooled = connection.connection
    driver = pooled.driver_connection
    idle = pooled.info.get(_IDLE_CURSORS)
    while idle:
        cursor = idle.pop()
        if cursor.connection is driver:
            return cursor
    return driver.cursor()  # type: ignore[union-attr]


def _release(connection: Connection, cursor: Any) -> None:
    """Keeps a cursor whose result was read for the connection's next statement."""
    connection.connection.info.setdefault(_IDLE_CURSORS, []).append(cursor)


class Sent:
    """A statement sent by `FastStatement.send`; `result` is what it returned (read once:
    the cursor goes to the next statement then)."""

    __slots__ = ("_args", "_connection", "_cursor", "_rendered", "_result")

    def __init__(
        self, connection: Connection, rendered: _Rendered, args: list[Any], cursor: Any
    ) -> None:
        self._connection = connection
        self._rendered = rendered
        self._args = args
        self._cursor = cursor
        self._result: FastResult | None = None

    def result(self) -> FastResult:
        """What the statement returned; in a pipeline, waits for it if it has not come yet.
        A statement that failed, or was skipped because one before it in the pipeline failed,
        raises the wrapped driver error."""
        if self._result is None:
            self._result = self._read()
        return self._result

    def _read(self) -> FastResult:
        rendered, cursor = self._rendered, self._cursor
        try:
            rows = cursor.fetchall() if rendered.returns_rows else []
            rowcount = cursor.rowcount
        except self._connection.dialect.loaded_dbapi.Error as error:
            cursor.close()
            raise _wrapped(self._connection, rendered.sql, self._args, error, cursor) from error
        _release(self._connection, cursor)
        return FastResult(rowcount, rendered.rows(rows))


@contextlib.contextmanager
def pipelined(session: Session) -> Iterator[None]:
    """Statements sent in the block (`FastStatement.send`) go to the server together, in
    order, in the session's current transaction; leaving the block waits for all their
    results. The first error of a statement is raised on leaving (wrapped as SQLAlchemy
    would); the statements after it were skipped. Drivers without a pipeline mode (SQLite)
    run each statement as it is sent."""
    connection = session.connection()
    driver = connection.connection.driver_connection
    if not hasattr(driver, "pipeline"):
        yield
        return
    info = connection.connection.info
    try:
        with driver.pipeline():  # type: ignore[union-attr]
            info[_PIPELINED] = True
            try:
                yield
            finally:
                info[_PIPELINED] = False
    except connection.dialect.loaded_dbapi.Error as error:
        raise _wrapped(connection, "(pipeline)", [], error, None) from error


def _wrapped(
    connection: Connection, sql: str, args: list[Any], error: DBAPIModule.Error, cursor: Any
) -> sa_exc.StatementError:
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
