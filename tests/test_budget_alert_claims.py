"""Budget alerts claimed once across model-gateway replicas (storage_service.budget_alerts),
on SQLite and PostgreSQL: the first claimant wins, a retry of the winner is granted again, a
racing claimant never; the winner gets every live gateway replica's address."""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from services.presence import players_digest
from services.runtime.errors import InvalidArgument
from storage_service.budget_alerts import KEEP_DAYS, BudgetAlertClaims, BudgetAlertRow
from storage_service.presence import PresenceStore

NOW = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC)
NO_PLAYERS = players_digest([])


def _scope() -> str:
    return f"s{uuid.uuid4().hex[:8]}"


def test_the_first_claimant_sends_and_a_retry_is_granted_again(
    sessions: sessionmaker[Session],
) -> None:
    presence = PresenceStore(sessions)
    presence.renew_replica("gw-a", "10.0.0.1:50056", 60, NO_PLAYERS, NOW)
    presence.renew_replica("gw-b", "10.0.0.2:50056", 60, NO_PLAYERS, NOW)
    presence.renew_replica(
        "gw-gone", "10.0.0.9:50056", 5, NO_PLAYERS, NOW - dt.timedelta(seconds=60)
    )
    claims = BudgetAlertClaims(sessions)
    scope = _scope()

    first = claims.claim("server_daily_tokens", scope, "2026-12-02", 80, "model-1", NOW)
    assert first.claimed
    assert first.gateway_addresses == ["10.0.0.1:50056", "10.0.0.2:50056"]  # live ones only
    other = claims.claim("server_daily_tokens", scope, "2026-12-02", 80, "model-2", NOW)
    assert (other.claimed, other.gateway_addresses) == (False, [])
    again = claims.claim("server_daily_tokens", scope, "2026-12-02", 80, "model-1", NOW)
    assert again.claimed and again.gateway_addresses == first.gateway_addresses

    # Another period, threshold, budget or scope is another crossing.
    for budget, whose, period, percent in (
        ("server_daily_tokens", scope, "2026-12-03", 80),
        ("server_daily_tokens", scope, "2026-12-02", 90),
        ("server_daily_cost", scope, "2026-12-02", 80),
        ("server_daily_tokens", _scope(), "2026-12-02", 80),
        ("network_monthly_cost", "", "2026-12", 80),
    ):
        assert claims.claim(budget, whose, period, percent, "model-2", NOW).claimed
    with sessions() as session:
        holders = session.execute(
            select(BudgetAlertRow.claimant).where(BudgetAlertRow.scope == scope)
        ).scalars()
        assert sorted(holders) == ["model-1", "model-2", "model-2", "model-2"]


def test_old_claims_are_forgotten_by_a_later_one(sessions: sessionmaker[Session]) -> None:
    claims = BudgetAlertClaims(sessions)
    scope = _scope()
    long_ago = NOW - dt.timedelta(days=KEEP_DAYS + 1)
    assert claims.claim("server_daily_tokens", scope, "2026-09-01", 80, "model-1", long_ago).claimed
    recent = NOW - dt.timedelta(days=KEEP_DAYS - 1)
    assert claims.claim("server_daily_tokens", scope, "2026-10-03", 80, "model-1", recent).claimed
    assert claims.claim("server_daily_cost", scope, "2026-12-02", 80, "model-1", NOW).claimed
    with sessions() as session:
        periods = session.execute(
            select(BudgetAlertRow.period).where(BudgetAlertRow.scope == scope)
        ).scalars()
        assert sorted(periods) == ["2026-10-03", "2026-12-02"]


def test_racing_claimants_one_wins(sessions: sessionmaker[Session]) -> None:
    """Eight replicas claim the same crossing at once: exactly one is granted."""
    claims = BudgetAlertClaims(sessions)
    scope = _scope()
    start = threading.Barrier(8)
    won: list[str] = []
    errors: list[BaseException] = []

    def claim(name: str) -> None:
        start.wait()
        try:
            if claims.claim("server_daily_cost", scope, "2026-12-02", 50, name, NOW).claimed:
                won.append(name)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=claim, args=(f"model-{n}",)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(won) == 1
    with sessions() as session:
        holder = session.execute(
            select(BudgetAlertRow.claimant).where(BudgetAlertRow.scope == scope)
        ).scalar_one()
    assert holder == won[0]


@pytest.mark.parametrize(
    ("budget", "scope", "period", "percent", "claimant", "says"),
    [
        ("", "s", "2026-12-02", 80, "m", "budget must be a budget name"),
        ("Server Daily", "s", "2026-12-02", 80, "m", "budget must be a budget name"),
        ("server_daily_tokens", "s", "2026-12-32", 80, "m", "period must be"),
        ("server_daily_tokens", "s", "yesterday", 80, "m", "period must be"),
        ("server_daily_tokens", "s", "2026-13", 80, "m", "period must be"),
        ("server_daily_tokens", "s", "2026-12-02", 0, "m", "percent must be 1 to 100"),
        ("server_daily_tokens", "s", "2026-12-02", 101, "m", "percent must be 1 to 100"),
        ("server_daily_tokens", "s", "2026-12-02", 80, "", "claimant"),
        ("server_daily_tokens", "x" * 65, "2026-12-02", 80, "m", "scope"),
    ],
)
def test_malformed_claims_are_refused(
    sessions: sessionmaker[Session],
    budget: str,
    scope: str,
    period: str,
    percent: int,
    claimant: str,
    says: str,
) -> None:
    with pytest.raises(InvalidArgument, match=says):
        BudgetAlertClaims(sessions).claim(budget, scope, period, percent, claimant, NOW)
