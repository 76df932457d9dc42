"""A budget alert on a network of replicas (issue 21): two model-gateway replicas and two
gateway replicas over one storage, real gRPC servers on loopback with service credentials.

Both model-gateway replicas see the same budgets pass their thresholds (each on its own
reservation); the alert is claimed in storage, so only the first sends it, and it goes to
every live gateway replica storage's presence knows, so the administrators on the game server
connected to the other gateway replica get it too, once."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
from collections.abc import AsyncIterator

import grpc
import pytest
from system.gateway.v1 import gateway_pb2
from system.model.v1 import model_pb2, model_pb2_grpc

from services.gamesim.client import GameServerClient
from services.model_testserver import FakeOpenAIServer
from tests.inprocess import SERVER_ID, Chain, running_chain
from tests.test_revoke_replicas import wait_located_at

KEY = "alert-replicas-key"
BUDGETS = (  # a lease of 16,384 tokens passes both thresholds at the first reservation
    "[server]\ndaily_tokens = 100000\nalert_percent = 10\n"
    "[network]\ndaily_tokens = 1000000\nalert_percent = 1\n"
)


@pytest.fixture
async def chain(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Chain]:
    monkeypatch.setenv("ALERT_REPLICAS_KEY", KEY)
    with FakeOpenAIServer(api_key=KEY) as fake:
        providers = tmp_path / "providers.toml"
        providers.write_text(
            f'[providers.fake]\npreset = "custom"\nbase_url = "{fake.base_url}"\n'
            'api_key_env = "ALERT_REPLICAS_KEY"\n[providers.fake.models]\n'
            "m = { input_per_million = 1000.0, output_per_million = 2000.0 }\n"
            '[routes]\ndefault = ["fake/m"]\n'
        )
        budgets = tmp_path / "budgets.toml"
        budgets.write_text(BUDGETS)
        settings = {"providers_file": str(providers), "budgets_file": str(budgets)}
        async with running_chain(
            tmp_path, credentials=True, model=fake, model_settings=settings, gateway_replicas=2
        ) as running:
            create, config = running._restart["model"]
            second = await create(dataclasses.replace(config, port=0))
            running.apps["model_b"] = second  # stopped with the chain
            await second.host.start()
            running.fake = fake  # type: ignore[attr-defined]
            yield running


async def complete(chain: Chain, model: str, player: str) -> None:
    """One model call of `player` on model-gateway replica `model`, as the engine makes it."""
    chain.fake.script("Hello!", prompt_tokens=40, completion_tokens=5)  # type: ignore[attr-defined]
    channel = grpc.aio.insecure_channel(chain.apps[model].host.target)
    try:
        answer = await model_pb2_grpc.ModelGatewayServiceStub(channel).Complete(
            model_pb2.CompleteRequest(
                player_id=f"{SERVER_ID}/{player}",
                messages=[model_pb2.ChatMessage(role=model_pb2.MESSAGE_ROLE_USER, content="hi")],
                max_tokens=16,
                module_id="system:chat",
            ),
            metadata=(("authorization", f"Bearer {chain.credentials['engine']}"),),
            timeout=10,
        )
    finally:
        await channel.close()
    assert answer.content == "Hello!"


async def alerts_seen(client: GameServerClient, count: int) -> dict[tuple[str, str], str]:
    """The next `count` notices: by (player, budget), the alert's first line."""
    got: dict[tuple[str, str], str] = {}
    for _ in range(count):
        frame: gateway_pb2.PlayerResponse = await asyncio.wait_for(client.notices.get(), 5)
        line = frame.notice.result.card.lines[0].text
        budget = line.split()[1].split("（")[0]
        assert (frame.player_id, budget) not in got, f"{frame.player_id} got {budget} twice"
        got[(frame.player_id, budget)] = line
    return got


async def test_an_alert_is_sent_once_and_reaches_every_gateway_replica(chain: Chain) -> None:
    on_a = await chain.client()
    await on_a.join("op", "Op", "en_us", permission_level=3)
    await on_a.join("steve", "Steve", "en_us")
    on_b = await chain.client(gateway="gateway_b")
    await on_b.join("zhop", "Zhop", "zh_cn", permission_level=4)
    await on_b.join("alex", "Alex", "en_us")
    await wait_located_at(chain, f"{SERVER_ID}/steve", "gateway")
    await wait_located_at(chain, f"{SERVER_ID}/alex", "gateway_b")

    # Replica A's reservation passes both thresholds first; replica B's passes them after.
    first, second = chain.apps["model"].notices, chain.apps["model_b"].notices
    await complete(chain, "model", "steve")
    await first.drain()
    await complete(chain, "model_b", "alex")
    await second.drain()
    assert (first.sent, first.left_to_others) == (2, 0)
    assert (second.sent, second.left_to_others) == (0, 2)  # claimed by A: B sends nothing

    # Every admin gets each alert once, on either gateway replica, in their language (the
    # network's on every game server; the server's on the game server's connections).
    seen_a = await alerts_seen(on_a, 2)
    seen_b = await alerts_seen(on_b, 2)
    assert set(seen_a) == {("op", "server_daily_tokens"), ("op", "network_daily_tokens")}
    assert set(seen_b) == {("zhop", "server_daily_tokens"), ("zhop", "network_daily_tokens")}
    assert seen_a[("op", "network_daily_tokens")].startswith(
        "Budget network_daily_tokens passed 1 % for "
    )
    assert seen_b[("zhop", "network_daily_tokens")].startswith("预算 network_daily_tokens 在 ")
    # Frames arrive in order: after a command's reply, no further notice is on its way.
    for client, admin in ((on_a, "op"), (on_b, "zhop")):
        await client.chat(admin, "/help")
        assert client.notices.empty()
