"""The event runner's recheck of a task that started waiting for its player
(engine_service.events.EventRunner._recheck_later): when storage names a gateway replica for
the player a moment later, their waiting tasks are queued; storage away for a moment is asked
again, never an unhandled error. Storage is a scripted journal here (the whole path, with real
services, is in tests/test_interrupted_gives.py and tests/test_gateway_replicas.py)."""

from __future__ import annotations

import asyncio

import pytest

from engine_service import events
from engine_service.engine import BoundedExecutor
from engine_service.events import RECHECK_ATTEMPTS, EventRunner
from services.runtime.errors import Unavailable


class _Journal:
    """Answers the runner's `resume` calls in order, and records them."""

    def __init__(self, answers: list[BaseException | int]) -> None:
        self.answers = answers
        self.resumed: list[str] = []

    async def resume(self, player_id: str) -> int:
        self.resumed.append(player_id)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


async def _recheck(journal: _Journal, located: bool) -> EventRunner:
    """Runs one recheck of player `p` to its end; returns the runner."""

    async def where(player_id: str) -> bool:
        return located

    runner = EventRunner(
        None,  # type: ignore[arg-type]  # nothing is claimed, so nothing runs
        journal,  # type: ignore[arg-type]
        BoundedExecutor("event", 2, 64),
        "slot#a",
        located=where,
    )
    runner._recheck_later("p")  # noqa: SLF001
    [task] = runner._rechecks  # noqa: SLF001
    await asyncio.wait_for(task, 10)  # raises if the recheck ended in an error
    return runner


@pytest.fixture(autouse=True)
def _quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "WAITING_RECHECK_SECONDS", 0.01)


async def test_a_located_player_has_their_waiting_tasks_queued() -> None:
    journal = _Journal([1])
    runner = await _recheck(journal, located=True)
    assert journal.resumed == ["p"]
    assert runner._wake.is_set()  # noqa: SLF001 - the runner claims at once


async def test_storage_away_a_moment_is_asked_again() -> None:
    journal = _Journal([Unavailable("storage restarting"), 1])
    runner = await _recheck(journal, located=True)
    assert journal.resumed == ["p", "p"]
    assert runner._wake.is_set()  # noqa: SLF001


async def test_storage_away_for_long_is_left_to_the_next_join_without_an_error() -> None:
    journal = _Journal([Unavailable("down")] * RECHECK_ATTEMPTS)
    runner = await _recheck(journal, located=True)
    assert journal.resumed == ["p"] * RECHECK_ATTEMPTS
    assert not runner._wake.is_set()  # noqa: SLF001


async def test_a_player_nowhere_is_not_asked_for() -> None:
    journal = _Journal([])
    runner = await _recheck(journal, located=False)
    assert journal.resumed == []
    assert not runner._wake.is_set()  # noqa: SLF001
