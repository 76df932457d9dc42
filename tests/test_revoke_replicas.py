"""A revoked player on a second engine replica (issue 18): two engine replicas and two gateway
replicas over one storage, all real gRPC servers on loopback with service credentials.

Gateway A sends its players' requests to engine A, gateway B to engine B, so the test knows
which engine replica would serve each request (in production every gateway spreads its calls
over every engine replica; the refusal holds whichever one a call would reach). The
administrators play on gateway A: their grant and revoke run on engine A, which reaches the
player's gateway replica through the presence recorded in storage. A revoked player's chat
and game events are refused at once, in zh and en, on either path, and a re-grant
serves them again at once; a change right after the player moved replica still reaches the one
serving them; a reset clears what the serving replica kept."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
from collections.abc import AsyncIterator

import grpc
import pytest
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2
from system.storage.v1 import presence_pb2, presence_pb2_grpc

from services.gamesim.client import GameServerClient
from services.gamesim.world import World
from services.stack.launcher import free_port
from tests.inprocess import SERVER_ID, Chain, HoldingClient, internal_target, running_chain
from tests.waiting import wait_until

SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
DENIED = "system.error.permission_denied"
STEVE = f"{SERVER_ID}/steve"
ALEX = f"{SERVER_ID}/alex"
ADVANCEMENT = "minecraft:advancement"
PRESENCE_LEASE_SECONDS = 60
"""Long enough that no replica renews (and so learns of a takeover) while a test runs: a
player's old replica still holds them after they joined on the other one."""


async def add_second_replicas(chain: Chain) -> None:
    """Starts engine B (the chain's engine settings, its own port) and gateway B (the chain's
    gateway settings, its own ports) whose players' requests go to engine B alone."""
    create_engine, engine_config = chain._restart["engine"]
    engine_b = await create_engine(dataclasses.replace(engine_config, port=0))
    chain.apps["engine_b"] = engine_b
    await engine_b.host.start()
    create_gateway, gateway_config = chain._restart["gateway"]
    gateway_b = await create_gateway(
        dataclasses.replace(
            gateway_config,
            port=0,
            internal_port=free_port(),
            engine_target=engine_b.host.target,
        )
    )
    chain.apps["gateway_b"] = gateway_b
    await gateway_b.host.start()


@pytest.fixture
async def chain(tmp_path: pathlib.Path) -> AsyncIterator[Chain]:
    async with running_chain(
        tmp_path, credentials=True, presence_lease_seconds=PRESENCE_LEASE_SECONDS
    ) as running:
        await add_second_replicas(running)
        yield running


async def connect(
    chain: Chain, gateway: str, world: World, kind: type[GameServerClient] = GameServerClient
) -> GameServerClient:
    client = chain.new_client(gateway=gateway, kind=kind)
    client.world = world
    await client.connect()
    return client


async def wait_located_at(chain: Chain, player_id: str, gateway: str) -> None:
    """Until storage names `gateway` for the player (asked with the engine's credential)."""
    stub = presence_pb2_grpc.PresenceServiceStub(chain.channel("storage"))
    auth = (("authorization", f"Bearer {chain.credentials['engine']}"),)
    address = internal_target(chain.apps[gateway].host)

    async def there() -> bool:
        found = await stub.LocatePlayer(
            presence_pb2.LocatePlayerRequest(player_id=player_id), metadata=auth, timeout=5
        )
        return found.connected and found.address == address

    await wait_until(there, what=f"{player_id} located at {gateway} ({address})")


async def refused_event(client: GameServerClient, player: str, key: str, advancement: str) -> None:
    """Sends an advancement and waits for its refusal: PERMISSION_DENIED, the player revoked."""
    await client.event(player, ADVANCEMENT, key, {"advancement": advancement})
    refusal = await wait_until(
        lambda: next((e for e in client.frame_errors if e.request_id == key), None),
        what=f"the event {key} refused",
    )
    assert refusal.code == grpc.StatusCode.PERMISSION_DENIED.value[0], refusal
    assert "revoked" in refusal.message


async def rewarded(client: GameServerClient, player: str, key: str, advancement: str) -> None:
    """Sends an advancement and waits for its reward's notice (the items given)."""
    await client.event(player, ADVANCEMENT, key, {"advancement": advancement})

    async def notice() -> gateway_pb2.PlayerResponse:
        while True:
            frame = await client.notices.get()
            if frame.player_id == player and frame.WhichOneof("body") == "notice":
                return frame

    shown = await asyncio.wait_for(notice(), 10)
    assert shown.notice.result.status == SUCCEEDED, shown
    assert not [e for e in client.frame_errors if e.request_id == key]


async def assert_refused(client: GameServerClient, player: str, texts: tuple[str, ...]) -> None:
    for text in texts:
        answer = (await client.chat(player, text)).reply.result
        assert answer.failure.key == DENIED, (player, text, answer)
        assert answer.failure.message in (  # in the player's language
            "管理员已停用你使用助手的权限。",
            "An administrator revoked your access to the assistant.",
        )


async def assert_served(client: GameServerClient, player: str, texts: tuple[str, ...]) -> None:
    for text in texts:
        answer = (await client.chat(player, text)).reply.result
        assert answer.status == SUCCEEDED, (player, text, answer)


async def test_a_player_revoked_through_one_engine_is_refused_on_the_other_at_once(
    chain: Chain,
) -> None:
    world = World()
    on_a = await connect(chain, "gateway", world)
    on_b = await connect(chain, "gateway_b", world, kind=HoldingClient)
    assert isinstance(on_b, HoldingClient)
    await on_a.join("op", "Op", "en_us", permission_level=3)
    await on_a.join("zhop", "Zhop", "zh_cn", permission_level=4)
    await on_b.join("steve", "Steve", "zh_cn")
    await on_b.join("alex", "Alex", "en_us")
    await wait_located_at(chain, STEVE, "gateway_b")
    await wait_located_at(chain, ALEX, "gateway_b")
    engine_a, engine_b = chain.apps["engine"].engine, chain.apps["engine_b"].engine

    # Before: both are served on engine B, and their events are rewarded.
    await assert_served(on_b, "steve", ("帮助", "/背包"))
    await assert_served(on_b, "alex", ("help", "/inventory"))
    await rewarded(on_b, "steve", "adv-1", "minecraft:story/mine_diamond")
    assert world.inventory("steve")["minecraft:diamond"] == 1

    # A request of steve's runs on engine B (its game-tool call held) when he is revoked.
    on_b.hold.add("steve")
    running = asyncio.ensure_future(on_b.chat("steve", "/inventory"))
    await asyncio.wait_for(on_b.held.wait(), 10)
    assert engine_b.runs.running(STEVE) is not None and engine_a.runs.running(STEVE) is None

    # Revoked through engine A (the admin's replica), in en and in zh.
    done = (await on_a.chat("op", "/system revoke steve")).reply.result
    assert done.status == SUCCEEDED and done.card.title == "Revoked steve"
    assert [line.text for line in done.card.lines] == [
        "In force at once on the player's game server."
    ]
    done = (await on_a.chat("zhop", "/system 撤销授权 alex")).reply.result
    assert done.status == SUCCEEDED and done.card.title == "已撤销 alex"

    # At once: steve's running request stops on engine B, and nothing of theirs is served.
    answered = await asyncio.wait_for(running, 10)
    assert answered.reply.result.failure.key == "system.error.cancelled"
    await wait_until(lambda: engine_b.runs.running(STEVE) is None, what="steve's run ended")
    on_b.hold.clear()
    await assert_refused(on_b, "steve", ("帮助", "/背包", "/system settings"))
    await assert_refused(on_b, "alex", ("help", "/inventory", "what is in my inventory"))
    bread = world.inventory("steve").get("minecraft:bread", 0)
    await refused_event(on_b, "steve", "adv-2", "minecraft:story/mine_stone")
    await refused_event(on_b, "alex", "adv-3", "minecraft:story/mine_stone")
    assert world.inventory("steve").get("minecraft:bread", 0) == bread
    assert (await on_a.chat("op", "help")).reply.result.status == SUCCEEDED  # others served

    # Steve's game server connection moves to gateway A: his requests now go to engine A,
    # which never saw the revoke; refused there too, and so are his events.
    await on_a.join("steve", "Steve", "zh_cn")
    await wait_located_at(chain, STEVE, "gateway")
    await assert_refused(on_a, "steve", ("帮助", "/help"))
    await refused_event(on_a, "steve", "adv-4", "minecraft:story/mine_stone")

    # Granted again (in zh, and in en): served again at once, wherever they are.
    granted = (await on_a.chat("zhop", "/system 授权 steve")).reply.result
    assert granted.status == SUCCEEDED and granted.card.title == "已授权 steve"
    granted = (await on_a.chat("op", "/system grant alex")).reply.result
    assert granted.status == SUCCEEDED and granted.card.title == "Granted alex"
    await assert_served(on_a, "steve", ("帮助", "/背包"))
    await assert_served(on_b, "alex", ("help", "/inventory"))
    torches = {p: world.inventory(p)["minecraft:torch"] for p in ("steve", "alex")}
    await rewarded(on_a, "steve", "adv-5", "minecraft:story/smelt_iron")
    await rewarded(on_b, "alex", "adv-6", "minecraft:story/smelt_iron")
    assert world.inventory("steve")["minecraft:torch"] == torches["steve"] + 16
    assert world.inventory("alex")["minecraft:torch"] == torches["alex"] + 16


async def test_a_change_right_after_the_player_moved_replica_reaches_the_one_serving_them(
    chain: Chain,
) -> None:
    """The engine keeps a player's route (here for as long as the test runs); the player's
    old replica still holds them until its next renewal. A revoke or a feature taken back
    must still reach the replica that serves them now."""
    chain.apps["engine"].game_tools.routes.route_seconds = 3600.0
    world = World()
    on_a = await connect(chain, "gateway", world)
    on_b = await connect(chain, "gateway_b", world)
    await on_a.join("op", "Op", "en_us", permission_level=3)
    await on_b.join("steve", "Steve", "en_us")
    await wait_located_at(chain, STEVE, "gateway_b")

    async def offers_search() -> bool:
        shown = (await on_a.chat("steve", "/help")).reply.result
        assert shown.status == SUCCEEDED, shown
        return any(line.text.startswith("/search ") for line in shown.card.lines)

    # Engine A tells B of a grant, and keeps B as steve's route.
    done = (await on_a.chat("op", "/system search-on steve")).reply.result
    assert done.card.title == "Web search on for steve"
    assert [line.text for line in done.card.lines] == [
        "In force at once on the player's game server."
    ]
    # Steve's game server moves him to gateway A; B has not renewed since, so it still holds
    # its attachment of him.
    await on_a.join("steve", "Steve", "en_us")
    await wait_located_at(chain, STEVE, "gateway")
    assert chain.apps["gateway_b"].connections.attached(STEVE) is not None
    assert await offers_search()  # A read his grants from storage at his first request

    off = (await on_a.chat("op", "/system search-off steve")).reply.result
    assert off.card.title == "Web search off for steve"
    assert not await offers_search()
    done = (await on_a.chat("op", "/system revoke steve")).reply.result
    assert done.card.title == "Revoked steve"
    await assert_refused(on_a, "steve", ("/help", "帮助"))
    await refused_event(on_a, "steve", "adv-1", "minecraft:story/mine_stone")
    granted = (await on_a.chat("op", "/system grant steve")).reply.result
    assert granted.card.title == "Granted steve"
    assert not await offers_search()  # served again, without the feature taken back


async def test_a_reset_through_one_engine_clears_the_player_served_by_the_other(
    chain: Chain,
) -> None:
    """`/system reset` (and its refusal for an ordinary player): the player's history and
    settings are deleted and the replica serving them forgets what it kept; they are served on,
    with the defaults."""
    world = World()
    on_a = await connect(chain, "gateway", world)
    on_b = await connect(chain, "gateway_b", world)
    await on_a.join("op", "Op", "en_us", permission_level=3)
    await on_b.join("steve", "Steve", "zh_cn")
    await on_b.join("alex", "Alex", "en_us")
    await wait_located_at(chain, STEVE, "gateway_b")
    await assert_served(on_b, "steve", ("帮助",))
    changed = await on_b.request("steve", preferences=gateway_pb2.Preferences(external=False))
    assert not changed.state.external_enabled
    history = await on_b.control("steve", gateway_pb2.CONTROL_ACTION_HISTORY)
    assert history.history.entries

    refused = (await on_b.chat("alex", "/system reset steve")).reply.result
    assert refused.failure.key == "system.error.unknown_command"
    done = (await on_a.chat("op", "/system reset steve")).reply.result
    assert done.status == SUCCEEDED and done.card.title == "Reset steve"
    assert [line.text for line in done.card.lines] == [
        "In force at once on the player's game server."
    ]
    state = await on_b.control("steve", gateway_pb2.CONTROL_ACTION_STATE)
    assert state.state.external_enabled  # the default again
    history = await on_b.control("steve", gateway_pb2.CONTROL_ACTION_HISTORY)
    assert list(history.history.entries) == []
    await assert_served(on_b, "steve", ("帮助",))
