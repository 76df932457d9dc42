"""Nested budgets in tokens and money, through a real model gateway on loopback (the local
OpenAI-compatible test server as its provider, priced) and a real storage service: each level
(the player's by rank, the game server's, the network's per day and per month) refusing when
it is the tightest, with its reason and reset; use settled to the actual tokens and cost;
money limits from the prices; concurrent calls on two replicas never passing a limit
(PostgreSQL); spend metrics and the alert threshold; bad budget files refused at start."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import select
from system.model.v1 import model_pb2, model_pb2_grpc
from system.storage.v1 import player_data_pb2, player_data_pb2_grpc

from services.model_gateway.config import ModelConfig
from services.model_testserver import FakeOpenAIServer
from services.runtime.config import ConfigError
from services.runtime.errors import error_reason
from storage_service.app import create_app as create_storage
from storage_service.config import StorageConfig
from storage_service.db import make_engine
from storage_service.usage_records import BudgetCounterRow
from tests.model_gateways import Gateways

KEY = "test-key"
HOST = {"port": 0, "metrics_port": -1, "drain_seconds": 0, "grace_seconds": 1}
# Prices per million tokens: a prompt token costs 1000 micros, an answer token 2000.
PRICES = "{ input_per_million = 1000.0, output_per_million = 2000.0 }"
NO_LEASES = {"lease_tokens": 0, "lease_web_searches": 0}


def _request(player_id: str, level: int = 0, max_tokens: int = 5) -> model_pb2.CompleteRequest:
    # "hello": 5 prompt characters, so a worst case of 5 + max_tokens tokens, and of
    # 5 * 1000 + max_tokens * 2000 micros.
    return model_pb2.CompleteRequest(
        player_id=player_id,
        messages=[model_pb2.ChatMessage(role=model_pb2.MESSAGE_ROLE_USER, content="hello")],
        max_tokens=max_tokens,
        permission_level=level,
    )


async def _fails(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def _tomorrow() -> str:
    return (dt.datetime.now(dt.UTC).date() + dt.timedelta(days=1)).isoformat()


def _next_month() -> str:
    today = dt.datetime.now(dt.UTC).date()
    return dt.date(today.year + today.month // 12, today.month % 12 + 1, 1).isoformat()


def _server() -> str:
    return f"s{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key=KEY) as server:
        yield server


class Deployment:
    """A storage service and gateway replicas with a priced provider and a budgets file."""

    def __init__(self, fake: FakeOpenAIServer, tmp: Path, database_url: str) -> None:
        self.fake = fake
        self.tmp = tmp
        self.database_url = database_url
        self.storage: Any = None
        self.gateways: Gateways | None = None
        self.budget_files = 0
        self.providers = tmp / "providers.toml"
        self.providers.write_text(
            f'[providers.fake]\npreset = "custom"\nbase_url = "{fake.base_url}"\n'
            f'api_key_env = "BUDGET_TEST_KEY"\n[providers.fake.models]\nm = {PRICES}\n'
            '[routes]\ndefault = ["fake/m"]\n'
        )

    async def start_storage(self) -> None:
        self.storage = await create_storage(StorageConfig(database_url=self.database_url, **HOST))
        await self.storage.host.start()
        self.gateways = Gateways(
            {
                "providers_file": str(self.providers),
                "storage_target": self.storage.host.target,
                "retry_backoff_seconds": 0.01,
                **NO_LEASES,
            }
        )

    async def gateway(
        self, budgets: str, **overrides: Any
    ) -> model_pb2_grpc.ModelGatewayServiceStub:
        assert self.gateways is not None
        self.budget_files += 1
        path = self.tmp / f"budgets-{self.budget_files}.toml"
        path.write_text(budgets)
        return await self.gateways(budgets_file=str(path), **overrides)

    async def settled(self) -> None:
        assert self.gateways is not None
        await self.gateways.settled()

    def counter(self, budget: str, period: str | None = None) -> tuple[int, int, int, int]:
        """(used tokens, held tokens, used micros, held micros) of a budget counter row."""
        period = period or dt.datetime.now(dt.UTC).date().isoformat()
        engine = make_engine(self.database_url)
        try:
            with engine.connect() as connection:
                row = connection.execute(
                    select(BudgetCounterRow.__table__).where(
                        (BudgetCounterRow.budget == budget) & (BudgetCounterRow.period == period)
                    )
                ).one_or_none()
        finally:
            engine.dispose()
        if row is None:
            return (0, 0, 0, 0)
        return (
            row.used_tokens,
            row.reserved_tokens,
            row.used_cost_micros,
            row.reserved_cost_micros,
        )

    async def close(self) -> None:
        if self.gateways is not None:
            await self.gateways.aclose()
        if self.storage is not None:
            await self.storage.host.stop()
            await self.storage.aclose()


@pytest.fixture
async def deployment(
    fake: FakeOpenAIServer, tmp_path: Path, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Deployment]:
    monkeypatch.setenv("BUDGET_TEST_KEY", KEY)
    deployment = Deployment(fake, tmp_path, database_url)
    await deployment.start_storage()
    try:
        yield deployment
    finally:
        await deployment.close()


RANKS = """
[ranks.player]
min_level = 0
daily_tokens = 100
[ranks.vip]
min_level = 2
daily_tokens = 1000
"""


async def test_the_players_rank_picks_the_limit(deployment: Deployment) -> None:
    stub = await deployment.gateway(RANKS)
    player = f"{_server()}/alex"
    error = await _fails(stub.Complete(_request(player, level=0, max_tokens=200), timeout=5))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_reason(error) == "BUDGET_PLAYER_DAILY_TOKENS"
    assert f"daily token budget of player {player} exhausted" in error.details()
    assert "of 100 today (UTC); this call needs up to 205" in error.details()
    assert f"renews at 00:00 UTC ({_tomorrow()})" in error.details()
    assert deployment.fake.completions == []
    # The same player as a VIP (permission level 2, and 3 falls in the same rank).
    for level in (2, 3):
        answer = await stub.Complete(_request(player, level=level, max_tokens=200), timeout=5)
        assert answer.content
    error = await _fails(stub.Complete(_request(player, level=5), timeout=5))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "permission_level" in error.details()


@pytest.mark.parametrize("leases", [False, True], ids=["per-call", "leases"])
async def test_money_limit_from_prices_settled_to_actual_cost(
    deployment: Deployment, leases: bool
) -> None:
    """Worst case 5 * 1000 + 5 * 2000 = 15,000 micros; each call actually costs 5 * 1000 +
    1 * 2000 = 7,000. A limit of 25,000 lets two calls through only because the first was
    settled to its actual cost; the third would pass it."""
    overrides = {} if not leases else {"lease_tokens": 16_384, "lease_web_searches": 4}
    stub = await deployment.gateway(
        "[ranks.player]\nmin_level = 0\ndaily_cost = 0.025\n", **overrides
    )
    player = f"{_server()}/steve"
    for _ in range(3):
        deployment.fake.script(content="ok", prompt_tokens=5, completion_tokens=1)
    for _ in range(2):
        assert (await stub.Complete(_request(player), timeout=5)).content == "ok"
        await deployment.settled()
    error = await _fails(stub.Complete(_request(player), timeout=5))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_reason(error) == "BUDGET_PLAYER_DAILY_COST"
    assert f"daily spending budget of player {player} exhausted: 0.014 spent" in error.details()
    assert "of 0.025 today (UTC); this call may cost up to 0.015" in error.details()
    assert len(deployment.fake.completions) == 2
    await deployment.settled()
    used_tokens, _, used_micros, _ = deployment.counter(f"player:{player}")
    assert (used_tokens, used_micros) == (12, 14_000)


async def test_the_game_servers_budget_covers_its_players(deployment: Deployment) -> None:
    server, other = _server(), _server()
    stub = await deployment.gateway(
        RANKS + "[server]\ndaily_tokens = 150\n", lease_tokens=0, lease_web_searches=0
    )
    for _ in range(3):
        deployment.fake.script(content="ok", prompt_tokens=50, completion_tokens=50)
    await stub.Complete(_request(f"{server}/a", level=2, max_tokens=100), timeout=5)
    await deployment.settled()  # the settle runs after the answer: else its hold is still there
    error = await _fails(stub.Complete(_request(f"{server}/b", level=2, max_tokens=100), timeout=5))
    assert error_reason(error) == "BUDGET_SERVER_DAILY_TOKENS"
    assert f"daily token budget of game server {server} exhausted: 100 used" in error.details()
    assert f"renews at 00:00 UTC ({_tomorrow()})" in error.details()
    # Another server's players are not held back.
    await stub.Complete(_request(f"{other}/c", level=2, max_tokens=100), timeout=5)
    await deployment.settled()
    assert deployment.counter(f"server:{server}")[:2] == (100, 0)


async def test_the_tightest_limit_answers(deployment: Deployment) -> None:
    """Player (100 tokens) and server (50 tokens) would both be passed: the server's has less
    room for the call, so it answers."""
    stub = await deployment.gateway(RANKS + "[server]\ndaily_tokens = 50\n")
    error = await _fails(stub.Complete(_request(f"{_server()}/a", max_tokens=200), timeout=5))
    assert error_reason(error) == "BUDGET_SERVER_DAILY_TOKENS"
    stub = await deployment.gateway(RANKS + "[server]\ndaily_tokens = 500\n")
    error = await _fails(stub.Complete(_request(f"{_server()}/a", max_tokens=200), timeout=5))
    assert error_reason(error) == "BUDGET_PLAYER_DAILY_TOKENS"


async def test_the_networks_daily_money_budget(deployment: Deployment) -> None:
    """The network's counters are shared with the other tests on this database: the limit is
    set just above what is spent already."""
    today = dt.datetime.now(dt.UTC).date().isoformat()
    _, _, spent, held = deployment.counter("network", today)
    limit = (spent + held + 10_000) / 1_000_000
    stub = await deployment.gateway(
        f"[ranks.player]\nmin_level = 0\ndaily_cost = 1.0\n[server]\ndaily_cost = 1.0\n"
        f"[network]\ndaily_cost = {limit}\n"
    )
    error = await _fails(stub.Complete(_request(f"{_server()}/a"), timeout=5))
    assert error_reason(error) == "BUDGET_NETWORK_DAILY_COST"
    assert "daily spending budget of everyone together exhausted" in error.details()
    assert f"renews at 00:00 UTC ({_tomorrow()})" in error.details()


async def test_the_networks_monthly_token_budget(deployment: Deployment) -> None:
    month = dt.datetime.now(dt.UTC).date().strftime("%Y-%m")
    used, held, _, _ = deployment.counter("network", month)
    stub = await deployment.gateway(f"[network]\nmonthly_tokens = {used + held + 50}\n")
    error = await _fails(stub.Complete(_request(f"{_server()}/a", max_tokens=100), timeout=5))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_reason(error) == "BUDGET_NETWORK_MONTHLY_TOKENS"
    assert "monthly token budget of everyone together exhausted" in error.details()
    assert "this month (UTC)" in error.details()
    assert f"resets on {_next_month()} at 00:00 UTC" in error.details()
    # A smaller call still fits the month.
    await stub.Complete(_request(f"{_server()}/a", max_tokens=5), timeout=5)


async def test_spend_metrics_and_one_alert_per_budget_and_period(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    server = _server()
    stub = await deployment.gateway("[server]\ndaily_tokens = 300\nalert_percent = 50\n")
    labels = {"provider": "fake", "module": "system:chat", "scope": server}
    for _ in range(4):
        deployment.fake.script(content="ok", prompt_tokens=50, completion_tokens=50)
    with caplog.at_level(logging.WARNING, logger="system.model"):
        for _ in range(3):
            request = _request(f"{server}/a", level=0, max_tokens=40)
            request.module_id = "system:chat"
            await stub.Complete(request, timeout=5)
            await deployment.settled()  # the next reservation sees this call's use
    alerts = [r for r in caplog.records if "budget server_daily_tokens" in r.getMessage()]
    assert len(alerts) == 1, [r.getMessage() for r in alerts]
    assert server in alerts[0].getMessage()
    assert REGISTRY.get_sample_value("model_spend_tokens_total", labels) == 300
    # 3 calls of 50 * 1000 + 50 * 2000 micros.
    assert REGISTRY.get_sample_value("model_spend_cost_total", labels) == pytest.approx(0.45)
    used = REGISTRY.get_sample_value(
        "model_budget_used_ratio", {"budget": "server_daily_tokens", "scope": server}
    )
    assert used == pytest.approx(245 / 300)  # 200 used and the third call's 45 held


async def test_concurrent_calls_on_two_replicas_never_pass_a_money_limit(
    fake: FakeOpenAIServer, tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 concurrent calls of 8 players of one server over two replicas with leases, each
    costing at most and actually 15,000 micros, against a server limit of 100,000: at most 6
    are answered, and the recorded spend stays within the limit."""
    monkeypatch.setenv("BUDGET_TEST_KEY", KEY)
    deployment = Deployment(fake, tmp_path, postgres_url)
    await deployment.start_storage()
    try:
        budgets = "[server]\ndaily_cost = 0.1\n"
        leases = {"lease_tokens": 64, "lease_web_searches": 1}
        replicas = [
            await deployment.gateway(budgets, **leases),
            await deployment.gateway(budgets, **leases),
        ]
        server = _server()
        for _ in range(40):
            fake.script(content="ok", delay=0.2, prompt_tokens=5, completion_tokens=5)

        async def call(index: int) -> bool:
            try:
                await replicas[index % 2].Complete(_request(f"{server}/p{index % 8}"), timeout=10)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                assert error_reason(exc) == "BUDGET_SERVER_DAILY_COST"
                return False
            return True

        answered = sum(await asyncio.gather(*(call(i) for i in range(40))))
        await deployment.settled()
        used_tokens, _, used_micros, _ = deployment.counter(f"server:{server}")
        assert 1 <= answered <= 6
        assert used_micros == answered * 15_000 <= 100_000
        assert used_tokens == answered * 10
    finally:
        await deployment.close()


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[rank.player]\nmin_level = 0\n", "unknown key 'rank'"),
        ("[ranks.vip]\nmin_level = 2\n", "no rank has min_level = 0"),
        ("[ranks.a]\nmin_level = 0\n[ranks.b]\nmin_level = 0\n", "ranks.b.min_level 0 is also"),
        ("[ranks.a]\nmin_level = 7\n", "ranks.a.min_level must be a whole number 0 to 4"),
        ("[ranks.a]\ndaily_tokens = 5\n", "ranks.a.min_level is missing"),
        ("[ranks.a]\nmin_level = 0\ndaily_cost = -1\n", "ranks.a.daily_cost must be an amount"),
        ("[ranks.a]\nmin_level = 0\ndaily_token = 5\n", "unknown key ranks.a.daily_token"),
        ("[server]\ndaily_tokens = 1.5\n", "server.daily_tokens must be a whole number"),
        ("[network]\nmonthly_cost = 'a lot'\n", "network.monthly_cost must be an amount"),
        ("[network]\nalert_percent = 150\n", "network.alert_percent must be a whole percentage"),
        ("alert_percent = -1\n", "alert_percent must be a whole percentage"),
        ("server = 5\n", "server must be a table"),
        ("[server\n", "is not valid TOML"),
    ],
)
def test_bad_budget_files_are_refused_naming_the_key(
    tmp_path: Path, body: str, message: str
) -> None:
    path = tmp_path / "budgets.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match="budgets_file") as caught:
        ModelConfig(budgets_file=str(path))
    assert message in str(caught.value)


def test_a_missing_budget_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        ModelConfig(budgets_file=str(tmp_path / "none.toml"))


def test_budget_file_defaults_come_from_the_flat_settings(tmp_path: Path) -> None:
    path = tmp_path / "budgets.toml"
    path.write_text(
        "[ranks.player]\nmin_level = 0\n[ranks.admin]\nmin_level = 3\ndaily_tokens = 0\n"
    )
    config = ModelConfig(budgets_file=str(path), player_daily_tokens=123, global_daily_tokens=9)
    plan = config.budgets
    assert [(r.name, r.daily_tokens) for r in plan.ranks] == [("player", 123), ("admin", 0)]
    assert plan.rank(4).name == "admin" and plan.rank(2).name == "player"
    assert plan.network_daily_tokens == 9


# -- the ledger alone ----------------------------------------------------------------------------


def _counter_row(sessions: Any, budget: str, period: str) -> tuple[int, int, int, int]:
    with sessions() as session:
        row = session.execute(
            select(BudgetCounterRow.__table__).where(
                (BudgetCounterRow.budget == budget) & (BudgetCounterRow.period == period)
            )
        ).one()
    return (row.used_tokens, row.reserved_tokens, row.used_cost_micros, row.reserved_cost_micros)


def test_a_lapsed_reservation_releases_its_money_on_every_level(sessions: Any) -> None:
    """A dead replica's reservation, holding tokens and money, is released from the player's,
    the server's and the network's day and month counters by a later reservation's sweep; a
    lease's keep-open settle records the cost and keeps the money asked."""
    from sqlalchemy import update

    from storage_service.usage import UsageLedger
    from storage_service.usage_records import Limits, ReservationRow

    ledger = UsageLedger(sessions, sweep_interval_seconds=0)
    server = _server()
    player = f"{server}/p"
    today = dt.datetime.now(dt.UTC).date()
    day, month = today.isoformat(), today.strftime("%Y-%m")
    limits = Limits(server_cost_micros=50_000)
    grant = ledger.reserve("r-1", player, 100, 0, limits, 60, cost_micros=30_000)
    assert (grant.tokens, grant.cost_micros) == (100, 30_000)
    assert [(u.budget, u.scope, u.used, u.limit) for u in grant.budgets] == [
        ("server_daily_cost", server, 30_000, 50_000)
    ]
    with pytest.raises(Exception, match="game server") as caught:
        ledger.reserve("r-2", f"{server}/q", 10, 0, limits, 60, cost_micros=30_000)
    assert caught.value.reason == "BUDGET_SERVER_DAILY_COST"  # type: ignore[attr-defined]
    with sessions.begin() as session:
        session.execute(
            update(ReservationRow.__table__)
            .where(ReservationRow.reservation_id == "r-1")
            .values(expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1))
        )
    grant = ledger.reserve(
        "r-3", f"{server}/q", 10, 0, limits, 60, cost_micros=30_000, extra_cost_micros=99_999
    )
    assert grant.cost_micros == 50_000  # the sweep released r-1 first; the extra fits the rest
    for budget, period in ((f"server:{server}", day), ("network", day), ("network", month)):
        assert _counter_row(sessions, budget, period) == (0, 10, 0, 50_000), budget
    assert _counter_row(sessions, f"player:{player}", day) == (0, 0, 0, 0)
    # A lease's batch: use recorded, money kept as asked.
    used = player_data_pb2.UsageAmounts(prompt_tokens=4, completion_tokens=2, cost_micros=8_000)
    settled = ledger.settle(
        "r-3", f"{server}/q", used, sequence=1, keep=(4, 0), ttl_seconds=60, keep_cost_micros=20_000
    )
    assert (settled.held_tokens, settled.held_cost_micros) == (4, 20_000)
    assert _counter_row(sessions, f"server:{server}", day) == (6, 4, 8_000, 20_000)


@pytest.mark.parametrize("leases", [False, True], ids=["per-call", "leases"])
async def test_spend_by_module_and_provider_reaches_storage(
    deployment: Deployment, leases: bool
) -> None:
    """Each call's tokens and money travel with its settle (a lease's batch sums them per
    module and provider) into storage's spend view, beside the player's and the server's
    budget counters, with the server budget's limit as the reservation carried it."""
    overrides = {} if leases else NO_LEASES
    stub = await deployment.gateway("[server]\ndaily_cost = 5.0\n", **overrides)
    server = _server()
    for module_id, player, prompt in (
        ("system:chat", "a", 50),
        ("system:chat", "b", 10),
        ("system:question", "a", 20),
        ("", "b", 5),
    ):
        deployment.fake.script(content="ok", prompt_tokens=prompt, completion_tokens=1)
        request = _request(f"{server}/{player}")
        request.module_id = module_id
        await stub.Complete(request, timeout=5)
    await deployment.settled()
    channel = grpc.aio.insecure_channel(deployment.storage.host.target)
    try:
        view = await player_data_pb2_grpc.PlayerDataServiceStub(channel).GetSpend(
            player_data_pb2.GetSpendRequest(scope=server), timeout=5
        )
    finally:
        await channel.close()

    def micros(prompt: int) -> int:
        return prompt * 1000 + 2000

    assert [(m.name, m.tokens, m.cost_micros) for m in view.modules] == [
        ("system:chat", 62, micros(50) + micros(10)),
        ("system:question", 21, micros(20)),
        ("", 6, micros(5)),
    ]
    assert [(p.name, p.tokens) for p in view.providers] == [("fake", 89)]
    assert [(p.name, p.tokens, p.cost_micros) for p in view.players] == [
        (f"{server}/a", 72, micros(50) + micros(20)),
        (f"{server}/b", 17, micros(10) + micros(5)),
    ]
    assert view.total.cost_micros == sum(micros(p) for p in (50, 10, 20, 5))
    [budget] = [b for b in view.budgets if b.scope == server]
    assert (budget.budget, budget.limit) == ("server_daily_cost", 5_000_000)
    assert budget.used == view.total.cost_micros  # settled: nothing held by a call any more


@pytest.mark.parametrize("level", [0, 5])
def test_the_alert_permission_level_is_checked(level: int) -> None:
    with pytest.raises(ConfigError, match="alert_permission_level must be 1 to 4"):
        ModelConfig(alert_permission_level=level).validate()
