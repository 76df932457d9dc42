"""The gateway on the real path, in-process: storage (SQLite), engine, router and gateway on
loopback, a simulated game server as the client. Every refusal is checked for its exact status
and message, and followed by proof that the connection (or another one) still serves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from system.relay.v1 import relay_pb2
from system.storage.v1 import storage_pb2

from services.gamesim.client import (
    CORE_WRITE_RACE,
    HELLO_RACE_ATTEMPTS,
    FrameRefused,
    GameServerClient,
    GatewayRefused,
)
from services.results import card, succeeded
from services.runtime.multiplex import MultiplexClient
from tests.inprocess import Chain, running_chain

STEVE = "00000000-0000-4000-8000-000000000001"
ALEX = "00000000-0000-4000-8000-000000000002"
MALLORY = "00000000-0000-4000-8000-000000000003"
GHOST = "00000000-0000-4000-8000-00000000dead"
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
RELAY_SERVICE = relay_pb2.DESCRIPTOR.services_by_name["ToolRelayService"]
FAILED = common_pb2.RESULT_STATUS_FAILED
HELP_FORMS = ("帮助", "help", "/help", "/HELP", "/system help")


@pytest.fixture
async def chain(tmp_path) -> AsyncIterator[Chain]:  # type: ignore[no-untyped-def]
    async with running_chain(tmp_path) as running:
        yield running


@pytest.fixture
async def client(chain: Chain) -> GameServerClient:
    """A connected game server with Steve (zh) and Alex (en) joined."""
    connected = await chain.client()
    await connected.join(STEVE, "Steve", "zh_cn")
    await connected.join(ALEX, "Alex", "en_us")
    return connected


def assert_help(response: gateway_pb2.PlayerResponse, title: str = "Assistant help") -> None:
    assert response.WhichOneof("body") == "reply", response
    reply = response.reply
    assert reply.module_id == "system:help"
    assert reply.result.status == SUCCEEDED
    card = reply.result.card
    assert card.template == "system:help"
    assert card.title == title
    assert {"/help", "/history"} <= {line.suggest_command for line in card.lines}


def assert_failed(
    response: gateway_pb2.PlayerResponse, key: str, message: str | None = None
) -> None:
    assert response.WhichOneof("body") == "reply", response
    result = response.reply.result
    assert result.status == FAILED
    assert result.failure.key == key
    if message is not None:
        assert result.failure.message == message
    assert result.card.template == "system:error"


async def serves(client: GameServerClient, player: str = ALEX) -> None:
    """Proof that the connection still serves: a help request is answered correctly."""
    assert_help(await client.chat(player, "help", timeout=10))


async def refused_frame(client: GameServerClient, **body: object) -> FrameRefused:
    with pytest.raises(FrameRefused) as caught:
        await client.request(ALEX if "player" not in body else body.pop("player"), 10, **body)  # type: ignore[arg-type]
    return caught.value


async def next_error(
    client: GameServerClient, frame: gateway_pb2.ConnectRequest
) -> gateway_pb2.FrameError:
    """Sends a frame that carries no request id; a STATE request behind it acts as a barrier
    (frames are handled in order), so its FrameError has arrived once the state has."""
    before = len(client.frame_errors)
    await client.send(frame)
    state = await client.control(ALEX, gateway_pb2.CONTROL_ACTION_STATE)
    assert state.WhichOneof("body") == "state"
    assert len(client.frame_errors) == before + 1, client.frame_errors[before:]
    return client.frame_errors[before]


def scoped(player: str, server: str = "sim") -> str:
    """The id other services know a game server's player by (decision 0012)."""
    return f"{server}/{player}"


async def history(chain: Chain, player: str, server: str = "sim") -> list[common_pb2.HistoryEntry]:
    """The player's stored history with every exchange already answered in it (the engine
    writes each just after its reply; settling waits for that, as the gateway's controls do)."""
    assert await chain.apps["engine"].engine.settle_history(scoped(player, server))
    page = await chain.storage_stub().ListHistory(
        storage_pb2.ListHistoryRequest(player_id=scoped(player, server), page_size=100), timeout=5
    )
    return list(page.entries)


async def raw_stream(
    chain: Chain,
    frames: Sequence[gateway_pb2.ConnectRequest],
    metadata: tuple[tuple[str, str], ...],
) -> tuple[grpc.StatusCode, str]:
    """Opens Connect with a plain stub, sends `frames` and returns how the stream ended. A
    write that races the gateway's refusal makes grpc report its own INTERNAL instead of the
    gateway's status (`CORE_WRITE_RACE`): the stream is opened again, as a plugin would."""
    stub = gateway_pb2_grpc.GameGatewayServiceStub(chain.channel("gateway"))
    for _ in range(HELLO_RACE_ATTEMPTS):
        call = stub.Connect(metadata=metadata, timeout=5)
        for frame in frames:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await call.write(frame)
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for _ in call:
                pass
        code, details = await call.code(), await call.details()
        if (code, details) != (grpc.StatusCode.INTERNAL, CORE_WRITE_RACE):
            break
    return code, details


def hello(server_id: str = "sim", version: int = 1) -> gateway_pb2.ConnectRequest:
    return gateway_pb2.ConnectRequest(
        hello=gateway_pb2.Hello(server_id=server_id, protocol_version=version)
    )


# -- the happy path ------------------------------------------------------------------------


async def test_welcome_says_what_the_gateway_speaks(chain: Chain) -> None:
    connected = await chain.client()
    assert connected.welcome is not None
    assert connected.welcome.protocol_version == 1
    assert connected.welcome.max_text_chars == 240
    assert len(connected.welcome.session_id) == 32


async def test_help_in_every_form_and_history_records_it(
    chain: Chain, client: GameServerClient
) -> None:
    for text in HELP_FORMS:
        response = await client.chat(STEVE, text)
        assert response.player_id == STEVE
        assert_help(response, "助手帮助")
    assert_help(await client.chat(ALEX, "help"), "Assistant help")

    stored = await history(chain, STEVE)
    assert [e.text for e in stored if e.role == common_pb2.HISTORY_ROLE_PLAYER] == list(HELP_FORMS)
    assistant = [e for e in stored if e.role == common_pb2.HISTORY_ROLE_ASSISTANT]
    assert len(assistant) == len(HELP_FORMS)
    assert all(e.result.card.template == "system:help" for e in assistant)

    response = await client.chat(STEVE, "/history")
    assert response.reply.module_id == "system:history"
    card = response.reply.result.card
    assert card.title == "最近的对话"
    texts = [line.text for line in card.lines]
    assert "你: 帮助" in texts and "你: /system help" in texts and "助手: 助手帮助" in texts


async def test_help_card_history_button_runs_history(client: GameServerClient) -> None:
    shown = await client.chat(ALEX, "help")
    card = shown.reply.result.card
    [button] = [b for b in card.buttons if b.label == "/history"]
    pressed = await client.press(ALEX, card, button)
    assert pressed.reply.module_id == "system:history"
    assert pressed.reply.result.status == SUCCEEDED
    texts = [line.text for line in pressed.reply.result.card.lines]
    assert texts[:2] == ["You: help", "Assistant: Assistant help"]


async def test_card_actions_are_checked_against_the_card_they_came_from(
    client: GameServerClient,
) -> None:
    # A card this connection never sent: nothing runs.
    response = await client.request(
        ALEX,
        card_action=gateway_pb2.CardAction(
            source=common_pb2.CardRef(card_id="forged", version=1),
            action_id="invoke",
            args={"module_id": "system:help"},
        ),
    )
    assert_failed(response, "system.error.stale_card")
    assert response.reply.result.failure.message == (
        "That card is no longer active (too old, or not one sent to you); ask again."
    )
    assert dict(response.reply.result.failure.args) == {"card_id": "forged", "version": "1"}

    shown = (await client.chat(ALEX, "help")).reply.result.card
    [button] = [b for b in shown.buttons if b.label == "/history"]
    # A button the card did not carry (another module, or other input) is refused...
    for action_id, args in (
        ("invoke", {**button.args, "module_id": "system:mail_claim"}),
        ("invoke", {**button.args, "input": '{"page_size": 5}'}),
        ("explode", dict(button.args)),
    ):
        response = await client.request(
            ALEX,
            card_action=gateway_pb2.CardAction(source=shown.ref, action_id=action_id, args=args),
        )
        assert_failed(response, "system.error.stale_card")
        assert response.reply.result.failure.message == (
            "That button is not on the card; use the card's own buttons."
        )
    # ...and so is a version that is not the one on screen.
    newer = common_pb2.CardRef(card_id=shown.ref.card_id, version=shown.ref.version + 1)
    response = await client.request(
        ALEX,
        card_action=gateway_pb2.CardAction(
            source=newer, action_id=button.action_id, args=button.args
        ),
    )
    assert_failed(response, "system.error.stale_card")
    # The card's own button runs, as often as the card is on screen.
    for _ in range(2):
        pressed = await client.press(ALEX, shown, button)
        assert pressed.reply.module_id == "system:history"
    await serves(client)


async def test_history_controls_right_after_a_reply_see_its_exchange(
    chain: Chain, client: GameServerClient
) -> None:
    """The engine writes an exchange just after its reply; HISTORY and CLEAR_HISTORY first
    have the engine settle the player's history, so neither misses the exchange just shown.
    Each history write is made 100 ms slow here, so a control that did not wait would."""
    store = chain.apps["engine"].engine.history
    write = store.append_history

    async def slow_write(player_id: str, entries: list[common_pb2.HistoryEntry]) -> None:
        await asyncio.sleep(0.1)
        await write(player_id, entries)

    store.append_history = slow_write
    for round_ in range(3):
        assert_help(await client.chat(STEVE, "help"), "助手帮助")
        shown = await client.control(STEVE, gateway_pb2.CONTROL_ACTION_HISTORY)
        assert [e.text for e in shown.history.entries][-2] == "help", round_
        assert_help(await client.chat(STEVE, "help"), "助手帮助")
        await client.control(STEVE, gateway_pb2.CONTROL_ACTION_CLEAR_HISTORY)
        assert await history(chain, STEVE) == [], round_  # nothing landed after the clear


async def test_controls_and_preferences(chain: Chain, client: GameServerClient) -> None:
    state = await client.control(ALEX, gateway_pb2.CONTROL_ACTION_STATE)
    assert state.state == gateway_pb2.State(
        busy=False,
        history_enabled=True,
        external_enabled=True,
        mode=common_pb2.CONVERSATION_MODE_STANDARD,
        mode_is_default=True,
    )

    await serves(client)
    page = await client.control(ALEX, gateway_pb2.CONTROL_ACTION_HISTORY)
    entries = page.history.entries
    assert [(e.role, e.text) for e in entries][0] == (common_pb2.HISTORY_ROLE_PLAYER, "help")
    assert entries[1].role == common_pb2.HISTORY_ROLE_ASSISTANT
    assert entries[1].result.card.template == "system:help"
    assert len(entries) == 2

    cleared = await client.control(ALEX, gateway_pb2.CONTROL_ACTION_CLEAR_HISTORY)
    assert cleared.notice.result.status == SUCCEEDED
    assert cleared.notice.result.text == "Conversation history cleared (2 entries)."
    assert not (await client.control(ALEX, gateway_pb2.CONTROL_ACTION_HISTORY)).history.entries

    # History off: later exchanges are answered but not recorded.
    off = await client.request(ALEX, preferences=gateway_pb2.Preferences(history=False))
    assert off.state == gateway_pb2.State(
        history_enabled=False,
        external_enabled=True,
        mode=common_pb2.CONVERSATION_MODE_STANDARD,
        mode_is_default=True,
    )
    await serves(client)
    assert_help(await client.chat(ALEX, "/help"))
    assert not (await client.control(ALEX, gateway_pb2.CONTROL_ACTION_HISTORY)).history.entries
    assert await history(chain, ALEX) == []
    state = await client.control(ALEX, gateway_pb2.CONTROL_ACTION_STATE)
    assert not state.state.history_enabled

    # Unset fields stay as they were.
    external = await client.request(ALEX, preferences=gateway_pb2.Preferences(external=False))
    assert external.state == gateway_pb2.State(
        history_enabled=False,
        external_enabled=False,
        mode=common_pb2.CONVERSATION_MODE_STANDARD,
        mode_is_default=True,
    )
    unchanged = await client.request(ALEX, preferences=gateway_pb2.Preferences())
    assert unchanged.state == external.state

    on = await client.request(ALEX, preferences=gateway_pb2.Preferences(history=True))
    assert on.state.history_enabled
    await serves(client)
    assert len(await history(chain, ALEX)) == 2

    cancel = await client.control(ALEX, gateway_pb2.CONTROL_ACTION_CANCEL)
    assert cancel.WhichOneof("body") == "state"
    assert not cancel.state.busy

    cleared = await client.control(STEVE, gateway_pb2.CONTROL_ACTION_CLEAR_HISTORY)
    assert cleared.notice.result.text == "对话记录已清空（0 条）。"


async def test_language_update_changes_the_answers(client: GameServerClient) -> None:
    await client.update(ALEX, "zh_cn")
    assert_help(await client.chat(ALEX, "help"), "助手帮助")
    await client.update(ALEX, "fr_fr")  # unknown languages fall back to English
    assert_help(await client.chat(ALEX, "help"))


async def test_concurrent_requests_and_tool_calls_on_one_connection(
    chain: Chain, client: GameServerClient
) -> None:
    """Many requests in flight at once, and tool results written back meanwhile."""
    relay = chain.relay_stub()
    chats = [client.chat(player, "help") for player in (STEVE, ALEX) * 10]
    tools = [
        relay.CallGameTool(_tool_request("minecraft:inventory.read", call_id=f"c{i}"), timeout=5)
        for i in range(5)
    ]
    answers = await asyncio.gather(*chats, *tools)
    for response in answers[: len(chats)]:
        assert response.reply.module_id == "system:help"
        assert response.reply.result.status == SUCCEEDED
    assert all(a.result.WhichOneof("outcome") == "output" for a in answers[len(chats) :])


async def test_concurrent_first_preferences_of_a_player(client: GameServerClient) -> None:
    for index in range(20):
        player = f"{GHOST[:-4]}{index:04d}"
        await client.join(player, "Fresh")
        answers = await asyncio.gather(
            *(
                client.request(player, preferences=gateway_pb2.Preferences(history=bool(k % 2)))
                for k in range(4)
            )
        )
        for answer in answers:
            assert answer.WhichOneof("body") == "state", answer


# -- refused connections -------------------------------------------------------------------


async def test_missing_or_wrong_token_is_unauthenticated(chain: Chain) -> None:
    code, details = await raw_stream(chain, [hello()], metadata=())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert details == "send the server's token as `authorization: Bearer <token>` metadata"

    code, details = await raw_stream(chain, [hello()], metadata=(("authorization", "Basic abc"),))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert details == "send the server's token as `authorization: Bearer <token>` metadata"

    with pytest.raises(GatewayRefused) as caught:
        await chain.client(token="not-the-token")
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.details == "the token is not valid for any game server"

    good = await chain.client()
    await good.join(ALEX, "Alex")
    await serves(good)


async def test_hello_for_another_server_is_unauthenticated(chain: Chain) -> None:
    with pytest.raises(GatewayRefused) as caught:
        await chain.client(server_id="other")
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.details == "the token was issued for server 'sim', not 'other'"
    good = await chain.client()
    await good.join(ALEX, "Alex")
    await serves(good)


async def test_first_frame_must_be_a_hello(chain: Chain) -> None:
    presence = gateway_pb2.ConnectRequest(
        presence=gateway_pb2.PlayerPresence(kind=gateway_pb2.PRESENCE_KIND_JOIN, player_id=ALEX)
    )
    for first in (presence, gateway_pb2.ConnectRequest()):
        code, details = await raw_stream(chain, [first], chain.auth())
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details == "the first frame of a connection must be a hello"
    code, details = await raw_stream(chain, [hello(server_id="")], chain.auth())
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "hello.server_id is required")
    good = await chain.client()
    await good.join(ALEX, "Alex")
    await serves(good)


async def test_malformed_hello_tools_are_invalid_argument(chain: Chain) -> None:
    bad = hello()
    bad.hello.tools.add(name="no namespace")
    code, details = await raw_stream(chain, [bad], chain.auth())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "hello.tools[0].name 'no namespace' is not of the form namespace:path"
    # A schema that is not JSON refuses that tool alone (a ToolProblem in the Welcome):
    # tests/test_tool_contract.py.
    good = await chain.client()
    await good.join(ALEX, "Alex")
    await serves(good)


async def test_other_protocol_version_is_failed_precondition(chain: Chain) -> None:
    code, details = await raw_stream(chain, [hello(version=2)], chain.auth())
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details == (
        "this gateway speaks protocol version 1; the hello asked for 2. "
        "Update the plugin or the gateway so both speak 1"
    )
    good = await chain.client()
    await good.join(ALEX, "Alex")
    await serves(good)


async def test_undecodable_bytes_end_or_refuse_the_frame(chain: Chain) -> None:
    method = "/system.gateway.v1.GameGatewayService/Connect"
    raw = chain.channel("gateway").stream_stream(
        method,
        request_serializer=lambda b: b,
        response_deserializer=gateway_pb2.ConnectResponse.FromString,
    )
    call = raw(metadata=chain.auth(), timeout=5)
    await call.write(b"\xff\xff\xff")
    with contextlib.suppress(grpc.aio.AioRpcError):
        await call.read()
    assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be decoded" in await call.details()

    call = raw(metadata=chain.auth(), timeout=5)
    await call.write(hello().SerializeToString())
    assert (await call.read()).WhichOneof("frame") == "welcome"
    await call.write(b"\x1a\x05ab")  # truncated request
    error = await call.read()
    assert error.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert error.error.message == (
        "a frame could not be decoded as a ConnectRequest (corrupt or truncated protobuf)"
    )
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    good = await chain.client()
    await good.join(ALEX, "Alex")
    await serves(good)


# -- refused frames on an open connection ----------------------------------------------------


async def test_refused_frames_keep_the_connection_and_write_nothing(
    chain: Chain, client: GameServerClient
) -> None:
    await client.join(MALLORY, "Mallory")
    limit = client.welcome.max_text_chars  # type: ignore[union-attr]

    error = await next_error(client, hello())
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert error.message == "this connection already sent its hello"

    error = await next_error(client, gateway_pb2.ConnectRequest())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert error.message.startswith("empty or unknown frame type")

    refused = await refused_frame(client, player=MALLORY)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.message == (
        "the request has no body; set one of chat, invoke, control, preferences, card_action"
    )
    assert refused.error.request_id  # correlated with the request

    refused = await refused_frame(
        client, player=MALLORY, chat=gateway_pb2.Chat(text="x" * (limit + 1))
    )
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.message == f"chat.text has {limit + 1} characters; the limit is {limit}"

    for empty in ("", "   \n\t"):
        refused = await refused_frame(client, player=MALLORY, chat=gateway_pb2.Chat(text=empty))
        assert (refused.code, refused.message) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "chat.text is empty",
        )

    refused = await refused_frame(client, player=MALLORY, invoke=gateway_pb2.Invoke())
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.message == "invoke.call.module_id is required"

    refused = await refused_frame(client, player=MALLORY, control=gateway_pb2.Control(action=99))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.message == "control.action must be STATE, CANCEL, HISTORY or CLEAR_HISTORY"

    refused = await refused_frame(client, player=GHOST, chat=gateway_pb2.Chat(text="help"))
    assert refused.code == grpc.StatusCode.NOT_FOUND
    assert refused.message == (
        f"player {GHOST!r} has not joined on this connection; send a JOIN presence first"
    )

    leave = gateway_pb2.ConnectRequest(
        presence=gateway_pb2.PlayerPresence(kind=gateway_pb2.PRESENCE_KIND_LEAVE, player_id=GHOST)
    )
    error = await next_error(client, leave)
    assert error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert error.message == f"player {GHOST} has not joined on this connection"

    update = gateway_pb2.ConnectRequest(
        presence=gateway_pb2.PlayerPresence(kind=gateway_pb2.PRESENCE_KIND_UPDATE, player_id=GHOST)
    )
    error = await next_error(client, update)
    assert error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert error.message == f"player {GHOST} has not joined; send JOIN before UPDATE"

    admin = gateway_pb2.ConnectRequest(
        presence=gateway_pb2.PlayerPresence(
            kind=gateway_pb2.PRESENCE_KIND_JOIN, player_id=GHOST, permission_level=9
        )
    )
    error = await next_error(client, admin)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert error.message == "presence.permission_level must be 0..4"
    refused = await refused_frame(client, player=GHOST, chat=gateway_pb2.Chat(text="help"))
    assert refused.code == grpc.StatusCode.NOT_FOUND  # the refused join did not join

    unknown_kind = gateway_pb2.ConnectRequest(
        presence=gateway_pb2.PlayerPresence(kind=7, player_id=GHOST)
    )
    error = await next_error(client, unknown_kind)
    assert error.message == "presence.kind must be JOIN, LEAVE or UPDATE"

    stray = gateway_pb2.ConnectRequest(tool_result=gateway_pb2.ToolResult(call_id="zzz"))
    error = await next_error(client, stray)
    assert error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert error.message == "no game-tool call 'zzz' is waiting (late or unknown)"

    bad_id = gateway_pb2.ConnectRequest(
        request=gateway_pb2.PlayerRequest(
            request_id="x" * 65, player_id=MALLORY, chat=gateway_pb2.Chat(text="help")
        )
    )
    error = await next_error(client, bad_id)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert error.message == "request.request_id must be at most 64 printable characters"
    assert error.request_id == "x" * 64

    # Refused frames wrote nothing; the connection serves every player as before.
    assert await history(chain, MALLORY) == []
    assert await history(chain, GHOST) == []
    await serves(client, MALLORY)
    assert len(await history(chain, MALLORY)) == 2
    assert_help(await client.chat(STEVE, "帮助"), "助手帮助")


async def test_answers_a_player_can_act_on(chain: Chain, client: GameServerClient) -> None:
    await client.join(MALLORY, "Mallory")
    response = await client.chat(MALLORY, "/nonsense")
    assert_failed(
        response,
        "system.error.unknown_command",
        "/nonsense is not a command; /help lists the commands",
    )
    assert response.reply.module_id == ""

    response = await client.chat(MALLORY, "/history extra")
    assert_failed(
        response, "system.error.invalid_input", "/history takes no argument; write /history"
    )

    response = await client.request(
        MALLORY, invoke=gateway_pb2.Invoke(call=common_pb2.ModuleAction(module_id="nope:nothing"))
    )
    assert_failed(
        response, "system.error.not_found", "no module 'nope:nothing' is registered; see /help"
    )

    data = struct_pb2.Struct()
    data.update({"colour": "red"})
    response = await client.request(
        MALLORY,
        invoke=gateway_pb2.Invoke(
            call=common_pb2.ModuleAction(module_id="system:help", input=data)
        ),
    )
    assert_failed(response, "system.error.invalid_input")
    assert "colour" in response.reply.result.failure.message

    # Low confidence and no model: a selection card of read-only choices, nothing executed.
    response = await client.chat(MALLORY, "tell me a joke")
    card = response.reply.result.card
    assert card.template == "system:selection"
    assert card.buttons and all(b.action_id == "invoke" for b in card.buttons)
    # Where none fits, the card says how to see everything (a click suggests /help).
    assert [(line.text, line.suggest_command) for line in card.lines] == [
        ("None of these? Type /help to see everything I can do.", "/help")
    ]
    assert {b.args["module_id"] for b in card.buttons} <= {
        "system:help",
        "system:history",
        "system:inventory",
        "system:profile",
        "system:settings",
    }
    # Labelled in the player's words (their module's description), not with module ids.
    labels = {
        "system:help": "List the commands and features you can use",
        "system:history": "Show your recent conversation",
        "system:inventory": "Show the items in your inventory",
        "system:profile": "Show your profile",
        "system:settings": "See and change your assistant settings",
    }
    assert [b.label for b in card.buttons] == [labels[b.args["module_id"]] for b in card.buttons]
    # A text most like a change (a purchase) gets no button for it, but its command, written
    # for the player (a click suggests `/buy `); a text like none of them no such line.
    bought = (await client.chat(MALLORY, "i want to buy 3 bread")).reply.result.card
    assert bought.template == "system:selection"
    assert [(line.text, line.suggest_command) for line in bought.lines][0] == (
        "Buy from the shop: type /buy <item [count]>",
        "/buy ",
    )
    assert "system:shop_buy" not in {b.args["module_id"] for b in bought.buttons}
    # The command typed without its slash: suggested with what the text gave filled in.
    for text, line in (
        ("buy 3 bread", "Buy from the shop: type /buy 3 bread"),
        ("buy 1 diamond", "Buy from the shop: type /buy 1 diamond"),
        ("转账 alex 50", "Pay another player: type /pay alex 50"),
        ("买两个面包", "Buy from the shop: type /buy 两个面包"),
    ):
        filled = (await client.chat(MALLORY, text)).reply.result.card
        assert (filled.lines[0].text, filled.lines[0].suggest_command) == (
            line,
            line.split("type ", 1)[1],
        ), text
    # A reference is no argument to write out: the usage instead.
    referred = (await client.chat(MALLORY, "buy it")).reply.result.card
    assert (referred.lines[0].text, referred.lines[0].suggest_command) == (
        "Buy from the shop: type /buy <item [count]>",
        "/buy ",
    )
    # An English sentence that only begins with a command's name is not that command.
    attention = (await client.chat(MALLORY, "pay attention to me")).reply.result.card
    assert [line.suggest_command for line in attention.lines] == ["/help"]
    # Where changes tie (`buy`, `pay` and `sign in` are all write words), the one whose
    # command the text names.
    named = (await client.chat(MALLORY, "i want to buy bread")).reply.result.card
    assert named.lines[0].text == "Buy from the shop: type /buy <item [count]>"

    assert await history(chain, MALLORY) == []  # none of these ran a module
    invoked = await client.request(
        MALLORY, invoke=gateway_pb2.Invoke(call=common_pb2.ModuleAction(module_id="system:help"))
    )
    assert_help(invoked)
    assert [e.text for e in await history(chain, MALLORY)][0] == "system:help"
    # A press is recorded in the button's words, bracketed: what the player clicked.
    help_button = next(b for b in card.buttons if b.args["module_id"] == "system:help")
    assert_help(await client.press(MALLORY, card, help_button))
    assert [e.text for e in await history(chain, MALLORY)][2] == (
        "[List the commands and features you can use]"
    )


async def test_leave_then_requests_are_not_found(client: GameServerClient) -> None:
    await client.leave(ALEX)
    with pytest.raises(FrameRefused) as caught:
        await client.chat(ALEX, "help")
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert_help(await client.chat(STEVE, "help"), "助手帮助")


# -- the tool relay -------------------------------------------------------------------------


def _tool_request(
    tool: str, player: str = STEVE, call_id: str = "c1", **data: object
) -> relay_pb2.CallGameToolRequest:
    request = relay_pb2.CallGameToolRequest(call_id=call_id, player_id=scoped(player), tool=tool)
    request.input.update(data)
    return request


async def test_tool_relay_reaches_the_game_server(chain: Chain, client: GameServerClient) -> None:
    relay = chain.relay_stub()
    answer = await relay.CallGameTool(_tool_request("minecraft:inventory.read"), timeout=5)
    assert answer.result.call_id == "c1"
    assert answer.result.WhichOneof("outcome") == "output"
    assert json_format.MessageToDict(answer.result.output) == {
        "items": [
            {"item": "minecraft:bread", "count": 12, "name": {"zh": "面包", "en": "Bread"}},
            {"item": "minecraft:torch", "count": 32, "name": {"zh": "火把", "en": "Torch"}},
        ]
    }

    given = await relay.CallGameTool(
        _tool_request("minecraft:item.give", call_id="c2", item="minecraft:diamond", count=3),
        timeout=5,
    )
    assert json_format.MessageToDict(given.result.output) == {
        "item": "minecraft:diamond",
        "count": 3,
    }
    bad = await relay.CallGameTool(_tool_request("minecraft:item.give", call_id="c3"), timeout=5)
    assert bad.result.failure.key == "system.error.invalid_input"

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await relay.CallGameTool(_tool_request("minecraft:nope"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == "game server sim does not offer tool minecraft:nope"

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await relay.CallGameTool(_tool_request("minecraft:inventory.read", player=GHOST), timeout=5)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details() == f"player sim/{GHOST} is not connected"

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await relay.CallGameTool(_tool_request("minecraft:inventory.read", call_id=""), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "call_id is required"

    await serves(client)
    await client.leave(STEVE)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await relay.CallGameTool(_tool_request("minecraft:inventory.read"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_tool_relay_stream_answers_as_the_unary_relay(
    chain: Chain, client: GameServerClient
) -> None:
    """ToolRelayService.MultiplexCalls: the engine's game-tool calls on one stream."""
    relay = chain.relay_stub()
    calls = MultiplexClient(relay.MultiplexCalls, RELAY_SERVICE)
    try:
        read, given = await asyncio.gather(
            calls.call("CallGameTool", _tool_request("minecraft:inventory.read"), 5),
            calls.call(
                "CallGameTool",
                _tool_request(
                    "minecraft:item.give", call_id="c2", item="minecraft:diamond", count=3
                ),
                5,
            ),
        )
        assert read.result.call_id == "c1" and read.result.WhichOneof("outcome") == "output"
        assert json_format.MessageToDict(given.result.output) == {
            "item": "minecraft:diamond",
            "count": 3,
        }
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await calls.call("CallGameTool", _tool_request("minecraft:nope"), 5)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert caught.value.details() == "game server sim does not offer tool minecraft:nope"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await calls.call(
                "CallGameTool", _tool_request("minecraft:inventory.read", player=GHOST), 5
            )
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await calls.aclose()


async def test_notify_player_shows_a_notice_on_their_game_server(
    chain: Chain, client: GameServerClient
) -> None:
    """ToolRelayService.NotifyPlayer (how an event task's outcome reaches its player): an
    unsolicited notice on the player's connection, unary or on the relay stream."""
    relay = chain.relay_stub()
    reward = succeeded(card("system:reward", "Advancement reward", ["minecraft:diamond × 1"]))
    await relay.NotifyPlayer(
        relay_pb2.NotifyPlayerRequest(player_id=scoped(STEVE), result=reward), timeout=5
    )
    notice = await asyncio.wait_for(client.notices.get(), 5)
    assert (notice.player_id, notice.request_id) == (STEVE, "")
    assert notice.notice.result == reward

    calls = MultiplexClient(relay.MultiplexCalls, RELAY_SERVICE)
    try:
        await calls.call(
            "NotifyPlayer",
            relay_pb2.NotifyPlayerRequest(player_id=scoped(STEVE), result=reward),
            5,
        )
        again = (await asyncio.wait_for(client.notices.get(), 5)).notice.result
        # The same card sent again is its next version (the gateway numbers versions).
        assert again.card.ref.version == reward.card.ref.version + 1
        again.card.ref.version = reward.card.ref.version
        assert again == reward
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await calls.call(
                "NotifyPlayer",
                relay_pb2.NotifyPlayerRequest(player_id=scoped(GHOST), result=reward),
                5,
            )
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await calls.aclose()

    for bad, message in (
        (relay_pb2.NotifyPlayerRequest(result=reward), "player_id is required"),
        (
            relay_pb2.NotifyPlayerRequest(player_id=scoped(STEVE)),
            "result.status is required: say how the work ended",
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await relay.NotifyPlayer(bad, timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == message
    assert client.notices.empty()


# -- a dependency that cannot be reached ----------------------------------------------------


async def test_engine_down_answers_failed_and_the_connection_stays(
    chain: Chain, client: GameServerClient
) -> None:
    await serves(client)  # the router has read the catalogue
    await chain.stop("engine")
    response = await client.chat(ALEX, "help")
    assert_failed(
        response,
        "system.error.module_failed",
        "The assistant is unavailable right now; try again later.",
    )
    response = await client.request(
        ALEX, invoke=gateway_pb2.Invoke(call=common_pb2.ModuleAction(module_id="system:help"))
    )
    assert_failed(response, "system.error.module_failed")
    state = await client.control(ALEX, gateway_pb2.CONTROL_ACTION_STATE)  # storage still answers
    assert state.state.history_enabled
    assert await chain.health("gateway") == health_pb2.HealthCheckResponse.SERVING
