"""Spend by player, module and provider: the `usage_spend` rows a settle adds to, and the
administrators' view of them (`/system spend`, PlayerDataService.GetSpend) beside the budget
counters' use and limits.

Domain code: no gRPC here. The writes (`add_spend`) run inside a settle's transaction
(storage_service.usage), last, after the budget counter rows: the lock order. The reads
(`SpendView`) take no lock: a view may be a settle behind.

The tables are storage_service.usage_records'.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from system.storage.v1 import player_data_pb2

from services.runtime.errors import InvalidArgument
from storage_service.dialect import insert_for
from storage_service.usage_records import _COUNTERS, _SPEND
from storage_service.validation import MAX_PLAYER_ID, check_id

__all__ = ["DEFAULT_SPEND_LINES", "MAX_SPEND_LINES", "SpendView", "add_spend"]


class SpendView:
    """Reads of spend and of the budget counters' money, each in one session.

    Args:
        sessions: the storage service's session factory.
    """

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def spend(
        self, scope: str, period: str, max_lines: int = 0
    ) -> player_data_pb2.GetSpendResponse:
        """What `scope`'s players spent in `period` (a UTC day or month; "" for today): in
        total, by player, module and provider, and the scope's and the network's budgets.

        Raises:
            InvalidArgument: a malformed scope or period, or max_lines over MAX_SPEND_LINES.
        """
        check_id(scope, "scope", MAX_PLAYER_ID - 1)
        if "/" in scope:
            raise InvalidArgument(f"scope must not contain '/': {scope!r} is a player id")
        period = period or dt.datetime.now(dt.UTC).date().isoformat()
        monthly = check_period(period)
        if max_lines > MAX_SPEND_LINES:
            raise InvalidArgument(f"max_lines is {max_lines}; the most is {MAX_SPEND_LINES}")
        lines = max_lines or DEFAULT_SPEND_LINES
        c = _COUNTERS.c
        with self._sessions() as session:
            counters = session.execute(
                select(
                    c.budget,
                    c.period,
                    c.used_tokens,
                    c.reserved_tokens,
                    c.used_cost_micros,
                    c.reserved_cost_micros,
                    c.limit_tokens,
                    c.limit_cost_micros,
                ).where(
                    (c.period.in_(sorted({period, period[:7]})) | _days(c.period, period, monthly))
                    & (
                        c.budget.in_(["network", f"server:{scope}"])
                        | c.budget.like(f"player:{_like(scope)}/%", escape="\\")
                    )
                )
            ).all()
            modules = session.execute(
                select(
                    _SPEND.c.module_id, _SPEND.c.provider, _SPEND.c.tokens, _SPEND.c.cost_micros
                ).where(_days(_SPEND.c.period, period, monthly) & (_SPEND.c.scope == scope))
            ).all()
        players: dict[str, list[int]] = {}
        total, network = [0, 0], [0, 0]
        budgets: list[player_data_pb2.BudgetUse] = []
        for row in counters:
            daily = len(row.period) == 10
            if row.budget.startswith("player:"):
                _add(players.setdefault(row.budget[len("player:") :], [0, 0]), row)
                continue
            if daily:
                _add(total if row.budget.startswith("server:") else network, row)
            # The budgets: the day's rows for a day, the month's row for a day or a month.
            if not daily or row.period == period:
                budgets.extend(_budget_uses(row, scope))
        by_module: dict[str, list[int]] = {}
        by_provider: dict[str, list[int]] = {}
        for line in modules:
            for key, into in ((line.module_id, by_module), (line.provider, by_provider)):
                entry = into.setdefault(key, [0, 0])
                entry[0] += line.tokens
                entry[1] += line.cost_micros
        return player_data_pb2.GetSpendResponse(
            period=period,
            total=_line(scope, total),
            network=_line("", network),
            players=_top(players, lines),
            modules=_top(by_module, lines),
            providers=_top(by_provider, lines),
            budgets=budgets,
            player_count=len(players),
        )

    def daily_cost(self, budget: str, first: str, last: str) -> dict[str, int]:
        """Money (micros) used on budget counter `budget` (`player:<id>` or `server:<scope>`)
        per day from `first` to `last` (`YYYY-MM-DD`, both included, already checked)."""
        c = _COUNTERS.c
        with self._sessions() as session:
            rows = session.execute(
                select(c.period, c.used_cost_micros).where(
                    (c.budget == budget) & (c.period >= first) & (c.period <= last)
                )
            ).all()
        return {row.period: row.used_cost_micros for row in rows if len(row.period) == 10}


DEFAULT_SPEND_LINES = 10
MAX_SPEND_LINES = 100
_PERIOD_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_PERIOD_MONTH = re.compile(r"^\d{4}-\d{2}$")
# The budgets each counter row carries limits for, by its key's kind and period's length.
_ROW_BUDGETS = {
    ("server", 10): ("server_daily_tokens", "server_daily_cost"),
    ("network", 10): ("network_daily_tokens", "network_daily_cost"),
    ("network", 7): ("network_monthly_tokens", "network_monthly_cost"),
}


def check_period(period: str) -> bool:
    """Whether `period` is a UTC month `YYYY-MM` (else a day `YYYY-MM-DD`); InvalidArgument
    when it is neither (a budget's period, storage_service.budget_alerts, too)."""
    try:
        if _PERIOD_MONTH.match(period):
            dt.date.fromisoformat(period + "-01")
            return True
        if _PERIOD_DAY.match(period):
            dt.date.fromisoformat(period)
            return False
    except ValueError:
        pass
    raise InvalidArgument(
        f"period must be a UTC day YYYY-MM-DD or month YYYY-MM, got {period[:16]!r}"
    )


def _days(period_column: Any, period: str, monthly: bool) -> Any:
    """Rows of the day `period`, or of every day of the month `period`."""
    return period_column.like(f"{period}-__") if monthly else period_column == period


def _like(text: str) -> str:
    """`text` with LIKE's wildcards escaped (by a backslash)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _add(into: list[int], row: Any) -> None:
    into[0] += row.used_tokens
    into[1] += row.used_cost_micros


def _line(name: str, amounts: list[int]) -> player_data_pb2.SpendLine:
    return player_data_pb2.SpendLine(name=name, tokens=amounts[0], cost_micros=amounts[1])


def _top(found: dict[str, list[int]], most: int) -> list[player_data_pb2.SpendLine]:
    """The `most` largest spenders: by money, then tokens, then name."""
    ranked = sorted(found.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))
    return [_line(name, amounts) for name, amounts in ranked[:most]]


def _budget_uses(row: Any, scope: str) -> list[player_data_pb2.BudgetUse]:
    """The limited budgets of one server or network counter row."""
    names = _ROW_BUDGETS.get((row.budget.partition(":")[0], len(row.period)))
    if names is None:
        return []
    whose = scope if row.budget.startswith("server:") else ""
    uses = []
    for name, used, held, limit in (
        (names[0], row.used_tokens, row.reserved_tokens, row.limit_tokens),
        (names[1], row.used_cost_micros, row.reserved_cost_micros, row.limit_cost_micros),
    ):
        if limit:
            uses.append(
                player_data_pb2.BudgetUse(
                    budget=name,
                    scope=whose,
                    period=row.period,
                    used=used + held,
                    limit=limit,
                    held=held,
                )
            )
    return uses


def add_spend(session: Session, day: str, spent: dict[tuple[str, str, str], list[int]]) -> None:
    """Adds a settle transaction's spend by (scope, module, provider) to the day's rows."""
    for (scope, module_id, provider), (tokens, cost) in sorted(spent.items()):
        if not tokens and not cost:
            continue
        statement = insert_for(session)(_SPEND).values(
            period=day,
            scope=scope,
            module_id=module_id,
            provider=provider,
            tokens=tokens,
            cost_micros=cost,
        )
        session.execute(
            statement.on_conflict_do_update(
                index_elements=["period", "scope", "module_id", "provider"],
                set_={
                    "tokens": _SPEND.c.tokens + statement.excluded.tokens,
                    "cost_micros": _SPEND.c.cost_micros + statement.excluded.cost_micros,
                },
            )
        )
