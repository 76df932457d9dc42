"""The event runner's recheck of a task that started waiting for its player
(engine_service.events.EventRunner._recheck_later), against a real storage service through
the engine's TaskStore: when the player is located a moment later, their waiting tasks are
queued; storage away for a moment is asked again, and away for longer is given up without an
error. (Whether the player is located is the presence lookup's answer, given here; the whole
path is in tests/test_interrupted_gives.py and tests/test_gateway_replicas.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from system.storage.v1 import journal_pb2, journal_pb2_grpc

from engine_service import events
from engine_service.engine import BoundedExecutor
from engine_service.events import RECHECK_ATTEMPTS, EventRunner
from engine_service.task_store import TaskStore
from storage_service.app import StorageApp
from storage_service.app import create_app as create_storage
from storage_service.config import StorageConfig
from tests.service_process import free_port
from tests.waiting import wait_until

PLAYER = "sim/steve"


@pytest.fixture(autouse=True)
def _quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "WAITING_RECHECK_SECONDS", 0.2)


class _Storage:
    """A storage service on a fixed port that can be stopped and started again."""

    def __init__(self, database_url: str) -> None:
        self.config = StorageConfig(
            port=free_port(), metrics_port=-1, drain_seconds=0, database_url=database_url
        )
        self.app: StorageApp | None = None

    async def start(self) -> None:
        self.app = await create_storage(self.config)
        await self.app.host.start()

    async def stop(self) -> None:
        assert self.app is not None
        await self.app.host.stop()
        await self.app.aclose()
        self.app = None


@contextlib.asynccontextmanager
async def _waiting_task(database_url: str) -> AsyncIterator[tuple[_Storage, TaskStore, str]]:
    """Storage running, the engine's TaskStore on it, and a WAITING task of PLAYER."""
    storage = _Storage(database_url)
    await storage.start()
    store = TaskStore(f"127.0.0.1:{storage.config.port}", timeout=2.0)
    try:
        task, _ = await store.create(PLAYER, "system:event", "e-1", {}, waiting=True)
        yield storage, store, task.task_id
    finally:
        await store.aclose()
        if storage.app is not None:
            await storage.stop()


def _recheck(store: TaskStore, located: bool) -> tuple[EventRunner, asyncio.Task[None]]:
    async def where(player_id: str) -> bool:
        return located

    runner = EventRunner(
        None,  # type: ignore[arg-type]  # nothing is claimed, so nothing runs
        store,
        BoundedExecutor("event", 2, 64),
        "slot#a",
        located=where,
    )
    runner._recheck_later(PLAYER)  # noqa: SLF001
    [task] = runner._rechecks  # noqa: SLF001
    return runner, task


async def _state(storage: _Storage, task_id: str) -> int:
    """The task's state as storage holds it."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{storage.config.port}") as channel:
        found = await journal_pb2_grpc.JournalServiceStub(channel).GetTask(
            journal_pb2.GetTaskRequest(task_id=task_id), timeout=5
        )
    return found.task.state


async def test_a_located_player_has_their_waiting_tasks_queued(fresh_database_url: str) -> None:
    async with _waiting_task(fresh_database_url) as (storage, store, task_id):
        runner, recheck = _recheck(store, located=True)
        await asyncio.wait_for(recheck, 10)
        assert await _state(storage, task_id) == journal_pb2.TASK_STATE_QUEUED
        assert runner._wake.is_set()  # noqa: SLF001 - the runner claims at once


async def test_storage_away_a_moment_is_asked_again(
    fresh_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with _waiting_task(fresh_database_url) as (storage, store, task_id):
        await storage.stop()
        with caplog.at_level(logging.WARNING, logger="system.engine.events"):
            runner, recheck = _recheck(store, located=True)
            await wait_until(
                lambda: "could not queue it" in caplog.text, timeout=10, what="a failed try"
            )
        await storage.start()
        await asyncio.wait_for(recheck, 10)  # raises if the recheck ended in an error
        assert await _state(storage, task_id) == journal_pb2.TASK_STATE_QUEUED
        assert runner._wake.is_set()  # noqa: SLF001


async def test_storage_away_for_long_is_given_up_without_an_error(
    fresh_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with _waiting_task(fresh_database_url) as (storage, store, task_id):
        await storage.stop()
        with caplog.at_level(logging.WARNING, logger="system.engine.events"):
            runner, recheck = _recheck(store, located=True)
            await asyncio.wait_for(recheck, 30)
        assert caplog.text.count("could not queue it") == RECHECK_ATTEMPTS
        assert not runner._wake.is_set()  # noqa: SLF001
        await storage.start()
        assert await _state(storage, task_id) == journal_pb2.TASK_STATE_WAITING


async def test_a_player_nowhere_is_not_asked_for(fresh_database_url: str) -> None:
    async with _waiting_task(fresh_database_url) as (storage, store, task_id):
        runner, recheck = _recheck(store, located=False)
        await asyncio.wait_for(recheck, 10)
        assert await _state(storage, task_id) == journal_pb2.TASK_STATE_WAITING
        assert not runner._wake.is_set()  # noqa: SLF001
