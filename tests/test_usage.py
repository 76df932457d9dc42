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
from storage_service.usage import UsageLedger
from storage_service.usage_records import (
    AMOUNT_FIELDS,
    Grant,
    Limits,
    ReservationRow,
    SettleItem,
    UsageTotalRow,
)
from storage_service.usage_spend import SpendView


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
    grant = ledger.reserve(rid, player, 500, 0, Limits(player_tokens=1000), 60)
    assert grant == Grant(dt.datetime.now(dt.UTC).date(), 500, 0)
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
    assert ledger.settle(rid, player, used).found is True
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
    # A second settle without a sequence finds nothing held and records again.
    assert ledger.settle(rid, player, _used(model_calls=1)).found is False
    assert _row(sessions, player).model_calls == 2


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
    assert ledger.settle(rid, player, _used()).found is True  # nothing used: released
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
    assert ledger.settle(stale, player, _used(prompt_tokens=5)).found is False
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


# -- leases: blocks held beyond one call, settled in batches --------------------------------------


def test_lease_extras_are_granted_as_far_as_the_limits_leave_room(
    sessions: sessionmaker[Session],
) -> None:
    ledger = UsageLedger(sessions)
    player = _player()
    limits = Limits(player_tokens=1000, player_web_searches=3)
    first = ledger.reserve(
        _rid(), player, 100, 0, limits, 60, extra_tokens=500, extra_web_searches=2
    )
    assert (first.tokens, first.web_searches) == (600, 2)
    # 400 left for the player: the call's 100 and 300 of the 500 extra.
    second = ledger.reserve(
        _rid(), player, 100, 1, limits, 60, extra_tokens=500, extra_web_searches=5
    )
    assert (second.tokens, second.web_searches) == (400, 1)
    assert _row(sessions, player).reserved_tokens == 1000
    with pytest.raises(ResourceExhausted):  # the call's own worst case must fit
        ledger.reserve(_rid(), player, 1, 0, limits, 60, extra_tokens=500)
    # No limit: all of it.
    unlimited = ledger.reserve(_rid(), _player(), 10, 0, Limits(), 60, extra_tokens=5000)
    assert unlimited.tokens == 5010


def test_lease_extras_respect_the_global_budget(sessions: sessionmaker[Session]) -> None:
    ledger = UsageLedger(sessions)
    already = _totals_or_zero(sessions)[1]
    limits = Limits(player_tokens=10_000, global_tokens=already + 700)
    grant = ledger.reserve(_rid(), _player(), 100, 0, limits, 60, extra_tokens=5000)
    assert grant.tokens == 700


def test_keep_open_settles_record_use_and_keep_the_rest(sessions: sessionmaker[Session]) -> None:
    ledger = UsageLedger(sessions)
    player, rid = _player(), _rid()
    ledger.reserve(rid, player, 100, 0, Limits(player_tokens=5000), 60, extra_tokens=900)
    used = _used(
        prompt_tokens=150, completion_tokens=50, prompt_cache_hit_tokens=100, model_calls=2
    )
    settled = ledger.settle(rid, player, used, sequence=1, keep=(800, 0), ttl_seconds=120)
    assert (settled.found, settled.duplicate, settled.held_tokens) == (True, False, 800)
    assert settled.external_enabled is True
    row = _row(sessions, player)
    assert (row.prompt_tokens, row.completion_tokens, row.reserved_tokens) == (150, 50, 800)
    assert (row.prompt_cache_hit_tokens, row.model_calls) == (100, 2)
    with sessions() as session:  # renewed
        hold = session.get(ReservationRow, rid)
        assert hold is not None and not hold.closed and hold.settled_sequence == 1
        left = hold.expires_at.replace(tzinfo=dt.UTC) - dt.datetime.now(dt.UTC)
        assert dt.timedelta(seconds=100) < left <= dt.timedelta(seconds=120)
    # A keep above what is held never grows it.
    assert (
        ledger.settle(rid, player, _used(), sequence=2, keep=(5000, 3), ttl_seconds=60).held_tokens
        == 800
    )
    assert _row(sessions, player).reserved_tokens == 800
    closed = ledger.settle(rid, player, _used(prompt_tokens=10, model_calls=1), sequence=3)
    assert (closed.found, closed.held_tokens) == (True, 0)
    row = _row(sessions, player)
    assert (row.prompt_tokens, row.reserved_tokens, row.model_calls) == (160, 0, 3)


def test_a_retried_settle_is_applied_once(sessions: sessionmaker[Session]) -> None:
    ledger = UsageLedger(sessions)
    player, rid = _player(), _rid()
    ledger.reserve(rid, player, 100, 0, Limits(), 60, extra_tokens=900)
    batch = _used(prompt_tokens=30, completion_tokens=20, model_calls=1)
    for _ in range(3):  # the answer was lost twice: sent three times
        ledger.settle(rid, player, batch, sequence=1, keep=(950, 0), ttl_seconds=60)
    row = _row(sessions, player)
    assert (row.prompt_tokens, row.completion_tokens, row.model_calls) == (30, 20, 1)
    assert row.reserved_tokens == 950
    repeat = ledger.settle(rid, player, batch, sequence=1, keep=(950, 0), ttl_seconds=60)
    assert (repeat.duplicate, repeat.held_tokens) == (True, 950)
    # The closing settle, retried after it was applied, changes nothing either.
    ledger.settle(rid, player, _used(prompt_tokens=5, model_calls=1), sequence=2)
    again = ledger.settle(rid, player, _used(prompt_tokens=5, model_calls=1), sequence=2)
    assert (again.duplicate, again.found) == (True, False)
    row = _row(sessions, player)
    assert (row.prompt_tokens, row.model_calls, row.reserved_tokens) == (35, 2, 0)


def test_an_expired_lease_is_released_and_late_use_still_recorded(
    sessions: sessionmaker[Session],
) -> None:
    ledger = UsageLedger(sessions, sweep_interval_seconds=0)
    player, lease = _player(), _rid()
    limits = Limits(player_tokens=1000)
    ledger.reserve(lease, player, 100, 0, limits, 60, extra_tokens=900)
    _expire(sessions, lease)  # its replica died: no renewal came
    ledger.reserve(_rid(), player, 900, 0, limits, 60)  # the sweep released it first
    assert _row(sessions, player).reserved_tokens == 900
    # A settle that comes late records its use and learns the lease is gone.
    late = ledger.settle(
        lease, player, _used(prompt_tokens=40), sequence=1, keep=(500, 0), ttl_seconds=60
    )
    assert (late.found, late.held_tokens) == (False, 0)
    row = _row(sessions, player)
    assert (row.prompt_tokens, row.reserved_tokens) == (40, 900)
    # A closed reservation is remembered (for retries), then deleted by a later sweep.
    _expire(sessions, lease)
    ledger.reserve(_rid(), _player(), 1, 0, Limits(), 60)
    with sessions() as session:
        assert session.get(ReservationRow, lease) is None


def test_settle_reports_the_external_services_preference(sessions: sessionmaker[Session]) -> None:
    ledger = UsageLedger(sessions)
    player, rid = _player(), _rid()
    ledger.reserve(rid, player, 10, 0, Limits(), 60, extra_tokens=100)
    with sessions.begin() as session:
        session.add(PreferenceRow(player_id=player, history_enabled=True, external_enabled=False))
    settled = ledger.settle(rid, player, _used(), sequence=1, keep=(110, 0), ttl_seconds=60)
    assert (settled.found, settled.external_enabled) == (True, False)


def test_concurrent_leases_never_exceed_the_budget(sessions: sessionmaker[Session]) -> None:
    """16 threads (as if on several replicas) take leases of up to 300 tokens against a
    2,000-token budget, use them in batches and close them: used and held never pass it."""
    ledger = UsageLedger(sessions)
    player = _player()
    limits = Limits(player_tokens=2000)
    used_total = 0
    lock = threading.Lock()

    def worker() -> None:
        nonlocal used_total
        for _ in range(4):
            rid = _rid()
            try:
                grant = ledger.reserve(rid, player, 50, 0, limits, 60, extra_tokens=250)
            except ResourceExhausted:
                continue
            held = grant.tokens
            for sequence in (1, 2):
                spend = min(held, 40)
                ledger.settle(
                    rid,
                    player,
                    _used(prompt_tokens=spend),
                    sequence=sequence,
                    keep=(held - spend, 0),
                    ttl_seconds=60,
                )
                held -= spend
                with lock:
                    used_total += spend
            ledger.settle(rid, player, _used(), sequence=3)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    row = _row(sessions, player)
    assert row.reserved_tokens == 0
    assert row.prompt_tokens == used_total <= 2000


def _expire(sessions: sessionmaker[Session], reservation_id: str) -> None:
    with sessions.begin() as session:
        session.execute(
            update(ReservationRow)
            .where(ReservationRow.reservation_id == reservation_id)
            .values(expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(hours=2))
        )


def test_a_batch_of_settles_applies_each_once(sessions: sessionmaker[Session]) -> None:
    ledger = UsageLedger(sessions)
    players = [_player() for _ in range(3)]
    rids = [_rid() for _ in players]
    for player, rid in zip(players, rids, strict=True):
        ledger.reserve(rid, player, 100, 0, Limits(), 60, extra_tokens=400)
    used = {**dict.fromkeys(AMOUNT_FIELDS, 0), "prompt_tokens": 30, "model_calls": 1}
    items = [
        SettleItem(rid, player, used, sequence=1, keep=(470, 0), ttl_seconds=60)
        for player, rid in zip(players, rids, strict=True)
    ]
    items.append(SettleItem(_rid(), "", used))  # never reserved: recorded on today anyway
    outcomes = ledger.settle_many(items)
    assert [o.found for o in outcomes] == [True, True, True, False]
    assert [o.held_tokens for o in outcomes[:3]] == [470] * 3
    assert ledger.settle_many(items[:3])[1].duplicate  # resent: nothing applied again
    for player in players:
        row = _row(sessions, player)
        assert (row.prompt_tokens, row.reserved_tokens, row.model_calls) == (30, 470, 1)
    # One bad item refuses the whole batch.
    wrong = SettleItem(rids[0], "someone-else", used, sequence=2)
    with pytest.raises(InvalidArgument, match="belongs to player"):
        ledger.settle_many([SettleItem(rids[1], players[1], used, sequence=2), wrong])
    assert _row(sessions, players[1]).prompt_tokens == 30


def _spend(module_id: str, provider: str, tokens: int, cost: int) -> player_data_pb2.SpendItem:
    return player_data_pb2.SpendItem(
        module_id=module_id, provider=provider, tokens=tokens, cost_micros=cost
    )


def test_spend_view_by_player_module_and_provider(sessions: sessionmaker[Session]) -> None:
    """What settles carried by module and provider is summed per scope; players come from the
    budget counters; the server's and network's budgets show the limits reservations carried;
    a retried settle counts once."""
    ledger = UsageLedger(sessions)
    spend = SpendView(sessions)
    scope = f"s{uuid.uuid4().hex[:8]}"
    alice, bob = f"{scope}/alice", f"{scope}/bob"
    limits = Limits(server_tokens=100_000, server_cost_micros=5_000_000, monthly_cost_micros=9**12)
    network_before = spend.spend(scope, "").network
    for player, module_id, provider, tokens, cost in (
        (alice, "system:question", "deepseek", 300, 2_000),
        (bob, "system:question", "qwen", 100, 500),
        (bob, "system:help", "deepseek", 50, 0),
    ):
        rid = _rid()
        ledger.reserve(rid, player, tokens, 0, limits, 60, cost_micros=cost)
        used = _used(
            prompt_tokens=tokens,
            model_calls=1,
            cost_micros=cost,
            spend=[_spend(module_id, provider, tokens, cost)],
        )
        ledger.settle(rid, player, used, sequence=1)
        ledger.settle(rid, player, used, sequence=1)  # a retry: applied once
    view = spend.spend(scope, "")
    today = dt.datetime.now(dt.UTC).date()
    assert view.period == today.isoformat()
    assert (view.total.name, view.total.tokens, view.total.cost_micros) == (scope, 450, 2_500)
    assert [(p.name, p.tokens, p.cost_micros) for p in view.players] == [
        (alice, 300, 2_000),
        (bob, 150, 500),
    ]
    assert view.player_count == 2
    assert [(m.name, m.tokens, m.cost_micros) for m in view.modules] == [
        ("system:question", 400, 2_500),
        ("system:help", 50, 0),
    ]
    assert [(p.name, p.tokens, p.cost_micros) for p in view.providers] == [
        ("deepseek", 350, 2_000),
        ("qwen", 100, 500),
    ]
    assert view.network.tokens - network_before.tokens >= 450
    budgets = {(b.budget, b.scope): (b.used, b.limit, b.period) for b in view.budgets}
    assert budgets[("server_daily_tokens", scope)] == (450, 100_000, today.isoformat())
    assert budgets[("server_daily_cost", scope)] == (2_500, 5_000_000, today.isoformat())
    month = today.strftime("%Y-%m")
    # (The network's rows are shared with other tests on PostgreSQL: only their shape.)
    assert all(b.period == month for b in view.budgets if "monthly" in b.budget)
    # The month: the same lines (this month's other days hold nothing of this scope).
    monthly = spend.spend(scope, month, max_lines=1)
    assert monthly.period == month
    assert (monthly.total.tokens, monthly.total.cost_micros) == (450, 2_500)
    assert [p.name for p in monthly.players] == [alice] and monthly.player_count == 2
    assert {b.budget for b in monthly.budgets} <= {"network_monthly_cost", "network_monthly_tokens"}
    # The money of /system usage: per player and per scope day.
    store = PlayerDataStore(sessions)
    assert spend.daily_cost(f"player:{alice}", today.isoformat(), today.isoformat()) == {
        today.isoformat(): 2_000
    }
    assert spend.daily_cost(f"server:{scope}", today.isoformat(), today.isoformat()) == {
        today.isoformat(): 2_500
    }
    assert [d.day for d in store.get_usage("", "", "", scope)] == [today.isoformat()]


@pytest.mark.parametrize(
    ("scope", "period", "max_lines", "expected"),
    [
        ("", "", 0, "scope is required"),
        ("a/b", "", 0, "must not contain '/'"),
        ("s", "2026-13", 0, "period must be"),
        ("s", "2026-02-30", 0, "period must be"),
        ("s", "yesterday", 0, "period must be"),
        ("s", "", 101, "max_lines is 101"),
    ],
)
def test_spend_view_refuses_malformed_requests(
    sessions: sessionmaker[Session], scope: str, period: str, max_lines: int, expected: str
) -> None:
    with pytest.raises(InvalidArgument, match=expected):
        SpendView(sessions).spend(scope, period, max_lines)


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        (_spend("system:question", "", 1, 0), "provider is required"),
        (_spend("question", "p", 1, 0), "namespace:path"),
        (_spend("system:q", "p" * 65, 1, 0), "longer than 64"),
        (_spend("system:q", "p", 2**41, 0), "tokens is"),
    ],
)
def test_settles_with_malformed_spend_items_are_refused(
    sessions: sessionmaker[Session], item: player_data_pb2.SpendItem, expected: str
) -> None:
    ledger = UsageLedger(sessions)
    rid, player = _rid(), _player()
    ledger.reserve(rid, player, 10, 0, Limits(), 60)
    with pytest.raises(InvalidArgument, match=expected):
        ledger.settle(rid, player, _used(prompt_tokens=1, spend=[item]), sequence=1)
