"""Players' mail in the simulated world: what `minecraft:mail.list`, `minecraft:mail.read` and
`minecraft:mail.claim` answer (docs/game-tools.md).

Every player starts with the same six mails (`seed`), some in Chinese and some in English as
their senders wrote them, four with an attachment. There is no read state: listing and reading
change nothing. Claiming puts the attachment into the inventory and marks the mail claimed in
one call (tools run one at a time, as on a game's main thread), once per mail.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import Any

from services.gamesim import items

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "PAGE_LIMIT",
    "Mail",
    "claim",
    "list_page",
    "read",
    "seed",
]

PAGE_LIMIT = 10
"""Most mails one page holds."""
DEFAULT_PAGE_SIZE = 5


@dataclasses.dataclass
class Mail:
    """One mail in a player's mailbox."""

    mail_id: str
    sender: str
    subject: str
    body: str
    sent_at: int
    """Seconds since 1970-01-01 UTC."""
    attachment: tuple[tuple[str, int], ...] = ()
    """(item id, count) stacks."""
    claimed: bool = False

    def as_tool_output(self) -> dict[str, Any]:
        return {
            "id": self.mail_id,
            "sender": self.sender,
            "subject": self.subject,
            "body": self.body,
            "sent_at": self.sent_at,
            "attachment": _stacks(self.attachment),
            "claimed": self.claimed,
        }


def _stacks(stacks: tuple[tuple[str, int], ...]) -> list[dict[str, Any]]:
    return [{"item": i, "name": items.name_of(i), "count": n} for i, n in stacks]


_SEED = (
    Mail(
        "m1",
        "服务器",
        "欢迎来到服务器！",
        "这是新手礼包：一把石剑和一些面包。祝你玩得开心！",
        1795629540,  # 2026-11-25 17:59 UTC
        (("minecraft:stone_sword", 1), ("minecraft:bread", 8)),
    ),
    Mail(
        "m2",
        "Server",
        "Welcome to the server!",
        "Here is a starter kit: some bread and torches. Have fun!",
        1795629600,  # 2026-11-25 18:00 UTC
        (("minecraft:bread", 16), ("minecraft:torch", 16)),
    ),
    Mail(
        "m3",
        "服务器",
        "服务器规则",
        "请勿破坏他人建筑，禁止使用作弊客户端。",
        1795685400,  # 2026-11-26 09:30 UTC
    ),
    Mail(
        "m4",
        "Alex",
        "Some iron for you",
        "Found a big vein today, here is some iron. — Alex",
        1795867200,  # 2026-11-28 12:00 UTC
        (("minecraft:iron_ingot", 16),),
    ),
    Mail(
        "m5",
        "系统",
        "签到奖励补发",
        "维护期间未发放的签到奖励已补发，请领取附件。",
        1795983300,  # 2026-11-29 20:15 UTC
        (("minecraft:diamond", 2),),
    ),
    Mail(
        "m6",
        "Server",
        "Double drops this weekend",
        "From Saturday to Sunday every mob drops twice as much.",
        1796025600,  # 2026-11-30 08:00 UTC
    ),
)


def seed() -> dict[str, Mail]:
    """A new player's mailbox (fresh copies: claiming one player's mail leaves the rest)."""
    return {m.mail_id: dataclasses.replace(m) for m in _SEED}


def _whole(data: Mapping[str, Any], key: str, low: int, high: int | None, default: int) -> int:
    value = data.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # numbers cross the wire as JSON numbers (Struct: doubles)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"mail.list: {key} must be a whole number from {low}")
    if high is not None and value > high:
        raise ValueError(f"mail.list: {key} must be at most {high}")
    return value


def list_page(mailbox: Mapping[str, Mail], data: Mapping[str, Any]) -> dict[str, Any]:
    """`minecraft:mail.list`: one page, newest first."""
    unknown = set(data) - {"page", "page_size"}
    if unknown:
        raise ValueError(f"mail.list takes page and page_size, not {', '.join(sorted(unknown))}")
    page = _whole(data, "page", 1, None, 1)
    size = _whole(data, "page_size", 1, PAGE_LIMIT, DEFAULT_PAGE_SIZE)
    newest = sorted(mailbox.values(), key=lambda m: (m.sent_at, m.mail_id), reverse=True)
    shown = newest[(page - 1) * size : page * size]
    return {
        "total": len(newest),
        "page": page,
        "page_size": size,
        "mails": [m.as_tool_output() for m in shown],
    }


def _mail_id(data: Mapping[str, Any], tool: str) -> str:
    mail_id = data.get("mail_id")
    if set(data) != {"mail_id"} or not isinstance(mail_id, str) or not 1 <= len(mail_id) <= 64:
        raise ValueError(f"{tool} takes a mail_id of 1 to 64 characters")
    return mail_id


def read(mailbox: Mapping[str, Mail], data: Mapping[str, Any]) -> dict[str, Any]:
    """`minecraft:mail.read`: one mail, or found false."""
    mail = mailbox.get(_mail_id(data, "mail.read"))
    return {"found": False} if mail is None else {"found": True, "mail": mail.as_tool_output()}


def claim(
    mailbox: Mapping[str, Mail], inventory: Counter[str], data: Mapping[str, Any]
) -> dict[str, Any]:
    """`minecraft:mail.claim`: the attachment into `inventory` and the mail marked claimed,
    together (nothing here can fail between the two), once per mail."""
    mail = mailbox.get(_mail_id(data, "mail.claim"))
    if mail is None:
        return {"outcome": "not_found", "items": []}
    if not mail.attachment:
        return {"outcome": "no_attachment", "items": []}
    if mail.claimed:
        return {"outcome": "already_claimed", "items": []}
    for item, count in mail.attachment:
        inventory[item] += count
    mail.claimed = True
    return {"outcome": "claimed", "items": _stacks(mail.attachment)}
