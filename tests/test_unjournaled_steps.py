"""Decision 0036: on a task's first claim a game tool that honours call ids runs without an
intent stored first, and its result is stored with the task's final transition (one write for
the whole task). What must still hold: a run lost before that write is resent under the same
call ids (the game server answers them as the first calls, so nothing is given twice); an
abandoned run's results replay; a step that needs an intent stores the held results first.
Real storage service (SQLite) on loopback, the engine's own TaskStore and TaskSteps."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from system.storage.v1 import journal_pb2

from engine_service.steps import JSON_CODEC, TaskSteps
from engine_service.task_store import Claim, TaskStore
from tests import test_honoured_call_ids
from tests.inprocess import task_store
from tests.test_honoured_call_ids import _claim, _give
from tests.test_step_record_retry import calls_to_storage

store = test_honoured_call_ids.store
"""The fixture: the engine's TaskStore over a storage service on SQLite."""


class GameServer:
    """A game server that honours call ids: a repeated call id gets the first answer."""

    def __init__(self) -> None:
        self.answers: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []

    def call(self) -> Callable[[str], Awaitable[dict[str, Any]]]:
        async def call(step_id: str) -> dict[str, Any]:
            self.calls.append(step_id)
            return self.answers.setdefault(step_id, {"given": len(self.answers) + 1})

        return call


async def _first_claim(store: TaskStore, player: str) -> Claim:
    task, _ = await store.create(player, "mod:warp", f"key-{player}", {}, waiting=False)
    claim = await _claim(store, "replica-a", task.task_id)
    assert claim.task.attempts == 1
    return claim


async def _receipt(store: TaskStore, step_id: str) -> journal_pb2.StepReceipt:
    response = await store._dep.stub.GetStep(
        journal_pb2.GetStepRequest(step_id=step_id, tool="mod:warp.pay")
    )
    return response.receipt


async def test_a_first_claims_honouring_steps_are_one_write_with_the_final_transition(
    store: TaskStore,
) -> None:
    claim = await _first_claim(store, "p1")
    task_id = claim.task.task_id
    called = calls_to_storage(store)
    game = GameServer()
    steps = TaskSteps(store, claim)
    assert await steps.run(_give(honours=True), game.call()) == {"given": 1}
    assert await steps.run(_give(honours=True), game.call()) == {"given": 2}
    assert called == []  # no intent before either call
    await steps.finish(journal_pb2.TASK_STATE_SUCCEEDED, None)
    assert called == ["Commit"]
    assert game.calls == [f"{task_id}/0", f"{task_id}/1"]
    for position, given in ((0, 1), (1, 2)):
        receipt = await _receipt(store, f"{task_id}/{position}")
        assert receipt.state == journal_pb2.STEP_STATE_DONE
        assert receipt.codec_id == JSON_CODEC and receipt.result == b'{"given":%d}' % given
    task = (await store._dep.stub.GetTask(journal_pb2.GetTaskRequest(task_id=task_id))).task
    assert task.state == journal_pb2.TASK_STATE_SUCCEEDED


async def test_a_run_lost_before_its_write_is_resent_under_the_same_call_ids(
    store: TaskStore,
) -> None:
    claim = await _first_claim(store, "p2")
    task_id = claim.task.task_id
    game = GameServer()
    lost = TaskSteps(store, claim)
    assert await lost.run(_give(honours=True), game.call()) == {"given": 1}
    # The replica dies here: nothing was stored. The next claim comes after the lease ran out.
    again = await _claim(store, "replica-b", task_id)
    assert again.task.attempts == 2
    steps = TaskSteps(store, again)
    assert await steps.run(_give(honours=True), game.call()) == {"given": 1}  # the first answer
    assert await steps.run(_give(honours=True), game.call()) == {"given": 2}
    await steps.finish(journal_pb2.TASK_STATE_SUCCEEDED, None)
    assert game.calls == [f"{task_id}/0", f"{task_id}/0", f"{task_id}/1"]
    assert len(game.answers) == 2  # each reward given once


async def test_an_abandoned_runs_results_are_stored_and_replay(store: TaskStore) -> None:
    claim = await _first_claim(store, "p3")
    task_id = claim.task.task_id
    game = GameServer()
    stopped = TaskSteps(store, claim)
    assert await stopped.run(_give(honours=True), game.call()) == {"given": 1}
    await stopped.abandon()
    assert (await _receipt(store, f"{task_id}/0")).state == journal_pb2.STEP_STATE_DONE
    again = await _claim(store, "replica-b", task_id)
    assert await TaskSteps(store, again).run(_give(honours=True), game.call()) == {"given": 1}
    assert game.calls == [f"{task_id}/0"]  # replayed from its receipt, not resent


async def test_a_step_that_needs_an_intent_stores_the_held_results_first(
    store: TaskStore,
) -> None:
    claim = await _first_claim(store, "p4")
    task_id = claim.task.task_id
    called = calls_to_storage(store)
    game = GameServer()
    # The recorded step's result is held until `finish`: a short linger would let its timer
    # store it while the test reads the receipt (CI saw it DONE on a slow machine).
    steps = TaskSteps(store, claim, linger=3600.0)
    await steps.run(_give(honours=True), game.call())
    await steps.run(_give(honours=False), game.call())  # its intent is stored before it runs
    assert called == ["Commit", "RecordStep"]
    assert (await _receipt(store, f"{task_id}/0")).state == journal_pb2.STEP_STATE_DONE
    assert (await _receipt(store, f"{task_id}/1")).state == journal_pb2.STEP_STATE_RUNNING
    await steps.finish(journal_pb2.TASK_STATE_SUCCEEDED, None)
    assert (await _receipt(store, f"{task_id}/1")).state == journal_pb2.STEP_STATE_DONE


@pytest.fixture
async def cramped(tmp_path: pathlib.Path) -> AsyncIterator[TaskStore]:
    """A storage service that keeps one receipt a player."""
    async with task_store(tmp_path, receipt_max_entries=1) as tasks:
        yield tasks


async def test_a_task_ends_though_its_steps_receipts_find_no_room(cramped: TaskStore) -> None:
    """The gives ran, so the task must end SUCCEEDED: with the player's receipts full the
    results are left out (a resend would be answered as the first call) and the move goes."""
    claim = await _first_claim(cramped, "p5")
    game = GameServer()
    steps = TaskSteps(cramped, claim)
    await steps.run(_give(honours=True), game.call())
    await steps.run(_give(honours=True), game.call())
    await steps.finish(journal_pb2.TASK_STATE_SUCCEEDED, None)
    request = journal_pb2.GetTaskRequest(task_id=claim.task.task_id)
    task = (await cramped._dep.stub.GetTask(request)).task
    assert task.state == journal_pb2.TASK_STATE_SUCCEEDED
    assert len(game.answers) == 2
