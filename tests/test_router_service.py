"""The router service in-process on port 0 with its real neighbours: a standalone profile set
(no engine), and the model step through the real model gateway and the real openai client
against the project's local OpenAI-compatible server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from system.common.v1 import common_pb2
from system.router.v1 import router_pb2, router_pb2_grpc

from engine_service.app import create_app as create_engine
from engine_service.config import EngineConfig
from router_service.app import create_app as create_router
from router_service.config import RouterConfig
from services.model_gateway.app import create_app as create_model
from services.model_gateway.config import ModelConfig
from services.model_testserver.server import FakeOpenAIServer

HOST = {"port": 0, "metrics_port": -1, "drain_seconds": 0, "grace_seconds": 1}
PROFILES = Path(__file__).resolve().parent.parent / "router_service/corpus/profiles.json"
STEVE = common_pb2.PlayerContext(server_id="sim", player_id="steve", language="en")
ADMIN = common_pb2.PlayerContext(server_id="sim", player_id="op", language="en", permission_level=4)


async def _stop(*apps: object) -> None:
    for app in apps:
        await app.host.stop()  # type: ignore[attr-defined]
        await app.aclose()  # type: ignore[attr-defined]


async def test_standalone_router_routes_from_a_profile_file_without_the_engine() -> None:
    router = await create_router(
        RouterConfig(**HOST, engine_target="", model_target="", profiles_file=str(PROFILES))
    )
    await router.host.start()
    try:
        async with grpc.aio.insecure_channel(router.host.target) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            request = router_pb2.RouteRequest(player=STEVE, text="open the shop")
            decision = await stub.Route(request, timeout=10)
            assert decision.source == router_pb2.DECISION_SOURCE_LOCAL, decision
            assert decision.action.module_id == "system:shop"
            write = await stub.Route(
                router_pb2.RouteRequest(player=STEVE, text="buy 3 diamonds from the shop"),
                timeout=10,
            )
            assert write.source != router_pb2.DECISION_SOURCE_LOCAL  # writes never go direct
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetDiagnostics(router_pb2.GetDiagnosticsRequest(player=STEVE), timeout=5)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            diagnostics = await stub.GetDiagnostics(
                router_pb2.GetDiagnosticsRequest(player=ADMIN), timeout=5
            )
            assert diagnostics.algorithm == "lexical-tfidf-v1"
            assert diagnostics.example_count > 100
            assert "open the shop" not in str(diagnostics)
    finally:
        await _stop(router)


@pytest.fixture
async def with_model(
    tmp_path: Path,
) -> AsyncIterator[tuple[router_pb2_grpc.RouterServiceStub, FakeOpenAIServer]]:
    fake = FakeOpenAIServer(api_key="router-test-key")
    fake.start()
    model = await create_model(
        ModelConfig(**HOST, base_url=fake.base_url, api_key="router-test-key", storage_target="")
    )
    await model.host.start()
    engine = await create_engine(EngineConfig(**HOST, storage_target="127.0.0.1:1"))
    await engine.host.start()
    router = await create_router(
        RouterConfig(**HOST, engine_target=engine.host.target, model_target=model.host.target)
    )
    await router.host.start()
    channel = grpc.aio.insecure_channel(router.host.target)
    try:
        yield router_pb2_grpc.RouterServiceStub(channel), fake
    finally:
        await channel.close()
        await _stop(router, engine, model)
        fake.stop()


async def test_unclear_text_goes_to_the_model_once_and_its_choice_is_cached(with_model) -> None:  # type: ignore[no-untyped-def]
    stub, fake = with_model
    text = "remind me what we were saying earlier"
    fake.script(json.dumps({"capabilityId": "system:history", "arguments": {}}))
    first = await stub.Route(
        router_pb2.RouteRequest(player=STEVE, text=text, external_enabled=True), timeout=10
    )
    assert first.source == router_pb2.DECISION_SOURCE_MODEL
    assert first.action.module_id == "system:history"
    (call,) = fake.completions
    catalogue = json.loads(call.json["messages"][1]["content"])["catalogue"]
    # /search is missing: it belongs to the `system:search` feature, which Steve lacks.
    assert {entry["id"] for entry in catalogue} == {
        "system:help",
        "system:history",
        "system:settings",
        "system:inventory",
        "system:profile",
        "system:item",
        "system:inbox",
        "system:shop",
        "system:shop_buy",
        "system:pay",
        "system:signin",
        "system:question",
        "system:reasoning",
        "clarify",
    }

    recorded = await stub.RecordOutcome(
        router_pb2.RecordOutcomeRequest(
            player=STEVE, text=text, action=first.action, cache_token=first.cache_token
        ),
        timeout=5,
    )
    assert recorded.cached, recorded.reason
    again = await stub.Route(
        router_pb2.RouteRequest(player=STEVE, text=text, external_enabled=True), timeout=10
    )
    assert again.source == router_pb2.DECISION_SOURCE_CACHE
    assert len(fake.completions) == 1  # the second time needed no model call


async def test_model_answers_outside_the_catalogue_never_decode(with_model) -> None:  # type: ignore[no-untyped-def]
    stub, fake = with_model
    fake.script(json.dumps({"capabilityId": "system:format_disk", "arguments": {}}))
    decision = await stub.Route(
        router_pb2.RouteRequest(player=STEVE, text="do the thing", external_enabled=True),
        timeout=10,
    )
    # Read as "nothing fits": standard mode answers it in conversation, never the invention.
    assert decision.source == router_pb2.DECISION_SOURCE_CHAT
    assert decision.action.module_id == "system:chat"
    assert decision.action.input["text"] == "do the thing"


async def test_a_provider_outage_falls_back_locally(with_model) -> None:  # type: ignore[no-untyped-def]
    stub, fake = with_model
    for _ in range(4):  # the model gateway's retries meet the outage too
        fake.script(status=500, message="overloaded")
    decision = await stub.Route(
        router_pb2.RouteRequest(player=STEVE, text="do the thing", external_enabled=True),
        timeout=10,
    )
    assert decision.source in (
        router_pb2.DECISION_SOURCE_LOCAL_FALLBACK,
        router_pb2.DECISION_SOURCE_NONE,
    )


# -- conversation modes ------------------------------------------------------------------------


def _in_mode(mode: int) -> common_pb2.PlayerContext:
    player = common_pb2.PlayerContext()
    player.CopyFrom(STEVE)
    player.conversation_mode = mode  # type: ignore[assignment]
    return player


async def test_offline_mode_never_asks_the_model(with_model) -> None:  # type: ignore[no-untyped-def]
    stub, fake = with_model
    fake.script(json.dumps({"capabilityId": "system:history", "arguments": {}}))
    offline = _in_mode(common_pb2.CONVERSATION_MODE_OFFLINE)
    decision = await stub.Route(
        router_pb2.RouteRequest(
            player=offline, text="remind me what we were saying", external_enabled=True
        ),
        timeout=10,
    )
    assert decision.source in (
        router_pb2.DECISION_SOURCE_LOCAL_FALLBACK,
        router_pb2.DECISION_SOURCE_NONE,
    )
    assert fake.completions == []
    # Commands still work offline.
    command = await stub.Route(router_pb2.RouteRequest(player=offline, text="/help"), timeout=10)
    assert command.source == router_pb2.DECISION_SOURCE_COMMAND


async def test_free_mode_converses_without_routing(with_model) -> None:  # type: ignore[no-untyped-def]
    stub, fake = with_model
    free = _in_mode(common_pb2.CONVERSATION_MODE_FREE)
    # Text that would route locally in standard mode is conversation in free mode...
    decision = await stub.Route(
        router_pb2.RouteRequest(player=free, text="打开帮助菜单", external_enabled=True),
        timeout=10,
    )
    assert decision.source == router_pb2.DECISION_SOURCE_CHAT
    assert decision.action.input["text"] == "打开帮助菜单"
    assert fake.completions == []  # no routing call: the engine's chat makes the one call
    # ...while exact commands still run, and with external services off there is no chat.
    command = await stub.Route(router_pb2.RouteRequest(player=free, text="/help"), timeout=10)
    assert command.source == router_pb2.DECISION_SOURCE_COMMAND
    off = await stub.Route(
        router_pb2.RouteRequest(player=free, text="打开帮助菜单", external_enabled=False),
        timeout=10,
    )
    assert off.source == router_pb2.DECISION_SOURCE_LOCAL
    assert off.action.module_id == "system:help"


async def test_extended_mode_routes_locally_only_at_the_free_chat_score(with_model) -> None:  # type: ignore[no-untyped-def]
    stub, fake = with_model
    text = "what's in my inventory right now"
    standard = await stub.Route(
        router_pb2.RouteRequest(player=STEVE, text=text, external_enabled=True), timeout=10
    )
    assert standard.source == router_pb2.DECISION_SOURCE_LOCAL
    assert standard.action.module_id == "system:inventory"
    assert standard.local.top_score < 0.95  # below the default freeChat score
    assert fake.completions == []
    fake.script(json.dumps({"capabilityId": "clarify", "arguments": {}}))
    extended = await stub.Route(
        router_pb2.RouteRequest(
            player=_in_mode(common_pb2.CONVERSATION_MODE_EXTENDED), text=text, external_enabled=True
        ),
        timeout=10,
    )
    # Not direct in extended mode: the model is asked, finds nothing, and it is conversation.
    assert extended.local.gate_failed == "mode:free_chat"
    assert len(fake.completions) == 1
    assert extended.source == router_pb2.DECISION_SOURCE_CHAT
    # A text scoring at freeChat or above routes locally in extended mode too.
    exact = await stub.Route(
        router_pb2.RouteRequest(
            player=_in_mode(common_pb2.CONVERSATION_MODE_EXTENDED),
            text="check my inventory",
            external_enabled=True,
        ),
        timeout=10,
    )
    assert exact.source == router_pb2.DECISION_SOURCE_LOCAL
    assert exact.action.module_id == "system:inventory"


async def test_history_off_keeps_the_intent_cache_out(with_model) -> None:  # type: ignore[no-untyped-def]
    stub, fake = with_model
    text = "remind me what we were saying earlier"
    fake.script(json.dumps({"capabilityId": "system:history", "arguments": {}}))
    first = await stub.Route(
        router_pb2.RouteRequest(player=STEVE, text=text, external_enabled=True), timeout=10
    )
    assert first.source == router_pb2.DECISION_SOURCE_MODEL
    recorded = await stub.RecordOutcome(
        router_pb2.RecordOutcomeRequest(
            player=STEVE, text=text, action=first.action, cache_token=first.cache_token
        ),
        timeout=5,
    )
    assert recorded.cached
    fake.script(json.dumps({"capabilityId": "system:history", "arguments": {}}))
    forgetful = await stub.Route(
        router_pb2.RouteRequest(
            player=STEVE, text=text, external_enabled=True, history_disabled=True
        ),
        timeout=10,
    )
    assert forgetful.source == router_pb2.DECISION_SOURCE_MODEL  # not CACHE
    assert len(fake.completions) == 2
