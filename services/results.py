"""Results and the fixed failure catalogue (`system.error.*`), shared by every service.

Modules build their results here; a failure key outside the catalogue is reported as
MODULE_FAILED so clients only ever see keys they can translate.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterable

from system.common.v1 import common_pb2

__all__ = [
    "FAILURE_TEXTS",
    "AgentFailure",
    "ModuleFailure",
    "NotDelivered",
    "card",
    "failed",
    "failure_text",
    "succeeded",
]


class AgentFailure(enum.Enum):
    """Built-in failures. Values are the translation keys clients show."""

    MODULE_FAILED = "system.error.module_failed"
    INVALID_INPUT = "system.error.invalid_input"
    NOT_FOUND = "system.error.not_found"
    PERMISSION_DENIED = "system.error.permission_denied"
    BUSY = "system.error.busy"
    TIMEOUT = "system.error.timeout"
    CANCELLED = "system.error.cancelled"
    UNKNOWN_COMMAND = "system.error.unknown_command"
    NO_MATCH = "system.error.no_match"
    STORAGE_UNAVAILABLE = "system.error.storage_unavailable"
    MODEL_UNAVAILABLE = "system.error.model_unavailable"
    EFFECT_UNKNOWN = "system.error.effect_unknown"
    STORAGE_FULL = "system.error.storage_full"
    BUDGET_EXHAUSTED = "system.error.budget_exhausted"
    TOOL_UNAVAILABLE = "system.error.tool_unavailable"
    WRITE_NOT_ALLOWED = "system.error.write_not_allowed"
    TOOL_OUTPUT_INVALID = "system.error.tool_output_invalid"
    """A game tool answered with output that breaks its output schema (docs/game-tools.md)."""
    STALE_CARD = "system.error.stale_card"
    """A button of a card that is no longer current (replaced by a newer version, expired,
    or already used)."""
    INSUFFICIENT_BALANCE = "system.error.insufficient_balance"
    SOLD_OUT = "system.error.sold_out"
    PRICE_CHANGED = "system.error.price_changed"
    """The price is no longer the quoted one; nothing was charged."""

    @classmethod
    def from_key(cls, key: str) -> AgentFailure:
        """The catalogue entry for `key`; unknown keys become MODULE_FAILED."""
        for member in cls:
            if member.value == key:
                return member
        return cls.MODULE_FAILED


FAILURE_TEXTS: dict[AgentFailure, dict[str, str]] = {
    AgentFailure.MODULE_FAILED: {
        "zh": "出了点问题，请再试一次。",
        "en": "Something went wrong; try again.",
    },
    AgentFailure.INVALID_INPUT: {"zh": "输入无效。", "en": "The input is not valid."},
    AgentFailure.NOT_FOUND: {"zh": "没有找到。", "en": "Not found."},
    AgentFailure.PERMISSION_DENIED: {"zh": "没有权限。", "en": "You may not do that."},
    AgentFailure.BUSY: {"zh": "助手正忙，请稍后再试。", "en": "The assistant is busy; try again."},
    AgentFailure.TIMEOUT: {"zh": "处理超时，请再试一次。", "en": "That took too long; try again."},
    AgentFailure.CANCELLED: {"zh": "已取消。", "en": "Cancelled."},
    AgentFailure.UNKNOWN_COMMAND: {"zh": "未知指令。", "en": "Unknown command."},
    AgentFailure.NO_MATCH: {"zh": "没有理解你的意思。", "en": "No feature matches that."},
    AgentFailure.STORAGE_UNAVAILABLE: {
        "zh": "数据暂时无法读写。",
        "en": "The data store is unavailable right now.",
    },
    AgentFailure.MODEL_UNAVAILABLE: {"zh": "模型暂时不可用。", "en": "The model is unavailable."},
    AgentFailure.EFFECT_UNKNOWN: {
        "zh": "操作可能已执行，也可能没有；不会重复执行。",
        "en": "It may or may not have happened; it is not repeated.",
    },
    AgentFailure.STORAGE_FULL: {"zh": "存储已满。", "en": "Storage is full."},
    AgentFailure.BUDGET_EXHAUSTED: {"zh": "额度已用完。", "en": "The budget is used up."},
    AgentFailure.TOOL_UNAVAILABLE: {
        "zh": "游戏服务器暂时无法提供此功能。",
        "en": "The game server cannot do that right now.",
    },
    AgentFailure.WRITE_NOT_ALLOWED: {
        "zh": "此操作需要明确的指令或按钮。",
        "en": "That change needs an explicit command or button.",
    },
    AgentFailure.TOOL_OUTPUT_INVALID: {
        "zh": "游戏服务器返回的数据格式不正确。",
        "en": "The game server answered with malformed data.",
    },
    AgentFailure.STALE_CARD: {
        "zh": "这张卡片已失效，请重新打开。",
        "en": "This card is no longer valid; open it again.",
    },
    AgentFailure.INSUFFICIENT_BALANCE: {"zh": "余额不足。", "en": "Not enough money."},
    AgentFailure.SOLD_OUT: {"zh": "库存不足。", "en": "Not enough in stock."},
    AgentFailure.PRICE_CHANGED: {"zh": "价格已变动。", "en": "The price has changed."},
}
"""What each failure key means, per language (`zh`, `en`): the text a client shows for a
failure key it has no translation of its own for."""


def failure_text(failure: AgentFailure | str, language: str) -> str:
    """The text of a failure key in `language` (`en` for other languages); unknown keys read as
    MODULE_FAILED."""
    member = failure if isinstance(failure, AgentFailure) else AgentFailure.from_key(failure)
    texts = FAILURE_TEXTS[member]
    return texts.get(language) or texts["en"]


class ModuleFailure(Exception):
    """Raised by a module to end its run with a catalogued failure and a message."""

    def __init__(self, failure: AgentFailure, message: str) -> None:
        super().__init__(message)
        self.failure = failure
        self.message = message


class NotDelivered(ModuleFailure):
    """A tool call that certainly never ran: it was refused before it reached the game server.
    Unlike a lost answer, repeating it later cannot repeat an effect.

    Args:
        player_offline: True when the player was not connected (an event task then waits for
            them to join); False when their server does not offer the tool.
    """

    def __init__(self, failure: AgentFailure, message: str, player_offline: bool) -> None:
        super().__init__(failure, message)
        self.player_offline = player_offline


def card(
    template: str,
    title: str,
    lines: Iterable[str | tuple[str, str]] = (),
    buttons: Iterable[common_pb2.CardButton] = (),
    speech: str = "",
) -> common_pb2.Card:
    """A new card (version 1). A line is text, or (text, command to suggest when clicked)."""
    body = [
        common_pb2.CardLine(text=line)
        if isinstance(line, str)
        else common_pb2.CardLine(text=line[0], suggest_command=line[1])
        for line in lines
    ]
    return common_pb2.Card(
        ref=common_pb2.CardRef(card_id=uuid.uuid4().hex, version=1),
        template=template,
        title=title,
        lines=body,
        buttons=list(buttons),
        speech=speech,
    )


def _plain(c: common_pb2.Card) -> str:
    return "\n".join([c.title, *(line.text for line in c.lines)]).strip()


def succeeded(result_card: common_pb2.Card) -> common_pb2.AgentResult:
    return common_pb2.AgentResult(
        status=common_pb2.RESULT_STATUS_SUCCEEDED, card=result_card, text=_plain(result_card)
    )


def failed(failure: AgentFailure | str, message: str, title: str = "") -> common_pb2.AgentResult:
    """A FAILED result with an error card; string keys are mapped through the catalogue."""
    member = failure if isinstance(failure, AgentFailure) else AgentFailure.from_key(failure)
    error_card = card("system:error", title or message, [] if not title else [message])
    return common_pb2.AgentResult(
        status=common_pb2.RESULT_STATUS_FAILED,
        failure=common_pb2.Failure(key=member.value, message=message),
        card=error_card,
        text=message,
    )
