"""Results and the fixed failure catalogue (`system.error.*`), shared by every service.

Modules build their results here; a failure key outside the catalogue is reported as
MODULE_FAILED so clients only ever see keys they can translate.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterable

from system.common.v1 import common_pb2

__all__ = ["AgentFailure", "ModuleFailure", "NotDelivered", "card", "failed", "succeeded"]


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

    @classmethod
    def from_key(cls, key: str) -> AgentFailure:
        """The catalogue entry for `key`; unknown keys become MODULE_FAILED."""
        for member in cls:
            if member.value == key:
                return member
        return cls.MODULE_FAILED


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
