"""With `run_migrations` off, storage changes no schema: it answers NOT_SERVING until the
database is at the revision its build needs (or a later release's additive one), then serves
(decision 0028). On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import Engine, text

from storage_service.app import SERVICE_NAME, StorageApp, create_app
from storage_service.config import StorageConfig
from storage_service.db import make_engine
from storage_service.migrate import SchemaVerdict, head_revision, schema_state, upgrade
from tests.waiting import holds_for

ROOT = Path(__file__).resolve().parent.parent
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _migrate(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m storage_service.migrate`, as the Kubernetes Job runs it."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SYSTEM_")},
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gen")]),
        "SYSTEM_STORAGE_DATABASE_URL": database_url,
    }
    return subprocess.run(
        [sys.executable, "-m", "storage_service.migrate", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@asynccontextmanager
async def _storage(database_url: str) -> AsyncIterator[StorageApp]:
    config = StorageConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=-1,
        drain_seconds=0,
        grace_seconds=1,
        database_url=database_url,
        run_migrations=False,
        schema_poll_seconds=0.05,
    )
    app = await create_app(config)
    try:
        await app.host.start()
        yield app
    finally:
        await app.host.stop()
        await app.aclose()


async def _health(app: StorageApp, service: str = SERVICE_NAME) -> int:
    async with grpc.aio.insecure_channel(app.host.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        status: int = reply.status
        return status


async def _not_serving(app: StorageApp) -> bool:
    return await _health(app) == NOT_SERVING


def _with_engine(database_url: str, act: Callable[[Engine], None]) -> None:
    engine = make_engine(database_url)
    try:
        act(engine)
    finally:
        engine.dispose()


async def test_waits_for_the_migration_then_serves(fresh_database_url: str) -> None:
    async with _storage(fresh_database_url) as app:
        # It keeps polling and keeps out: not serving over several polls.
        await holds_for(lambda: _not_serving(app), 0.3, what="the storage not serving")
        assert await _health(app, "") == SERVING  # alive: probes of the process pass
        assert not app.ready.is_set()
        check = await asyncio.to_thread(_migrate, fresh_database_url, "--check")
        assert check.returncode == 1, check.stdout + check.stderr
        assert "empty" in check.stdout
        done = await asyncio.to_thread(_migrate, fresh_database_url)
        assert done.returncode == 0, done.stderr
        await asyncio.wait_for(app.ready.wait(), 30)
        assert await _health(app) == SERVING
        assert app.schema is not None and app.schema.verdict is SchemaVerdict.CURRENT
        entries, _ = await asyncio.to_thread(app.knowledge.list_entries, "", 10)
        assert entries, "the starter knowledge is written once the schema is there"
    check = await asyncio.to_thread(_migrate, fresh_database_url, "--check")
    assert check.returncode == 0, check.stdout + check.stderr


async def test_serves_at_once_on_a_current_schema(fresh_database_url: str) -> None:
    _with_engine(fresh_database_url, upgrade)
    async with _storage(fresh_database_url) as app:
        await asyncio.wait_for(app.ready.wait(), 10)
        assert await _health(app) == SERVING


def _pretend_newer(engine: Engine) -> None:
    """What a later release's additive migration leaves: a revision this build does not
    know, a table and a column it has never heard of."""
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999_later'"))
        connection.execute(text("CREATE TABLE later_things (id INTEGER PRIMARY KEY)"))
        connection.execute(text("ALTER TABLE gateway_replicas ADD COLUMN later_column INTEGER"))


async def test_serves_on_a_later_releases_additive_schema(fresh_database_url: str) -> None:
    _with_engine(fresh_database_url, upgrade)
    _with_engine(fresh_database_url, _pretend_newer)
    async with _storage(fresh_database_url) as app:
        await asyncio.wait_for(app.ready.wait(), 10)
        assert await _health(app) == SERVING
        assert app.schema is not None and app.schema.verdict is SchemaVerdict.NEWER


def test_schema_verdicts(fresh_database_url: str) -> None:
    engine = make_engine(fresh_database_url)
    try:
        head = head_revision()
        assert head is not None
        assert schema_state(engine).verdict is SchemaVerdict.EMPTY
        upgrade(engine, "0007")
        older = schema_state(engine)
        assert older.verdict is SchemaVerdict.OLDER and not older.verdict.serves
        assert older.current == ("0007",) and older.head == head
        assert "0007" in older.describe() and head in older.describe()
        upgrade(engine)
        assert schema_state(engine).verdict is SchemaVerdict.CURRENT
        _pretend_newer(engine)
        assert schema_state(engine).verdict is SchemaVerdict.NEWER
        with engine.begin() as connection:  # a later release that dropped what this one uses
            connection.execute(text("DROP TABLE gateway_replicas"))
        incompatible = schema_state(engine)
        assert incompatible.verdict is SchemaVerdict.INCOMPATIBLE
        assert not incompatible.verdict.serves
        assert "gateway_replicas" in incompatible.missing
    finally:
        engine.dispose()


async def test_a_refused_schema_keeps_it_out(fresh_database_url: str) -> None:
    _with_engine(fresh_database_url, lambda engine: upgrade(engine, "0007"))
    async with _storage(fresh_database_url) as app:
        await holds_for(lambda: _not_serving(app), 0.3, what="the storage not serving")
        await asyncio.to_thread(_with_engine, fresh_database_url, upgrade)
        await asyncio.wait_for(app.ready.wait(), 10)
        assert await _health(app) == SERVING
