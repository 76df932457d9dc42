"""A step's intent whose answer is lost on the way back from storage (the storage replica gone
mid-call, as bench.scaleout's storage kill does) is recorded again when the step's tool may run
again (idempotent or honouring call ids): the retry finds its own intent RUNNING and the call
is sent once. Any other tool's step is not retried: the run ends storage_unavailable and the
tool is never called. A real storage service on SQLite; the fault is the answer of the first
RecordStep dropped after storage applied it (the stream's reply lost)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from engine_service.steps import TaskSteps
from engine_service.task_store import Claim, TaskStore
from services.results import AgentFailure, ModuleFailure
from tests import test_honoured_call_ids
from tests.test_honoured_call_ids import _give
from tests.waiting import wait_until

store = test_honoured_call_ids.store
"""The fixture: the engine's TaskStore over a storage service on SQLite."""


def calls_to_storage(
    store: TaskStore, lose: Callable[[str, list[str]], bool] = lambda method, called: False
) -> list[str]:
    """The methods the store sends on its journal stream from now on. A call for which
    `lose(method, called so far)` is true runs in storage and then fails UNAVAILABLE, as a
    call whose storage replica died before its answer got back."""
    client = store._calls._client
    real = client._call_once
    called: list[str] = []

    async def once(method: str, request: Any, response_type: Any, timeout: Any) -> Any:
        called.append(method)
        answer = await real(method, request, response_type, timeout)
        if lose(method, called):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "Stream removed (Socket closed)",
            )
        return answer

    client._call_once = once  # type: ignore[method-assign]
    return called


def _lose_first_record_answer(store: TaskStore) -> list[str]:
    """The first RecordStep's answer lost after storage applied it; returns the methods
    called."""
    return calls_to_storage(
        store, lambda method, called: method == "RecordStep" and called.count(method) == 1
    )


async def _claimed(store: TaskStore, player: str) -> Claim:
    task, _ = await store.create(player, "mod:warp", f"key-{player}", {}, waiting=False)

    async def claimed() -> Claim | None:
        claims = await store.claim("replica-a", 8, 30)
        return next((c for c in claims if c.task.task_id == task.task_id), None)

    return await wait_until(claimed, timeout=15, interval=0.1, what="the task claimed")


def _counting(calls: list[str]) -> Callable[[str], Awaitable[dict[str, Any]]]:
    async def call(step_id: str) -> dict[str, Any]:
        calls.append(step_id)
        return {"paid": True}

    return call


async def test_an_honouring_tools_intent_is_recorded_again_and_sent_once(
    store: TaskStore,
) -> None:
    claim = await _claimed(store, "p1")
    # A later claim: on the first, such a tool's step records no intent (decision 0036).
    claim.task.attempts = 2
    called = _lose_first_record_answer(store)
    calls: list[str] = []
    output = await TaskSteps(store, claim).run(_give(honours=True), _counting(calls))
    assert output == {"paid": True}
    assert called.count("RecordStep") == 2  # the lost answer, then the retry
    assert calls == [f"{claim.task.task_id}/0"]  # sent once, under the step's call id


async def test_any_other_tools_step_is_not_retried_and_never_called(store: TaskStore) -> None:
    claim = await _claimed(store, "p2")
    called = _lose_first_record_answer(store)
    calls: list[str] = []
    with pytest.raises(ModuleFailure) as caught:
        await TaskSteps(store, claim).run(_give(honours=False), _counting(calls))
    assert caught.value.failure is AgentFailure.STORAGE_UNAVAILABLE
    assert called.count("RecordStep") == 1 and calls == []
