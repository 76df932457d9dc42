"""Game write tools that honour the call id as an idempotency key (issue 20, "fewer false
EFFECT_UNKNOWN"): an event step interrupted after its intent was recorded is retried with the
same step id when its tool honours call ids, and reported EFFECT_UNKNOWN otherwise. Real
storage service (SQLite) on loopback, the engine's own TaskStore and TaskSteps. Issue 19
(no EFFECT_UNKNOWN rewards after a kill): `minecraft:item.give` honours call ids, and the
simulated world gives once per call id."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from system.engine.v1 import engine_pb2
from system.gateway.v1 import gateway_pb2

from engine_service.steps import TaskSteps
from engine_service.task_store import Claim, TaskStore
from engine_service.tools import ToolKind, ToolRegistry, ToolRegistryError, ToolSpec
from services.gamesim import world as gamesim
from services.gamesim.world import HONOURS_CALL_ID, World
from services.gateway.tool_contract import check_tools
from services.results import AgentFailure, ModuleFailure
from tests.inprocess import task_store
from tests.waiting import wait_until

LEASE = 1


def _give(honours: bool) -> ToolSpec:
    return ToolSpec(
        "mod:warp.pay",
        "Pays for a warp.",
        kind=ToolKind.GAME,
        event_allowed=True,
        honours_call_id=honours,
    )


@pytest.fixture
async def store(tmp_path: pathlib.Path) -> AsyncIterator[TaskStore]:
    async with task_store(tmp_path) as tasks:
        yield tasks


async def _claim(store: TaskStore, owner: str, task_id: str) -> Claim:
    async def claimed() -> Claim | None:
        claims = await store.claim(owner, 8, LEASE)
        return next((claim for claim in claims if claim.task.task_id == task_id), None)

    return await wait_until(claimed, timeout=15, interval=0.1, what=f"{owner} to claim {task_id}")


async def _interrupted(store: TaskStore, player: str, spec: ToolSpec) -> str:
    """A task whose first write step recorded its intent, then its replica stopped waiting
    (as if it crashed while the game server ran the call). Returns the task id."""
    task, _ = await store.create(player, "mod:warp", f"key-{player}", {}, waiting=False)
    claim = await _claim(store, "replica-a", task.task_id)
    started = asyncio.Event()

    async def never_answered(step_id: str) -> dict[str, Any]:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError

    run = asyncio.create_task(TaskSteps(store, claim).run(spec, never_answered))
    await started.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    return task.task_id


async def test_an_interrupted_step_of_an_honouring_tool_is_retried_with_its_step_id(
    store: TaskStore,
) -> None:
    task_id = await _interrupted(store, "p1", _give(honours=True))
    claim = await _claim(store, "replica-b", task_id)  # after replica-a's lease ran out
    calls: list[str] = []

    async def answered(step_id: str) -> dict[str, Any]:
        calls.append(step_id)
        return {"paid": 5}

    assert await TaskSteps(store, claim).run(_give(honours=True), answered) == {"paid": 5}
    assert calls == [f"{task_id}/0"]  # the same call id: the game server deduplicates on it


async def test_an_interrupted_step_of_any_other_write_is_effect_unknown(store: TaskStore) -> None:
    task_id = await _interrupted(store, "p2", _give(honours=False))
    claim = await _claim(store, "replica-b", task_id)
    calls: list[str] = []

    async def answered(step_id: str) -> dict[str, Any]:
        calls.append(step_id)
        return {}

    with pytest.raises(ModuleFailure) as caught:
        await TaskSteps(store, claim).run(_give(honours=False), answered)
    assert caught.value.failure is AgentFailure.EFFECT_UNKNOWN
    assert calls == []  # never repeated


def test_only_game_tools_honour_call_ids() -> None:
    registry = ToolRegistry(game_tools=())
    registry.game(_give(honours=True))

    async def handler(data: dict[str, Any]) -> dict[str, Any]:
        return {}

    with pytest.raises(ToolRegistryError, match="only game tools can honour call ids"):
        registry.server(ToolSpec("system:x", "X.", honours_call_id=True), handler)


def test_a_hello_must_honour_call_ids_where_the_catalogue_says_so() -> None:
    entry = engine_pb2.GameToolEntry(
        tool=gateway_pb2.GameTool(
            name="mod:warp.pay", event_allowed=True, honours_call_id=True, output_schema="{}"
        ),
        declared=True,
        needed_by=[engine_pb2.ToolNeed(module_id="mod:warp", required=True)],
    )
    offered = gateway_pb2.GameTool(name="mod:warp.pay", event_allowed=True)
    checked = check_tools([offered], [entry])
    assert "honours_call_id is false; the catalogue says true" in checked.problems[0].problem
    assert checked.unavailable_modules == ("mod:warp",)
    offered.honours_call_id = True
    assert check_tools([offered], [entry]).problems == ()
    # A server may promise it where the catalogue does not ask (mail.claim, say).
    (claim,) = [tool for tool in World.tools() if tool.name == "minecraft:mail.claim"]
    documented = engine_pb2.GameToolEntry(tool=claim, declared=True)
    assert not documented.tool.honours_call_id
    claim.honours_call_id = True
    assert check_tools([claim], [documented]).problems == ()
    claim.idempotent = False  # while other flags must still match
    assert "idempotent is false" in check_tools([claim], [documented]).problems[0].problem


# -- minecraft:item.give (issue 19) -------------------------------------------------------------

GIVE = "minecraft:item.give"


def test_the_catalogue_and_the_world_say_item_give_honours_call_ids() -> None:
    spec = ToolRegistry().get(GIVE)
    assert spec is not None and spec.honours_call_id and not spec.idempotent
    # The hello declares exactly the tools the world deduplicates (one list, HONOURS_CALL_ID).
    declared = {tool.name for tool in World.tools() if tool.honours_call_id}
    assert declared == HONOURS_CALL_ID == {GIVE, "minecraft:signin.claim"}


def test_a_repeated_item_give_with_one_call_id_gives_once() -> None:
    world = World()
    diamond = {"item": "minecraft:diamond", "count": 2}
    first = world.call_with_id("steve", GIVE, diamond, "task-1/0")
    assert first == {"item": "minecraft:diamond", "count": 2}
    again = world.call_with_id("steve", GIVE, {**diamond, "count": 5}, "task-1/0")
    assert again == first and world.inventory("steve")["minecraft:diamond"] == 2
    # Another call id, another player, or no call id at all: each gives.
    assert world.call_with_id("steve", GIVE, diamond, "task-2/0")["count"] == 4
    assert world.call_with_id("alex", GIVE, diamond, "task-1/0")["count"] == 2
    assert world.call_with_id("steve", GIVE, diamond, "")["count"] == 6
    assert world.call("steve", GIVE, diamond)["count"] == 8
    # A failed call is not remembered: it changed nothing, and the same id may run again.
    with pytest.raises(ValueError):
        world.call_with_id("steve", GIVE, {"item": "minecraft:diamond", "count": 0}, "task-3/0")
    assert world.call_with_id("steve", GIVE, diamond, "task-3/0")["count"] == 10
    assert world.inventory("steve")["minecraft:diamond"] == 10


def test_the_worlds_memory_of_call_ids_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gamesim, "CALL_ID_MEMORY", 2)
    world = World()
    bread = {"item": "minecraft:bread", "count": 1}
    for call_id in ("a", "b", "c"):
        world.call_with_id("steve", GIVE, bread, call_id)
    assert len(world._answers) == 2
    world.call_with_id("steve", GIVE, bread, "b")  # remembered: nothing given
    assert world.inventory("steve")["minecraft:bread"] == 12 + 3
    world.call_with_id("steve", GIVE, bread, "a")  # the oldest was forgotten: given again
    assert world.inventory("steve")["minecraft:bread"] == 12 + 4
