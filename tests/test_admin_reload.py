"""`/system reload` (issue 18) reads the router's `system-semantic.json` and its notification
button phrasings, and the engine's event rules, end to end through the gateway: an edit takes
effect at the next text or event, a malformed file is refused with an error that names the
file and the key, and what was in force stays (the router's two files all or nothing)."""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections import Counter
from typing import Any

import pytest
from system.common.v1 import common_pb2

from router_service.buttons import ButtonMatcher, load_phrasings
from tests.inprocess import running_chain

SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
REWARD = "system:advancement_reward"
DIAMOND = "minecraft:story/mine_diamond"


def card_lines(result: common_pb2.AgentResult) -> list[str]:
    return [line.text for line in result.card.lines]


def _write(path: pathlib.Path, document: Any) -> None:
    path.write_text(json.dumps(document, ensure_ascii=False), encoding="utf-8")


def _reward(advancement: str, item: str, count: int, module: str = REWARD) -> dict[str, Any]:
    return {
        "advancement": advancement,
        "module": module,
        "input": {"items": [{"item": item, "count": count}]},
    }


def test_replaced_phrasings_apply_to_the_next_match_and_name_what_changed() -> None:
    buttons = [("claim", "claim", "Claim"), ("close", "", "Close")]
    matcher = ButtonMatcher(load_phrasings())
    assert matcher.match("grab the loot", "en", buttons).action_id is None
    edited = load_phrasings()
    edited["claim"]["en"] = [*edited["claim"]["en"], "grab the loot"]
    edited["brand_new"] = {"zh": ["新的"]}
    assert matcher.replace_phrasings(edited) == ["brand_new", "claim"]
    assert matcher.match("grab the loot", "en", buttons).action_id == "claim"
    assert matcher.replace_phrasings(edited) == []  # the same again changes nothing
    with pytest.raises(ValueError, match="'claim'.'en' must be a list of non-empty strings"):
        matcher.replace_phrasings({"claim": {"en": [""]}})
    assert matcher.match("grab the loot", "en", buttons).action_id == "claim"  # kept


async def test_a_bad_phrasings_file_stops_the_router_at_start_naming_the_key(
    tmp_path: pathlib.Path,
) -> None:
    from router_service.app import create_app
    from router_service.config import RouterConfig
    from services.runtime.config import ConfigError

    bad = tmp_path / "notification-buttons.json"
    _write(bad, {"claim": {"zh": "领取"}})
    config = RouterConfig(engine_target="127.0.0.1:1", button_phrasings=str(bad))
    with pytest.raises(ConfigError, match=r"'claim'\.'zh' must be a list .*button_phrasings"):
        await create_app(config)


async def test_reload_applies_edited_phrasings_and_refuses_a_bad_file_keeping_both(
    tmp_path: pathlib.Path,
) -> None:
    semantic = tmp_path / "config" / "system-semantic.json"
    phrasings = tmp_path / "config" / "notification-buttons.json"
    settings = {"semantic_config": str(semantic), "button_phrasings": str(phrasings)}
    async with running_chain(tmp_path, router_settings=settings) as chain:
        # Written with the bundled phrasings at the first start, for the operator to edit.
        assert json.loads(phrasings.read_text(encoding="utf-8")) == load_phrasings()
        client = await chain.steve_and_alex()
        await client.join("op", "Op", "en_us", permission_level=3)
        await client.join("zhop", "Zhop", "zh_cn", permission_level=3)
        mail = (await client.chat("alex", "/mail m4")).reply.result.card
        iron = lambda: client.world.inventory("alex")["minecraft:iron_ingot"]  # noqa: E731
        unknown = (await client.chat("alex", "grab the loot", viewing=mail)).reply
        assert unknown.module_id != "system:mail_claim" and iron() == 0

        document = load_phrasings()
        document["claim"]["en"].append("grab the loot")
        document["claim"]["zh"].append("拿走奖励")
        _write(phrasings, document)
        done = (await client.chat("op", "/system reload")).reply.result
        assert done.status == SUCCEEDED and done.card.title == "Configuration reloaded"
        assert "Applied: button phrasings (claim): applies live" in card_lines(done)
        assert "Router replicas reloaded: 1 of 1" in card_lines(done)  # the one there is
        assert "Engine replicas reloaded: 1 of 1" in card_lines(done)

        # A bad phrasings file beside a good semantic edit: neither applies.
        good = json.loads(semantic.read_text(encoding="utf-8"))
        good["minCoverage"] = 0.95
        _write(semantic, good)
        broken = dict(document, cancel={"en": ["nope", 3]})
        _write(phrasings, broken)
        refused = (await client.chat("zhop", "/system 重载配置")).reply.result
        assert refused.status == SUCCEEDED and refused.card.title == "重载配置"
        (error,) = [line for line in card_lines(refused) if line.startswith("路由配置")]
        assert str(phrasings) in error and "'cancel'.'en' must be a list" in error
        assert "the previous settings stay in force" in error
        assert "路由副本已重载：0/1" in card_lines(refused)
        assert chain.apps["router"].router.config.min_coverage == 0.9  # not half a reload

        # What was last reloaded stays in force: the new phrasing presses the claim button.
        claimed = (await client.chat("alex", "grab the loot", viewing=mail)).reply
        assert claimed.module_id == "system:mail_claim" and iron() == 16

        # A file that is not JSON is refused the same way, naming the file.
        phrasings.write_text("{not json", encoding="utf-8")
        again = (await client.chat("op", "/system reload")).reply.result
        (error,) = [line for line in card_lines(again) if "was not reloaded" in line]
        assert f"{phrasings}: not valid JSON at line 1" in error


async def test_reload_reads_the_event_rules_again_and_refuses_a_bad_rule_by_name(
    tmp_path: pathlib.Path,
) -> None:
    rules = tmp_path / "rules.json"
    _write(rules, {"rules": [_reward(DIAMOND, "minecraft:emerald", 7)]})
    async with running_chain(tmp_path, engine_settings={"advancements_file": str(rules)}) as chain:
        client = await chain.client()
        await client.join("op", "Op", "en_us", permission_level=3)
        await client.join("steve", "Steve", "en_us")

        async def earn(key: str) -> Counter[str]:
            before = Counter(client.world.inventory("steve"))
            await client.event("steve", "minecraft:advancement", key, {"advancement": DIAMOND})
            notice = await asyncio.wait_for(client.notices.get(), 20)
            assert notice.notice.result.status == SUCCEEDED, notice
            return Counter(client.world.inventory("steve")) - before

        assert await earn("adv-1") == Counter({"minecraft:emerald": 7})
        _write(rules, {"rules": [_reward(DIAMOND, "minecraft:gold_ingot", 2)]})
        done = (await client.chat("op", "/system reload")).reply.result
        assert done.status == SUCCEEDED
        assert f"Event rules: 1 rules from {rules}" in card_lines(done)
        assert await earn("adv-2") == Counter({"minecraft:gold_ingot": 2})

        _write(rules, {"rules": [_reward(DIAMOND, "minecraft:gold_ingot", 2, "system:help")]})
        refused = (await client.chat("op", "/system reload")).reply.result
        (error,) = [line for line in card_lines(refused) if line.startswith("Event rules were")]
        assert f"rules[0] ({DIAMOND}): module system:help does not handle" in error
        assert "the rules in force stay" in error
        assert await earn("adv-3") == Counter({"minecraft:gold_ingot": 2})

        # An ordinary player reloads nothing: the command does not exist for him.
        denied = (await client.chat("steve", "/system reload")).reply.result
        assert denied.failure.key == "system.error.unknown_command"
