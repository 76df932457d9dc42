"""Payments (转账): the game tool `minecraft:economy.transfer` in the simulated world; the
modules `system:pay` (the confirmation card) and `system:pay_confirm` (a structured press of
its confirm button only); and a payment end to end through the gateway in Chinese and
English: confirm pressed twice pays once, a newer card makes the older stale, an unknown
player, not enough money, paying oneself, and typed text never confirming."""

from __future__ import annotations

import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from system.common.v1 import catalog_pb2, common_pb2
from system.gateway.v1 import gateway_pb2

from engine_service.app import build_registry
from engine_service.config import EngineConfig
from engine_service.modules.pay import OFFER_CARD, parse_payment
from engine_service.tools import BUILTIN_GAME_TOOLS
from services.gamesim.world import STARTING_BALANCE, World
from tests.gametools import call_tool
from tests.inprocess import Chain, card_lines, running_chain

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
FAILED = common_pb2.RESULT_STATUS_FAILED
TRANSFER = "minecraft:economy.transfer"
SPEC = {spec.tool_id: spec for spec in BUILTIN_GAME_TOOLS}[TRANSFER]


def _pay(world: World, data: dict[str, Any], player: str = "steve") -> Any:
    return call_tool(world, TRANSFER, data, player)


def _world() -> World:
    world = World()
    world.join("steve", "Steve")
    world.join("alex", "Alex")
    return world


# -- the simulated world -----------------------------------------------------------------------


def test_a_payment_moves_money_once_per_order() -> None:
    world = _world()
    paid = _pay(world, {"order_id": "p1", "to": "alex", "amount": 150})
    assert (paid["outcome"], paid["to"], paid["balance"], paid["replayed"]) == (
        "transferred",
        "Alex",
        STARTING_BALANCE - 150,
        False,
    )
    assert paid["recipient_online"] is True
    again = _pay(world, {"order_id": "p1", "to": "alex", "amount": 150})
    assert again["replayed"] is True and again["outcome"] == "transferred"
    assert world.player("steve").balance == STARTING_BALANCE - 150
    assert world.player("alex").balance == STARTING_BALANCE + 150


def test_refused_payments_move_nothing() -> None:
    world = _world()
    for data, outcome in (
        ({"order_id": "a", "to": "Notch", "amount": 1}, "unknown_player"),
        ({"order_id": "b", "to": "Steve", "amount": 1}, "self_payment"),
        ({"order_id": "c", "to": "Alex", "amount": STARTING_BALANCE + 1}, "insufficient_balance"),
    ):
        assert _pay(world, data)["outcome"] == outcome
    assert world.player("steve").balance == world.player("alex").balance == STARTING_BALANCE
    for bad in (
        {"order_id": "d", "to": "Alex"},
        {"order_id": "d", "to": "Alex", "amount": 0},
        {"order_id": "d", "to": "Alex", "amount": 1.5},
        {"order_id": "", "to": "Alex", "amount": 1},
        {"order_id": "d", "to": "", "amount": 1},
        {"order_id": "d", "to": "Alex", "amount": 1, "x": 1},
    ):
        with pytest.raises(ValueError):
            world.call("steve", TRANSFER, bad)


def test_the_written_forms_of_a_payment() -> None:
    assert parse_payment("Alex 100") == ("Alex", 100)
    assert parse_payment("给 Alex 转账 100") == ("Alex", 100)
    assert parse_payment("Alex 100 金币") == ("Alex", 100)
    assert parse_payment("100 coins to Alex") == ("Alex", 100)
    assert parse_payment("100 金币给 Alex") == ("Alex", 100)
    # A negative amount is an amount, so the player reads the range.
    assert parse_payment("Alex -5") == ("Alex", -5)
    assert parse_payment("-5 coins to Alex") == ("Alex", -5)
    assert parse_payment("Alex") is None
    assert parse_payment("a lot to Alex") is None


def test_the_registrations_match_the_corpus() -> None:
    registry = build_registry(EngineConfig())
    pay = registry.descriptor("system:pay")
    assert pay.routing_mode == catalog_pb2.ROUTING_MODE_HINTS and pay.write_steps == 1
    corpus = json.loads((ROOT / "router_service/corpus/profiles.json").read_text("utf-8"))
    profile = {m["id"]: m for m in corpus["modules"]}["system:pay"]
    assert {e.language: list(e.examples) for e in pay.semantic.examples} == profile["examples"]
    assert profile["direct"] is False and profile["writeSteps"] == 1
    confirm = registry.descriptor("system:pay_confirm")
    assert confirm.routing_mode == catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY
    assert not confirm.commands and not confirm.HasField("semantic")
    assert not SPEC.read_only and SPEC.idempotent and not SPEC.event_allowed


# -- end to end through the gateway ----------------------------------------------------------------


@pytest.fixture
async def chain(tmp_path: pathlib.Path) -> AsyncIterator[Chain]:
    async with running_chain(tmp_path) as running:
        yield running


def _labels(response: gateway_pb2.PlayerResponse) -> list[str]:
    return [b.label for b in response.reply.result.card.buttons]


async def test_a_payment_confirmed_twice_pays_once(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    world = client.world
    offered = await client.chat("steve", "/pay Alex 120")
    assert offered.reply.module_id == "system:pay"
    card = offered.reply.result.card
    assert card.title == "确认转账" and card.ref.card_id == OFFER_CARD
    assert card_lines(offered) == [
        "收款人：Alex",
        "金额：120 金币",
        "余额 1000，转账后 880 金币",
        "5 分钟内有效；请按“确认转账”按钮。",
    ]
    confirm = card.buttons[0]
    assert confirm.args["press_only"] == "true"
    for text in ("确认转账", "确认", "1", "confirm payment"):
        typed = await client.chat("steve", text)
        assert typed.reply.module_id != "system:pay_confirm", text
    assert world.player("steve").balance == STARTING_BALANCE
    first = await client.press("steve", card, confirm)
    assert first.reply.result.status == SUCCEEDED, first.reply.result.failure
    assert card_lines(first)[:2] == ["已向 Alex 转账 120 金币", "余额：880 金币"]
    second = await client.press("steve", card, confirm)
    assert card_lines(second)[-1] == "这笔转账之前已经完成，这次没有再扣款。"
    assert world.player("steve").balance == STARTING_BALANCE - 120
    assert world.player("alex").balance == STARTING_BALANCE + 120
    english = await client.chat("alex", "/pay 50 coins to Steve")
    assert card_lines(english)[:2] == ["To: Steve", "Amount: 50 coins"]
    # As the shop's quote says it: whole minutes in minutes.
    assert card_lines(english)[-1] == "This holds for 5 minutes; press “Confirm payment”."
    paid = await client.press(
        "alex", english.reply.result.card, english.reply.result.card.buttons[0]
    )
    assert paid.reply.result.card.title == "Payment sent"
    assert world.player("steve").balance == STARTING_BALANCE - 120 + 50


async def test_help_shows_how_to_pay_and_no_button_only_module(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    lines = card_lines(await client.chat("alex", "/help"))
    assert any(line.startswith("/pay <player amount> — Pay another player") for line in lines)
    assert any(line.startswith("/buy <item [count]> — Buy from the shop") for line in lines)
    assert not any("confirm" in line.split(" — ")[0] for line in lines)


async def test_refusals_and_a_stale_card(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    world = client.world
    older = await client.chat("alex", "/pay Steve 10")
    newer = await client.chat("alex", "/pay Steve 20")
    stale = await client.press("alex", older.reply.result.card, older.reply.result.card.buttons[0])
    assert stale.reply.result.failure.key == "system.error.stale_card"
    assert stale.reply.result.failure.message.startswith("That card was updated (version 2")
    poor = await client.chat("alex", "/pay Steve 5000")
    # No balance "after paying" below zero: the refusal says the balance.
    assert card_lines(poor) == [
        "To: Steve",
        "Amount: 5000 coins",
        "You cannot pay this: It takes 5000 coins and your balance is 1000.",
    ]
    assert _labels(poor) == []
    self_paid = await client.chat("alex", "/pay Alex 5")
    assert card_lines(self_paid)[-1] == "You cannot pay this: You cannot pay yourself."
    # A name no player has is refused before any card to confirm (minecraft:player.find).
    nobody = (await client.chat("alex", "/pay Notch 5")).reply.result
    assert (nobody.failure.key, nobody.failure.message, list(nobody.card.buttons)) == (
        "system.error.not_found",
        "There is no player called Notch on this server; check the name.",
        [],
    )
    # The name as the game spells it is the one on the card.
    assert card_lines(await client.chat("alex", "/pay steve 1"))[0] == "To: Steve"
    unclear = await client.chat("alex", "/pay Steve")
    assert unclear.reply.result.status == FAILED
    assert unclear.reply.result.failure.key == "system.error.invalid_input"
    # An amount out of range says the range, not how to write a payment.
    too_much = await client.chat("alex", "/pay Steve 99999999999")
    assert too_much.reply.result.failure.message == (
        "The amount must be from 1 to 1,000,000,000, for example: /pay Alex 100"
    )
    for amount in ("0", "-5"):
        nothing = await client.chat("alex", f"/pay Steve {amount}")
        assert nothing.reply.result.failure.key == "system.error.invalid_input"
        assert "from 1 to" in nothing.reply.result.failure.message
    done = await client.press("alex", newer.reply.result.card, newer.reply.result.card.buttons[0])
    # The newer card was replaced by a later one too (the refused and unclear cards made none
    # but `/pay steve 1` did): it is stale now, and nothing moved.
    assert done.reply.result.failure.key == "system.error.stale_card"
    assert world.player("alex").balance == STARTING_BALANCE
    assert world.player("steve").balance == STARTING_BALANCE


async def test_a_recipient_gone_by_the_confirm_is_refused_then(chain: Chain) -> None:
    """The name is checked again when the payment is made (a player renamed meanwhile, or a
    game server without minecraft:player.find)."""
    client = await chain.steve_and_alex()
    quoted = (await client.chat("alex", "/pay Steve 5")).reply.result.card
    client.world.player("steve").name = "Steve_"
    refused = (await client.press("alex", quoted, quoted.buttons[0])).reply.result
    assert (refused.failure.key, refused.failure.message) == (
        "system.error.not_found",
        "There is no player called Steve on this server. Nothing was paid.",
    )
    assert client.world.player("alex").balance == STARTING_BALANCE
