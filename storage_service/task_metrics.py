"""The event backlog as metrics: how many event tasks ClaimTasks would hand out now, and how
long the oldest of them has waited, so an autoscaler can add engine replicas on queue depth
(deploy/README.md, "Scale").

Claimable is ClaimTasks's own rule (storage_service.claims): QUEUED, or RUNNING with no live
lease (its replica died). One count every `interval` seconds, by one task per storage
replica, not a counter moved at every transition: a gauge that the transitions kept would
drift with every crash between a write and its increment, and the count reads the same rows
the claims do. The count stops at `CAP` (a backlog that large scales to the maximum anyway),
so it costs at most that many index entries however far behind the engines are. Every storage
replica reports the same backlog (the table is shared): aggregate with `max`, never `sum`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable

from prometheus_client import Gauge
from sqlalchemy import DateTime, Integer, bindparam, text
from sqlalchemy.orm import Session, sessionmaker

from storage_service.claims import _RUNNABLE
from storage_service.dbcall import run_db
from storage_service.dialect import aware, utc_now

__all__ = [
    "CAP",
    "CLAIMABLE",
    "OLDEST_CLAIMABLE",
    "Backlog",
    "TaskMetrics",
    "count_claimable",
]

log = logging.getLogger("system.storage.task_metrics")

CLAIMABLE = Gauge(
    "system_storage_event_tasks_claimable",
    "Event tasks ClaimTasks would hand out now (QUEUED, or RUNNING with no live lease), "
    "counted every few seconds, at most 100000. The same on every storage replica: use max.",
)
OLDEST_CLAIMABLE = Gauge(
    "system_storage_event_tasks_claimable_oldest_seconds",
    "Seconds since the oldest claimable event task last changed state (0 when none waits).",
)
CAP = 100_000
"""The count stops here."""
INTERVAL_SECONDS = 5.0
"""How often the backlog is counted."""

_COUNT = text(
    "SELECT count(*), min(updated_at) FROM ("
    f"SELECT t.updated_at FROM journal_tasks AS t WHERE {_RUNNABLE.format(players='')} "
    "LIMIT :cap) AS claimable"
).bindparams(bindparam("now", type_=DateTime(timezone=True)), bindparam("cap", type_=Integer))


class Backlog:
    """One count of the claimable tasks."""

    def __init__(self, claimable: int, oldest: dt.datetime | None) -> None:
        self.claimable = claimable
        self.oldest = oldest
        """When the oldest claimable task last changed state; None when none waits."""

    def waited(self, now: dt.datetime) -> float:
        """Seconds the oldest has waited at `now` (0 when none waits)."""
        return 0.0 if self.oldest is None else max(0.0, (now - self.oldest).total_seconds())


def count_claimable(sessions: sessionmaker[Session], now: dt.datetime) -> Backlog:
    """Counts the claimable tasks at `now` (at most CAP)."""
    with sessions() as session:
        claimable, oldest = session.execute(_COUNT, {"now": now, "cap": CAP}).one()
    if isinstance(oldest, str):  # SQLite answers min() of a time column as its stored text
        oldest = dt.datetime.fromisoformat(oldest)
    return Backlog(int(claimable), aware(oldest) if oldest is not None else None)


class TaskMetrics:
    """Counts the backlog every `interval` seconds and sets the gauges.

    Args:
        sessions: the storage service's sessions.
        interval: seconds between counts.
        now: the clock (tests set it).
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        interval: float = INTERVAL_SECONDS,
        now: Callable[[], dt.datetime] = utc_now,
    ) -> None:
        self._sessions = sessions
        self._interval = interval
        self._now = now
        self._task: asyncio.Task[None] | None = None
        self.counts = 0
        """Counts made."""

    async def refresh(self) -> Backlog:
        """Counts once and sets the gauges."""
        now = self._now()
        backlog = await run_db(count_claimable, self._sessions, now)
        CLAIMABLE.set(backlog.claimable)
        OLDEST_CLAIMABLE.set(backlog.waited(now))
        self.counts += 1
        return backlog

    def start(self, after: asyncio.Event | None = None) -> None:
        """Counts from now on, or once `after` is set (the schema serving)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(after))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, after: asyncio.Event | None) -> None:
        if after is not None:
            await after.wait()
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - the database away, a schema not there yet
                log.debug("event backlog not counted: %s", exc)
            await asyncio.sleep(self._interval)
