"""Lease calls on PostgreSQL from the event loop (storage_service.async_leases): the same rules
and answers as the threaded calls (one set of rules, two drivers), arguments checked before
any connection, an unreachable database is UNAVAILABLE, and a connection the server dropped
is replaced by the next call."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from services.runtime.errors import FailedPrecondition, InvalidArgument, Unavailable
from storage_service import async_leases
from storage_service.async_leases import AsyncLeases
from storage_service.db import make_engine
from storage_service.journal import JournalBounds, JournalStore
from storage_service.migrate import upgrade

pytestmark = pytest.mark.postgres


@pytest.fixture
def engine(postgres_url: str) -> Iterator[Engine]:
    engine = make_engine(postgres_url)
    upgrade(engine)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def store(engine: Engine) -> JournalStore:
    return JournalStore(sessionmaker(engine, expire_on_commit=False), JournalBounds())


@pytest.fixture
async def leases(store: JournalStore, engine: Engine) -> AsyncIterator[AsyncLeases]:
    made = AsyncLeases(store, engine)
    try:
        yield made
    finally:
        await made.aclose()


def _name() -> str:
    return f"player:{uuid.uuid4().hex[:12]}"


async def test_the_same_answers_as_the_threaded_calls(
    leases: AsyncLeases, store: JournalStore
) -> None:
    async def on_the_loop(name: str) -> list[object]:
        seen: list[object] = []
        first = await leases.take_lease(name, "a", 30)
        seen.append(first.previous_token == 0)
        try:
            await leases.take_lease(name, "b", 30)
        except FailedPrecondition as exc:
            seen.append(exc.message.split(" until ")[0].replace(name, "N"))
        renewed = await leases.renew_lease(name, "a", first.lease.token, 30)
        seen.append(renewed.token == first.lease.token)
        seen.append(await leases.release_lease(name, "a", first.lease.token))
        seen.append(await leases.release_lease(name, "a", first.lease.token))
        again = await leases.take_lease(name, "b", 30)
        seen.append(again.previous_token == first.lease.token)
        try:
            await leases.renew_lease(name, "a", first.lease.token, 30)
        except FailedPrecondition as exc:
            seen.append(exc.message.replace(name, "N").split(" with token")[0])
        return seen

    def threaded(name: str) -> list[object]:
        seen: list[object] = []
        first = store.take_lease(name, "a", 30)
        seen.append(first.previous_token == 0)
        try:
            store.take_lease(name, "b", 30)
        except FailedPrecondition as exc:
            seen.append(exc.message.split(" until ")[0].replace(name, "N"))
        renewed = store.renew_lease(name, "a", first.lease.token, 30)
        seen.append(renewed.token == first.lease.token)
        seen.append(store.release_lease(name, "a", first.lease.token))
        seen.append(store.release_lease(name, "a", first.lease.token))
        again = store.take_lease(name, "b", 30)
        seen.append(again.previous_token == first.lease.token)
        try:
            store.renew_lease(name, "a", first.lease.token, 30)
        except FailedPrecondition as exc:
            seen.append(exc.message.replace(name, "N").split(" with token")[0])
        return seen

    expected = [True, "lease 'N' is held by 'a'", True, True, False, True]
    expected.append("lease 'N' is held by 'b'")
    assert await on_the_loop(_name()) == threaded(_name()) == expected


async def test_arguments_are_checked_before_any_connection(store: JournalStore) -> None:
    nowhere = make_engine("postgresql+psycopg://postgres@127.0.0.1:1/none")  # nothing listens
    leases = AsyncLeases(store, nowhere)
    with pytest.raises(InvalidArgument, match="name is required"):
        await leases.take_lease("", "a", 30)
    with pytest.raises(InvalidArgument, match="ttl_seconds"):
        await leases.renew_lease("n", "a", 1, 0)
    with pytest.raises(InvalidArgument, match="token is required"):
        await leases.release_lease("n", "a", 0)
    # A valid call needs the database, which is not there: UNAVAILABLE, retried by clients.
    with pytest.raises(Unavailable):
        await leases.take_lease("n", "a", 30)
    await leases.aclose()
    nowhere.dispose()


async def test_a_connection_the_server_dropped_is_replaced(
    leases: AsyncLeases, postgres_url: str
) -> None:
    name = _name()
    first = await leases.take_lease(name, "a", 30)
    # The server ends every other session on this database (a restart, an operator).
    conninfo = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as admin:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    with pytest.raises(Unavailable):
        await leases.release_lease(name, "a", first.lease.token)
    # The next call opens a new connection: the lease is still held and given back now.
    assert await leases.release_lease(name, "a", first.lease.token) is True


async def test_a_refused_acquisition_keeps_its_connection(leases: AsyncLeases) -> None:
    name = _name()
    await leases.take_lease(name, "a", 30)
    for _ in range(3):
        with pytest.raises(FailedPrecondition):
            await leases.take_lease(name, "b", 30)
    assert len(leases._connections._idle) == 1  # noqa: SLF001 - one connection served all


async def test_lease_changes_do_not_wait_for_the_wal_flush(leases: AsyncLeases) -> None:
    """Decision 0010: the lease connections commit asynchronously (visible at once)."""
    await leases.take_lease(_name(), "a", 30)
    async with leases._connections.connection() as connection:  # noqa: SLF001
        cursor = await connection.execute("SHOW synchronous_commit")
        assert await cursor.fetchone() == ("off",)


async def test_a_database_that_does_not_answer_is_unavailable_in_time(
    store: JournalStore, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease call stuck on a silent server gives its connection up and answers
    UNAVAILABLE instead of holding one of the few connections for ever."""
    monkeypatch.setattr(async_leases, "CALL_SECONDS", 0.2)
    leases = AsyncLeases(store, engine)
    try:
        name = _name()
        blocker = await psycopg.AsyncConnection.connect(
            engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        )
        try:
            # Another session holds the table, so the lease statement waits on it.
            await blocker.execute("LOCK TABLE leases IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(Unavailable, match="did not answer AcquireLease"):
                await leases.take_lease(name, "a", 30)
        finally:
            await blocker.rollback()
            await blocker.close()
        assert (await leases.take_lease(name, "a", 30)).previous_token == 0
    finally:
        await leases.aclose()
