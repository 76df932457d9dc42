"""The server shop (商城): the game tools `minecraft:shop.list`, `minecraft:shop.item` and
`minecraft:shop.buy` in the simulated world; the modules `system:shop` (browse, search,
detail; read-only, routed locally), `system:shop_buy` (the quote) and `system:shop_confirm`
(the purchase, a structured press of the quote card's confirm button only); and the purchase
end to end through the gateway in Chinese and English: confirm pressed twice charges once, a
newer quote makes the older stale, insufficient balance, sold out and a changed price each
answer with their own failure card, and a purchase interrupted by restarting the engine or the
storage service is applied once."""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import AsyncIterator

import pytest
from system.common.v1 import catalog_pb2, common_pb2
from system.gateway.v1 import gateway_pb2

from engine_service.app import build_registry
from engine_service.config import EngineConfig
from engine_service.modules.shop import QUOTE_CARD, _split_count
from engine_service.schema import violation
from engine_service.tools import BUILTIN_GAME_TOOLS, SHOP_PAGE_LIMIT
from services.gamesim import shop
from services.gamesim.client import GameServerClient
from services.gamesim.world import STARTING_BALANCE, World
from services.runtime.config import ConfigError
from tests.gametools import call_tool
from tests.inprocess import Chain, card_lines, running_chain
from tests.waiting import wait_until

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
FAILED = common_pb2.RESULT_STATUS_FAILED
TOOLS = {spec.tool_id: spec for spec in BUILTIN_GAME_TOOLS}
LIST, ITEM, BUY = "minecraft:shop.list", "minecraft:shop.item", "minecraft:shop.buy"


# -- the simulated world -----------------------------------------------------------------------


def test_the_shop_lists_by_page_category_and_name_in_both_languages() -> None:
    world = World()
    first = call_tool(world, LIST, {})
    assert (first["total"], first["page"], first["page_size"]) == (16, 1, 5)
    assert [c["id"] for c in first["categories"]] == ["materials", "tools", "food", "misc"]
    assert first["listings"][0] == {
        "item": {"id": "minecraft:diamond", "name": {"zh": "钻石", "en": "Diamond"}},
        "price": 100,
        "stock": 64,
        "category": "materials",
    }
    food = call_tool(world, LIST, {"category": "food", "page_size": 10})
    assert [entry["item"]["id"] for entry in food["listings"]] == [
        "minecraft:bread",
        "minecraft:apple",
        "minecraft:cooked_beef",
        "minecraft:golden_apple",
    ]
    for query in ("钻石", "diamond", "DIAMOND", "minecraft:diamond"):
        names = [e["item"]["id"] for e in call_tool(world, LIST, {"query": query})["listings"]]
        assert "minecraft:diamond" in names, query
    assert call_tool(world, LIST, {"query": "剑"})["listings"][0]["item"]["id"] == (
        "minecraft:diamond_sword"
    )
    assert call_tool(world, LIST, {"query": "nothing like it"})["total"] == 0
    assert call_tool(world, LIST, {"page": 9})["listings"] == []
    assert call_tool(world, ITEM, {"item": "minecraft:bow"})["listing"]["price"] == 30
    assert call_tool(world, ITEM, {"item": "minecraft:dirt"}) == {
        "found": False,
        "currency": {"zh": "金币", "en": "coins"},
    }
    assert shop.PAGE_LIMIT == SHOP_PAGE_LIMIT


def test_a_purchase_debits_takes_stock_and_delivers_together_once_per_order() -> None:
    world = World()
    order = {"order_id": "o1", "item": "minecraft:diamond", "count": 3, "unit_price": 100}
    bought = call_tool(world, BUY, order)
    assert (bought["outcome"], bought["total"], bought["balance"], bought["stock"]) == (
        "purchased",
        300,
        STARTING_BALANCE - 300,
        61,
    )
    assert bought["replayed"] is False
    assert world.inventory("steve")["minecraft:diamond"] == 3
    again = call_tool(world, BUY, order)
    assert again["replayed"] is True and again["outcome"] == "purchased"
    assert world.player("steve").balance == STARTING_BALANCE - 300
    assert world.inventory("steve")["minecraft:diamond"] == 3
    assert world.shop.listings["minecraft:diamond"].stock == 61
    # One order id per player: Alex's o1 is another order.
    assert call_tool(world, BUY, order, "alex")["replayed"] is False


def test_refusals_change_nothing() -> None:
    world = World()
    state = world.player("steve")

    def buy(order_id: str, item: str, count: int, price: int) -> str:
        data = {"order_id": order_id, "item": item, "count": count, "unit_price": price}
        return call_tool(world, BUY, data)["outcome"]

    assert buy("a", "minecraft:diamond", 1, 90) == "price_changed"
    assert buy("b", "minecraft:diamond_pickaxe", 6, 400) == "sold_out"
    assert buy("c", "minecraft:diamond_sword", 4, 300) == "insufficient_balance"
    assert buy("d", "minecraft:dirt", 1, 1) == "not_for_sale"
    assert state.balance == STARTING_BALANCE
    assert world.shop.listings["minecraft:diamond_pickaxe"].stock == 5
    assert world.inventory("steve")["minecraft:diamond_sword"] == 0
    # A decided order id stays decided, even once it could succeed.
    assert buy("a", "minecraft:diamond", 1, 100) == "price_changed"


def test_the_tools_refuse_bad_input() -> None:
    world = World()
    for bad in ({"page": 0}, {"page_size": 11}, {"category": "weapons"}, {"x": 1}):
        with pytest.raises(ValueError):
            world.call("steve", LIST, bad)
    for bad in ({}, {"item": ""}, {"item": "x", "y": 1}):
        with pytest.raises(ValueError):
            world.call("steve", ITEM, bad)
    good = {"order_id": "o", "item": "minecraft:bread", "count": 1, "unit_price": 5}
    for change in (
        {"order_id": ""},
        {"count": 0},
        {"count": 65},
        {"count": 1.5},
        {"unit_price": -1},
    ):
        with pytest.raises(ValueError):
            world.call("steve", BUY, {**good, **change})
    assert world.player("steve").balance == STARTING_BALANCE


def test_the_hello_offers_the_shop_tools_as_the_catalogue_declares_them() -> None:
    offered = {t.name: t for t in World.tools()}
    for tool_id in (LIST, ITEM, BUY):
        spec, tool = TOOLS[tool_id], offered[tool_id]
        assert (tool.read_only, tool.idempotent, tool.event_allowed) == (
            spec.read_only,
            spec.idempotent,
            spec.event_allowed,
        )
        for name in ("input", "output"):
            example = getattr(spec, f"example_{name}")
            assert violation(json.loads(getattr(tool, f"{name}_schema")), example) is None
    assert TOOLS[LIST].read_only and TOOLS[ITEM].read_only
    assert not TOOLS[BUY].read_only and TOOLS[BUY].idempotent and not TOOLS[BUY].event_allowed


def test_a_count_may_follow_the_item() -> None:
    assert _split_count("钻石 3") == ("钻石", 3)
    assert _split_count("面包 10 个") == ("面包", 10)
    assert _split_count("diamond x3") == ("diamond", 3)
    assert _split_count("minecraft:diamond") == ("minecraft:diamond", None)
    assert _split_count("42") == ("42", None)
    # Before the item too, as players write it.
    assert _split_count("3 bread") == ("bread", 3)
    assert _split_count("x3 bread") == ("bread", 3)
    assert _split_count("3个面包") == ("面包", 3)
    assert _split_count("三个面包") == ("面包", 3)
    assert _split_count("两把钻石剑") == ("钻石剑", 2)
    assert _split_count("三叉戟") == ("三叉戟", None)  # the trident, not three of something
    # A count out of range stays a count, so the player reads the range.
    assert _split_count("bread -1") == ("bread", -1)
    assert _split_count("-3 bread") == ("bread", -3)
    assert _split_count("1000 bread") == ("bread", 1000)


# -- the registrations ---------------------------------------------------------------------------


def test_the_registrations_match_the_corpus_and_the_confirm_is_structured_only() -> None:
    registry = build_registry(EngineConfig())
    corpus = json.loads((ROOT / "router_service/corpus/profiles.json").read_text("utf-8"))
    profiles = {m["id"]: m for m in corpus["modules"]}
    browse = registry.descriptor("system:shop")
    assert browse.routing_mode == catalog_pb2.ROUTING_MODE_READ
    assert browse.semantic.read_only_tools and browse.write_steps == 0
    buy = registry.descriptor("system:shop_buy")
    assert buy.routing_mode == catalog_pb2.ROUTING_MODE_HINTS and buy.write_steps == 1
    for module_id, descriptor in (("system:shop", browse), ("system:shop_buy", buy)):
        profile = profiles[module_id]
        examples = {e.language: list(e.examples) for e in descriptor.semantic.examples}
        assert examples == profile["examples"], module_id
        assert profile["direct"] is (module_id == "system:shop")
        assert (descriptor.semantic.extractor or None) == profile["extractor"]
        assert profile.get("writeSteps", 0) == descriptor.write_steps
    confirm = registry.descriptor("system:shop_confirm")
    assert confirm.routing_mode == catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY
    assert not confirm.commands and not confirm.HasField("semantic")
    assert confirm.write_steps == 3 and "system:shop_confirm" not in profiles


# -- end to end through the gateway ----------------------------------------------------------------


@pytest.fixture
async def chain(tmp_path: pathlib.Path) -> AsyncIterator[Chain]:
    async with running_chain(tmp_path) as running:
        yield running


def _labels(response: gateway_pb2.PlayerResponse) -> list[str]:
    return [b.label for b in response.reply.result.card.buttons]


def _button(response: gateway_pb2.PlayerResponse, label: str) -> common_pb2.CardButton:
    return next(b for b in response.reply.result.card.buttons if b.label == label)


def _ok(response: gateway_pb2.PlayerResponse) -> common_pb2.AgentResult:
    result = response.reply.result
    assert result.status == SUCCEEDED, (result.failure, result.card.title)
    return result


async def test_browsing_searching_and_detail_in_chinese_and_english(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    for text in ("商城", "/shop", "打开商店", "看看商店有什么"):
        response = await client.chat("steve", text)
        assert response.reply.module_id == "system:shop", text
        assert _ok(response).card.title == "商城（第 1/4 页）"
    assert card_lines(response)[0] == "1. 钻石 — 100 金币（库存 64）"
    assert _labels(response)[-5:] == ["下一页", "材料", "工具与武器", "食物", "杂项"]
    food = await client.press("steve", response.reply.result.card, _button(response, "食物"))
    assert _ok(food).card.title == "商城 · 食物"
    assert card_lines(food)[0] == "1. 面包 — 5 金币（库存 200）"
    assert _labels(food)[-1] == "全部商品"
    searched = await client.chat("steve", "/shop 剑")
    assert _ok(searched).card.title == "钻石剑"  # one match: its detail
    assert card_lines(searched) == [
        "物品 ID：minecraft:diamond_sword",
        "单价：300 金币",
        "库存：5",
    ]
    assert _labels(searched) == ["购买 1 个", "物品来源", "返回商城"]  # stock 5: no 16
    english = await client.chat("alex", "open the shop")
    assert english.reply.module_id == "system:shop"
    assert _ok(english).card.title == "Shop (page 1 of 4)"
    assert card_lines(english)[0] == "1. Diamond — 100 coins (64 in stock)"
    assert card_lines(english)[4] == "5. Torch — 1 coin (1024 in stock)"  # not `1 coins`
    opened = await client.chat("alex", "/shop bread")
    assert _ok(opened).card.title == "Bread"
    assert _labels(opened) == ["Buy 1", "Buy 16", "Where it comes from", "Back to the shop"]
    # A category's name is its page, in either language (`/shop food`, `/shop 食物`).
    for player, text, title in (
        ("alex", "/shop food", "Shop · Food"),
        ("steve", "/shop 食物", "商城 · 食物"),
    ):
        category = await client.chat(player, text)
        assert _ok(category).card.title == title, text
    missing = await client.chat("alex", "/shop elytra")
    assert missing.reply.result.failure.key == "system.error.not_found"
    assert missing.reply.result.card.title == "Not for sale"


async def test_a_price_question_opens_the_items_listing(chain: Chain) -> None:
    """Routed locally (the router's `price` extractor passes the item as the search), no
    model call; an English plural that matches nothing is searched as its singular; a price
    question about the player's own money stays the profile's."""
    client = await chain.steve_and_alex()
    for text in ("钻石多少钱", "火把在商店卖多少钱", "金锭的价格是多少"):
        response = await client.chat("steve", text)
        assert response.reply.module_id == "system:shop", text
        assert card_lines(response)[1].startswith("单价："), text
    assert _ok(await client.chat("steve", "钻石多少钱")).card.title == "钻石"
    english = await client.chat("alex", "how much is a diamond in the shop")
    assert english.reply.module_id == "system:shop"
    assert _ok(english).card.title == "Diamond"
    assert card_lines(english)[1] == "Price: 100 coins each"
    plural = await client.chat("alex", "/shop diamonds")
    assert _ok(plural).card.title == "Diamond"
    money = await client.chat("steve", "我有多少钱")
    assert money.reply.module_id == "system:profile"


async def _quote(
    client: GameServerClient, player: str, text: str
) -> tuple[gateway_pb2.PlayerResponse, common_pb2.CardButton]:
    response = await client.chat(player, text)
    assert response.reply.module_id == "system:shop_buy", text
    result = _ok(response)
    confirm = result.card.buttons[0]
    assert confirm.args["module_id"] == "system:shop_confirm"
    assert confirm.args["press_only"] == "true"
    return response, confirm


async def test_a_quote_then_confirm_pressed_twice_charges_once(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    world = client.world
    quoted, confirm = await _quote(client, "steve", "/buy 钻石 3")
    card = quoted.reply.result.card
    assert card.title == "确认购买" and card.ref.card_id == QUOTE_CARD
    assert card_lines(quoted) == [
        "钻石 × 3",
        "单价 100，合计 300 金币",
        "余额 1000，购买后 700 金币",
        "库存：64",
        "报价 5 分钟内有效；请按“确认购买”按钮。",
    ]
    assert _labels(quoted) == ["确认购买", "返回商城"]
    assert world.player("steve").balance == STARTING_BALANCE  # a quote charges nothing
    first = await client.press("steve", card, confirm)
    assert first.reply.module_id == "system:shop_confirm"
    assert _ok(first).card.title == "购买成功"
    lines = card_lines(first)
    assert lines[:3] == ["钻石 × 3", "已支付 300 金币，余额 700", "物品已放入背包。"]
    assert lines[3].startswith("订单号：") and len(lines) == 4
    second = await client.press("steve", card, confirm)
    assert _ok(second).card.title == "购买成功"
    assert card_lines(second)[-1] == "这笔订单之前已经完成，这次没有再扣款。"
    assert world.player("steve").balance == 700
    assert world.inventory("steve")["minecraft:diamond"] == 3
    assert world.shop.listings["minecraft:diamond"].stock == 61
    # In English, from the detail card's Buy button.
    detail = await client.chat("alex", "/shop bread")
    quote = await client.press("alex", detail.reply.result.card, _button(detail, "Buy 16"))
    assert card_lines(quote)[:3] == [
        "Bread × 16",
        "5 each, 80 coins in all",
        "Balance 1000, 920 coins after buying",
    ]
    done = await client.press("alex", quote.reply.result.card, _button(quote, "Confirm purchase"))
    assert _ok(done).card.title == "Purchase complete"
    assert world.inventory("alex")["minecraft:bread"] == 12 + 16


async def test_a_command_with_a_number_is_the_command_not_a_pick_from_the_list(
    chain: Chain,
) -> None:
    client = await chain.steve_and_alex()
    listed = await client.chat("steve", "/shop")
    assert _labels(listed)[1] == "铁锭"
    quoted, _ = await _quote(client, "steve", "/buy 面包 2")  # not the list's second button
    assert card_lines(quoted)[0] == "面包 × 2"
    # A number alone still picks from the list, by the numbers the card shows: `2` is "back
    # to the shop"; `1` is the confirm, which only a press uses, so typing it says so and
    # runs nothing (it opened the shop, the first button a number could pick).
    pressed_only = await client.chat("steve", "查看 1")
    assert pressed_only.reply.module_id == ""
    assert pressed_only.reply.result.failure.message == (
        "第 1 个按钮需要点击才能生效，输入编号不会按下它。"
    )
    assert client.world.player("steve").balance == STARTING_BALANCE
    picked = await client.chat("steve", "查看 2")
    assert picked.reply.module_id == "system:shop"
    assert picked.reply.result.card.title == "商城（第 1/4 页）"


async def test_the_confirm_is_never_reached_by_typed_text_or_a_number(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    quoted, confirm = await _quote(client, "steve", "/buy minecraft:diamond")
    for text in ("确认购买", "确认", "1", "查看 1", "/shop_confirm", "confirm purchase"):
        response = await client.chat("steve", text)
        assert response.reply.module_id != "system:shop_confirm", text
    assert client.world.player("steve").balance == STARTING_BALANCE
    # A forged press of the confirm with another player's offer id is stale, not a purchase.
    stolen = await client.press("alex", quoted.reply.result.card, confirm)
    assert stolen.reply.result.failure.key == "system.error.stale_card"
    assert client.world.player("alex").balance == STARTING_BALANCE
    assert client.world.player("steve").balance == STARTING_BALANCE


async def test_buy_it_typed_at_an_items_card_quotes_one(chain: Chain) -> None:
    """The single purchase is the card's `buy` button: `buy it` / `买` typed at the item's card
    quote one (still confirmed by a press); the bulk one is pressed by its label alone."""
    client = await chain.steve_and_alex()
    item = (await client.chat("alex", "/shop minecraft:diamond")).reply.result.card
    assert [b.label_key for b in item.buttons] == ["buy", "", "", "back"]
    one = (await client.chat("alex", "buy it", viewing=item)).reply
    assert one.module_id == "system:shop_buy"
    assert one.result.card.lines[0].text == "Diamond × 1"
    bulk = await client.chat("alex", "buy 16", viewing=item)
    assert card_lines(bulk)[0] == "Diamond × 16"
    zh = (await client.chat("steve", "/shop 钻石")).reply.result.card
    bought = await client.chat("steve", "买", viewing=zh)
    assert card_lines(bought)[0] == "钻石 × 1"
    assert client.world.player("alex").balance == STARTING_BALANCE  # quotes charge nothing


async def test_a_newer_quote_makes_the_older_stale(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    older, older_confirm = await _quote(client, "steve", "/buy 面包 2")
    newer, newer_confirm = await _quote(client, "steve", "/buy 面包 4")
    assert newer.reply.result.card.ref.version > older.reply.result.card.ref.version
    stale = await client.press("steve", older.reply.result.card, older_confirm)
    result = stale.reply.result
    assert result.status == FAILED and result.failure.key == "system.error.stale_card"
    # The gateway refuses it: the quote card on screen is the newer version.
    assert result.failure.message.startswith("这张卡片已更新")
    assert client.world.player("steve").balance == STARTING_BALANCE
    done = await client.press("steve", newer.reply.result.card, newer_confirm)
    assert _ok(done).card.title == "购买成功"
    assert client.world.player("steve").balance == STARTING_BALANCE - 20


async def test_each_refusal_has_its_own_failure_card(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    world = client.world
    # Not enough money: the quote shows the price and why, without a confirm button.
    poor = await client.chat("steve", "/buy 钻石剑 4")
    assert _ok(poor).card.title == "确认购买"
    assert card_lines(poor)[-1] == "无法购买：需要 1200 金币，你的余额是 1000。没有扣款。"
    assert not any("购买后" in line for line in card_lines(poor))  # no balance below zero
    assert _labels(poor) == ["返回商城"]
    # A count before the item and an English plural read as the player meant them.
    plural = await client.chat("alex", "/buy 2 diamond swords")
    assert card_lines(plural)[0] == "Diamond Sword × 2"
    # More than one purchase may hold: each player reads the range in their language.
    for player, range_text in (
        ("steve", "一次可以买 1 到 64 个，不能买 100 个。"),
        ("alex", "Buy 1 to 64 at a time, not 100."),
    ):
        too_many = (await client.chat(player, "/buy diamond 100")).reply.result
        assert (too_many.failure.key, too_many.failure.message) == (
            "system.error.invalid_input",
            range_text,
        )
    # A count of 0 is out of range too, not a count left out (it quoted one).
    none = (await client.chat("alex", "/buy diamond 0")).reply.result
    assert none.failure.message == "Buy 1 to 64 at a time, not 0."
    # The balance drops between quote and confirm.
    quoted, confirm = await _quote(client, "steve", "/buy diamond 5")
    world.player("steve").balance = 100
    refused = await client.press("steve", quoted.reply.result.card, confirm)
    result = refused.reply.result
    assert result.failure.key == "system.error.insufficient_balance"
    assert result.card.title == "余额不足"
    assert result.failure.message == "需要 500 金币，你的余额是 100。没有扣款。"
    world.player("steve").balance = STARTING_BALANCE
    # Sold out meanwhile.
    quoted, confirm = await _quote(client, "alex", "/buy ender pearl 10")
    world.shop.listings["minecraft:ender_pearl"].stock = 3
    sold = await client.press("alex", quoted.reply.result.card, confirm)
    assert sold.reply.result.failure.key == "system.error.sold_out"
    assert sold.reply.result.failure.message == (
        "Only 3 Ender Pearl left, fewer than 10. Nothing was charged."
    )
    # The price changed: a new quote at the new price is one press away.
    quoted, confirm = await _quote(client, "alex", "/buy golden apple")
    world.shop.listings["minecraft:golden_apple"].price = 180
    changed = await client.press("alex", quoted.reply.result.card, confirm)
    assert changed.reply.result.failure.key == "system.error.price_changed", changed
    assert changed.reply.result.card.title == "The price changed"
    assert _labels(changed) == ["Quote at the new price", "Back to the shop"]
    requote = await client.press(
        "alex", changed.reply.result.card, _button(changed, "Quote at the new price")
    )
    assert card_lines(requote)[1] == "180 each, 180 coins in all"
    assert world.player("alex").balance == STARTING_BALANCE
    assert world.player("steve").balance == STARTING_BALANCE
    # The requote updated the quote card: a press of the old one is stale; nothing is charged.
    again = await client.press("alex", quoted.reply.result.card, confirm)
    assert again.reply.result.failure.key == "system.error.stale_card"
    assert world.player("alex").balance == STARTING_BALANCE


async def _press_until_answered(
    client: GameServerClient, card: common_pb2.Card, button: common_pb2.CardButton
) -> gateway_pb2.PlayerResponse:
    """Presses again while the restarted service is not reachable yet (as a player would)."""
    last: list[gateway_pb2.PlayerResponse] = []

    async def answered() -> gateway_pb2.PlayerResponse | None:
        response = await client.press("steve", card, button)
        last[:] = [response]
        key = response.reply.result.failure.key
        if key not in ("system.error.storage_unavailable", "system.error.busy") and (
            response.reply.module_id == "system:shop_confirm"
        ):
            return response
        return None

    return await wait_until(
        answered,
        timeout=15,
        interval=0.25,
        what=lambda: f"an answer from the restarted service, last: {last}",
    )


async def test_a_purchase_cut_off_by_an_engine_restart_is_applied_once(chain: Chain) -> None:
    client = await chain.cut_off_client()
    quoted, confirm = await _quote(client, "steve", "/buy 钻石 2")
    # The engine that asked never hears the answer.
    client.cut_off(BUY, lambda: chain.restart("engine"), drop=True)
    first = await client.press("steve", quoted.reply.result.card, confirm)
    assert first.reply.result.status != SUCCEEDED, first  # the engine went away mid-purchase
    assert client.world.player("steve").balance == STARTING_BALANCE - 200  # applied once
    again = await _press_until_answered(client, quoted.reply.result.card, confirm)
    assert _ok(again).card.title == "购买成功"
    assert card_lines(again)[-1] == "这笔订单之前已经完成，这次没有再扣款。"
    third = await client.press("steve", quoted.reply.result.card, confirm)
    assert _ok(third).card.title == "购买成功"
    assert client.world.player("steve").balance == STARTING_BALANCE - 200
    assert client.world.inventory("steve")["minecraft:diamond"] == 2


async def test_a_purchase_cut_off_by_a_storage_restart_is_applied_once(chain: Chain) -> None:
    client = await chain.cut_off_client()
    quoted, confirm = await _quote(client, "steve", "/buy 面包 10")
    client.cut_off(BUY, lambda: chain.restart("storage"), drop=False)
    first = await client.press("steve", quoted.reply.result.card, confirm)
    # The game server applied it; settling the order may not have reached storage.
    assert first.reply.result.card.title in ("购买成功", "结果未知")
    assert client.world.player("steve").balance == STARTING_BALANCE - 50
    again = await _press_until_answered(client, quoted.reply.result.card, confirm)
    assert _ok(again).card.title == "购买成功"
    assert card_lines(again)[-1] == "这笔订单之前已经完成，这次没有再扣款。"
    assert client.world.player("steve").balance == STARTING_BALANCE - 50
    assert client.world.inventory("steve")["minecraft:bread"] == 12 + 10


async def test_an_expired_quote_charges_nothing(tmp_path: pathlib.Path) -> None:
    async with running_chain(tmp_path, engine_settings={"offer_seconds": 1}) as chain:
        client = await chain.steve_and_alex()
        quoted, confirm = await _quote(client, "alex", "/buy bread 2")
        assert card_lines(quoted)[-1] == "This quote holds for 1 second; press “Confirm purchase”."
        await asyncio.sleep(1.2)
        late = await client.press("alex", quoted.reply.result.card, confirm)
        result = late.reply.result
        assert result.failure.key == "system.error.stale_card"
        assert result.failure.message == (
            "This quote has expired. Nothing was charged; ask for a new quote."
        )
        assert client.world.player("alex").balance == STARTING_BALANCE


async def test_without_storage_no_quote_is_made_and_nothing_is_charged(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    quoted, confirm = await _quote(client, "steve", "/buy 面包")
    await chain.stop("storage")
    # Without storage the engine cannot take the player's lease: the run never starts, and the
    # gateway says the assistant is unavailable.
    for response in (
        await client.chat("steve", "/buy 面包"),
        await client.press("steve", quoted.reply.result.card, confirm),
    ):
        assert response.reply.result.status == FAILED
        assert response.reply.result.failure.message == "助手暂时无法使用，请稍后再试。"
    assert client.world.player("steve").balance == STARTING_BALANCE
    assert client.world.inventory("steve")["minecraft:bread"] == 12


def test_the_offer_validity_is_checked_at_start() -> None:
    with pytest.raises(ConfigError, match="offer_seconds"):
        EngineConfig(offer_seconds=0).validate()


async def test_a_purchase_that_never_reached_the_game_server_says_nothing_happened(
    chain: Chain,
) -> None:
    """The engine cannot reach the gateway's relay at all (the call never left): not an
    unknown outcome but "not done yet", nothing charged, and the order still placed."""
    client = await chain.steve_and_alex()
    quoted, confirm = await _quote(client, "alex", "/buy diamond 1")
    await chain.apps["gateway"].host.server.stop(0)  # the relay port only
    pressed = await client.press("alex", quoted.reply.result.card, confirm)
    result = pressed.reply.result
    assert result.failure.key == "system.error.tool_unavailable", result
    assert result.card.title == "Not done yet"
    assert "so nothing happened" in card_lines(pressed)[0]
    assert client.world.player("alex").balance == STARTING_BALANCE
