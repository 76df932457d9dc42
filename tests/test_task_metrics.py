"""The event backlog gauges (storage_service.task_metrics) on SQLite and PostgreSQL: they count
what ClaimTasks would hand out (QUEUED, or RUNNING with a lapsed lease) and nothing else, say
how long the oldest waited, stop at the cap, and the storage service counts from start."""

from __future__ import annotations

import pathlib

import pytest
from google.protobuf import struct_pb2
from prometheus_client import REGISTRY
from sqlalchemy.orm import Session, sessionmaker
from system.storage.v1 import journal_pb2

from storage_service import task_metrics
from storage_service.config import StorageConfig
from storage_service.journal import JournalBounds, JournalStore
from storage_service.task_metrics import TaskMetrics, count_claimable
from tests.test_journal import Clock
from tests.waiting import wait_until

TS = journal_pb2.TaskState
QUEUED, WAITING = TS.TASK_STATE_QUEUED, TS.TASK_STATE_WAITING
MODULE = "system:sign_in"


def _queue(store: JournalStore, key: str, state: int = QUEUED) -> None:
    _, created, _ = store.create_task("sim/steve", MODULE, struct_pb2.Struct(), key, state)
    assert created


async def test_the_gauge_counts_what_a_claim_would_hand_out(
    sessions: sessionmaker[Session],
) -> None:
    clock = Clock()
    store = JournalStore(sessions, JournalBounds(), clock)
    metrics = TaskMetrics(sessions, now=clock)
    started = clock.now
    for key in ("e-1", "e-2", "e-3"):
        _queue(store, key)
        clock.advance(1)
    _queue(store, "e-4", WAITING)  # waits for its player: no engine can run it
    backlog = await metrics.refresh()
    assert backlog.claimable == 3 and backlog.oldest == started
    assert REGISTRY.get_sample_value("system_storage_event_tasks_claimable") == 3
    assert REGISTRY.get_sample_value("system_storage_event_tasks_claimable_oldest_seconds") == 3

    # Two are claimed: held under live leases, they are not claimable.
    claimed = store.claim_tasks("engine-a", max_tasks=2, lease_seconds=30)
    assert len(claimed) == 2
    assert (await metrics.refresh()).claimable == 1
    assert REGISTRY.get_sample_value("system_storage_event_tasks_claimable") == 1

    # Their replica died: once the leases lapse they are claimable again.
    clock.advance(31)
    assert count_claimable(sessions, clock.now).claimable == 3
    assert len(store.claim_tasks("engine-b", max_tasks=10, lease_seconds=30)) == 3
    after = await metrics.refresh()
    assert after.claimable == 0 and after.oldest is None
    assert REGISTRY.get_sample_value("system_storage_event_tasks_claimable_oldest_seconds") == 0


def test_the_count_stops_at_the_cap(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    store = JournalStore(sessions, JournalBounds(), clock)
    for key in ("e-1", "e-2", "e-3"):
        _queue(store, key)
    monkeypatch.setattr(task_metrics, "CAP", 2)
    assert count_claimable(sessions, clock.now).claimable == 2


async def test_the_storage_service_counts_the_backlog_once_it_serves(
    tmp_path: pathlib.Path,
) -> None:
    from storage_service.app import create_app

    app = await create_app(
        StorageConfig(
            database_url=f"sqlite:///{tmp_path / 'storage.db'}",
            port=0,
            metrics_port=-1,
            starter_knowledge=False,
        )
    )
    try:
        assert app.task_metrics.counts == 0  # not before it serves
        await app.host.start()
        await wait_until(lambda: app.task_metrics.counts > 0, what="the backlog counted")
    finally:
        await app.host.stop()
        await app.aclose()
