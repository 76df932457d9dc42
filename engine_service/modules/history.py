"""`system:history`: shows the player's recent conversation, read back from storage."""

from __future__ import annotations

from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.modules.answering import TEMPLATE as ANSWER_TEMPLATE
from engine_service.modules.chat import TEMPLATE as CHAT_TEMPLATE
from engine_service.modules.text import pick
from engine_service.registry import CommandSpec, ModuleContext, ModuleSpec, SemanticSpec
from services.results import card, succeeded

__all__ = ["HistoryModule"]

_TITLE = {"zh": "最近的对话", "en": "Recent conversation"}
_EMPTY = {"zh": "还没有记录。", "en": "Nothing recorded yet."}
_ROLE = {
    common_pb2.HISTORY_ROLE_PLAYER: {"zh": "你", "en": "You"},
    common_pb2.HISTORY_ROLE_ASSISTANT: {"zh": "助手", "en": "Assistant"},
}
DEFAULT_COUNT = 10
MAX_COUNT = 50
SHOWN_CHARACTERS = 80
"""Longest an entry's line on the card; a longer one is cut and ends with `…`."""
_PROSE = frozenset({CHAT_TEMPLATE, ANSWER_TEMPLATE})
"""Cards whose title is the same for every answer (`Assistant`, `Answer`): history shows the
answer's first line instead."""


def _said(entry: common_pb2.HistoryEntry) -> str:
    """What an entry's line shows: the first line of its text (a card's title), or of a prose
    answer's body."""
    shown = entry.result.card if entry.result.HasField("card") else None
    if shown is not None and shown.template in _PROSE and shown.lines:
        first = shown.lines[0].text
    else:
        first = entry.text.splitlines()[0] if entry.text else ""
    return first if len(first) <= SHOWN_CHARACTERS else first[: SHOWN_CHARACTERS - 1] + "…"


class HistoryModule:
    """Lists the last entries of the player's history, oldest first."""

    spec = ModuleSpec(
        module_id="system:history",
        description={"zh": "查看最近的对话记录。", "en": "Show your recent conversation."},
        input_schema={
            "type": "object",
            "properties": {"count": {"type": "integer", "minimum": 1, "maximum": MAX_COUNT}},
            "additionalProperties": False,
        },
        history_entries=MAX_COUNT,
        commands=(CommandSpec(("history", "历史", "对话记录")),),
        routing_mode=catalog_pb2.ROUTING_MODE_READ,
        semantic=SemanticSpec(
            examples={
                "zh": (
                    "查看对话记录",
                    "查看聊天记录",
                    "最近的对话",
                    "显示历史记录",
                    "我们之前聊了什么",
                    "打开历史",
                    "查看最近的提问记录",
                    "翻一下之前的对话",
                    "显示最近的消息记录",
                ),
                "en": (
                    "show history",
                    "show my chat history",
                    "recent conversation",
                    "what did we talk about before",
                    "show previous conversation",
                    "open my conversation log",
                    "list my recent questions",
                    "show the chat log",
                ),
            },
            choice_label="system.history.choice",
            shortcut=True,
        ),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        entries = await ctx.list_history(int(data.get("count", DEFAULT_COUNT)))
        lines = [
            f"{pick(_ROLE.get(e.role, {'en': '?'}), language)}: {_said(e)}" for e in entries
        ] or [pick(_EMPTY, language)]
        return succeeded(card("system:history", pick(_TITLE, language), lines))
