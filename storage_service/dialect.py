"""Where SQLite and PostgreSQL differ, said once for the storage package.

The stores run the same rules on both databases. What differs is how a statement is spelled
(the dialect's INSERT ... ON CONFLICT, `greatest` against SQLite's two-argument `max`), how
values come back (SQLite keeps no time zone), how writers are kept apart (SQLite's writers
take turns at BEGIN IMMEDIATE, see db.py; PostgreSQL takes advisory and row locks, which
only it has) and where a single statement runs (`OneStatement`). The modules ask this one
instead of comparing dialect names themselves.

Statements written for one database alone (the claims' and the group receipt writes' SQL,
knowledge search's FTS5 and tsvector indexes) stay with their area; they choose the form
with `is_postgresql`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sqlalchemy import BigInteger, Integer, Table, TableValuedAlias, bindparam, column, func
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import TypeEngine

__all__ = [
    "GREATEST",
    "ID",
    "INSERT",
    "POSTGRESQL",
    "SQLITE",
    "OneStatement",
    "advisory_lock",
    "aware",
    "insert_for",
    "is_postgresql",
    "name_of",
    "unnested",
    "utc_now",
]

SQLITE = "sqlite"
POSTGRESQL = "postgresql"

ID = BigInteger().with_variant(Integer, SQLITE)
"""An autoincrementing key: BIGINT on PostgreSQL; on SQLite INTEGER, the only type that
makes a rowid alias (and so autoincrements)."""

DialectInsert = Callable[[Table], sqlite.Insert | postgresql.Insert]
"""A dialect's `insert()`: both constructs have ON CONFLICT ... DO NOTHING / DO UPDATE."""

INSERT: dict[str, DialectInsert] = {SQLITE: sqlite_insert, POSTGRESQL: postgresql_insert}
"""Each dialect's INSERT, the one with ON CONFLICT."""

GREATEST: dict[str, Callable[..., ColumnElement[Any]]] = {
    SQLITE: func.max,
    POSTGRESQL: func.greatest,
}
"""The larger of two values: SQLite's two-argument max() is PostgreSQL's greatest()."""


def name_of(target: Session | Connection | Engine) -> str:
    """The database's dialect name, for a session, a connection or an engine."""
    if isinstance(target, Session):
        return target.get_bind().dialect.name
    return target.dialect.name


def is_postgresql(target: Session | Connection | Engine) -> bool:
    """Whether `target` works on PostgreSQL (else SQLite, the only other one supported)."""
    return name_of(target) == POSTGRESQL


def insert_for(target: Session | Connection | Engine) -> DialectInsert:
    """The INSERT construct (with ON CONFLICT) of `target`'s database."""
    return INSERT[name_of(target)]


def aware(value: dt.datetime) -> dt.datetime:
    """A stored time as an aware UTC datetime: SQLite returns naive datetimes, stored as UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


def advisory_lock(key: Any) -> Any:
    """PostgreSQL only: the expression that takes the transaction-scoped advisory lock named
    by the text `key` (hashed to the lock's 64-bit id), held until the transaction ends.
    SQLite has no such locks and needs none: its writers take turns at BEGIN IMMEDIATE
    (db.py)."""
    return func.pg_advisory_xact_lock(func.hashtextextended(key, 0))


def unnested(
    name: str, prefix: str, columns: Sequence[tuple[str, TypeEngine[Any]]]
) -> TableValuedAlias:
    """PostgreSQL only: a FROM item `name` whose rows are array parameters unnested side by
    side, one per (column, element type), the parameter named `prefix` + the column: how one
    statement writes a group's rows (storage_service.batch_groups)."""
    return (
        func.unnest(*(bindparam(prefix + field, type_=ARRAY(type_)) for field, type_ in columns))
        .table_valued(*(column(field, type_) for field, type_ in columns))
        .render_derived(name=name)
    )


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class OneStatement:
    """Where work that is a single statement runs (a lease taken, renewed or given back, a
    claim): on PostgreSQL a Core connection in autocommit, so the statement is its own
    transaction and costs one round trip instead of three (BEGIN, the statement, COMMIT;
    measured: acquire + release 3.5 -> 2.4 ms, the database's CPU for them halved), without
    an ORM session around it (measured in process: CPU for an acquire and a release
    0.9-1.5 -> 0.8 ms). SQLite keeps its sessions' transactions: its writers take
    turns at BEGIN (storage_service.db), and its claim takes three statements."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions
        bind = sessions.kw.get("bind")
        self._autocommit = (
            bind.execution_options(isolation_level="AUTOCOMMIT")
            if bind is not None and bind.dialect.name == POSTGRESQL
            else None
        )

    @contextlib.contextmanager
    def begin(self) -> Iterator[Session | Connection]:
        if self._autocommit is None:
            with self._sessions.begin() as session:
                yield session
            return
        with self._autocommit.connect() as connection:
            yield connection
