"""Administrators' commands in game: `/system routing` (路由诊断) shows the router's state and
counts; `/system reload` (重载配置) reloads the router's `system-semantic.json` and this engine's
event rules. Both need permission level `ADMIN_LEVEL` (3) and appear nowhere below it; they
are commands only (no routing by meaning) and read-only for the game.
"""

from __future__ import annotations

from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.admin_tools import ADMIN_LEVEL, CONFIG_RELOAD, ROUTING_DIAGNOSTICS
from engine_service.modules.text import pick
from engine_service.registry import CommandSpec, ExecutionPolicy, ModuleContext, ModuleSpec
from services.results import card, succeeded

__all__ = ["ReloadModule", "RoutingModule"]

_NO_INPUT: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_ROUTING_TITLE = {"zh": "路由诊断", "en": "Routing diagnostics"}
_STATE = {
    "zh": "模式 {mode}，{status}；算法 {algorithm}；例句 {examples} 条；意图缓存 {cache} 条",
    "en": "Mode {mode}, {status}; algorithm {algorithm}; {examples} examples; "
    "{cache} intent cache entries",
}
_DECISIONS = {"zh": "按来源：{counts}", "en": "By source: {counts}"}
_GATES = {
    "zh": "拦下本地路由的关卡与回退原因：{counts}",
    "en": "Gates and fallback reasons: {counts}",
}
_LAST = {
    "zh": "最近一次本地匹配：{module}（分数 {score}，差距 {margin}，覆盖 {coverage}）",
    "en": "Last local match: {module} (score {score}, margin {margin}, coverage {coverage})",
}
_NONE = {"zh": "无", "en": "none"}
_RELOAD_TITLE = {"zh": "重载配置", "en": "Configuration reloaded"}
_APPLIED = {"zh": "已生效：{items}", "en": "Applied: {items}"}
_RESTART = {"zh": "需要重启：{items}", "en": "Needs a restart: {items}"}
_SEMANTIC_ERROR = {
    "zh": "system-semantic.json 未重载：{error}",
    "en": "system-semantic.json was not reloaded: {error}",
}
_RULES = {"zh": "事件规则：{rules}", "en": "Event rules: {rules}"}
_RULES_ERROR = {"zh": "事件规则未重载：{error}", "en": "Event rules were not reloaded: {error}"}
_NOTHING = {"zh": "没有变化", "en": "nothing changed"}


def _admin_spec(
    module_id: str, description: dict[str, str], aliases: tuple[str, ...], tool: str, writes: int
) -> ModuleSpec:
    """An admin command: explicit only, level ADMIN_LEVEL, one call of its one tool."""
    return ModuleSpec(
        module_id=module_id,
        description=description,
        input_schema=_NO_INPUT,
        commands=(CommandSpec(aliases),),
        routing_mode=catalog_pb2.ROUTING_MODE_EXPLICIT_ONLY,
        min_permission_level=ADMIN_LEVEL,
        tools=(tool,),
        policy=ExecutionPolicy(
            rounds=1, model_calls=0, tool_calls=1, steps=1, seconds=10.0, write_steps=writes
        ),
    )


def _counts(counts: dict[str, int], language: str) -> str:
    if not counts:
        return pick(_NONE, language)
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))


class RoutingModule:
    """`/system routing`: one card of the router's diagnostics."""

    spec = _admin_spec(
        "system:routing",
        {
            "zh": "管理员：查看路由诊断，包括各来源的计数和拦下本地路由的原因。",
            "en": "Admin: routing diagnostics, with counts per source and why local routes stopped.",
        },
        ("routing", "路由诊断"),
        ROUTING_DIAGNOSTICS,
        writes=0,
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        found = await ctx.tool(ROUTING_DIAGNOSTICS, {})
        lines = [
            pick(_STATE, language).format(
                mode=found["mode"],
                status=found["status"],
                algorithm=found.get("algorithm") or "-",
                examples=found.get("examples", 0),
                cache=found.get("cache_entries", 0),
            ),
            pick(_DECISIONS, language).format(counts=_counts(found["decisions"], language)),
            pick(_GATES, language).format(counts=_counts(found["gates"], language)),
        ]
        last = found.get("last_match") or {}
        if found.get("last_module_id"):
            lines.append(
                pick(_LAST, language).format(
                    module=found["last_module_id"],
                    score=round(float(last.get("topScore", 0.0)), 3),
                    margin=round(float(last.get("margin", 0.0)), 3),
                    coverage=round(float(last.get("coverage", 0.0)), 3),
                )
            )
        return succeeded(card("system:routing", pick(_ROUTING_TITLE, language), lines))


class ReloadModule:
    """`/system reload`: the router's semantic config and the event rules, read again."""

    spec = _admin_spec(
        "system:reload",
        {
            "zh": "管理员：重新读取语义路由配置和事件规则。",
            "en": "Admin: read the semantic routing config and the event rules again.",
        },
        ("reload", "重载配置"),
        CONFIG_RELOAD,
        writes=1,  # changes the router's settings: it holds the player's lease
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        done = await ctx.tool(CONFIG_RELOAD, {})
        lines = []
        if done["applied"]:
            lines.append(pick(_APPLIED, language).format(items="; ".join(done["applied"])))
        if done["needs_restart"]:
            lines.append(pick(_RESTART, language).format(items="; ".join(done["needs_restart"])))
        if done.get("semantic_error"):
            lines.append(pick(_SEMANTIC_ERROR, language).format(error=done["semantic_error"]))
        if done.get("event_rules"):
            lines.append(pick(_RULES, language).format(rules=done["event_rules"]))
        if done.get("event_rules_error"):
            lines.append(pick(_RULES_ERROR, language).format(error=done["event_rules_error"]))
        return succeeded(
            card(
                "system:reload", pick(_RELOAD_TITLE, language), lines or [pick(_NOTHING, language)]
            )
        )
