"""`system:profile` (本人概况) and `system:item` (物品 ID 查询, 物品来源) over the game tools
`minecraft:player.profile` and `minecraft:item.lookup`: the simulated world's data and answers,
the modules' registrations, and each module end to end through the gateway (in-process chain)
in Chinese and in English, with unknown items and bad input."""

from __future__ import annotations

import json
import pathlib
from collections.abc import AsyncIterator

import pytest
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

from engine_service.app import build_registry
from engine_service.config import EngineConfig
from engine_service.modules.profile import play_time
from engine_service.modules.text import singular as _singular
from engine_service.schema import violation
from engine_service.tools import BUILTIN_GAME_TOOLS
from services.gamesim import items
from services.gamesim.world import STARTING_PLAY_SECONDS, World
from tests.inprocess import Chain, card_lines, running_chain

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
FAILED = common_pb2.RESULT_STATUS_FAILED
TOOLS = {spec.tool_id: spec for spec in BUILTIN_GAME_TOOLS}
LOOKUP = TOOLS["minecraft:item.lookup"]
PROFILE = TOOLS["minecraft:player.profile"]


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the simulated world -----------------------------------------------------------------------


def test_the_registry_is_complete_and_names_are_unambiguous() -> None:
    assert len(items.ITEMS) >= 30
    for item in items.ITEMS.values():
        referenced = [i for _, inputs in item.crafting for i, _ in inputs]
        referenced += [*item.smelting, *item.drops, *item.mining]
        for thing in referenced:
            name = items.name_of(thing)
            assert name["zh"] != thing and name["en"] != thing, (item.item_id, thing)
    for listing in items.SHOP:
        assert listing.item_id in items.ITEMS and listing.price >= 0 and listing.stock >= 0
    for language in ("zh", "en"):
        names = [getattr(item, language).casefold() for item in items.ITEMS.values()]
        assert len(names) == len(set(names)), f"{language} names repeat"


def test_every_lookup_answer_keeps_the_catalogue_schema() -> None:
    queries = [*items.ITEMS, "剑", "iron", "minecraft:diamnod", "没有这个", "a"]
    for query in queries:
        answer = items.lookup(query)
        found = violation(LOOKUP.output_schema, answer)
        assert found is None, (query, found and found.text())
    for item_id in items.ITEMS:
        answer = items.lookup(item_id)
        assert answer["exact"] and answer["total"] == 1 and answer["items"][0]["id"] == item_id


@pytest.mark.parametrize(
    "query", ["minecraft:diamond", "diamond", "Diamond", "ＤＩＡＭＯＮＤ", " 钻石 "]
)
def test_lookup_by_id_path_or_whole_name_is_exact(query: str) -> None:
    answer = items.lookup(query)
    assert answer["exact"] is True and answer["total"] == 1
    (diamond,) = answer["items"]
    assert diamond["id"] == "minecraft:diamond"
    assert diamond["name"] == {"zh": "钻石", "en": "Diamond"}
    sources = diamond["sources"]
    assert [b["block"]["id"] for b in sources["mining"]] == [
        "minecraft:diamond_ore",
        "minecraft:deepslate_diamond_ore",
    ]
    assert sources["crafting"][0]["inputs"][0]["id"] == "minecraft:diamond_block"
    assert sources["shop"] == [
        {"price": 100, "stock": 64, "currency": {"zh": "金币", "en": "coins"}}
    ]


def test_lookup_without_an_exact_match_lists_candidates() -> None:
    swords = items.lookup("剑")
    assert swords["exact"] is False and swords["total"] == 4
    assert [i["name"]["en"] for i in swords["items"]] == [
        "Wooden Sword",
        "Stone Sword",
        "Iron Sword",
        "Diamond Sword",
    ]
    assert items.lookup("iron")["total"] == 6
    # An id is exact or nothing: a misspelt one has no near misses.
    assert items.lookup("minecraft:diamnod") == {"exact": False, "total": 0, "items": []}


def test_lookup_caps_the_list_and_counts_all_matches() -> None:
    many = {
        f"minecraft:thing_{n}": items.Item(f"minecraft:thing_{n}", f"东西{n}", f"Thing {n}")
        for n in range(15)
    }
    answer = items.lookup("thing", many, ())
    assert answer["total"] == 15 and len(answer["items"]) == items.LOOKUP_LIMIT
    assert violation(LOOKUP.output_schema, answer) is None


def test_play_time_counts_only_while_online() -> None:
    clock = Clock()
    world = World(clock=clock)

    def played() -> int:
        answer = world.call("steve", "minecraft:player.profile", {})
        assert violation(PROFILE.output_schema, answer) is None
        return answer["play_seconds"] - STARTING_PLAY_SECONDS

    assert played() == 0
    world.join("steve")
    clock.now += 90
    assert played() == 90
    world.leave("steve")
    clock.now += 1000  # offline: not counted
    assert played() == 90
    world.join("steve")
    clock.now += 10.5
    assert played() == 100
    answer = world.call("steve", "minecraft:player.profile", {})
    assert (answer["balance"], answer["level"], answer["currency"]) == (
        1000,
        12,
        {"zh": "金币", "en": "coins"},
    )


def test_the_tools_refuse_bad_input() -> None:
    world = World()
    with pytest.raises(ValueError, match="takes no input"):
        world.call("steve", "minecraft:player.profile", {"who": "alex"})
    for bad in ({}, {"query": ""}, {"query": "   "}, {"query": 7}, {"query": "x" * 65}):
        with pytest.raises(ValueError, match="1 to 64 characters"):
            world.call("steve", "minecraft:item.lookup", bad)


def test_play_time_reads_in_the_players_language() -> None:
    assert play_time(0, "zh") == "0 分钟"
    assert play_time(19200, "zh") == "5 小时 20 分钟"
    assert play_time(2 * 86400 + 61, "en") == "2 d 0 h 1 min"
    assert play_time(59, "en") == "0 min"


# -- the registrations ---------------------------------------------------------------------------


def test_the_modules_are_read_only_local_routes_matching_the_corpus_profiles() -> None:
    registry = build_registry(EngineConfig())
    corpus = json.loads((ROOT / "router_service/corpus/profiles.json").read_text("utf-8"))
    profiles = {m["id"]: m for m in corpus["modules"]}
    for module_id, tool in (
        ("system:profile", "minecraft:player.profile"),
        ("system:item", "minecraft:item.lookup"),
    ):
        descriptor = registry.descriptor(module_id)
        assert descriptor.semantic.read_only_tools and descriptor.write_steps == 0
        assert registry.get(module_id).spec.tools == (tool,)  # type: ignore[union-attr]
        examples = {e.language: list(e.examples) for e in descriptor.semantic.examples}
        assert examples == profiles[module_id]["examples"], module_id
        assert (descriptor.semantic.extractor or None) == profiles[module_id]["extractor"]
        assert descriptor.semantic.choice_label == profiles[module_id]["choiceLabel"]
    aliases = [list(c.aliases) for c in registry.descriptor("system:item").commands]
    assert aliases == [["item", "物品", "查询物品"]]


# -- end to end through the gateway ----------------------------------------------------------------


@pytest.fixture
async def chain(tmp_path: pathlib.Path) -> AsyncIterator[Chain]:
    async with running_chain(tmp_path) as running:
        yield running


async def test_profile_in_chinese_and_english(chain: Chain) -> None:
    clock = Clock()
    client = await chain.steve_and_alex(World(clock=clock))
    clock.now += 3600 + 120  # Steve and Alex have been online an hour and two minutes
    for text in ("本人概况", "/profile", "我有多少金币"):
        response = await client.chat("steve", text)
        reply = response.reply
        assert reply.module_id == "system:profile", text
        assert reply.result.status == SUCCEEDED, reply.result.failure
        assert reply.result.card.title == "本人概况"
        assert card_lines(response) == [
            "余额：1000 金币",
            "等级：12",
            "游戏时长：6 小时 22 分钟",
            "本月还没有签到（输入 /signin 签到）",
        ]
    for text in ("show my profile", "/profile"):
        response = await client.chat("alex", text)
        assert response.reply.module_id == "system:profile", text
        assert response.reply.result.card.title == "My profile"
        assert card_lines(response) == [
            "Balance: 1000 coins",
            "Level: 12",
            "Play time: 6 h 22 min",
            "No sign-in this month yet (type /signin)",
        ]


async def test_item_lookup_in_chinese_and_english(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    for text in ("/item 钻石", "查询物品 minecraft:diamond", "/物品 minecraft:diamond"):
        response = await client.chat("steve", text)
        reply = response.reply
        assert reply.module_id == "system:item", text
        assert reply.result.status == SUCCEEDED, reply.result.failure
        assert reply.result.card.title == "物品：钻石"
        assert card_lines(response) == [
            "ID：minecraft:diamond",
            "英文名：Diamond",
            "来源：",
            "  合成：1 × 钻石块 → 9 个",
            "  挖掘：钻石矿石、深层钻石矿石",
            "  商店：100 金币（库存 64）",
        ]
    response = await client.chat("alex", "/item Iron Ingot")
    assert response.reply.result.card.title == "Item: Iron Ingot"
    assert card_lines(response) == [
        "ID: minecraft:iron_ingot",
        "Chinese name: 铁锭",
        "Where it comes from:",
        "  Crafting: 1 × Block of Iron → 9",
        "  Crafting: 9 × Iron Nugget → 1",
        "  Smelting: Raw Iron",
        "  Dropped by: Iron Golem, Zombie",
        "  Shop: 10 coins (256 in stock)",
    ]
    # A crafting line suggests looking its first ingredient up.
    assert response.reply.result.card.lines[3].suggest_command == "/item minecraft:iron_block"
    elytra = await client.chat("alex", "look up item minecraft:elytra")
    assert elytra.reply.module_id == "system:item"
    assert card_lines(elytra)[-1] == "  No known source."


async def test_a_question_about_making_or_getting_an_item_opens_its_card(chain: Chain) -> None:
    """Routed locally (the router's `item` extractor passes the name as `query`), no model
    call; an English plural that names nothing is looked up as its singular."""
    client = await chain.steve_and_alex()
    for text, title in (
        ("火把怎么合成", "物品：火把"),
        ("铁锭从哪里获得", "物品：铁锭"),
        ("钻石剑的合成配方", "物品：钻石剑"),
    ):
        response = await client.chat("steve", text)
        assert response.reply.module_id == "system:item", text
        assert response.reply.result.card.title == title, text
    assert "  合成：1 × 煤炭、1 × 木棍 → 4 个" in card_lines(
        await client.chat("steve", "火把怎么合成")
    )
    plural = await client.chat("alex", "where to find diamonds")
    assert plural.reply.module_id == "system:item"
    assert plural.reply.result.card.title == "Item: Diamond"
    assert card_lines(plural)[0] == "ID: minecraft:diamond"
    # Below the direct threshold the item lookup leads the card of choices, carrying the name
    # its extractor read, which its label shows: one press opens the item.
    choices = await client.chat("alex", "how do i craft a bow")
    card = choices.reply.result.card
    assert card.buttons[0].label == "Look up an item by id or name: bow", [
        b.label for b in card.buttons
    ]
    pressed = await client.press("alex", card, card.buttons[0])
    assert pressed.reply.module_id == "system:item"
    assert pressed.reply.result.card.title == "Item: Bow"


async def test_an_ambiguous_name_lists_candidates_as_buttons(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    response = await client.chat("steve", "/item 剑")
    result = response.reply.result
    assert result.status == SUCCEEDED and result.card.title == "找到 4 个物品"
    assert [b.label for b in result.card.buttons] == ["木剑", "石剑", "铁剑", "钻石剑"]
    pressed = await client.press("steve", result.card, result.card.buttons[3])
    assert pressed.reply.result.card.title == "物品：钻石剑"
    assert "  合成：2 × 钻石、1 × 木棍 → 1 个" in card_lines(pressed)
    # The candidates are the player's current list: `查看 2` opens the second.
    await client.chat("steve", "/item 剑")
    second = await client.chat("steve", "查看 2")
    assert second.reply.module_id == "system:item"
    assert second.reply.result.card.title == "物品：石剑"
    english = await client.chat("alex", "/item sword")
    assert [b.label for b in english.reply.result.card.buttons] == [
        "Wooden Sword",
        "Stone Sword",
        "Iron Sword",
        "Diamond Sword",
    ]


async def test_unknown_items_get_a_not_found_card(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    response = await client.chat("steve", "/item 不存在的东西")
    result = response.reply.result
    assert result.status == FAILED and result.failure.key == "system.error.not_found"
    assert result.card.title == "没有找到物品"
    assert "不存在的东西" in card_lines(response)[0]
    # A misspelt id still routes locally to the module, which reports it.
    misspelt = await client.chat("alex", "look up item minecraft:diamnod")
    assert misspelt.reply.module_id == "system:item"
    assert misspelt.reply.result.failure.key == "system.error.not_found"
    assert misspelt.reply.result.card.title == "No such item"
    assert "minecraft:diamnod" in card_lines(misspelt)[0]


async def test_bad_input_is_refused_with_a_message(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    missing = await client.chat("alex", "/item")
    assert missing.reply.result.failure.key == "system.error.invalid_input"
    assert "/item needs an argument" in missing.reply.result.failure.message
    long = await client.chat("alex", "/item " + "x" * 65)
    assert long.reply.result.failure.key == "system.error.invalid_input"
    assert "longer than 64 characters" in long.reply.result.failure.message
    extra = await client.chat("alex", "/profile me")
    assert extra.reply.result.failure.key == "system.error.invalid_input"
    # Buttons, and invocations, carry input the engine checks like any other.
    listed = (await client.chat("alex", "/item sword")).reply.result.card
    for forged in ({"item_id": "Not An Id"}, {"item_id": "minecraft:stone", "query": "x"}, {}):
        button = common_pb2.CardButton(
            action_id="invoke",
            label="forged",
            args={"module_id": "system:item", "input": json.dumps(forged)},
        )
        # Pressed as if from the card, a button it never carried runs nothing...
        pressed = await client.press("alex", listed, button)
        assert pressed.reply.result.failure.key == "system.error.stale_card", forged
        # ...and sent as an invocation, the module refuses the input.
        call = common_pb2.ModuleAction(module_id="system:item")
        call.input.update(forged)
        refused = await client.request("alex", invoke=gateway_pb2.Invoke(call=call))
        assert refused.reply.result.failure.key == "system.error.invalid_input", forged


@pytest.mark.parametrize(
    ("query", "singular"),
    [
        ("diamonds", "diamond"),
        ("Torches", "Torch"),
        ("sweet berries", "sweet berry"),
        ("boxes", "box"),
        ("glass", None),
        ("钻石", None),
        ("ice", None),
        ("gus", None),
    ],
)
def test_an_english_plural_is_looked_up_again_as_its_singular(
    query: str, singular: str | None
) -> None:
    assert _singular(query) == singular
