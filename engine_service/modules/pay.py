"""Payments (转账): `system:pay` makes the confirmation card, `system:pay_confirm` pays.

`system:pay` (`/pay <player> <amount>`, 转账, or the model's routing; never a local match or
the intent cache) checks the recipient where the game server offers `minecraft:player.find`
(a name no player has gets a NOT_FOUND card, no offer), reads the payer's balance and makes
the player's current payment offer (engine_service/offers.py, book `system:pay`): recipient,
amount, balance after. Its card has id `system:pay.offer` and the offer's version, so a newer
payment card makes an older one stale. An amount beyond the balance shows why, without a
confirm button.

`system:pay_confirm` has no command and no routing profile: only a structured press of the
card's confirm button (`press_only`) reaches it (engine_service/modules/confirm.py). It pays
once through `minecraft:economy.transfer` under the order id; a second press shows the first
outcome.
"""

from __future__ import annotations

import re
from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.modules.buttons import invoke
from engine_service.modules.confirm import CONFIRM_INPUT, ConfirmTexts, confirm_offer, valid_span
from engine_service.modules.profile import PLAYER_PROFILE
from engine_service.modules.text import pick
from engine_service.offers import OFFER_MAKE, OFFER_TAKE, ORDER_SETTLE
from engine_service.registry import (
    CommandSpec,
    ExecutionPolicy,
    ModuleContext,
    ModuleSpec,
    SemanticSpec,
)
from engine_service.tools import PAY_MAX_AMOUNT
from services.results import AgentFailure, ModuleFailure, card, failed, succeeded

__all__ = ["BOOK", "OFFER_CARD", "TRANSFER", "PayConfirmModule", "PayModule", "parse_payment"]

TRANSFER = "minecraft:economy.transfer"
PLAYER_FIND = "minecraft:player.find"
PAY = "system:pay"
CONFIRM = "system:pay_confirm"
BOOK = "system:pay"
OFFER_CARD = "system:pay.offer"
_NAME = re.compile(r"^[A-Za-z0-9_]{1,32}$")
_TEXT = re.compile(
    r"^(?:给\s*)?(?P<a>[A-Za-z0-9_]{1,32})\s*(?:转账?|付)?\s*(?P<n>-?\d{1,18})\s*(?:金币|coins?)?$"
    r"|^(?P<m>-?\d{1,18})\s*(?:金币|coins?)?\s*(?:给|to)\s*(?P<b>[A-Za-z0-9_]{1,32})$",
    re.IGNORECASE,
)

_TITLE = {"zh": "确认转账", "en": "Confirm payment"}
_TO = {"zh": "收款人：{name}", "en": "To: {name}"}
_AMOUNT = {"zh": "金额：{amount} {currency}", "en": "Amount: {amount:~~{currency}}"}
_BALANCE = {
    "zh": "余额 {balance}，转账后 {after} {currency}",
    "en": "Balance {balance}, {after:~~{currency}} after paying",
}
_VALID = {
    "zh": "{time}内有效；请按“确认转账”按钮。",
    "en": "This holds for {time}; press “Confirm payment”.",
}
_CONFIRM = {"zh": "确认转账", "en": "Confirm payment"}
_CANNOT = {"zh": "无法转账：{reason}", "en": "You cannot pay this: {reason}"}
_SHORT = {
    "zh": "需要 {amount} {currency}，你的余额是 {balance}。",
    "en": "It takes {amount:~~{currency}} and your balance is {balance}.",
}
_SELF = {"zh": "不能给自己转账。", "en": "You cannot pay yourself."}
_USAGE = {
    "zh": "请写明收款人和金额，例如：/pay Alex 100",
    "en": "Name the player and the amount, for example: /pay Alex 100",
}
_AMOUNT_RANGE = {
    "zh": "转账金额须在 1 到 {most} 之间，例如：/pay Alex 100",
    "en": "The amount must be from 1 to {most}, for example: /pay Alex 100",
}
_DONE_TITLE = {"zh": "转账成功", "en": "Payment sent"}
_PAID = {"zh": "已向 {name} 转账 {amount} {currency}", "en": "Paid {amount:~~{currency}} to {name}"}
_LEFT = {"zh": "余额：{balance} {currency}", "en": "Balance: {balance:~~{currency}}"}
_ORDER = {"zh": "订单号：{order}", "en": "Order: {order}"}
_REPLAYED = {
    "zh": "这笔转账之前已经完成，这次没有再扣款。",
    "en": "This payment was made before; nothing was paid again.",
}
_INSUFFICIENT_TITLE = {"zh": "余额不足", "en": "Not enough money"}
_INSUFFICIENT = {
    "zh": "需要 {amount} {currency}，你的余额是 {balance}。没有转账。",
    "en": "It takes {amount:~~{currency}} and your balance is {balance}. Nothing was paid.",
}
_UNKNOWN_TITLE = {"zh": "没有这个玩家", "en": "No such player"}
_UNKNOWN = {
    "zh": "服务器上没有名为 {name} 的玩家。没有转账。",
    "en": "There is no player called {name} on this server. Nothing was paid.",
}
_NO_PLAYER = {
    "zh": "服务器上没有名为 {name} 的玩家，请检查名字。",
    "en": "There is no player called {name} on this server; check the name.",
}
_STALE_TITLE = {"zh": "转账卡片已失效", "en": "This payment card is no longer valid"}
_STALE = {
    "zh": "这张转账卡片已被更新的卡片取代或已作废。没有转账；请重新发起。",
    "en": "A newer payment card replaced this one, or it was withdrawn. Nothing was paid; "
    "start the payment again.",
}
_EXPIRED = {
    "zh": "这张转账卡片已超过有效期。没有转账；请重新发起。",
    "en": "This payment card has expired. Nothing was paid; start the payment again.",
}
_CONFIRM_TEXTS = ConfirmTexts(stale_title=_STALE_TITLE, stale=_STALE, expired=_EXPIRED)


def parse_payment(text: str) -> tuple[str, int] | None:
    """`Alex 100`, `给 Alex 转账 100`, `100 金币给 Alex`, `100 coins to Alex` → (name, amount)."""
    match = _TEXT.match(text.strip())
    if match is None:
        return None
    name = match["a"] or match["b"]
    amount = int(match["n"] or match["m"])
    return name, amount


class PayModule:
    """Makes the confirmation card of a payment to another player."""

    spec = ModuleSpec(
        module_id=PAY,
        description={
            "zh": "给其他玩家转账：先显示确认卡片（收款人、金额、转账后余额），按“确认转账”后才"
            "扣款。",
            "en": "Pay another player: first a confirmation card (recipient, amount, balance "
            "after); nothing is paid until Confirm is pressed.",
        },
        input_schema={
            "type": "object",
            "properties": {
                "to": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 48,
                    "description": "The recipient's player name (or `Alex 100`: name and amount).",
                },
                "amount": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": PAY_MAX_AMOUNT,
                    "description": "How much to pay.",
                },
            },
            "required": ["to"],
            "additionalProperties": False,
        },
        commands=(
            CommandSpec(
                ("pay", "转账", "付款"),
                argument="to",
                argument_required=True,
                argument_label={"zh": "玩家 金额", "en": "player amount"},
            ),
        ),
        routing_mode=catalog_pb2.ROUTING_MODE_HINTS,
        semantic=SemanticSpec(
            examples={
                "zh": (
                    "给 Steve 转账 100",
                    "支付 50 金币",
                    "付款",
                    "转钱给朋友",
                    "把金币转给别人",
                    "确认付款",
                    "付钱给 Alex",
                    "转 200 金币给 Notch",
                ),
                "en": (
                    "pay Steve 100 coins",
                    "send money to Alex",
                    "transfer 50 coins",
                    "make a payment",
                    "give coins to a friend",
                    "confirm payment",
                    "pay Alex",
                    "send 200 coins to Notch",
                ),
            }
        ),
        tools=(PLAYER_PROFILE, OFFER_MAKE),
        optional_tools=(PLAYER_FIND,),
        policy=ExecutionPolicy(
            rounds=1, model_calls=0, tool_calls=3, steps=3, seconds=15.0, write_steps=1
        ),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        to = str(data["to"]).strip()
        if "amount" in data:
            amount = int(data["amount"])
        else:
            parsed = parse_payment(to)
            if parsed is None:
                raise ModuleFailure(AgentFailure.INVALID_INPUT, pick(_USAGE, language))
            to, amount = parsed
        if not _NAME.match(to):
            raise ModuleFailure(AgentFailure.INVALID_INPUT, pick(_USAGE, language))
        if not 1 <= amount <= PAY_MAX_AMOUNT:
            raise ModuleFailure(
                AgentFailure.INVALID_INPUT,
                pick(_AMOUNT_RANGE, language, most=f"{PAY_MAX_AMOUNT:,}"),
            )
        try:
            found = await ctx.tool(PLAYER_FIND, {"name": to})
        except ModuleFailure as failure:
            # A game server without the lookup: the name is checked when the payment is made.
            if failure.failure is not AgentFailure.TOOL_UNAVAILABLE:
                raise
        else:
            if not found["found"]:
                unknown = failed(
                    AgentFailure.NOT_FOUND,
                    pick(_NO_PLAYER, language, name=to),
                    title=pick(_UNKNOWN_TITLE, language),
                )
                unknown.card.template = PAY
                return unknown
            to = found["name"]
        profile = await ctx.tool(PLAYER_PROFILE, {})
        balance, currency = profile["balance"], profile["currency"]
        money = pick(currency, language)
        lines: list[str | tuple[str, str]] = [
            pick(_TO, language, name=to),
            pick(_AMOUNT, language, amount=amount, currency=money),
        ]
        if balance >= amount:  # short of money, the refusal below says the balance instead
            after = balance - amount
            lines.append(pick(_BALANCE, language, balance=balance, after=after, currency=money))
        title = pick(_TITLE, language)
        if to.casefold() == (ctx.player.player_name or "").casefold():
            return succeeded(
                card(PAY, title, [*lines, pick(_CANNOT, language, reason=pick(_SELF, language))])
            )
        if balance < amount:
            reason = pick(_SHORT, language, amount=amount, currency=money, balance=balance)
            return succeeded(card(PAY, title, [*lines, pick(_CANNOT, language, reason=reason)]))
        offer = await ctx.tool(
            OFFER_MAKE,
            {"book": BOOK, "terms": {"to": to, "amount": amount, "currency": currency}},
        )
        lines.append(pick(_VALID, language, time=valid_span(offer["valid_seconds"], language)))
        confirm = invoke(
            CONFIRM,
            pick(_CONFIRM, language),
            {"offer_id": offer["offer_id"], "version": offer["version"]},
            press_only=True,
            label_key="confirm",
        )
        offered = card(PAY, title, lines, [confirm])
        offered.ref.card_id = OFFER_CARD
        offered.ref.version = offer["version"]
        return succeeded(offered)


class PayConfirmModule:
    """Confirms a payment card: takes the offer, pays once, settles the order."""

    spec = ModuleSpec(
        module_id=CONFIRM,
        description={
            "zh": "确认转账（仅限转账卡片上的“确认转账”按钮）；同一张卡片只付一次款。",
            "en": "Confirm a payment (only the Confirm button of a payment card); one card pays "
            "at most once.",
        },
        input_schema=CONFIRM_INPUT,
        routing_mode=catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY,
        tools=(OFFER_TAKE, TRANSFER, ORDER_SETTLE),
        policy=ExecutionPolicy(
            rounds=1, model_calls=0, tool_calls=3, steps=3, seconds=20.0, write_steps=3
        ),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language

        async def transfer(order: dict[str, Any]) -> dict[str, Any]:
            terms = order["terms"]
            return await ctx.tool(
                TRANSFER,
                {"order_id": order["order_id"], "to": terms["to"], "amount": terms["amount"]},
            )

        back = invoke("system:profile", pick({"zh": "本人概况", "en": "My profile"}, language), {})
        applied = await confirm_offer(
            ctx,
            BOOK,
            data,
            transfer,
            lambda outcome: outcome["outcome"] == "transferred",
            _CONFIRM_TEXTS,
            back,
        )
        if isinstance(applied, common_pb2.AgentResult):
            return applied
        paid, terms = applied.outcome, applied.terms
        money = pick(terms["currency"], language)
        if paid["outcome"] == "transferred":
            lines = [
                pick(_PAID, language, name=paid["to"], amount=paid["amount"], currency=money),
                pick(_LEFT, language, balance=paid["balance"], currency=money),
                pick(_ORDER, language, order=paid["order_id"]),
            ]
            if applied.replayed:
                lines.append(pick(_REPLAYED, language))
            return succeeded(card(CONFIRM, pick(_DONE_TITLE, language), lines, [back]))
        if paid["outcome"] == "insufficient_balance":
            key, title = AgentFailure.INSUFFICIENT_BALANCE, _INSUFFICIENT_TITLE
            message = pick(
                _INSUFFICIENT,
                language,
                amount=paid["amount"],
                currency=money,
                balance=paid["balance"],
            )
        elif paid["outcome"] == "unknown_player":
            key, title = AgentFailure.NOT_FOUND, _UNKNOWN_TITLE
            message = pick(_UNKNOWN, language, name=paid["to"])
        else:  # self_payment
            key, title = AgentFailure.INVALID_INPUT, _TITLE
            message = pick(_SELF, language)
        result = failed(key, message, title=pick(title, language))
        result.card.template = CONFIRM
        result.card.buttons.append(back)
        return result
