"""Conversation modes end to end (issue 18): gateway, router, engine, model gateway and storage,
each a real gRPC server, with the project's OpenAI-compatible test server as the model.

Standard mode answers text no module fits in a short conversation reply (one model call, no
tools); offline never calls a model; free mode converses at once and the model may call the
player's read-only tools and nothing else; the server's default applies until a player
chooses. In zh and en.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from system.common.v1 import catalog_pb2, common_pb2
from system.gateway.v1 import gateway_pb2

from engine_service.app import build_registry
from engine_service.config import EngineConfig
from services.gamesim.client import FrameRefused
from services.model_testserver import FakeOpenAIServer
from tests.inprocess import running_chain

ROOT = pathlib.Path(__file__).resolve().parent.parent

SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
OFFLINE = common_pb2.CONVERSATION_MODE_OFFLINE
STANDARD = common_pb2.CONVERSATION_MODE_STANDARD
FREE = common_pb2.CONVERSATION_MODE_FREE


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key="modes-test-key") as server:
        yield server


def _routes_nowhere(fake: FakeOpenAIServer) -> None:
    """The next completion is the router's: no module fits."""
    fake.script(json.dumps({"capabilityId": "clarify", "arguments": {}}))


def _tool_call(fake: FakeOpenAIServer, name: str, **arguments: Any) -> None:
    call = {
        "id": f"call-{time.monotonic_ns()}",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
    fake.script(content="", finish_reason="tool_calls", tool_calls=[call])


def _offered(request: Any) -> set[str]:
    return {tool["function"]["name"] for tool in request.json.get("tools", [])}


async def _set_mode(client: Any, player: str, mode: int) -> gateway_pb2.State:
    response = await client.request(player, preferences=gateway_pb2.Preferences(mode=mode))
    return response.state


async def test_standard_mode_answers_small_talk_in_a_short_reply(
    tmp_path: pathlib.Path, fake: FakeOpenAIServer
) -> None:
    async with running_chain(tmp_path, model=fake) as chain:
        client = await chain.steve_and_alex()
        _routes_nowhere(fake)
        fake.script("Why did the creeper cross the road? To get to the other sssside.")
        joke = (await client.chat("alex", "tell me a joke")).reply
        assert joke.module_id == "system:chat"
        assert joke.result.status == SUCCEEDED
        assert joke.result.card.template == "system:chat"
        assert joke.result.card.title == "Assistant"
        assert "creeper" in joke.result.card.speech  # voice clients speak the answer
        routing, chatting = fake.completions
        assert "catalogue" in routing.json["messages"][1]["content"]
        assert _offered(chatting) == set()  # standard mode: no tools
        assert chatting.json["messages"][-1]["content"] == "tell me a joke"

        _routes_nowhere(fake)
        fake.script("今天是个挖矿的好日子。")
        weather = (await client.chat("steve", "今天天气怎么样")).reply
        assert weather.result.card.title == "助手"
        assert weather.result.card.lines[0].text == "今天是个挖矿的好日子。"

        state = (await client.control("alex", gateway_pb2.CONTROL_ACTION_STATE)).state
        assert state.mode == STANDARD and state.mode_is_default

        # The asker's own words reach the router's model cleaned of formatting codes too.
        _routes_nowhere(fake)
        fake.script("Hi!")
        await client.chat("alex", "§chello §lthere\u200b")
        routed = json.loads(fake.completions[-2].json["messages"][1]["content"])
        assert routed["request"] == "hello there"


async def test_offline_mode_never_calls_a_model(
    tmp_path: pathlib.Path, fake: FakeOpenAIServer
) -> None:
    async with running_chain(tmp_path, model=fake) as chain:
        client = await chain.steve_and_alex()
        state = await _set_mode(client, "alex", OFFLINE)
        assert state.mode == OFFLINE and not state.mode_is_default
        joke = (await client.chat("alex", "tell me a joke")).reply.result
        assert joke.card.template in ("system:selection", "system:error")
        # Asked by name, the conversation module is refused rather than calling the model.
        chat = (await client.chat("alex", "/chat hello there")).reply.result
        assert chat.status != SUCCEEDED
        assert chat.failure.key == "system.error.model_unavailable"
        assert chat.failure.message.startswith("Offline mode makes no AI model calls")
        # Local routes and commands still work.
        shown = (await client.chat("alex", "check my inventory")).reply
        assert shown.module_id == "system:inventory" and shown.result.status == SUCCEEDED
        assert fake.completions == []

        # The choice is the player's: Steve still talks in the server's default (standard).
        _routes_nowhere(fake)
        fake.script("你好！")
        hello = (await client.chat("steve", "讲个笑话吧")).reply
        assert hello.module_id == "system:chat"
        # In offline mode he reads the refusal in Chinese.
        await _set_mode(client, "steve", OFFLINE)
        refused = (await client.chat("steve", "/chat 你好")).reply.result
        assert refused.failure.message == (
            "离线模式不调用 AI 模型：可以使用指令和按钮，或在 /settings 中换一种模式。"
        )
        await _set_mode(client, "steve", common_pb2.CONVERSATION_MODE_UNSPECIFIED)
        # And it is kept in storage: a new connection finds it again.
        again = await chain.client()
        await again.join("alex", "Alex", "en_us")
        state = (await again.control("alex", gateway_pb2.CONTROL_ACTION_STATE)).state
        assert state.mode == OFFLINE


async def test_free_mode_converses_with_read_only_tools_only(
    tmp_path: pathlib.Path, fake: FakeOpenAIServer
) -> None:
    async with running_chain(tmp_path, model=fake) as chain:
        client = await chain.steve_and_alex()
        assert (await _set_mode(client, "steve", FREE)).mode == FREE
        client.world.inventory("steve")["minecraft:diamond"] = 3
        _tool_call(fake, "minecraft_inventory_read")
        _tool_call(fake, "answer", answer="你有 3 颗钻石 [1]。", sources=[1])
        reply = (await client.chat("steve", "我的背包里有什么好东西")).reply
        assert reply.module_id == "system:chat"
        assert reply.result.status == SUCCEEDED
        assert reply.result.card.title == "助手"
        assert reply.result.card.lines[0].text == "你有 3 颗钻石 [1]。"
        first, second = fake.completions  # no routing call: free mode skips routing
        offered = _offered(first)
        assert "minecraft_inventory_read" in offered and "answer" in offered
        writes = {"minecraft_shop_buy", "minecraft_mail_claim", "minecraft_pay", "minecraft_give"}
        assert not offered & writes
        assert not any("buy" in name or "claim" in name for name in offered)
        # Exact commands still run without the model in free mode.
        helped = (await client.chat("steve", "/help")).reply
        assert helped.module_id == "system:help" and len(fake.completions) == 2

        # A model that asks for a tool it was not offered gets nothing run.
        fake.script(
            content="",
            finish_reason="tool_calls",
            tool_calls=[
                {
                    "id": "call-x",
                    "function": {"name": "minecraft_mail_claim", "arguments": "{}"},
                }
            ],
        )
        refused = (await client.chat("steve", "帮我把邮件都领了")).reply.result
        assert refused.status == common_pb2.RESULT_STATUS_FAILED
        assert refused.failure.key == "system.error.module_failed"
        assert len(fake.completions) == 3  # the loop stopped at the refused call


async def test_the_server_default_mode_applies_until_a_player_chooses(
    tmp_path: pathlib.Path, fake: FakeOpenAIServer
) -> None:
    async with running_chain(tmp_path, model=fake, conversation_mode="free") as chain:
        client = await chain.steve_and_alex()
        state = (await client.control("alex", gateway_pb2.CONTROL_ACTION_STATE)).state
        assert state.mode == FREE and state.mode_is_default
        fake.script("Hi Alex!")
        hi = (await client.chat("alex", "hello")).reply
        assert hi.module_id == "system:chat" and hi.result.card.lines[0].text == "Hi Alex!"
        assert len(fake.completions) == 1

        chosen = await _set_mode(client, "alex", STANDARD)
        assert chosen.mode == STANDARD and not chosen.mode_is_default
        back = await _set_mode(client, "alex", common_pb2.CONVERSATION_MODE_UNSPECIFIED)
        assert back.mode == FREE and back.mode_is_default

        with pytest.raises(FrameRefused) as refused:
            await client.request("alex", preferences=gateway_pb2.Preferences(mode=9))  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "preferences.mode" in refused.value.message


# -- /system settings ---------------------------------------------------------------------------


def _settings_button(card: common_pb2.Card, label: str) -> common_pb2.CardButton:
    return next(b for b in card.buttons if b.label == label)


async def test_settings_card_changes_mode_history_and_clears_memory(
    tmp_path: pathlib.Path, fake: FakeOpenAIServer
) -> None:
    async with running_chain(tmp_path, model=fake) as chain:
        client = await chain.steve_and_alex()
        shown = (await client.chat("alex", "/system settings")).reply.result.card
        assert shown.template == "system:settings" and shown.title == "Assistant settings"
        assert [line.text for line in shown.lines] == [
            "Conversation history: on",
            "External services (model, web): on",
            "Conversation mode: standard (the server's default)",
        ]
        free = await client.press("alex", shown, _settings_button(shown, "Switch to free mode"))
        updated = free.reply.result.card
        assert (updated.ref.card_id, updated.ref.version) == (shown.ref.card_id, 2)
        assert updated.lines[2].text == "Conversation mode: free"
        state = (await client.control("alex", gateway_pb2.CONTROL_ACTION_STATE)).state
        assert state.mode == FREE and not state.mode_is_default
        # The change is in force at once: text now goes to conversation.
        fake.script("Hello!")
        assert (await client.chat("alex", "hi there")).reply.module_id == "system:chat"

        off = await client.press("alex", updated, _settings_button(updated, "Turn history off"))
        card = off.reply.result.card
        assert card.ref.version == 3 and card.lines[0].text == "Conversation history: off"
        back = await client.press(
            "alex", card, _settings_button(card, "Follow the server's default mode")
        )
        card = back.reply.result.card
        assert card.lines[2].text == "Conversation mode: standard (the server's default)"
        # The older version's buttons are stale: nothing changes.
        stale = await client.press("alex", updated, _settings_button(updated, "Turn history off"))
        assert stale.reply.result.failure.key == "system.error.stale_card"

        on = await client.press("alex", card, _settings_button(card, "Turn history on"))
        card = on.reply.result.card
        assert (await client.chat("alex", "/help")).reply.result.status == SUCCEEDED
        before = await client.control("alex", gateway_pb2.CONTROL_ACTION_HISTORY)
        kept = len(before.history.entries)
        assert kept >= 2
        cleared = await client.press(
            "alex", card, _settings_button(card, "Clear conversation memory")
        )
        card = cleared.reply.result.card
        assert card.lines[-1].text == f"Cleared {kept} history entries."  # kept >= 2
        history = await client.control("alex", gateway_pb2.CONTROL_ACTION_HISTORY)
        # Only the press that cleared it remains, in the button's words, and the settings card
        # it showed.
        left = [(e.role, e.text.split("\n")[0]) for e in history.history.entries]
        assert left == [
            (common_pb2.HISTORY_ROLE_PLAYER, "[Clear conversation memory]"),
            (common_pb2.HISTORY_ROLE_ASSISTANT, "Assistant settings"),
        ]

        zh = (await client.chat("steve", "/设置")).reply.result.card
        assert zh.title == "助手设置"
        assert zh.lines[2].text == "对话模式：标准（服务器默认）"
        offline = await client.press("steve", zh, _settings_button(zh, "切换到离线模式"))
        assert offline.reply.result.card.lines[2].text == "对话模式：离线"


def test_the_settings_card_is_a_read_route_matching_the_corpus_profile() -> None:
    settings = build_registry(EngineConfig()).descriptor("system:settings")
    assert settings.routing_mode == catalog_pb2.ROUTING_MODE_READ
    assert settings.semantic.read_only_tools and settings.write_steps == 0
    corpus = json.loads((ROOT / "router_service/corpus/profiles.json").read_text("utf-8"))
    profile = next(m for m in corpus["modules"] if m["id"] == "system:settings")
    assert profile["kind"] == "read" and profile["direct"] is True
    assert {e.language: list(e.examples) for e in settings.semantic.examples} == (
        profile["examples"]
    )


async def test_plain_words_open_the_settings_card_without_a_model(tmp_path: pathlib.Path) -> None:
    async with running_chain(tmp_path) as chain:
        client = await chain.steve_and_alex()
        for player, text, title in (
            ("alex", "open settings", "Assistant settings"),
            ("alex", "what mode am i in", "Assistant settings"),
            ("steve", "打开设置", "助手设置"),
        ):
            reply = (await client.chat(player, text)).reply
            assert reply.module_id == "system:settings", text
            assert reply.result.card.title == title
        # Changing a setting stays a press of the card's button: typed, it opens nothing.
        typed = (await client.chat("alex", "turn my history off")).reply
        assert typed.module_id != "system:settings"


async def test_a_toggle_typed_at_the_settings_card_on_screen_is_pressed(
    tmp_path: pathlib.Path,
) -> None:
    """As `领取` typed at a mail presses its claim: the card updates in place, as a click
    updates it. Clearing the memory, which cannot be undone, only a click does; and with no
    card in view, or a toggle's number typed, nothing changes."""
    async with running_chain(tmp_path) as chain:
        client = await chain.steve_and_alex()
        shown = (await client.chat("alex", "/settings")).reply.result.card
        numbered = (await client.chat("alex", "3")).reply.result
        assert numbered.failure.message.startswith("Button 3 works only when pressed")
        blind = (await client.chat("alex", "Switch to offline mode")).reply
        assert blind.module_id != "system:settings"
        state = (await client.control("alex", gateway_pb2.CONTROL_ACTION_STATE)).state
        assert state.mode_is_default

        typed = (await client.chat("alex", "switch to offline mode", viewing=shown)).reply
        card = typed.result.card
        assert typed.module_id == "system:settings"
        assert (card.ref.card_id, card.ref.version) == (shown.ref.card_id, 2)
        assert card.lines[2].text == "Conversation mode: offline"
        state = (await client.control("alex", gateway_pb2.CONTROL_ACTION_STATE)).state
        assert state.mode == common_pb2.CONVERSATION_MODE_OFFLINE
        off = (await client.chat("alex", "turn history off please", viewing=card)).reply
        card = off.result.card
        assert card.lines[0].text == "Conversation history: off"
        # The older version on screen no more: typed at it, nothing is pressed.
        stale = (await client.chat("alex", "Turn history on", viewing=shown)).reply
        assert stale.module_id != "system:settings"

        kept = (await client.control("alex", gateway_pb2.CONTROL_ACTION_HISTORY)).history
        cleared = (await client.chat("alex", "Clear conversation memory", viewing=card)).reply
        assert cleared.module_id != "system:settings"
        after = (await client.control("alex", gateway_pb2.CONTROL_ACTION_HISTORY)).history
        assert len(after.entries) >= len(kept.entries)

        zh = (await client.chat("steve", "/设置")).reply.result.card
        pressed = (await client.chat("steve", "关闭外部服务", viewing=zh)).reply
        assert pressed.result.card.lines[1].text.endswith("关")
