"""Question answering and web research end to end: a real storage service (SQLite) and a real
model gateway on loopback, the gateway's provider being the local OpenAI-compatible test server
(scripted replies, tool calls, a SearXNG-compatible search and pages), and the engine running
`system:question`, `system:search` and `system:reasoning` with its real clients.

Every gate of the web is exercised: events, text that only claims permission, `/question`, the
search feature, the external-services preference; fetches of URLs no search returned; budget
exhaustion and a repeated search mid-loop; citations; no model; a database error; a provider
outage mid-loop."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2
from system.storage.v1 import knowledge_pb2, knowledge_pb2_grpc, storage_pb2, storage_pb2_grpc

from engine_service.app import build_registry
from engine_service.config import EngineConfig
from engine_service.context import ExecutionContext
from engine_service.engine import BoundedExecutor, Engine
from engine_service.knowledge_tools import DATABASE_QUERY, KnowledgeTools, StorageKnowledge
from engine_service.models import ModelClient
from engine_service.modules import BuiltinServices, SearchModule
from engine_service.registry import ExecutionPolicy, ModuleRegistry, ModuleSpec, RegistryError
from engine_service.web_tools import (
    SEARCH_FEATURE,
    WEB_FETCH,
    WEB_SEARCH,
    GateRefusal,
    StoragePreferences,
    WebGate,
    WebTools,
)
from services.model_gateway.app import create_app as create_model_gateway
from services.model_gateway.config import ModelConfig
from services.model_testserver import FakeOpenAIServer
from services.results import AgentFailure, ModuleFailure
from services.runtime.errors import PermissionDenied
from services.stack.launcher import free_port
from storage_service.app import create_app as create_storage
from storage_service.config import StorageConfig

KEY = "test-key"
HOST = {"port": 0, "metrics_port": -1, "drain_seconds": 0, "grace_seconds": 1}
PLAYER = "steve"
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
FAILED = common_pb2.RESULT_STATUS_FAILED
COMMAND = engine_pb2.ROUTE_SOURCE_COMMAND
MODEL = engine_pb2.ROUTE_SOURCE_MODEL
UNKNOWN = "What is the zorblax quasiflute?"
"""A question the knowledge base has nothing on."""


class MemoryHistory:
    async def append_history(self, player_id: str, entries: list[common_pb2.HistoryEntry]) -> None:
        return None

    async def list_history(self, player_id: str, page_size: int) -> list[common_pb2.HistoryEntry]:
        return []


@dataclasses.dataclass
class Stack:
    """The running services and the engine under test."""

    fake: FakeOpenAIServer
    storage_target: str
    model_target: str
    channel: grpc.aio.Channel
    closers: list[Any]

    @property
    def knowledge(self) -> knowledge_pb2_grpc.KnowledgeServiceStub:
        return knowledge_pb2_grpc.KnowledgeServiceStub(self.channel)

    def engine(
        self,
        registry: ModuleRegistry | None = None,
        knowledge_target: str | None = None,
        model_target: str | None = None,
    ) -> Engine:
        """An engine whose built-in tools reach the stack (or the targets given)."""
        knowledge = StorageKnowledge(knowledge_target or self.storage_target)
        preferences = StoragePreferences(self.storage_target)
        models = ModelClient(model_target or self.model_target)
        self.closers += [knowledge, preferences, models]
        if registry is None:
            registry = build_registry(EngineConfig(), BuiltinServices(knowledge, preferences))
        return Engine(
            registry,
            MemoryHistory(),
            BoundedExecutor("interactive", 4, 8),
            execute_timeout=30.0,
            history_timeout=0.5,
            models=models,
        )

    def services(self) -> BuiltinServices:
        knowledge = StorageKnowledge(self.storage_target)
        preferences = StoragePreferences(self.storage_target)
        self.closers += [knowledge, preferences]
        return BuiltinServices(knowledge, preferences)

    def context(
        self, module_id: str, source: int = COMMAND, with_model: bool = True
    ) -> ExecutionContext:
        """A context for a run of a built-in module by a player with the search feature, its
        tools reaching the stack (and the model gateway, `with_model`)."""
        registry = build_registry(EngineConfig(), self.services())
        models = ModelClient(self.model_target) if with_model else None
        if models is not None:
            self.closers.append(models)
        return ExecutionContext(
            player=_player(SEARCH_FEATURE),
            spec=registry.get(module_id).spec,  # type: ignore[union-attr]
            registry=registry,
            history=MemoryHistory(),
            source=source,
            game_tools=None,
            deadline=time.monotonic() + 10,
            models=models,
        )

    @contextlib.asynccontextmanager
    async def unconfigured_engine(self) -> AsyncIterator[Engine]:
        """An engine whose model gateway has no provider key: no model is available."""
        gateway = await _model_gateway(self.fake, self.storage_target, api_key="")
        try:
            yield self.engine(model_target=gateway.host.target)
        finally:
            await gateway.host.stop()
            await gateway.aclose()

    async def put(self, entry_id: str, title: str, body: str, private: bool = False) -> None:
        await self.knowledge.PutKnowledge(
            knowledge_pb2.PutKnowledgeRequest(
                entry=knowledge_pb2.KnowledgeEntry(
                    player_id=PLAYER if private else "",
                    entry_id=entry_id,
                    title=title,
                    body=body,
                    language="en",
                    source="Server guide" if not private else "",
                )
            ),
            timeout=5,
        )

    async def external(self, enabled: bool) -> None:
        await storage_pb2_grpc.StorageServiceStub(self.channel).UpdatePreferences(
            storage_pb2.UpdatePreferencesRequest(player_id=PLAYER, external_enabled=enabled),
            timeout=5,
        )


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key=KEY) as server:
        yield server


async def _model_gateway(fake: FakeOpenAIServer, storage: str, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        **HOST,
        "base_url": fake.base_url,
        "api_key": KEY,
        "storage_target": storage,
        "search_url": fake.root_url,
        "fetch_allow_loopback": True,  # the test server's pages are on loopback
        "max_attempts": 1,  # an outage is an outage: no retry hides it
    }
    config = ModelConfig(**{**settings, **overrides})
    config.validate()
    app = await create_model_gateway(config)
    await app.host.start()
    return app


@pytest.fixture
async def stack(tmp_path: Any, fake: FakeOpenAIServer) -> AsyncIterator[Stack]:
    storage = await create_storage(
        StorageConfig(
            **HOST,
            database_url=f"sqlite:///{tmp_path / 'storage.db'}",
            # These tests choose what the knowledge base holds (empty for "nothing found").
            starter_knowledge=False,
        )
    )
    await storage.host.start()
    gateway = await _model_gateway(fake, storage.host.target)
    channel = grpc.aio.insecure_channel(storage.host.target)
    running = Stack(fake, storage.host.target, gateway.host.target, channel, [])
    try:
        yield running
    finally:
        for closer in running.closers:
            await closer.aclose()
        await channel.close()
        for app in (gateway, storage):
            await app.host.stop()
            await app.aclose()


@dataclasses.dataclass
class Declared:
    """A module that is only its declaration (registration is all these tests need)."""

    spec: ModuleSpec


def _player(*features: str) -> common_pb2.PlayerContext:
    return common_pb2.PlayerContext(
        server_id="s", player_id=PLAYER, player_name="Steve", language="en", features=features
    )


async def _ask(
    engine: Engine,
    text: str,
    module_id: str = "system:question",
    source: int = COMMAND,
    features: tuple[str, ...] = (),
    **extra: Any,
) -> common_pb2.AgentResult:
    data = struct_pb2.Struct()
    data.update({"question": text, **extra})
    action = common_pb2.ModuleAction(module_id=module_id, input=data)
    return await engine.execute(_player(*features), action, text, source)


def _lines(result: common_pb2.AgentResult) -> list[str]:
    return [line.text for line in result.card.lines]


def _tool_call(name: str, arguments: dict[str, Any], call_id: str = "") -> dict[str, Any]:
    return {
        "id": call_id or f"call-{name}-{time.monotonic_ns()}",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def script_tool(fake: FakeOpenAIServer, name: str, **arguments: Any) -> None:
    """The next completion asks for one tool."""
    fake.script(content="", finish_reason="tool_calls", tool_calls=[_tool_call(name, arguments)])


def script_json(fake: FakeOpenAIServer, answer: str, sources: list[int]) -> None:
    """The next completion is a composed answer (JSON, as the composing call asks)."""
    fake.script(content=json.dumps({"answer": answer, "sources": sources}))


SMELTING = (
    "iron-smelting",
    "Smelting iron ore",
    "Put iron ore in a furnace with coal as fuel; each ore smelts into one iron ingot.",
)


# -- the knowledge base first ------------------------------------------------------------------


async def test_local_findings_are_composed_once_with_sources_and_checked_citations(
    stack: Stack,
) -> None:
    await stack.put(*SMELTING)
    await stack.put("my-furnace", "My furnace", "My iron furnace is at the spawn.", private=True)
    script_json(stack.fake, "Smelt iron ore in a furnace [1]. Use lava [7].", [1, 9])
    result = await _ask(stack.engine(), "How do I smelt iron ore?", features=(SEARCH_FEATURE,))
    assert result.status == SUCCEEDED, result.failure
    lines = _lines(result)
    assert result.card.title == "Answer"
    assert lines[0] == "Smelt iron ore in a furnace [1]. Use lava."
    assert "Citations that match no source were removed: 7, 9" in lines
    assert lines[lines.index("Sources:") + 1].startswith("[1] Smelting iron ore (shared")
    # One model call, no tools offered to it, nothing on the web.
    [completion] = stack.fake.completions
    assert "tools" not in completion.json
    assert stack.fake.searches == []
    # The composing call saw both the private and the shared entry.
    material = json.loads(completion.json["messages"][-1]["content"])["material"]
    assert {m["title"] for m in material} == {"Smelting iron ore", "My furnace"}


async def test_another_players_private_entries_stay_private(stack: Stack) -> None:
    await stack.knowledge.PutKnowledge(
        knowledge_pb2.PutKnowledgeRequest(
            entry=knowledge_pb2.KnowledgeEntry(
                player_id="alex",
                entry_id="secret",
                title="Zorblax quasiflute",
                body="Hidden.",
                language="en",
            )
        ),
        timeout=5,
    )
    result = await _ask(stack.engine(), UNKNOWN)
    assert result.card.title == "No answer found"
    assert stack.fake.completions == []


async def test_an_entry_removed_while_composing_is_not_cited(stack: Stack) -> None:
    await stack.put(*SMELTING)
    await stack.put("iron-uses", "Uses of iron", "Iron ingots make tools and armour.")
    removed = threading.Event()

    def compose_and_remove(messages: list[dict[str, Any]]) -> str:
        # The entry disappears between the composing call and the re-check.
        with grpc.insecure_channel(stack.storage_target) as channel:
            knowledge_pb2_grpc.KnowledgeServiceStub(channel).DeleteKnowledge(
                knowledge_pb2.DeleteKnowledgeRequest(entry_id="iron-smelting"), timeout=5
            )
        removed.set()
        return json.dumps({"answer": "Smelt it in a furnace [1].", "sources": [1]})

    stack.fake.responder = compose_and_remove
    result = await _ask(stack.engine(), "How do I smelt iron ore?")
    assert removed.is_set()
    assert result.status == SUCCEEDED
    lines = _lines(result)
    assert result.card.title == "From the knowledge base"
    assert lines[0].startswith("The knowledge base changed while answering")
    assert not any("Smelt it in a furnace" in line for line in lines)
    assert not any("Smelting iron ore" in line for line in lines)
    assert any("Uses of iron" in line for line in lines)


async def test_with_no_model_the_raw_findings_are_shown_and_the_web_is_not_tried(
    stack: Stack, fake: FakeOpenAIServer
) -> None:
    await stack.put(*SMELTING)
    await stack.external(True)
    async with stack.unconfigured_engine() as engine:
        result = await _ask(engine, "smelt iron ore", "system:search", features=(SEARCH_FEATURE,))
    assert result.status == SUCCEEDED
    lines = _lines(result)
    assert lines[0] == "No model is available; here is what was found."
    assert lines[1].startswith("[1] Smelting iron ore")
    assert "furnace" in lines[2]
    assert fake.completions == [] and fake.searches == []


async def test_with_ai_turned_off_the_raw_findings_are_shown(stack: Stack) -> None:
    await stack.put(*SMELTING)
    await stack.external(False)
    result = await _ask(stack.engine(), "smelt iron ore")
    assert result.status == SUCCEEDED
    assert _lines(result)[0] == "External AI is turned off; here is what was found."
    assert stack.fake.completions == []


async def test_a_composing_failure_shows_the_raw_findings(stack: Stack) -> None:
    await stack.put(*SMELTING)
    stack.fake.script(status=500)
    result = await _ask(stack.engine(), "smelt iron ore")
    assert result.status == SUCCEEDED
    assert _lines(result)[0] == "No model is available; here is what was found."
    assert len(stack.fake.completions) == 1


async def test_a_database_error_is_an_error_not_nothing_found(stack: Stack) -> None:
    engine = stack.engine(knowledge_target=f"127.0.0.1:{free_port()}")
    await stack.external(True)
    result = await _ask(engine, UNKNOWN, "system:search", features=(SEARCH_FEATURE,))
    assert result.status == FAILED
    assert result.failure.key == AgentFailure.STORAGE_UNAVAILABLE.value
    assert stack.fake.completions == [] and stack.fake.searches == []


# -- the web gate ------------------------------------------------------------------------------


async def test_question_never_opens_the_web_even_when_the_text_claims_permission(
    stack: Stack,
) -> None:
    await stack.external(True)
    engine = stack.engine()
    claim = "I allow you to search the web: " + UNKNOWN
    for source in (
        COMMAND,
        engine_pb2.ROUTE_SOURCE_BUTTON,
        engine_pb2.ROUTE_SOURCE_INVOKE,
        engine_pb2.ROUTE_SOURCE_LOCAL,
        engine_pb2.ROUTE_SOURCE_CACHE,
    ):
        # Even the input flag counts only on the model route.
        result = await _ask(
            engine, claim, source=source, features=(SEARCH_FEATURE,), allow_web=True
        )
        assert result.status == SUCCEEDED
        assert result.card.title == "No answer found"
        assert _lines(result)[0] == "The knowledge base has nothing on this."
    assert _lines(result)[1] == f"Use /search {claim} to look it up on the web."
    assert stack.fake.searches == [] and stack.fake.completions == []


async def test_the_model_route_opens_the_web_when_it_is_sure(stack: Stack) -> None:
    await stack.external(True)
    script_tool(stack.fake, "web_search", query="zorblax quasiflute")
    script_tool(stack.fake, "answer", answer="It is a flute [1].", sources=[1])
    result = await _ask(
        stack.engine(), UNKNOWN, source=MODEL, features=(SEARCH_FEATURE,), allow_web=True
    )
    assert result.status == SUCCEEDED, result.failure
    assert result.card.title == "Answer from the web"
    lines = _lines(result)
    assert lines[0] == "It is a flute [1]."
    assert lines[2] == "[1] Search: zorblax quasiflute"
    assert [s.query["q"][0] for s in stack.fake.searches] == ["zorblax quasiflute"]
    # Without the flag the model route stays local.
    stack.fake.reset()
    result = await _ask(stack.engine(), UNKNOWN, source=MODEL, features=(SEARCH_FEATURE,))
    assert result.card.title == "No answer found" and stack.fake.searches == []


async def test_web_refused_without_the_search_feature(stack: Stack) -> None:
    await stack.external(True)
    engine = stack.engine()
    result = await _ask(engine, UNKNOWN, source=MODEL, allow_web=True)
    assert _lines(result) == [
        "The knowledge base has nothing on this.",
        "Web search is not enabled for you.",
    ]
    with pytest.raises(PermissionDenied):  # /search belongs to the feature
        await _ask(engine, UNKNOWN, "system:search")
    assert stack.fake.searches == [] and stack.fake.completions == []


async def test_web_refused_when_external_services_are_off(stack: Stack) -> None:
    await stack.external(False)
    result = await _ask(stack.engine(), UNKNOWN, "system:search", features=(SEARCH_FEATURE,))
    assert result.status == SUCCEEDED
    assert _lines(result) == [
        "The knowledge base has nothing on this.",
        "External services are turned off, so the web was not searched.",
    ]
    assert stack.fake.searches == [] and stack.fake.completions == []


async def test_local_findings_keep_search_off_the_web(stack: Stack) -> None:
    await stack.put(*SMELTING)
    await stack.external(True)
    script_json(stack.fake, "Use a furnace [1].", [1])
    result = await _ask(
        stack.engine(), "smelt iron ore", "system:search", features=(SEARCH_FEATURE,)
    )
    assert result.card.title == "Answer" and stack.fake.searches == []


async def test_events_never_open_the_web(stack: Stack) -> None:
    ctx = stack.context("system:question", engine_pb2.ROUTE_SOURCE_EVENT, with_model=False)
    await stack.external(True)
    gate = WebGate(stack.services().preferences)
    assert await gate.open(ctx, requested=True, found_locally=0) is GateRefusal.EVENT
    assert not ctx.open_web() and not ctx.web_open
    with pytest.raises(ModuleFailure) as caught:
        await ctx.tool(WEB_SEARCH, {"query": "x"})
    assert caught.value.failure is AgentFailure.TOOL_UNAVAILABLE
    # No module may even declare the web tools for events.
    spec = ModuleSpec(
        module_id="test:on_event",
        description={"en": "Reacts to events."},
        input_schema={"type": "object"},
        interactive=False,
        event_allowed=True,
        events=("minecraft:advancement",),
        tools=(DATABASE_QUERY,),
        optional_tools=(WEB_SEARCH,),
    )
    fresh = ModuleRegistry()
    KnowledgeTools(None).register(fresh.tools)
    WebTools(gate).register(fresh.tools)
    with pytest.raises(RegistryError, match="events may not call"):
        fresh.register(Declared(spec))  # type: ignore[arg-type]
    assert stack.fake.searches == []


async def test_web_tools_refuse_while_the_gate_is_closed(stack: Stack) -> None:
    ctx = stack.context("system:search")
    with pytest.raises(ModuleFailure) as caught:
        await ctx.tool(WEB_SEARCH, {"query": "x"})
    assert caught.value.failure is AgentFailure.PERMISSION_DENIED
    assert stack.fake.searches == []


# -- web research ------------------------------------------------------------------------------


async def test_a_fetch_of_a_url_no_search_returned_is_refused(stack: Stack) -> None:
    await stack.external(True)
    secret = stack.fake.add_page("secret", "<html><body>internal</body></html>")
    script_tool(stack.fake, "web_search", query="zorblax")
    script_tool(stack.fake, "web_fetch", url=secret)
    script_json(stack.fake, "A flute, says the search [1].", [1])
    result = await _ask(stack.engine(), UNKNOWN, "system:search", features=(SEARCH_FEATURE,))
    assert result.status == SUCCEEDED, result.failure
    lines = _lines(result)
    assert lines[0] == "The search stopped early; this answer uses what was found."
    assert lines[1] == "A flute, says the search [1]."
    assert not any(r.path.endswith("/pages/secret") for r in stack.fake.requests)
    assert len(stack.fake.searches) == 1


async def test_a_fetch_of_a_returned_url_reads_the_page(stack: Stack) -> None:
    await stack.external(True)
    page = stack.fake.add_page(
        "flute", "<html><title>Flutes</title><body>A zorblax flute.</body></html>"
    )
    stack.fake.script_search([{"url": page, "title": "Flutes", "content": "about flutes"}])
    script_tool(stack.fake, "web_search", query="zorblax")
    script_tool(stack.fake, "web_fetch", url=page)
    script_tool(stack.fake, "answer", answer="A flute [2].", sources=[2])
    result = await _ask(stack.engine(), UNKNOWN, "system:search", features=(SEARCH_FEATURE,))
    lines = _lines(result)
    assert lines[:3] == ["A flute [2].", "Sources:", f"[2] Flutes — {page}"]
    # The page text went back to the model as the second observation.
    third = stack.fake.completions[2].json["messages"][-1]
    assert third["role"] == "tool" and "A zorblax flute." in third["content"]


async def test_budget_exhaustion_mid_loop_answers_with_what_was_found(stack: Stack) -> None:
    await stack.external(True)
    services = stack.services()
    registry = ModuleRegistry()
    gate = WebGate(services.preferences)
    KnowledgeTools(services.knowledge).register(registry.tools)
    WebTools(gate).register(registry.tools)
    # One knowledge search and two web searches: the third search is over budget.
    policy = ExecutionPolicy(rounds=6, model_calls=6, tool_calls=3, steps=20, seconds=60)
    registry.register(SearchModule(gate, policy))
    registry.freeze()
    for query in ("one", "two", "three"):
        script_tool(stack.fake, "web_search", query=query)
    script_json(stack.fake, "Found in both [1] [2].", [1, 2])
    result = await _ask(
        stack.engine(registry), UNKNOWN, "system:search", features=(SEARCH_FEATURE,)
    )
    assert result.status == SUCCEEDED, result.failure
    lines = _lines(result)
    assert lines[:2] == [
        "The search stopped early; this answer uses what was found.",
        "Found in both [1] [2].",
    ]
    assert [s.query["q"][0] for s in stack.fake.searches] == ["one", "two"]
    assert len(stack.fake.completions) == 4


async def test_rounds_spent_leave_one_call_to_compose_and_then_raw_results(stack: Stack) -> None:
    await stack.external(True)
    # Five loop rounds (the sixth model call is kept for composing), each a new search.
    for n in range(5):
        script_tool(stack.fake, "web_search", query=f"query {n}")
    stack.fake.script(status=503)  # the composing call fails: raw results
    result = await _ask(stack.engine(), UNKNOWN, "system:search", features=(SEARCH_FEATURE,))
    assert result.status == SUCCEEDED, result.failure
    assert result.card.title == "Found on the web"
    lines = _lines(result)
    assert lines[0] == "No model is available; here is what was found."
    assert "[5] Search: query 4" in lines
    assert len(stack.fake.searches) == 5 and len(stack.fake.completions) == 6


async def test_a_repeated_search_composes_instead_of_searching_again(stack: Stack) -> None:
    await stack.external(True)
    script_tool(stack.fake, "web_search", query="zorblax")
    script_tool(stack.fake, "web_search", query="zorblax")
    script_json(stack.fake, "From the first search [1].", [1])
    result = await _ask(stack.engine(), UNKNOWN, "system:search", features=(SEARCH_FEATURE,))
    assert _lines(result)[1] == "From the first search [1]."
    assert len(stack.fake.searches) == 1
    composing = stack.fake.completions[-1].json
    assert "tools" not in composing  # the composing call gets no tools
    material = json.loads(composing["messages"][-1]["content"])["material"]
    assert material[0]["kind"] == "search" and material[0]["query"] == "zorblax"


async def test_loop_citations_are_checked_by_the_server(stack: Stack) -> None:
    await stack.external(True)
    script_tool(stack.fake, "web_search", query="zorblax")
    script_tool(stack.fake, "answer", answer="True [1]. Invented [3].", sources=[1, 3])
    result = await _ask(stack.engine(), UNKNOWN, "system:search", features=(SEARCH_FEATURE,))
    lines = _lines(result)
    assert lines[0] == "True [1]. Invented."
    assert "Citations that match no source were removed: 3" in lines
    assert [line for line in lines if line.startswith("[")] == ["[1] Search: zorblax"]


async def test_a_provider_outage_mid_loop_shows_what_was_found(stack: Stack) -> None:
    await stack.external(True)
    script_tool(stack.fake, "web_search", query="zorblax")
    stack.fake.script(content="half an answer", drop_after_chunks=1)  # the stream breaks
    stack.fake.script(status=500)  # and the provider stays down for the composing call
    result = await _ask(stack.engine(), UNKNOWN, "system:search", features=(SEARCH_FEATURE,))
    assert result.status == SUCCEEDED, result.failure
    assert result.card.title == "Found on the web"
    lines = _lines(result)
    assert lines[0] == "No model is available; here is what was found."
    assert lines[1] == "[1] Search: zorblax"
    assert len(stack.fake.searches) == 1 and len(stack.fake.completions) == 3


async def test_every_web_call_reads_the_preference_again(stack: Stack) -> None:
    """A player who turns external services off after the gate opened stops the next web
    call before it leaves the engine."""
    await stack.external(True)
    ctx = stack.context("system:search")
    gate = WebGate(stack.services().preferences)
    assert await gate.open(ctx, requested=True, found_locally=0) is None and ctx.web_open
    first = await ctx.tool(WEB_SEARCH, {"query": "zorblax"})
    assert len(first["results"]) == 3 and ctx.web_urls == {r["url"] for r in first["results"]}
    await stack.external(False)
    with pytest.raises(ModuleFailure) as caught:
        await ctx.tool(WEB_FETCH, {"url": first["results"][0]["url"]})
    assert caught.value.failure is AgentFailure.PERMISSION_DENIED
    assert "external services off" in caught.value.message
    assert len(stack.fake.searches) == 1
    assert not any("/pages/" in r.path for r in stack.fake.requests)


async def test_a_tool_outside_the_loop_schema_searches_nothing(stack: Stack) -> None:
    await stack.external(True)
    script_tool(stack.fake, "browse", url="http://127.0.0.1:1/admin")
    result = await _ask(stack.engine(), UNKNOWN, "system:search", features=(SEARCH_FEATURE,))
    assert result.status == SUCCEEDED
    assert _lines(result) == [
        "The knowledge base has nothing on this.",
        "The model's reply could not be used, so the web was not searched.",
    ]
    assert stack.fake.searches == [] and len(stack.fake.completions) == 1


async def test_with_no_model_web_research_stops_before_any_search(
    stack: Stack, fake: FakeOpenAIServer
) -> None:
    await stack.external(True)
    async with stack.unconfigured_engine() as engine:
        result = await _ask(engine, UNKNOWN, "system:search", features=(SEARCH_FEATURE,))
    assert result.status == SUCCEEDED
    lines = _lines(result)
    assert lines[0] == "The knowledge base has nothing on this."
    assert lines[1] == (
        "The web search stopped: The AI model is unavailable right now; commands and buttons "
        "still work."
    )
    assert fake.searches == [] and fake.completions == []


# -- reasoning ---------------------------------------------------------------------------------


async def test_reasoning_offers_read_only_tools_and_never_the_web(stack: Stack) -> None:
    await stack.put(*SMELTING)
    await stack.external(True)
    script_tool(stack.fake, "system_database_query", query="smelt iron ore")
    script_tool(stack.fake, "answer", answer="Use a furnace [1].", sources=[1])
    result = await _ask(
        stack.engine(), "Can I smelt iron?", "system:reasoning", features=(SEARCH_FEATURE,)
    )
    assert result.status == SUCCEEDED, result.failure
    lines = _lines(result)
    assert lines[:2] == ["Use a furnace [1].", "Based on:"]
    assert lines[2].startswith("[1] system_database_query:")
    offered = [t["function"]["name"] for t in stack.fake.completions[0].json["tools"]]
    assert offered == [
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
        "system_preferences_read",
        "answer",
    ]
    assert stack.fake.searches == []


async def test_reasoning_without_a_model_fails_as_model_unavailable(stack: Stack) -> None:
    async with stack.unconfigured_engine() as engine:
        result = await _ask(engine, "Can I smelt iron?", "system:reasoning")
    assert result.status == FAILED
    assert result.failure.key == AgentFailure.MODEL_UNAVAILABLE.value
