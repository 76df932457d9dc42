"""Engine tests: the registry's checks, input schemas, Engine.execute against an in-memory
history, the bounded executor, the built-in help and history modules, entry-point loading, and
the engine service in-process on port 0 in front of a real storage service."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from system.common.v1 import catalog_pb2, common_pb2
from system.engine.v1 import engine_pb2, engine_pb2_grpc
from system.storage.v1 import storage_pb2, storage_pb2_grpc

from engine_service.app import build_registry
from engine_service.app import create_app as create_engine
from engine_service.config import EngineConfig
from engine_service.engine import BoundedExecutor, Engine
from engine_service.modules import BUILTIN_MODULES, SMALL_TALK, register_builtins
from engine_service.registry import (
    CommandSpec,
    ExecutionPolicy,
    ModuleRegistry,
    ModuleSpec,
    RegistryError,
    load_entry_point_modules,
)
from engine_service.runs import PlayerRuns, RunStart
from engine_service.schema import check_input
from services.results import AgentFailure, ModuleFailure, card, succeeded
from services.runtime.config import ConfigError
from services.runtime.context import request_scope
from services.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from storage_service.app import create_app as create_storage
from storage_service.config import StorageConfig
from tests.waiting import holds_for, wait_until

HOST = {"port": 0, "metrics_port": -1, "drain_seconds": 0, "grace_seconds": 1}
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
FAILED = common_pb2.RESULT_STATUS_FAILED
OBJECT = {"type": "object", "properties": {}, "additionalProperties": False}

Run = Callable[[dict[str, Any], Any], Awaitable[common_pb2.AgentResult]]


async def _ok(data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
    return succeeded(card("test:card", "done", [f"data={sorted(data.items())}"]))


@dataclasses.dataclass
class FakeModule:
    """A module built in the test: a spec and a run function."""

    spec: ModuleSpec
    runner: Run = _ok

    async def run(self, data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
        return await self.runner(data, ctx)


def _spec(module_id: str = "test:thing", **fields: Any) -> ModuleSpec:
    values: dict[str, Any] = {
        "description": {"en": f"The {module_id} module.", "zh": f"{module_id} 模块。"},
        "input_schema": OBJECT,
    }
    values.update(fields)
    return ModuleSpec(module_id=module_id, **values)


def _module(module_id: str = "test:thing", runner: Run = _ok, **fields: Any) -> FakeModule:
    return FakeModule(_spec(module_id, **fields), runner)


ADMIN = _module(
    "test:ban",
    commands=(CommandSpec(("ban", "封禁")),),
    min_permission_level=2,
)
QUESTS = _module(
    "ftbquests:quests", commands=(CommandSpec(("questbook",)),), owner_feature="ftbquests"
)
"""A third-party module of the `ftbquests` feature (the built-in quest modules belong to it too)."""
QUEST_MODULES = ("system:quests", "system:quest_detail", "system:quest_claim")
SHOP_AND_PAY = (
    "system:shop",
    "system:shop_buy",
    "system:shop_confirm",
    "system:pay",
    "system:pay_confirm",
)
FOR_EVERY_PLAYER = (
    "system:help",
    "system:history",
    "system:inventory",
    "system:profile",
    "system:item",
    "system:inbox",
    "system:mail_claim",
    "system:advancement_reward",
    *SHOP_AND_PAY,
    "system:signin",
    "system:question",
)
"""The built-in modules every player may use, first in registration order."""
FOR_ADMINS = (
    "system:routing",
    "system:reload",
    "system:usage",
    "system:spend",
    "system:grant",
    "system:revoke",
    "system:reset",
    "system:search.grant",
    "system:search.revoke",
    "system:knowledge_add",
    "system:knowledge_list",
    "system:knowledge_remove",
)
"""The built-in administrators' modules (above the permission level of an ordinary player), in
registration order."""
REGISTERED_IN_ORDER = [
    *FOR_EVERY_PLAYER,
    "system:search",
    *QUEST_MODULES,
    *FOR_ADMINS,
    "system:settings",
    "system:reasoning",
    "system:chat",
]
"""Every built-in module in registration order, as the registry and GetCatalog list them:
reasoning and chat last, after any extra module."""


def _registry(*modules: Any, builtins: bool = True) -> ModuleRegistry:
    registry = ModuleRegistry()
    if builtins:
        register_builtins(registry, extra=modules)
        registry.reject("system:small_talk", SMALL_TALK)
    else:
        for module in modules:
            registry.register(module)
    registry.freeze()
    return registry


def _player(
    level: int = 0, language: str = "en", features: tuple[str, ...] = (), player_id: str = "p-1"
) -> common_pb2.PlayerContext:
    return common_pb2.PlayerContext(
        server_id="s",
        player_id=player_id,
        language=language,
        permission_level=level,
        features=features,
    )


def _action(module_id: str, **data: Any) -> common_pb2.ModuleAction:
    value = struct_pb2.Struct()
    value.update(data)
    return common_pb2.ModuleAction(module_id=module_id, input=value)


class MemoryHistory:
    """The engine's HistoryStore port, in memory."""

    def __init__(self) -> None:
        self.entries: dict[str, list[common_pb2.HistoryEntry]] = defaultdict(list)

    async def append_history(self, player_id: str, entries: list[common_pb2.HistoryEntry]) -> None:
        self.entries[player_id].extend(entries)

    async def list_history(self, player_id: str, page_size: int) -> list[common_pb2.HistoryEntry]:
        return list(self.entries[player_id][-page_size:])


class BrokenHistory(MemoryHistory):
    async def append_history(self, player_id: str, entries: list[common_pb2.HistoryEntry]) -> None:
        raise ConnectionError("storage is down")

    async def list_history(self, player_id: str, page_size: int) -> list[common_pb2.HistoryEntry]:
        raise ConnectionError("storage is down")


class HangingHistory(MemoryHistory):
    async def append_history(self, player_id: str, entries: list[common_pb2.HistoryEntry]) -> None:
        await asyncio.sleep(30)


def _engine(
    registry: ModuleRegistry | None = None,
    history: MemoryHistory | None = None,
    workers: int = 4,
    queue: int = 8,
) -> Engine:
    return Engine(
        registry or _registry(),
        history if history is not None else MemoryHistory(),
        BoundedExecutor("interactive", workers, queue),
        execute_timeout=5.0,
        history_timeout=0.2,
    )


def _lines(result: common_pb2.AgentResult) -> list[str]:
    return [line.text for line in result.card.lines]


# --- Registry --------------------------------------------------------------------------------


def test_builtin_registry() -> None:
    registry = build_registry(EngineConfig())
    assert [m.spec.module_id for m in registry.modules()] == REGISTERED_IN_ORDER
    assert [m.spec.module_id for m in registry.handlers("minecraft:advancement")] == [
        "system:advancement_reward"
    ]
    assert registry.get("system:help") is not None
    assert registry.get("system:nothing") is None
    assert len(registry.generation) == 16


def test_duplicate_module_id_is_refused() -> None:
    registry = ModuleRegistry()
    registry.register(_module("test:a"))
    with pytest.raises(RegistryError, match="already registered"):
        registry.register(_module("test:a"))


@pytest.mark.parametrize("alias", ["HELP", "help", "帮助", "Help"])
def test_duplicate_alias_across_modules_is_refused_case_insensitively(alias: str) -> None:
    registry = ModuleRegistry()
    registry.register(_module("test:a", commands=(CommandSpec(("help", "帮助")),)))
    with pytest.raises(RegistryError, match="already used by test:a"):
        registry.register(_module("test:b", commands=(CommandSpec(("other", alias)),)))
    registry.register(
        _module("test:c", commands=(CommandSpec(("other",)),))
    )  # nothing was half-added


def test_duplicate_alias_within_a_module_is_refused() -> None:
    with pytest.raises(RegistryError, match="already used"):
        ModuleRegistry().register(
            _module("test:a", commands=(CommandSpec(("go",)), CommandSpec(("GO",))))
        )


@pytest.mark.parametrize(
    "alias", ["two words", " help", "help ", "帮\u3000助", "/help", "", "tab\tbed"]
)
def test_alias_must_be_one_word_without_slash(alias: str) -> None:
    with pytest.raises(RegistryError, match="one word"):
        ModuleRegistry().register(_module("test:a", commands=(CommandSpec((alias,)),)))


def test_a_question_field_must_be_a_string_input_of_a_module_that_only_reads() -> None:
    text = {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}}
    registry = ModuleRegistry()
    registry.register(_module("test:ask", input_schema=text, question_field="q"))
    assert registry.descriptor("test:ask").question_field == "q"
    for field in ("n", "missing"):
        with pytest.raises(RegistryError, match="is not a string input field"):
            ModuleRegistry().register(_module("test:a", input_schema=text, question_field=field))
    writes = ExecutionPolicy(tool_calls=1, steps=1, write_steps=1)
    with pytest.raises(RegistryError, match="must only read"):
        ModuleRegistry().register(
            _module("test:a", input_schema=text, question_field="q", policy=writes)
        )


def test_command_without_alias_is_refused() -> None:
    with pytest.raises(RegistryError, match="at least one alias"):
        ModuleRegistry().register(_module("test:a", commands=(CommandSpec(()),)))


@pytest.mark.parametrize(
    "module_id", ["help", "System:help", "system:", ":help", "a b:c", "x:Y", ""]
)
def test_module_id_must_be_namespace_path(module_id: str) -> None:
    with pytest.raises(RegistryError, match="namespace:path"):
        ModuleRegistry().register(_module(module_id))


def test_schema_and_description_are_required() -> None:
    with pytest.raises(RegistryError, match="object"):
        ModuleRegistry().register(_module("test:a", input_schema={"type": "string"}))
    with pytest.raises(RegistryError, match="description"):
        ModuleRegistry().register(_module("test:a", description={}))


def test_registration_after_freeze_is_refused() -> None:
    registry = _registry()
    with pytest.raises(RegistryError, match="frozen"):
        registry.register(_module("test:late"))


def test_command_argument_must_be_an_input_field() -> None:
    with pytest.raises(RegistryError, match="not an input field"):
        ModuleRegistry().register(
            _module("test:a", commands=(CommandSpec(("find",), argument="query"),))
        )
    ModuleRegistry().register(
        _module(
            "test:a",
            input_schema={"type": "object", "properties": {"query": {"type": "string"}}},
            commands=(CommandSpec(("find",), argument="query", argument_required=True),),
        )
    )


def test_generation_is_stable_and_follows_the_modules() -> None:
    assert ModuleRegistry().generation == ""  # not frozen yet
    first = build_registry(EngineConfig()).generation
    assert first == build_registry(EngineConfig()).generation == _registry().generation
    with_admin = _registry(ADMIN).generation
    assert with_admin != first
    assert with_admin == _registry(ADMIN).generation
    changed = _module("test:ban", commands=(CommandSpec(("ban",)),), min_permission_level=3)
    assert _registry(changed).generation != with_admin


def test_available_filters_by_permission_and_feature() -> None:
    registry = _registry(ADMIN, QUESTS)

    def ids(player: common_pb2.PlayerContext | None) -> list[str]:
        return [m.spec.module_id for m in registry.available(player)]

    # `system:search` belongs to the `system:search` feature, granted explicitly; extra modules
    # register after the built-ins, before reasoning and chat.
    assert ids(None) == [
        *REGISTERED_IN_ORDER[:-2],
        "test:ban",
        "ftbquests:quests",
        *REGISTERED_IN_ORDER[-2:],
    ]
    everyone = ["system:reasoning", "system:chat"]
    assert ids(_player(level=0)) == [*FOR_EVERY_PLAYER, "system:settings", *everyone]
    assert ids(_player(level=2)) == [*FOR_EVERY_PLAYER, "system:settings", "test:ban", *everyone]
    assert ids(_player(level=4, features=("ftbquests", "system:search"))) == ids(None)
    assert ids(_player(features=("ftbquests",))) == [
        *FOR_EVERY_PLAYER,
        *QUEST_MODULES,
        "system:settings",
        "ftbquests:quests",
        "system:reasoning",
        "system:chat",
    ]
    assert [d.module_id for d in registry.descriptors(_player(level=4))] == ids(_player(level=4))


def test_descriptor_carries_the_declaration() -> None:
    descriptor = build_registry(EngineConfig()).get("system:help").spec.descriptor()  # type: ignore[union-attr]
    assert descriptor.owner_feature == "system:core"
    assert descriptor.commands[0].aliases[:2] == ["help", "帮助"]
    assert descriptor.commands[0].argument_kind == catalog_pb2.ARGUMENT_KIND_OPTIONAL_TEXT
    assert descriptor.commands[0].argument_field == "topic"
    assert descriptor.description.text["zh"]


# --- Input schema ----------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "count": {"type": "integer", "minimum": 1, "maximum": 50},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "flag": {"type": "boolean"},
    },
    "required": ["name"],
    "additionalProperties": False,
}


def test_check_input_accepts_and_normalises() -> None:
    checked = check_input("m:x", SCHEMA, {"name": "abc", "count": 3.0, "ratio": 0.5, "flag": True})
    assert checked == {"name": "abc", "count": 3, "ratio": 0.5, "flag": True}
    assert type(checked["count"]) is int
    assert check_input("m:x", SCHEMA, {"name": "五个字符呀"}) == {
        "name": "五个字符呀"
    }  # characters


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({}, "input field 'name' is required"),
        (
            {"name": "a", "colour": "red", "size": 1},
            "unknown input field(s) colour, size; known fields are count, flag, name, ratio",
        ),
        ({"name": 5}, "'name' must be a string"),
        ({"name": "a", "count": "3"}, "'count' must be a integer"),
        ({"name": "a", "count": True}, "'count' must be a integer"),
        ({"name": "a", "flag": 1}, "'flag' must be a boolean"),
        ({"name": "a", "ratio": None}, "'ratio' must be a number"),
        ({"name": "a", "count": 2.5}, "'count' must be a whole number"),
        ({"name": "a", "count": float("inf")}, "'count' must be a finite number"),
        ({"name": "a", "ratio": float("nan")}, "'ratio' must be a finite number"),
        ({"name": "abcdef"}, "'name' is longer than 5 characters"),
        ({"name": "a", "count": 0}, "'count' must be at least 1"),
        ({"name": "a", "count": 51}, "'count' must be at most 50"),
        ({"name": "a", "ratio": 1.5}, "'ratio' must be at most 1"),
    ],
)
def test_check_input_refuses(value: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_input("m:x", SCHEMA, value)
    assert info.value.message.startswith("m:x: ")
    assert message in info.value.message


def test_check_input_without_properties() -> None:
    with pytest.raises(InvalidArgument, match="known fields are none"):
        check_input("m:x", OBJECT, {"x": 1})
    assert check_input("m:x", {"type": "object"}, {"x": 1}) == {"x": 1}  # additional allowed


# --- Engine.execute --------------------------------------------------------------------------


async def test_execute_refuses_bad_calls() -> None:
    engine = _engine(_registry(ADMIN, QUESTS, _module("test:events", interactive=False)))
    with pytest.raises(NotFound, match="test:missing"):
        await engine.execute(_player(), _action("test:missing"), "")
    refused = await engine.execute(_player(level=1), _action("test:ban"), "")
    assert refused.failure.key == "system.error.permission_denied"
    assert dict(refused.failure.args) == {"module_id": "test:ban"}
    with pytest.raises(PermissionDenied):
        await engine.execute(_player(level=4), _action("ftbquests:quests"), "")
    with pytest.raises(InvalidArgument, match="player_id"):
        await engine.execute(_player(player_id=""), _action("system:help"), "")
    with pytest.raises(InvalidArgument, match="module_id"):
        await engine.execute(_player(), common_pb2.ModuleAction(), "")
    with pytest.raises(FailedPrecondition):
        await engine.execute(_player(), _action("test:events"), "")
    assert engine.history.entries == {}  # type: ignore[attr-defined]  # nothing ran


async def test_execute_refuses_input_that_does_not_match_the_schema() -> None:
    engine = _engine()
    with pytest.raises(InvalidArgument, match="unknown input field"):
        await engine.execute(_player(), _action("system:help", colour="red"), "")
    with pytest.raises(InvalidArgument, match="'count' must be at most 50"):
        await engine.execute(_player(), _action("system:history", count=51), "")
    with pytest.raises(InvalidArgument, match="'count' must be a whole number"):
        await engine.execute(_player(), _action("system:history", count=2.5), "")
    with pytest.raises(InvalidArgument, match="system:history"):  # NaN cannot be JSON
        await engine.execute(_player(), _action("system:history", count=float("nan")), "")


async def test_module_failure_becomes_a_failed_result_with_its_key() -> None:
    async def fails(data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
        raise ModuleFailure(AgentFailure.STORAGE_FULL, "no room for that")

    engine = _engine(_registry(_module("test:fails", fails)))
    result = await engine.execute(_player(), _action("test:fails"), "do it")
    assert result.status == FAILED
    assert result.failure.key == "system.error.storage_full"
    assert result.failure.message == "no room for that"
    assert result.card.template == "system:error"


async def test_crashing_module_becomes_module_failed_without_leaking(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def crashes(data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
        raise RuntimeError("secret internals")

    engine = _engine(_registry(_module("test:crash", crashes)))
    with caplog.at_level(logging.ERROR):
        result = await engine.execute(_player(), _action("test:crash"), "")
    assert result.status == FAILED
    assert result.failure.key == "system.error.module_failed"
    assert "secret" not in result.failure.message and "secret" not in result.text
    assert any("test:crash" in r.getMessage() and r.exc_info for r in caplog.records)
    # The player reads a plain sentence in their language; the log names the module.
    assert result.failure.message == "Something went wrong; try again."
    chinese = await engine.execute(_player(language="zh"), _action("test:crash"), "")
    assert chinese.failure.message == "出了点问题，请再试一次。"


async def test_slow_module_past_the_deadline_is_a_timeout() -> None:
    async def slow(data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
        await asyncio.sleep(10)
        raise AssertionError("not reached")

    history = MemoryHistory()
    engine = _engine(_registry(_module("test:slow", slow)), history)
    started = time.monotonic()
    with request_scope(timeout=0.1):
        result = await engine.execute(_player(), _action("test:slow"), "slow please")
    assert time.monotonic() - started < 2
    assert result.status == FAILED
    assert result.failure.key == "system.error.timeout"
    assert result.failure.message == "That took too long; try again."
    assert engine.interactive._admitted == 0  # the slot was given back


async def test_execute_records_the_exchange_in_history() -> None:
    history = MemoryHistory()
    engine = _engine(history=history)
    with request_scope("req-1"):
        result = await engine.execute(_player(), _action("system:help"), "帮助")
    assert result.status == SUCCEEDED
    await engine.flush_history()  # written after the result went back
    player_entry, assistant_entry = history.entries["p-1"]
    assert player_entry.role == common_pb2.HISTORY_ROLE_PLAYER
    assert player_entry.text == "帮助"
    assert assistant_entry.role == common_pb2.HISTORY_ROLE_ASSISTANT
    assert assistant_entry.text == result.text
    assert assistant_entry.result == result
    assert player_entry.request_id == assistant_entry.request_id == "req-1"


async def test_history_describes_an_action_without_text() -> None:
    history = MemoryHistory()
    engine = _engine(history=history)
    await engine.execute(_player(), _action("system:help"), "")
    await engine.execute(_player(), _action("system:help", topic="历史"), "")
    await engine.flush_history()
    texts = [e.text for e in history.entries["p-1"] if e.role == common_pb2.HISTORY_ROLE_PLAYER]
    assert texts == ["system:help", 'system:help {"topic": "历史"}']


@pytest.mark.parametrize("history", [BrokenHistory(), HangingHistory()], ids=["broken", "hanging"])
async def test_failing_history_does_not_fail_the_result(history: MemoryHistory) -> None:
    engine = _engine(history=history)
    started = time.monotonic()
    result = await engine.execute(_player(), _action("system:help"), "help")
    assert result.status == SUCCEEDED
    # The player's next request waits for the failing write only as long as history_timeout.
    result = await engine.execute(_player(), _action("system:help"), "help again")
    assert result.status == SUCCEEDED
    await engine.flush_history()
    assert time.monotonic() - started < 2  # bounded by history_timeout


class GatedHistory(MemoryHistory):
    """Holds every write until `open` is set, so a test sees what waits for history."""

    def __init__(self) -> None:
        super().__init__()
        self.open = asyncio.Event()
        self.writes = 0

    async def append_history(self, player_id: str, entries: list[common_pb2.HistoryEntry]) -> None:
        self.writes += 1
        await self.open.wait()
        await super().append_history(player_id, entries)


async def test_the_result_does_not_wait_for_the_history_write() -> None:
    history = GatedHistory()
    engine = _engine(history=history)
    result = await asyncio.wait_for(engine.execute(_player(), _action("system:help"), "a"), 2)
    assert result.status == SUCCEEDED
    await asyncio.sleep(0)
    assert history.writes == 1 and history.entries == {}  # still in flight
    history.open.set()
    await engine.flush_history()
    assert len(history.entries["p-1"]) == 2


async def test_a_players_next_run_reads_history_with_the_previous_exchange() -> None:
    """The next run of the player that reads history (it declares so) starts only once the
    previous exchange is stored, and writes keep the order of the exchanges."""
    history = GatedHistory()
    seen: list[list[str]] = []

    async def reads(data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
        seen.append([e.text for e in await history.list_history("p-1", 10)])
        return await _ok(data, ctx)

    engine = _engine(_registry(_module("test:reads", reads, history_entries=10)), history)
    await engine.execute(_player(), _action("test:reads"), "first")
    second = asyncio.ensure_future(engine.execute(_player(), _action("test:reads"), "second"))
    await wait_until(lambda: history.writes == 1, what="the first exchange's write, held")
    await holds_for(
        lambda: not second.done() and seen == [[]],
        0.05,
        what='the second run waiting for "first" to be stored',
    )
    history.open.set()
    await second
    await engine.flush_history()
    assert seen[1][0] == "first"
    players = [e.text for e in history.entries["p-1"] if e.role == common_pb2.HISTORY_ROLE_PLAYER]
    assert players == ["first", "second"]


async def test_a_run_that_reads_no_history_does_not_wait_for_the_previous_write() -> None:
    """`/help` right after `/help`: the second answers while the first's exchange is still
    being stored, and the two exchanges are stored in the order they were answered."""
    history = GatedHistory()
    engine = _engine(history=history)
    await engine.execute(_player(), _action("system:help"), "first")
    second = await asyncio.wait_for(engine.execute(_player(), _action("system:help"), "second"), 2)
    assert second.status == SUCCEEDED and history.entries == {}
    history.open.set()
    await engine.flush_history()
    players = [e.text for e in history.entries["p-1"] if e.role == common_pb2.HISTORY_ROLE_PLAYER]
    assert players == ["first", "second"]


async def test_full_interactive_queue_is_resource_exhausted() -> None:
    gate = asyncio.Event()

    async def waits(data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
        await gate.wait()
        return await _ok(data, ctx)

    engine = _engine(_registry(_module("test:wait", waits)), workers=1, queue=0)
    first = asyncio.create_task(engine.execute(_player(), _action("test:wait"), ""))
    await wait_until(lambda: engine.interactive._admitted == 1, what="the first run admitted")
    with pytest.raises(ResourceExhausted, match="queue is full"):  # another player: the queue
        await engine.execute(_player(player_id="p-2"), _action("system:help"), "")
    gate.set()
    assert (await first).status == SUCCEEDED


# --- BoundedExecutor -------------------------------------------------------------------------


async def test_bounded_executor_refuses_at_once_beyond_workers_plus_queue() -> None:
    executor = BoundedExecutor("interactive", workers=1, queue=1)
    gate = asyncio.Event()
    running = 0
    peak = 0

    async def job() -> str:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await gate.wait()
        running -= 1
        return "done"

    first = asyncio.create_task(executor.run(job))
    second = asyncio.create_task(executor.run(job))
    await wait_until(
        lambda: executor._admitted == 2 and running == 1, what="one job running, one queued"
    )
    started = time.monotonic()
    with pytest.raises(ResourceExhausted, match="interactive queue is full"):
        await executor.run(job)
    assert time.monotonic() - started < 0.5  # refused at once, not queued
    gate.set()
    assert await asyncio.gather(first, second) == ["done", "done"]
    assert peak == 1  # one worker: the second waited
    assert executor._admitted == 0
    third = asyncio.create_task(executor.run(job))
    fourth = asyncio.create_task(executor.run(job))
    assert await asyncio.gather(third, fourth) == ["done", "done"]


async def test_bounded_executor_frees_the_slot_of_a_cancelled_or_failing_job() -> None:
    executor = BoundedExecutor("interactive", workers=1, queue=0)

    async def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError):
        await executor.run(boom)
    task = asyncio.create_task(executor.run(lambda: asyncio.sleep(10)))
    await wait_until(lambda: executor._admitted == 1, what="the job admitted")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert executor._admitted == 0
    assert await executor.run(lambda: asyncio.sleep(0, "ok")) == "ok"


# --- Help and history modules ----------------------------------------------------------------


async def test_help_lists_the_modules_the_player_may_use() -> None:
    engine = _engine(_registry(ADMIN, QUESTS))
    ordinary = await engine.execute(_player(level=0), _action("system:help"), "")
    admin = await engine.execute(_player(level=4), _action("system:help"), "")
    assert ordinary.status == admin.status == SUCCEEDED
    assert ordinary.card.template == "system:help"
    assert ordinary.card.title == "Assistant help"
    assert any(line.startswith("/help [topic]") for line in _lines(ordinary))
    assert any(line.startswith("/history") for line in _lines(ordinary))
    assert not any("/ban" in line for line in _lines(ordinary))
    assert any(line.startswith("/ban — The test:ban module.") for line in _lines(admin))
    assert not any("quests" in line for line in _lines(admin))  # feature not installed
    commands = {line.suggest_command for line in admin.card.lines if line.suggest_command}
    assert commands == {
        "/help",
        "/history",
        "/inventory",
        "/profile",
        "/item",
        "/mail",
        "/mailclaim",
        "/shop",
        "/buy",
        "/pay",
        "/signin",
        "/question",
        "/ban",
        "/routing",
        "/reload",
        "/usage",
        "/spend",
        "/grant",
        "/revoke",
        "/reset",
        "/search-on",
        "/search-off",
        "/knowledge-add",
        "/knowledge",
        "/knowledge-remove",
        "/settings",
        "/reason",
        "/chat",
    }
    # A command that needs an argument (/item <query>) gets no button.
    assert {b.args["module_id"] for b in admin.card.buttons} == {
        "system:history",
        "system:inventory",
        "system:profile",
        "system:inbox",
        "system:shop",
        "system:signin",
        "test:ban",
        "system:routing",
        "system:reload",
        "system:usage",
        "system:spend",
        "system:knowledge_list",
        "system:settings",
    }


async def test_help_language() -> None:
    engine = _engine()
    zh = await engine.execute(_player(language="zh"), _action("system:help"), "")
    en = await engine.execute(_player(language="en"), _action("system:help"), "")
    other = await engine.execute(_player(language="fr"), _action("system:help"), "")
    assert zh.card.title == "助手帮助"
    assert "查看最近的对话记录。" in zh.text
    assert en.card.title == "Assistant help"
    assert "Show your recent conversation." in en.text
    assert other.card.title == "Assistant help"


@pytest.mark.parametrize(
    "topic", ["history", "HISTORY", "/history", "历史", "对话记录", "system:history"]
)
async def test_help_topic_explains_a_module(topic: str) -> None:
    engine = _engine()
    result = await engine.execute(_player(), _action("system:help", topic=topic), "")
    assert result.status == SUCCEEDED
    assert result.card.title == "Command /history"
    assert _lines(result) == [
        "Show your recent conversation.",
        "Usage: /history",
        "Aliases: history, 历史, 对话记录",
    ]


async def test_help_topic_in_chinese_and_unknown_topic() -> None:
    engine = _engine(_registry(ADMIN))
    zh = await engine.execute(_player(language="zh"), _action("system:help", topic="帮助"), "")
    assert zh.card.title == "指令 /help"
    assert "用法：/help [主题]" in _lines(zh)
    for topic, level in (("nonsense", 4), ("ban", 0), ("test:ban", 0)):
        result = await engine.execute(_player(level=level), _action("system:help", topic=topic), "")
        assert result.status == FAILED
        assert result.failure.key == "system.error.not_found"
        assert topic in result.failure.message
    assert (
        await engine.execute(_player(level=2), _action("system:help", topic="封禁"), "")
    ).status == SUCCEEDED


async def test_history_module_shows_entries_from_the_store() -> None:
    history = MemoryHistory()
    history.entries["p-1"] = [
        common_pb2.HistoryEntry(role=common_pb2.HISTORY_ROLE_PLAYER, text="where is iron"),
        common_pb2.HistoryEntry(
            role=common_pb2.HISTORY_ROLE_ASSISTANT, text="Below you\nsecond line"
        ),
        common_pb2.HistoryEntry(role=common_pb2.HISTORY_ROLE_PLAYER, text="thanks"),
    ]
    engine = _engine(history=history)
    result = await engine.execute(_player(), _action("system:history"), "history")
    assert result.status == SUCCEEDED
    assert result.card.title == "Recent conversation"
    assert _lines(result) == ["You: where is iron", "Assistant: Below you", "You: thanks"]
    two = await engine.execute(_player(language="zh"), _action("system:history", count=2), "")
    assert two.card.title == "最近的对话"
    assert len(_lines(two)) == 2


async def test_history_shows_a_prose_answer_by_its_first_line_not_its_title() -> None:
    # A chat answer's card is titled `Assistant` whatever it says: its line shows the answer.
    chat = card("system:chat", "Assistant", ["It is noon on the server.", "second"])
    listing = card("system:inbox", "Inbox (2 mails)", ["1. Hello"])
    history = MemoryHistory()
    history.entries["p-1"] = [
        common_pb2.HistoryEntry(role=common_pb2.HISTORY_ROLE_ASSISTANT, text=r.text, result=r)
        for r in (succeeded(chat), succeeded(listing))
    ] + [common_pb2.HistoryEntry(role=common_pb2.HISTORY_ROLE_PLAYER, text="x" * 200)]
    result = await _engine(history=history).execute(_player(), _action("system:history"), "")
    assert _lines(result) == [
        "Assistant: It is noon on the server.",
        "Assistant: Inbox (2 mails)",
        "You: " + "x" * 79 + "…",  # a long line is cut
    ]


async def test_history_module_empty_and_store_down() -> None:
    empty = await _engine().execute(_player(language="zh"), _action("system:history"), "")
    assert _lines(empty) == ["还没有记录。"]
    down = await _engine(history=BrokenHistory()).execute(_player(), _action("system:history"), "")
    assert down.status == FAILED
    assert down.failure.key == "system.error.storage_unavailable"


# --- Entry points ----------------------------------------------------------------------------


@dataclasses.dataclass
class FakeEntryPoint:
    name: str
    loader: Callable[[], Any]
    group: str = "system.modules"

    def load(self) -> Any:
        return self.loader()


class PluginModule:
    spec = _spec("plugin:hello", commands=(CommandSpec(("hello", "你好")),))

    async def run(self, data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
        return succeeded(card("plugin:hello", "hello"))


def _broken_load() -> Any:
    raise ImportError("plugin dependency missing")


@pytest.fixture
def entry_points(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    groups: list[str] = []

    def fake(**params: Any) -> list[FakeEntryPoint]:
        groups.append(params.get("group", ""))
        return [
            FakeEntryPoint("broken", _broken_load),
            FakeEntryPoint("hello", lambda: PluginModule),
        ]

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)
    return groups


def test_entry_point_modules_are_loaded_and_broken_ones_skipped(
    entry_points: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="system.engine.registry"):
        modules = load_entry_point_modules()
    assert entry_points == ["system.modules"]
    assert [m.spec.module_id for m in modules] == ["plugin:hello"]
    assert isinstance(modules[0], PluginModule)
    broken = [r for r in caplog.records if "broken" in r.getMessage()]
    assert broken and broken[0].levelno == logging.ERROR and broken[0].exc_info


def test_entry_point_modules_join_the_registry_unless_disabled(entry_points: list[str]) -> None:
    registry = build_registry(EngineConfig())
    # Entry-point modules come after the built-ins, before reasoning and chat (which see their
    # tools).
    assert [m.spec.module_id for m in registry.modules()][-3:] == [
        "plugin:hello",
        "system:reasoning",
        "system:chat",
    ]
    assert registry.generation != _registry().generation
    assert load_entry_point_modules(["hello"]) == []
    disabled = build_registry(EngineConfig(disabled_entry_points=("hello", "broken")))
    assert disabled.generation == _registry().generation


# --- The engine service in-process, with a real storage service ------------------------------


@dataclasses.dataclass
class Services:
    engine: engine_pb2_grpc.EngineServiceStub
    storage: storage_pb2_grpc.StorageServiceStub
    generation: str


@pytest.fixture
async def services(tmp_path: Any) -> AsyncIterator[Services]:
    storage = await create_storage(StorageConfig(**HOST, database_url=f"sqlite:///{tmp_path}/s.db"))
    await storage.host.start()
    engine = await create_engine(EngineConfig(**HOST, storage_target=storage.host.target))
    await engine.host.start()
    channels = [
        grpc.aio.insecure_channel(engine.host.target),
        grpc.aio.insecure_channel(storage.host.target),
    ]
    try:
        yield Services(
            engine_pb2_grpc.EngineServiceStub(channels[0]),
            storage_pb2_grpc.StorageServiceStub(channels[1]),
            engine.engine.registry.generation,
        )
    finally:
        for channel in channels:
            await channel.close()
        await engine.host.stop()
        await engine.aclose()
        await storage.host.stop()
        await storage.aclose()


def _execute(
    module_id: str = "system:help", text: str = "帮助", **data: Any
) -> engine_pb2.ExecuteRequest:
    return engine_pb2.ExecuteRequest(
        player=_player(language="zh", player_id="steve"),
        action=_action(module_id, **data),
        source=engine_pb2.ROUTE_SOURCE_COMMAND,
        request_text=text,
    )


async def test_service_executes_and_records_history(services: Services) -> None:
    response = await services.engine.Execute(_execute(), timeout=10)
    assert response.result.status == SUCCEEDED
    assert response.result.card.template == "system:help"
    assert response.result.card.title == "助手帮助"
    # The exchange is written after the reply; the player's next run waits for it, so the
    # history module, asked right away, shows it.
    shown = await services.engine.Execute(_execute("system:history", "历史"), timeout=10)
    assert shown.result.status == SUCCEEDED
    assert [line.text for line in shown.result.card.lines][0] == "你: 帮助"
    listed = await services.storage.ListHistory(
        storage_pb2.ListHistoryRequest(player_id="steve", page_size=10), timeout=5
    )
    assert [e.role for e in listed.entries][:2] == [
        common_pb2.HISTORY_ROLE_PLAYER,
        common_pb2.HISTORY_ROLE_ASSISTANT,
    ]
    assert listed.entries[0].text == "帮助"
    assert listed.entries[1].result.card.title == "助手帮助"


async def test_service_refuses_bad_requests(services: Services) -> None:
    unspecified = _execute()
    unspecified.source = engine_pb2.ROUTE_SOURCE_UNSPECIFIED
    unknown_source = _execute()
    unknown_source.source = 99
    cases = [
        (unspecified, grpc.StatusCode.INVALID_ARGUMENT, "source is required"),
        (unknown_source, grpc.StatusCode.INVALID_ARGUMENT, "not a known RouteSource"),
        (_execute("test:none"), grpc.StatusCode.NOT_FOUND, "test:none"),
        (
            _execute("system:help", topic=5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "'topic' must be a string",
        ),
    ]
    for request, code, words in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await services.engine.Execute(request, timeout=10)
        assert info.value.code() == code
        assert words in (info.value.details() or "")


async def test_service_catalog(services: Services) -> None:
    catalog = await services.engine.GetCatalog(engine_pb2.GetCatalogRequest(), timeout=5)
    assert [m.module_id for m in catalog.modules] == REGISTERED_IN_ORDER
    assert catalog.generation == services.generation != ""
    for_player = await services.engine.GetCatalog(
        engine_pb2.GetCatalogRequest(player=_player()), timeout=5
    )
    assert for_player.generation == catalog.generation
    # The web search feature is granted explicitly; without it /search appears nowhere, and
    # without FTB Quests on the player's server the quests appear nowhere either.
    # Nor do the admin commands for an ordinary player.
    assert list(for_player.modules) == [
        m
        for m in catalog.modules
        if m.module_id not in ("system:search", *FOR_ADMINS, *QUEST_MODULES)
    ]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await services.engine.GetCatalog(
            engine_pb2.GetCatalogRequest(player=common_pb2.PlayerContext(language="en")), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "player_id" in (info.value.details() or "")


def test_reject_profiles_are_published_and_checked() -> None:
    registry = build_registry(EngineConfig())
    (small_talk,) = registry.reject_profiles()
    assert small_talk.profile_id == "system:small_talk"
    assert {e.language for e in small_talk.examples} == {"en", "zh"}
    fresh = ModuleRegistry()
    fresh.register(BUILTIN_MODULES[0]())
    with pytest.raises(RegistryError, match="clashes"):
        fresh.reject("system:help", SMALL_TALK)
    with pytest.raises(RegistryError, match="needs examples"):
        fresh.reject("system:nothing", {"en": ()})
    fresh.freeze()
    with pytest.raises(RegistryError, match="frozen"):
        fresh.reject("system:late", SMALL_TALK)


def test_semantic_profiles_reach_the_catalogue() -> None:
    help_descriptor = build_registry(EngineConfig()).get("system:help").spec.descriptor()
    profile = help_descriptor.semantic
    examples = {e.language: list(e.examples) for e in profile.examples}
    assert "帮助" in examples["zh"] and "help" in examples["en"]
    assert profile.read_only_tools and profile.shortcut


class RecordingRuns:
    """A RunJournal in memory, recording what happened in order; each finish waits for
    `open`."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.token = 0
        self.open = asyncio.Event()

    async def begin(
        self, player_id: str, owner: str, lease_seconds: int, history_entries: int
    ) -> RunStart:
        self.token += 1
        self.log.append(f"begin {self.token}")
        return RunStart(self.token, history=[] if history_entries else None)

    async def renew(self, lease: str, owner: str, token: int, lease_seconds: int) -> None:
        pass

    async def finish(
        self, player_id: str, owner: str, token: int, entries: list[common_pb2.HistoryEntry]
    ) -> None:
        await self.open.wait()
        self.log.append(f"finish {token}: {len(entries)} entries")


def _journaled_engine(
    events: list[str], gate: asyncio.Event | None = None
) -> tuple[Engine, RecordingRuns]:
    """An engine whose runs begin and finish on a recording journal (finishes gated); with
    `gate`, it also has `test:wait`, a module that waits for the gate."""

    async def waits(data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
        assert gate is not None
        await gate.wait()
        return await _ok(data, ctx)

    journal = RecordingRuns(events)
    engine = Engine(
        # test:wait may write, so its runs hold the player's lease.
        _registry(_module("test:wait", waits, policy=ExecutionPolicy(write_steps=1)))
        if gate is not None
        else _registry(),
        MemoryHistory(),
        BoundedExecutor("interactive", 4, 8),
        execute_timeout=5.0,
        history_timeout=1.0,
        runs=PlayerRuns(journal, "replica-a", 5),
    )
    return engine, journal


async def test_a_run_is_one_begin_before_it_and_one_finish_after_the_reply() -> None:
    """A run that holds the player's lease (here one reading the history): the lease and the
    history tail come with the begin; the exchange and the lease's release go in one finish,
    which the reply does not wait for."""
    events: list[str] = []
    engine, journal = _journaled_engine(events)
    result = await engine.execute(_player(), _action("system:history"), "history")
    assert result.status == SUCCEEDED
    assert events == ["begin 1"]  # answered; the finish still waits
    journal.open.set()
    await engine.flush_history()
    assert events == ["begin 1", "finish 1: 2 entries"]


async def test_a_run_that_neither_writes_nor_reads_history_takes_no_lease() -> None:
    """`/help` needs nothing of storage before its reply: its one call is the finish, which
    stores the exchange (token 0: no lease to give back)."""
    events: list[str] = []
    engine, journal = _journaled_engine(events)
    journal.open.set()
    assert (await engine.execute(_player(), _action("system:help"), "help")).status == SUCCEEDED
    await engine.flush_history()
    assert events == ["finish 0: 2 entries"]


async def test_the_players_next_run_begins_once_the_previous_finish_landed() -> None:
    """This replica owns the lease already, so only waiting for its own finish keeps the
    player's history in order (and the older token's release from crossing the new one)."""
    events: list[str] = []
    engine, journal = _journaled_engine(events)
    await engine.execute(_player(), _action("system:help"), "first")
    second = asyncio.ensure_future(engine.execute(_player(), _action("system:history"), "second"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert events == [] and not second.done()  # the first's finish is held
    journal.open.set()
    await second
    await engine.flush_history()
    assert events == ["finish 0: 2 entries", "begin 1", "finish 1: 2 entries"]


async def test_a_cancelled_run_finishes_without_history() -> None:
    events: list[str] = []
    engine, journal = _journaled_engine(events, asyncio.Event())
    journal.open.set()
    running = asyncio.ensure_future(engine.execute(_player(), _action("test:wait"), "wait"))
    await wait_until(lambda: events == ["begin 1"], what="the run to begin")
    assert engine.cancel("p-1")
    result = await running
    assert result.failure.key == "system.error.cancelled"
    await engine.flush_history()
    assert events == ["begin 1", "finish 1: 0 entries"]


async def test_settle_history_waits_for_the_answered_exchange() -> None:
    """SettleHistory returns once the exchange already answered is stored (an empty run
    begun and finished after it); with a run of the player in progress it answers False."""
    events: list[str] = []
    engine, journal = _journaled_engine(events)
    await engine.execute(_player(), _action("system:help"), "help")
    settle = asyncio.ensure_future(engine.settle_history("p-1"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not settle.done() and events == []
    journal.open.set()
    assert await settle is True
    assert events == ["finish 0: 2 entries", "begin 1", "finish 1: 0 entries"]

    gate = asyncio.Event()
    busy_events: list[str] = []
    busy, idle = _journaled_engine(busy_events, gate)
    idle.open.set()
    running = asyncio.ensure_future(busy.execute(_player(), _action("test:wait"), "wait"))
    await wait_until(lambda: busy_events == ["begin 1"], what="the run to begin")
    assert await busy.settle_history("p-1") is False
    gate.set()
    await running
    assert await busy.settle_history("p-1") is True


# -- per-module budget overrides -------------------------------------------------------------------


def test_module_policies_override_a_modules_budgets() -> None:
    config = EngineConfig(
        module_policies=(
            "system:chat@model_calls=2",
            "system:chat@seconds=12.5",
            "system:question@tool_calls=3",
        )
    )
    config.validate()
    registry = build_registry(config)
    chat = registry.get("system:chat")
    assert chat is not None
    assert (chat.spec.policy.model_calls, chat.spec.policy.seconds) == (2, 12.5)
    assert chat.spec.policy.rounds == 3  # untouched budgets keep the module's own
    question = registry.get("system:question")
    assert question is not None and question.spec.policy.tool_calls == 3
    # Another registry (another engine in the same process) keeps the shipped budgets.
    assert build_registry(EngineConfig()).get("system:chat").spec.policy.model_calls == 4  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("system:chat", "must look like module@budget=value"),
        ("chat@model_calls=2", "must look like module@budget=value"),
        ("system:chat@write_steps=3", "'write_steps' is not a budget"),
        ("system:chat@model_calls=two", "model_calls must be a number"),
        ("system:chat@steps=0", "steps must be at least 1"),
        ("system:chat@seconds=-1", "seconds: positive"),
    ],
)
def test_a_malformed_module_policy_is_refused_naming_the_entry(entry: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        EngineConfig(module_policies=(entry,)).validate()
    assert "module_policies[0]" in str(refused.value) and message in str(refused.value)


def test_a_module_policy_for_an_unknown_module_stops_the_start() -> None:
    with pytest.raises(ConfigError, match="module_policies names system:nope, which is not"):
        build_registry(EngineConfig(module_policies=("system:nope@rounds=2",)))
