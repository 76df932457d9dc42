"""Metering through the storage service: usage recorded per player (cache tokens, calls,
searches), daily budgets checked before a call is sent and never exceeded by concurrent calls
on two gateway replicas, holds released on failure, the external-services preference honoured,
and storage being down answered UNAVAILABLE. Budget leases: their rest given back when idle, a
killed replica's lease expiring in storage, the preference honoured while a lease is held, a
settle whose answer was lost sent again and applied once. Storage and gateways run in-process
on port 0 (one killed replica as a child process), over SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from system.model.v1 import model_pb2, model_pb2_grpc
from system.storage.v1 import player_data_pb2, player_data_pb2_grpc, storage_pb2, storage_pb2_grpc

from services.model_gateway.app import create_app
from services.model_gateway.config import ModelConfig
from services.model_gateway.lease import Amount, Answer, Batch, Lease, Verdict
from services.model_gateway.leasing import LeaseMeter, LeasePolicy
from services.model_gateway.metering import Budgets, ExternalServicesOff, Spend, Used
from services.model_gateway.usage_store import UsageStore
from services.model_testserver import FakeOpenAIServer
from services.runtime.errors import Unavailable
from services.stack.launcher import free_port
from storage_service.app import create_app as create_storage
from storage_service.config import StorageConfig
from tests.model_gateways import Gateways, gateways
from tests.service_process import ServiceProcess
from tests.waiting import wait_until

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


@pytest.fixture
async def gateway(fake: FakeOpenAIServer, storage: str) -> AsyncIterator[Gateways]:
    """Gateway replicas against `fake`, metered in `storage`."""
    async with gateways(
        base_url=fake.base_url,
        api_key=KEY,
        storage_target=storage,
        search_url=fake.root_url,
        retry_backoff_seconds=0.01,
    ) as started:
        yield started


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
    port = free_port()  # free a moment ago: nothing listens there
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


async def _eventually(call: Any, timeout: float, step: float = 0.2) -> float:
    """Calls `call()` until it stops raising AioRpcError; returns the seconds it took."""
    began = time.monotonic()
    refused: list[grpc.aio.AioRpcError] = []

    async def answered() -> bool:
        try:
            await call()
        except grpc.aio.AioRpcError as exc:
            refused[:] = [exc]
            return False
        return True

    await wait_until(
        answered, timeout, interval=step, what=lambda: f"the call answered, last: {refused}"
    )
    return time.monotonic() - began


async def test_leases_on_two_replicas_never_exceed_the_budget(
    gateway: Gateways, fake: FakeOpenAIServer, storage_stubs: Any
) -> None:
    """64 concurrent calls over two replicas whose leases (300 tokens) are smaller than the
    2,000-token budget, so leases run out and are taken again on both while calls are in
    flight. Each call holds 105 and uses 100: what was used never passes the budget, and it
    is all recorded once the leases are written."""
    settings = {"player_daily_tokens": 2000, "lease_tokens": 300, "lease_refresh_seconds": 0.2}
    replicas = [await gateway(**settings), await gateway(**settings)]
    for _ in range(64):
        fake.script(content="ok", delay=0.1, prompt_tokens=50, completion_tokens=50)

    async def call(index: int) -> bool:
        try:
            await replicas[index % 2].Complete(_request("lease-1", max_tokens=100), timeout=10)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
            return False
        return True

    succeeded = sum(await asyncio.gather(*(call(i) for i in range(64))))
    await gateway.settled()
    day = await _usage(storage_stubs, "lease-1")
    assert 2 <= succeeded <= 19  # 19 x 105 fits in 2,000; fragmentation may leave fewer
    assert day.prompt_tokens + day.completion_tokens == 100 * succeeded <= 2000
    assert day.model_calls == succeeded == len(fake.completions)


async def test_an_idle_lease_gives_its_rest_back(
    gateway: Gateways, fake: FakeOpenAIServer, storage_stubs: Any
) -> None:
    """Replica A's lease takes the whole 1,000-token budget; replica B is refused until A's
    lease has been idle for `lease_idle_seconds` and its rest released."""
    settings = {
        "player_daily_tokens": 1000,
        "lease_refresh_seconds": 0.2,
        "lease_idle_seconds": 1.0,
    }
    first, second = await gateway(**settings), await gateway(**settings)
    fake.script(content="ok", prompt_tokens=50, completion_tokens=50)
    await first.Complete(_request("lease-2", max_tokens=100), timeout=5)
    error = await _fails(second.Complete(_request("lease-2", max_tokens=100), timeout=5))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "held for calls in progress" in error.details()  # by A's lease
    fake.script(content="ok", prompt_tokens=50, completion_tokens=50)
    took = await _eventually(
        lambda: second.Complete(_request("lease-2", max_tokens=100), timeout=5), timeout=5
    )
    assert took < 3
    await gateway.settled()
    day = await _usage(storage_stubs, "lease-2")
    assert (day.prompt_tokens + day.completion_tokens, day.model_calls) == (200, 2)


async def test_a_killed_replicas_lease_expires(
    gateway: Gateways, fake: FakeOpenAIServer, storage: str, tmp_path: Path
) -> None:
    """A replica (a child process) takes a lease of the whole budget and is killed with
    SIGKILL: nothing gives the lease back, and storage releases it after its TTL (4 s)."""
    settings = {
        "BASE_URL": fake.base_url,
        "API_KEY": KEY,
        "STORAGE_TARGET": storage,
        "PLAYER_DAILY_TOKENS": "1000",
        "REQUEST_TIMEOUT_SECONDS": "1",
        "FIRST_TOKEN_TIMEOUT_SECONDS": "1",
        "LEASE_TTL_SECONDS": "4",
        "LEASE_IDLE_SECONDS": "60",
    }
    doomed = ServiceProcess(
        "services.model_gateway", "SYSTEM_MODEL_", settings, tmp_path / "gw.log"
    )
    await doomed.start()
    try:
        async with grpc.aio.insecure_channel(doomed.target) as channel:
            stub = model_pb2_grpc.ModelGatewayServiceStub(channel)
            fake.script(content="ok", prompt_tokens=50, completion_tokens=50)
            await stub.Complete(_request("lease-3", max_tokens=100), timeout=5)
    finally:
        doomed.kill()
    killed = time.monotonic()
    survivor = await gateway(player_daily_tokens=1000)
    error = await _fails(survivor.Complete(_request("lease-3", max_tokens=100), timeout=5))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    fake.script(content="ok", prompt_tokens=50, completion_tokens=50)
    await _eventually(
        lambda: survivor.Complete(_request("lease-3", max_tokens=100), timeout=5), timeout=10
    )
    assert time.monotonic() - killed >= 2  # not before the lease ran out (4 s after renewal)


async def test_external_services_off_is_honoured_while_a_lease_is_held(
    gateway: Gateways, fake: FakeOpenAIServer, storage_stubs: Any
) -> None:
    """With refreshes every 0.2 s, a lease serves no call more than 0.6 s after its last
    contact with storage, which re-reads the preference: once that has passed, the player is
    refused although the lease had budget left."""
    stub = await gateway(lease_refresh_seconds=0.2)
    await stub.Complete(_request("lease-4"), timeout=5)
    await storage_stubs[1].UpdatePreferences(
        storage_pb2.UpdatePreferencesRequest(player_id="lease-4", external_enabled=False)
    )
    # Time passing is what is tested (a probe before would be served, and counted): the
    # lease's 0.6 s bound, and a margin.
    await asyncio.sleep(0.6 + 0.3)
    error = await _fails(stub.Complete(_request("lease-4"), timeout=5))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "turned external services off" in error.details()
    assert len(fake.completions) == 1
    await gateway.settled()
    assert (await _usage(storage_stubs, "lease-4")).model_calls == 1


class _LostAnswers(UsageStore):
    """Storage applies the first `lost` settles, but their answers never arrive."""

    def __init__(self, *args: Any, lost: int) -> None:
        super().__init__(*args)
        self.lost = lost
        self.sent: list[int] = []

    async def settle(
        self, reservation_id: str, player_id: str, batch: Batch, ttl_seconds: int
    ) -> Answer:
        answer = await super().settle(reservation_id, player_id, batch, ttl_seconds)
        self.sent.append(batch.sequence)
        if self.lost:
            self.lost -= 1
            raise Unavailable("the answer was lost")
        return answer


async def test_a_settle_sent_again_is_applied_once(storage: str, storage_stubs: Any) -> None:
    """The first two answers to a lease's settle are lost (storage applied it): the meter
    sends the same batch, with the same sequence number, until one answer arrives, and the
    use is recorded once."""
    store = _LostAnswers(storage, Budgets(player_tokens=1000), 2.0, lost=2)
    # Refreshes far apart: only `drain` writes here.
    meter = LeaseMeter(store, LeasePolicy(refresh_seconds=30, ttl_seconds=120))
    try:
        hold = await meter.reserve("lease-5", tokens=100, hold_seconds=5)
        meter.settle_later(
            hold,
            Used(prompt_tokens=40, completion_tokens=2, prompt_cache_hit_tokens=30, model_calls=1),
        )
        for _ in range(2):
            with pytest.raises(Unavailable):
                await meter.drain()
        await meter.drain()
    finally:
        await meter.aclose()
    assert store.sent[:3] == [1, 1, 1]  # the same batch, three times
    day = await _usage(storage_stubs, "lease-5")
    assert (day.prompt_tokens, day.completion_tokens, day.model_calls) == (40, 2, 1)
    assert day.prompt_cache_hit_tokens == 30


# -- a lease's bookkeeping, without storage ---------------------------------------------------


def _lease(granted: int = 1000, **fields: Any) -> Lease:
    return Lease(
        "r1",
        "p",
        dt.date(2026, 1, 2),
        Amount(granted, 2),
        contacted=100.0,
        ttl_seconds=60,
        **fields,
    )


def test_a_lease_serves_what_is_free_and_no_more() -> None:
    lease = _lease()
    today = dt.date(2026, 1, 2)
    verdict = {"now": 101.0, "today": today, "call_seconds": 22.0, "stale_after": 3.0}
    lease.take(Amount(600), 101.0)
    assert lease.check(Amount(400), **verdict) is Verdict.OK
    assert lease.check(Amount(401), **verdict) is Verdict.SPENT
    lease.finish(Amount(600), Used(prompt_tokens=100, completion_tokens=50, model_calls=1), 102.0)
    assert lease.free == Amount(850, 2)
    # Writing the use moves it from the grant to storage's figures: what is free is the same.
    batch, resent = lease.next_batch()
    assert (batch.sequence, batch.keep, resent) == (1, Amount(850, 2), False)
    assert lease.free == Amount(850, 2)
    assert lease.next_batch() == (batch, True)  # not acknowledged: the same batch again
    lease.acknowledge(batch, Answer(True, Amount(850, 2), True), sent=103.0)
    assert (lease.free, lease.sequence, lease.expires) == (Amount(850, 2), 1, 163.0)


def test_a_lease_sums_its_calls_spend_per_module_and_provider() -> None:
    lease = _lease()
    for module_id, provider, tokens in (
        ("system:chat", "deepseek", 10),
        ("system:question", "qwen", 7),
        ("system:chat", "deepseek", 5),
        ("system:chat", "qwen", 1),
    ):
        lease.take(Amount(20), 101.0)
        used = Used(
            prompt_tokens=tokens,
            model_calls=1,
            cost_micros=tokens * 100,
            spend=(Spend(module_id, provider, tokens, tokens * 100),),
        )
        lease.finish(Amount(20), used, 102.0)
    batch, _ = lease.next_batch()
    assert batch.used.spend == (
        Spend("system:chat", "deepseek", 15, 1500),
        Spend("system:chat", "qwen", 1, 100),
        Spend("system:question", "qwen", 7, 700),
    )
    assert (batch.used.prompt_tokens, batch.used.cost_micros) == (23, 2300)


def test_a_lease_turns_stale_spent_or_closing() -> None:
    lease = _lease()
    today = dt.date(2026, 1, 2)
    need = Amount(10)
    assert lease.check(need, now=104.0, today=today, call_seconds=1, stale_after=3) is Verdict.STALE
    assert (
        lease.check(need, now=101.0, today=today, call_seconds=60, stale_after=3) is Verdict.STALE
    )
    tomorrow = dt.date(2026, 1, 3)
    assert (
        lease.check(need, now=101.0, today=tomorrow, call_seconds=1, stale_after=3) is Verdict.SPENT
    )
    # Storage says the player turned external services off: no new calls, then closed.
    lease.take(need, 101.0)
    batch, _ = lease.next_batch()
    lease.acknowledge(batch, Answer(True, Amount(1000, 2), False), sent=101.5)
    assert lease.check(need, now=102.0, today=today, call_seconds=1, stale_after=3) is Verdict.SPENT
    assert not lease.closing  # a call still draws on it
    assert lease.next_batch()[0].keep == need  # giving back all but the running call's hold
    lease.acknowledge(lease.next_batch()[0], Answer(True, need, False), sent=102.0)
    lease.finish(need, Used(prompt_tokens=3, model_calls=1), 102.5)
    assert lease.closing
    close, _ = lease.next_batch()
    assert (close.keep, close.used.prompt_tokens, close.sequence) == (None, 3, 3)
    lease.acknowledge(close, Answer(True, Amount(), True), sent=103.0)
    assert lease.closed and not lease.has_work()


async def test_a_stale_lease_is_renewed_on_the_calls_path(storage: str, storage_stubs: Any) -> None:
    """When the background refresh has fallen behind (here: refreshes 30 s apart, and the
    clock moved past 3 of them), the next call renews the lease itself first, which re-reads
    the preference: a player who turned external services off is refused then."""
    now = [1000.0]
    meter = LeaseMeter(
        UsageStore(storage, Budgets(), 2.0),
        LeasePolicy(refresh_seconds=30, ttl_seconds=600),
        clock=lambda: now[0],
    )
    try:
        hold = await meter.reserve("lease-6", tokens=10, hold_seconds=5)
        meter.settle_later(hold, Used(prompt_tokens=4, model_calls=1))
        now[0] += 60  # within 3 refreshes: served from the lease without asking
        meter.settle_later(await meter.reserve("lease-6", tokens=10, hold_seconds=5), Used())
        await storage_stubs[1].UpdatePreferences(
            storage_pb2.UpdatePreferencesRequest(player_id="lease-6", external_enabled=False)
        )
        now[0] += 40  # 100 s since the last contact: stale
        with pytest.raises(ExternalServicesOff):
            await meter.reserve("lease-6", tokens=10, hold_seconds=5)
    finally:
        await meter.aclose()
    assert (await _usage(storage_stubs, "lease-6")).prompt_tokens == 4
