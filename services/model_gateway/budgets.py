"""Nested budgets: the limits per rank, game server and network, read from `budgets_file`;
the money a call may cost; spend metrics; and the alert when a budget passes its threshold.

Domain code: no gRPC. Storage checks and keeps every budget (`ReserveUsage`); this module
only says which limits a reservation carries and watches what storage answers.

Levels, each in tokens and in money (millionths of the prices' currency, "micros"; the prices
are the providers' `input_per_million` / `output_per_million`, so one currency for all):

- per request: the engine's own budgets (rounds, calls, steps), not here;
- per player per UTC day, by **rank**: the player's permission level picks the rank with the
  highest `min_level` at or below it, and that rank's limits apply to the player;
- per game server per UTC day: every player whose id is scoped `<server>/<player>` (decision
  0012) counts on `<server>`;
- per network (the whole deployment) per UTC day and per calendar month (UTC).

The file (TOML), every key optional:

    alert_percent = 80            # warn once per budget and period at 80 % (0: never)
    [ranks.player]                # any name; min_level 0 is required when ranks are given
    min_level = 0
    daily_tokens = 200000         # default: player_daily_tokens
    daily_cost = 0.05             # default 0: no money limit
    [ranks.vip]
    min_level = 2
    daily_tokens = 500000
    daily_cost = 0.5
    [server]
    daily_tokens = 5000000
    daily_cost = 2.0
    [network]
    daily_tokens = 0              # default: global_daily_tokens
    daily_cost = 20.0
    monthly_tokens = 0
    monthly_cost = 400.0
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from services.model_gateway.provider_config import Price, Routing
from services.runtime.config import ConfigError

__all__ = [
    "MAX_LEVEL",
    "BudgetAlerts",
    "BudgetPlan",
    "Rank",
    "count_spend",
    "cost_micros",
    "read_budgets_file",
    "worst_case_micros",
]

log = logging.getLogger("system.model")

MAX_LEVEL = 4
"""The highest operator permission level a game sends."""
MICROS = 1_000_000
# Distinct label values a spend metric takes before the rest count as "other": module ids and
# server scopes are bounded in practice, but a label must never grow with the players.
MAX_LABEL_VALUES = 256

MODEL_SPEND_TOKENS = Counter(
    "model_spend_tokens",
    "Tokens (prompt + completion) answered calls used, by provider, module and game server "
    "scope (no player label: too many series).",
    ["provider", "module", "scope"],
)
MODEL_SPEND_COST = Counter(
    "model_spend_cost",
    "What answered calls cost at the configured prices (the prices' currency), by provider, "
    "module and game server scope.",
    ["provider", "module", "scope"],
)
MODEL_BUDGET_USED = Gauge(
    "model_budget_used_ratio",
    "Used and held share of each game server and network budget, as the last reservation "
    "on this replica found it (per-player budgets are left out: one series per player).",
    ["budget", "scope"],
)


@dataclasses.dataclass(frozen=True)
class Rank:
    """A permission group and its per-player daily limits."""

    name: str
    min_level: int
    daily_tokens: int
    daily_cost_micros: int = 0


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """Every limit besides the per-request ones; 0 is no limit. Money in micros."""

    ranks: tuple[Rank, ...]
    """By `min_level`, lowest first; the first has min_level 0."""
    player_daily_web_searches: int = 0
    server_daily_tokens: int = 0
    server_daily_cost_micros: int = 0
    network_daily_tokens: int = 0
    network_daily_cost_micros: int = 0
    network_daily_web_searches: int = 0
    network_monthly_tokens: int = 0
    network_monthly_cost_micros: int = 0
    alert_percent: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """By budget name (`player_daily_tokens`, `server_daily_cost`, ...); missing: no alert."""

    def rank(self, level: int | None) -> Rank:
        """The rank of a permission level; the lowest for None (a call that does not say)."""
        chosen = self.ranks[0]
        for rank in self.ranks:
            if level is not None and rank.min_level <= level:
                chosen = rank
        return chosen

    def limits(self, rank: Rank) -> dict[str, int]:
        """The UsageLimits fields a reservation for a player of `rank` carries."""
        return {
            "player_tokens": rank.daily_tokens,
            "player_web_searches": self.player_daily_web_searches,
            "player_cost_micros": rank.daily_cost_micros,
            "global_tokens": self.network_daily_tokens,
            "global_web_searches": self.network_daily_web_searches,
            "global_cost_micros": self.network_daily_cost_micros,
            "server_tokens": self.server_daily_tokens,
            "server_cost_micros": self.server_daily_cost_micros,
            "monthly_tokens": self.network_monthly_tokens,
            "monthly_cost_micros": self.network_monthly_cost_micros,
        }

    @classmethod
    def flat(
        cls,
        player_tokens: int = 0,
        player_web_searches: int = 0,
        global_tokens: int = 0,
        global_web_searches: int = 0,
    ) -> BudgetPlan:
        """The flat settings alone: one rank, no money limits, no alerts."""
        return cls(
            ranks=(Rank("player", 0, player_tokens),),
            player_daily_web_searches=player_web_searches,
            network_daily_tokens=global_tokens,
            network_daily_web_searches=global_web_searches,
        )


# -- reading the file ---------------------------------------------------------------------------

_SECTIONS = {
    "server": {"daily_tokens", "daily_cost", "alert_percent"},
    "network": {"daily_tokens", "daily_cost", "monthly_tokens", "monthly_cost", "alert_percent"},
}
_RANK_KEYS = {"min_level", "daily_tokens", "daily_cost", "alert_percent"}


def read_budgets_file(
    path: str,
    *,
    player_daily_tokens: int,
    player_daily_web_searches: int,
    global_daily_tokens: int,
    global_daily_web_searches: int,
) -> BudgetPlan:
    """Reads and checks `budgets_file`; raises ConfigError naming the key at fault."""
    source = f"budgets_file {path}"
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{source} cannot be read: {exc.strerror or 'unreadable'}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source} is not valid TOML: {exc}") from None
    return parse_budgets(
        data,
        source,
        player_daily_tokens=player_daily_tokens,
        player_daily_web_searches=player_daily_web_searches,
        global_daily_tokens=global_daily_tokens,
        global_daily_web_searches=global_daily_web_searches,
    )


def parse_budgets(
    data: Mapping[str, Any],
    source: str,
    *,
    player_daily_tokens: int,
    player_daily_web_searches: int,
    global_daily_tokens: int,
    global_daily_web_searches: int,
) -> BudgetPlan:
    """The plan of a parsed budgets file (see the module docstring)."""
    unknown = set(data) - {"alert_percent", "ranks", *_SECTIONS}
    if unknown:
        raise ConfigError(
            f"{source}: unknown key {sorted(unknown)[0]!r}; the keys are alert_percent, "
            "[ranks.<name>], [server] and [network]"
        )
    default_alert = _percent(data, "alert_percent", 0, source)
    sections: dict[str, dict[str, Any]] = {}
    for name, keys in _SECTIONS.items():
        table = _table(data.get(name, {}), name, source)
        _known(table, keys, name, source)
        sections[name] = table
    alerts: dict[str, int] = {}
    server, network = sections["server"], sections["network"]
    server_alert = _percent(server, "alert_percent", default_alert, source, "server")
    network_alert = _percent(network, "alert_percent", default_alert, source, "network")
    for budget in ("server_daily_tokens", "server_daily_cost"):
        alerts[budget] = server_alert
    for budget in (
        "network_daily_tokens",
        "network_daily_cost",
        "network_monthly_tokens",
        "network_monthly_cost",
    ):
        alerts[budget] = network_alert
    ranks = _ranks(data.get("ranks"), player_daily_tokens, default_alert, source, alerts)
    return BudgetPlan(
        ranks=ranks,
        player_daily_web_searches=player_daily_web_searches,
        server_daily_tokens=_count(server, "daily_tokens", 0, source, "server"),
        server_daily_cost_micros=_money(server, "daily_cost", source, "server"),
        network_daily_tokens=_count(
            network, "daily_tokens", global_daily_tokens, source, "network"
        ),
        network_daily_cost_micros=_money(network, "daily_cost", source, "network"),
        network_daily_web_searches=global_daily_web_searches,
        network_monthly_tokens=_count(network, "monthly_tokens", 0, source, "network"),
        network_monthly_cost_micros=_money(network, "monthly_cost", source, "network"),
        alert_percent={budget: percent for budget, percent in alerts.items() if percent},
    )


def _ranks(
    value: Any, player_daily_tokens: int, default_alert: int, source: str, alerts: dict[str, int]
) -> tuple[Rank, ...]:
    if value is None:
        alerts["player_daily_tokens"] = alerts["player_daily_cost"] = default_alert
        return (Rank("player", 0, player_daily_tokens),)
    tables = _table(value, "ranks", source)
    if not tables:
        raise ConfigError(f"{source}: [ranks] is empty; give at least [ranks.<name>] min_level = 0")
    ranks: list[Rank] = []
    rank_alerts: set[int] = set()
    for name, raw in tables.items():
        where = f"ranks.{name}"
        table = _table(raw, where, source)
        _known(table, _RANK_KEYS, where, source)
        if "min_level" not in table:
            raise ConfigError(f"{source}: {where}.min_level is missing (0 to {MAX_LEVEL})")
        level = table["min_level"]
        if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= MAX_LEVEL:
            raise ConfigError(
                f"{source}: {where}.min_level must be a whole number 0 to {MAX_LEVEL}, "
                f"got {level!r}"
            )
        if any(rank.min_level == level for rank in ranks):
            other = next(rank.name for rank in ranks if rank.min_level == level)
            raise ConfigError(
                f"{source}: {where}.min_level {level} is also ranks.{other}'s; each rank needs "
                "its own level"
            )
        tokens = _count(table, "daily_tokens", player_daily_tokens, source, where)
        ranks.append(Rank(name, level, tokens, _money(table, "daily_cost", source, where)))
        rank_alerts.add(_percent(table, "alert_percent", default_alert, source, where))
    ranks.sort(key=lambda rank: rank.min_level)
    if ranks[0].min_level != 0:
        raise ConfigError(
            f"{source}: no rank has min_level = 0, so ordinary players would have none; add "
            "[ranks.player] min_level = 0"
        )
    # Players' alerts log one line per player; the strictest rank's threshold is used.
    percent = min((p for p in rank_alerts if p), default=0)
    alerts["player_daily_tokens"] = alerts["player_daily_cost"] = percent
    return tuple(ranks)


def _table(value: Any, where: str, source: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {where} must be a table ([{where}])")
    return value


def _known(table: Mapping[str, Any], keys: set[str], where: str, source: str) -> None:
    unknown = set(table) - keys
    if unknown:
        raise ConfigError(
            f"{source}: unknown key {where}.{sorted(unknown)[0]}; the keys of [{where}] are "
            f"{', '.join(sorted(keys))}"
        )


def _count(table: Mapping[str, Any], key: str, default: int, source: str, where: str) -> int:
    value = table.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(
            f"{source}: {where}.{key} must be a whole number of tokens, 0 (no limit) or more, "
            f"got {value!r}"
        )
    return value


def _money(table: Mapping[str, Any], key: str, source: str, where: str) -> int:
    value = table.get(key, 0)
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(
            f"{source}: {where}.{key} must be an amount in the prices' currency, 0 (no limit) "
            f"or more, got {value!r}"
        )
    return round(value * MICROS)


def _percent(table: Mapping[str, Any], key: str, default: int, source: str, where: str = "") -> int:
    value = table.get(key, default)
    name = f"{where}.{key}" if where else key
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 100:
        raise ConfigError(
            f"{source}: {name} must be a whole percentage 0 (no alert) to 100, got {value!r}"
        )
    return value


# -- money ---------------------------------------------------------------------------------------


def cost_micros(price: Price | None, prompt_tokens: int, completion_tokens: int) -> int:
    """What `price` makes of the tokens, in micros, rounded up (a limit is never undercut)."""
    if price is None:
        return 0
    exact = prompt_tokens * price.input_per_million + completion_tokens * price.output_per_million
    return math.ceil(exact - 1e-9) if exact > 0 else 0


def worst_case_micros(
    routing: Routing, module_id: str, prompt_tokens: int, answer_tokens: int
) -> int:
    """The most a call may cost: its worst-case tokens at the dearest model of its list (a
    fallback may land on any of them)."""
    prices = (
        routing.providers[route.provider].models.get(route.model)
        for route in routing.routes(module_id)
    )
    return max((cost_micros(p, prompt_tokens, answer_tokens) for p in prices), default=0)


def dearest_micros_per_token(routing: Routing) -> float:
    """The highest price per token of any configured model, in micros: what a lease's tokens
    may cost at most."""
    prices = [
        max(price.input_per_million, price.output_per_million)
        for spec in routing.providers.values()
        for price in spec.models.values()
    ]
    return max(prices, default=0.0)


# -- spend metrics ------------------------------------------------------------------------------

_seen: dict[str, set[str]] = {"module": set(), "scope": set()}
# Series looked up once per label set: `labels()` takes a lock and builds a tuple per call.
_series: dict[tuple[str, str, str], tuple[Any, Any]] = {}


def _bounded(kind: str, value: str) -> str:
    seen = _seen[kind]
    if value in seen:
        return value
    if len(seen) >= MAX_LABEL_VALUES:
        return "other"
    seen.add(value)
    return value


def count_spend(provider: str, module_id: str, player_id: str, tokens: int, micros: int) -> None:
    """Adds one answered call's use to the spend metrics."""
    scope = player_id.partition("/")[0] if "/" in player_id else ""
    key = (provider, module_id, scope)
    series = _series.get(key)
    if series is None:
        labels = (
            provider,
            _bounded("module", module_id or "default"),
            _bounded("scope", scope or "none"),
        )
        series = (MODEL_SPEND_TOKENS.labels(*labels), MODEL_SPEND_COST.labels(*labels))
        if len(_series) < 4 * MAX_LABEL_VALUES:
            _series[key] = series
    series[0].inc(tokens)
    if micros:
        series[1].inc(micros / MICROS)


# -- alerts --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Use:
    """One budget as a reservation found it (storage's BudgetUse)."""

    budget: str
    scope: str
    period: str
    used: int
    limit: int


class BudgetAlerts:
    """Logs a warning once per budget, scope and period (per replica) when what is used and
    held passes the budget's `alert_percent`, and keeps the usage gauge of the game server and
    network budgets.

    Used and held: leases hold budget ahead of use, so the warning comes early rather than
    late, by at most the leases held.
    """

    MAX_REMEMBERED = 100_000

    def __init__(
        self,
        percent: Mapping[str, int],
        notify: Callable[[Use, int, str], None] | None = None,
    ) -> None:
        """`notify(use, percent, player_id)` is told of each alert too (the in-game notice to
        administrators, `alerts.AdminNotices.alert`); it must not block or raise."""
        self._percent = dict(percent)
        self._fired: set[tuple[str, str, str]] = set()
        self._notify = notify

    def observe(self, uses: Iterable[Use], player_id: str = "") -> None:
        """`uses`: every limited budget a reservation of `player_id` found."""
        for use in uses:
            if not use.limit:
                continue
            if not use.budget.startswith("player_"):
                MODEL_BUDGET_USED.labels(use.budget, use.scope or "network").set(
                    use.used / use.limit
                )
            percent = self._percent.get(use.budget, 0)
            if not percent or use.used * 100 < use.limit * percent:
                continue
            key = (use.budget, use.scope, use.period)
            if key in self._fired:
                continue
            if len(self._fired) >= self.MAX_REMEMBERED:
                self._forget_old(use.period)
            self._fired.add(key)
            money = use.budget.endswith("_cost")
            shown = (
                f"{use.used / MICROS:.2f} of {use.limit / MICROS:.2f}"
                if money
                else f"{use.used} of {use.limit} tokens"
            )
            log.warning(
                "budget %s%s passed %d%% for %s: %s used or held",
                use.budget,
                f" of {use.scope}" if use.scope else "",
                percent,
                use.period,
                shown,
                extra={"budget": use.budget, "budget_scope": use.scope, "period": use.period},
            )
            if self._notify is not None:
                self._notify(use, percent, player_id)

    def _forget_old(self, current: str) -> None:
        """Drops the alerts of periods before today's and this month's."""
        today = dt.datetime.now(dt.UTC).date()
        keep = {today.isoformat(), today.strftime("%Y-%m"), current}
        self._fired = {key for key in self._fired if key[2] in keep}
