"""Metering through the storage service: usage recorded per player (cache tokens, calls,
searches), daily budgets checked before a call is sent and never exceeded by concurrent calls
on two gateway replicas, holds released on failure, the external-services preference honoured,
and storage being down answered UNAVAILABLE. Storage and gateways run in-process on port 0,
over SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import grpc
import pytest
from system.model.v1 import model_pb2, model_pb2_grpc
from system.storage.v1 import player_data_pb2, player_data_pb2_grpc, storage_pb2, storage_pb2_grpc

from services.model_gateway.app import create_app
from services.model_gateway.config import ModelConfig
from services.model_testserver import FakeOpenAIServer
from storage_service.app import create_app as create_storage
from storage_service.config import StorageConfig

KEY = "test-key"
HOST = {"port": 0, "metrics_port": -1, "drain_seconds": 0, "grace_seconds": 1}


def _request(player_id: str, text: str = "hello", **fields: Any) -> model_pb2.CompleteRequest:
    return model_pb2.CompleteRequest(
        player_id=player_id,
        messages=[model_pb2.ChatMessage(role=model_pb2.MESSAGE_ROLE_USER, content=text)],
        **fields,
    )


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key=KEY) as server:
        yield server


@pytest.fixture
async def storage(database_url: str) -> AsyncIterator[str]:
    """A storage service on port 0; yields its target."""
    app = await create_storage(StorageConfig(database_url=database_url, **HOST))
    await app.host.start()
    try:
        yield app.host.target
    finally:
        await app.host.stop()
        await app.aclose()


@pytest.fixture
async def storage_stubs(
    storage: str,
) -> AsyncIterator[
    tuple[player_data_pb2_grpc.PlayerDataServiceStub, storage_pb2_grpc.StorageServiceStub]
]:
    async with grpc.aio.insecure_channel(storage) as channel:
        yield (
            player_data_pb2_grpc.PlayerDataServiceStub(channel),
            storage_pb2_grpc.StorageServiceStub(channel),
        )


class Gateways:
    """Starts gateway replicas against `fake` and `storage`; `settled()` waits for their
    background settles, so the recorded usage can be read."""

    def __init__(self, fake: FakeOpenAIServer, storage: str) -> None:
        self._fake = fake
        self._storage = storage
        self.started: list[tuple[Any, grpc.aio.Channel]] = []

    async def __call__(self, **overrides: Any) -> model_pb2_grpc.ModelGatewayServiceStub:
        settings: dict[str, Any] = {
            **HOST,
            "base_url": self._fake.base_url,
            "api_key": KEY,
            "storage_target": self._storage,
            "search_url": self._fake.root_url,
            "retry_backoff_seconds": 0.01,
        }
        config = ModelConfig(**{**settings, **overrides})
        config.validate()
        app = await create_app(config)
        await app.host.start()
        channel = grpc.aio.insecure_channel(app.host.target)
        self.started.append((app, channel))
        return model_pb2_grpc.ModelGatewayServiceStub(channel)

    async def settled(self) -> None:
        for app, _ in self.started:
            await app.meter.drain()


@pytest.fixture
async def gateway(fake: FakeOpenAIServer, storage: str) -> AsyncIterator[Gateways]:
    gateways = Gateways(fake, storage)
    yield gateways
    for app, channel in gateways.started:
        await channel.close()
        await app.host.stop()
        await app.aclose()


async def _usage(
    stubs: tuple[player_data_pb2_grpc.PlayerDataServiceStub, Any], player_id: str
) -> player_data_pb2.DailyUsage:
    response = await stubs[0].GetUsage(player_data_pb2.GetUsageRequest(player_id=player_id))
    return response.days[0] if response.days else player_data_pb2.DailyUsage()


async def _fails(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_usage_is_recorded_per_player(
    gateway: Gateways, fake: FakeOpenAIServer, storage_stubs: Any
) -> None:
    stub = await gateway()
    fake.script(
        content="ok",
        prompt_tokens=40,
        completion_tokens=10,
        prompt_cache_hit_tokens=32,
        prompt_cache_miss_tokens=8,
    )
    await stub.Complete(_request("meter-1"), timeout=5)
    await stub.WebSearch(
        model_pb2.WebSearchRequest(player_id="meter-1", search_session="s1", query="diamond"),
        timeout=5,
    )
    await gateway.settled()
    day = await _usage(storage_stubs, "meter-1")
    assert (day.prompt_tokens, day.completion_tokens, day.model_calls) == (40, 10, 1)
    assert (day.prompt_cache_hit_tokens, day.prompt_cache_miss_tokens) == (32, 8)
    assert day.web_searches == 1


async def test_failed_call_releases_its_hold(
    gateway: Gateways, fake: FakeOpenAIServer, storage_stubs: Any
) -> None:
    # Each call holds 5 + 150 tokens of a 200-token budget: a leaked hold would refuse the next.
    stub = await gateway(player_daily_tokens=200, max_attempts=1)
    fake.script(status=500)
    error = await _fails(stub.Complete(_request("meter-2", max_tokens=150), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    await gateway.settled()
    fake.script(content="ok", prompt_tokens=5, completion_tokens=1)
    assert (await stub.Complete(_request("meter-2", max_tokens=150), timeout=5)).content == "ok"
    await gateway.settled()
    day = await _usage(storage_stubs, "meter-2")
    assert (day.model_calls, day.prompt_tokens, day.completion_tokens) == (2, 5, 1)


async def test_budget_refuses_before_sending(
    gateway: Gateways, fake: FakeOpenAIServer, storage_stubs: Any
) -> None:
    stub = await gateway(player_daily_tokens=100)
    error = await _fails(stub.Complete(_request("meter-3", max_tokens=200), timeout=5))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "daily token budget of player meter-3" in error.details()
    assert "needs up to 205" in error.details()
    assert fake.completions == []


async def test_search_budget(gateway: Gateways, fake: FakeOpenAIServer) -> None:
    stub = await gateway(player_daily_web_searches=1)
    request = model_pb2.WebSearchRequest(player_id="meter-4", search_session="s", query="q")
    await stub.WebSearch(request, timeout=5)
    await gateway.settled()
    error = await _fails(stub.WebSearch(request, timeout=5))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "web-search budget" in error.details()
    assert len(fake.searches) == 1


async def test_concurrent_calls_on_two_replicas_never_exceed_the_budget(
    gateway: Gateways, fake: FakeOpenAIServer, storage_stubs: Any
) -> None:
    """40 concurrent calls over two gateways sharing one storage. Each holds 105 tokens of a
    1,000-token budget and uses 100: at most 9 fit at once, and the total used never passes
    the budget."""
    replicas = [await gateway(player_daily_tokens=1000), await gateway(player_daily_tokens=1000)]
    for _ in range(40):
        fake.script(content="ok", delay=0.3, prompt_tokens=50, completion_tokens=50)

    async def call(index: int) -> grpc.StatusCode:
        try:
            await replicas[index % 2].Complete(_request("meter-5", max_tokens=100), timeout=10)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
            return exc.code()
        return grpc.StatusCode.OK

    codes = await asyncio.gather(*(call(i) for i in range(40)))
    succeeded = codes.count(grpc.StatusCode.OK)
    await gateway.settled()
    day = await _usage(storage_stubs, "meter-5")
    assert 1 <= succeeded <= 10
    assert day.prompt_tokens + day.completion_tokens == 100 * succeeded <= 1000
    assert day.model_calls == succeeded == len(fake.completions)


async def test_external_services_off_is_refused(
    gateway: Gateways, fake: FakeOpenAIServer, storage_stubs: Any
) -> None:
    stub = await gateway()
    await storage_stubs[1].UpdatePreferences(
        storage_pb2.UpdatePreferencesRequest(player_id="meter-6", external_enabled=False)
    )
    error = await _fails(stub.Complete(_request("meter-6"), timeout=5))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "turned external services off" in error.details()
    search = model_pb2.WebSearchRequest(player_id="meter-6", search_session="s", query="q")
    error = await _fails(stub.WebSearch(search, timeout=5))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert fake.completions == [] and fake.searches == []
    # Others are unaffected.
    assert (await stub.Complete(_request("meter-7"), timeout=5)).content == "echo: hello"


async def test_storage_down_is_unavailable_and_nothing_is_sent(fake: FakeOpenAIServer) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = ModelConfig(
        **HOST, base_url=fake.base_url, api_key=KEY, storage_target=f"127.0.0.1:{port}"
    )
    app = await create_app(config)
    await app.host.start()
    try:
        async with grpc.aio.insecure_channel(app.host.target) as channel:
            stub = model_pb2_grpc.ModelGatewayServiceStub(channel)
            error = await _fails(stub.Complete(_request("meter-8"), timeout=5))
    finally:
        await app.host.stop()
        await app.aclose()
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "storage service that keeps usage budgets" in error.details()
    assert fake.completions == []
