"""Reservations against daily budgets (storage_service.usage), on SQLite and PostgreSQL.

The concurrency tests run many threads against one database: the atomic check in storage is
what keeps the budget when several model-gateway replicas reserve at once.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker
from system.storage.v1 import player_data_pb2

from services.runtime.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from storage_service.db import PreferenceRow, make_engine
from storage_service.migrate import upgrade
from storage_service.player_data import PlayerDataStore, UsageRow
from storage_service.usage import Limits, ReservationRow, UsageLedger, UsageTotalRow


@pytest.fixture
def sessions(database_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(database_url)
    upgrade(engine)
    try:
        yield sessionmaker(engine, expire_on_commit=False)
    finally:
        engine.dispose()


def _player() -> str:
    return f"p-{uuid.uuid4().hex[:10]}"


def _rid() -> str:
    return uuid.uuid4().hex


def _row(sessions: sessionmaker[Session], player_id: str) -> UsageRow:
    with sessions() as session:
        return session.execute(select(UsageRow).where(UsageRow.player_id == player_id)).scalar_one()


def _totals(sessions: sessionmaker[Session]) -> UsageTotalRow:
    with sessions() as session:
        today = dt.datetime.now(dt.UTC).date()
        return session.execute(select(UsageTotalRow).where(UsageTotalRow.day == today)).scalar_one()


def _used(**amounts: int) -> player_data_pb2.UsageAmounts:
    return player_data_pb2.UsageAmounts(**amounts)


def test_reserve_then_settle_records_actual_use(sessions: sessionmaker[Session]) -> None:
    ledger = UsageLedger(sessions)
    player, rid = _player(), _rid()
    before = _totals_or_zero(sessions)
    day = ledger.reserve(rid, player, 500, 0, Limits(player_tokens=1000), 60)
    assert day == dt.datetime.now(dt.UTC).date()
    assert (_row(sessions, player).reserved_tokens, _row(sessions, player).prompt_tokens) == (
        500,
        0,
    )
    used = _used(
        prompt_tokens=120,
        completion_tokens=30,
        prompt_cache_hit_tokens=100,
        prompt_cache_miss_tokens=20,
        model_calls=1,
    )
    assert ledger.settle(rid, player, used) is True
    row = _row(sessions, player)
    assert (row.reserved_tokens, row.prompt_tokens, row.completion_tokens) == (0, 120, 30)
    assert (row.prompt_cache_hit_tokens, row.prompt_cache_miss_tokens, row.model_calls) == (
        100,
        20,
        1,
    )
    totals = _totals(sessions)
    assert totals.prompt_tokens - before[0] == 120
    # GetUsage reports the new columns too.
    [daily] = PlayerDataStore(sessions).get_usage(player)
    assert (daily.prompt_cache_hit_tokens, daily.prompt_cache_miss_tokens) == (100, 20)
    # A second settle finds nothing held and records again (settle is not idempotent).
    assert ledger.settle(rid, player, _used()) is False


def _totals_or_zero(sessions: sessionmaker[Session]) -> tuple[int, int]:
    """(prompt tokens, tokens used or held) of today's totals; the database is shared by the
    tests of this module."""
    try:
        totals = _totals(sessions)
    except Exception:  # noqa: BLE001 - no row yet today
        return (0, 0)
    used = totals.prompt_tokens + totals.completion_tokens + totals.reserved_tokens
    return (totals.prompt_tokens, used)


def test_budget_counts_used_and_held(sessions: sessionmaker[Session]) -> None:
    ledger = UsageLedger(sessions)
    player = _player()
    limits = Limits(player_tokens=1000)
    first = _rid()
    ledger.reserve(first, player, 600, 0, limits, 60)
    with pytest.raises(ResourceExhausted) as caught:
        ledger.reserve(_rid(), player, 500, 0, limits, 60)
    message = str(caught.value)
    assert f"player {player}" in message and "600 held" in message and "needs up to 500" in message
    ledger.settle(first, player, _used(prompt_tokens=100, completion_tokens=50))
    ledger.reserve(_rid(), player, 500, 0, limits, 60)  # 150 used + 500 held fits now
    assert _row(sessions, player).reserved_tokens == 500


def test_release_on_failure_and_idempotent_reserve(sessions: sessionmaker[Session]) -> None:
    ledger = UsageLedger(sessions)
    player, rid = _player(), _rid()
    ledger.reserve(rid, player, 300, 0, Limits(), 60)
    ledger.reserve(rid, player, 300, 0, Limits(), 60)  # a retried request holds once
    assert _row(sessions, player).reserved_tokens == 300
    assert ledger.settle(rid, player, _used()) is True  # nothing used: released
    row = _row(sessions, player)
    assert (row.reserved_tokens, row.prompt_tokens, row.model_calls) == (0, 0, 0)


def test_web_search_budget(sessions: sessionmaker[Session]) -> None:
    ledger = UsageLedger(sessions)
    player = _player()
    limits = Limits(player_web_searches=2)
    for _ in range(2):
        rid = _rid()
        ledger.reserve(rid, player, 0, 1, limits, 60)
        ledger.settle(rid, player, _used(web_searches=1))
    with pytest.raises(ResourceExhausted, match="web-search budget"):
        ledger.reserve(_rid(), player, 0, 1, limits, 60)
    assert _row(sessions, player).web_searches == 2


def test_global_budget_applies_to_everyone(sessions: sessionmaker[Session]) -> None:
    ledger = UsageLedger(sessions)
    already = _totals_or_zero(sessions)[1]
    limits = Limits(global_tokens=already + 1000)
    ledger.reserve(_rid(), _player(), 700, 0, limits, 60)
    with pytest.raises(ResourceExhausted, match="everyone together"):
        ledger.reserve(_rid(), "", 400, 0, limits, 60)  # no player's behalf: global only
    ledger.reserve(_rid(), "", 300, 0, limits, 60)


def test_external_services_off_is_refused(sessions: sessionmaker[Session]) -> None:
    ledger = UsageLedger(sessions)
    player = _player()
    with sessions.begin() as session:
        session.add(PreferenceRow(player_id=player, history_enabled=True, external_enabled=False))
    with pytest.raises(FailedPrecondition, match="turned external services off"):
        ledger.reserve(_rid(), player, 10, 0, Limits(), 60)


def test_expired_holds_are_released_by_a_later_reservation(
    sessions: sessionmaker[Session],
) -> None:
    ledger = UsageLedger(sessions, sweep_interval_seconds=0)
    player, stale = _player(), _rid()
    limits = Limits(player_tokens=1000)
    ledger.reserve(stale, player, 900, 0, limits, 60)
    with sessions.begin() as session:  # as if its gateway replica died an hour ago
        session.execute(
            update(ReservationRow)
            .where(ReservationRow.reservation_id == stale)
            .values(expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1))
        )
    ledger.reserve(_rid(), player, 900, 0, limits, 60)
    assert _row(sessions, player).reserved_tokens == 900
    # The late settle of the expired hold still records its use.
    assert ledger.settle(stale, player, _used(prompt_tokens=5)) is False
    assert _row(sessions, player).prompt_tokens == 5


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda lg: lg.reserve("", "p1", 1, 0, Limits(), 60), "reservation_id"),
        (lambda lg: lg.reserve("a b", "p1", 1, 0, Limits(), 60), "reservation_id"),
        (lambda lg: lg.reserve("r1", "p1", 0, 0, Limits(), 60), "tokens or web_searches"),
        (lambda lg: lg.reserve("r1", "p1", 1, 0, Limits(), 0), "ttl_seconds"),
        (lambda lg: lg.reserve("r1", "p1", 2**41, 0, Limits(), 60), "tokens is"),
        (lambda lg: lg.reserve("r1", "x" * 65, 1, 0, Limits(), 60), "player_id"),
    ],
)
def test_invalid_reservations(sessions: sessionmaker[Session], call, expected: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgument, match=expected):
        call(UsageLedger(sessions))


def test_settle_of_another_players_reservation_is_refused(
    sessions: sessionmaker[Session],
) -> None:
    ledger = UsageLedger(sessions)
    player, rid = _player(), _rid()
    ledger.reserve(rid, player, 10, 0, Limits(), 60)
    with pytest.raises(InvalidArgument, match="belongs to player"):
        ledger.settle(rid, "someone-else", _used())


def test_concurrent_reservations_never_exceed_the_budget(
    sessions: sessionmaker[Session],
) -> None:
    """32 threads each try 5 reservations of 100 tokens against a 1,000-token budget (and
    settle half of them to 100 actual tokens): exactly as many succeed as fit."""
    ledger = UsageLedger(sessions)
    player = _player()
    limits = Limits(player_tokens=1000)
    granted: list[str] = []
    refused = 0
    lock = threading.Lock()

    def worker(index: int) -> None:
        nonlocal refused
        for attempt in range(5):
            rid = _rid()
            try:
                ledger.reserve(rid, player, 100, 0, limits, 60)
            except ResourceExhausted:
                with lock:
                    refused += 1
                continue
            with lock:
                granted.append(rid)
            if (index + attempt) % 2:
                ledger.settle(rid, player, _used(prompt_tokens=60, completion_tokens=40))
            time.sleep(0)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    row = _row(sessions, player)
    assert len(granted) == 10
    assert refused == 32 * 5 - 10
    assert row.prompt_tokens + row.completion_tokens + row.reserved_tokens == 1000
