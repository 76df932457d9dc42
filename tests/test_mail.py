"""Mail (收件箱): the game tools `minecraft:mail.list`, `minecraft:mail.read` and
`minecraft:mail.claim` in the simulated world; the modules `system:inbox` (read-only, routed
locally) and `system:mail_claim` (a write reached only by its button and its command); and
both end to end through the gateway (in-process chain) in Chinese and in English: paging,
reading by number, claiming twice (delivered once), a mail without attachment, unknown ids,
bad input, and claims that typed text, a typed number, a local or a cached route never make."""

from __future__ import annotations

import json
import pathlib
from collections.abc import AsyncIterator

import pytest
from system.common.v1 import catalog_pb2, common_pb2
from system.engine.v1 import engine_pb2
from system.gateway.v1 import gateway_pb2

from engine_service.app import build_registry
from engine_service.config import EngineConfig
from engine_service.schema import violation
from engine_service.tools import BUILTIN_GAME_TOOLS, MAIL_PAGE_LIMIT
from services.gamesim import mail
from services.gamesim.world import World
from tests.gametools import call_tool
from tests.inprocess import Chain, card_lines, running_chain

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
FAILED = common_pb2.RESULT_STATUS_FAILED
TOOLS = {spec.tool_id: spec for spec in BUILTIN_GAME_TOOLS}
LIST, READ, CLAIM = "minecraft:mail.list", "minecraft:mail.read", "minecraft:mail.claim"
NEWEST_FIRST = ["m6", "m5", "m4", "m3", "m2", "m1"]


# -- the simulated world -----------------------------------------------------------------------


def test_every_player_starts_with_mail_in_both_languages_some_with_attachments() -> None:
    world = World()
    listed = call_tool(world, LIST, {"page_size": 10})
    assert listed["total"] == 6 and [m["id"] for m in listed["mails"]] == NEWEST_FIRST
    subjects = [m["subject"] for m in listed["mails"]]
    assert "签到奖励补发" in subjects and "Double drops this weekend" in subjects
    attached = [m for m in listed["mails"] if m["attachment"]]
    assert len(attached) == 4 and not any(m["claimed"] for m in listed["mails"])
    diamonds = next(m for m in listed["mails"] if m["id"] == "m5")["attachment"]
    assert diamonds == [
        {"item": "minecraft:diamond", "name": {"zh": "钻石", "en": "Diamond"}, "count": 2}
    ]
    times = [m["sent_at"] for m in listed["mails"]]
    assert times == sorted(times, reverse=True)
    # Deterministic: another world, another player, the same mail.
    assert call_tool(World(), LIST, {"page_size": 10}, "alex") == listed


def test_the_list_pages_newest_first() -> None:
    world = World()
    first = call_tool(world, LIST, {})
    assert (first["page"], first["page_size"], first["total"]) == (1, 5, 6)
    assert [m["id"] for m in first["mails"]] == NEWEST_FIRST[:5]
    assert [m["id"] for m in call_tool(world, LIST, {"page": 2})["mails"]] == ["m1"]
    assert [m["id"] for m in call_tool(world, LIST, {"page": 2, "page_size": 2})["mails"]] == [
        "m4",
        "m3",
    ]
    past = call_tool(world, LIST, {"page": 3})
    assert past["mails"] == [] and past["total"] == 6


def test_reading_changes_nothing_and_an_unknown_id_is_not_found() -> None:
    world = World()
    before = call_tool(world, LIST, {"page_size": 10})
    read = call_tool(world, READ, {"mail_id": "m5"})
    assert read["found"] is True and read["mail"]["body"].startswith("维护期间")
    assert call_tool(world, READ, {"mail_id": "m5"}) == read
    assert call_tool(world, LIST, {"page_size": 10}) == before
    assert call_tool(world, READ, {"mail_id": "nope"}) == {"found": False}


def test_a_claim_delivers_the_items_and_marks_the_mail_together_once() -> None:
    world = World()
    inventory = world.inventory("steve")
    claimed = call_tool(world, CLAIM, {"mail_id": "m2"})
    assert claimed["outcome"] == "claimed"
    assert [(s["item"], s["count"]) for s in claimed["items"]] == [
        ("minecraft:bread", 16),
        ("minecraft:torch", 16),
    ]
    assert inventory["minecraft:bread"] == 12 + 16 and inventory["minecraft:torch"] == 32 + 16
    assert call_tool(world, READ, {"mail_id": "m2"})["mail"]["claimed"] is True
    again = call_tool(world, CLAIM, {"mail_id": "m2"})
    assert again == {"outcome": "already_claimed", "items": []}
    assert inventory["minecraft:bread"] == 28 and inventory["minecraft:torch"] == 48
    assert call_tool(world, CLAIM, {"mail_id": "m3"}) == {"outcome": "no_attachment", "items": []}
    assert call_tool(world, CLAIM, {"mail_id": "nope"}) == {"outcome": "not_found", "items": []}
    # Another player's copy of the mail is untouched.
    assert call_tool(world, READ, {"mail_id": "m2"}, "alex")["mail"]["claimed"] is False
    assert world.inventory("alex")["minecraft:bread"] == 12


def test_the_tools_refuse_bad_input() -> None:
    world = World()
    for bad in ({"page": 0}, {"page": "1"}, {"page": True}, {"page_size": 11}, {"page": 1.5}):
        with pytest.raises(ValueError, match="mail.list: page"):
            world.call("steve", LIST, bad)
    with pytest.raises(ValueError, match="takes page and page_size"):
        world.call("steve", LIST, {"mail_id": "m1"})
    for tool in (READ, CLAIM):
        for bad in (
            {},
            {"mail_id": ""},
            {"mail_id": 5},
            {"mail_id": "x" * 65},
            {"mail_id": "m1", "x": 1},
        ):
            with pytest.raises(ValueError, match="takes a mail_id of 1 to 64 characters"):
                world.call("steve", tool, bad)
    assert world.inventory("steve")["minecraft:diamond"] == 0


def test_the_hello_offers_the_mail_tools_as_the_catalogue_declares_them() -> None:
    offered = {t.name: t for t in World.tools()}
    for tool_id in (LIST, READ, CLAIM):
        spec, tool = TOOLS[tool_id], offered[tool_id]
        assert (tool.read_only, tool.idempotent, tool.event_allowed) == (
            spec.read_only,
            spec.idempotent,
            spec.event_allowed,
        )
        assert not tool.honours_call_id and not spec.honours_call_id
        for name in ("input", "output"):
            example = getattr(spec, f"example_{name}")
            assert violation(json.loads(getattr(tool, f"{name}_schema")), example) is None
    assert TOOLS[LIST].read_only and TOOLS[READ].read_only
    # A claim changes the game (a write), but repeating it has the effect of one.
    assert not TOOLS[CLAIM].read_only and TOOLS[CLAIM].idempotent
    assert not TOOLS[CLAIM].event_allowed
    assert mail.PAGE_LIMIT == MAIL_PAGE_LIMIT


# -- the registrations ---------------------------------------------------------------------------


def test_the_inbox_is_a_read_only_local_route_matching_the_corpus_profile() -> None:
    registry = build_registry(EngineConfig())
    corpus = json.loads((ROOT / "router_service/corpus/profiles.json").read_text("utf-8"))
    profiles = {m["id"]: m for m in corpus["modules"]}
    inbox = registry.descriptor("system:inbox")
    assert inbox.routing_mode == catalog_pb2.ROUTING_MODE_READ
    assert inbox.semantic.read_only_tools and inbox.write_steps == 0
    assert registry.get("system:inbox").spec.tools == (LIST, READ)  # type: ignore[union-attr]
    profile = profiles["system:inbox"]
    assert profile["kind"] == "read" and profile["direct"] is True
    examples = {e.language: list(e.examples) for e in inbox.semantic.examples}
    assert examples == profile["examples"]
    assert (inbox.semantic.extractor or None) == profile["extractor"]
    assert inbox.semantic.choice_label == profile["choiceLabel"] == "system.inbox.choice"
    assert [list(c.aliases) for c in inbox.commands] == [
        ["mail", "inbox", "收件箱", "邮件", "邮箱"]
    ]


def test_the_claim_is_a_write_reached_only_by_buttons_and_its_command() -> None:
    registry = build_registry(EngineConfig())
    claim = registry.descriptor("system:mail_claim")
    assert claim.routing_mode == catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY
    assert claim.write_steps == 1 and claim.interactive and not claim.event_allowed
    assert not claim.HasField("semantic")  # no examples: local matching never sees it
    assert registry.get("system:mail_claim").spec.tools == (CLAIM,)  # type: ignore[union-attr]
    assert [list(c.aliases) for c in claim.commands] == [["mailclaim", "领取邮件"]]
    assert claim.commands[0].argument_kind == catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT
    corpus = json.loads((ROOT / "router_service/corpus/profiles.json").read_text("utf-8"))
    assert "system:mail_claim" not in {m["id"] for m in corpus["modules"]}


# -- end to end through the gateway ----------------------------------------------------------------


@pytest.fixture
async def chain(tmp_path: pathlib.Path) -> AsyncIterator[Chain]:
    async with running_chain(tmp_path) as running:
        yield running


def _labels(response) -> list[str]:  # type: ignore[no-untyped-def]
    return [b.label for b in response.reply.result.card.buttons]


def _button(response, label: str) -> common_pb2.CardButton:  # type: ignore[no-untyped-def]
    return next(b for b in response.reply.result.card.buttons if b.label == label)


ZH_PAGE_ONE = [
    "1. Double drops this weekend — Server · 2026-11-30",
    "2. 签到奖励补发 — 系统 · 2026-11-29 [附件]",
    "3. Some iron for you — Alex · 2026-11-28 [附件]",
    "4. 服务器规则 — 服务器 · 2026-11-26",
    "5. Welcome to the server! — Server · 2026-11-25 [附件]",
]


async def test_the_inbox_lists_and_reads_mail_in_chinese_and_english(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    for text in ("收件箱", "/mail", "查看收件箱", "我的邮件"):
        response = await client.chat("steve", text)
        reply = response.reply
        assert reply.module_id == "system:inbox", text
        assert reply.result.status == SUCCEEDED, reply.result.failure
        assert reply.result.card.title == "收件箱（共 6 封，第 1/2 页）"
        assert card_lines(response)[:2] == ZH_PAGE_ONE[:2]
    assert card_lines(response) == ZH_PAGE_ONE  # subjects as their senders wrote them
    assert _labels(response) == [
        "Double drops this weekend",
        "签到奖励补发",
        "Some iron for you",
        "服务器规则",
        "Welcome to the server!",
        "下一页",
    ]
    assert response.reply.result.card.lines[1].suggest_command == "/mail m5"
    # The list is the player's current list: `查看 2` opens the second mail.
    second = await client.chat("steve", "查看 2")
    assert second.reply.module_id == "system:inbox"
    assert second.reply.result.card.title == "签到奖励补发"
    assert card_lines(second) == [
        "发件人：系统",
        "时间：2026-11-29 20:15 UTC",
        "维护期间未发放的签到奖励已补发，请领取附件。",
        "附件：",
        "  钻石 × 2",
        "附件未领取。",
    ]
    assert _labels(second) == ["领取附件", "返回收件箱"]
    for text in ("/inbox", "check my mail", "open my inbox"):
        english = await client.chat("alex", text)
        assert english.reply.module_id == "system:inbox", text
        assert english.reply.result.card.title == "Inbox (6 mails, page 1 of 2)"
    assert card_lines(english)[2] == "3. Some iron for you — Alex · 2026-11-28 [attachment]"
    assert _labels(english)[-1] == "Next page"
    viewed = await client.chat("alex", "/view 3")
    assert viewed.reply.result.card.title == "Some iron for you"
    assert card_lines(viewed)[3:] == ["Attachment:", "  Iron Ingot × 16", "Not claimed yet."]
    assert _labels(viewed) == ["Claim attachment", "Back to inbox"]
    plain = await client.chat("alex", "/mail m6")
    assert plain.reply.result.card.title == "Double drops this weekend"
    assert card_lines(plain) == [
        "From: Server",
        "Sent: 2026-11-30 08:00 UTC",
        "From Saturday to Sunday every mob drops twice as much.",
    ]
    assert _labels(plain) == ["Back to inbox"]  # nothing to claim


async def test_the_inbox_pages(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    first = await client.chat("steve", "/mail")
    second = await client.press("steve", first.reply.result.card, _button(first, "下一页"))
    assert second.reply.result.card.title == "收件箱（共 6 封，第 2/2 页）"
    assert card_lines(second) == ["1. 欢迎来到服务器！ — 服务器 · 2026-11-25 [附件]"]
    assert _labels(second) == ["欢迎来到服务器！", "上一页"]
    # `查看 1` picks from the page shown now.
    opened = await client.chat("steve", "查看 1")
    assert opened.reply.result.card.title == "欢迎来到服务器！"
    assert card_lines(opened)[3:] == ["附件：", "  石剑 × 1", "  面包 × 8", "附件未领取。"]
    back = await client.press("steve", second.reply.result.card, _button(second, "上一页"))
    assert back.reply.result.card.title == "收件箱（共 6 封，第 1/2 页）"
    forged = common_pb2.CardButton(
        action_id="invoke",
        label="forged",
        args={"module_id": "system:inbox", "input": json.dumps({"page": 3})},
    )
    # A button the card never carried runs nothing...
    refused = await client.press("steve", first.reply.result.card, forged)
    assert refused.reply.result.failure.key == "system.error.stale_card"
    # ...and asked for directly, a page past the end says so.
    past = await client.request(
        "alex", invoke=gateway_pb2.Invoke(call=_call("system:inbox", {"page": 3}))
    )
    assert past.reply.result.status == SUCCEEDED
    assert past.reply.result.card.title == "Inbox (6 mails, page 3 of 2)"
    assert card_lines(past) == ["There is no page 3 (there are 2)."]
    assert _labels(past) == []


async def test_claiming_twice_delivers_once(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    inventory = client.world.inventory("steve")
    opened = await client.chat("steve", "/mail m5")
    card = opened.reply.result.card
    claim = _button(opened, "领取附件")
    assert claim.args["module_id"] == "system:mail_claim"
    first = await client.press("steve", card, claim)
    assert first.reply.module_id == "system:mail_claim"
    assert first.reply.result.status == SUCCEEDED, first.reply.result.failure
    assert first.reply.result.card.title == "已领取附件"
    assert card_lines(first) == ["  钻石 × 2", "以上物品已放入背包。"]
    assert inventory["minecraft:diamond"] == 2
    again = await client.press("steve", card, claim)
    assert again.reply.result.status == SUCCEEDED
    assert again.reply.result.card.title == "附件已领取过"
    assert card_lines(again) == ["邮件 m5 的附件之前已经领取，这次没有再发放物品。"]
    assert inventory["minecraft:diamond"] == 2
    reopened = await client.chat("steve", "/mail m5")
    assert card_lines(reopened)[-1] == "附件已领取。"
    assert _labels(reopened) == ["返回收件箱"]
    listed = await client.chat("steve", "/mail")
    assert card_lines(listed)[1] == "2. 签到奖励补发 — 系统 · 2026-11-29 [已领取]"
    # The explicit command, in English.
    by_command = await client.chat("alex", "/mailclaim m4")
    assert by_command.reply.result.card.title == "Attachment claimed"
    assert card_lines(by_command) == ["  Iron Ingot × 16", "These items are now in your inventory."]
    twice = await client.chat("alex", "/mailclaim m4")
    assert twice.reply.result.card.title == "Already claimed"
    assert client.world.inventory("alex")["minecraft:iron_ingot"] == 16


async def test_a_mail_without_attachment_and_unknown_mail(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    before = dict(client.world.inventory("steve"))
    nothing = await client.chat("steve", "/mailclaim m3")
    result = nothing.reply.result
    assert result.status == FAILED and result.failure.key == "system.error.not_found"
    assert result.card.title == "没有附件"
    assert result.failure.message == "邮件 m3 没有附件，没有可领取的物品。"
    for text in ("/mailclaim nope", "/mail nope"):
        unknown = await client.chat("steve", text)
        assert unknown.reply.result.failure.key == "system.error.not_found", text
        assert unknown.reply.result.card.title == "没有这封邮件"
        assert "nope" in unknown.reply.result.failure.message
    english = await client.chat("alex", "/mail nope")
    assert english.reply.result.failure.message == (
        "You have no mail nope. Type /mail to see your inbox."
    )
    # `/mail 2`: no mail has that id, so it is the inbox list's second (newest first), as
    # `view 2` after the list opens it; numbers run on across pages (6: page 2's first).
    listed = await client.chat("alex", "/mail")
    second = await client.chat("alex", "view 2")
    assert second.reply.module_id == "system:inbox"
    assert second.reply.result.card.title == listed.reply.result.card.buttons[1].label
    numbered = await client.chat("alex", "/mail 2")  # the mail's card is on screen now
    assert numbered.reply.result.card.title == second.reply.result.card.title
    total = len(client.world.player("alex").mailbox)
    sixth = (await client.chat("alex", "/mail 6")).reply.result
    assert total >= 6  # the seeded inbox has a second page
    page = listed.reply.result.card
    nexted = await client.press("alex", page, page.buttons[-1])
    assert sixth.card.title == nexted.reply.result.card.buttons[0].label
    past = (await client.chat("alex", f"/mail {total + 1}")).reply.result
    assert past.failure.message == (
        f"Your inbox has no number {total + 1} (it has {total}). Type /mail to see it."
    )
    # A claim takes no list number (a write names its mail): it says how to reach the button.
    claim = (await client.chat("alex", "/mailclaim 2")).reply.result
    assert claim.failure.message == (
        "You have no mail 2. To claim from number 2 of your inbox list, open it (/mail 2) "
        "and press Claim on its card."
    )
    assert dict(client.world.inventory("steve")) == before


async def test_a_claim_is_never_made_from_typed_text(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    opened = await client.chat("steve", "/mail m5")
    assert _labels(opened) == ["领取附件", "返回收件箱"]
    # The claim button is press-only: its typed number says so and claims nothing; the
    # others keep the numbers the card shows (2: back to the inbox).
    typed = await client.chat("steve", "查看 1")
    assert typed.reply.module_id == ""
    assert typed.reply.result.failure.message.startswith("第 1 个按钮需要点击才能生效")
    back = await client.chat("steve", "查看 2")
    assert back.reply.module_id == "system:inbox"
    assert back.reply.result.card.title.startswith("收件箱")
    await client.chat("alex", "/mail m4")
    for player, text in (
        ("steve", "领取邮件附件"),
        ("steve", "帮我把邮件附件都领了"),
        ("steve", "领取附件"),
        ("steve", "收下邮件里的物品"),
        ("alex", "1"),
        ("alex", "claim the attachment"),
        ("alex", "collect my mail attachments"),
        ("alex", "take the items out of my mail"),
    ):
        response = await client.chat(player, text)
        assert response.reply.module_id != "system:mail_claim", text
    assert client.world.inventory("steve")["minecraft:diamond"] == 0
    assert client.world.inventory("alex")["minecraft:iron_ingot"] == 0


@pytest.mark.parametrize("source", [engine_pb2.ROUTE_SOURCE_LOCAL, engine_pb2.ROUTE_SOURCE_CACHE])
async def test_the_engine_refuses_a_claim_from_a_local_or_cached_route(
    chain: Chain, source: int
) -> None:
    client = await chain.steve_and_alex()
    engine = chain.apps["engine"].engine
    player = common_pb2.PlayerContext(
        server_id=chain.server_id,
        player_id=f"{chain.server_id}/steve",
        player_name="Steve",
        language="zh",
    )
    action = common_pb2.ModuleAction(module_id="system:mail_claim")
    action.input.update({"mail_id": "m5"})
    refused = await engine.execute(player, action, "领取邮件附件", source=source)
    assert refused.status == FAILED
    assert refused.failure.key == "system.error.write_not_allowed"
    assert client.world.inventory("steve")["minecraft:diamond"] == 0
    # The same call from a command goes through: the refusal was the route's.
    allowed = await engine.execute(
        player, action, "/mailclaim m5", source=engine_pb2.ROUTE_SOURCE_COMMAND
    )
    assert allowed.status == SUCCEEDED, allowed.failure
    assert client.world.inventory("steve")["minecraft:diamond"] == 2


async def test_bad_input_is_refused_with_a_message(chain: Chain) -> None:
    client = await chain.steve_and_alex()
    missing = await client.chat("alex", "/mailclaim")
    assert missing.reply.result.failure.key == "system.error.invalid_input"
    assert "/mailclaim needs an argument" in missing.reply.result.failure.message
    long = await client.chat("alex", "/mail " + "x" * 65)
    assert long.reply.result.failure.key == "system.error.invalid_input"
    assert "longer than 64 characters" in long.reply.result.failure.message
    listed = (await client.chat("alex", "/mail")).reply.result.card
    for module_id, forged in (
        ("system:inbox", {"page": 0}),
        ("system:inbox", {"page": 1, "mail_id": "m1"}),
        ("system:inbox", {"mail_id": ""}),
        ("system:mail_claim", {}),
        ("system:mail_claim", {"mail_id": "m4", "count": 99}),
    ):
        button = common_pb2.CardButton(
            action_id="invoke",
            label="forged",
            args={"module_id": module_id, "input": json.dumps(forged)},
        )
        # Pressed as if from the card, a forged button runs nothing...
        pressed = await client.press("alex", listed, button)
        assert pressed.reply.result.failure.key == "system.error.stale_card", forged
        # ...and asked for directly, the module refuses the input.
        refused = await client.request(
            "alex", invoke=gateway_pb2.Invoke(call=_call(module_id, forged))
        )
        assert refused.reply.result.failure.key == "system.error.invalid_input", forged
    assert client.world.inventory("alex")["minecraft:iron_ingot"] == 0


def _call(module_id: str, data: dict[str, object]) -> common_pb2.ModuleAction:
    call = common_pb2.ModuleAction(module_id=module_id)
    call.input.update(data)
    return call
