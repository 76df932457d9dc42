"""A run of a player this replica ran last starts while the player's lease is being taken
(decision 0009): read-only game tools go ahead, everything else waits for the lease, and the
early start is thrown away when another owner held the lease since or holds it now."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2

from engine_service.context import ExecutionContext
from engine_service.engine import BoundedExecutor, Engine
from engine_service.registry import ExecutionPolicy, ModuleRegistry, ModuleSpec
from engine_service.runs import LeaseTaken, PlayerRuns
from engine_service.tools import ToolRegistry
from services.results import card, succeeded
from services.runtime.errors import ResourceExhausted, Unavailable

READ = "minecraft:inventory.read"
GIVE = "minecraft:item.give"
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
OBJECT = {"type": "object", "additionalProperties": False}


class SlowLeases:
    """PlayerLeases whose acquisitions wait for `open`; `other_since` makes the next one
    report another owner's acquisition before it, `held` makes it BUSY until cleared."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.open = asyncio.Event()
        self.open.set()
        self.token = 0
        self.other_since = False
        self.held = False

    async def acquire(self, name: str, owner: str, ttl_seconds: int) -> LeaseTaken:
        await self.open.wait()
        if self.held:
            self.events.append("busy")
            raise ResourceExhausted("held by another replica")
        previous = self.token
        if self.other_since:
            previous, self.other_since = self.token + 1, False
            self.token += 1
        self.token += 1
        self.events.append(f"acquire {self.token}")
        return LeaseTaken(self.token, previous)

    async def renew(self, name: str, owner: str, token: int, ttl_seconds: int) -> None:
        pass

    async def release(self, name: str, owner: str, token: int) -> None:
        self.events.append(f"release {token}")


class RecordingGame:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def call(
        self,
        player_id: str,
        call_id: str,
        tool_id: str,
        data: dict[str, Any],
        timeout: float,
        idempotent: bool,
        server_id: str = "",
    ) -> dict[str, Any]:
        self.events.append(tool_id)
        # Answers as the game-tool catalogue says (docs/game-tools.md); the engine checks it.
        if tool_id == GIVE:
            return {"item": data["item"], "count": data["count"]}
        return {"items": []}


class RecordingHistory:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.written = 0

    async def append_history(self, player_id: str, entries: list[common_pb2.HistoryEntry]) -> None:
        self.written += 1

    async def list_history(self, player_id: str, page_size: int) -> list[common_pb2.HistoryEntry]:
        self.events.append("history read")
        return []


class FlowModule:
    def __init__(self, module_id: str, steps: list[str]) -> None:
        self.spec = ModuleSpec(
            module_id=module_id,
            description={"en": "A test flow."},
            input_schema=OBJECT,
            tools=tuple(s for s in steps if s != "history"),
            policy=ExecutionPolicy(tool_calls=4, steps=4, write_steps=2),
        )
        self.steps = steps

    async def run(self, data: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        for step in self.steps:
            if step == "history":
                await ctx.list_history(5)
            elif step == GIVE:
                await ctx.tool(GIVE, {"item": "minecraft:apple", "count": 1})
            else:
                await ctx.tool(step)
        return succeeded(card("test:card", "done"))


class Setup:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.leases = SlowLeases(self.events)
        self.history = RecordingHistory(self.events)
        registry = ModuleRegistry(ToolRegistry())
        for module in (
            FlowModule("test:read", [READ]),
            FlowModule("test:write", [READ, GIVE]),
            FlowModule("test:history", ["history"]),
        ):
            registry.register(module)
        registry.freeze()
        self.runs = PlayerRuns(self.leases, "replica-a", 5)
        self.engine = Engine(
            registry,
            self.history,
            BoundedExecutor("interactive", 4, 8),
            execute_timeout=5.0,
            history_timeout=1.0,
            game_tools=RecordingGame(self.events),
            runs=self.runs,
        )

    async def execute(self, module_id: str) -> common_pb2.AgentResult:
        player = common_pb2.PlayerContext(server_id="s1", player_id="p1", language="en")
        return await self.engine.execute(
            player,
            common_pb2.ModuleAction(module_id=module_id),
            "",
            engine_pb2.ROUTE_SOURCE_COMMAND,
        )

    async def slow_lease_run(self, module_id: str) -> tuple[asyncio.Future[Any], list[str]]:
        """Starts a run with the lease's answer held back; returns it and what happened
        before the answer came."""
        self.events.clear()
        self.leases.open.clear()
        running = asyncio.ensure_future(self.execute(module_id))
        for _ in range(20):
            await asyncio.sleep(0.005)
        before = list(self.events)
        self.leases.open.set()
        return running, before


@pytest.fixture
async def setup() -> Setup:
    made = Setup()
    # The replica runs the player once, so it remembers its own last token.
    assert (await made.execute("test:read")).status == SUCCEEDED
    await made.engine.flush_history()
    return made


async def test_a_player_not_run_here_before_waits_for_the_lease() -> None:
    made = Setup()
    running, before = await made.slow_lease_run("test:read")
    assert before == []  # nothing ran: another replica may be running this player
    assert (await running).status == SUCCEEDED
    assert made.events[:2] == ["acquire 1", READ]


async def test_a_read_only_game_tool_runs_while_the_lease_is_taken(setup: Setup) -> None:
    running, before = await setup.slow_lease_run("test:read")
    assert before == [READ]
    assert (await running).status == SUCCEEDED
    assert setup.events == [READ, "acquire 2"]  # the tool ran once, the early start stood
    assert setup.runs.early_starts == {"kept": 1, "dropped": 0}
    await setup.engine.flush_history()
    assert setup.history.written == 2


async def test_a_write_waits_for_the_lease(setup: Setup) -> None:
    running, before = await setup.slow_lease_run("test:write")
    assert before == [READ]  # the read went ahead; the give waited
    assert (await running).status == SUCCEEDED
    assert setup.events == [READ, "acquire 2", GIVE]


async def test_history_is_read_only_under_the_lease(setup: Setup) -> None:
    running, before = await setup.slow_lease_run("test:history")
    assert before == []
    assert (await running).status == SUCCEEDED
    assert setup.events == ["acquire 2", "history read"]


async def test_an_early_start_is_thrown_away_when_another_owner_held_the_lease(
    setup: Setup,
) -> None:
    setup.leases.other_since = True
    running, before = await setup.slow_lease_run("test:write")
    assert before == [READ]
    assert (await running).status == SUCCEEDED
    # Everything after the lease ran again, under it: the early read is not trusted.
    assert setup.events == [READ, "acquire 3", READ, GIVE]
    assert setup.runs.early_starts == {"kept": 0, "dropped": 1}
    await setup.engine.flush_history()
    assert setup.history.written == 2  # one exchange per run, none for the early start
    assert setup.engine.interactive.admitted == 0  # its queue place given back once


async def test_an_early_start_is_thrown_away_while_another_owner_holds_the_lease(
    setup: Setup,
) -> None:
    setup.leases.held = True
    setup.runs.busy_wait = 0.05
    running, before = await setup.slow_lease_run("test:write")
    assert before == [READ]
    with pytest.raises(ResourceExhausted):
        await running
    assert GIVE not in setup.events
    await setup.engine.flush_history()
    assert setup.history.written == 1  # only the first run's
    assert setup.engine.interactive.admitted == 0
    # Once the other owner lets go, the player runs again (under the lease, then early).
    setup.leases.held = False
    setup.leases.other_since = True
    assert (await setup.execute("test:read")).status == SUCCEEDED
    await setup.engine.flush_history()
    await asyncio.sleep(0.02)  # its lease's release lands
    running, before = await setup.slow_lease_run("test:read")
    assert before == [READ]
    assert (await running).status == SUCCEEDED


async def test_a_run_refused_after_its_early_start_gives_the_lease_back(setup: Setup) -> None:
    """The run proper needs a queue place of its own; refused one (here: shutting down), it
    gives back the lease it already holds instead of leaving it to expire."""
    setup.leases.other_since = True
    setup.events.clear()
    setup.leases.open.clear()
    running = asyncio.ensure_future(setup.execute("test:read"))
    for _ in range(20):
        await asyncio.sleep(0.005)
    setup.engine.interactive.shutdown()
    setup.leases.open.set()
    with pytest.raises(Unavailable):
        await running
    for _ in range(20):
        await asyncio.sleep(0.005)
    assert setup.events == [READ, "acquire 3", "release 3"]
