"""Nested budgets of a usage reservation (decision 0029): the limited levels it is checked
against (the player's rank, their game server, the network by day and by month), the refusal
of the tightest, and the budget counter rows' changes, applied in key order.

Domain code: no gRPC here; storage_service.usage runs it inside its reserve and settle
transactions.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Table, case, update
from sqlalchemy.orm import Session

from services.runtime.errors import ResourceExhausted
from storage_service.db import rowcount
from storage_service.dialect import insert_for
from storage_service.usage_records import (
    _COUNTERS,
    _ZERO_ROW,
    Limits,
    scope_of,
)

_COUNTER_ZERO = dict.fromkeys(
    ("used_tokens", "reserved_tokens", "used_cost_micros", "reserved_cost_micros"), 0
)

__all__ = [
    "CounterChanges",
    "Level",
    "budget_levels",
    "counter_keys",
    "counter_limit",
    "least_room",
    "lock_row",
    "refuse_tightest",
    "release",
]


def release(column: Any, amount: int) -> Any:
    """`column - amount`, never below zero."""
    return case((column >= amount, column - amount), else_=0)


def lock_row(session: Session, table: Table, **key: Any) -> Any:
    """The usage row with primary key `key`, made (all zero) when missing, and locked until
    the transaction ends: one INSERT … ON CONFLICT DO UPDATE … RETURNING, which on PostgreSQL
    takes the row lock and on SQLite runs inside the already exclusive transaction."""
    zero = _COUNTER_ZERO if table is _COUNTERS else _ZERO_ROW
    statement = insert_for(session)(table).values(**key, **zero)
    statement = statement.on_conflict_do_update(
        index_elements=list(key), set_={name: statement.excluded[name] for name in key}
    )
    return session.execute(statement.returning(*table.c)).one()


@dataclasses.dataclass(frozen=True)
class Level:
    """One limited budget a reservation is checked against."""

    budget: str
    """Its name, e.g. `player_daily_tokens`; upper-cased with BUDGET_ it is the reason."""
    unit: str
    """`tokens`, `web_searches` or `cost` (micros)."""
    who: str
    """Whose, for the message: `player X`, `game server S`, `everyone together`."""
    scope: str
    period: str
    monthly: bool
    used: int
    held: int
    limit: int

    @property
    def room(self) -> int:
        return self.limit - self.used - self.held


def counter_keys(player_id: str, scope: str, day: dt.date) -> list[tuple[str, str]]:
    """The budget counter rows a reservation of `player_id` on `day` counts on."""
    keys = [("network", day.isoformat()), ("network", day.strftime("%Y-%m"))]
    if player_id:
        keys.append((f"player:{player_id}", day.isoformat()))
    if scope:
        keys.append((f"server:{scope}", day.isoformat()))
    return keys


def counter_limit(budget: str, period: str, limits: Limits) -> tuple[int, int]:
    """The (token, money) limits `limits` set on the budget counter row (`budget`, `period`),
    one of counter_keys's, recorded on the row for the spend view (0: no limit)."""
    if budget.startswith("player:"):
        return limits.player_tokens, limits.player_cost_micros
    if budget.startswith("server:"):
        return limits.server_tokens, limits.server_cost_micros
    if len(period) == 7:  # the network's month
        return limits.monthly_tokens, limits.monthly_cost_micros
    return limits.global_tokens, limits.global_cost_micros


def budget_levels(
    player_id: str,
    day: dt.date,
    limits: Limits,
    totals: Any,
    player: Any,
    counters: dict[tuple[str, str], Any],
) -> list[Level]:
    """Every limited budget of this reservation, with what it has used and holds."""
    scope = scope_of(player_id)
    today, month = day.isoformat(), day.strftime("%Y-%m")
    levels: list[Level] = []

    def add(budget: str, unit: str, who: str, whose: str, limit: int, used: int, held: int) -> None:
        if limit:
            monthly = "monthly" in budget
            period = month if monthly else today
            levels.append(Level(budget, unit, who, whose, period, monthly, used, held, limit))

    def counter(key: str, period: str) -> Any:
        return counters[(key, period)]

    if player is not None:
        who = f"player {player_id}"
        used = player.prompt_tokens + player.completion_tokens
        add(
            "player_daily_tokens",
            "tokens",
            who,
            player_id,
            limits.player_tokens,
            used,
            player.reserved_tokens,
        )
        add(
            "player_daily_web_searches",
            "web_searches",
            who,
            player_id,
            limits.player_web_searches,
            player.web_searches,
            player.reserved_web_searches,
        )
        row = counter(f"player:{player_id}", today)
        add(
            "player_daily_cost",
            "cost",
            who,
            player_id,
            limits.player_cost_micros,
            row.used_cost_micros,
            row.reserved_cost_micros,
        )
    if scope:
        row = counter(f"server:{scope}", today)
        who = f"game server {scope}"
        add(
            "server_daily_tokens",
            "tokens",
            who,
            scope,
            limits.server_tokens,
            row.used_tokens,
            row.reserved_tokens,
        )
        add(
            "server_daily_cost",
            "cost",
            who,
            scope,
            limits.server_cost_micros,
            row.used_cost_micros,
            row.reserved_cost_micros,
        )
    who = "everyone together"
    used = totals.prompt_tokens + totals.completion_tokens
    add(
        "network_daily_tokens",
        "tokens",
        who,
        "",
        limits.global_tokens,
        used,
        totals.reserved_tokens,
    )
    add(
        "network_daily_web_searches",
        "web_searches",
        who,
        "",
        limits.global_web_searches,
        totals.web_searches,
        totals.reserved_web_searches,
    )
    row = counter("network", today)
    add(
        "network_daily_cost",
        "cost",
        who,
        "",
        limits.global_cost_micros,
        row.used_cost_micros,
        row.reserved_cost_micros,
    )
    row = counter("network", month)
    add(
        "network_monthly_tokens",
        "tokens",
        who,
        "",
        limits.monthly_tokens,
        row.used_tokens,
        row.reserved_tokens,
    )
    add(
        "network_monthly_cost",
        "cost",
        who,
        "",
        limits.monthly_cost_micros,
        row.used_cost_micros,
        row.reserved_cost_micros,
    )
    return levels


def least_room(levels: Iterable[Level], unit: str) -> int | None:
    rooms = [level.room for level in levels if level.unit == unit]
    return min(rooms) if rooms else None


def refuse_tightest(levels: list[Level], asked: dict[str, int]) -> None:
    """Raises ResourceExhausted for the tightest level the asked amounts would pass: the one
    with the least room left for this call, measured as room / asked (unit-free, so a money
    limit and a token limit compare), a monthly one first on a tie, since it resets later."""
    passed = [
        level
        for level in levels
        if asked[level.unit] and level.used + level.held + asked[level.unit] > level.limit
    ]
    if not passed:
        return
    level = min(passed, key=lambda level: (level.room / asked[level.unit], not level.monthly))
    raise ResourceExhausted(_refusal(level, asked[level.unit]), f"BUDGET_{level.budget.upper()}")


def _resets(level: Level) -> str:
    day = dt.date.fromisoformat(level.period + "-01" if level.monthly else level.period)
    if level.monthly:
        first = dt.date(day.year + day.month // 12, day.month % 12 + 1, 1)
        return f"The budget resets on {first.isoformat()} at 00:00 UTC"
    return f"The budget renews at 00:00 UTC ({(day + dt.timedelta(days=1)).isoformat()})"


def _refusal(level: Level, asked: int) -> str:
    span, when = ("monthly", "this month (UTC)") if level.monthly else ("daily", "today (UTC)")
    used = level.used
    if level.unit == "cost":
        return (
            f"{span} spending budget of {level.who} exhausted: {_money(used)} spent and "
            f"{_money(level.held)} held for calls in progress (by gateway budget leases) of "
            f"{_money(level.limit)} {when}; this call may cost up to {_money(asked)}. "
            + _resets(level)
        )
    if level.unit == "web_searches":
        return (
            f"{span} web-search budget of {level.who} exhausted: {used} used and {level.held} "
            f"in progress of {level.limit} {when}. " + _resets(level)
        )
    return (
        f"{span} token budget of {level.who} exhausted: {used} used and {level.held} held for "
        f"calls in progress (by gateway budget leases) of {level.limit} {when}; this call "
        f"needs up to {asked}. " + _resets(level)
    )


def _money(micros: int) -> str:
    """Micros in the prices' currency, e.g. 1.250000."""
    return f"{micros / 1_000_000:.6f}".rstrip("0").rstrip(".") if micros else "0"


class CounterChanges:
    """Changes to budget counter rows within one transaction, applied together at its end
    in key order (after every totals and player row the transaction locks: the lock order)."""

    def __init__(self) -> None:
        # (budget, period) -> [held, released, used] each (tokens, cost)
        self._rows: dict[tuple[str, str], list[int]] = {}
        self._limits: dict[tuple[str, str], tuple[int, int]] = {}

    def _row(self, budget: str, period: str) -> list[int]:
        return self._rows.setdefault((budget, period), [0] * 6)

    def hold(self, budget: str, period: str, tokens: int, cost: int) -> None:
        row = self._row(budget, period)
        row[0] += tokens
        row[1] += cost

    def release(self, budget: str, period: str, tokens: int, cost: int) -> None:
        row = self._row(budget, period)
        row[2] += tokens
        row[3] += cost

    def use(self, budget: str, period: str, tokens: int, cost: int) -> None:
        row = self._row(budget, period)
        row[4] += tokens
        row[5] += cost

    def limit(self, budget: str, period: str, tokens: int, cost: int) -> None:
        """Records the row's limits (as the reservation carried them) with its changes."""
        self._limits[(budget, period)] = (tokens, cost)

    def apply(self, session: Session) -> None:
        c = _COUNTERS.c
        for (budget, period), row in sorted(self._rows.items()):
            if not any(row):
                continue
            values: dict[str, Any] = {
                "reserved_tokens": release(c.reserved_tokens + row[0], row[2]),
                "reserved_cost_micros": release(c.reserved_cost_micros + row[1], row[3]),
                "used_tokens": c.used_tokens + row[4],
                "used_cost_micros": c.used_cost_micros + row[5],
            }
            limits = self._limits.get((budget, period))
            if limits is not None:
                values["limit_tokens"], values["limit_cost_micros"] = limits
            change = (
                update(_COUNTERS).where((c.budget == budget) & (c.period == period)).values(values)
            )
            # One statement when the row exists (its reservation made it); otherwise made first.
            if rowcount(session.execute(change)) == 0:
                lock_row(session, _COUNTERS, budget=budget, period=period)
                session.execute(change)
