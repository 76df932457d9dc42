"""Quests (FTB Quests, issue 15): the game tools `ftbquests:quest.query`, `quest.find`,
`quest.detail`, `quest.claim` and the shared `minecraft:gift.list` in the simulated world; the
modules `system:quests` and `system:quest_detail` (read-only, routed locally) and
`system:quest_claim` (a write reached only by its button and its command), all of the
`ftbquests` feature; end to end through the gateway (in-process chain) in Chinese and in
English: the list, numbers, names, ambiguous names as buttons, starter gifts, claiming twice
(delivered once), bad input; and a game server without `ftbquests`, whose players see quests
nowhere and cannot press an old quest button."""

from __future__ import annotations

import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from system.common.v1 import catalog_pb2, common_pb2
from system.engine.v1 import engine_pb2, engine_pb2_grpc
from system.gateway.v1 import gateway_pb2
from system.router.v1 import router_pb2

from engine_service.app import build_registry
from engine_service.config import EngineConfig
from engine_service.quest_tools import QUEST_GAME_TOOLS, QUEST_LIST_LIMIT
from engine_service.schema import violation
from engine_service.tool_catalog import game_tool_catalog, to_proto
from services.gamesim import quests
from services.gamesim.client import GameServerClient
from services.gamesim.world import World
from services.gateway.tool_contract import check_tools
from services.runtime.permissions import CORE_FEATURE
from tests.gametools import call_tool
from tests.inprocess import Chain, card_lines, running_chain
from tests.test_router_service import with_model  # noqa: F401 - the router with a model

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
FAILED = common_pb2.RESULT_STATUS_FAILED
TOOLS = {spec.tool_id: spec for spec in QUEST_GAME_TOOLS}
QUERY, FIND, DETAIL, CLAIM = (
    "ftbquests:quest.query",
    "ftbquests:quest.find",
    "ftbquests:quest.detail",
    "ftbquests:quest.claim",
)
GIFT = "minecraft:gift.list"
MODULES = ("system:quests", "system:quest_detail", "system:quest_claim")
OPEN_QUESTS = ["q1", "q3", "q4", "q5", "q7", "q8", "q10"]
"""The default list of every new player: in progress or claimable, in book order."""


def _ids(answer: dict[str, Any]) -> list[str]:
    return [q["id"] for q in answer["quests"]]


# -- the simulated world -----------------------------------------------------------------------


def test_the_default_list_holds_the_quests_in_progress_or_claimable() -> None:
    world = World()
    listed = call_tool(world, QUERY, {})
    assert listed["total"] == 7 and _ids(listed) == OPEN_QUESTS
    by_id = {q["id"]: q for q in listed["quests"]}
    assert by_id["q1"] == {
        "id": "q1",
        "title": {"zh": "欢迎来到服务器", "en": "Welcome to the Server"},
        "chapter": {"zh": "新手入门", "en": "Getting Started"},
        "status": "claimable",
        "progress": 100,
    }
    assert (by_id["q3"]["status"], by_id["q3"]["progress"]) == ("in_progress", 62)  # 40 of 64
    assert by_id["q7"]["progress"] == 65  # 3 of 10 zombies, 10 of 10 skeletons
    # Claimed (q2), locked (q6) and hidden (q9) quests are left out.
    assert not {"q2", "q6", "q9"} & set(by_id)
    # Deterministic: another world, another player, the same list.
    assert call_tool(World(), QUERY, {}, "alex") == listed
    assert len(quests.QUESTS) <= QUEST_LIST_LIMIT and quests.LIST_LIMIT == QUEST_LIST_LIMIT


def test_find_searches_titles_in_both_languages_and_never_shows_hidden_quests() -> None:
    world = World()
    assert _ids(call_tool(world, FIND, {"name": "铁"})) == ["q4", "q8"]
    assert _ids(call_tool(world, FIND, {"name": "IRON"})) == ["q4", "q8"]
    assert _ids(call_tool(world, FIND, {"name": "ｓｔｏｎｅ"})) == ["q3"]  # width folded
    assert _ids(call_tool(world, FIND, {"name": "砍树"})) == ["q2"]  # claimed quests are found
    nether = call_tool(world, FIND, {"name": "下界"})
    assert _ids(nether) == ["q6"] and nether["quests"][0]["status"] == "locked"
    assert call_tool(world, FIND, {"name": "末地"}) == {"total": 0, "quests": []}  # hidden
    assert call_tool(world, FIND, {"name": "The End"}) == {"total": 0, "quests": []}


def test_detail_reads_one_visible_quest_and_changes_nothing() -> None:
    world = World()
    before = call_tool(world, QUERY, {})
    stone = call_tool(world, DETAIL, {"quest_id": "q3"})["quest"]
    assert stone["tasks"] == [
        {
            "kind": "item",
            "target": "minecraft:cobblestone",
            "name": {"zh": "圆石", "en": "Cobblestone"},
            "done": 40,
            "required": 64,
        }
    ]
    assert stone["rewards"] == [
        {"item": "minecraft:furnace", "name": {"zh": "熔炉", "en": "Furnace"}, "count": 1}
    ]
    assert stone["starter_gift"] == "" and stone["requires"][0]["id"] == "q2"
    welcome = call_tool(world, DETAIL, {"quest_id": "q1"})["quest"]
    assert welcome["starter_gift"] == "starter_kit" and welcome["rewards"] == []
    assert welcome["tasks"][0]["kind"] == "checkmark" and welcome["tasks"][0]["target"] == ""
    locked = call_tool(world, DETAIL, {"quest_id": "q6"})["quest"]
    assert locked["status"] == "locked"
    assert [r["title"]["en"] for r in locked["requires"]] == ["Diamonds!"]
    # Unknown, and hidden while locked: the same answer, so a hidden quest cannot be probed.
    assert call_tool(world, DETAIL, {"quest_id": "q9"}) == {"found": False}
    assert call_tool(world, DETAIL, {"quest_id": "nope"}) == {"found": False}
    assert call_tool(world, QUERY, {}) == before


def test_a_claim_delivers_the_reward_and_marks_the_quest_together_once() -> None:
    world = World()
    inventory = world.inventory("steve")
    claimed = call_tool(world, CLAIM, {"quest_id": "q4"})
    assert claimed["outcome"] == "claimed"
    assert [(s["item"], s["count"]) for s in claimed["items"]] == [
        ("minecraft:iron_pickaxe", 1),
        ("minecraft:bread", 8),
    ]
    assert inventory["minecraft:iron_pickaxe"] == 1 and inventory["minecraft:bread"] == 12 + 8
    assert call_tool(world, DETAIL, {"quest_id": "q4"})["quest"]["status"] == "claimed"
    assert "q4" not in _ids(call_tool(world, QUERY, {}))
    again = call_tool(world, CLAIM, {"quest_id": "q4"})
    assert again == {"outcome": "already_claimed", "items": []}
    assert inventory["minecraft:iron_pickaxe"] == 1 and inventory["minecraft:bread"] == 20
    # A starter gift quest delivers its gift.
    gift = call_tool(world, CLAIM, {"quest_id": "q1"})
    assert [(s["item"], s["count"]) for s in gift["items"]] == [
        ("minecraft:stone_sword", 1),
        ("minecraft:bread", 16),
        ("minecraft:torch", 16),
    ]
    assert call_tool(world, CLAIM, {"quest_id": "q3"}) == {"outcome": "not_complete", "items": []}
    assert call_tool(world, CLAIM, {"quest_id": "q6"}) == {"outcome": "not_complete", "items": []}
    assert call_tool(world, CLAIM, {"quest_id": "q2"})["outcome"] == "already_claimed"
    assert call_tool(world, CLAIM, {"quest_id": "q9"}) == {"outcome": "not_found", "items": []}
    # Another player's quests are untouched.
    assert call_tool(world, DETAIL, {"quest_id": "q4"}, "alex")["quest"]["status"] == "claimable"
    assert world.inventory("alex")["minecraft:iron_pickaxe"] == 0


def test_progress_opens_locked_quests_and_hidden_ones_appear() -> None:
    world = World()
    progress = world.player("steve").quest_progress
    progress.advance("q5", 0, 99)  # capped at what the task requires
    assert progress.done["q5"] == [5]
    assert call_tool(world, DETAIL, {"quest_id": "q6"})["quest"]["status"] == "in_progress"
    assert call_tool(world, DETAIL, {"quest_id": "q9"}) == {"found": False}  # q6 not done yet
    progress.advance("q6", 0, 5)
    progress.advance("q6", 1, 5)
    assert call_tool(world, DETAIL, {"quest_id": "q9"})["quest"]["status"] == "in_progress"
    assert _ids(call_tool(world, FIND, {"name": "末地"})) == ["q9"]


def test_the_gift_list_reads_a_gift() -> None:
    world = World()
    kit = call_tool(world, GIFT, {"gift_id": "starter_kit"})
    assert kit["gift"]["name"] == {"zh": "新手礼包", "en": "Starter Kit"}
    assert [s["count"] for s in kit["gift"]["items"]] == [1, 16, 16]
    assert call_tool(world, GIFT, {"gift_id": "nope"}) == {"found": False}
    assert world.inventory("steve")["minecraft:stone_sword"] == 0  # reading gives nothing


def test_the_tools_refuse_bad_input() -> None:
    world = World()
    with pytest.raises(ValueError, match="quest.query takes no input"):
        world.call("steve", QUERY, {"page": 1})
    for bad in ({}, {"name": ""}, {"name": 3}, {"name": "x" * 65}, {"name": "a", "b": 1}):
        with pytest.raises(ValueError, match="quest.find takes a name of 1 to 64"):
            world.call("steve", FIND, bad)
    with pytest.raises(ValueError, match="not blank"):
        world.call("steve", FIND, {"name": "   "})
    for tool in (DETAIL, CLAIM):
        for bad in ({}, {"quest_id": ""}, {"quest_id": 4}, {"quest_id": "q4", "x": 1}):
            with pytest.raises(ValueError, match="takes a quest_id of 1 to 64 characters"):
                world.call("steve", tool, bad)
    with pytest.raises(ValueError, match="gift.list takes a gift_id"):
        world.call("steve", GIFT, {"gift": "starter_kit"})
    assert world.inventory("steve")["minecraft:iron_pickaxe"] == 0


def test_a_world_without_ftbquests_has_no_quests_but_keeps_the_gift_list() -> None:
    plain = World(features=())
    offered = [tool.name for tool in plain.hello_tools()]
    assert GIFT in offered and not set(quests.TOOLS) & set(offered)
    for tool in quests.TOOLS:
        with pytest.raises(ValueError, match="unknown tool"):
            plain.call("steve", tool, {})
    assert plain.call("steve", GIFT, {"gift_id": "starter_kit"})["found"] is True
    full = World()
    assert full.features == ("ftbquests",)
    assert set(quests.TOOLS) <= {tool.name for tool in full.hello_tools()}


def test_the_hello_offers_the_quest_tools_as_the_catalogue_declares_them() -> None:
    offered = {t.name: t for t in World().hello_tools()}
    for tool_id, spec in TOOLS.items():
        tool = offered[tool_id]
        assert (tool.read_only, tool.idempotent, tool.event_allowed) == (
            spec.read_only,
            spec.idempotent,
            spec.event_allowed,
        )
        assert not tool.honours_call_id and not spec.honours_call_id
        for name in ("input", "output"):
            example = getattr(spec, f"example_{name}")
            assert violation(json.loads(getattr(tool, f"{name}_schema")), example) is None
    assert all(TOOLS[t].read_only for t in (QUERY, FIND, DETAIL, GIFT))
    # A claim changes the game (a write), but repeating it has the effect of one.
    assert not TOOLS[CLAIM].read_only and TOOLS[CLAIM].idempotent
    assert not TOOLS[CLAIM].event_allowed
    assert {TOOLS[t].owner_feature for t in quests.TOOLS} == {"ftbquests"}
    assert TOOLS[GIFT].owner_feature == CORE_FEATURE  # gifts are the server's, not the mod's


def test_the_hello_check_expects_quest_tools_only_from_servers_with_the_feature() -> None:
    catalogue = to_proto(game_tool_catalog(build_registry(EngineConfig())))
    vanilla = World(features=()).hello_tools()
    assert check_tools(vanilla, catalogue).problems == ()
    # The same hello claiming FTB Quests lacks the mod's tools: each is a problem, and the
    # quest modules are unavailable on that server.
    claimed = check_tools(vanilla, catalogue, ("ftbquests",))
    assert sorted(p.tool for p in claimed.problems) == sorted(quests.TOOLS)
    assert claimed.unavailable_modules == tuple(sorted(MODULES))
    assert check_tools(World().hello_tools(), catalogue, ("ftbquests",)).problems == ()


# -- the registrations ---------------------------------------------------------------------------


def test_the_quest_reads_are_local_routes_matching_the_corpus_profiles() -> None:
    registry = build_registry(EngineConfig())
    corpus = json.loads((ROOT / "router_service/corpus/profiles.json").read_text("utf-8"))
    profiles = {m["id"]: m for m in corpus["modules"]}
    for module_id, aliases in (
        ("system:quests", ["quests", "任务", "任务列表"]),
        ("system:quest_detail", ["quest", "任务详情"]),
    ):
        descriptor = registry.descriptor(module_id)
        assert descriptor.owner_feature == "ftbquests"
        assert descriptor.routing_mode == catalog_pb2.ROUTING_MODE_READ
        assert descriptor.semantic.read_only_tools and descriptor.write_steps == 0
        profile = profiles[module_id]
        assert profile["kind"] == "read" and profile["direct"] is True
        examples = {e.language: list(e.examples) for e in descriptor.semantic.examples}
        assert examples == profile["examples"], module_id
        assert (descriptor.semantic.extractor or None) == profile["extractor"]
        assert (descriptor.semantic.choice_label or None) == profile.get("choiceLabel")
        assert [list(c.aliases) for c in descriptor.commands] == [aliases]
    detail = registry.get("system:quest_detail")
    assert detail is not None and detail.spec.tools == (QUERY, FIND, DETAIL, GIFT)


def test_the_claim_is_a_write_of_the_feature_reached_only_by_buttons_and_its_command() -> None:
    registry = build_registry(EngineConfig())
    claim = registry.descriptor("system:quest_claim")
    assert claim.owner_feature == "ftbquests"
    assert claim.routing_mode == catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY
    assert claim.write_steps == 1 and claim.interactive and not claim.event_allowed
    assert not claim.HasField("semantic")  # no examples: local matching never sees it
    assert registry.get("system:quest_claim").spec.tools == (CLAIM,)  # type: ignore[union-attr]
    assert [list(c.aliases) for c in claim.commands] == [["questclaim", "领取任务奖励"]]
    assert claim.commands[0].argument_kind == catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT
    corpus = json.loads((ROOT / "router_service/corpus/profiles.json").read_text("utf-8"))
    assert "system:quest_claim" not in {m["id"] for m in corpus["modules"]}
    # Registered once: every quest module and tool exactly once in the registry.
    ids = [m.spec.module_id for m in registry.modules()]
    assert all(ids.count(m) == 1 for m in MODULES)
    catalogue = json.loads((ROOT / "docs/game-tools.json").read_text("utf-8"))
    needed = {t["name"]: [n["module_id"] for n in t["needed_by"]] for t in catalogue["tools"]}
    assert needed[CLAIM] == ["system:quest_claim"]
    # reasoning and chat: optional
    assert needed[GIFT] == ["system:quest_detail", "system:reasoning", "system:chat"]


def test_reasoning_may_read_quests_but_never_claim() -> None:
    registry = build_registry(EngineConfig())
    reasoning = registry.get("system:reasoning")
    assert reasoning is not None
    offered = set(reasoning.spec.optional_tools)
    assert {QUERY, FIND, DETAIL} <= offered and CLAIM not in offered


# -- end to end through the gateway ----------------------------------------------------------------


@pytest.fixture
async def chain(tmp_path: pathlib.Path) -> AsyncIterator[Chain]:
    async with running_chain(tmp_path) as running:
        yield running


def _labels(response: gateway_pb2.PlayerResponse) -> list[str]:
    return [b.label for b in response.reply.result.card.buttons]


def _button(response: gateway_pb2.PlayerResponse, label: str) -> common_pb2.CardButton:
    return next(b for b in response.reply.result.card.buttons if b.label == label)


ZH_LIST = [
    "1. 欢迎来到服务器 · 新手入门 — 可领取奖励",
    "2. 石器时代 · 新手入门 — 进行中 62%",
    "3. 铁器时代 · 采矿 — 可领取奖励",
    "4. 闪闪发光的钻石 · 采矿 — 进行中 0%",
    "5. 怪物猎人 · 冒险 — 进行中 65%",
    "6. 铁傀儡守卫 · 采矿 — 进行中 25%",
    "7. 农夫的礼物 · 新手入门 — 进行中 31%",
]


async def test_the_quest_list_and_details_in_chinese_and_english(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    # A fresh player's number reaches the detail through local routing (list_index).
    fresh = await client.chat("alex", "show quest 2")
    assert fresh.reply.module_id == "system:quest_detail", fresh.reply
    assert fresh.reply.result.card.title == "Stone Age"
    assert card_lines(fresh) == [
        "Chapter: Getting Started",
        "Status: in progress (62%)",
        "Gather a stack of cobblestone and build a furnace.",
        "Tasks:",
        "  Collect Cobblestone 40/64",
        "Rewards:",
        "  Furnace × 1",
    ]
    assert _labels(fresh) == ["Back to quests"]  # in progress: nothing to claim
    helped = await client.chat("steve", "帮助")
    commands = {line.suggest_command for line in helped.reply.result.card.lines}
    assert {"/quests", "/quest", "/questclaim"} <= commands, commands
    for text in ("查看任务", "/quests", "我的任务", "任务"):
        response = await client.chat("steve", text)
        assert response.reply.module_id == "system:quests", text
        assert response.reply.result.status == SUCCEEDED, response.reply.result.failure
        assert response.reply.result.card.title == "进行中的任务（共 7 个）"
    assert card_lines(response) == ZH_LIST
    assert _labels(response) == [
        "欢迎来到服务器",
        "石器时代",
        "铁器时代",
        "闪闪发光的钻石",
        "怪物猎人",
        "铁傀儡守卫",
        "农夫的礼物",
    ]
    assert response.reply.result.card.lines[2].suggest_command == "/quest q4"
    # `查看 3` opens the third quest of the list shown.
    third = await client.chat("steve", "查看 3")
    assert third.reply.module_id == "system:quest_detail"
    assert third.reply.result.card.title == "铁器时代"
    assert card_lines(third) == [
        "章节：采矿",
        "状态：已完成，奖励可领取",
        "冶炼十六个铁锭，换一把铁镐。",
        "任务要求：",
        "  收集 铁锭 16/16",
        "奖励：",
        "  铁镐 × 1",
        "  面包 × 8",
    ]
    assert _labels(third) == ["领取奖励", "返回任务列表"]
    assert third.reply.result.card.lines[4].suggest_command == "/item minecraft:iron_ingot"
    back = await client.press("steve", third.reply.result.card, _button(third, "返回任务列表"))
    assert card_lines(back) == ZH_LIST
    # From the list, then from a detail card (its one numbered button is "back"): the
    # number is then the quest list's, through local routing or the command.
    for text in ("/view 5", "查看任务 5", "/quest 5"):
        fifth = await client.chat("steve", text)
        assert fifth.reply.module_id == "system:quest_detail", text
        assert fifth.reply.result.card.title == "怪物猎人", text
    assert card_lines(fifth)[4:6] == ["  击杀 僵尸 3/10", "  击杀 骷髅 10/10"]
    english = await client.chat("alex", "show my quests")
    assert english.reply.module_id == "system:quests"
    assert english.reply.result.card.title == "Quests in progress (7)"
    assert card_lines(english)[0] == "1. Welcome to the Server · Getting Started — reward ready"
    assert card_lines(english)[1] == "2. Stone Age · Getting Started — in progress 62%"
    viewed = await client.chat("alex", "/view 6")
    assert viewed.reply.result.card.title == "Iron Guardian"
    locked = await client.chat("alex", "/quest q6")
    assert card_lines(locked)[1] == "Status: locked; first complete: Diamonds!"
    assert card_lines(locked)[4:6] == ["  Kill Blaze 0/5", "  Collect Blaze Rod 0/5"]


async def test_a_starter_gift_quest_lists_its_gift(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    welcome = await client.chat("steve", "/quest q1")
    assert welcome.reply.result.card.title == "欢迎来到服务器"
    assert card_lines(welcome) == [
        "章节：新手入门",
        "状态：已完成，奖励可领取",
        "打开任务书看一看，然后领取你的新手礼包。",
        "任务要求：",
        "  打开任务书 1/1",
        "新手礼包任务：奖励是“新手礼包”，内含：",
        "  石剑 × 1",
        "  面包 × 16",
        "  火把 × 16",
    ]
    assert _labels(welcome) == ["领取奖励", "返回任务列表"]
    farmer = await client.chat("alex", "/quest Farmer's Gift")
    assert farmer.reply.result.card.title == "Farmer's Gift"
    assert card_lines(farmer)[-3:] == [
        "Starter gift quest: the reward is the Farmer's Kit, holding:",
        "  Bread × 8",
        "  Apple × 8",
    ]
    assert _labels(farmer) == ["Back to quests"]  # not complete: no claim button


async def test_names_search_and_ambiguous_names_show_candidates(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    searched = await client.chat("steve", "/quests 铁")
    assert searched.reply.module_id == "system:quests"
    assert searched.reply.result.card.title == "任务搜索“铁”（共 2 个）"
    assert card_lines(searched) == [
        "1. 铁器时代 · 采矿 — 可领取奖励",
        "2. 铁傀儡守卫 · 采矿 — 进行中 25%",
    ]
    # The number picks from the list on screen, here the search's.
    picked = await client.chat("steve", "查看 2")
    assert picked.reply.result.card.title == "铁傀儡守卫"
    ambiguous = await client.chat("steve", "/quest 铁")
    assert ambiguous.reply.module_id == "system:quest_detail"
    assert ambiguous.reply.result.status == SUCCEEDED
    assert ambiguous.reply.result.card.title == "有 2 个任务符合“铁”"
    assert card_lines(ambiguous)[-1] == "选择一个查看详情。"
    assert _labels(ambiguous) == ["铁器时代", "铁傀儡守卫"]
    pressed = await client.press(
        "steve", ambiguous.reply.result.card, _button(ambiguous, "铁傀儡守卫")
    )
    assert pressed.reply.result.card.title == "铁傀儡守卫"
    again = await client.chat("steve", "/quest 铁")
    typed = await client.chat("steve", "查看 1")  # a candidate by its number
    assert again.reply.result.card.title.startswith("有 2 个")
    assert typed.reply.result.card.title == "铁器时代"
    english = await client.chat("alex", "/quest iron")
    assert english.reply.result.card.title == "2 quests match “iron”"
    assert _labels(english) == ["Iron Age", "Iron Guardian"]
    # One match, or one whole title among several, opens it directly.
    assert (await client.chat("steve", "/quest 石器")).reply.result.card.title == "石器时代"
    assert (await client.chat("alex", "/quest iron age")).reply.result.card.title == "Iron Age"
    assert (await client.chat("alex", "/quest q7")).reply.result.card.title == "Monster Hunter"
    nothing = await client.chat("steve", "/quests 末地")  # hidden: never found
    assert card_lines(nothing) == ["没有找到名称包含“末地”的任务。"]
    assert _labels(nothing) == []
    for text, message in (
        ("/quest 末地", "No quest you can see has “末地” in its title."),
        ("/quest 99", "Your quest list has no number 99 (it has 7). Type /quests to see it."),
    ):
        missing = (await client.chat("alex", text)).reply.result
        assert (missing.status, missing.failure.key) == (FAILED, "system.error.not_found"), text
        assert missing.failure.message == message
    hidden = (await client.chat("steve", "/questclaim q9")).reply.result
    assert hidden.failure.key == "system.error.not_found"
    assert hidden.card.title == "没有这个任务" and "q9" in hidden.failure.message
    # A list number is no quest id for a claim: the message says how to reach the button.
    numbered = (await client.chat("alex", "/questclaim 2")).reply.result
    assert numbered.failure.message == (
        "There is no quest 2. To claim the reward of number 2 of your quest list, open it "
        "(/quest 2) and press Claim on its card."
    )


async def test_claiming_twice_delivers_once(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    inventory = client.world.inventory("steve")
    opened = await client.chat("steve", "/quest q4")
    card = opened.reply.result.card
    claim = _button(opened, "领取奖励")
    assert claim.args["module_id"] == "system:quest_claim" and claim.args["press_only"] == "true"
    first = await client.press("steve", card, claim)
    assert first.reply.module_id == "system:quest_claim"
    assert first.reply.result.status == SUCCEEDED, first.reply.result.failure
    assert first.reply.result.card.title == "已领取任务奖励"
    assert card_lines(first) == ["  铁镐 × 1", "  面包 × 8", "以上物品已放入背包。"]
    assert inventory["minecraft:iron_pickaxe"] == 1 and inventory["minecraft:bread"] == 20
    again = await client.press("steve", card, claim)
    assert again.reply.result.status == SUCCEEDED
    assert again.reply.result.card.title == "任务奖励已领取过"
    assert card_lines(again) == ["任务 q4 的奖励之前已经领取，这次没有再发放物品。"]
    assert inventory["minecraft:iron_pickaxe"] == 1 and inventory["minecraft:bread"] == 20
    reopened = await client.chat("steve", "/quest q4")
    assert card_lines(reopened)[1] == "状态：已完成，奖励已领取"
    assert _labels(reopened) == ["返回任务列表"]
    listed = await client.chat("steve", "/quests")
    assert listed.reply.result.card.title == "进行中的任务（共 6 个）"  # claimed: off the list
    # The explicit command, in English: the starter gift's items.
    by_command = await client.chat("alex", "/questclaim q1")
    assert by_command.reply.result.card.title == "Quest reward claimed"
    assert card_lines(by_command) == [
        "  Stone Sword × 1",
        "  Bread × 16",
        "  Torch × 16",
        "These items are now in your inventory.",
    ]
    twice = await client.chat("alex", "/questclaim q1")
    assert twice.reply.result.card.title == "Already claimed"
    assert client.world.inventory("alex")["minecraft:stone_sword"] == 1
    early = (await client.chat("alex", "/questclaim q3")).reply.result
    assert (early.status, early.failure.key) == (FAILED, "system.error.not_found")
    assert early.card.title == "Quest not complete"
    assert early.failure.message == "Quest q3 is not complete yet; there is no reward to claim."
    assert client.world.inventory("alex")["minecraft:furnace"] == 0


async def test_a_quest_claim_is_never_made_from_typed_text(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    opened = await client.chat("steve", "/quest q4")
    assert _labels(opened) == ["领取奖励", "返回任务列表"]
    # The claim button is press-only: its typed number says so and claims nothing; the
    # others keep the numbers the card shows (2: back to the list).
    typed = await client.chat("steve", "查看 1")
    assert typed.reply.module_id == ""
    assert typed.reply.result.failure.message.startswith("第 1 个按钮需要点击才能生效")
    back = await client.chat("steve", "查看 2")
    assert back.reply.module_id == "system:quests"
    await client.chat("alex", "/quest q1")
    for player, text in (
        ("steve", "领取任务奖励"),
        ("steve", "领一下任务奖励"),
        ("steve", "帮我把任务奖励都领了"),
        ("steve", "提交任务"),
        ("alex", "1"),
        ("alex", "claim the quest reward"),
        ("alex", "claim my quest rewards"),
        ("alex", "complete the quest and take the reward"),
    ):
        response = await client.chat(player, text)
        assert response.reply.module_id != "system:quest_claim", text
    assert client.world.inventory("steve")["minecraft:iron_pickaxe"] == 0
    assert client.world.inventory("alex")["minecraft:stone_sword"] == 0


@pytest.mark.parametrize("source", [engine_pb2.ROUTE_SOURCE_LOCAL, engine_pb2.ROUTE_SOURCE_CACHE])
async def test_the_engine_refuses_a_quest_claim_from_a_local_or_cached_route(
    chain: Chain, source: int
) -> None:
    client = await chain.steve_and_alex()
    engine = chain.apps["engine"].engine
    player = common_pb2.PlayerContext(
        server_id=chain.server_id,
        player_id=f"{chain.server_id}/steve",
        player_name="Steve",
        language="zh",
        features=["ftbquests"],
    )
    action = common_pb2.ModuleAction(module_id="system:quest_claim")
    action.input.update({"quest_id": "q4"})
    refused = await engine.execute(player, action, "领取任务奖励", source=source)
    assert refused.status == FAILED
    assert refused.failure.key == "system.error.write_not_allowed"
    assert client.world.inventory("steve")["minecraft:iron_pickaxe"] == 0
    allowed = await engine.execute(
        player, action, "/questclaim q4", source=engine_pb2.ROUTE_SOURCE_COMMAND
    )
    assert allowed.status == SUCCEEDED, allowed.failure
    assert client.world.inventory("steve")["minecraft:iron_pickaxe"] == 1


async def test_bad_input_is_refused_with_a_message(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    for text, message in (
        ("/questclaim", "/questclaim needs an argument"),
        ("/quest", "/quest needs an argument"),
        ("/quest " + "x" * 65, "longer than 64 characters"),
        ("/quests " + "x" * 65, "longer than 64 characters"),
    ):
        refused = (await client.chat("alex", text)).reply.result
        assert refused.failure.key == "system.error.invalid_input", text
        assert message in refused.failure.message, (text, refused.failure.message)
    listed = (await client.chat("alex", "/quests")).reply.result.card
    for module_id, forged in (
        ("system:quest_detail", {}),
        ("system:quest_detail", {"index": 0}),
        ("system:quest_detail", {"index": 2, "quest_id": "q3"}),
        ("system:quest_detail", {"quest_id": ""}),
        ("system:quests", {"name": ""}),
        ("system:quests", {"page": 2}),
        ("system:quest_claim", {}),
        ("system:quest_claim", {"quest_id": "q4", "count": 99}),
    ):
        button = common_pb2.CardButton(
            action_id="invoke",
            label="forged",
            args={"module_id": module_id, "input": json.dumps(forged)},
        )
        pressed = (await client.press("alex", listed, button)).reply.result
        assert pressed.failure.key == "system.error.stale_card", forged  # not on the card
        call = common_pb2.ModuleAction(module_id=module_id)
        call.input.update(forged)
        invoked = await client.request("alex", invoke=gateway_pb2.Invoke(call=call))
        assert invoked.reply.result.failure.key == "system.error.invalid_input", forged
    assert client.world.inventory("alex")["minecraft:iron_pickaxe"] == 0


# -- a game server without FTB Quests ------------------------------------------------------------


async def _vanilla(chain: Chain) -> GameServerClient:
    """A client whose world lacks `ftbquests`, with Steve (zh) and Alex (en) joined."""
    client = chain.new_client()
    client.world = World(features=())
    welcome = await client.connect()
    # Modules of a feature the server lacks need none of its tools: no problem is reported.
    assert list(welcome.tool_problems) == []
    await client.join("steve", "Steve", "zh_cn")
    await client.join("alex", "Alex", "en_us")
    return client


async def test_without_ftbquests_quests_appear_nowhere(chain: Chain) -> None:
    client = await _vanilla(chain)
    for player, text in (("steve", "帮助"), ("alex", "help")):
        helped = (await client.chat(player, text)).reply.result
        assert helped.status == SUCCEEDED
        commands = {line.suggest_command for line in helped.card.lines}
        assert "/mail" in commands
        assert not {"/quests", "/quest", "/questclaim"} & commands, commands
        assert "FTB" not in helped.text  # the quest list's description
        assert not [t for t in helped.text.split("\n") if t.startswith(("/quest ", "/quests"))]
    for text in ("/quests", "/quest 1", "/questclaim q4"):
        unknown = (await client.chat("alex", text)).reply.result
        assert unknown.failure.key == "system.error.unknown_command", text
    for player, text in (
        ("steve", "查看任务"),
        ("steve", "查看任务 1"),
        ("alex", "show my quests"),
    ):
        routed = await client.chat(player, text)
        assert routed.reply.module_id not in MODULES, (text, routed.reply)
        assert "任务" not in routed.reply.result.card.title, text
    # What a client completes commands from: the engine's catalogue for the player.
    engine = engine_pb2_grpc.EngineServiceStub(chain.channel("engine"))
    vanilla = common_pb2.PlayerContext(server_id=chain.server_id, player_id="sim/alex")
    with_mod = common_pb2.PlayerContext(
        server_id=chain.server_id, player_id="sim/alex", features=["ftbquests"]
    )
    without = await engine.GetCatalog(engine_pb2.GetCatalogRequest(player=vanilla), timeout=5)
    offered = await engine.GetCatalog(engine_pb2.GetCatalogRequest(player=with_mod), timeout=5)
    assert not {m.module_id for m in without.modules} & set(MODULES)
    assert set(MODULES) <= {m.module_id for m in offered.modules}
    aliases = {a for m in without.modules for c in m.commands for a in c.aliases}
    assert not {"quests", "quest", "questclaim", "任务"} & aliases


async def test_without_ftbquests_an_old_quest_button_is_refused(chain: Chain) -> None:
    modded = await chain.steve_and_alex()
    opened = await modded.chat("steve", "/quest q4")
    claim = _button(opened, "领取奖励")
    detail = _button(opened, "返回任务列表")
    vanilla = await _vanilla(chain)
    for button in (claim, detail):
        # The card outlives the reconnect (decision 0030), but its button needs the feature
        # this server lacks: refused, nothing runs...
        refused = await vanilla.press("steve", opened.reply.result.card, button)
        result = refused.reply.result
        assert (result.status, result.failure.key) == (FAILED, "system.error.permission_denied")
        assert "ftbquests" in result.failure.message
        # ...and so is its action asked for directly.
        call = common_pb2.ModuleAction(module_id=button.args["module_id"])
        call.input.update(json.loads(button.args["input"]))
        invoked = await vanilla.request("steve", invoke=gateway_pb2.Invoke(call=call))
        result = invoked.reply.result
        assert (result.status, result.failure.key) == (
            FAILED,
            "system.error.permission_denied",
        ), button.args
        assert "ftbquests" in result.failure.message
        assert f"game server {chain.server_id}" in result.failure.message
    assert vanilla.world.inventory("steve")["minecraft:iron_pickaxe"] == 0


async def test_the_models_catalogue_offers_quests_only_with_the_feature(with_model) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    stub, fake = with_model
    catalogues = []
    for features in ((), ("ftbquests",)):
        fake.script(json.dumps({"capabilityId": "clarify", "arguments": {}}))
        player = common_pb2.PlayerContext(
            server_id="sim", player_id="steve", language="en", features=features
        )
        await stub.Route(
            router_pb2.RouteRequest(
                player=player, text="what should I work on next", external_enabled=True
            ),
            timeout=10,
        )
        sent = json.loads(fake.completions[-1].json["messages"][1]["content"])["catalogue"]
        catalogues.append({entry["id"] for entry in sent})
    without, with_mod = catalogues
    assert not set(MODULES) & without and "system:inbox" in without
    # The reads are offered to the model; the claim never is (STRUCTURED_ONLY).
    assert {"system:quests", "system:quest_detail"} <= with_mod
    assert "system:quest_claim" not in with_mod
