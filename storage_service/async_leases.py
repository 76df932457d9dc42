"""The lease calls on PostgreSQL, run on the event loop (psycopg's async connections) instead
of a worker thread.

A player's lease is taken before every interactive run, so `AcquireLease` is on every
request's critical path, and it is one short statement. Handed to a worker thread, its wait
was mostly the hand-over: a thread woken to run it and the event loop woken again for its
answer cost about as much as the statement (measured on this 2-core machine: 1.0-1.5 ms for
the statement run directly, 1.9-2.1 ms through the thread). Here the statement is sent from
the event loop on one of a few autocommit connections of its own, and the loop goes on with
other calls while the database answers. The rules are those of storage_service.leases
(`acquire_steps`, `renew_steps`, `release_steps`); only the driver differs. SQLite keeps the
thread: its driver has no asynchronous form.

These connections commit without waiting for the WAL flush (`synchronous_commit = off`,
decision 0010): a lease change is seen by everyone at once, and only a database crash can
undo the last fraction of a second of them, which to a holder looks like a lease that lapsed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from sqlalchemy.engine import Dialect, Engine
from system.storage.v1 import journal_pb2

from services.runtime.errors import ServiceError, Unavailable
from storage_service.dbcall import map_unavailable, run_db
from storage_service.dialect import is_postgresql
from storage_service.journal import JournalStore
from storage_service.leases import LeaseSteps, acquire_steps, release_steps, renew_steps

__all__ = ["AsyncConnections", "AsyncLeases", "Leases", "ThreadedLeases", "leases_for"]

CONNECTIONS = 4
"""Connections for lease calls: one statement each, so a few serve many calls in flight."""
LEASE_SESSION = "-c synchronous_commit=off"
"""What the lease connections set for their session (decision 0010)."""
CONNECT_SECONDS = 5
"""How long opening a lease connection may take (a database that drops packets)."""
CALL_SECONDS = 10.0
"""How long one lease call may wait for the database before it answers UNAVAILABLE: a call
stuck on a silent server must not hold one of the few connections for ever."""


class AsyncConnections:
    """A few autocommit psycopg AsyncConnections to one database, opened when first needed;
    one that failed is closed and replaced by the next call's."""

    def __init__(self, conninfo: str, size: int = CONNECTIONS) -> None:
        self._conninfo = conninfo
        self._slots = asyncio.Semaphore(size)
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._closed = False

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        async with self._slots:
            if self._closed:
                raise psycopg.OperationalError("the lease connections are closed")
            connection = self._idle.pop() if self._idle else None
            if connection is None or connection.closed:
                connection = await psycopg.AsyncConnection.connect(
                    self._conninfo,
                    autocommit=True,
                    options=LEASE_SESSION,
                    connect_timeout=CONNECT_SECONDS,
                )
            reusable = False
            try:
                yield connection
                reusable = True
            except ServiceError:
                reusable = True  # the call's answer (a lease held by another, say)
                raise
            finally:
                # A driver error or a cancel may have left it broken or mid-result.
                if reusable and not self._closed:
                    self._idle.append(connection)
                else:
                    await connection.close()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.close()


class ThreadedLeases:
    """AcquireLease, RenewLease and ReleaseLease of `store` on a worker thread (SQLite, whose
    driver has no asynchronous form): the same interface as AsyncLeases."""

    def __init__(self, store: JournalStore) -> None:
        self._store = store

    async def take_lease(
        self, name: str, owner: str, ttl_seconds: int
    ) -> journal_pb2.AcquireLeaseResponse:
        return await run_db(self._store.take_lease, name, owner, ttl_seconds)

    async def renew_lease(
        self, name: str, owner: str, token: int, ttl_seconds: int
    ) -> journal_pb2.Lease:
        return await run_db(self._store.renew_lease, name, owner, token, ttl_seconds)

    async def release_lease(self, name: str, owner: str, token: int) -> bool:
        return await run_db(self._store.release_lease, name, owner, token)

    async def aclose(self) -> None:
        return None


class AsyncLeases:
    """AcquireLease, RenewLease and ReleaseLease of `store`, on the event loop.

    Raises what the store's methods raise (typed errors), and Unavailable when the database
    cannot be reached (as storage_service.dbcall maps it for the threaded calls)."""

    def __init__(self, store: JournalStore, engine: Engine) -> None:
        self._store = store
        self._dialect: Dialect = engine.dialect
        url = engine.url.set(drivername="postgresql")
        self._connections = AsyncConnections(url.render_as_string(hide_password=False))

    async def take_lease(
        self, name: str, owner: str, ttl_seconds: int
    ) -> journal_pb2.AcquireLeaseResponse:
        steps = acquire_steps(name, owner, ttl_seconds, self._store.now(), sqlite=False)
        return await self._run(steps, "AcquireLease")  # type: ignore[no-any-return]

    async def renew_lease(
        self, name: str, owner: str, token: int, ttl_seconds: int
    ) -> journal_pb2.Lease:
        steps = renew_steps(name, owner, token, ttl_seconds, self._store.now())
        return await self._run(steps, "RenewLease")  # type: ignore[no-any-return]

    async def release_lease(self, name: str, owner: str, token: int) -> bool:
        return await self._run(release_steps(name, owner, token), "ReleaseLease")  # type: ignore[no-any-return]

    async def _run(self, steps: LeaseSteps, where: str) -> Any:
        statement, params = next(steps)  # checks the arguments before any connection

        async def run() -> Any:
            nonlocal statement, params
            async with self._connections.connection() as connection:
                while True:
                    result = await statement.execute_async(connection, self._dialect, params)
                    try:
                        statement, params = steps.send(result)
                    except StopIteration as done:
                        return done.value

        try:
            return await asyncio.wait_for(run(), CALL_SECONDS)
        except TimeoutError:
            raise Unavailable(
                f"the database did not answer {where} within {CALL_SECONDS:.0f} s; "
                "retry with the same request"
            ) from None
        except psycopg.Error as error:
            mapped = map_unavailable(error, where)
            if mapped is error:
                raise
            raise mapped from error

    async def aclose(self) -> None:
        await self._connections.aclose()


Leases = ThreadedLeases | AsyncLeases


def leases_for(store: JournalStore, engine: Engine) -> Leases:
    """The lease calls' driver for the engine's database: the event loop on PostgreSQL, a
    worker thread elsewhere."""
    if is_postgresql(engine):
        return AsyncLeases(store, engine)
    return ThreadedLeases(store)
