"""The bounded ReAct loop as a unit: only tools in this step's schema run, arguments must be a
JSON object, a paid call is never repeated, rounds and budgets end the loop with what was
observed, recoverable failures stop it, cancellation and revokes propagate; and the server's
citation check. The model is a scripted stand-in for the gateway client (the loop's whole view
of it is `complete`); the question tests drive the same loop through the real gateway."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2
from system.model.v1 import model_pb2

from engine_service.context import ExecutionContext
from engine_service.models import Completion, ToolCall
from engine_service.modules import ReasoningModule, register_builtins
from engine_service.modules.compose import check_citations
from engine_service.modules.reasoning import offered_tools
from engine_service.react import LoopTool, ReActLoop
from engine_service.registry import ExecutionPolicy, ModuleRegistry, ModuleSpec
from engine_service.tools import ToolRegistry, ToolSpec
from services.results import AgentFailure, ModuleFailure

LOOKUP = "system:test.lookup"
PAID = "system:test.paid"
OBJECT = {"type": "object", "properties": {"q": {"type": "string"}}, "additionalProperties": False}


class ScriptedModel:
    """Answers `complete` with the scripted completions in order, recording each request."""

    def __init__(self, *replies: Completion | ModuleFailure) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []

    async def complete(
        self, player_id: str, messages: list[model_pb2.ChatMessage], timeout: float, **kwargs: Any
    ) -> Completion:
        self.requests.append({"messages": list(messages), "timeout": timeout, **kwargs})
        reply = self.replies.pop(0)
        if isinstance(reply, ModuleFailure):
            raise reply
        return reply


def call(name: str, arguments: Any = None, raw: str | None = None) -> Completion:
    text = raw if raw is not None else json.dumps(arguments or {})
    return Completion("", (ToolCall(f"c-{name}", name, text),), "tool_calls")


def answer(text: str, sources: list[int] | None = None) -> Completion:
    return call("answer", {"answer": text, "sources": sources or []})


class Tools:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail_with: ModuleFailure | None = None
        self.on_call: Callable[[], None] | None = None

    async def lookup(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((LOOKUP, payload))
        if self.on_call is not None:
            self.on_call()
        if self.fail_with is not None:
            raise self.fail_with
        return {"found": payload.get("q", "")}

    async def paid(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((PAID, payload))
        return {"paid": payload.get("q", "")}


def _context(
    model: ScriptedModel,
    tools: Tools,
    policy: ExecutionPolicy | None = None,
    live: list[common_pb2.PlayerContext] | None = None,
) -> ExecutionContext:
    registry_tools = ToolRegistry()
    registry_tools.server(ToolSpec(LOOKUP, "Looks up.", OBJECT, read_only=True), tools.lookup)
    registry_tools.server(ToolSpec(PAID, "Costs money.", OBJECT, read_only=True), tools.paid)
    registry = ModuleRegistry(registry_tools)
    spec = ModuleSpec(
        module_id="test:loop",
        description={"en": "A loop."},
        input_schema={"type": "object"},
        min_permission_level=1,
        tools=(LOOKUP, PAID),
        policy=policy or ExecutionPolicy(rounds=4, model_calls=4, tool_calls=4, steps=10),
    )

    class Module:
        async def run(self, data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
            raise AssertionError("not run")

    module = Module()
    module.spec = spec  # type: ignore[attr-defined]
    registry.register(module)  # type: ignore[arg-type]
    registry.freeze()
    player = common_pb2.PlayerContext(player_id="p", language="en", permission_level=1)
    snapshots = live if live is not None else [player]
    return ExecutionContext(
        player=player,
        spec=spec,
        registry=registry,
        history=None,  # type: ignore[arg-type]
        source=engine_pb2.ROUTE_SOURCE_COMMAND,
        game_tools=None,
        deadline=time.monotonic() + 30,
        current_player=lambda: snapshots[-1],
        models=model,  # type: ignore[arg-type]
    )


LOOP_TOOLS = (
    LoopTool("lookup", LOOKUP, "Look something up.", OBJECT),
    LoopTool("paid", PAID, "A paid lookup.", OBJECT, paid=True),
)


async def _run(ctx: ExecutionContext, rounds: int | None = None) -> Any:
    return await ReActLoop(ctx, "instructions", LOOP_TOOLS, rounds=rounds).run("question")


async def test_answer_after_an_observation_carries_the_tool_result_back() -> None:
    model = ScriptedModel(call("lookup", {"q": "iron"}), answer("Iron [1].", [1]))
    tools = Tools()
    outcome = await _run(_context(model, tools))
    assert outcome.stopped == "answer" and outcome.answer == "Iron [1]." and outcome.sources == (1,)
    assert [o.output for o in outcome.observations] == [{"found": "iron"}]
    assert tools.calls == [(LOOKUP, {"q": "iron"})]
    second = model.requests[1]["messages"]
    assert second[-2].role == model_pb2.MESSAGE_ROLE_ASSISTANT
    assert second[-2].tool_calls[0].name == "lookup"
    assert second[-1].role == model_pb2.MESSAGE_ROLE_TOOL
    assert second[-1].tool_call_id == "c-lookup"
    assert json.loads(second[-1].content) == {"observation": 1, "output": {"found": "iron"}}
    # Every step offers the same schema, `answer` included, and requires a tool call.
    names = [t.name for t in model.requests[0]["tools"]]
    assert names == ["lookup", "paid", "answer"] and model.requests[0]["require_tool"]
    # The model gateway picks the module's providers and the player's rank from these.
    assert model.requests[0]["permission_level"] == 1
    assert model.requests[0]["module_id"] == "test:loop"


async def test_a_tool_outside_the_schema_is_refused_and_never_run() -> None:
    model = ScriptedModel(call("lookup", {"q": "a"}), call("system_test_lookup", {"q": "b"}))
    tools = Tools()
    outcome = await _run(_context(model, tools))
    assert outcome.stopped == "refused"
    assert len(outcome.observations) == 1 and len(tools.calls) == 1


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", '"text"', "null"])
async def test_arguments_that_are_not_a_json_object_are_refused(raw: str) -> None:
    tools = Tools()
    outcome = await _run(_context(ScriptedModel(call("lookup", raw=raw)), tools))
    assert outcome.stopped == "refused" and not tools.calls


async def test_arguments_outside_the_tool_schema_stop_the_loop_as_invalid_input() -> None:
    tools = Tools()
    outcome = await _run(_context(ScriptedModel(call("lookup", {"colour": "red"})), tools))
    assert outcome.stopped == "failure" and not tools.calls
    assert outcome.failure is not None and outcome.failure.failure is AgentFailure.INVALID_INPUT


async def test_rounds_exhausted_end_with_what_was_observed() -> None:
    model = ScriptedModel(*(call("lookup", {"q": str(n)}) for n in range(3)))
    outcome = await _run(_context(model, Tools()), rounds=3)
    assert outcome.stopped == "rounds"
    assert [o.number for o in outcome.observations] == [1, 2, 3]
    assert len(model.requests) == 3


async def test_a_paid_call_is_never_repeated() -> None:
    model = ScriptedModel(call("paid", {"q": "x"}), call("paid", {"q": "x"}))
    tools = Tools()
    outcome = await _run(_context(model, tools))
    assert outcome.stopped == "repeat"
    assert tools.calls == [(PAID, {"q": "x"})]


async def test_an_unpaid_call_may_repeat() -> None:
    model = ScriptedModel(call("lookup", {"q": "x"}), call("lookup", {"q": "x"}), answer("ok"))
    outcome = await _run(_context(model, Tools()))
    assert outcome.stopped == "answer" and len(outcome.observations) == 2


async def test_the_model_budget_ends_the_loop_as_a_recoverable_failure() -> None:
    policy = ExecutionPolicy(rounds=5, model_calls=2, tool_calls=5, steps=10)
    model = ScriptedModel(call("lookup", {"q": "a"}), call("lookup", {"q": "b"}))
    outcome = await _run(_context(model, Tools(), policy))
    assert outcome.stopped == "failure" and len(outcome.observations) == 2
    assert outcome.failure is not None
    assert outcome.failure.failure is AgentFailure.BUDGET_EXHAUSTED


async def test_the_tool_budget_ends_the_loop_with_what_was_found() -> None:
    policy = ExecutionPolicy(rounds=5, model_calls=5, tool_calls=1, steps=10)
    model = ScriptedModel(call("lookup", {"q": "a"}), call("lookup", {"q": "b"}))
    tools = Tools()
    outcome = await _run(_context(model, tools, policy))
    assert outcome.stopped == "failure" and len(outcome.observations) == 1
    assert len(tools.calls) == 1


async def test_a_model_outage_stops_the_loop_recoverably() -> None:
    outage = ModuleFailure(AgentFailure.MODEL_UNAVAILABLE, "provider down")
    model = ScriptedModel(call("lookup", {"q": "a"}), outage)
    outcome = await _run(_context(model, Tools()))
    assert outcome.stopped == "failure" and outcome.failure is not None
    assert outcome.failure.failure is AgentFailure.MODEL_UNAVAILABLE
    # The player reads a plain sentence; the provider's words ("provider down") go to the log.
    assert outcome.failure.message == (
        "The AI model is unavailable right now; commands and buttons still work."
    )
    assert len(outcome.observations) == 1


async def test_a_plain_text_reply_is_an_answer_and_an_empty_one_is_refused() -> None:
    outcome = await _run(_context(ScriptedModel(Completion("Just this.", (), "stop")), Tools()))
    assert outcome.stopped == "answer" and outcome.answer == "Just this."
    outcome = await _run(_context(ScriptedModel(Completion("  ", (), "stop")), Tools()))
    assert outcome.stopped == "refused"
    outcome = await _run(_context(ScriptedModel(answer("  ")), Tools()))
    assert outcome.stopped == "refused"


async def test_cancellation_propagates() -> None:
    tools = Tools()
    tools.fail_with = ModuleFailure(AgentFailure.CANCELLED, "cancelled")
    with pytest.raises(ModuleFailure) as caught:
        await _run(_context(ScriptedModel(call("lookup", {"q": "a"})), tools))
    assert caught.value.failure is AgentFailure.CANCELLED


async def test_a_refused_call_stops_the_loop_but_a_revoke_propagates() -> None:
    tools = Tools()
    tools.fail_with = ModuleFailure(AgentFailure.PERMISSION_DENIED, "that page may not be read")
    outcome = await _run(_context(ScriptedModel(call("lookup", {"q": "a"})), tools))
    assert outcome.stopped == "failure"
    # The player loses the permission level the module needs while the tool runs: the run
    # must stop at its next call, not compose.
    live = [common_pb2.PlayerContext(player_id="p", permission_level=1)]
    revoking = Tools()
    revoking.on_call = lambda: live.append(common_pb2.PlayerContext(player_id="p"))
    model = ScriptedModel(call("lookup", {"q": "a"}), answer("never"))
    with pytest.raises(ModuleFailure) as caught:
        await _run(_context(model, revoking, live=live))
    assert caught.value.failure is AgentFailure.PERMISSION_DENIED
    assert len(model.requests) == 1


def test_loop_tool_names_must_be_unique_and_not_answer() -> None:
    ctx = _context(ScriptedModel(), Tools())
    with pytest.raises(ValueError):
        ReActLoop(ctx, "x", [LoopTool("answer", LOOKUP, "x", OBJECT)])
    with pytest.raises(ValueError):
        ReActLoop(ctx, "x", [LOOP_TOOLS[0], LOOP_TOOLS[0]])


# -- citations ----------------------------------------------------------------------------------


def test_citations_keep_known_numbers_and_drop_the_rest() -> None:
    checked = check_citations("Smelt it [1]. Or pray [4]. Both [1, 3].", [2, 9, True, "1"], 3)
    assert checked.answer == "Smelt it [1]. Or pray. Both [1, 3]."
    assert checked.sources == (1, 2, 3)
    assert checked.dropped == (4, 9)


def test_citations_with_nothing_to_cite() -> None:
    checked = check_citations("Nothing found [1].", [1], 0)
    assert checked.answer == "Nothing found." and checked.sources == () and checked.dropped == (1,)


# -- reasoning's tools ----------------------------------------------------------------------------


def test_reasoning_offers_read_only_tools_of_modules_the_player_may_use() -> None:
    tools = Tools()

    class Quests:
        spec = ModuleSpec(
            module_id="ftbquests:quests",
            description={"en": "Quests."},
            input_schema={"type": "object"},
            owner_feature="ftbquests",
            tools=("ftbquests:quests.list",),
        )

        async def run(self, data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
            raise AssertionError("not run")

    registry = ModuleRegistry()
    registry.tools.server(ToolSpec(LOOKUP, "Looks up.", OBJECT, read_only=True), tools.lookup)
    registry.tools.game(
        ToolSpec(
            "ftbquests:quests.list",
            "Lists quests.",
            read_only=True,
            owner_feature="ftbquests",
            kind="game",
        )
    )
    register_builtins(registry, extra=[Quests()])  # type: ignore[list-item]
    registry.freeze()
    reasoning = registry.get("system:reasoning")
    assert isinstance(reasoning, ReasoningModule)
    # Read-only tools only (never minecraft:item.give), never the web tools.
    assert reasoning.spec.optional_tools == (
        "minecraft:inventory.read",
        "minecraft:player.profile",
        "minecraft:signin.status",
        "minecraft:item.lookup",
        "minecraft:mail.list",
        "minecraft:mail.read",
        "minecraft:shop.list",
        "minecraft:shop.item",
        "minecraft:player.find",
        "system:database.query",
        "ftbquests:quest.query",
        "ftbquests:quest.find",
        "ftbquests:quest.detail",
        "minecraft:gift.list",
        # Offered only to a player who may use /system routing, /system usage,
        # /system spend and /system knowledge (an admin): see `offered`.
        "system:routing.diagnostics",
        "system:usage.read",
        "system:spend.read",
        "system:knowledge.list",
        "system:preferences.read",
        "ftbquests:quests.list",
    )

    def offered(*features: str) -> list[str]:
        player = common_pb2.PlayerContext(player_id="p", features=features)
        ctx = ExecutionContext(
            player=player,
            spec=reasoning.spec,
            registry=registry,
            history=None,  # type: ignore[arg-type]
            source=engine_pb2.ROUTE_SOURCE_COMMAND,
            game_tools=None,
            deadline=time.monotonic() + 5,
        )
        return [tool.name for tool in offered_tools(ctx, reasoning.spec.optional_tools)]

    core = [
        "minecraft_inventory_read",
        "minecraft_player_profile",
        "minecraft_signin_status",
        "minecraft_item_lookup",
        "minecraft_mail_list",
        "minecraft_mail_read",
        "minecraft_shop_list",
        "minecraft_shop_item",
        "minecraft_player_find",
        "system_database_query",
        "system_preferences_read",  # the player's own settings (/system settings)
    ]
    assert offered() == core
    # With FTB Quests: the quest reads, the gift list (a core tool only the quest detail
    # declares) and the third-party module's tool.
    assert offered("ftbquests", "system:search") == [
        *core[:-1],
        "ftbquests_quest_query",
        "ftbquests_quest_find",
        "ftbquests_quest_detail",
        "minecraft_gift_list",
        core[-1],
        "ftbquests_quests_list",
    ]
