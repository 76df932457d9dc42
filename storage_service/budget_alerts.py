"""Budget alerts fired once across every model-gateway replica (PlayerDataService.
ClaimBudgetAlert, decision 0029).

Each model-gateway replica sees a budget pass its `alert_percent` on its own (the reservation
that found it so); every one of them may ask to send the in-game alert. `budget_alerts` holds
one row per (budget, scope, period, percent): the first claim inserts it (a conditional
insert on that key, so two replicas racing cannot both win, on SQLite or PostgreSQL) and
names its claimant; a later claim by another claimant is refused, one by the same claimant
(a retry after a lost answer) is granted again. The winner is answered the internal addresses
of every live gateway replica (storage's presence table, storage_service.presence), so the
notice reaches the administrators whichever replica their game server is connected to.

Rows of periods long past are deleted by the next new claim (`KEEP_DAYS`): alerts are rare.

Domain code: no gRPC here. Every call takes `now`, so tests say what time it is.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import NamedTuple

from sqlalchemy import DateTime, Index, Integer, String, delete, select
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from services.runtime.errors import InvalidArgument
from storage_service.db import KEEP_ON_RESET, Base, rowcount, table_of, upsert_ignore
from storage_service.presence import MAX_REPLICA_ID, live_replica_addresses
from storage_service.usage_spend import check_period
from storage_service.validation import MAX_PLAYER_ID, check_id

__all__ = ["KEEP_DAYS", "AlertClaim", "BudgetAlertClaims", "BudgetAlertRow"]

MAX_BUDGET = 64
KEEP_DAYS = 62
"""Days a claim is remembered: past the longest period (a month) and a margin."""
_BUDGET = re.compile(r"^[a-z][a-z0-9_]*$")


class BudgetAlertRow(Base):
    """One alert sent: a budget of a scope passing `percent` in a period, and who sent it."""

    __tablename__ = "budget_alerts"
    __table_args__ = (
        Index("ix_budget_alerts_claimed_at", "claimed_at"),
        # Usage figures, no player's data: kept on reset (a player budget's scope is the id).
        {"info": {KEEP_ON_RESET: True}},
    )

    budget: Mapped[str] = mapped_column(String(MAX_BUDGET), primary_key=True)
    scope: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), primary_key=True)
    """The game server's scope, the player id, or "" for the network."""
    period: Mapped[str] = mapped_column(String(10), primary_key=True)
    """`YYYY-MM-DD` or `YYYY-MM` (UTC)."""
    percent: Mapped[int] = mapped_column(Integer, primary_key=True)
    claimant: Mapped[str] = mapped_column(String(MAX_REPLICA_ID))
    """The model-gateway replica that sends the alert."""
    claimed_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


_ALERTS = table_of(BudgetAlertRow)


class AlertClaim(NamedTuple):
    """What ClaimBudgetAlert answers."""

    claimed: bool
    """Whether the caller sends the alert."""
    gateway_addresses: list[str]
    """With `claimed`: every live gateway replica's internal address, sorted; else empty."""


def _check(budget: str, scope: str, period: str, percent: int, claimant: str) -> None:
    if not _BUDGET.match(budget) or len(budget) > MAX_BUDGET:
        raise InvalidArgument(
            f"budget must be a budget name such as server_daily_tokens, got {budget[:64]!r}"
        )
    if scope:
        check_id(scope, "scope", MAX_PLAYER_ID)
    check_period(period)
    if not 1 <= percent <= 100:
        raise InvalidArgument(f"percent must be 1 to 100, got {percent}")
    check_id(claimant, "claimant", MAX_REPLICA_ID)


class BudgetAlertClaims:
    """The claim rule over a database (see the module docstring)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def claim(
        self, budget: str, scope: str, period: str, percent: int, claimant: str, now: dt.datetime
    ) -> AlertClaim:
        """Claims the alert of `budget` of `scope` passing `percent` in `period` for
        `claimant`; one transaction.

        Raises:
            InvalidArgument: a malformed budget, scope, period, percent or claimant.
        """
        _check(budget, scope, period, percent, claimant)
        with self._sessions.begin() as session:
            inserted = session.execute(
                upsert_ignore(
                    session,
                    _ALERTS,
                    budget=budget,
                    scope=scope,
                    period=period,
                    percent=percent,
                    claimant=claimant,
                    claimed_at=now,
                )
            )
            if rowcount(inserted) == 1:
                _prune(session, now)
            else:  # claimed before: granted again only to the same claimant (a retry)
                holder = session.execute(
                    select(_ALERTS.c.claimant).where(
                        _ALERTS.c.budget == budget,
                        _ALERTS.c.scope == scope,
                        _ALERTS.c.period == period,
                        _ALERTS.c.percent == percent,
                    )
                ).scalar_one()
                if holder != claimant:
                    return AlertClaim(False, [])
            return AlertClaim(True, live_replica_addresses(session, now))


def _prune(session: Session, now: dt.datetime) -> None:
    """Deletes the claims older than KEEP_DAYS (by the index on `claimed_at`)."""
    cutoff = now - dt.timedelta(days=KEEP_DAYS)
    session.execute(delete(_ALERTS).where(_ALERTS.c.claimed_at < cutoff))
