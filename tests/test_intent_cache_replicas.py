"""Two router replicas over one storage (decision 0024), real servers on loopback: an intent
recorded through one replica is a hit on the other, a clear through either (or a history clear
in storage) is seen by both, and a storage that cannot be reached costs the cache, never the
routing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from system.common.v1 import common_pb2
from system.router.v1 import router_pb2, router_pb2_grpc
from system.storage.v1 import intent_cache_pb2, intent_cache_pb2_grpc, storage_pb2, storage_pb2_grpc

from engine_service.app import create_app as create_engine
from engine_service.config import EngineConfig
from router_service.app import create_app as create_router
from router_service.config import RouterConfig
from services.model_gateway.app import create_app as create_model
from services.model_gateway.config import ModelConfig
from services.model_testserver.server import FakeOpenAIServer
from storage_service.app import create_app as create_storage
from storage_service.config import StorageConfig

HOST: dict[str, Any] = {"port": 0, "metrics_port": -1, "drain_seconds": 0, "grace_seconds": 1}
# Scoped ids (decision 0012), as the gateway sends them.
STEVE = common_pb2.PlayerContext(server_id="sim", player_id="sim/steve", language="en")
ALEX = common_pb2.PlayerContext(server_id="sim", player_id="sim/alex", language="en")
TEXT = "remind me what we were saying earlier"
HISTORY = json.dumps({"capabilityId": "system:history", "arguments": {}})


class Replicas:
    def __init__(
        self,
        stubs: list[router_pb2_grpc.RouterServiceStub],
        fake: FakeOpenAIServer,
        storage_channel: grpc.aio.Channel,
        apps: dict[str, Any],
    ) -> None:
        self.a, self.b = stubs
        self.fake = fake
        self.history = storage_pb2_grpc.StorageServiceStub(storage_channel)
        self.intents = intent_cache_pb2_grpc.IntentCacheServiceStub(storage_channel)
        self.apps = apps

    async def route(
        self, stub: router_pb2_grpc.RouterServiceStub, player: common_pb2.PlayerContext = STEVE
    ) -> router_pb2.RouteResponse:
        self.fake.script(HISTORY)
        response: router_pb2.RouteResponse = await stub.Route(
            router_pb2.RouteRequest(player=player, text=TEXT, external_enabled=True), timeout=10
        )
        return response

    async def route_and_record(
        self, stub: router_pb2_grpc.RouterServiceStub, player: common_pb2.PlayerContext = STEVE
    ) -> router_pb2.RecordOutcomeResponse:
        first = await self.route(stub, player)
        assert first.source == router_pb2.DECISION_SOURCE_MODEL, first
        recorded: router_pb2.RecordOutcomeResponse = await stub.RecordOutcome(
            router_pb2.RecordOutcomeRequest(
                player=player, text=TEXT, action=first.action, cache_token=first.cache_token
            ),
            timeout=5,
        )
        return recorded


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[Replicas]:
    fake = FakeOpenAIServer(api_key="replica-key")
    fake.start()
    apps: dict[str, Any] = {}
    channels: list[grpc.aio.Channel] = []
    try:
        apps["storage"] = await create_storage(
            StorageConfig(**HOST, database_url=f"sqlite:///{tmp_path / 'storage.db'}")
        )
        await apps["storage"].host.start()
        storage_target = apps["storage"].host.target
        apps["model"] = await create_model(
            ModelConfig(**HOST, base_url=fake.base_url, api_key="replica-key", storage_target="")
        )
        await apps["model"].host.start()
        apps["engine"] = await create_engine(EngineConfig(**HOST, storage_target=storage_target))
        await apps["engine"].host.start()
        for name in ("router_a", "router_b"):
            apps[name] = await create_router(
                RouterConfig(
                    **HOST,
                    engine_target=apps["engine"].host.target,
                    model_target=apps["model"].host.target,
                    storage_target=storage_target,
                )
            )
            await apps[name].host.start()
        for target in (apps["router_a"].host.target, apps["router_b"].host.target, storage_target):
            channels.append(grpc.aio.insecure_channel(target))
        stubs = [router_pb2_grpc.RouterServiceStub(c) for c in channels[:2]]
        yield Replicas(stubs, fake, channels[2], apps)
    finally:
        for channel in channels:
            await channel.close()
        for app in reversed(list(apps.values())):
            await app.host.stop()
            await app.aclose()
        fake.stop()


async def test_an_intent_recorded_through_one_replica_is_a_hit_on_the_other(
    replicas: Replicas,
) -> None:
    recorded = await replicas.route_and_record(replicas.a)
    assert recorded.cached, recorded.reason
    again = await replicas.b.Route(
        router_pb2.RouteRequest(player=STEVE, text=TEXT, external_enabled=True), timeout=10
    )
    assert again.source == router_pb2.DECISION_SOURCE_CACHE, again
    assert again.action.module_id == "system:history"
    assert len(replicas.fake.completions) == 1  # B needed no model call
    # Another player's identical text is theirs alone.
    other = await replicas.route(replicas.b, ALEX)
    assert other.source == router_pb2.DECISION_SOURCE_MODEL


@pytest.mark.parametrize("through", ["a", "b"])
async def test_a_clear_through_either_replica_is_seen_by_both(
    replicas: Replicas, through: str
) -> None:
    assert (await replicas.route_and_record(replicas.a)).cached
    clearing = replicas.a if through == "a" else replicas.b
    cleared = await clearing.ClearPlayerScope(
        router_pb2.ClearPlayerScopeRequest(
            player_id=STEVE.player_id,
            server_id=STEVE.server_id,
            reason=router_pb2.CLEAR_REASON_DISCONNECTED,
        ),
        timeout=5,
    )
    assert cleared.removed == 1
    for stub in (replicas.a, replicas.b):
        assert (await replicas.route(stub)).source == router_pb2.DECISION_SOURCE_MODEL


async def test_a_history_clear_in_storage_drops_the_entry_for_every_replica_and_fences_late_writes(
    replicas: Replicas,
) -> None:
    assert (await replicas.route_and_record(replicas.b)).cached
    # Routed before the clear; the module's success is reported after it.
    late = await replicas.route(replicas.a, ALEX)
    await replicas.history.ClearHistory(
        storage_pb2.ClearHistoryRequest(player_id=STEVE.player_id), timeout=5
    )
    await replicas.history.ClearHistory(
        storage_pb2.ClearHistoryRequest(player_id=ALEX.player_id), timeout=5
    )
    for stub in (replicas.a, replicas.b):
        assert (await replicas.route(stub)).source == router_pb2.DECISION_SOURCE_MODEL
    dropped = await replicas.a.RecordOutcome(
        router_pb2.RecordOutcomeRequest(
            player=ALEX, text=TEXT, action=late.action, cache_token=late.cache_token
        ),
        timeout=5,
    )
    assert not dropped.cached and dropped.reason == "stale_scope"


async def test_storage_refuses_bad_input_with_a_message(replicas: Replicas) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await replicas.intents.LookupIntent(
            intent_cache_pb2.LookupIntentRequest(
                player_id="sim/steve", text_sha256=b"abc", language="en", runtime_generation="g"
            ),
            timeout=5,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "32-byte SHA-256" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await replicas.intents.ClearIntents(
            intent_cache_pb2.ClearIntentsRequest(player_id="sim/steve"), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reason must be" in (info.value.details() or "")


async def test_routing_goes_on_without_the_cache_when_storage_is_unreachable(
    replicas: Replicas,
) -> None:
    lost = await create_router(
        RouterConfig(
            **HOST,
            engine_target=replicas.apps["engine"].host.target,
            model_target=replicas.apps["model"].host.target,
            storage_target="127.0.0.1:1",
        )
    )
    await lost.host.start()
    try:
        async with grpc.aio.insecure_channel(lost.host.target) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            recorded = await replicas.route_and_record(stub)
            assert not recorded.cached and recorded.reason == "storage_unavailable"
            assert (await replicas.route(stub)).source == router_pb2.DECISION_SOURCE_MODEL
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ClearPlayerScope(
                    router_pb2.ClearPlayerScopeRequest(
                        player_id=STEVE.player_id, reason=router_pb2.CLEAR_REASON_DISCONNECTED
                    ),
                    timeout=5,
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await lost.host.stop()
        await lost.aclose()
