"""Tools and the execution context: the tool registry's checks, budgets, the write rule for
local and cached routes, permission re-checked at every call, cancellation, partial success,
and the built-in `system:inventory` module end to end through the in-process chain (engine ->
gateway relay -> simulated game server)."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from system.common.v1 import catalog_pb2, common_pb2
from system.engine.v1 import engine_pb2, engine_pb2_grpc
from system.gateway.v1 import gateway_pb2
from system.relay.v1 import relay_pb2, relay_pb2_grpc

from engine_service.app import build_registry
from engine_service.clients import GatewayGameTools
from engine_service.config import EngineConfig
from engine_service.context import ExecutionContext
from engine_service.engine import BoundedExecutor, Engine
from engine_service.modules import InventoryModule
from engine_service.registry import ExecutionPolicy, ModuleRegistry, ModuleSpec, RegistryError
from engine_service.tools import (
    BUILTIN_GAME_TOOLS,
    ToolKind,
    ToolRegistry,
    ToolRegistryError,
    ToolSpec,
)
from services.gamesim.world import World
from services.results import AgentFailure, ModuleFailure, card, succeeded
from services.runtime.errors import PermissionDenied
from services.runtime.multiplex import MultiplexServer
from tests.inprocess import Chain, running_chain
from tests.waiting import holds_for, wait_until

SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
FAILED = common_pb2.RESULT_STATUS_FAILED
PARTIAL = common_pb2.RESULT_STATUS_PARTIALLY_SUCCEEDED
OBJECT = {"type": "object", "properties": {}, "additionalProperties": False}
COUNTER = "system:test.counter"
LEDGER = "system:test.ledger"
QUESTS = "system:test.quests"

Run = Callable[[dict[str, Any], ExecutionContext], Awaitable[common_pb2.AgentResult]]


def _done(text: str = "done") -> common_pb2.AgentResult:
    return succeeded(card("test:card", text))


@dataclasses.dataclass
class FakeModule:
    spec: ModuleSpec
    runner: Run

    async def run(self, data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
        return await self.runner(data, ctx)


class Tools:
    """Test server tools: a read-only counter, a write ledger and an optional quest reader."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.before_call: Callable[[str], Awaitable[None]] | None = None

    async def _record(self, name: str) -> None:
        self.calls.append(name)
        if self.before_call is not None:
            await self.before_call(name)

    async def counter(self, data: dict[str, Any]) -> dict[str, Any]:
        await self._record(COUNTER)
        return {"n": len(self.calls)}

    async def ledger(self, data: dict[str, Any]) -> dict[str, Any]:
        await self._record(LEDGER)
        return {"written": data.get("amount", 0)}

    async def quests(self, data: dict[str, Any]) -> dict[str, Any]:
        await self._record(QUESTS)
        return {"quests": []}

    def registry(self) -> ToolRegistry:
        tools = ToolRegistry()
        tools.server(ToolSpec(COUNTER, "Counts.", read_only=True, idempotent=True), self.counter)
        tools.server(
            ToolSpec(
                LEDGER,
                "Writes to a ledger.",
                input_schema={
                    "type": "object",
                    "properties": {"amount": {"type": "integer", "minimum": 1}},
                    "additionalProperties": False,
                },
            ),
            self.ledger,
        )
        tools.server(
            ToolSpec(QUESTS, "Lists quests.", read_only=True, owner_feature="ftbquests"),
            self.quests,
        )
        return tools


class FakeGameTools:
    """GameTools recording each relayed call."""

    def __init__(self, answer: dict[str, Any] | None = None) -> None:
        self.calls: list[tuple[str, str, str, float]] = []
        self.servers: list[str] = []
        self.answer = (
            answer if answer is not None else {"items": [{"item": "minecraft:apple", "count": 3}]}
        )

    async def call(
        self,
        player_id: str,
        call_id: str,
        tool_id: str,
        data: dict[str, Any],
        timeout: float,
        idempotent: bool,
        server_id: str = "",
        language: str = "en",
    ) -> dict[str, Any]:
        self.calls.append((player_id, call_id, tool_id, timeout))
        self.servers.append(server_id)
        return self.answer


class MemoryHistory:
    async def append_history(self, player_id: str, entries: list[common_pb2.HistoryEntry]) -> None:
        return None

    async def list_history(self, player_id: str, page_size: int) -> list[common_pb2.HistoryEntry]:
        return []


def _spec(module_id: str = "test:flow", **fields: Any) -> ModuleSpec:
    values: dict[str, Any] = {"description": {"en": "A test flow."}, "input_schema": OBJECT}
    values.update(fields)
    return ModuleSpec(module_id=module_id, **values)


def _engine(tools: Tools, *modules: FakeModule, game_tools: FakeGameTools | None = None) -> Engine:
    registry = ModuleRegistry(tools.registry())
    for module in modules:
        registry.register(module)
    registry.freeze()
    return Engine(
        registry,
        MemoryHistory(),
        BoundedExecutor("interactive", 4, 8),
        execute_timeout=5.0,
        history_timeout=0.2,
        game_tools=game_tools,
    )


def _player(
    level: int = 0, features: tuple[str, ...] = (), language: str = "en"
) -> common_pb2.PlayerContext:
    return common_pb2.PlayerContext(
        server_id="s1",
        player_id="p1",
        player_name="Steve",
        language=language,
        permission_level=level,
        features=list(features),
    )


def _action(module_id: str = "test:flow") -> common_pb2.ModuleAction:
    return common_pb2.ModuleAction(module_id=module_id)


async def _execute(
    engine: Engine,
    module_id: str = "test:flow",
    source: int = engine_pb2.ROUTE_SOURCE_COMMAND,
    player: common_pb2.PlayerContext | None = None,
) -> common_pb2.AgentResult:
    return await engine.execute(player or _player(), _action(module_id), "", source)


def _repeat(tool_id: str, times: int, **data: Any) -> Run:
    async def run(_: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        for _ in range(times):
            await ctx.tool(tool_id, data)
        return _done()

    return run


WRITER = ExecutionPolicy(tool_calls=4, steps=4, write_steps=2)


# --- Registry --------------------------------------------------------------------------------


def test_duplicate_tool_and_shared_handler_are_refused() -> None:
    tools = Tools()
    registry = tools.registry()
    with pytest.raises(ToolRegistryError, match="already registered"):
        registry.server(ToolSpec(COUNTER, "Again.", read_only=True), tools.quests)
    with pytest.raises(ToolRegistryError, match="one handler has one behaviour"):
        registry.server(ToolSpec("system:test.other", "Other.", read_only=True), tools.counter)
    with pytest.raises(ToolRegistryError, match="already registered"):
        registry.game(ToolSpec("minecraft:inventory.read", "Again.", kind=ToolKind.GAME))
    with pytest.raises(ToolRegistryError, match="namespace is for server tools"):
        registry.game(ToolSpec("system:x", "A game tool in system:.", kind=ToolKind.GAME))
    with pytest.raises(ToolRegistryError, match="namespace:path"):
        registry.server(ToolSpec("no-namespace", "Bad id."), tools.ledger)
    registry.freeze()
    with pytest.raises(ToolRegistryError, match="frozen"):
        registry.server(ToolSpec("system:test.late", "Late."), tools.ledger)


def test_module_tool_declarations_are_checked() -> None:
    tools = Tools()
    registry = ModuleRegistry(tools.registry())
    run = _repeat(COUNTER, 1)
    with pytest.raises(RegistryError, match="declared both required and optional"):
        registry.register(FakeModule(_spec(tools=(COUNTER,), optional_tools=(COUNTER,)), run))
    with pytest.raises(RegistryError, match="server tool system:test.missing is not registered"):
        registry.register(FakeModule(_spec(tools=("system:test.missing",)), run))
    with pytest.raises(RegistryError, match="allows no write steps"):
        registry.register(FakeModule(_spec(tools=(LEDGER,)), run))
    with pytest.raises(RegistryError, match="optional tool .* must be read-only"):
        registry.register(FakeModule(_spec(optional_tools=(LEDGER,), policy=WRITER), run))
    with pytest.raises(RegistryError, match="READ routing"):
        registry.register(
            FakeModule(
                _spec(tools=(LEDGER,), policy=WRITER, routing_mode=catalog_pb2.ROUTING_MODE_READ),
                run,
            )
        )
    # A game server's own tool is accepted by pattern, as the most restricted kind: a write.
    registry.register(FakeModule(_spec("test:custom", tools=("mymod:warp",), policy=WRITER), run))
    custom = registry.tools.get("mymod:warp")
    assert custom is not None and custom.kind == ToolKind.GAME and not custom.read_only
    assert not registry.descriptor("test:custom").HasField("semantic")
    registry.freeze()
    assert registry.tools.frozen


def test_policy_is_validated() -> None:
    assert ExecutionPolicy().write_steps == 0
    for bad in (
        {"tool_calls": -1},
        {"steps": 0},
        {"rounds": 0},
        {"seconds": 0},
        {"seconds": float("inf")},
        {"write_steps": 3, "tool_calls": 2},
        {"model_calls": 1.5},
    ):
        with pytest.raises(RegistryError, match="policy"):
            ExecutionPolicy(**bad)


def test_builtin_inventory_is_read_only_and_locally_routable() -> None:
    registry = build_registry(EngineConfig())
    descriptor = registry.descriptor("system:inventory")
    assert descriptor.routing_mode == catalog_pb2.ROUTING_MODE_READ
    assert descriptor.semantic.read_only_tools and descriptor.write_steps == 0
    assert [c.aliases for c in descriptor.commands] == [["inventory", "背包", "查看背包"]]
    inventory = registry.tools.get("minecraft:inventory.read")
    assert inventory is not None and inventory.read_only and inventory.kind == ToolKind.GAME


# --- Execution context -----------------------------------------------------------------------


async def test_undeclared_tool_use_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    tools = Tools()
    engine = _engine(tools, FakeModule(_spec(tools=(COUNTER,)), _repeat(QUESTS, 1)))
    result = await _execute(engine)
    assert result.status == FAILED
    assert result.failure.key == "system.error.tool_unavailable"
    # The module's mistake is the operator's to fix: the log names it, the player reads why.
    assert "did not declare tool system:test.quests" in caplog.text
    assert result.failure.message == "Something went wrong; try again."
    assert tools.calls == []


async def test_tool_budget_exhausted_mid_run_stops_further_calls() -> None:
    tools = Tools()
    seen: list[Any] = []

    async def run(_: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        for _ in range(5):
            try:
                await ctx.tool(COUNTER)
            except ModuleFailure as failure:
                seen.append(failure.failure)  # a module that ignores it gets nothing more
        raise ModuleFailure(seen[0], "out of budget")

    policy = ExecutionPolicy(tool_calls=2)
    engine = _engine(tools, FakeModule(_spec(tools=(COUNTER,), policy=policy), run))
    result = await _execute(engine)
    assert result.status == FAILED
    assert (
        result.failure.key
        == AgentFailure.BUDGET_EXHAUSTED.value
        == ("system.error.budget_exhausted")
    )
    assert tools.calls == [COUNTER, COUNTER]
    assert seen == [AgentFailure.BUDGET_EXHAUSTED] * 3


async def test_step_and_model_budgets(caplog: pytest.LogCaptureFixture) -> None:
    tools = Tools()

    async def run(_: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        ctx.charge_model_call()
        await ctx.tool(COUNTER)
        await ctx.tool(COUNTER)  # third step of two
        return _done()

    engine = _engine(
        tools,
        FakeModule(_spec(tools=(COUNTER,), policy=ExecutionPolicy(steps=2)), run),
        FakeModule(
            _spec("test:chatty", policy=ExecutionPolicy(model_calls=1)),
            _charge_models(2),
        ),
    )
    result = await _execute(engine)
    assert (result.status, result.failure.key) == (FAILED, "system.error.budget_exhausted")
    assert "more steps than this feature may take" in result.failure.message
    assert "test:flow used all 2 steps its policy allows" in caplog.text
    assert tools.calls == [COUNTER]
    chatty = await _execute(engine, "test:chatty", player=_player(language="zh"))
    assert "超出了这项功能的上限" in chatty.failure.message
    assert "test:chatty used all 1 model calls" in caplog.text


def _charge_models(times: int) -> Run:
    async def run(_: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        for _ in range(times):
            ctx.charge_model_call()
        return _done()

    return run


async def test_write_budget_exhausted_after_a_write_is_partial(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tools = Tools()
    policy = ExecutionPolicy(tool_calls=4, steps=4, write_steps=1)
    engine = _engine(
        tools, FakeModule(_spec(tools=(LEDGER,), policy=policy), _repeat(LEDGER, 2, amount=5))
    )
    result = await _execute(engine)
    assert result.status == PARTIAL
    assert result.failure.key == "system.error.budget_exhausted"
    assert "the rest was not done" in result.failure.message
    assert "all 1 write steps its policy allows" in caplog.text
    assert tools.calls == [LEDGER]
    assert any(LEDGER in line.text for line in result.card.lines)


@pytest.mark.parametrize(
    "source",
    [
        engine_pb2.ROUTE_SOURCE_LOCAL,
        engine_pb2.ROUTE_SOURCE_CACHE,
        engine_pb2.ROUTE_SOURCE_UNSPECIFIED,
    ],
)
async def test_write_tool_refused_from_local_and_cached_routes(source: int) -> None:
    tools = Tools()
    engine = _engine(
        tools,
        FakeModule(_spec(tools=(COUNTER, LEDGER), policy=WRITER), _read_then_write),
    )
    result = await _execute(engine, source=source)
    assert result.status == FAILED
    assert result.failure.key == "system.error.write_not_allowed"
    assert tools.calls == [COUNTER]  # the read-only tool ran; the write never did


async def _read_then_write(_: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
    await ctx.tool(COUNTER)
    written = await ctx.tool(LEDGER, {"amount": 2})
    return _done(f"wrote {written['written']}")


@pytest.mark.parametrize(
    "source",
    [
        engine_pb2.ROUTE_SOURCE_COMMAND,
        engine_pb2.ROUTE_SOURCE_BUTTON,
        engine_pb2.ROUTE_SOURCE_INVOKE,
    ],
)
async def test_write_tool_allowed_from_explicit_routes(source: int) -> None:
    tools = Tools()
    engine = _engine(
        tools, FakeModule(_spec(tools=(COUNTER, LEDGER), policy=WRITER), _read_then_write)
    )
    result = await _execute(engine, source=source)
    assert result.status == SUCCEEDED, result.failure
    assert result.card.title == "wrote 2"
    assert tools.calls == [COUNTER, LEDGER]


def _ledgers(*amounts: int) -> Run:
    async def run(_: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        outputs = await ctx.tools([(LEDGER, {"amount": amount}) for amount in amounts])
        return _done(" ".join(str(output["written"]) for output in outputs))

    return run


async def test_tools_sends_the_calls_together_and_answers_in_their_order() -> None:
    """Each call waits until the other has started: called one after another, the first
    would wait for ever."""
    tools = Tools()
    started: list[asyncio.Event] = [asyncio.Event(), asyncio.Event()]

    async def both_started(_: str) -> None:
        started[len(tools.calls) - 1].set()
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 2)

    tools.before_call = both_started
    engine = _engine(tools, FakeModule(_spec(tools=(LEDGER,), policy=WRITER), _ledgers(1, 2)))
    result = await _execute(engine)
    assert result.status == SUCCEEDED, result.failure
    assert result.card.title == "1 2"
    assert tools.calls == [LEDGER, LEDGER]


async def test_tools_checks_the_budgets_of_every_call_before_sending_any() -> None:
    tools = Tools()
    engine = _engine(
        tools, FakeModule(_spec(tools=(LEDGER,), policy=WRITER), _ledgers(1, 2, 3))
    )  # WRITER allows two write steps
    result = await _execute(engine)
    assert result.failure.key == "system.error.budget_exhausted"
    assert tools.calls == []


async def test_tools_lets_the_others_finish_and_raises_the_first_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first call fails once the second has finished: the run reports the first call's
    failure, with the second's write as done."""
    tools = Tools()
    second_done = asyncio.Event()

    async def first_fails(_: str) -> None:
        if len(tools.calls) == 1:
            await asyncio.wait_for(second_done.wait(), 2)
            raise ModuleFailure(AgentFailure.TOOL_UNAVAILABLE, "the ledger is closed")
        second_done.set()

    tools.before_call = first_fails
    engine = _engine(tools, FakeModule(_spec(tools=(LEDGER,), policy=WRITER), _ledgers(1, 2)))
    result = await _execute(engine)
    assert result.status == PARTIAL
    assert result.failure.key == "system.error.tool_unavailable"
    assert "the ledger is closed" in caplog.text  # the tool's words are the operator's
    assert result.failure.message == "That is not available right now; try again later."
    assert [line.text for line in result.card.lines][-1:] == [f"✓ {LEDGER}"]


async def test_a_server_tools_deployment_words_reach_staff_not_players() -> None:
    async def store_down(_: str) -> None:
        raise ModuleFailure(AgentFailure.STORAGE_UNAVAILABLE, "the ledger store: UNAVAILABLE")

    for level, language, seen in (
        (0, "zh", "数据暂时无法读写。"),
        (3, "en", "the ledger store: UNAVAILABLE"),
    ):
        tools = Tools()
        tools.before_call = store_down
        spec = _spec(tools=(COUNTER,), min_permission_level=level)
        engine = _engine(tools, FakeModule(spec, _repeat(COUNTER, 1)))
        result = await _execute(engine, player=_player(level=level, language=language))
        assert (result.failure.key, result.failure.message) == (
            "system.error.storage_unavailable",
            seen,
        )


async def test_tool_input_is_checked_against_its_schema() -> None:
    tools = Tools()
    engine = _engine(
        tools,
        FakeModule(_spec(tools=(LEDGER,), policy=WRITER), _repeat(LEDGER, 1, amount=0)),
    )
    result = await _execute(engine)
    assert result.failure.key == "system.error.invalid_input"
    assert "amount" in result.failure.message and tools.calls == []


async def test_permission_revoked_between_calls_is_refused_at_the_next_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tools = Tools()
    engine = _engine(
        tools,
        FakeModule(_spec(tools=(COUNTER,), min_permission_level=2), _repeat(COUNTER, 3)),
    )

    async def demote(_: str) -> None:
        engine.update_player(_player(level=0))  # an operator lowered Steve's level

    tools.before_call = demote
    result = await _execute(engine, player=_player(level=2))
    assert result.status == FAILED
    assert result.failure.key == "system.error.permission_denied"
    assert result.failure.message == "You may no longer use this."
    assert "test:flow is no longer available to Steve" in caplog.text
    assert tools.calls == [COUNTER]
    # The snapshot left with the run; the next request brings its own.
    tools.before_call = None
    assert (await _execute(engine, player=_player(level=2))).status == SUCCEEDED


async def test_optional_tool_needs_its_feature() -> None:
    tools = Tools()

    async def run(_: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        try:
            await ctx.tool(QUESTS)
        except ModuleFailure as failure:
            return _done(f"without quests: {failure.failure.value}")
        return _done("with quests")

    engine = _engine(tools, FakeModule(_spec(optional_tools=(QUESTS,)), run))
    without = await _execute(engine)
    assert without.card.title == "without quests: system.error.tool_unavailable"
    assert tools.calls == []
    with_feature = await _execute(engine, player=_player(features=("ftbquests",)))
    assert with_feature.card.title == "with quests" and tools.calls == [QUESTS]


async def test_cancellation_stops_a_run() -> None:
    tools = Tools()
    started = asyncio.Event()

    async def hang(_: str) -> None:
        started.set()
        await asyncio.sleep(30)

    tools.before_call = hang
    engine = _engine(tools, FakeModule(_spec(tools=(COUNTER,)), _repeat(COUNTER, 3)))
    task = asyncio.create_task(_execute(engine))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: engine.interactive._admitted == 0, what="the run's slot given back")
    assert engine.players.current(_player(level=9)).permission_level == 9  # snapshot released
    # Nothing of the run goes on after it: no second call of the three.
    await holds_for(lambda: tools.calls == [COUNTER], 0.05, what="no tool call after the cancel")


async def test_cooperative_cancel_and_deadline() -> None:
    tools = Tools()

    async def cancel_self(_: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        await ctx.tool(COUNTER)
        ctx.cancel()
        await ctx.tool(COUNTER)
        return _done()

    async def slow(_: str) -> None:
        await asyncio.sleep(5)

    engine = _engine(
        tools,
        FakeModule(_spec(tools=(COUNTER,)), cancel_self),
        FakeModule(
            _spec("test:slow", tools=(COUNTER,), policy=ExecutionPolicy(seconds=0.2)),
            _repeat(COUNTER, 1),
        ),
    )
    cancelled = await _execute(engine)
    assert cancelled.failure.key == "system.error.cancelled" and tools.calls == [COUNTER]
    tools.before_call = slow
    timed_out = await _execute(engine, "test:slow")
    assert timed_out.failure.key == "system.error.timeout"


async def test_module_reports_partial_success() -> None:
    tools = Tools()

    async def run(_: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        await ctx.tool(LEDGER, {"amount": 1})
        return ctx.partial(AgentFailure.EFFECT_UNKNOWN, "the second transfer is unconfirmed")

    async def fails_after_write(_: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        await ctx.tool(LEDGER, {"amount": 1})
        raise ModuleFailure(AgentFailure.NOT_FOUND, "the recipient left")

    async def fails_after_read(_: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        await ctx.tool(COUNTER)
        raise ModuleFailure(AgentFailure.NOT_FOUND, "nothing to do")

    engine = _engine(
        tools,
        FakeModule(_spec(tools=(LEDGER,), policy=WRITER), run),
        FakeModule(_spec("test:after", tools=(LEDGER,), policy=WRITER), fails_after_write),
        FakeModule(_spec("test:read", tools=(COUNTER,)), fails_after_read),
    )
    explicit = await _execute(engine)
    assert explicit.status == PARTIAL
    assert explicit.failure.key == "system.error.effect_unknown"
    assert explicit.failure.message == "the second transfer is unconfirmed"
    implicit = await _execute(engine, "test:after")
    assert (implicit.status, implicit.failure.key) == (PARTIAL, "system.error.not_found")
    # Only reads happened: nothing changed, so it is a plain failure.
    read_only = await _execute(engine, "test:read")
    assert read_only.status == FAILED


async def test_game_tools_go_through_the_relay_with_the_time_left() -> None:
    tools = Tools()
    relay = FakeGameTools()
    registry = ModuleRegistry(tools.registry())
    registry.register(InventoryModule())
    registry.freeze()
    engine = Engine(
        registry,
        MemoryHistory(),
        BoundedExecutor("interactive", 4, 8),
        execute_timeout=5.0,
        history_timeout=0.2,
        game_tools=relay,
    )
    player = _player()
    first = await engine.execute(player, _action("system:inventory"), "", 4)
    await engine.execute(player, _action("system:inventory"), "", 3)
    assert first.status == SUCCEEDED
    assert [line.text for line in first.card.lines][0] == "minecraft:apple × 3"
    assert [c[2] for c in relay.calls] == ["minecraft:inventory.read"] * 2
    assert relay.calls[0][0] == "p1" and relay.calls[0][1] != relay.calls[1][1]
    assert all(0 < c[3] <= 10.0 for c in relay.calls)  # the policy's 10 s, at most
    engine.game_tools = None
    missing = await engine.execute(player, _action("system:inventory"), "", 2)
    assert missing.failure.key == "system.error.tool_unavailable"


# --- End to end: in-process chain ------------------------------------------------------------


class RecordingWorld(World):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def call(self, player_id: str, tool: str, data: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((player_id, tool))
        return super().call(player_id, tool, data)


@pytest.fixture
async def chain(tmp_path: pathlib.Path) -> AsyncIterator[Chain]:
    async with running_chain(tmp_path) as running:
        yield running


async def test_steve_reads_his_inventory_through_the_gateway(chain: Chain) -> None:
    world = RecordingWorld()
    client = chain.new_client()
    client.world = world
    await client.connect()
    await client.join("steve", "Steve", "zh_cn")
    for text in ("背包", "/inventory"):
        response = await client.chat("steve", text)
        reply = response.reply
        assert reply.module_id == "system:inventory", text
        assert reply.result.status == SUCCEEDED, reply.result.failure
        assert reply.result.card.title == "背包"
        lines = [line.text for line in reply.result.card.lines]
        assert "面包 × 12" in lines and "火把 × 32" in lines
        assert reply.result.card.lines[0].suggest_command == "/item minecraft:bread"
    # Each tool call crossed engine -> gateway relay -> this game server's connection.
    assert world.calls == [("steve", "minecraft:inventory.read")] * 2


async def test_relay_not_found_becomes_a_catalogued_failure(chain: Chain) -> None:
    client = await chain.client()
    await client.join("steve", "Steve", "en_us")
    engine = engine_pb2_grpc.EngineServiceStub(chain.channel("engine"))
    ghost = common_pb2.PlayerContext(server_id="sim", player_id="ghost", language="en")
    response = await engine.Execute(
        engine_pb2.ExecuteRequest(
            player=ghost,
            action=_action("system:inventory"),
            source=engine_pb2.ROUTE_SOURCE_COMMAND,
        ),
        timeout=10,
    )
    assert response.result.status == FAILED
    assert response.result.failure.key == "system.error.tool_unavailable"
    # The player reads what it means for them; the relay's words ("ghost is not connected")
    # are the engine log's.
    assert response.result.failure.message == "You need to be online for this."
    ghost.language = "zh"
    chinese = await engine.Execute(
        engine_pb2.ExecuteRequest(
            player=ghost, action=_action("system:inventory"), source=engine_pb2.ROUTE_SOURCE_COMMAND
        ),
        timeout=10,
    )
    assert chinese.result.failure.message == "你需要在线才能完成这一步。"


# --- The game-tool contract: output schemas ----------------------------------------------------


def _inventory_engine(relay: FakeGameTools) -> Engine:
    registry = ModuleRegistry(Tools().registry())
    registry.register(InventoryModule())
    registry.freeze()
    return Engine(
        registry,
        MemoryHistory(),
        BoundedExecutor("interactive", 4, 8),
        execute_timeout=5.0,
        history_timeout=0.2,
        game_tools=relay,
    )


@pytest.mark.parametrize(
    ("answer", "where"),
    [
        ({"items": [{"id": "minecraft:diamond", "count": 3}]}, "items[0].item is required"),
        ({}, "items is required"),
        ({"items": "none"}, "items must be a array"),
        (
            {"items": [{"item": "minecraft:apple", "count": -1}]},
            "items[0].count must be at least 0",
        ),
        (
            {"items": [{"item": "minecraft:apple", "count": 2.5}]},
            "items[0].count must be a whole number",
        ),
        ({"items": [{"item": "", "count": 1}]}, "items[0].item is shorter than 1 characters"),
    ],
)
async def test_a_malformed_answer_is_tool_output_invalid_never_empty(
    answer: dict[str, Any], where: str
) -> None:
    result = await _execute(_inventory_engine(FakeGameTools(answer)), "system:inventory")
    assert (result.status, result.failure.key) == (FAILED, "system.error.tool_output_invalid")
    # The player can pass the tool and the first error on to whoever runs the plugin.
    assert result.failure.message.startswith(
        "Your game server answered with data the assistant cannot read "
        f"(minecraft:inventory.read: {where}"
    )
    assert "empty" not in result.text.lower()


async def test_a_valid_answer_is_read_with_whole_numbers_and_the_players_server() -> None:
    relay = FakeGameTools({"items": [{"item": "minecraft:apple", "count": 3.0, "nbt": "{}"}]})
    result = await _execute(_inventory_engine(relay), "system:inventory")
    assert result.status == SUCCEEDED
    assert result.card.lines[0].text == "minecraft:apple × 3"
    assert relay.servers == ["s1"]  # the player's PlayerContext.server_id, passed on


async def test_write_output_is_checked_before_the_step_counts_as_done() -> None:
    give = "minecraft:item.give"

    async def run(_: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        output = await ctx.tool(give, {"item": "minecraft:apple", "count": 1})
        return _done(str(output))

    module = FakeModule(_spec(tools=(give,), policy=WRITER), run)
    registry = ModuleRegistry(Tools().registry())
    registry.register(module)
    registry.freeze()
    relay = FakeGameTools({"given": True})
    engine = Engine(
        registry,
        MemoryHistory(),
        BoundedExecutor("interactive", 4, 8),
        execute_timeout=5.0,
        history_timeout=0.2,
        game_tools=relay,
    )
    result = await _execute(engine)
    assert result.failure.key == "system.error.tool_output_invalid"
    assert "minecraft:item.give" in result.failure.message and "item is required" in (
        result.failure.message
    )
    relay.answer = {"item": "minecraft:apple", "count": 4.0}
    assert (await _execute(engine)).card.title == "{'item': 'minecraft:apple', 'count': 4}"


def test_game_tool_declarations_need_valid_schemas_and_examples() -> None:
    registry = ToolRegistry(game_tools=())
    with pytest.raises(
        ToolRegistryError, match="output_schema: the schema must describe an object"
    ):
        registry.game(ToolSpec("mod:a", "A.", kind=ToolKind.GAME, output_schema={"type": "array"}))
    with pytest.raises(ToolRegistryError, match="output_schema: not a valid JSON Schema"):
        registry.game(
            ToolSpec(
                "mod:b", "B.", kind=ToolKind.GAME, output_schema={"type": "object", "required": 5}
            )
        )
    with pytest.raises(ToolRegistryError, match="example_output breaks its schema: n is required"):
        registry.game(
            ToolSpec(
                "mod:c",
                "C.",
                kind=ToolKind.GAME,
                output_schema={"type": "object", "required": ["n"]},
                example_output={},
            )
        )
    registry.game(ToolSpec("mod:d", "D.", kind=ToolKind.GAME))  # any object by default
    assert registry.get("mod:d").output_schema == {"type": "object"}  # type: ignore[union-attr]
    for spec in BUILTIN_GAME_TOOLS:
        assert spec.output_schema["required"], spec.tool_id
        assert spec.example_input is not None and spec.example_output is not None


class RecordingRelay(relay_pb2_grpc.ToolRelayServiceServicer):
    """A real ToolRelayService on loopback recording what the engine's client sends."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self._multiplex = MultiplexServer(
            relay_pb2.DESCRIPTOR.services_by_name["ToolRelayService"],
            {"CallGameTool": self.CallGameTool, "NotifyPlayer": self.NotifyPlayer},
        )

    async def CallGameTool(self, request, context):  # type: ignore[no-untyped-def]
        self.requests.append(request)
        result = gateway_pb2.ToolResult(call_id=request.call_id)
        result.output.update({"items": []})
        return relay_pb2.CallGameToolResponse(result=result)

    async def NotifyPlayer(self, request, context):  # type: ignore[no-untyped-def]
        self.requests.append(request)
        return relay_pb2.NotifyPlayerResponse()

    async def MultiplexCalls(self, request_iterator, context):  # type: ignore[no-untyped-def]
        async for response in self._multiplex.serve(request_iterator):
            yield response


async def test_the_relay_client_names_the_players_server() -> None:
    relay = RecordingRelay()
    server = grpc.aio.server()
    relay_pb2_grpc.add_ToolRelayServiceServicer_to_server(relay, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GatewayGameTools(f"127.0.0.1:{port}")
    try:
        output = await client.call(
            "p1", "c1", "minecraft:inventory.read", {}, 5.0, True, server_id="b"
        )
        await client.notify("p1", _done(), 5.0, server_id="b")
    finally:
        await client.aclose()
        await server.stop(0)
    assert output == {"items": []}
    assert [(type(r).__name__, r.server_id, r.player_id) for r in relay.requests] == [
        ("CallGameToolRequest", "b", "p1"),
        ("NotifyPlayerRequest", "b", "p1"),
    ]


async def test_unavailable_modules_are_absent_for_that_player_only() -> None:
    engine = _inventory_engine(FakeGameTools())
    registry = engine.registry
    lacking = _player()
    lacking.unavailable_modules.append("system:inventory")
    assert not registry.allows("system:inventory", lacking)
    assert "system:inventory" not in [m.spec.module_id for m in registry.available(lacking)]
    assert "system:inventory" not in [d.module_id for d in registry.descriptors(lacking)]
    assert registry.allows("system:inventory", _player())
    with pytest.raises(PermissionDenied, match="unavailable on game server s1"):
        await engine.execute(lacking, _action("system:inventory"), "", 2)
    assert (await _execute(engine, "system:inventory")).status == SUCCEEDED
