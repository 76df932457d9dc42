"""The game-tool contract at hello time: services.gateway.tool_contract on its own, then the
whole chain (a hello offering an incompatible or malformed tool gets its problems in the
Welcome, the module needing it disappears for that server's players only, and a tool answer
breaking its schema reaches the player as TOOL_OUTPUT_INVALID)."""

from __future__ import annotations

import contextlib
import copy
import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any
from unittest import mock

import pytest
from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2
from system.gateway.v1 import gateway_pb2

from engine_service.app import build_registry
from engine_service.config import EngineConfig
from engine_service.tool_catalog import game_tool_catalog, to_proto
from services.gamesim.client import GameServerClient
from services.gamesim.world import World
from services.gateway.tool_contract import check_tools
from tests import inprocess
from tests.inprocess import Chain, running_chain
from tests.waiting import wait_until

INVENTORY = "minecraft:inventory.read"
GIVE = "minecraft:item.give"
FAILED = common_pb2.RESULT_STATUS_FAILED
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
JAVA_OUTPUT = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "string"}, "count": {"type": "integer"}},
                "required": ["id", "count"],
            },
        }
    },
    "required": ["items"],
}
"""What the Java client of issue 14 meant to answer: `id` where the catalogue says `item`."""


@pytest.fixture(scope="module")
def catalogue() -> list[engine_pb2.GameToolEntry]:
    return to_proto(game_tool_catalog(build_registry(EngineConfig())))


def _tools(**changes: dict[str, Any]) -> list[gateway_pb2.GameTool]:
    """The simulated server's tools, with fields of some replaced (by tool name)."""
    tools = World.tools()
    for tool in tools:
        for field, value in changes.get(tool.name, {}).items():
            setattr(tool, field, json.dumps(value) if field.endswith("_schema") else value)
    return tools


def _problem(checked: Any, tool: str) -> gateway_pb2.ToolProblem:
    return next(p for p in checked.problems if p.tool == tool)


# -- the check on its own --------------------------------------------------------------------


def test_the_simulated_servers_tools_conform(catalogue: list[engine_pb2.GameToolEntry]) -> None:
    checked = check_tools(World.tools(), catalogue)
    assert checked.problems == () and checked.refused == frozenset()
    assert checked.unavailable_modules == ()


def test_empty_schemas_mean_as_the_catalogue_says(
    catalogue: list[engine_pb2.GameToolEntry],
) -> None:
    tools = World.tools()
    for tool in tools:
        tool.input_schema = tool.output_schema = ""
    assert check_tools(tools, catalogue).problems == ()


def test_the_catalogues_own_schemas_pass(catalogue: list[engine_pb2.GameToolEntry]) -> None:
    offered = [copy.deepcopy(entry.tool) for entry in catalogue]
    assert check_tools(offered, catalogue).problems == ()


def test_an_output_schema_dropping_a_required_key_is_refused(
    catalogue: list[engine_pb2.GameToolEntry],
) -> None:
    checked = check_tools(_tools(**{INVENTORY: {"output_schema": JAVA_OUTPUT}}), catalogue)
    problem = _problem(checked, INVENTORY)
    assert "output_schema: items[].item is required by the catalogue but missing" in (
        problem.problem
    )
    assert "refuses the catalogue's example answer" in problem.problem
    assert list(problem.unavailable_modules) == ["system:inventory"]
    assert checked.refused == {INVENTORY}
    assert checked.unavailable_modules == ("system:inventory",)


def test_other_flags_and_types_are_refused(catalogue: list[engine_pb2.GameToolEntry]) -> None:
    retyped = json.loads(World.tools()[1].output_schema)
    retyped["properties"]["count"] = {"type": "string"}
    checked = check_tools(
        _tools(**{GIVE: {"idempotent": True, "output_schema": retyped}}), catalogue
    )
    text = _problem(checked, GIVE).problem
    assert "idempotent is true; the catalogue says false" in text
    assert "output_schema: count has type string; the catalogue says integer" in text
    assert checked.unavailable_modules == ("system:advancement_reward",)


def test_an_input_schema_requiring_more_than_the_engine_sends_is_refused(
    catalogue: list[engine_pb2.GameToolEntry],
) -> None:
    stricter = {
        "type": "object",
        "properties": {"item": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["item", "count", "slot"],
    }
    checked = check_tools(_tools(**{GIVE: {"input_schema": stricter}}), catalogue)
    text = _problem(checked, GIVE).problem
    assert "input_schema: slot is required here but the catalogue does not require it" in text
    assert "refuses the catalogue's example call input" in text


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ("{not json", "output_schema is not JSON"),
        ("[1, 2]", "output_schema must be a JSON object (a JSON Schema), not list"),
        ('"object"', "output_schema must be a JSON object (a JSON Schema), not str"),
        ('{"type": 5}', "output_schema is not a valid JSON Schema (draft 2020-12) at type"),
        ('{"properties": {"a": {"minimum": "x"}}}', "not a valid JSON Schema"),
        ("[" * 5000 + "]" * 5000, "output_schema is not JSON"),
        ('{"items":' * 900 + "{}" + "}" * 900, "output_schema"),
    ],
)
def test_bad_schemas_are_problems_never_errors(
    catalogue: list[engine_pb2.GameToolEntry], schema: str, expected: str
) -> None:
    tools = World.tools()
    tools[0].output_schema = schema
    custom = gateway_pb2.GameTool(name="myplugin:warp", output_schema=schema)
    checked = check_tools([*tools, custom], catalogue)
    assert expected in _problem(checked, INVENTORY).problem
    assert expected in _problem(checked, "myplugin:warp").problem
    # A tool no module needs makes no module unavailable; the catalogued one does.
    assert list(_problem(checked, "myplugin:warp").unavailable_modules) == []
    assert checked.refused == {INVENTORY, "myplugin:warp"}
    assert checked.unavailable_modules == ("system:inventory",)


def test_a_required_tool_not_offered_is_a_problem(
    catalogue: list[engine_pb2.GameToolEntry],
) -> None:
    checked = check_tools([t for t in World.tools() if t.name != GIVE], catalogue)
    problem = _problem(checked, GIVE)
    assert problem.problem == "not offered; required by system:advancement_reward"
    assert checked.refused == frozenset()
    assert checked.unavailable_modules == ("system:advancement_reward",)
    nothing = check_tools([], catalogue)
    assert [p.tool for p in nothing.problems] == [
        "minecraft:economy.transfer",
        INVENTORY,
        GIVE,
        "minecraft:item.lookup",
        "minecraft:mail.claim",
        "minecraft:mail.list",
        "minecraft:mail.read",
        "minecraft:player.profile",
        "minecraft:shop.buy",
        "minecraft:shop.item",
        "minecraft:shop.list",
        "minecraft:signin.claim",
        "minecraft:signin.status",
    ]
    assert nothing.unavailable_modules == (
        "system:advancement_reward",
        "system:inbox",
        "system:inventory",
        "system:item",
        "system:mail_claim",
        "system:pay",
        "system:pay_confirm",
        "system:profile",
        "system:shop",
        "system:shop_buy",
        "system:shop_confirm",
        "system:signin",
    )


def test_undeclared_tools_are_checked_for_presence_only() -> None:
    entry = engine_pb2.GameToolEntry(
        tool=gateway_pb2.GameTool(name="ftbquests:quests.list"),
        declared=False,
        needed_by=[engine_pb2.ToolNeed(module_id="ftbquests:quests", required=True)],
    )
    offered = gateway_pb2.GameTool(
        name="ftbquests:quests.list", read_only=True, output_schema='{"type": "object"}'
    )
    assert check_tools([offered], [entry]).problems == ()
    assert check_tools([], [entry]).unavailable_modules == ("ftbquests:quests",)


# -- through the gateway ---------------------------------------------------------------------


class JavaWorld(World):
    """Answers inventory.read as the Java client of issue 14 did: `id` for `item`."""

    def __init__(self, offer_schema: bool) -> None:
        super().__init__()
        self.offer_schema = offer_schema

    def tools(self) -> list[gateway_pb2.GameTool]:  # type: ignore[override]
        if not self.offer_schema:
            return World.tools()
        return _tools(**{INVENTORY: {"output_schema": JAVA_OUTPUT}})

    def call(self, player_id: str, tool: str, data: dict[str, Any]) -> dict[str, Any]:
        if tool == INVENTORY:
            return {"items": [{"id": "minecraft:diamond", "count": 3}]}
        return super().call(player_id, tool, data)


class BadSchemaWorld(World):
    def tools(self) -> list[gateway_pb2.GameTool]:  # type: ignore[override]
        tools = World.tools()
        tools[0].output_schema = "[1, 2]"
        tools[1].input_schema = "{not json"
        return tools


@contextlib.asynccontextmanager
async def two_servers(tmp_path: pathlib.Path) -> AsyncIterator[Chain]:
    """The in-process chain with tokens for servers `a` and `b` besides its own."""
    original = inprocess.GatewayConfig

    def config(**kwargs: Any) -> Any:
        kwargs["tokens"] = (*kwargs["tokens"], "a=token-of-a", "b=token-of-b")
        return original(**kwargs)

    with mock.patch.object(inprocess, "GatewayConfig", config):
        async with running_chain(tmp_path) as chain:
            yield chain


async def _connect(chain: Chain, server: str, world: World) -> GameServerClient:
    client = chain.new_client(server, f"token-of-{server}")
    client.world = world
    await client.connect()
    return client


def _help_commands(response: gateway_pb2.PlayerResponse) -> set[str]:
    assert response.reply.result.status == SUCCEEDED, response
    return {line.suggest_command for line in response.reply.result.card.lines}


async def test_an_incompatible_tool_takes_its_module_away_on_that_server_only(
    tmp_path: pathlib.Path,
) -> None:
    async with two_servers(tmp_path) as chain:
        java = await _connect(chain, "a", JavaWorld(offer_schema=True))
        sim = await _connect(chain, "b", World())
        assert java.welcome is not None and sim.welcome is not None
        assert [p.tool for p in java.welcome.tool_problems] == [INVENTORY]
        problem = java.welcome.tool_problems[0]
        assert "items[].item is required by the catalogue but missing" in problem.problem
        assert list(problem.unavailable_modules) == ["system:inventory"]
        assert list(sim.welcome.tool_problems) == []
        await java.join("steve", "Steve", "en_us")
        await sim.join("alex", "Alex", "en_us")

        assert "/inventory" not in _help_commands(await java.chat("steve", "help"))
        assert "/inventory" in _help_commands(await sim.chat("alex", "help"))
        refused = (await java.chat("steve", "/inventory")).reply.result
        assert (refused.status, refused.failure.key) == (FAILED, "system.error.unknown_command")
        invoked = await java.request(
            "steve",
            invoke=gateway_pb2.Invoke(call=common_pb2.ModuleAction(module_id="system:inventory")),
        )
        assert invoked.reply.result.failure.key == "system.error.permission_denied"
        assert "unavailable on game server a" in invoked.reply.result.failure.message
        # Nor does local (semantic) routing pick it for that server's player.
        asked = await java.chat("steve", "show my inventory")
        assert asked.reply.module_id != "system:inventory", asked
        local = await sim.chat("alex", "show my inventory")
        assert local.reply.module_id == "system:inventory", local
        served = (await sim.chat("alex", "/inventory")).reply.result
        assert served.status == SUCCEEDED, served.failure
        assert "Bread × 12" in [line.text for line in served.card.lines]


async def test_a_malformed_answer_fails_as_tool_output_invalid(tmp_path: pathlib.Path) -> None:
    async with running_chain(tmp_path) as chain:
        client = chain.new_client()
        client.world = JavaWorld(offer_schema=False)  # claims the catalogue's schema
        await client.connect()
        assert client.welcome is not None and list(client.welcome.tool_problems) == []
        await client.join("steve", "Steve", "en_us")
        result = (await client.chat("steve", "/inventory")).reply.result
        assert (result.status, result.failure.key) == (
            FAILED,
            "system.error.tool_output_invalid",
        )
        assert "minecraft:inventory.read" in result.failure.message
        assert "items[0].item is required" in result.failure.message
        assert "empty" not in result.text.lower()


async def test_bad_schemas_in_a_hello_are_problems_and_the_connection_serves(
    tmp_path: pathlib.Path,
) -> None:
    async with running_chain(tmp_path) as chain:
        client = chain.new_client()
        client.world = BadSchemaWorld()
        await client.connect()
        assert client.welcome is not None
        problems = {p.tool: p for p in client.welcome.tool_problems}
        assert set(problems) == {INVENTORY, GIVE}
        assert problems[INVENTORY].problem.startswith("output_schema must be a JSON object")
        assert problems[GIVE].problem.startswith("input_schema is not JSON")
        await client.join("steve", "Steve", "en_us")
        commands = _help_commands(await client.chat("steve", "help"))
        assert "/help" in commands and "/inventory" not in commands
        # The reward module is gone too: its event is refused, not turned into a task.
        await client.event(
            "steve", "minecraft:advancement", "adv-1", {"advancement": "minecraft:story/mine_stone"}
        )
        await wait_until(lambda: client.frame_errors, timeout=5, what="the event refused")
        assert [e.request_id for e in client.frame_errors] == ["adv-1"]
        assert client.frame_errors[0].code == 5  # NOT_FOUND: no module handles it here
