"""`system:inbox` (收件箱) and `system:mail_claim` (领取邮件附件), over the game tools
`minecraft:mail.list`, `minecraft:mail.read` and `minecraft:mail.claim`: the mail lives in the
game server, like the inventory.

`system:inbox` reads only, so local routing may pick it: `/mail` (收件箱, 我的邮件) lists the
newest page, one button per mail and one per neighbouring page; pressing a mail's button, or
`查看 2` / `/view 2` (the number in the player's last list), `/mail m5` (its id) or `/mail 2`
(its number in the inbox list, newest first, numbered on across pages) opens it.

`system:mail_claim` is a write and is never routed from free text, the intent cache or the
model (STRUCTURED_ONLY): only the claim button on the mail's card and the command
`/mailclaim <id>` reach it. The button is marked `press_only`, so a typed number never presses
it. The claim is one game-tool call that delivers the items and marks the mail claimed
together, once per mail: a repeated claim (a second press, a retry) gives nothing and says so.
"""

from __future__ import annotations

import datetime
from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.modules.buttons import invoke
from engine_service.modules.text import pick
from engine_service.registry import (
    CommandSpec,
    ExecutionPolicy,
    ModuleContext,
    ModuleSpec,
    SemanticSpec,
)
from services.results import AgentFailure, card, failed, succeeded

__all__ = ["MAIL_CLAIM", "MAIL_LIST", "MAIL_READ", "PAGE_SIZE", "InboxModule", "MailClaimModule"]

MAIL_LIST = "minecraft:mail.list"
MAIL_READ = "minecraft:mail.read"
MAIL_CLAIM = "minecraft:mail.claim"
INBOX = "system:inbox"
CLAIM = "system:mail_claim"
PAGE_SIZE = 5
"""Mails per page of the inbox card."""
MAX_PAGE = 1000

_MAIL_LABEL = {"zh": "邮件序号或 ID", "en": "mail number or id"}
"""How help writes `/mail`'s argument: a number of the inbox list, or a mail's id."""
_MAIL_ID_LABEL = {"zh": "邮件 ID", "en": "mail id"}
"""How help writes `/mailclaim`'s argument: a mail's id (the claim button carries it)."""
_MAIL_ID = {
    "type": "string",
    "minLength": 1,
    "maxLength": 64,
    "description": "The mail's id, as the list shows it (m5).",
}

_INBOX_TITLE = {"zh": "收件箱（共 {total} 封）", "en": "Inbox ({total:~mail})"}
_INBOX_PAGED = {
    "zh": "收件箱（共 {total} 封，第 {page}/{pages} 页）",
    "en": "Inbox ({total:~mail}, page {page} of {pages})",
}
_EMPTY = {"zh": "收件箱是空的。", "en": "Your inbox is empty."}
_NO_PAGE = {
    "zh": "没有第 {page} 页（共 {pages} 页）。",
    "en": "There is no page {page} (there are {pages}).",
}
_ENTRY = {
    "zh": "{n}. {subject} — {sender} · {date}{mark}",
    "en": "{n}. {subject} — {sender} · {date}{mark}",
}
_UNCLAIMED_MARK = {"zh": " [附件]", "en": " [attachment]"}
_CLAIMED_MARK = {"zh": " [已领取]", "en": " [claimed]"}
_PREVIOUS = {"zh": "上一页", "en": "Previous page"}
_NEXT = {"zh": "下一页", "en": "Next page"}

_FROM = {"zh": "发件人：{sender}", "en": "From: {sender}"}
_SENT = {"zh": "时间：{date}", "en": "Sent: {date}"}
_ATTACHMENT = {"zh": "附件：", "en": "Attachment:"}
_STACK = {"zh": "  {name} × {count}", "en": "  {name} × {count}"}
_UNCLAIMED = {"zh": "附件未领取。", "en": "Not claimed yet."}
_CLAIMED = {"zh": "附件已领取。", "en": "Claimed."}
_CLAIM_BUTTON = {"zh": "领取附件", "en": "Claim attachment"}
_BACK = {"zh": "返回收件箱", "en": "Back to inbox"}
_NO_MAIL_TITLE = {"zh": "没有这封邮件", "en": "No such mail"}
_NO_MAIL = {
    "zh": "没有编号为 {mail_id} 的邮件。输入 /mail 查看收件箱。",
    "en": "You have no mail {mail_id}. Type /mail to see your inbox.",
}
_CLAIM_BY_NUMBER = {
    "zh": "没有编号为 {mail_id} 的邮件。要领取收件箱列表里第 {mail_id} 封的附件，请先打开它"
    "（/mail {mail_id}），再按邮件卡片上的“领取附件”。",
    "en": "You have no mail {mail_id}. To claim from number {mail_id} of your inbox list, "
    "open it (/mail {mail_id}) and press Claim on its card.",
}
_NO_NUMBER = {
    "zh": "收件箱列表里没有第 {number} 封（共 {total} 封）。输入 /mail 查看收件箱。",
    "en": "Your inbox has no number {number} (it has {total}). Type /mail to see it.",
}

_CLAIMED_TITLE = {"zh": "已领取附件", "en": "Attachment claimed"}
_DELIVERED = {"zh": "以上物品已放入背包。", "en": "These items are now in your inventory."}
_ALREADY_TITLE = {"zh": "附件已领取过", "en": "Already claimed"}
_ALREADY = {
    "zh": "邮件 {mail_id} 的附件之前已经领取，这次没有再发放物品。",
    "en": "You claimed the attachment of mail {mail_id} before; nothing was given this time.",
}
_NO_ATTACHMENT_TITLE = {"zh": "没有附件", "en": "No attachment"}
_NO_ATTACHMENT = {
    "zh": "邮件 {mail_id} 没有附件，没有可领取的物品。",
    "en": "Mail {mail_id} has no attachment; there is nothing to claim.",
}


def _date(sent_at: int) -> str:
    return datetime.datetime.fromtimestamp(sent_at, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _stacks(mail_stacks: list[dict[str, Any]], language: str) -> list[str | tuple[str, str]]:
    return [
        (
            pick(_STACK, language, name=pick(s["name"], language), count=s["count"]),
            f"/item {s['item']}",
        )
        for s in mail_stacks
    ]


def _not_found(mail_id: str, language: str, claiming: bool = False) -> common_pb2.AgentResult:
    message = pick(_NO_MAIL, language, mail_id=mail_id)
    if claiming and mail_id.isdigit():  # `/mailclaim 2` meant the list's second mail
        message = pick(_CLAIM_BY_NUMBER, language, mail_id=mail_id)
    return failed(AgentFailure.NOT_FOUND, message, title=pick(_NO_MAIL_TITLE, language))


class InboxModule:
    """Lists a page of the player's mail, or shows one mail."""

    spec = ModuleSpec(
        module_id=INBOX,
        description={
            "zh": "查看收件箱：邮件列表（最新在前，分页）和单封邮件；附件在邮件卡片上领取。",
            "en": "Your inbox: the mail list (newest first, by page) and one mail; claim an "
            "attachment from the mail's card.",
        },
        input_schema={
            "type": "object",
            "properties": {
                "page": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAX_PAGE,
                    "description": "The page of the list to show, from 1.",
                },
                "mail_id": {
                    **_MAIL_ID,
                    "description": "Show this mail instead of the list: its id (m5), or its "
                    "number in the inbox list (3: the third, newest first).",
                },
            },
            "maxProperties": 1,
            "additionalProperties": False,
        },
        commands=(
            CommandSpec(
                ("mail", "inbox", "收件箱", "邮件", "邮箱"),
                argument="mail_id",
                argument_label=_MAIL_LABEL,
            ),
        ),
        routing_mode=catalog_pb2.ROUTING_MODE_READ,
        semantic=SemanticSpec(
            examples={
                "zh": (
                    "查看收件箱",
                    "打开邮箱",
                    "我的邮件",
                    "有没有新邮件",
                    "查看未读邮件",
                    "显示邮件列表",
                    "看看信箱",
                    "收件箱里有什么",
                    "查收邮件",
                    "我收到了哪些邮件",
                ),
                "en": (
                    "open my inbox",
                    "check my mail",
                    "show my mailbox",
                    "do I have new mail",
                    "show unread mail",
                    "list the mail in my inbox",
                    "read my mail",
                    "what's in my inbox",
                ),
            },
            choice_label="system.inbox.choice",
        ),
        tools=(MAIL_LIST, MAIL_READ),
        # A list number takes three calls: the id tried, the list's page, that mail.
        policy=ExecutionPolicy(rounds=1, model_calls=0, tool_calls=3, steps=3, seconds=10.0),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        if "mail_id" in data:
            mail_id = str(data["mail_id"]).strip()
            opened = await self._open(mail_id, ctx)
            if opened is not None:
                return opened
            if mail_id.isdigit() and 1 <= int(mail_id) <= MAX_PAGE * PAGE_SIZE:
                # No mail has that id: `/mail 3` means the third of the list, as /quest 3 does.
                return await self._by_number(int(mail_id), ctx)
            return _not_found(mail_id, language)
        page = int(data.get("page", 1))
        listed = await ctx.tool(MAIL_LIST, {"page": page, "page_size": PAGE_SIZE})
        return succeeded(self._list_card(listed, language))

    async def _by_number(self, number: int, ctx: ModuleContext) -> common_pb2.AgentResult:
        """The number-th mail of the inbox list (newest first, numbered from 1 across pages)."""
        language = ctx.player.language
        page, offset = divmod(number - 1, PAGE_SIZE)
        listed = await ctx.tool(MAIL_LIST, {"page": page + 1, "page_size": PAGE_SIZE})
        if offset >= len(listed["mails"]):
            message = pick(_NO_NUMBER, language, number=number, total=listed["total"])
            return failed(AgentFailure.NOT_FOUND, message, title=pick(_NO_MAIL_TITLE, language))
        mail_id = listed["mails"][offset]["id"]
        opened = await self._open(mail_id, ctx)
        # None: gone between the list and the read.
        return opened if opened is not None else _not_found(mail_id, language)

    async def _open(self, mail_id: str, ctx: ModuleContext) -> common_pb2.AgentResult | None:
        """The card of the mail with id `mail_id`; None when the player has no such mail."""
        found = await ctx.tool(MAIL_READ, {"mail_id": mail_id})
        if not found["found"] or "mail" not in found:
            return None
        return succeeded(self._mail_card(found["mail"], ctx.player.language))

    @staticmethod
    def _list_card(listed: dict[str, Any], language: str) -> common_pb2.Card:
        total, page, size = listed["total"], listed["page"], listed["page_size"]
        pages = max((total + size - 1) // size, 1)
        title = (
            pick(_INBOX_PAGED, language, total=total, page=page, pages=pages)
            if pages > 1 or page > 1
            else pick(_INBOX_TITLE, language, total=total)
        )
        lines: list[str | tuple[str, str]] = []
        buttons = []
        for number, mail in enumerate(listed["mails"], 1):
            mark = ""
            if mail["attachment"]:
                mark = pick(_CLAIMED_MARK if mail["claimed"] else _UNCLAIMED_MARK, language)
            text = pick(
                _ENTRY,
                language,
                n=number,
                subject=mail["subject"],
                sender=mail["sender"],
                date=_date(mail["sent_at"])[:10],
                mark=mark,
            )
            lines.append((text, f"/mail {mail['id']}"))
            buttons.append(invoke(INBOX, mail["subject"], {"mail_id": mail["id"]}))
        if not listed["mails"]:
            lines.append(
                pick(_NO_PAGE, language, page=page, pages=pages)
                if total
                else pick(_EMPTY, language)
            )
        if 1 < page <= pages:
            buttons.append(
                invoke(INBOX, pick(_PREVIOUS, language), {"page": page - 1}, label_key="previous")
            )
        if page < pages:
            buttons.append(
                invoke(INBOX, pick(_NEXT, language), {"page": page + 1}, label_key="next")
            )
        return card(INBOX, title, lines, buttons)

    @staticmethod
    def _mail_card(mail: dict[str, Any], language: str) -> common_pb2.Card:
        lines: list[str | tuple[str, str]] = [
            pick(_FROM, language, sender=mail["sender"]),
            pick(_SENT, language, date=_date(mail["sent_at"])),
            mail["body"],
        ]
        buttons = []
        if mail["attachment"]:
            lines.append(pick(_ATTACHMENT, language))
            lines += _stacks(mail["attachment"], language)
            lines.append(pick(_CLAIMED if mail["claimed"] else _UNCLAIMED, language))
            if not mail["claimed"]:
                # press_only: a typed number (查看 1) never presses a write button.
                buttons.append(
                    invoke(
                        CLAIM,
                        pick(_CLAIM_BUTTON, language),
                        {"mail_id": mail["id"]},
                        press_only=True,
                        label_key="claim",
                    )
                )
        buttons.append(invoke(INBOX, pick(_BACK, language), {}, label_key="back"))
        return card(INBOX, mail["subject"], lines, buttons)


class MailClaimModule:
    """Claims one mail's attachment: one write step."""

    spec = ModuleSpec(
        module_id=CLAIM,
        description={
            "zh": "领取邮件附件（在邮件卡片上按“领取附件”）。每封邮件只能领取一次。",
            "en": "Claim a mail's attachment (the Claim button on the mail's card). Once per mail.",
        },
        input_schema={
            "type": "object",
            "properties": {"mail_id": _MAIL_ID},
            "required": ["mail_id"],
            "additionalProperties": False,
        },
        commands=(
            CommandSpec(
                ("mailclaim", "领取邮件"),
                argument="mail_id",
                argument_required=True,
                argument_label=_MAIL_ID_LABEL,
            ),
        ),
        routing_mode=catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY,
        tools=(MAIL_CLAIM,),
        policy=ExecutionPolicy(
            rounds=1, model_calls=0, tool_calls=1, steps=1, seconds=15.0, write_steps=1
        ),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        mail_id = str(data["mail_id"]).strip()
        # A write step: refused from local and cached routes before it leaves the engine.
        claimed = await ctx.tool(MAIL_CLAIM, {"mail_id": mail_id})
        outcome = claimed["outcome"]
        if outcome == "not_found":
            return _not_found(mail_id, language, claiming=True)
        if outcome == "no_attachment":
            return failed(
                AgentFailure.NOT_FOUND,
                pick(_NO_ATTACHMENT, language, mail_id=mail_id),
                title=pick(_NO_ATTACHMENT_TITLE, language),
            )
        back = invoke(INBOX, pick(_BACK, language), {}, label_key="back")
        if outcome == "already_claimed":
            return succeeded(
                card(
                    CLAIM,
                    pick(_ALREADY_TITLE, language),
                    [pick(_ALREADY, language, mail_id=mail_id)],
                    [back],
                )
            )
        lines = [*_stacks(claimed["items"], language), pick(_DELIVERED, language)]
        return succeeded(card(CLAIM, pick(_CLAIMED_TITLE, language), lines, [back]))
