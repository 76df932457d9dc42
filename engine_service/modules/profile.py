"""`system:profile` (本人概况): the player's own overview, read from the game server through
the game tool `minecraft:player.profile`: balance, level and play time; and the sign-in streak
from the sign-in calendar's `minecraft:signin.status` (the tool `system:signin` reads too). The
calendar is an optional tool: a game server without it still has profiles, without the streak
line.
"""

from __future__ import annotations

from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.modules.signin import SIGNIN_STATUS, streak_line
from engine_service.modules.text import pick
from engine_service.registry import (
    CommandSpec,
    ExecutionPolicy,
    ModuleContext,
    ModuleSpec,
    SemanticSpec,
)
from services.results import AgentFailure, ModuleFailure, card, succeeded

__all__ = ["PLAYER_PROFILE", "ProfileModule", "play_time"]

PLAYER_PROFILE = "minecraft:player.profile"
_TITLE = {"zh": "本人概况", "en": "My profile"}
_BALANCE = {"zh": "余额：{balance} {currency}", "en": "Balance: {balance:~~{currency}}"}
_LEVEL = {"zh": "等级：{level}", "en": "Level: {level}"}
_PLAY_TIME = {"zh": "游戏时长：{time}", "en": "Play time: {time}"}
_UNITS = {
    "zh": ("{d} 天", "{h} 小时", "{m} 分钟"),
    "en": ("{d} d", "{h} h", "{m} min"),
}


def play_time(seconds: int, language: str) -> str:
    """`2 天 3 小时 5 分钟` / `2 d 3 h 5 min`: days and hours only where not zero, minutes
    always (so a new player reads `0 min`)."""
    days, rest = divmod(max(seconds, 0), 86400)
    hours, rest = divmod(rest, 3600)
    minutes = rest // 60
    day_unit, hour_unit, minute_unit = _UNITS.get(language, _UNITS["en"])
    parts = []
    if days:
        parts.append(day_unit.format(d=days))
    if days or hours:
        parts.append(hour_unit.format(h=hours))
    parts.append(minute_unit.format(m=minutes))
    return " ".join(parts)


class ProfileModule:
    """Reads the profile once and shows it as one card."""

    spec = ModuleSpec(
        module_id="system:profile",
        description={
            "zh": "查看本人概况：余额、等级、游戏时长和连续签到。",
            "en": "Show your profile: balance, level, play time and sign-in streak.",
        },
        input_schema={"type": "object", "properties": {}, "additionalProperties": False},
        commands=(CommandSpec(("profile", "本人概况", "概况", "个人信息")),),
        routing_mode=catalog_pb2.ROUTING_MODE_READ,
        semantic=SemanticSpec(
            examples={
                "zh": (
                    "查看我的概况",
                    "我的信息",
                    "查看个人资料",
                    "我的状态",
                    "显示我的账户",
                    "查看我的余额",
                    "我有多少金币",
                    "我的等级",
                    "个人主页",
                    "查看我的数据",
                    "我的资料卡",
                    "查看我的游戏时长",
                    "余额",
                ),
                "en": (
                    "show my profile",
                    "my stats",
                    "my status",
                    "my account overview",
                    "check my balance",
                    "how many coins do I have",
                    "what level am I",
                    "show my player info",
                    "my overview",
                    "view my profile card",
                    "show my playtime",
                    "my balance",
                ),
            },
            choice_label="system.profile.choice",
            shortcut=True,
        ),
        tools=(PLAYER_PROFILE,),
        optional_tools=(SIGNIN_STATUS,),
        policy=ExecutionPolicy(rounds=1, model_calls=0, tool_calls=2, steps=2, seconds=10.0),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        # Checked against the tool's output schema before it gets here (docs/game-tools.md).
        profile = await ctx.tool(PLAYER_PROFILE, {})
        lines = [
            pick(
                _BALANCE,
                language,
                balance=profile["balance"],
                currency=pick(profile["currency"], language),
            ),
            pick(_LEVEL, language, level=profile["level"]),
            pick(_PLAY_TIME, language, time=play_time(profile["play_seconds"], language)),
        ]
        try:
            lines.append(streak_line(await ctx.tool(SIGNIN_STATUS, {}), language))
        except ModuleFailure as failure:
            # A game server without a sign-in calendar: the profile without the streak.
            if failure.failure is not AgentFailure.TOOL_UNAVAILABLE:
                raise
        return succeeded(card("system:profile", pick(_TITLE, language), lines))
