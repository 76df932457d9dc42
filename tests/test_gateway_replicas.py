"""Two gateway replicas over one storage and one engine, all real gRPC servers on loopback
(decision 0023): the engine's game-tool calls and notices reach a player on whichever replica
their game server is connected to, a game server reconnecting to the other replica takes its
players over, and a replica that stops renewing its lease is ignored once the lease ends; a
card a replica sent is pressed on the other one after the game server moved there (decision
0030).

The engine's `gateway_target` names replica B (`running_chain(gateway_replicas=2)`), so a
player on replica A is reached only through the presence recorded in storage."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator

import grpc
import pytest
from sqlalchemy import delete, select
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2
from system.storage.v1 import card_book_pb2, card_book_pb2_grpc, presence_pb2, presence_pb2_grpc

from services.gamesim.client import FrameRefused, GameServerClient
from services.gamesim.world import World
from storage_service.presence import PlayerPresenceRow
from tests.inprocess import SERVER_ID, Chain, internal_target, running_chain
from tests.waiting import wait_until

SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
LEASE_SECONDS = 3  # the shortest a gateway accepts; renewed every second
STEVE = f"{SERVER_ID}/steve"
INVENTORY = "minecraft:inventory.read"


class RecordingClient(GameServerClient):
    """A simulated game server that records the game-tool calls it was sent."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.tool_calls: list[str] = []

    def _run_tool(self, call: gateway_pb2.ToolCall) -> gateway_pb2.ConnectRequest:
        self.tool_calls.append(call.tool)
        return super()._run_tool(call)


@pytest.fixture
async def chain(tmp_path: pathlib.Path) -> AsyncIterator[Chain]:
    async with running_chain(
        tmp_path, gateway_replicas=2, presence_lease_seconds=LEASE_SECONDS
    ) as running:
        yield running


def connect_to(chain: Chain, gateway: str, world: World) -> RecordingClient:
    client = RecordingClient(chain.target(gateway), SERVER_ID, chain.token, world)
    chain._clients.append(client)
    return client


def presence(chain: Chain) -> presence_pb2_grpc.PresenceServiceStub:
    return presence_pb2_grpc.PresenceServiceStub(chain.channel("storage"))


async def located(chain: Chain, player_id: str = STEVE) -> presence_pb2.LocatePlayerResponse:
    return await presence(chain).LocatePlayer(
        presence_pb2.LocatePlayerRequest(player_id=player_id), timeout=5
    )


def relay_address(chain: Chain, gateway: str) -> str:
    return internal_target(chain.apps[gateway].host)


async def wait_located_at(chain: Chain, gateway: str) -> None:
    address = relay_address(chain, gateway)

    async def there() -> bool:
        found = await located(chain)
        return found.connected and found.address == address

    await wait_until(there, what=f"steve located at {gateway} ({address})")


async def next_notice(client: GameServerClient) -> gateway_pb2.PlayerResponse:
    """The next notice the game server was sent; fails the test after 5 s without one."""
    return await asyncio.wait_for(client.notices.get(), 5.0)


def notice(text: str) -> common_pb2.AgentResult:
    return common_pb2.AgentResult(status=SUCCEEDED, text=text)


async def test_tool_calls_follow_the_game_server_to_the_other_replica(chain: Chain) -> None:
    world = World()
    on_a = connect_to(chain, "gateway", world)
    await on_a.connect()
    await on_a.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway")
    # The engine's own target is replica B; the inventory read reaches steve on A.
    shown = (await on_a.chat("steve", "check my inventory")).reply
    assert shown.module_id == "system:inventory" and shown.result.status == SUCCEEDED
    assert on_a.tool_calls == [INVENTORY]

    # The game server reconnects to replica B: steve goes with it.
    await on_a.close()
    on_b = connect_to(chain, "gateway_b", world)
    await on_b.connect()
    await on_b.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway_b")
    shown = (await on_b.chat("steve", "check my inventory")).reply
    assert shown.module_id == "system:inventory" and shown.result.status == SUCCEEDED
    assert on_b.tool_calls == [INVENTORY]
    assert on_a.tool_calls == [INVENTORY]

    # And back to A: the engine's cached route to B answers "not connected", so it asks
    # storage again and follows.
    await on_b.close()
    again = connect_to(chain, "gateway", world)
    await again.connect()
    await again.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway")
    shown = (await again.chat("steve", "check my inventory")).reply
    assert shown.result.status == SUCCEEDED
    assert again.tool_calls == [INVENTORY] and on_b.tool_calls == [INVENTORY]
    # A notice from the engine (an event task's outcome) goes the same way.
    tools = chain.apps["engine"].game_tools
    await tools.notify(STEVE, notice("done"), 5.0, server_id=SERVER_ID)
    shown_notice = await next_notice(again)
    assert shown_notice.player_id == "steve" and shown_notice.notice.result.text == "done"


async def test_a_reconnection_elsewhere_takes_the_players_over_and_notices_follow(
    chain: Chain,
) -> None:
    world = World()
    on_b = connect_to(chain, "gateway_b", world)
    await on_b.connect()
    await on_b.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway_b")
    shown = (await on_b.chat("steve", "check my inventory")).reply
    assert shown.result.status == SUCCEEDED and on_b.tool_calls == [INVENTORY]

    # A new stream on replica A while the one on B is still open (a link B has not seen
    # die yet): the JOIN on A takes steve's row over.
    on_a = connect_to(chain, "gateway", world)
    await on_a.connect()
    await on_a.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway")
    # B's next renewal learns it from storage and lets steve go, as a newer connection on
    # one replica would: the old stream's frames for steve are refused.
    b = chain.apps["gateway_b"]
    await wait_until(
        lambda: b.connections.attached(STEVE) is None and not b.presence.holds(STEVE),
        timeout=LEASE_SECONDS * 3,
        what="B let steve go",
    )
    with pytest.raises(FrameRefused) as refused:
        await on_b.chat("steve", "check my inventory")
    assert refused.value.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    # B's repair does not take steve back.
    renewed = b.presence.renewals
    await wait_until(lambda: b.presence.renewals > renewed + 1, what="two more renewals of B")
    await wait_located_at(chain, "gateway")

    # The engine's notice and tool calls reach steve on A, not on B (the engine's own
    # target, where its last call for steve went).
    tools = chain.apps["engine"].game_tools
    await tools.notify(STEVE, notice("moved"), 5.0, server_id=SERVER_ID)
    moved = await next_notice(on_a)
    assert moved.player_id == "steve" and moved.notice.result.text == "moved"
    reply = (await on_a.chat("steve", "check my inventory")).reply
    assert reply.result.status == SUCCEEDED and on_a.tool_calls == [INVENTORY]
    assert on_b.tool_calls == [INVENTORY]
    assert on_b.notices.empty()


async def test_a_late_leave_on_the_old_replica_leaves_the_new_row_alone(chain: Chain) -> None:
    world = World()
    on_b = connect_to(chain, "gateway_b", world)
    await on_b.connect()
    await on_b.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway_b")
    on_a = connect_to(chain, "gateway", world)
    await on_a.connect()
    await on_a.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway")
    # B's old stream ends before B heard of the takeover, or after: either way B's write
    # (a detach, or its repair) never removes the row A holds.
    b = chain.apps["gateway_b"].presence
    await on_b.close()
    await wait_until(lambda: not b.holds(STEVE) and b.settled, what="B wrote steve's leave")
    renewed = b.renewals
    await wait_until(lambda: b.renewals > renewed, what="another renewal of B")
    await wait_located_at(chain, "gateway")
    reply = (await on_a.chat("steve", "check my inventory")).reply
    assert reply.result.status == SUCCEEDED and on_a.tool_calls == [INVENTORY]


async def test_a_replica_that_stops_renewing_is_ignored_after_its_lease(chain: Chain) -> None:
    world = World()
    on_a = connect_to(chain, "gateway", world)
    await on_a.connect()
    await on_a.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway")

    # Replica A hangs as far as storage can tell: no more renewals. It still holds the
    # stream, but once its lease ends nothing names it.
    await chain.apps["gateway"].presence.stop()

    async def gone() -> bool:
        return not (await located(chain)).connected

    await wait_until(gone, timeout=LEASE_SECONDS * 3, what="A's lease ended")

    # B's next renewal deletes A's rows.
    def no_rows_left() -> bool:
        with chain.apps["storage"].engine.connect() as connection:
            return connection.execute(select(PlayerPresenceRow)).first() is None

    await wait_until(no_rows_left, timeout=LEASE_SECONDS * 3, what="A's rows deleted")
    # The engine no longer finds steve on A: its notice goes to its own target (B), where
    # steve is not.
    tools = chain.apps["engine"].game_tools
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await tools.notify(STEVE, notice("lost"), 5.0, server_id=SERVER_ID)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert on_a.notices.empty()

    # The game server reconnects to B and is reachable again.
    await on_a.close()
    on_b = connect_to(chain, "gateway_b", world)
    await on_b.connect()
    await on_b.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway_b")
    await tools.notify(STEVE, notice("found"), 5.0, server_id=SERVER_ID)
    assert (await next_notice(on_b)).notice.result.text == "found"


async def test_a_gateway_that_shuts_down_takes_its_players_out_at_once(chain: Chain) -> None:
    on_a = connect_to(chain, "gateway", World())
    await on_a.connect()
    await on_a.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway")
    await chain.stop("gateway")
    assert not (await located(chain)).connected


async def test_the_engine_may_locate_players_and_nobody_else_may_write_presence(
    tmp_path: pathlib.Path,
) -> None:
    async with running_chain(
        tmp_path, credentials=True, gateway_replicas=2, presence_lease_seconds=LEASE_SECONDS
    ) as chain:
        on_a = connect_to(chain, "gateway", World())
        await on_a.connect()
        await on_a.join("steve", "Steve", "en_us")
        # Through the engine's credential: the relay to A, located in storage.
        shown = (await on_a.chat("steve", "check my inventory")).reply
        assert shown.result.status == SUCCEEDED and on_a.tool_calls == [INVENTORY]

        def stub(
            caller: str,
        ) -> tuple[presence_pb2_grpc.PresenceServiceStub, tuple[tuple[str, str], ...]]:
            channel = grpc.aio.insecure_channel(chain.storage_target)
            chain._channels.append(channel)
            return presence_pb2_grpc.PresenceServiceStub(channel), (
                ("authorization", f"Bearer {chain.credentials[caller]}"),
            )

        engine, as_engine = stub("engine")
        found = await engine.LocatePlayer(
            presence_pb2.LocatePlayerRequest(player_id=STEVE), metadata=as_engine, timeout=5
        )
        assert found.connected
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await engine.AttachPlayers(
                presence_pb2.AttachPlayersRequest(replica_id="x", player_ids=[STEVE]),
                metadata=as_engine,
                timeout=5,
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        router, as_router = stub("router")
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await router.LocatePlayer(
                presence_pb2.LocatePlayerRequest(player_id=STEVE), metadata=as_router, timeout=5
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_bad_presence_calls_say_what_to_fix(chain: Chain) -> None:
    stub = presence(chain)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.RenewReplica(
            presence_pb2.RenewReplicaRequest(replica_id="r1", address="nowhere", lease_seconds=5),
            timeout=5,
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "host:port" in (refused.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.AttachPlayers(
            presence_pb2.AttachPlayersRequest(replica_id="never-renewed", player_ids=[STEVE]),
            timeout=5,
        )
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "RenewReplica" in (refused.value.details() or "")


async def test_the_engine_closes_a_replicas_idle_channel_and_opens_it_again(
    chain: Chain,
) -> None:
    on_a = connect_to(chain, "gateway", World())
    await on_a.connect()
    await on_a.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway")
    routes = chain.apps["engine"].game_tools.routes
    address_a = relay_address(chain, "gateway")
    assert (await on_a.chat("steve", "check my inventory")).reply.result.status == SUCCEEDED
    assert address_a in routes.addresses
    # Every route counts as idle from now on: the next lookup closes A's channel, never the
    # engine's own target's.
    routes.idle_seconds = routes.route_seconds = 0.0
    await routes.route(f"{SERVER_ID}/nobody")
    assert routes.addresses == [routes.default.address]
    # The next call for steve opens it again.
    assert (await on_a.chat("steve", "check my inventory")).reply.result.status == SUCCEEDED
    assert on_a.tool_calls == [INVENTORY, INVENTORY]


async def test_a_row_storage_lost_is_written_again_at_the_next_renewal(chain: Chain) -> None:
    on_a = connect_to(chain, "gateway", World())
    await on_a.connect()
    await on_a.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway")
    a = chain.apps["gateway"].presence
    # The join's write answered (a retry of it would write the row again, not a sync).
    await wait_until(lambda: a.settled, what="the join's presence write settled")
    syncs = a.syncs
    # The row goes missing (a write lost in a failover, say): the digest of A's next renewal
    # no longer matches, and A sends its list once.
    with chain.apps["storage"].engine.begin() as connection:
        connection.execute(delete(PlayerPresenceRow))
    assert not (await located(chain)).connected
    await wait_located_at(chain, "gateway")
    # Storage shows the row once the sync is stored, a moment before the gateway reads the
    # answer and counts it.
    await wait_until(lambda: a.syncs > syncs, what="the renewal's sync counted")
    assert a.syncs == syncs + 1


async def test_a_replica_the_engine_cannot_reach_gets_nothing_sent_and_is_not_guessed(
    chain: Chain,
) -> None:
    """A gateway replica whose relay port is gone (a crashed pod whose presence row has not
    expired yet): the engine's calls for its players could not have left, so a write is not
    EFFECT_UNKNOWN but not delivered (an event task waits for the player), and where storage
    already names another replica the call goes there once."""
    from services.results import AgentFailure, NotDelivered

    world = World()
    on_a = connect_to(chain, "gateway", world)
    await on_a.connect()
    await on_a.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway")
    dead = relay_address(chain, "gateway")
    await chain.apps["gateway"].host.server.stop(0)  # the relay port only: presence renews on

    tools = chain.apps["engine"].game_tools
    give = {"item": "minecraft:diamond", "count": 1}
    with pytest.raises(NotDelivered) as lost:
        await tools.call(STEVE, "t1/1", "minecraft:item.give", give, 5.0, False, SERVER_ID)
    assert lost.value.player_offline and lost.value.failure is AgentFailure.TOOL_UNAVAILABLE
    assert on_a.tool_calls == []

    # The game server reconnects to B; the engine still holds A's address for steve, finds
    # it unreachable, asks storage again and sends the call to B, once.
    await on_a.close()
    on_b = connect_to(chain, "gateway_b", world)
    await on_b.connect()
    await on_b.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway_b")
    tools.routes._located[STEVE] = (dead, float("inf"))
    await tools.call(STEVE, "t1/1.2", "minecraft:item.give", give, 5.0, False, SERVER_ID)
    assert on_b.tool_calls == ["minecraft:item.give"]


async def test_an_event_right_after_a_join_waits_for_the_players_presence(chain: Chain) -> None:
    """The engine finds a player through storage: an event sent right after the JOIN on
    replica A (the engine's own target is B) must not run before storage names A, or its task
    waits for a join that already happened. Storage is made slow to take A's write."""
    world = World()
    on_a = connect_to(chain, "gateway", world)
    await on_a.connect()
    reporter = chain.apps["gateway"].presence
    attach = reporter._dep.stub.AttachPlayers

    async def slow_attach(*args: object, **kwargs: object) -> object:
        await asyncio.sleep(0.5)  # storage slow to answer, not a wait for a condition
        return await attach(*args, **kwargs)

    reporter._dep.stub.AttachPlayers = slow_attach  # type: ignore[method-assign]
    await on_a.join("steve", "Steve", "en_us")
    await on_a.event(
        "steve", "minecraft:advancement", "adv-1", {"advancement": "minecraft:story/mine_diamond"}
    )
    shown = await asyncio.wait_for(on_a.notices.get(), 10)  # the reward's notice
    assert shown.notice.result.status == SUCCEEDED, shown
    assert on_a.tool_calls.count("minecraft:item.give") == 2
    assert world.inventory("steve")["minecraft:diamond"] >= 1


async def test_a_task_that_started_waiting_just_after_its_players_join_runs_after_all(
    chain: Chain, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steve's game server moved to replica B and his join queued his waiting tasks; a task
    already running could not reach him on A (gone), and started waiting only after that. A
    moment later the engine asks storage, finds him on B, and the task runs."""
    from engine_service import events

    monkeypatch.setattr(events, "WAITING_RECHECK_SECONDS", 0.2)
    world = World()
    on_b = connect_to(chain, "gateway_b", world)
    await on_b.connect()
    await on_b.join("steve", "Steve", "en_us")
    await wait_located_at(chain, "gateway_b")

    # The engine still holds replica A's old address for steve, and A is gone.
    dead = relay_address(chain, "gateway")
    await chain.apps["gateway"].host.server.stop(0)
    tools = chain.apps["engine"].game_tools
    routes = tools.routes
    real_route = routes.route
    stale = 2  # the cached route and the fresh lookup both still name A

    async def stale_route(player_id: str, *, fresh: bool = False):  # type: ignore[no-untyped-def]
        nonlocal stale
        if player_id == STEVE and stale:
            stale -= 1
            routes._located[STEVE] = (dead, float("inf"))
            return await real_route(player_id)
        return await real_route(player_id, fresh=fresh)

    monkeypatch.setattr(routes, "route", stale_route)
    await on_b.event(
        "steve", "minecraft:advancement", "adv-1", {"advancement": "minecraft:story/mine_diamond"}
    )
    shown = await asyncio.wait_for(on_b.notices.get(), 10)  # the reward, after the recheck
    assert shown.notice.result.status == SUCCEEDED, shown
    assert on_b.tool_calls.count("minecraft:item.give") == 2


def _button(card: common_pb2.Card, label: str) -> common_pb2.CardButton:
    return next(b for b in card.buttons if b.label == label)


async def test_a_card_sent_by_one_replica_is_pressed_on_the_other(chain: Chain) -> None:
    """Steve pages his mail on replica A; his game server fails over to replica B. On B the
    newest version's button works and is numbered on, the older version is refused, and so
    is a button the card never carried."""
    world = World()
    on_a = connect_to(chain, "gateway", world)
    await on_a.connect()
    await on_a.join("steve", "Steve", "en_us")
    first = (await on_a.chat("steve", "/mail")).reply.result.card
    page2 = (await on_a.press("steve", first, _button(first, "Next page"))).reply.result.card
    assert (page2.ref.card_id, page2.ref.version) == (first.ref.card_id, 2)
    a = chain.apps["gateway"].card_books
    assert await a.written(5.0), "A wrote steve's cards to storage"
    assert a.settled

    await on_a.close()
    on_b = connect_to(chain, "gateway_b", world)
    await on_b.connect()
    await on_b.join("steve", "Steve", "en_us")
    stale = (await on_b.press("steve", first, _button(first, "Next page"))).reply.result
    assert stale.failure.key == "system.error.stale_card"
    assert stale.failure.message.startswith(
        "That card was updated (version 2 is on screen, the button was on version 1)"
    )
    forged = common_pb2.CardButton()
    forged.CopyFrom(_button(page2, "Previous page"))
    forged.args["input"] = '{"page": 7}'
    refused = (await on_b.press("steve", page2, forged)).reply.result
    assert refused.failure.message == "That button is not on the card; use the card's own buttons."
    back = (await on_b.press("steve", page2, _button(page2, "Previous page"))).reply.result
    assert back.status == SUCCEEDED and back.card.title.endswith("page 1 of 2)"), back
    assert (back.card.ref.card_id, back.card.ref.version) == (first.ref.card_id, 3)
    again = (await on_b.press("steve", page2, _button(page2, "Previous page"))).reply.result
    assert again.failure.key == "system.error.stale_card"


async def test_a_press_on_a_card_written_after_the_book_was_read_reads_it_again(
    chain: Chain,
) -> None:
    """Replica B read steve's book at his first request there; a card another replica sent
    lands in storage after that (its write was still on the way). A press on it makes B read
    storage again, and it runs; a card no replica sent is still refused."""
    on_b = connect_to(chain, "gateway_b", World())
    await on_b.connect()
    await on_b.join("steve", "Steve", "en_us")
    assert (await on_b.chat("steve", "/help")).reply.result.status == SUCCEEDED
    button = common_pb2.CardButton(
        action_id="invoke", label="/help", args={"module_id": "system:help", "input": "{}"}
    )
    cards = card_book_pb2_grpc.CardBookServiceStub(chain.channel("storage"))
    await cards.SaveCards(
        card_book_pb2.SaveCardsRequest(
            cards=[
                card_book_pb2.StoredCard(
                    player_id=STEVE,
                    card_id="from-a",
                    version=4,
                    template="system:help",
                    buttons=[button],
                )
            ]
        ),
        timeout=5,
    )
    sent = common_pb2.Card(ref=common_pb2.CardRef(card_id="from-a", version=4), buttons=[button])
    pressed = (await on_b.press("steve", sent, button)).reply
    assert pressed.module_id == "system:help" and pressed.result.status == SUCCEEDED
    sent.ref.card_id = "from-nowhere"
    refused = (await on_b.press("steve", sent, button)).reply.result
    assert refused.failure.key == "system.error.stale_card"
    assert refused.failure.message.startswith("That card is no longer active")
