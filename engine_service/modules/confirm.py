"""The confirmation half of an offer (engine_service/offers.py), shared by every module whose
write waits for a confirm button: the shop's purchase, a payment.

A confirm module calls `confirm_offer` with its book, the pressed offer and how to apply the
order on the game server. In order: only a structured button press may confirm (the seed's
check of the explicit route source, beside STRUCTURED_ONLY); the offer is taken (stale or
expired: a failure card, nothing done); an order settled before answers its first outcome,
nothing done now; otherwise the order is applied under its id, which the game server decides
once, and settled. A game-server call that fails leaves the order placed and answers
EFFECT_UNKNOWN, or, when it certainly never reached the game server (NotDelivered), says that
nothing happened: either way the next press of the same card asks again under the same id.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2

from engine_service.modules.text import pick
from engine_service.offers import OFFER_TAKE, ORDER_SETTLE
from engine_service.registry import ModuleContext
from services.results import AgentFailure, ModuleFailure, NotDelivered, failed

__all__ = ["CONFIRM_INPUT", "Applied", "ConfirmTexts", "confirm_offer", "valid_span"]

CONFIRM_INPUT = {
    "type": "object",
    "properties": {
        "offer_id": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
        "version": {"type": "integer", "minimum": 1},
    },
    "required": ["offer_id", "version"],
    "additionalProperties": False,
}
"""The input of every confirm module: the offer and the version its card showed."""

_MINUTES = {"zh": "{n} 分钟", "en": "{n:~minute}"}
_SECONDS = {"zh": "{n} 秒", "en": "{n:~second}"}


def valid_span(seconds: int, language: str) -> str:
    """How long an offer's card holds, as its line says it: whole minutes as minutes (`5
    minutes`, `5 分钟`), anything else in seconds (`90 seconds`)."""
    minutes, rest = divmod(seconds, 60)
    if minutes and not rest:
        return pick(_MINUTES, language, n=minutes)
    return pick(_SECONDS, language, n=seconds)


_BUTTON_ONLY = {
    "zh": "这项操作只能通过确认卡片上的按钮进行。",
    "en": "This is confirmed only with the button on its confirmation card.",
}
_NOT_SENT_TITLE = {"zh": "尚未执行", "en": "Not done yet"}
_NOT_SENT = {
    "zh": "订单 {order} 尚未执行：没能联系到游戏服务器（{reason}），什么都没有发生。稍后再按一次"
    "确认按钮即可完成，不会重复执行。",
    "en": "Order {order} was not carried out: the game server could not be reached ({reason}), "
    "so nothing happened. Press the confirm button again in a moment to finish it; it will "
    "not happen twice.",
}
_UNKNOWN_TITLE = {"zh": "结果未知", "en": "Outcome unknown"}
_UNKNOWN = {
    "zh": "订单 {order} 已记录，但游戏服务器没有确认是否完成（{reason}）。再按一次确认按钮即可"
    "查明并完成，不会重复执行。",
    "en": "Order {order} is recorded, but the game server did not confirm it ({reason}). Press "
    "the confirm button again to find out and finish it; it will not happen twice.",
}


@dataclasses.dataclass(frozen=True)
class ConfirmTexts:
    """A confirm module's own words for a card that can no longer be confirmed."""

    stale_title: dict[str, str]
    stale: dict[str, str]
    """Replaced by a newer offer, or withdrawn."""
    expired: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Applied:
    """An order's outcome on the game server."""

    terms: dict[str, Any]
    """What was offered (the offer's terms)."""
    outcome: dict[str, Any]
    """The game tool's answer."""
    replayed: bool
    """True when the order was decided before and nothing was done now."""


async def confirm_offer(
    ctx: ModuleContext,
    book: str,
    data: dict[str, Any],
    apply: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
    succeeded_when: Callable[[dict[str, Any]], bool],
    texts: ConfirmTexts,
    back: common_pb2.CardButton,
) -> Applied | common_pb2.AgentResult:
    """Takes the pressed offer and applies its order once.

    Args:
        apply: calls the game tool for an order (its `order_id` and `terms`); its answer must
            carry `replayed`.
        succeeded_when: whether an answer settles the order as completed (else rejected).
        back: the button a failure card offers.

    Returns:
        The applied order, or the failure result to show as it is.
    """
    language = ctx.player.language
    if ctx.source != engine_pb2.ROUTE_SOURCE_BUTTON:
        return failed(AgentFailure.WRITE_NOT_ALLOWED, pick(_BUTTON_ONLY, language))
    taken = await ctx.tool(
        OFFER_TAKE, {"book": book, "offer_id": data["offer_id"], "version": data["version"]}
    )
    if taken["outcome"] in ("stale", "expired"):
        message = texts.stale if taken["outcome"] == "stale" else texts.expired
        result = failed(
            AgentFailure.STALE_CARD,
            pick(message, language),
            title=pick(texts.stale_title, language),
        )
        result.card.buttons.append(back)
        return result
    order = taken["order"]
    if order["state"] != "placed":  # settled before: its outcome, nothing done now
        return Applied(order["terms"], order["outcome"], replayed=True)
    try:
        outcome = await apply(order)
    except NotDelivered as failure:
        # The call certainly never reached the game server: nothing happened, and the order
        # stays placed for the next press.
        return failed(
            failure.failure,
            pick(_NOT_SENT, language, order=order["order_id"], reason=failure.message),
            title=pick(_NOT_SENT_TITLE, language),
        )
    except ModuleFailure as failure:
        return failed(
            AgentFailure.EFFECT_UNKNOWN,
            pick(_UNKNOWN, language, order=order["order_id"], reason=failure.message),
            title=pick(_UNKNOWN_TITLE, language),
        )
    state = "completed" if succeeded_when(outcome) else "rejected"
    # Should settling fail, the game server applied it all the same: the next press of the
    # card settles the order (the game server answers the known order id again).
    with contextlib.suppress(ModuleFailure):
        await ctx.tool(
            ORDER_SETTLE,
            {
                "book": book,
                "order": order,
                "order_version": taken["order_version"],
                "state": state,
                "outcome": outcome,
            },
        )
    return Applied(order["terms"], outcome, replayed=bool(outcome.get("replayed")))
