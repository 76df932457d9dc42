"""Administrators' knowledge commands in game (issue 18), beside the operator's CLI:
`/system knowledge-add FILE [player]` (添加知识) adds a Markdown or plain-text file from the
engine's knowledge folder to the shared knowledge or one player's private knowledge,
`/system knowledge [player]` (知识库) lists a table, `/system knowledge-remove ENTRY [player]`
(删除知识) removes an entry (see engine_service.knowledge_admin_tools). Admin level, commands
only, as the other admin commands (`admin.admin_spec`).
"""

from __future__ import annotations

from typing import Any

from system.common.v1 import common_pb2

from engine_service.knowledge_admin_tools import KNOWLEDGE_ADD, KNOWLEDGE_LIST, KNOWLEDGE_REMOVE
from engine_service.modules.admin import admin_spec
from engine_service.modules.text import pick
from engine_service.registry import ModuleContext
from services.results import AgentFailure, card, failed, succeeded

__all__ = ["KnowledgeModule"]


_KNOWLEDGE: dict[str, dict[str, Any]] = {
    "add": {
        "tool": KNOWLEDGE_ADD,
        "aliases": ("knowledge-add", "添加知识"),
        "argument": "document",
        "writes": 1,
        "description": {
            "zh": "管理员：把知识目录里的 Markdown 或纯文本文件加入共享知识库（或加上玩家名，"
            "加入其私人知识库）：/system knowledge-add 文件名 [玩家]。",
            "en": "Admin: add a Markdown or plain-text file from the knowledge folder to the "
            "shared knowledge (or, with a player, their private knowledge): "
            "/system knowledge-add FILE [player].",
        },
    },
    "list": {
        "tool": KNOWLEDGE_LIST,
        "aliases": ("knowledge", "知识库"),
        "argument": "player",
        "writes": 0,
        "description": {
            "zh": "管理员：列出共享知识库（或某位玩家的私人知识库）的条目。",
            "en": "Admin: list the entries of the shared knowledge (or one player's private "
            "knowledge).",
        },
    },
    "remove": {
        "tool": KNOWLEDGE_REMOVE,
        "aliases": ("knowledge-remove", "删除知识"),
        "argument": "entry",
        "writes": 1,
        "description": {
            "zh": "管理员：从共享知识库（或某位玩家的私人知识库）删除一个条目："
            "/system knowledge-remove 条目 [玩家]。",
            "en": "Admin: remove one entry from the shared knowledge (or one player's private "
            "knowledge): /system knowledge-remove ENTRY [player].",
        },
    },
}
_KNOWLEDGE_USAGE = {
    "add": {
        "zh": "用法：/system knowledge-add 文件名 [玩家]",
        "en": "Usage: /system knowledge-add FILE [player]",
    },
    "list": {"zh": "用法：/system knowledge [玩家]", "en": "Usage: /system knowledge [player]"},
    "remove": {
        "zh": "用法：/system knowledge-remove 条目 [玩家]",
        "en": "Usage: /system knowledge-remove ENTRY [player]",
    },
}
_SHARED = {"zh": "共享知识库", "en": "the shared knowledge"}
_PRIVATE = {"zh": "{player} 的私人知识库", "en": "{player}'s private knowledge"}
_ADDED_TITLE = {"zh": "已添加知识", "en": "Knowledge added"}
_REPLACED_TITLE = {"zh": "已替换知识", "en": "Knowledge replaced"}
_ADDED = {
    "zh": "{entry}（{language}）已存入{scope}：{title}",
    "en": "{entry} ({language}) in {scope}: {title}",
}
_LIST_TITLE = {"zh": "知识条目：{scope}", "en": "Knowledge entries: {scope}"}
_LISTED = {"zh": "{entry}（{language}）{title}", "en": "{entry} ({language}) {title}"}
_LIST_EMPTY = {"zh": "没有条目。", "en": "No entries."}
_LIST_MORE = {
    "zh": "还有更多条目（操作员工具可列出全部）。",
    "en": "More entries follow (the operator's tool lists them all).",
}
_REMOVED_TITLE = {"zh": "已删除知识", "en": "Knowledge removed"}
_REMOVED = {"zh": "已从{scope}删除 {entry}", "en": "{entry} removed from {scope}"}


class KnowledgeModule:
    """`/system knowledge-add FILE [player]`, `/system knowledge [player]`,
    `/system knowledge-remove ENTRY [player]`: the knowledge base managed in game, beside the
    operator's CLI (see knowledge_admin_tools)."""

    def __init__(self, action: str) -> None:
        known = _KNOWLEDGE[action]
        self.action = action
        self.spec = admin_spec(
            f"system:knowledge_{action}",
            known["description"],
            known["aliases"],
            known["tool"],
            writes=known["writes"],
            argument=known["argument"],
            required=action != "list",
        )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        words = str(data.get(_KNOWLEDGE[self.action]["argument"], "")).split()
        most = 1 if self.action == "list" else 2
        if len(words) > most or (self.action != "list" and not words):
            return failed(AgentFailure.INVALID_INPUT, pick(_KNOWLEDGE_USAGE[self.action], language))
        payload: dict[str, Any] = {}
        if self.action == "add":
            payload["file"] = words.pop(0)
        elif self.action == "remove":
            payload["entry_id"] = words.pop(0)
        if words:
            payload["player"] = words[0]
        done = await ctx.tool(_KNOWLEDGE[self.action]["tool"], payload)
        scope = (
            pick(_PRIVATE, language, player=done["player"])
            if done["player"]
            else pick(_SHARED, language)
        )
        if self.action == "add":
            entry = done["entry"]
            title = pick(_ADDED_TITLE if done["created"] else _REPLACED_TITLE, language)
            line = pick(
                _ADDED,
                language,
                entry=entry["entry_id"],
                language=entry["language"],
                scope=scope,
                title=entry["title"],
            )
            return succeeded(card("system:knowledge", title, [line]))
        if self.action == "remove":
            line = pick(_REMOVED, language, entry=done["entry_id"], scope=scope)
            return succeeded(card("system:knowledge", pick(_REMOVED_TITLE, language), [line]))
        lines = [
            pick(_LISTED, language, entry=e["entry_id"], language=e["language"], title=e["title"])
            for e in done["entries"]
        ] or [pick(_LIST_EMPTY, language)]
        if done["more"]:
            lines.append(pick(_LIST_MORE, language))
        return succeeded(card("system:knowledge", pick(_LIST_TITLE, language, scope=scope), lines))
