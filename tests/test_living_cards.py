"""Cards that live (issue 18), end to end through the gateway: an answer to a press updates the
card it came from (same id, higher version), the older version's buttons are refused, a
selection card is closed once a choice is made, a button must be one the card carried, and
refusals name the card so clients can translate them. In zh and en."""

from __future__ import annotations

import pathlib

from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

from tests.inprocess import running_chain

SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
STALE = "system.error.stale_card"


def _button(card: common_pb2.Card, label: str) -> common_pb2.CardButton:
    return next(b for b in card.buttons if b.label == label)


async def test_paging_updates_the_card_and_the_older_version_goes_stale(
    tmp_path: pathlib.Path,
) -> None:
    async with running_chain(tmp_path) as chain:
        client = await chain.steve_and_alex()
        first = (await client.chat("steve", "/mail")).reply.result.card
        assert first.ref.version == 1
        second = (await client.press("steve", first, _button(first, "下一页"))).reply
        page2 = second.result.card
        assert (page2.ref.card_id, page2.ref.version) == (first.ref.card_id, 2)
        assert page2.title == "收件箱（共 6 封，第 2/2 页）"
        # The first version's buttons are stale now: refused, nothing runs.
        late = (await client.press("steve", first, _button(first, "下一页"))).reply.result
        assert late.failure.key == STALE
        assert late.failure.message.startswith("这张卡片已更新（当前是第 2 版，按钮来自第 1 版）")
        assert dict(late.failure.args) == {"card_id": first.ref.card_id, "version": "1"}
        # The newest version's buttons work, and update it again.
        back = (await client.press("steve", page2, _button(page2, "上一页"))).reply.result
        assert back.card.ref.version == 3 and back.card.title.endswith("第 1/2 页）")

        # Another player's card is not this player's: unknown to them, refused.
        stolen = (await client.press("alex", page2, _button(page2, "上一页"))).reply.result
        assert stolen.failure.key == STALE
        assert stolen.failure.message.startswith("That card is no longer active")

        # A new /mail is a new card of its own; the one on screen keeps its id and version.
        again = (await client.chat("steve", "/mail")).reply.result.card
        assert again.ref.card_id != first.ref.card_id and again.ref.version == 1


async def test_a_selection_card_closes_once_a_choice_is_made(tmp_path: pathlib.Path) -> None:
    async with running_chain(tmp_path) as chain:
        client = await chain.steve_and_alex()
        # No model in this chain: low-confidence text gets a selection card.
        shown = (await client.chat("alex", "stuff things items")).reply.result.card
        assert shown.template == "system:selection", shown
        choice = shown.buttons[0]
        picked = (await client.press("alex", shown, choice)).reply
        assert picked.result.status == SUCCEEDED
        assert [(c.card_id, c.version) for c in picked.closes] == [
            (shown.ref.card_id, shown.ref.version)
        ]
        again = (await client.press("alex", shown, choice)).reply.result
        assert again.failure.key == STALE
        assert again.failure.message == "That card was closed; ask again."


async def test_a_reconnected_game_server_keeps_its_players_cards(
    tmp_path: pathlib.Path,
) -> None:
    """The book outlives the connection (decision 0030): the newest version's buttons work on
    the new connection, an older version's are still refused, and the next update is numbered
    above what was on screen. The old connection's writes need not have landed yet: what this
    replica has not written is joined into what storage answers."""
    async with running_chain(tmp_path) as chain:
        client = await chain.steve_and_alex()
        first = (await client.chat("steve", "/mail")).reply.result.card
        page2 = (await client.press("steve", first, _button(first, "下一页"))).reply.result.card
        assert page2.ref.version == 2
        fresh = await chain.client()
        await fresh.join("steve", "Steve", "zh_cn")
        late = (await fresh.press("steve", first, _button(first, "下一页"))).reply.result
        assert late.failure.key == STALE
        assert late.failure.message.startswith("这张卡片已更新（当前是第 2 版，按钮来自第 1 版）")
        state = await fresh.control("steve", gateway_pb2.CONTROL_ACTION_STATE)
        assert not state.state.busy  # the refusal ran nothing
        back = (await fresh.press("steve", page2, _button(page2, "上一页"))).reply.result
        assert back.status == SUCCEEDED
        assert (back.card.ref.card_id, back.card.ref.version) == (first.ref.card_id, 3)
        # Page 2 is stale once the press on it made page 1 the third version.
        again = (await fresh.press("steve", page2, _button(page2, "上一页"))).reply.result
        assert again.failure.key == STALE


async def test_typing_claim_presses_the_button_of_the_card_being_viewed(
    tmp_path: pathlib.Path,
) -> None:
    async with running_chain(tmp_path) as chain:
        client = await chain.steve_and_alex()
        iron = lambda: client.world.inventory("alex")["minecraft:iron_ingot"]  # noqa: E731
        mail = (await client.chat("alex", "/mail m4")).reply.result.card
        assert [b.label_key for b in mail.buttons] == ["claim", "back"]
        # Not looking at the card: "claim it" is ordinary text, and a write never routes so.
        blind = (await client.chat("alex", "claim it")).reply
        assert blind.module_id != "system:mail_claim" and iron() == 0
        # Looking at another card with no claim button: nothing is pressed either.
        helped = (await client.chat("alex", "/help")).reply.result.card
        other = (await client.chat("alex", "claim it", viewing=helped)).reply
        assert other.module_id != "system:mail_claim" and iron() == 0
        # A question about the button is not a press of it.
        maybe = (await client.chat("alex", "don't claim it", viewing=mail)).reply
        assert maybe.module_id != "system:mail_claim" and iron() == 0
        # Looking at the mail: the phrase presses its claim button, and only that.
        claimed = (await client.chat("alex", "claim it", viewing=mail)).reply
        assert claimed.module_id == "system:mail_claim"
        assert claimed.result.status == SUCCEEDED and iron() == 16

    async with running_chain(tmp_path / "zh") as chain:
        client = await chain.steve_and_alex()
        mail = (await client.chat("steve", "/mail m4")).reply.result.card
        claimed = (await client.chat("steve", "领取", viewing=mail)).reply
        assert claimed.module_id == "system:mail_claim"
        assert client.world.inventory("steve")["minecraft:iron_ingot"] == 16
        # A stale view (a version no longer on screen) is ignored: nothing is pressed.
        stale = common_pb2.Card()
        stale.CopyFrom(mail)
        stale.ref.version += 1
        again = (await client.chat("steve", "领取", viewing=stale)).reply
        assert again.module_id != "system:mail_claim"


async def test_typing_back_or_next_page_presses_the_viewed_cards_navigation(
    tmp_path: pathlib.Path,
) -> None:
    """The pages' and the back buttons name their kind (`next`, `previous`, `back`), so `next
    page`, `上一页`, `go back` or `返回` typed at the card on screen press them, as `领取` presses
    a claim; typed with no card in view they are ordinary text."""
    async with running_chain(tmp_path) as chain:
        client = await chain.steve_and_alex()
        inbox = (await client.chat("steve", "/mail")).reply.result.card
        assert [b.label_key for b in inbox.buttons][-1] == "next"
        page2 = (await client.chat("steve", "翻页", viewing=inbox)).reply
        assert page2.result.card.title == "收件箱（共 6 封，第 2/2 页）"
        page1 = (await client.chat("steve", "上一页", viewing=page2.result.card)).reply
        assert page1.result.card.title == "收件箱（共 6 封，第 1/2 页）"
        mail = (await client.chat("steve", "/mail m4")).reply.result.card
        back = (await client.chat("steve", "返回", viewing=mail)).reply
        assert back.module_id == "system:inbox" and back.result.card.title.startswith("收件箱")
        blind = (await client.chat("steve", "返回")).reply
        assert blind.module_id != "system:inbox"

        shop = (await client.chat("alex", "/shop")).reply.result.card
        more = (await client.chat("alex", "next page", viewing=shop)).reply.result.card
        assert more.title == "Shop (page 2 of 4)"
        item = (await client.chat("alex", "/shop minecraft:diamond")).reply.result.card
        assert [b.label_key for b in item.buttons][-1] == "back"
        home = (await client.chat("alex", "go back", viewing=item)).reply
        assert home.result.card.title == "Shop (page 1 of 4)"
        quest = (await client.chat("alex", "/quest 1")).reply.result.card
        listed = (await client.chat("alex", "back", viewing=quest)).reply
        assert listed.module_id == "system:quests"


async def test_without_a_model_a_question_gets_the_knowledge_search_on_its_card(
    tmp_path: pathlib.Path,
) -> None:
    """No model in this chain: a question no module matches clearly gets a selection card
    whose last choice searches the knowledge base with the whole text; one press shows what
    it found (the starter knowledge)."""
    async with running_chain(tmp_path) as chain:
        client = await chain.steve_and_alex()
        shown = (await client.chat("alex", "how does paying another player work?")).reply
        card = shown.result.card
        assert card.template == "system:selection"
        choice = card.buttons[-1]
        assert choice.args["module_id"] == "system:question"
        assert choice.label.startswith("Answer a question from the knowledge base: how does")
        answered = (await client.press("alex", card, choice)).reply
        assert answered.module_id == "system:question"
        lines = [line.text for line in answered.result.card.lines]
        assert lines[0] == "No model is available; here is what was found."
        assert any("How buying and paying work" in line for line in lines), lines
