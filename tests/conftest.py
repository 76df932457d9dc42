"""Shared fixtures: a throwaway PostgreSQL database per test session, made and dropped here."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

import services  # noqa: F401 - turns gRPC fork support off before any gRPC import

DEFAULT_DSN = "postgresql://127.0.0.1:5432/test"

# A test stuck where pytest-timeout's signal cannot reach it (a C call that never returns to
# Python) would otherwise hold the whole run until CI's own limit: after this long, every
# thread's stack is printed and the run ends, so the log says where it stuck.
WATCHDOG_SECONDS = 600


@pytest.fixture(autouse=True)
def _watchdog() -> Iterator[None]:
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _admin_url() -> str:
    url = make_url(os.environ.get("TEST_POSTGRES_DSN", DEFAULT_DSN))
    return url.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


@contextlib.contextmanager
def _postgres_database() -> Iterator[str]:
    """Makes a PostgreSQL database, yields its URL and drops it. The server comes from
    TEST_POSTGRES_DSN (default: the local server, database `test`); the tests never touch
    that database's own tables, only the one made here."""
    admin = create_engine(_admin_url(), isolation_level="AUTOCOMMIT")
    name = f"system_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001 - any connection failure means no server
        admin.dispose()
        pytest.fail(f"PostgreSQL at TEST_POSTGRES_DSN is not reachable: {exc}")
    try:
        yield make_url(_admin_url()).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """URL of a fresh PostgreSQL database for one test module, dropped after it."""
    with _postgres_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_database_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """Like `database_url`, but a new PostgreSQL database for every test: for tests whose
    leftovers (say, unfinished tasks a later engine would claim) must not reach the next."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'storage.db'}"
        return
    with _postgres_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path) -> str:  # type: ignore[no-untyped-def]
    """Each test that takes this runs once on a SQLite file and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'storage.db'}"
    return request.getfixturevalue("postgres_url")


_MIGRATED: set[str] = set()
"""The PostgreSQL databases this process has migrated (each a test module's: postgres_url)."""


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """The storage schema on `database_url`, every table emptied first: the PostgreSQL
    database is shared by the module's tests, and ClaimTasks, say, takes any player's
    runnable task. On PostgreSQL the schema is the migrations' (once a database), as the
    storage service makes it: a module whose tests also start the service on that database
    would otherwise have its migrations find create_all's tables in the way, depending on
    which test ran first. A SQLite file is new for each test and gets create_all."""
    from storage_service.db import Base, make_engine
    from storage_service.dialect import is_postgresql
    from storage_service.migrate import upgrade

    made = make_engine(database_url)
    if not is_postgresql(made):
        Base.metadata.create_all(made)
    elif database_url not in _MIGRATED:
        upgrade(made)
        _MIGRATED.add(database_url)
    with made.begin() as connection:
        for table in reversed(Base.metadata.sorted_tables):
            connection.execute(table.delete())
    try:
        yield made
    finally:
        made.dispose()


@pytest.fixture
def sessions(engine: Engine) -> sessionmaker[Session]:
    """Sessions on `engine`, as the storage service makes them."""
    return sessionmaker(engine, expire_on_commit=False)


@pytest.fixture
def statements(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every statement psycopg sends from now on (SQLAlchemy's and the raw cursor's alike); a
    test that counts them is skipped on SQLite, where a statement costs no round trip."""
    if engine.dialect.name != "postgresql":
        pytest.skip("counts PostgreSQL's statements (psycopg's cursor)")
    sent: list[str] = []
    execute, executemany = psycopg.Cursor.execute, psycopg.Cursor.executemany

    def counted_execute(self: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(str(query))
        return execute(self, query, *args, **kwargs)

    def counted_executemany(
        self: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any
    ) -> Any:
        sent.append(str(query))
        return executemany(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", counted_execute)
    monkeypatch.setattr(psycopg.Cursor, "executemany", counted_executemany)
    yield sent
