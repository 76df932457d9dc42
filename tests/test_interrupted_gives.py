"""Issue 19: a give in flight when its gateway replica stops (decision 0033). Two gateway
replicas over one storage and one engine, real gRPC servers on loopback
(`running_chain(gateway_replicas=2)`). The advancement reward's two gives go out together
(`ExecutionContext.tools`); the game server runs them on replica A, but A stops before the
first one's answer gets back: the engine's call fails UNAVAILABLE.

`minecraft:item.give` honours call ids, so the task waits for its player and, once the game
server has reconnected to replica B, resends the give under the same call id: the world
answers it as the first call, the task ends SUCCEEDED and the reward is given once. A tool that
does not honour call ids (the same give, its spec changed on the engine) still ends
EFFECT_UNKNOWN. Below, the step journal's rules alone: a lost answer waits and is resent under
its call id, an undelivered resend keeps its receipt RUNNING, and the waiting is bounded."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2
from system.storage.v1 import journal_pb2, journal_pb2_grpc

from engine_service import tools as engine_tools
from engine_service.steps import RESEND_ATTEMPTS, ResendLater, TaskSteps
from engine_service.task_store import Claim, TaskStore
from services.gamesim.client import GameServerClient
from services.gamesim.world import World
from services.results import AgentFailure, ModuleFailure, NotDelivered
from tests import test_gateway_replicas, test_honoured_call_ids
from tests.inprocess import SERVER_ID, Chain
from tests.test_honoured_call_ids import _give
from tests.waiting import holds_for, wait_until

STEVE = f"{SERVER_ID}/steve"
GIVE = "minecraft:item.give"
DIAMOND = {"advancement": "minecraft:story/mine_diamond"}
REWARD = {"minecraft:diamond": 1, "minecraft:experience_bottle": 5}

chain = test_gateway_replicas.chain
"""The fixture: two gateway replicas (the engine's own target is replica B)."""
store = test_honoured_call_ids.store
"""The fixture: the engine's TaskStore over a storage service on SQLite."""


class LosesFirstGiveAnswer(GameServerClient):
    """A simulated game server that runs every give, but never sends the answer of the first
    one (as if the gateway died while it travelled back)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gives: list[str] = []
        self.lost: set[str] = set()
        self.ran = asyncio.Event()

    def _run_tool(self, call: gateway_pb2.ToolCall) -> gateway_pb2.ConnectRequest:
        answer = super()._run_tool(call)
        if call.tool == GIVE:
            self.gives.append(call.call_id)
            if len(self.gives) == 1:
                self.lost.add(call.call_id)
                self.ran.set()
        return answer

    async def send(self, frame: gateway_pb2.ConnectRequest) -> None:
        if frame.WhichOneof("frame") == "tool_result" and frame.tool_result.call_id in self.lost:
            return
        await super().send(frame)


class Recording(GameServerClient):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gives: list[str] = []

    def _run_tool(self, call: gateway_pb2.ToolCall) -> gateway_pb2.ConnectRequest:
        if call.tool == GIVE:
            self.gives.append(call.call_id)
        return super()._run_tool(call)


async def _tasks(chain: Chain) -> list[journal_pb2.EventTask]:
    journal = journal_pb2_grpc.JournalServiceStub(chain.channel("storage"))
    page = await journal.ListTasks(journal_pb2.ListTasksRequest(player_id=STEVE), timeout=5)
    return list(page.tasks)


async def _ended(chain: Chain) -> journal_pb2.EventTask:
    terminal = {
        journal_pb2.TASK_STATE_SUCCEEDED,
        journal_pb2.TASK_STATE_PARTIALLY_SUCCEEDED,
        journal_pb2.TASK_STATE_FAILED,
    }

    async def ended() -> journal_pb2.EventTask | None:
        found = await _tasks(chain)
        return found[0] if found and found[0].state in terminal else None

    return await wait_until(ended, timeout=20, interval=0.1, what="the reward task to end")


async def _give_lost_with_gateway_a(chain: Chain, world: World) -> Recording:
    """Steve's reward starts on replica A; A runs the first give and stops before its answer
    is back; the game server reconnects to B. Returns the client on B."""
    on_a = LosesFirstGiveAnswer(chain.target("gateway"), SERVER_ID, chain.token, world)
    chain._clients.append(on_a)
    await on_a.connect()
    await on_a.join("steve", "Steve", "en_us")

    async def located_at_a() -> bool:
        routes = chain.apps["engine"].game_tools.routes
        return await routes.located(STEVE)

    await wait_until(located_at_a, timeout=10, interval=0.05, what="steve located")
    await on_a.event("steve", "minecraft:advancement", "adv-1", DIAMOND)
    await asyncio.wait_for(on_a.ran.wait(), 10)
    assert world.inventory("steve").get("minecraft:diamond") == 1  # it ran; the answer is lost
    await chain.stop("gateway")  # the engine's give, waiting on A, fails UNAVAILABLE

    on_b = Recording(chain.target("gateway_b"), SERVER_ID, chain.token, world)
    chain._clients.append(on_b)
    await on_b.connect()
    await on_b.join("steve", "Steve", "en_us")
    return on_b


async def test_a_give_lost_with_its_gateway_is_resent_on_the_other_and_given_once(
    chain: Chain, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine_service import events

    monkeypatch.setattr(events, "WAITING_RECHECK_SECONDS", 0.2)
    world = World()
    on_b = await _give_lost_with_gateway_a(chain, world)
    task = await _ended(chain)
    assert task.state == journal_pb2.TASK_STATE_SUCCEEDED, task.result
    assert task.attempts >= 2
    # The gives went out together: the first one is resent under its call id (answered as the
    # first call); the second too only where its answer had not reached the engine before A
    # stopped (it ran on A, and a resend of it is answered from the world's memory as well).
    first_call, second_call = f"{task.task_id}/0", f"{task.task_id}/1"
    assert on_b.gives in ([first_call], [first_call, second_call]), on_b.gives
    inventory = world.inventory("steve")
    assert {item: inventory.get(item) for item in REWARD} == REWARD
    shown = await asyncio.wait_for(on_b.notices.get(), 10)
    assert shown.notice.result.status == common_pb2.RESULT_STATUS_SUCCEEDED


async def test_a_tool_that_does_not_honour_call_ids_still_ends_effect_unknown(
    chain: Chain, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine_service import events

    monkeypatch.setattr(events, "WAITING_RECHECK_SECONDS", 0.2)
    registry = chain.apps["engine"].engine.registry.tools
    entry = registry._tools[GIVE]
    monkeypatch.setitem(
        registry._tools,
        GIVE,
        engine_tools._Entry(dataclasses.replace(entry.spec, honours_call_id=False), entry.handler),
    )
    world = World()
    on_b = await _give_lost_with_gateway_a(chain, world)
    task = await _ended(chain)
    assert task.state == journal_pb2.TASK_STATE_FAILED
    assert task.result.failure.key == "system.error.effect_unknown", task.result
    # Nothing is resent, even once steve is back.
    await holds_for(lambda: on_b.gives == [], 0.5, what="no give resent on gateway b")
    assert world.inventory("steve").get("minecraft:experience_bottle") is None


# -- the step journal alone (real storage service, SQLite: its `store` fixture) ------------


async def _claim(store: TaskStore, task_id: str) -> Claim:
    async def claimed() -> Claim | None:
        claims = await store.claim("replica-a", 8, 5)
        return next((claim for claim in claims if claim.task.task_id == task_id), None)

    return await wait_until(claimed, timeout=15, interval=0.1, what=f"a claim of {task_id}")


async def _new_task(store: TaskStore, player_id: str) -> Claim:
    """A new task of the player, claimed."""
    task, _ = await store.create(player_id, "mod:warp", f"key-{player_id}", {}, waiting=False)
    return await _claim(store, task.task_id)


async def _wait_and_reclaim(store: TaskStore, steps: TaskSteps, claim: Claim) -> Claim:
    """The run ended waiting for its player; the player joins; the task is claimed again."""
    await steps.finish(journal_pb2.TASK_STATE_WAITING, None)
    assert await store.resume(claim.task.player_id) == 1
    return await _claim(store, claim.task.task_id)


def _lost(calls: list[str]) -> Callable[[str], Awaitable[dict[str, Any]]]:
    async def call(step_id: str) -> dict[str, Any]:
        calls.append(step_id)
        raise ModuleFailure(AgentFailure.EFFECT_UNKNOWN, "mod:warp.pay may or may not have run")

    return call


async def _effect_unknown(run: Awaitable[dict[str, Any]]) -> None:
    """The step ends the run EFFECT_UNKNOWN (the task does not wait)."""
    with pytest.raises(ModuleFailure) as caught:
        await run
    assert not isinstance(caught.value, NotDelivered)
    assert caught.value.failure is AgentFailure.EFFECT_UNKNOWN


async def test_a_lost_answer_of_an_honouring_tool_waits_and_resends_under_its_call_id(
    store: TaskStore,
) -> None:
    claim = await _new_task(store, "p1")
    task = claim.task
    calls: list[str] = []
    steps = TaskSteps(store, claim)
    with pytest.raises(ResendLater) as caught:
        await steps.run(_give(honours=True), _lost(calls))
    assert isinstance(caught.value, NotDelivered) and caught.value.player_offline  # it waits
    # Back, but still not reachable: the resend is not delivered, and the receipt stays
    # RUNNING (a new attempt id would be a new call id, run again by the game server).
    claim = await _wait_and_reclaim(store, steps, claim)
    steps = TaskSteps(store, claim)

    async def offline(step_id: str) -> dict[str, Any]:
        calls.append(step_id)
        raise NotDelivered(AgentFailure.TOOL_UNAVAILABLE, "offline", player_offline=True)

    with pytest.raises(NotDelivered):
        await steps.run(_give(honours=True), offline)
    claim = await _wait_and_reclaim(store, steps, claim)

    async def answered(step_id: str) -> dict[str, Any]:
        calls.append(step_id)
        return {"paid": 5}

    assert await TaskSteps(store, claim).run(_give(honours=True), answered) == {"paid": 5}
    assert calls == [f"{task.task_id}/0"] * 3


async def test_a_lost_answer_of_any_other_write_is_effect_unknown_at_once(
    store: TaskStore,
) -> None:
    claim = await _new_task(store, "p2")
    task = claim.task
    calls: list[str] = []
    await _effect_unknown(TaskSteps(store, claim).run(_give(honours=False), _lost(calls)))
    assert calls == [f"{task.task_id}/0"]


async def test_waiting_out_lost_answers_is_bounded(store: TaskStore) -> None:
    claim = await _new_task(store, "p3")
    claim.task.attempts = RESEND_ATTEMPTS  # claimed that often already
    await _effect_unknown(TaskSteps(store, claim).run(_give(honours=True), _lost([])))
