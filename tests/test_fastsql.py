"""FastStatement: a Core statement run on the driver's cursor behaves as SQLAlchemy would run
it (parameters and rows converted by the column types, errors wrapped the same way), on
SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import pytest
from sqlalchemy import (
    Column,
    DateTime,
    Engine,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    bindparam,
    insert,
    select,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from storage_service.db import make_engine
from storage_service.dbcall import is_unavailable
from storage_service.fastsql import FastStatement, pipelined

metadata = MetaData()
things = Table(
    "fastsql_things",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(32), unique=True),
    Column("data", LargeBinary, nullable=True),
    Column("at", DateTime(timezone=True)),
)
WHEN = dt.datetime(2030, 1, 2, 3, 4, 5, 600_000, tzinfo=dt.UTC)
INSERT = FastStatement(insert(things), column_keys=["id", "name", "data", "at"])
RENAME = FastStatement(
    update(things)
    .where(things.c.id == bindparam("p_id", type_=Integer))
    .values(name=bindparam("p_name", type_=String))
    .returning(things.c.id, things.c.name, things.c.data, things.c.at)
)
FIND = FastStatement(
    select(things.c.name, things.c.at).where(things.c.at >= bindparam("p_at", type_=DateTime))
)


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    metadata.drop_all(engine)
    metadata.create_all(engine)
    try:
        yield engine
    finally:
        metadata.drop_all(engine)
        engine.dispose()


def _aware(value: dt.datetime) -> dt.datetime:
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def test_rows_and_counts_match_sqlalchemy(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        inserted = INSERT.execute(session, {"id": 1, "name": "a", "data": b"\x00\x01", "at": WHEN})
        assert inserted.rowcount == 1 and inserted.rows == []
        renamed = RENAME.execute(session, {"p_id": 1, "p_name": "b"})
        assert renamed.rowcount == 1
        row = renamed.first()
        assert row is not None
        assert (row[0], row[1], bytes(row[2]), _aware(row[3])) == (1, "b", b"\x00\x01", WHEN)
        assert RENAME.execute(session, {"p_id": 2, "p_name": "c"}).first() is None
        found = FIND.execute(session, {"p_at": WHEN - dt.timedelta(seconds=1)}).rows
        assert [(name, _aware(at)) for name, at in found] == [("b", WHEN)]
    # What it wrote reads back the same through SQLAlchemy: the datetime was stored as
    # SQLAlchemy stores it (text on SQLite), inside the session's transaction.
    with engine.connect() as connection:
        stored = connection.execute(select(things)).one()
    assert (stored.name, _aware(stored.at)) == ("b", WHEN)


def test_driver_errors_become_sqlalchemy_errors(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        INSERT.execute(session, {"id": 1, "name": "a", "data": None, "at": WHEN})
        with pytest.raises(sa_exc.IntegrityError) as raised:
            INSERT.execute(session, {"id": 2, "name": "a", "data": None, "at": WHEN})
        session.rollback()
    assert not is_unavailable(raised.value)  # a bug or a race, not an outage


def test_a_statement_rolled_back_with_its_session_leaves_nothing(engine: Engine) -> None:
    with Session(engine) as session:
        with session.begin():
            INSERT.execute(session, {"id": 1, "name": "a", "data": None, "at": WHEN})
            session.rollback()
        with session.begin():
            assert FIND.execute(session, {"p_at": WHEN}).rows == []


def test_statements_sent_in_a_pipeline_answer_in_order(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        with pipelined(session):
            inserted = [
                INSERT.send(session, {"id": n, "name": f"n{n}", "data": None, "at": WHEN})
                for n in range(3)
            ]
            renamed = RENAME.send(session, {"p_id": 1, "p_name": "one"})
            missing = RENAME.send(session, {"p_id": 9, "p_name": "nine"})
        assert [sent.result().rowcount for sent in inserted] == [1, 1, 1]
        row = renamed.result().first()
        assert row is not None and row[1] == "one"  # it saw the insert sent before it
        assert missing.result().first() is None
        # Cursors are reused once read, and read again correctly.
        found = FIND.execute(session, {"p_at": WHEN}).rows
        assert sorted(name for name, _ in found) == ["n0", "n2", "one"]


def test_a_failed_statement_in_a_pipeline_fails_it_wrapped(engine: Engine) -> None:
    with Session(engine) as session:
        session.begin()
        with pytest.raises(sa_exc.IntegrityError), pipelined(session):
            INSERT.send(session, {"id": 1, "name": "a", "data": None, "at": WHEN})
            INSERT.send(session, {"id": 2, "name": "a", "data": None, "at": WHEN})
            RENAME.send(session, {"p_id": 1, "p_name": "b"})
        session.rollback()
        with session.begin():
            assert FIND.execute(session, {"p_at": WHEN}).rows == []
