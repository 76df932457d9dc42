"""A button on a card still on screen is refused once the player lost what it needs (issue 18),
end to end through the gateway: the card is current (neither stale nor closed), so the refusal
is `system.error.permission_denied`, and nothing runs; the card's other buttons still work.
Lost by a lower permission level (an admin command's button on `/help`) and by a revoke."""

from __future__ import annotations

import asyncio
import pathlib

from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

from tests.inprocess import running_chain

SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
DENIED = "system.error.permission_denied"


def _button(card: common_pb2.Card, label: str) -> common_pb2.CardButton:
    return next(b for b in card.buttons if b.label == label)


async def test_a_press_after_the_permission_was_lost_is_refused(tmp_path: pathlib.Path) -> None:
    async with running_chain(tmp_path, credentials=True) as chain:
        client = await chain.client()
        await client.join("op", "Op", "en_us", permission_level=3)
        await client.join("zhop", "Zhop", "zh_cn", permission_level=3)
        helped = (await client.chat("op", "/help")).reply.result.card
        routing = _button(helped, "/routing")  # shown to an admin only
        assert dict(routing.args) == {"module_id": "system:routing"}
        # Pressed while still an admin, the button runs (and the card stays on screen: the
        # diagnostics come as a card of their own).
        shown = (await client.press("op", helped, routing)).reply.result
        assert shown.status == SUCCEEDED and shown.card.title == "Routing diagnostics"

        await client.update("op", "en_us", permission_level=0)
        refused = (await client.press("op", helped, routing)).reply.result
        assert refused.status != SUCCEEDED
        assert refused.failure.key == DENIED
        assert "system:routing" in refused.failure.message
        assert refused.card.title != "Routing diagnostics"
        # The card is not stale: its buttons the player may still use run.
        history = (await client.press("op", helped, _button(helped, "/history"))).reply.result
        assert history.status == SUCCEEDED
        # The same in zh, for a button of another admin command.
        zh_help = (await client.chat("zhop", "/help")).reply.result.card
        await client.update("zhop", "zh_cn", permission_level=1)
        usage = (await client.press("zhop", zh_help, _button(zh_help, "/usage"))).reply.result
        assert usage.failure.key == DENIED


async def test_a_press_after_a_revoke_is_refused(tmp_path: pathlib.Path) -> None:
    async with running_chain(tmp_path, credentials=True) as chain:
        client = await chain.client()
        await client.join("op", "Op", "en_us", permission_level=3)
        await client.join("steve", "Steve", "zh_cn")
        mail = (await client.chat("steve", "/mail")).reply.result.card
        next_page = _button(mail, "下一页")

        done = (await client.chat("op", "/system revoke steve")).reply.result
        assert done.status == SUCCEEDED
        frame = await asyncio.wait_for(client.notices.get(), 5)
        assert frame.binding.change == gateway_pb2.BINDING_CHANGE_REVOKED
        refused = (await client.press("steve", mail, next_page)).reply.result
        assert refused.failure.key == DENIED and "停用" in refused.failure.message
        assert not refused.card.title.startswith("收件箱")  # the next page was never read

        granted = (await client.chat("op", "/system grant steve")).reply.result
        assert granted.status == SUCCEEDED
        turned = (await client.press("steve", mail, next_page)).reply.result
        assert turned.status == SUCCEEDED and turned.card.ref.version == 2
