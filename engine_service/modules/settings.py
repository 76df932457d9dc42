"""`system:settings` (`/system settings`, `/设置`): the player's own settings as a card: history on
or off, external services on or off, the conversation mode, and buttons that change them, view
the history, or clear the conversation memory.

The module only shows; it changes nothing. Its `preferences` and `clear_history` buttons are
carried out by the gateway, which owns preferences (it keeps them for the player's connection)
and then shows this card again as an update of the one pressed; `input.cleared` is how many
history entries such a press just cleared. The mode shown is the one in force
(`PlayerContext.conversation_mode`); storage says whether the player chose it.
"""

from __future__ import annotations

from typing import Any

import grpc
from system.common.v1 import catalog_pb2, common_pb2
from system.storage.v1 import storage_pb2

from engine_service.context import ExecutionContext
from engine_service.modules.buttons import invoke
from engine_service.modules.text import pick
from engine_service.registry import CommandSpec, ModuleContext, ModuleSpec, SemanticSpec
from engine_service.tools import ToolRegistry, ToolSpec
from engine_service.web_tools import ExternalPreference
from services.modes import MODES, mode_name
from services.results import AgentFailure, ModuleFailure, card, succeeded

__all__ = ["PREFERENCES_READ", "PreferenceTools", "SettingsModule"]

MODULE_ID = "system:settings"
TEMPLATE = "system:settings"
PREFERENCES_READ = "system:preferences.read"
STORAGE_TIMEOUT_SECONDS = 5.0

PREFERENCES_READ_SPEC = ToolSpec(
    tool_id=PREFERENCES_READ,
    description="Read the player's own assistant settings: history, external services, mode.",
    input_schema={"type": "object", "properties": {}, "additionalProperties": False},
    read_only=True,
    idempotent=True,
    needs_context=True,
)

_T: dict[str, dict[str, str]] = {
    "title": {"zh": "助手设置", "en": "Assistant settings"},
    "history": {"zh": "对话记录：{state}", "en": "Conversation history: {state}"},
    "external": {
        "zh": "外部服务（模型、联网）：{state}",
        "en": "External services (model, web): {state}",
    },
    "mode": {"zh": "对话模式：{mode}", "en": "Conversation mode: {mode}"},
    "default": {"zh": "{mode}（服务器默认）", "en": "{mode} (the server's default)"},
    "on": {"zh": "开", "en": "on"},
    "off": {"zh": "关", "en": "off"},
    "history_on": {"zh": "开启对话记录", "en": "Turn history on"},
    "history_off": {"zh": "关闭对话记录", "en": "Turn history off"},
    "external_on": {"zh": "开启外部服务", "en": "Turn external services on"},
    "external_off": {"zh": "关闭外部服务", "en": "Turn external services off"},
    "follow_default": {"zh": "跟随服务器默认模式", "en": "Follow the server's default mode"},
    "view_history": {"zh": "查看对话记录", "en": "View history"},
    "clear": {"zh": "清空对话记忆", "en": "Clear conversation memory"},
    "cleared": {
        "zh": "已清空 {n} 条对话记录。",
        "en": "Cleared {n:~history entry|history entries}.",
    },
    "no_store": {
        "zh": "无法读取设置，请稍后再试。",
        "en": "The settings could not be read; try again later.",
    },
}
_MODE_NAMES: dict[str, dict[str, str]] = {
    "offline": {"zh": "离线", "en": "offline"},
    "standard": {"zh": "标准", "en": "standard"},
    "extended": {"zh": "扩展", "en": "extended"},
    "free": {"zh": "自由", "en": "free"},
}
_MODE_BUTTON = {"zh": "切换到{mode}模式", "en": "Switch to {mode} mode"}


def _t(key: str, language: str, **values: Any) -> str:
    return pick(_T[key], language, **values)


def _preference_button(label: str, **change: str) -> common_pb2.CardButton:
    """A button the gateway carries out: it changes the player's preferences."""
    return common_pb2.CardButton(action_id="preferences", label=label, args=change)


class PreferenceTools:
    """The handler of `system:preferences.read`.

    Args:
        store: storage's preferences; None when the engine has no storage service (reads then
            fail as STORAGE_UNAVAILABLE).
    """

    def __init__(self, store: ExternalPreference | None) -> None:
        self._store = store

    def register(self, tools: ToolRegistry) -> None:
        tools.server(PREFERENCES_READ_SPEC, self.read)

    async def read(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        if self._store is None:
            raise ModuleFailure(AgentFailure.STORAGE_UNAVAILABLE, "this engine has no storage")
        try:
            prefs: storage_pb2.PlayerPreferences = await self._store.read(
                ctx.player.player_id, min(STORAGE_TIMEOUT_SECONDS, ctx.remaining())
            )
        except grpc.aio.AioRpcError as exc:
            raise ModuleFailure(
                AgentFailure.STORAGE_UNAVAILABLE, _t("no_store", ctx.player.language)
            ) from exc
        return {
            "history": prefs.history_enabled,
            "external": prefs.external_enabled,
            "mode": mode_name(prefs.conversation_mode),
        }


class SettingsModule:
    """Shows the player's settings with buttons to change them."""

    spec = ModuleSpec(
        module_id=MODULE_ID,
        description={
            "zh": "查看并修改自己的助手设置：对话记录、外部服务、对话模式。",
            "en": "See and change your assistant settings: history, external services, mode.",
        },
        input_schema={
            "type": "object",
            "properties": {"cleared": {"type": "integer", "minimum": 0}},
            "additionalProperties": False,
        },
        commands=(CommandSpec(("settings", "设置")),),
        # Opening the card reads; every change is a press of one of its buttons.
        routing_mode=catalog_pb2.ROUTING_MODE_READ,
        semantic=SemanticSpec(
            examples={
                "zh": (
                    "打开设置",
                    "查看设置",
                    "我的设置",
                    "偏好设置",
                    "看看我的设置",
                    "设置页面",
                    "我现在是什么模式",
                    "查看当前模式",
                    # What the card's buttons change, so a request to change one (`关闭对话记录`,
                    # `切换到离线模式`) finds the card among its choices.
                    "对话记录设置",
                    "离线模式",
                    "外部服务",
                ),
                "en": (
                    "open settings",
                    "show my settings",
                    "my settings",
                    "settings page",
                    "view my preferences",
                    "open preferences",
                    "what mode am I in",
                    "check my settings",
                    "history setting",
                    "offline mode",
                    "external services",
                ),
            },
            choice_label="system.settings.choice",
            shortcut=True,
        ),
        tools=(PREFERENCES_READ,),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        stored = await ctx.tool(PREFERENCES_READ)
        in_force = mode_name(ctx.player.conversation_mode) or "standard"
        shown_mode = pick(_MODE_NAMES[in_force], language)
        if not stored["mode"]:
            shown_mode = _t("default", language, mode=shown_mode)
        state = {True: _t("on", language), False: _t("off", language)}
        lines = [
            _t("history", language, state=state[stored["history"]]),
            _t("external", language, state=state[stored["external"]]),
            _t("mode", language, mode=shown_mode),
        ]
        if "cleared" in data:
            lines.append(_t("cleared", language, n=int(data["cleared"])))
        history = "off" if stored["history"] else "on"
        external = "off" if stored["external"] else "on"
        buttons = [
            _preference_button(_t(f"history_{history}", language), history=history),
            _preference_button(_t(f"external_{external}", language), external=external),
        ]
        for name in MODES:
            if name != in_force:
                label = pick(_MODE_BUTTON, language, mode=pick(_MODE_NAMES[name], language))
                buttons.append(_preference_button(label, mode=name))
        if stored["mode"]:
            buttons.append(_preference_button(_t("follow_default", language), mode="default"))
        buttons.append(invoke("system:history", _t("view_history", language), {}))
        buttons.append(
            common_pb2.CardButton(action_id="clear_history", label=_t("clear", language))
        )
        return succeeded(card(TEMPLATE, _t("title", language), lines, buttons))
