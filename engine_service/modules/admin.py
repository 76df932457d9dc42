"""Administrators' commands in game: `/system routing` (路由诊断) shows the router's state and
counts; `/system reload` (重载配置) reloads the router's `system-semantic.json` and this engine's
event rules; `/system usage` (用量) a player's use; `/system spend [today|month]` (花费) what the
server spent, by player, module and provider, and its budgets against their limits (the
knowledge commands are in knowledge_admin.py, built with `admin_spec` too). They need the
engine's `admin_permission_level` (3 by default, `ADMIN_LEVEL`) and appear nowhere below it;
they are commands only (no routing by meaning) and read-only for the game.
"""

from __future__ import annotations

from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.admin_tools import ADMIN_LEVEL, CONFIG_RELOAD, ROUTING_DIAGNOSTICS
from engine_service.binding_tools import BINDING_CHANGE, FEATURE_CHANGE
from engine_service.modules.text import pick
from engine_service.registry import CommandSpec, ExecutionPolicy, ModuleContext, ModuleSpec
from engine_service.usage_tools import EVERYONE, SPEND_READ, USAGE_DAYS, USAGE_READ
from engine_service.web_tools import SEARCH_FEATURE
from services.results import AgentFailure, card, failed, succeeded

__all__ = [
    "ADMIN_MODULES",
    "BindingModule",
    "FeatureModule",
    "ReloadModule",
    "RoutingModule",
    "SpendModule",
    "UsageModule",
    "admin_spec",
    "money",
]

_NO_INPUT: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_ROUTING_TITLE = {"zh": "路由诊断", "en": "Routing diagnostics"}
_STATE = {
    "zh": "模式 {mode}，{status}；算法 {algorithm}；例句 {examples} 条；意图缓存 {cache} 条",
    "en": "Mode {mode}, {status}; algorithm {algorithm}; {examples:~example}; "
    "{cache:~intent cache entry|intent cache entries}",
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
_CANDIDATES = {"zh": "候选：{candidates}", "en": "Candidates: {candidates}"}
_STOPPED = {"zh": "拦下它的关卡：{gate}", "en": "Gate that stopped it: {gate}"}
_ROUTED = {"zh": "无（已直达）", "en": "none (it routed)"}
_RELOAD_TITLE = {"zh": "重载配置", "en": "Configuration reloaded"}
_APPLIED = {"zh": "已生效：{items}", "en": "Applied: {items}"}
_RESTART = {"zh": "需要重启：{items}", "en": "Needs a restart: {items}"}
_SEMANTIC_ERROR = {
    "zh": "路由配置（system-semantic.json 和按钮说法）未重载：{error}",
    "en": "The router's config (system-semantic.json and button phrasings) was not reloaded: "
    "{error}",
}
_RULES = {"zh": "事件规则：{rules}", "en": "Event rules: {rules}"}
_RULES_ERROR = {"zh": "事件规则未重载：{error}", "en": "Event rules were not reloaded: {error}"}
_NOTHING = {"zh": "没有变化", "en": "nothing changed"}
_ROUTERS = {"zh": "路由副本已重载：{n}/{total}", "en": "Router replicas reloaded: {n} of {total}"}
_ENGINES = {"zh": "引擎副本已重载：{n}/{total}", "en": "Engine replicas reloaded: {n} of {total}"}
_FAILED = {"zh": "未能重载的副本：{items}", "en": "Replicas that failed: {items}"}


_ARGUMENT_LABELS = {
    "player": {"zh": "玩家", "en": "player"},
    "period": {"zh": "时段", "en": "period"},
}
"""How help writes the admin commands' arguments, per language."""


def admin_spec(
    module_id: str,
    description: dict[str, str],
    aliases: tuple[str, ...],
    tool: str,
    writes: int,
    argument: str = "",
    required: bool = False,
) -> ModuleSpec:
    """An admin command: explicit only, level ADMIN_LEVEL, one call of its one tool;
    `argument`: the name of its one text argument, if it takes one (`required` or not)."""
    schema: dict[str, Any] = _NO_INPUT
    if argument:
        schema = {
            "type": "object",
            "properties": {argument: {"type": "string", "minLength": 1, "maxLength": 63}},
            "required": [argument] if required else [],
            "additionalProperties": False,
        }
    return ModuleSpec(
        module_id=module_id,
        description=description,
        input_schema=schema,
        commands=(
            CommandSpec(
                aliases,
                argument,
                argument_required=required,
                argument_label=_ARGUMENT_LABELS.get(argument, {}),
            ),
        ),
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

    spec = admin_spec(
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
            pick(
                _STATE,
                language,
                mode=found["mode"],
                status=found["status"],
                algorithm=found.get("algorithm") or "-",
                examples=found.get("examples", 0),
                cache=found.get("cache_entries", 0),
            ),
            pick(_DECISIONS, language, counts=_counts(found["decisions"], language)),
            pick(_GATES, language, counts=_counts(found["gates"], language)),
        ]
        last = found.get("last_match") or {}
        if found.get("last_module_id"):
            lines.append(
                pick(
                    _LAST,
                    language,
                    module=found["last_module_id"],
                    score=round(float(last.get("topScore", 0.0)), 3),
                    margin=round(float(last.get("margin", 0.0)), 3),
                    coverage=round(float(last.get("coverage", 0.0)), 3),
                )
            )
            top = ", ".join(
                f"{c.get('moduleId', '')} {round(float(c.get('score', 0.0)), 3)}"
                for c in last.get("candidates", [])
            )
            if top:
                lines.append(pick(_CANDIDATES, language, candidates=top))
            lines.append(
                pick(_STOPPED, language, gate=last.get("gateFailed") or pick(_ROUTED, language))
            )
        return succeeded(card("system:routing", pick(_ROUTING_TITLE, language), lines))


class ReloadModule:
    """`/system reload`: the router's semantic config and notification-button phrasings, and
    the engines' event rules, read again on every replica."""

    spec = admin_spec(
        "system:reload",
        {
            "zh": "管理员：重新读取语义路由配置、通知按钮说法和事件规则。",
            "en": "Admin: read the semantic routing config, the notification button phrasings "
            "and the event rules again.",
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
            lines.append(pick(_APPLIED, language, items="; ".join(done["applied"])))
        if done["needs_restart"]:
            lines.append(pick(_RESTART, language, items="; ".join(done["needs_restart"])))
        if done.get("semantic_error"):
            lines.append(pick(_SEMANTIC_ERROR, language, error=done["semantic_error"]))
        if done.get("event_rules"):
            lines.append(pick(_RULES, language, rules=done["event_rules"]))
        if done.get("event_rules_error"):
            lines.append(pick(_RULES_ERROR, language, error=done["event_rules_error"]))
        # Every replica is reloaded (decision 0033): how many did, and which could not.
        failed: list[str] = []
        for key, text in (("routers", _ROUTERS), ("engines", _ENGINES)):
            if key in done:
                count = done[key]
                lines.append(pick(text, language, n=count["reloaded"], total=count["total"]))
                failed += count["failed"]
        if failed:
            lines.append(pick(_FAILED, language, items="; ".join(failed)))
        return succeeded(
            card(
                "system:reload", pick(_RELOAD_TITLE, language), lines or [pick(_NOTHING, language)]
            )
        )


_USAGE_TITLE = {"zh": "{player} 的用量", "en": "Usage of {player}"}
_SERVER_USAGE_TITLE = {"zh": "本服所有玩家的用量", "en": "Usage of every player on this server"}
_USAGE_DAY = {
    "zh": "{day}：模型调用 {calls} 次，输入 {prompt} / 输出 {completion} tokens，花费 {cost}，"
    "联网搜索 {searches} 次",
    "en": "{day}: {calls:~model call}, {prompt} prompt / {completion} completion tokens, "
    "cost {cost}, {searches:~web search|web searches}",
}
_USAGE_TOTAL = {
    "zh": "近 {days} 天合计：模型调用 {calls} 次，{tokens} tokens，花费 {cost}，联网搜索 {searches} 次",
    "en": "Last {days:~day}: {calls:~model call}, {tokens:~token}, cost {cost}, "
    "{searches:~web search|web searches}",
}
_USAGE_NONE = {"zh": "近 {days} 天没有用量。", "en": "No usage in the last {days:~day}."}


class UsageModule:
    """`/system usage [player|*]`: a player's external-service use per day (oneself by
    default), or with `*` the whole server's."""

    spec = admin_spec(
        "system:usage",
        {
            "zh": "管理员：查看玩家（或用 * 查看全服）近一周的模型和联网用量。",
            "en": "Admin: a player's (or with *, the whole server's) model and web use over the "
            "last week.",
        },
        ("usage", "用量"),
        USAGE_READ,
        writes=0,
        argument="player",
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        player = (data.get("player") or "").strip() or ctx.player.player_id.rpartition("/")[2]
        found = await ctx.tool(USAGE_READ, {"player": player})
        days = found["days"]
        lines = [
            pick(
                _USAGE_DAY,
                language,
                day=d["day"],
                calls=d["model_calls"],
                prompt=d["prompt_tokens"],
                completion=d["completion_tokens"],
                cost=money(d["cost_micros"]),
                searches=d["web_searches"],
            )
            for d in days
        ]
        if days:
            lines.append(
                pick(
                    _USAGE_TOTAL,
                    language,
                    days=USAGE_DAYS,
                    calls=sum(d["model_calls"] for d in days),
                    tokens=sum(d["prompt_tokens"] + d["completion_tokens"] for d in days),
                    cost=money(sum(d["cost_micros"] for d in days)),
                    searches=sum(d["web_searches"] for d in days),
                )
            )
        else:
            lines.append(pick(_USAGE_NONE, language, days=USAGE_DAYS))
        title = (
            pick(_SERVER_USAGE_TITLE, language)
            if found["player"] == EVERYONE
            else pick(_USAGE_TITLE, language, player=found["player"])
        )
        return succeeded(card("system:usage", title, lines))


def money(micros: int) -> str:
    """Micros (millionths of the prices' currency) as an amount: 2500 -> 0.0025."""
    return f"{micros / 1_000_000:.6f}".rstrip("0").rstrip(".") if micros else "0"


_SPEND_TITLE = {
    False: {"zh": "本服今日花费（{period}）", "en": "Spend on this server today ({period})"},
    True: {"zh": "本服本月花费（{period}）", "en": "Spend on this server this month ({period})"},
}
_SPEND_SERVER = {
    "zh": "本服：{tokens} tokens，花费 {cost}",
    "en": "This server: {tokens:~token}, cost {cost}",
}
_SPEND_NETWORK = {
    "zh": "全网：{tokens} tokens，花费 {cost}",
    "en": "Whole network: {tokens:~token}, cost {cost}",
}
_SPEND_BY = {
    "players": {
        "zh": "按玩家（共 {count} 人）：{lines}",
        "en": "By player ({count} in all): {lines}",
    },
    "modules": {"zh": "按模块：{lines}", "en": "By module: {lines}"},
    "providers": {"zh": "按服务商：{lines}", "en": "By provider: {lines}"},
}
_SPEND_LINE = {"zh": "{name} {tokens} tokens / {cost}", "en": "{name} {tokens:~token} / {cost}"}
_SEPARATOR = {"zh": "；", "en": "; "}
_NO_MODULE = {"zh": "（未注明）", "en": "(none named)"}
_BUDGET_LINE = {
    "zh": "预算 {budget}：已花 {spent}，预留 {held}，上限 {limit}（已占 {percent}%）",
    "en": "Budget {budget}: {spent} spent, {held} held, of {limit} ({percent} % taken)",
}
_NO_BUDGETS = {"zh": "本期没有设上限的预算。", "en": "No budget has a limit this period."}
_PERIODS = {
    "": "day",
    "today": "day",
    "day": "day",
    "今天": "day",
    "今日": "day",
    "month": "month",
    "本月": "month",
    "月": "month",
}


class SpendModule:
    """`/system spend [today|month]`: what this server's players spent on the model (tokens and
    money), by player, module and provider, beside the network's whole, and the budgets (game
    server, network) against their limits."""

    spec = admin_spec(
        "system:spend",
        {
            "zh": "管理员：查看本服今日或本月的模型花费（按玩家、模块、服务商）和预算用量。",
            "en": "Admin: this server's model spend today or this month, by player, module and "
            "provider, and the budgets' use against their limits.",
        },
        ("spend", "花费"),
        SPEND_READ,
        writes=0,
        argument="period",
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        asked = (data.get("period") or "").strip().lower()
        period = _PERIODS.get(asked)
        if period is None:
            return failed(
                AgentFailure.INVALID_INPUT,
                pick(
                    {
                        "zh": f"不认识的时段 {asked!r}：请用 今天 或 本月",
                        "en": f"unknown period {asked!r}: say today or month",
                    },
                    language,
                ),
            )
        found = await ctx.tool(SPEND_READ, {"period": period})
        sep = pick(_SEPARATOR, language)
        lines = [
            pick(
                _SPEND_SERVER,
                language,
                tokens=found["total"]["tokens"],
                cost=money(found["total"]["cost_micros"]),
            ),
            pick(
                _SPEND_NETWORK,
                language,
                tokens=found["network"]["tokens"],
                cost=money(found["network"]["cost_micros"]),
            ),
        ]
        for key in ("players", "modules", "providers"):
            if not found[key]:
                continue
            shown = sep.join(
                pick(
                    _SPEND_LINE,
                    language,
                    name=line["name"] or pick(_NO_MODULE, language),
                    tokens=line["tokens"],
                    cost=money(line["cost_micros"]),
                )
                for line in found[key]
            )
            lines.append(pick(_SPEND_BY[key], language, count=found["player_count"], lines=shown))
        for budget in found["budgets"]:
            cost = budget["budget"].endswith("_cost")
            show = money if cost else str
            lines.append(
                pick(
                    _BUDGET_LINE,
                    language,
                    budget=budget["budget"],
                    spent=show(budget["spent"]),
                    held=show(budget["held"]),
                    limit=show(budget["limit"]),
                    percent=round(100 * (budget["spent"] + budget["held"]) / budget["limit"], 1),
                )
            )
        if not found["budgets"]:
            lines.append(pick(_NO_BUDGETS, language))
        title = pick(_SPEND_TITLE[found["monthly"]], language, period=found["period"])
        return succeeded(card("system:spend", title, lines))


_BINDING: dict[str, dict[str, Any]] = {
    "grant": {
        "aliases": ("grant", "授权"),
        "description": {
            "zh": "管理员：授予玩家使用助手的权限（撤销后恢复）。",
            "en": "Admin: grant a player the assistant (again, after a revoke).",
        },
        "title": {"zh": "已授权 {player}", "en": "Granted {player}"},
    },
    "revoke": {
        "aliases": ("revoke", "撤销授权"),
        "description": {
            "zh": "管理员：撤销玩家的助手权限，删除其数据，此后的请求一律拒绝。",
            "en": "Admin: revoke a player: their data is deleted and every request refused.",
        },
        "title": {"zh": "已撤销 {player}", "en": "Revoked {player}"},
    },
    "reset": {
        "aliases": ("reset", "重置玩家"),
        "description": {
            "zh": "管理员：重置玩家，删除其对话、设置和模块数据（用量保留）。",
            "en": "Admin: reset a player: their history, settings and module data are deleted.",
        },
        "title": {"zh": "已重置 {player}", "en": "Reset {player}"},
    },
}
_AT_ONCE = {
    "zh": "已在玩家所在的游戏服务器上生效。",
    "en": "In force at once on the player's game server.",
}
_AT_JOIN = {
    "zh": "玩家不在线：下次加入时生效。",
    "en": "The player is offline: in force when they next join.",
}


class BindingModule:
    """`/system grant|revoke|reset <player>`: one binding change (see binding_tools)."""

    def __init__(self, action: str) -> None:
        known = _BINDING[action]
        self.action = action
        self.spec = admin_spec(
            f"system:{action}",
            known["description"],
            known["aliases"],
            BINDING_CHANGE,
            writes=1,
            argument="player",
            required=True,
        )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        done = await ctx.tool(BINDING_CHANGE, {"player": data["player"], "action": self.action})
        title = pick(_BINDING[self.action]["title"], language, player=done["player"])
        lines = [pick(_AT_ONCE if done["notified"] else _AT_JOIN, language)]
        return succeeded(card("system:binding", title, lines))


_FEATURE: dict[bool, dict[str, Any]] = {
    True: {
        "module_id": "system:search.grant",
        "aliases": ("search-on", "开启联网"),
        "description": {
            "zh": "管理员：为某位玩家单独开启联网搜索。",
            "en": "Admin: turn web search on for one player.",
        },
        "title": {"zh": "已为 {player} 开启联网搜索", "en": "Web search on for {player}"},
    },
    False: {
        "module_id": "system:search.revoke",
        "aliases": ("search-off", "关闭联网"),
        "description": {
            "zh": "管理员：收回某位玩家单独获得的联网搜索（其正在进行的请求会被取消）。",
            "en": "Admin: take web search back from one player (what they have running stops).",
        },
        "title": {"zh": "已为 {player} 关闭联网搜索", "en": "Web search off for {player}"},
    },
}
_SERVER_WIDE = {
    "zh": "若其游戏服务器为所有人开启了联网搜索，该玩家仍可使用。",
    "en": "If their game server turns web search on for everyone, they keep it.",
}


class FeatureModule:
    """`/system search-on|search-off <player>`: web search granted to one player alone, or
    taken back (see binding_tools)."""

    def __init__(self, granted: bool) -> None:
        known = _FEATURE[granted]
        self.granted = granted
        self.spec = admin_spec(
            known["module_id"],
            known["description"],
            known["aliases"],
            FEATURE_CHANGE,
            writes=1,
            argument="player",
            required=True,
        )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        done = await ctx.tool(
            FEATURE_CHANGE,
            {"player": data["player"], "feature": SEARCH_FEATURE, "granted": self.granted},
        )
        title = pick(_FEATURE[self.granted]["title"], language, player=done["player"])
        lines = [pick(_AT_ONCE if done["notified"] else _AT_JOIN, language)]
        if not self.granted:
            lines.append(pick(_SERVER_WIDE, language))
        return succeeded(card("system:binding", title, lines))


ADMIN_MODULES = (
    RoutingModule,
    ReloadModule,
    UsageModule,
    SpendModule,
    BindingModule,
    FeatureModule,
)
"""The administrators' commands: their level is the engine's `admin_permission_level`."""
