"""Database schema and engine setup. SQLite (WAL) embedded by default, PostgreSQL via psycopg 3."""

from __future__ import annotations

import datetime as dt
import sqlite3
import threading
from pathlib import Path
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Engine,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Table,
    Text,
    create_engine,
    event,
)
from sqlalchemy.engine import Connection, CursorResult, Result, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.sql.dml import Insert

from storage_service.dialect import ID, insert_for

__all__ = [
    "KEEP_ON_RESET",
    "Base",
    "HISTORY",
    "PREFERENCES",
    "HistoryRow",
    "PreferenceRow",
    "make_engine",
    "pool_capacity",
    "upsert_ignore",
]

KEEP_ON_RESET = "keep_on_reset"
"""Key in a table's `info`: when true, ResetPlayer leaves the player's rows in that table."""


class Base(DeclarativeBase):
    pass


class HistoryRow(Base):
    """One conversation-history entry. `result` is an encoded system.common.v1.AgentResult.

    `seq` and `bytes_through` count the player's entries and their bytes from some start up to
    and including this one (each insert adds to the player's newest entry's); only their
    differences mean something: the entries and bytes from one entry to the newest, which
    eviction reads from the oldest entries alone instead of summing the whole history."""

    __tablename__ = "history_entries"
    __table_args__ = (Index("ix_history_player_id", "player_id", "id"),)

    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    player_id: Mapped[str] = mapped_column(String(64))
    role: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    request_id: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    seq: Mapped[int] = mapped_column(BigInteger)
    bytes_through: Mapped[int] = mapped_column(BigInteger)


class PreferenceRow(Base):
    """A player's preferences; absent means defaults."""

    __tablename__ = "player_preferences"

    player_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    history_enabled: Mapped[bool] = mapped_column(Boolean)
    external_enabled: Mapped[bool] = mapped_column(Boolean)
    conversation_mode: Mapped[int] = mapped_column(SmallInteger, server_default="0")
    """A `system.common.v1.ConversationMode` number; 0 follows the server's default."""


def table_of(row: type[Base]) -> Table:
    """The Core table behind a mapped class.

    SQLAlchemy declares `__table__` as a FromClause (a mapping may target a join or a
    subquery); every row class here maps one Table, so this only names that for the checker.
    """
    return cast(Table, row.__table__)


HISTORY = table_of(HistoryRow)
PREFERENCES = table_of(PreferenceRow)


def rowcount(result: Result[Any]) -> int:
    """The rows an INSERT, UPDATE or DELETE run by `Session.execute` touched: at run time its
    result is a CursorResult, which the signature only calls a Result."""
    return cast(CursorResult[Any], result).rowcount


def upsert_ignore(session: Session, table: Table, **values: Any) -> Insert:
    """INSERT that does nothing when the key exists, on SQLite and PostgreSQL.

    Its result's rowcount is 1 when this insert made the row and 0 when the key existed (what
    tells a racing writer whether it won): SQLAlchemy reports no count for an INSERT unless
    asked to preserve it.
    """
    return (
        insert_for(session)(table)
        .values(**values)
        .on_conflict_do_nothing()
        .execution_options(preserve_rowcount=True)
    )


def _sqlite_pragmas(dbapi_connection: sqlite3.Connection, _record: object) -> None:
    # Let SQLAlchemy's "begin" event issue BEGIN itself (see _sqlite_begin).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    # WAL lets readers run beside the writer; NORMAL sync is durable across process crashes.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


# How long a transaction waits for another to end before "database is locked" (busy_timeout).
SQLITE_BUSY_SECONDS = 5.0


class _SerializedConnection(sqlite3.Connection):
    """A SQLite connection whose transactions queue on a lock shared by the engine's
    connections before BEGIN IMMEDIATE, and give it back once COMMIT or ROLLBACK is done.

    Every transaction here takes SQLite's write lock at its start (see _sqlite_begin), so only
    one runs at a time anyway; what this changes is how the others wait. SQLite's busy
    handler polls with sleeps of 1, 2, 5, ... up to 100 ms, so under concurrent writes (the
    group committer beside worker threads) a waiting transaction slept far longer than the
    one it waited for; a thread blocked on this lock wakes as soon as it is free. SQLite still
    enforces the locking itself (another process on the same file, say): the lock only
    orders this engine's threads.
    """

    _write_lock: threading.Lock  # set per engine by make_engine's subclass
    _holds_write_lock = False

    def begin_immediate(self) -> None:
        if not self._write_lock.acquire(timeout=SQLITE_BUSY_SECONDS):
            raise sqlite3.OperationalError("database is locked")
        self._holds_write_lock = True
        try:
            self.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._release_write_lock()
            raise

    def _release_write_lock(self) -> None:
        if self._holds_write_lock:
            self._holds_write_lock = False
            self._write_lock.release()

    def commit(self) -> None:
        try:
            super().commit()
        finally:
            self._release_write_lock()

    def rollback(self) -> None:
        try:
            super().rollback()
        finally:
            self._release_write_lock()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._release_write_lock()


def _sqlite_begin(connection: Connection) -> None:
    # IMMEDIATE takes the write lock at the start, so two transactions that read then write
    # wait for each other instead of failing on the lock upgrade. make_engine connects SQLite
    # through _SerializedConnection.
    driver = cast(_SerializedConnection, connection.connection.driver_connection)
    driver.begin_immediate()


# PostgreSQL connections, and threads working on them (see app.py). Sized for throughput on a
# small machine: each connection is a server process, and threads beyond the cores mostly
# contend for the GIL; 32 concurrent clients are served as well by 8 as by 32.
POSTGRES_POOL_SIZE = 8


def make_engine(database_url: str, extra_connections: int = 0) -> Engine:
    """Creates the engine (no schema: see storage_service.migrate). Plain `postgresql://` URLs
    use psycopg 3. `extra_connections` are added to the PostgreSQL pool for threads that
    hold one beside the worker threads (the group committer)."""
    url = make_url(database_url)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    if url.get_backend_name() == "sqlite":
        if url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        # One lock per engine, shared by its connections (see _SerializedConnection).
        factory = type(
            "SerializedConnection", (_SerializedConnection,), {"_write_lock": threading.Lock()}
        )
        engine = create_engine(url, connect_args={"check_same_thread": False, "factory": factory})
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
    else:
        # No pool_pre_ping: it costs a round trip on every checkout. A connection that died
        # in the pool fails its first statement instead; SQLAlchemy then invalidates the
        # pool's connections and run_db answers UNAVAILABLE, which clients retry.
        engine = create_engine(
            url, pool_size=POSTGRES_POOL_SIZE + extra_connections, max_overflow=0
        )
    return engine


def pool_capacity(engine: Engine) -> int:
    """How many connections the engine's pool hands out at once (at least 1)."""
    size = getattr(engine.pool, "size", None)
    overflow = getattr(engine.pool, "_max_overflow", 0)
    if not callable(size):
        return 1
    capacity: int = size() + max(overflow, 0)
    return max(1, capacity)
