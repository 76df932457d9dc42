"""Extended mode and each mode's budgets end to end (issue 18): gateway, router, engine, model
gateway and storage, each a real gRPC server, with the project's OpenAI-compatible test server
as the model.

Extended mode routes locally only at the stricter `freeChat` score (a text that standard mode
routes to the inventory asks the router's model first), and talks with the player's read-only
tools, in zh and en. Each mode's budget is what the run gets: the same model, scripted to keep
calling tools, gets one call and no tools in standard mode, two loop rounds plus one composing
call in extended mode, three plus one in free mode, and a per-module override in the engine's
configuration narrows a mode's budget further. Counted in the model's requests, never in time.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

from services.model_testserver import FakeOpenAIServer
from tests.inprocess import running_chain
from tests.test_conversation_modes import _offered, _routes_nowhere

SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
STANDARD = common_pb2.CONVERSATION_MODE_STANDARD
EXTENDED = common_pb2.CONVERSATION_MODE_EXTENDED
FREE = common_pb2.CONVERSATION_MODE_FREE
READS = ("minecraft_inventory_read", "minecraft_player_profile")
WRITES = {"minecraft_shop_buy", "minecraft_mail_claim", "minecraft_pay", "minecraft_give"}


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key="budgets-test-key") as server:
        yield server


def _keeps_calling_tools(fake: FakeOpenAIServer, calls: int) -> None:
    """`calls` tool calls in turn (inventory, profile, ...), each its own completion."""
    for n in range(calls):
        call = {
            "id": f"call-{n}-{time.monotonic_ns()}",
            "function": {"name": READS[n % 2], "arguments": "{}"},
        }
        fake.script(content="", finish_reason="tool_calls", tool_calls=[call])


async def _set_mode(client: Any, player: str, mode: int) -> None:
    state = (await client.request(player, preferences=gateway_pb2.Preferences(mode=mode))).state
    assert state.mode == mode


async def test_extended_mode_asks_the_model_below_free_chat_and_uses_read_only_tools(
    tmp_path: pathlib.Path, fake: FakeOpenAIServer
) -> None:
    async with running_chain(tmp_path, model=fake) as chain:
        client = await chain.steve_and_alex()
        client.world.inventory("alex")["minecraft:diamond"] = 3
        client.world.inventory("steve")["minecraft:emerald"] = 5
        cases = (
            ("alex", "what's in my inventory right now", "You have 3 diamonds [1].", "English"),
            ("steve", "看看我的背包里有啥", "你有 5 颗绿宝石 [1]。", "Simplified Chinese"),
        )
        for player, text, answer, language in cases:
            # Standard mode: a confident local match, no model at all.
            local = (await client.chat(player, text)).reply
            assert local.module_id == "system:inventory" and fake.completions == []

            await _set_mode(client, player, EXTENDED)
            _routes_nowhere(fake)
            _keeps_calling_tools(fake, 1)
            fake.script(
                content="",
                finish_reason="tool_calls",
                tool_calls=[
                    {
                        "id": f"answer-{player}",
                        "function": {
                            "name": "answer",
                            "arguments": json.dumps({"answer": answer, "sources": [1]}),
                        },
                    }
                ],
            )
            reply = (await client.chat(player, text)).reply
            assert reply.module_id == "system:chat", reply
            assert reply.result.status == SUCCEEDED
            assert reply.result.card.lines[0].text == answer
            routing, looking, answering = fake.completions
            # Below freeChat (0.95) the router asks its model rather than routing locally.
            assert "catalogue" in routing.json["messages"][1]["content"]
            offered = _offered(looking)
            assert set(READS) <= offered and "answer" in offered and not offered & WRITES
            assert f"Answer in {language}" in looking.json["messages"][0]["content"]
            assert looking.json["messages"][-1]["content"].endswith(text)
            assert _offered(answering) == offered
            fake.reset()
            await _set_mode(client, player, STANDARD)


@pytest.mark.parametrize(
    ("mode", "engine_settings", "loop_calls"),
    [
        (EXTENDED, {}, 2),  # rounds 2, model calls 3: two rounds, then one to compose
        (FREE, {}, 3),  # rounds 3, model calls 4
        # The engine's configuration narrows a mode: two model calls in all, one round.
        (EXTENDED, {"module_policies": ["system:chat@model_calls=2"]}, 1),
    ],
    ids=["extended", "free", "extended-with-override"],
)
async def test_each_mode_stops_a_tool_hungry_model_at_its_own_budget(
    tmp_path: pathlib.Path,
    fake: FakeOpenAIServer,
    mode: int,
    engine_settings: dict[str, Any],
    loop_calls: int,
) -> None:
    async with running_chain(tmp_path, model=fake, engine_settings=engine_settings) as chain:
        client = await chain.steve_and_alex()
        await _set_mode(client, "alex", mode)
        if mode != FREE:
            _routes_nowhere(fake)  # free mode skips routing
        _keeps_calling_tools(fake, 6)  # more than any mode allows
        reply = (await client.chat("alex", "tell me everything about me")).reply
        assert reply.module_id == "system:chat"
        chatting = fake.completions[0 if mode == FREE else 1 :]
        # Each loop round ran its tool; then the budget's last model call composed, offered
        # no tools; the model was never asked again.
        assert [bool(_offered(r)) for r in chatting] == [True] * loop_calls + [False]
        assert "material" in chatting[-1].json["messages"][-1]["content"]
        assert fake.pending == 6 - loop_calls - 1  # the rest of the script was never asked for
        result = reply.result
        # The composing call got a tool call back rather than an answer: nothing composed,
        # the observations are shown as looked up.
        assert result.status == SUCCEEDED, result
        observed = [line.text for line in result.card.lines if line.text.startswith("[")]
        assert len(observed) == loop_calls

        # Standard mode for the same player and the same model: one call, no tools at all.
        fake.reset()
        await _set_mode(client, "alex", STANDARD)
        _routes_nowhere(fake)
        fake.script("I can only chat in this mode; /help lists what I can do.")
        _keeps_calling_tools(fake, 1)  # never asked for
        short = (await client.chat("alex", "tell me everything about me")).reply
        assert short.module_id == "system:chat" and short.result.status == SUCCEEDED
        assert short.result.card.lines[0].text.startswith("I can only chat")
        routing, answering = fake.completions
        assert _offered(answering) == set() and fake.pending == 1
