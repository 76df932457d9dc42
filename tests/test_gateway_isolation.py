"""Game servers confined to their own players, frames that harm only themselves, and the
connection lifecycle (issue 20), on the real path in-process: storage (SQLite), engine, router
and gateway on loopback, several game servers with tokens of their own.

Every attack of the issue is replayed here: a second server JOINs a player of the first and
tries to read and clear her history, change her preferences, cancel her run, run /inventory
and give items through events. Networks (servers that share players) are tested too, with a
player moving between servers during a run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any
from unittest import mock

import grpc
import pytest
from google.protobuf import struct_pb2
from system.common.v1 import common_pb2, stream_pb2
from system.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from system.relay.v1 import relay_pb2
from system.storage.v1 import journal_pb2, journal_pb2_grpc, storage_pb2

from services.gamesim.client import FrameRefused
from services.gamesim.world import World
from services.gateway.config import GatewayConfig
from services.results import card, succeeded
from services.runtime.config import ConfigError
from services.runtime.logging import JsonFormatter, RepeatedLines
from services.runtime.metrics import RPC_HANDLED
from services.runtime.multiplex import MultiplexClient
from tests import inprocess
from tests.inprocess import Chain, HoldingClient, running_chain
from tests.waiting import wait_until

STEVE = "00000000-0000-4000-8000-000000000001"
ALEX = "00000000-0000-4000-8000-000000000002"
TOKENS = {
    "a": "token-of-server-a",
    "b": "token-of-server-b",
    "lobby": "token-of-the-lobby",
    "survival": "token-of-survival",
    "solo": "token-of-solo-server",
}
HUB = ("hub=lobby+survival",)
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
FAILED = common_pb2.RESULT_STATUS_FAILED
RELAY_SERVICE = relay_pb2.DESCRIPTOR.services_by_name["ToolRelayService"]
MINE_DIAMOND = {"advancement": "minecraft:story/mine_diamond"}


@contextlib.asynccontextmanager
async def servers_chain(tmp_path: Any, **overrides: Any) -> AsyncIterator[Chain]:
    """The in-process chain with a token for every server in TOKENS besides its own `sim`."""
    original = inprocess.GatewayConfig

    def config(**kwargs: Any) -> GatewayConfig:
        kwargs["tokens"] = (*kwargs["tokens"], *(f"{s}={t}" for s, t in TOKENS.items()))
        return original(**kwargs)

    with mock.patch.object(inprocess, "GatewayConfig", config):
        async with running_chain(tmp_path, **overrides) as chain:
            yield chain


async def connect(chain: Chain, server: str, world: World | None = None) -> HoldingClient:
    client = HoldingClient(chain.gateway_target, server, TOKENS[server], world)
    chain._clients.append(client)
    await client.connect()
    return client


def scoped(player: str, scope: str) -> str:
    return f"{scope}/{player}"


async def stored_history(chain: Chain, player_id: str) -> list[str]:
    assert await chain.apps["engine"].engine.settle_history(player_id)
    page = await chain.storage_stub().ListHistory(
        storage_pb2.ListHistoryRequest(player_id=player_id, page_size=100), timeout=5
    )
    return [e.text for e in page.entries]


async def tasks(chain: Chain, player_id: str) -> list[journal_pb2.Task]:
    journal = journal_pb2_grpc.JournalServiceStub(chain.channel("storage"))
    page = await journal.ListTasks(journal_pb2.ListTasksRequest(player_id=player_id), timeout=5)
    return list(page.tasks)


def deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def struct(data: dict[str, Any]) -> struct_pb2.Struct:
    value = struct_pb2.Struct()
    value.update(data)
    return value


def route_calls() -> float:
    return sum(
        sample.value
        for metric in RPC_HANDLED.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels.get("grpc_method") == "Route"
    )


# -- settings --------------------------------------------------------------------------------


def test_networks_are_checked_at_start() -> None:
    tokens = tuple(f"{s}={t}" for s, t in TOKENS.items())
    config = GatewayConfig(tokens=tokens, networks=("hub=lobby+survival",))
    assert config.player_scopes() == {
        "a": "a",
        "b": "b",
        "lobby": "hub",
        "survival": "hub",
        "solo": "solo",
    }
    refused = {
        "hub": "networks[0] must look like network=server_a+server_b, got 'hub'",
        "=a+b": "networks[0] must look like network=server_a+server_b, got '=a+b'",
        "hub=a+": "networks[0] must look like network=server_a+server_b, got 'hub=a+'",
        "hub=a+nobody": "networks[0]: server nobody of network hub has no token",
        "a=b+lobby": "networks[0]: a is a server id too; give the network a name of its own",
    }
    for entry, message in refused.items():
        with pytest.raises(ConfigError) as caught:
            GatewayConfig(tokens=tokens, networks=(entry,)).validate()
        assert str(caught.value) == message, entry
    with pytest.raises(ConfigError) as caught:
        GatewayConfig(tokens=tokens, networks=("hub=a+b", "other=b+solo")).validate()
    assert str(caught.value) == (
        "networks[1]: server b is in networks hub and other; a server belongs to one network at most"
    )
    with pytest.raises(ConfigError) as caught:
        GatewayConfig(tokens=tokens, networks=("hub=a", "hub=b")).validate()
    assert str(caught.value) == "networks[1]: network hub is named twice"
    for bad in ("x" * 28, "with/slash", "with space"):
        with pytest.raises(ConfigError) as caught:
            GatewayConfig(tokens=(f"{bad}=a-long-token",)).validate()
        assert "cannot scope players" in str(caught.value), bad


# -- servers in no network: each keeps its players ------------------------------------------


async def test_another_servers_join_touches_nothing_of_the_first(tmp_path: Any) -> None:
    """The issue's attack, step by step: server b JOINs the id of a player on server a and
    tries everything; a's player, her history, preferences, run, inventory and rewards are
    untouched, and b only ever reached its own player of that id."""
    async with servers_chain(tmp_path) as chain:
        world_a, world_b = World(), World()
        a = await connect(chain, "a", world_a)
        b = await connect(chain, "b", world_b)
        await a.join(STEVE, "Steve", "en_us")
        for text in ("help", "/history"):
            assert (await a.chat(STEVE, text)).reply.result.status == SUCCEEDED
        steve = scoped(STEVE, "a")
        before = await stored_history(chain, steve)
        assert before[0] == "help" and len(before) == 4

        await b.join(STEVE, "Not Steve", "en_us")  # accepted: b's own player of that id
        # History: b sees and clears only its own player's (empty) history.
        shown = await b.control(STEVE, gateway_pb2.CONTROL_ACTION_HISTORY)
        assert list(shown.history.entries) == []
        cleared = await b.control(STEVE, gateway_pb2.CONTROL_ACTION_CLEAR_HISTORY)
        assert cleared.notice.result.text == "Conversation history cleared (0 entries)."
        assert await stored_history(chain, steve) == before
        # Preferences: b's change is its own player's.
        off = await b.request(STEVE, preferences=gateway_pb2.Preferences(history=False))
        assert not off.state.history_enabled
        state = await a.control(STEVE, gateway_pb2.CONTROL_ACTION_STATE)
        assert state.state.history_enabled and not state.state.busy

        # A run of a's Steve in progress (a holds his tool call): b's CANCEL leaves it.
        a.hold.add(STEVE)
        running = asyncio.ensure_future(a.chat(STEVE, "/inventory"))
        await asyncio.wait_for(a.held.wait(), 10)
        engine = chain.apps["engine"].engine
        assert engine.runs.running(steve) is not None
        cancel = await b.control(STEVE, gateway_pb2.CONTROL_ACTION_CANCEL)
        assert not cancel.state.busy
        assert (await a.control(STEVE, gateway_pb2.CONTROL_ACTION_STATE)).state.busy
        assert not running.done() and not engine.runs.running(steve).cancelled
        # /inventory from b runs on b's game server, for b's player.
        inventory = await b.chat(STEVE, "/inventory")
        assert inventory.reply.result.status == SUCCEEDED
        assert b.calls == [(STEVE, "minecraft:inventory.read")]
        assert a.calls == [(STEVE, "minecraft:inventory.read")]  # only a's own, held
        # a's own CANCEL ends a's run.
        await a.control(STEVE, gateway_pb2.CONTROL_ACTION_CANCEL)
        ended = await asyncio.wait_for(running, 10)
        assert ended.reply.result.failure.key == "system.error.cancelled"
        a.hold.clear()

        # Events: b's advancement rewards b's player on b's game server only; an event of b
        # for a's other player (never joined on b) waits for b's own player of that id.
        await b.event(STEVE, "minecraft:advancement", "adv-1", MINE_DIAMOND)
        notice = await asyncio.wait_for(b.notices.get(), 10)
        assert notice.player_id == STEVE and notice.notice.result.status == SUCCEEDED
        assert world_b.inventory(STEVE)["minecraft:diamond"] == 1
        await a.join(ALEX, "Alex")
        await b.event(ALEX, "minecraft:advancement", "adv-2", MINE_DIAMOND)
        waiting = await _eventually_tasks(chain, scoped(ALEX, "b"))
        assert [t.state for t in waiting] == [journal_pb2.TASK_STATE_WAITING]
        assert await tasks(chain, scoped(ALEX, "a")) == []
        assert world_a.inventory(STEVE)["minecraft:diamond"] == 0
        assert world_a.inventory(ALEX)["minecraft:diamond"] == 0
        assert a.notices.empty()

        # The relay keeps a call inside the server it names.
        relay = chain.relay_stub()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await relay.CallGameTool(
                relay_pb2.CallGameToolRequest(
                    call_id="x1", player_id=steve, tool="minecraft:item.give", server_id="b"
                ),
                timeout=5,
            )
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert caught.value.details() == f"player {steve} does not belong to game server b"
        assert world_a.inventory(STEVE)["minecraft:diamond"] == 0
        # a's Steve is served as before, his history intact.
        assert (await a.chat(STEVE, "help")).reply.result.status == SUCCEEDED
        assert (await stored_history(chain, steve))[: len(before)] == before


async def _eventually_tasks(chain: Chain, player_id: str) -> list[journal_pb2.Task]:
    """The player's tasks once there is one (an event is submitted in the background)."""
    return await wait_until(
        lambda: tasks(chain, player_id), timeout=10, interval=0.02, what=f"{player_id}'s task"
    )


# -- a network: one player, attached to one server at a time ---------------------------------


async def test_a_network_player_moves_with_a_join(tmp_path: Any) -> None:
    async with servers_chain(tmp_path, networks=HUB) as chain:
        lobby_world, survival_world = World(), World()
        lobby = await connect(chain, "lobby", lobby_world)
        survival = await connect(chain, "survival", survival_world)
        solo = await connect(chain, "solo")
        steve = scoped(STEVE, "hub")
        await lobby.join(STEVE, "Steve")
        assert (await lobby.chat(STEVE, "help")).reply.result.status == SUCCEEDED

        await survival.join(STEVE, "Steve")  # moves him
        # One player across the network: survival sees the lobby's exchange.
        page = await survival.control(STEVE, gateway_pb2.CONTROL_ACTION_HISTORY)
        assert [e.text for e in page.history.entries][0] == "help"
        # The lobby's later frames for him are refused, each alone.
        with pytest.raises(FrameRefused) as caught:
            await lobby.chat(STEVE, "help")
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert caught.value.message == (
            f"player {STEVE} moved to server survival of network hub; frames for them go "
            "there until they join here again"
        )
        before = len(lobby.frame_errors)
        await lobby.leave(STEVE)
        await lobby.event(STEVE, "minecraft:advancement", "adv-l", MINE_DIAMOND)
        await wait_until(lambda: len(lobby.frame_errors) >= before + 2, timeout=10)
        assert {e.code for e in lobby.frame_errors[before:]} == {
            grpc.StatusCode.FAILED_PRECONDITION.value[0]
        }
        # Tool calls and events follow the attachment: a call naming the lobby reaches him on
        # survival; survival's event rewards him there.
        relay = chain.relay_stub()
        read = await relay.CallGameTool(
            relay_pb2.CallGameToolRequest(
                call_id="n1", player_id=steve, tool="minecraft:inventory.read", server_id="lobby"
            ),
            timeout=5,
        )
        assert read.result.WhichOneof("outcome") == "output"
        assert survival.calls == [(STEVE, "minecraft:inventory.read")] and lobby.calls == []
        await survival.event(STEVE, "minecraft:advancement", "adv-s", MINE_DIAMOND)
        notice = await asyncio.wait_for(survival.notices.get(), 10)
        assert notice.notice.result.status == SUCCEEDED
        assert survival_world.inventory(STEVE)["minecraft:diamond"] == 1
        assert lobby_world.inventory(STEVE)["minecraft:diamond"] == 0
        # A server outside the network has a Steve of its own and cannot reach the hub's.
        await solo.join(STEVE, "Other Steve")
        assert (
            list((await solo.control(STEVE, gateway_pb2.CONTROL_ACTION_HISTORY)).history.entries)
            == []
        )
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await relay.CallGameTool(
                relay_pb2.CallGameToolRequest(
                    call_id="n2", player_id=steve, tool="minecraft:item.give", server_id="solo"
                ),
                timeout=5,
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Back to the lobby: he moves again and the lobby serves him.
        await lobby.join(STEVE, "Steve")
        assert (await lobby.chat(STEVE, "help")).reply.result.status == SUCCEEDED
        with pytest.raises(FrameRefused) as caught:
            await survival.chat(STEVE, "help")
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_move_during_a_run_cancels_the_old_attachments_work(tmp_path: Any) -> None:
    async with servers_chain(tmp_path, networks=HUB) as chain:
        lobby = await connect(chain, "lobby")
        survival = await connect(chain, "survival")
        steve = scoped(STEVE, "hub")
        await lobby.join(STEVE, "Steve")
        lobby.hold.add(STEVE)
        running = asyncio.ensure_future(lobby.chat(STEVE, "/inventory"))
        await asyncio.wait_for(lobby.held.wait(), 10)
        engine = chain.apps["engine"].engine
        assert engine.runs.running(steve) is not None

        await survival.join(STEVE, "Steve")
        # The lobby's request is answered CANCELLED; its held tool call failed, so the run
        # ends; nothing of it reaches survival.
        answered = await asyncio.wait_for(running, 10)
        assert answered.reply.result.failure.key == "system.error.cancelled"
        await wait_until(lambda: engine.runs.running(steve) is None, timeout=10)
        # He is served on survival at once, with survival's tools.
        inventory = await survival.chat(STEVE, "/inventory")
        assert inventory.reply.result.status == SUCCEEDED, inventory.reply.result.failure
        assert survival.calls == [(STEVE, "minecraft:inventory.read")]
        assert lobby.calls == [(STEVE, "minecraft:inventory.read")]


# -- connection lifecycle ----------------------------------------------------------------------


async def test_a_stream_without_a_hello_is_ended(tmp_path: Any) -> None:
    async with servers_chain(tmp_path, hello_timeout_seconds=0.2) as chain:
        stub = gateway_pb2_grpc.GameGatewayServiceStub(chain.channel("gateway"))
        call = stub.Connect(metadata=(("authorization", f"Bearer {TOKENS['a']}"),), timeout=10)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call.read()
        assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await call.details() == (
            "no hello within 0.2 s of opening the stream; send the hello as the first frame"
        )
        a = await connect(chain, "a")
        await a.join(STEVE, "Steve")
        assert (await a.chat(STEVE, "help")).reply.result.status == SUCCEEDED


async def test_a_newer_connection_replaces_a_stalled_one(tmp_path: Any) -> None:
    """The newer wins: the old stream ends ABORTED, its waiting tool calls fail UNAVAILABLE,
    and its players are the new connection's once it joins them."""
    async with servers_chain(tmp_path) as chain:
        old = await connect(chain, "a")
        await old.join(STEVE, "Steve")
        old.hold.add(STEVE)  # stalled: it answers no tool call
        relay = chain.relay_stub()
        request = relay_pb2.CallGameToolRequest(
            call_id="r1", player_id=scoped(STEVE, "a"), tool="minecraft:inventory.read"
        )
        pending = asyncio.ensure_future(relay.CallGameTool(request, timeout=10))
        await asyncio.wait_for(old.held.wait(), 10)

        new = await connect(chain, "a")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pending
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert caught.value.details() == "game server a's connection was replaced by a newer one"
        await old.wait_closed()
        assert old.ended is not None and old.ended.code == grpc.StatusCode.ABORTED
        assert old.ended.details.startswith("replaced by a newer connection of server a")
        # Not attached until the new connection joins him; then everything goes there.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await relay.CallGameTool(request, timeout=5)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        await new.join(STEVE, "Steve")
        # The join is a frame on the new stream: the call may only follow once it is read.
        registry = chain.apps["gateway"].connections
        await wait_until(lambda: registry.attached(scoped(STEVE, "a")) is not None, timeout=10)
        answer = await relay.CallGameTool(request, timeout=5)
        assert answer.result.WhichOneof("outcome") == "output"
        assert (await new.chat(STEVE, "help")).reply.result.status == SUCCEEDED


async def test_a_stalled_reader_has_a_bounded_outbox(tmp_path: Any) -> None:
    """A game server that stops reading: notices beyond the outbox are dropped oldest first
    and the queue stays within its bounds; once only answers would be left to drop, its
    stream ends RESOURCE_EXHAUSTED. Another server is served all along."""
    limit = 8
    async with servers_chain(tmp_path, outbox_frames=limit) as chain:
        healthy = await connect(chain, "b")
        await healthy.join(ALEX, "Alex")
        # A small receive window, so that the stall reaches the gateway after a few frames
        # rather than after the megabytes gRPC would otherwise buffer.
        stalled = grpc.aio.insecure_channel(
            chain.gateway_target,
            options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)],
        )
        chain._channels.append(stalled)
        stub = gateway_pb2_grpc.GameGatewayServiceStub(stalled)
        call = stub.Connect(metadata=(("authorization", f"Bearer {TOKENS['a']}"),))
        await call.write(
            gateway_pb2.ConnectRequest(hello=gateway_pb2.Hello(server_id="a", protocol_version=1))
        )
        assert (await call.read()).WhichOneof("frame") == "welcome"
        await call.write(
            gateway_pb2.ConnectRequest(
                presence=gateway_pb2.PlayerPresence(
                    kind=gateway_pb2.PRESENCE_KIND_JOIN, player_id=STEVE
                )
            )
        )
        registry = chain.apps["gateway"].connections
        await wait_until(lambda: registry.attached(scoped(STEVE, "a")) is not None, timeout=10)
        connection = registry.attached(scoped(STEVE, "a"))
        relay = chain.relay_stub()
        big = succeeded(card("system:reward", "x" * 2000, ["y" * 2000]))
        largest = 0
        for index in range(400):  # the reader reads nothing from now on
            await relay.NotifyPlayer(
                relay_pb2.NotifyPlayerRequest(player_id=scoped(STEVE, "a"), result=big), timeout=5
            )
            largest = max(largest, len(connection))
            if index % 50 == 0:
                assert_help = await healthy.chat(ALEX, "help")
                assert assert_help.reply.result.status == SUCCEEDED
        assert largest <= limit
        assert connection.notices_dropped > 0
        assert connection.outbox_bytes <= limit * big.ByteSize() * 2
        # Answers cannot be dropped: FrameErrors for empty frames fill what notices leave.
        for _ in range(4 * limit):
            await call.write(gateway_pb2.ConnectRequest())
            if connection.ended:
                break
        await wait_until(lambda: connection.ended is not None, timeout=10)
        assert connection.ended[0] == "RESOURCE_EXHAUSTED"
        with contextlib.suppress(grpc.aio.AioRpcError):  # reads again: the status comes
            while await call.read() is not grpc.aio.EOF:
                pass
        assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await call.details()).startswith("the game server is not reading its frames")
        assert (await healthy.chat(ALEX, "help")).reply.result.status == SUCCEEDED


# -- one frame harms only its own call ---------------------------------------------------------


async def test_a_deep_tool_answer_fails_its_call_alone(tmp_path: Any) -> None:
    """The issue's 375-byte frame: a tool answer nested 32 deep. It fails that call (a clear
    failure for its caller, a FrameError for its game server); another server's tool calls in
    flight on the same relay stream succeed, and the stream stays up."""
    async with servers_chain(tmp_path) as chain:
        evil = await connect(chain, "b")
        honest = await connect(chain, "a")
        await evil.join(STEVE, "Steve")
        await honest.join(ALEX, "Alex")
        assert (await honest.chat(ALEX, "/inventory")).reply.result.status == SUCCEEDED
        tools = chain.apps["engine"].game_tools
        opened = tools._calls.streams_opened
        evil.answer = deep(32)
        answers = await asyncio.gather(
            evil.chat(STEVE, "/inventory"),
            *(honest.chat(ALEX, "/inventory") for _ in range(5)),
        )
        refused = answers[0].reply.result
        assert refused.status == FAILED
        assert refused.failure.key == "system.error.module_failed"
        assert "nests deeper than 16 levels" in refused.failure.message
        assert all(a.reply.result.status == SUCCEEDED for a in answers[1:])
        [error] = [
            e for e in evil.frame_errors if e.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        ]
        assert error.message == "tool_result.output nests deeper than 16 levels"
        assert tools._calls.streams_opened == opened
        # A write tool's refused answer is an unknown effect, never "not given".
        relay = chain.relay_stub()
        given = await relay.CallGameTool(
            relay_pb2.CallGameToolRequest(
                call_id="g1",
                player_id=scoped(STEVE, "b"),
                tool="minecraft:item.give",
                input=struct({"item": "minecraft:diamond", "count": 1}),
            ),
            timeout=5,
        )
        assert given.result.failure.key == "system.error.effect_unknown"


async def test_oversized_frames_are_refused_alone_with_bounded_messages(tmp_path: Any) -> None:
    async with servers_chain(tmp_path) as chain:
        client = await connect(chain, "a")
        await client.join(STEVE, "Steve")
        huge = "x" * 100_000

        async def refusal(frame: gateway_pb2.ConnectRequest) -> gateway_pb2.FrameError:
            before = len(client.frame_errors)
            await client.send(frame)
            await client.control(STEVE, gateway_pb2.CONTROL_ACTION_STATE)  # a barrier
            assert len(client.frame_errors) == before + 1
            return client.frame_errors[before]

        def request(**body: Any) -> gateway_pb2.ConnectRequest:
            return gateway_pb2.ConnectRequest(
                request=gateway_pb2.PlayerRequest(request_id="r", player_id=STEVE, **body)
            )

        cases = {
            "request.request_id must be at most 64 printable characters": gateway_pb2.ConnectRequest(
                request=gateway_pb2.PlayerRequest(
                    request_id=huge, player_id=STEVE, chat=gateway_pb2.Chat(text="help")
                )
            ),
            "presence.player_id must be at most 62 printable characters": gateway_pb2.ConnectRequest(
                presence=gateway_pb2.PlayerPresence(
                    kind=gateway_pb2.PRESENCE_KIND_JOIN, player_id="p" * 63
                )
            ),
            "invoke.call.input nests deeper than 16 levels": request(
                invoke=gateway_pb2.Invoke(
                    call=common_pb2.ModuleAction(module_id="system:help", input=struct(deep(17)))
                )
            ),
            "invoke.call.module_id must be at most 128 printable characters": request(
                invoke=gateway_pb2.Invoke(call=common_pb2.ModuleAction(module_id=huge))
            ),
            "card_action.args has more than 32 entries": request(
                card_action=gateway_pb2.CardAction(
                    action_id="invoke", args={str(i): "v" for i in range(33)}
                )
            ),
            "event.data nests deeper than 16 levels": gateway_pb2.ConnectRequest(
                event=gateway_pb2.GameEvent(
                    player_id=STEVE, event_type="minecraft:x", event_key="k", data=struct(deep(20))
                )
            ),
        }
        for message, frame in cases.items():
            error = await refusal(frame)
            assert error.message == message
            assert len(error.request_id) <= 64
        # Unknown players and ids are echoed at most 64 characters long.
        error = await refusal(
            gateway_pb2.ConnectRequest(
                request=gateway_pb2.PlayerRequest(
                    request_id="r2", player_id=huge, chat=gateway_pb2.Chat(text="help")
                )
            )
        )
        assert error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert len(error.message) < 200 and "x" * 64 + "…" in error.message
        assert (await client.chat(STEVE, "help")).reply.result.status == SUCCEEDED


async def test_busy_is_decided_before_routing(tmp_path: Any) -> None:
    async with servers_chain(tmp_path) as chain:
        client = await connect(chain, "a")
        await client.join(STEVE, "Steve")
        client.hold.add(STEVE)
        running = asyncio.ensure_future(client.chat(STEVE, "/inventory"))
        await asyncio.wait_for(client.held.wait(), 10)
        routed = route_calls()
        for text in ("help", "/history", "背包"):
            busy = await client.chat(STEVE, text)
            assert busy.reply.result.failure.key == "system.error.busy"
        assert route_calls() == routed  # none of them reached the router
        state = await client.control(STEVE, gateway_pb2.CONTROL_ACTION_STATE)
        assert state.state.busy  # controls still answer
        await client.control(STEVE, gateway_pb2.CONTROL_ACTION_CANCEL)
        await asyncio.wait_for(running, 10)


async def test_the_gateway_bounds_requests_in_progress_across_servers(tmp_path: Any) -> None:
    """Two game servers whose players' requests hang take the gateway-wide allowance; the next
    request, on either server, is refused at once; the gateway serves again once they end."""
    async with servers_chain(tmp_path, max_pending_requests_total=2) as chain:
        a, b = await connect(chain, "a"), await connect(chain, "b")
        await a.join(STEVE, "Steve")
        await b.join(ALEX, "Alex")
        a.hold.add(STEVE)
        b.hold.add(ALEX)
        held = [
            asyncio.ensure_future(a.chat(STEVE, "/inventory")),
            asyncio.ensure_future(b.chat(ALEX, "/inventory")),
        ]
        for client in (a, b):
            await asyncio.wait_for(client.held.wait(), 10)
        await b.join(STEVE, "Steve on b")
        with pytest.raises(FrameRefused) as refused:
            await b.chat(STEVE, "help", timeout=5)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "all its game servers" in refused.value.message
        await a.control(STEVE, gateway_pb2.CONTROL_ACTION_CANCEL)
        await b.control(ALEX, gateway_pb2.CONTROL_ACTION_CANCEL)
        await asyncio.wait_for(asyncio.gather(*held), 10)
        assert (await b.chat(STEVE, "help")).reply.result.status == SUCCEEDED


# -- a shared stream survives one undecodable message --------------------------------------------


def _field(number: int, payload: bytes) -> bytes:
    return _varint((number << 3) | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _deep_struct_bytes(levels: int) -> bytes:
    """A Struct nested `levels` deep, encoded by hand (protobuf refuses to build one)."""
    value = b"\x11" + b"\x00" * 8  # Value.number_value = 0
    struct_bytes = b""
    for _ in range(levels):
        struct_bytes = _field(1, _field(1, b"a") + _field(2, value))  # Struct.fields entry
        value = _field(5, struct_bytes)  # Value.struct_value
    return struct_bytes


async def test_an_undecodable_answer_fails_its_call_alone() -> None:
    """An answer's response travels as bytes in the envelope, so one the client cannot decode
    (nested deeper than protobuf decodes) fails its call alone, INTERNAL; the message and the
    stream's other answers are read as usual."""
    tool_result = _field(1, b"c") + _field(2, _deep_struct_bytes(40))
    deep = _field(1, tool_result)  # CallGameToolResponse.result
    with pytest.raises(Exception):  # noqa: B017 - what protobuf raises
        relay_pb2.CallGameToolResponse.FromString(deep)

    class Answering:
        """A stream call answering call 1 with a notice's response and call 2 with `deep`."""

        def __init__(self) -> None:
            self._out: asyncio.Queue[Any] = asyncio.Queue()
            self._calls = 0

        async def write(self, message: relay_pb2.MultiplexCallsRequest) -> None:
            self._calls += len(message.calls)
            if self._calls == 2:
                self._out.put_nowait(
                    relay_pb2.MultiplexCallsResponse(
                        answers=[
                            stream_pb2.StreamedAnswer(
                                call_id=1,
                                response=relay_pb2.NotifyPlayerResponse().SerializeToString(),
                            ),
                            stream_pb2.StreamedAnswer(call_id=2, response=deep),
                        ]
                    )
                )

        async def read(self) -> Any:
            return await self._out.get()

        def cancel(self) -> None:
            self._out.put_nowait(grpc.aio.EOF)

    stream = Answering()
    client = MultiplexClient(lambda: stream, RELAY_SERVICE)
    try:
        notified, called = await asyncio.gather(
            client.call("NotifyPlayer", relay_pb2.NotifyPlayerRequest(), 5),
            client.call("CallGameTool", relay_pb2.CallGameToolRequest(), 5),
            return_exceptions=True,
        )
    finally:
        await client.aclose()
    assert notified == relay_pb2.NotifyPlayerResponse()
    assert isinstance(called, grpc.aio.AioRpcError)
    assert called.code() == grpc.StatusCode.INTERNAL
    assert (called.details() or "").startswith("the answer could not be decoded")
    assert client.streams_opened == 1


async def test_an_undecodable_call_leaves_the_relay_stream_up(tmp_path: Any) -> None:
    """A call whose request cannot be decoded (nested deeper than protobuf decodes) is refused
    alone, INVALID_ARGUMENT; a message whose envelope itself is corrupt goes unanswered; the
    calls around both are answered and the stream ends OK."""
    async with servers_chain(tmp_path) as chain:
        a = await connect(chain, "a")
        await a.join(STEVE, "Steve")
        channel = grpc.aio.insecure_channel(inprocess.internal_target(chain.apps["gateway"].host))
        try:
            raw = channel.stream_stream(
                "/system.relay.v1.ToolRelayService/MultiplexCalls",
                request_serializer=lambda b: b,
                response_deserializer=relay_pb2.MultiplexCallsResponse.FromString,
            )
            call = raw(timeout=10)

            def notify(call_id: int) -> bytes:
                request = relay_pb2.NotifyPlayerRequest(
                    player_id=scoped(STEVE, "a"),
                    result=common_pb2.AgentResult(status=SUCCEEDED, text="hi"),
                )
                return relay_pb2.MultiplexCallsRequest(
                    calls=[
                        stream_pb2.StreamedCall(
                            call_id=call_id,
                            timeout_ms=5000,
                            method="NotifyPlayer",
                            request=request.SerializeToString(),
                        )
                    ]
                ).SerializeToString()

            await call.write(notify(1))
            deep_request = _field(4, _deep_struct_bytes(40))  # CallGameToolRequest.input
            await call.write(
                relay_pb2.MultiplexCallsRequest(
                    calls=[
                        stream_pb2.StreamedCall(
                            call_id=2, method="CallGameTool", request=deep_request
                        )
                    ]
                ).SerializeToString()
            )
            await call.write(_field(1, b"\x08"))  # a call cut short: the envelope is corrupt
            await call.write(notify(3))
            await call.done_writing()
            answered = {a.call_id: a async for response in call for a in response.answers}
            assert sorted(answered) == [1, 2, 3]
            assert answered[1].WhichOneof("outcome") == answered[3].WhichOneof("outcome")
            assert answered[3].WhichOneof("outcome") == "response"
            assert answered[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert answered[2].error.message.startswith(
                "the request of CallGameTool could not be decoded"
            )
            assert await call.code() == grpc.StatusCode.OK
        finally:
            await channel.close()


# -- logs stay bounded -----------------------------------------------------------------------------


def test_repeated_lines_are_summarised(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    lines = RepeatedLines(logging.getLogger("test.repeated"), interval=10, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.repeated"):
        logged = [lines.log(logging.INFO, "busy", "busy %d", i) for i in range(1000)]
        assert logged.count(True) == 1
        now[0] += 10
        assert lines.log(logging.INFO, "busy", "busy again")
        assert lines.log(logging.INFO, "refused", "another kind")
    assert [(r.getMessage(), r.repeated) for r in caplog.records] == [  # type: ignore[attr-defined]
        ("busy 0", 0),
        ("busy again", 999),
        ("another kind", 0),
    ]


def test_a_log_line_is_bounded() -> None:
    record = logging.LogRecord("x", logging.WARNING, "", 0, "id %s", ("y" * 100_000,), None)
    record.player = "z" * 100_000
    line = JsonFormatter("gateway").format(record)
    assert len(line) < 10_000
    entry = json.loads(line)
    assert entry["msg"].endswith("…") and entry["player"].endswith("…")


async def test_a_flood_of_refused_frames_logs_a_few_lines(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with servers_chain(tmp_path) as chain:
        client = await connect(chain, "a")
        await client.join(STEVE, "Steve")
        with caplog.at_level(logging.INFO, logger="system.gateway"):
            for _ in range(300):
                await client.send(gateway_pb2.ConnectRequest())
            await client.control(STEVE, gateway_pb2.CONTROL_ACTION_STATE)
        assert len(client.frame_errors) == 300
        refused = [r for r in caplog.records if r.getMessage().startswith("frame refused")]
        assert len(refused) == 1
