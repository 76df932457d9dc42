"""Reservations of external use against daily budgets, and their settlement.

Domain code: no gRPC here. The model gateway calls a provider only after `UsageLedger.reserve`
has held the call's worst case (prompt estimate + max answer tokens, or one web search) against
the day's limits, for the player (`player_usage`) and for everyone together (`usage_totals`).
A reservation may also hold a block beyond that (`extra_*`, as far as the limits leave room):
a gateway replica's lease, which it draws on for later calls without coming back here.

`settle` records what was actually used and releases the hold: all of it (the reservation is
closed), or with `keep_open` all but what the caller still wants held (the reservation stays
and is renewed for `ttl_seconds`): a lease's batches. A settle with a `sequence` is applied at
most once per reservation, so a holder may retry it. A reservation that is neither settled nor
renewed in time (a gateway replica died) is released by a later reservation once its
`expires_at` has passed. Settled and expired reservations stay, closed and holding nothing, for
`SETTLED_MEMORY_SECONDS`, so a late retry is still recognised; then they are deleted.

Concurrency: each reserve and settle is one transaction that first locks the day's
`usage_totals` row (made if missing, in the same statement), so every reservation of a day is
serialized on that row and a check of "used + held + asked <= limit" cannot interleave with
another (on any number of gateway replicas). Player rows and reservation rows are read and
written only after it, which keeps the lock order the same everywhere and so free of
deadlocks. On SQLite, BEGIN IMMEDIATE serializes the writers anyway (see db.py).

Nested budgets (decision 0029): besides the player's and everyone's daily tokens and web
searches (`player_usage`, `usage_totals`), a reservation holds tokens and money (micros of the
prices' currency) on the rows of `usage_budget_counters`: the player's day, the game server's
day (the scope before the player id's `/`), the network's day and month. Those rows are locked
after the totals and the player row, in key order, by reserve, settle and sweep alike, so the
one lock order above still holds. Of the limits a reservation would pass, the tightest (least
room for what it asks) is named in the refusal, with when it resets, and as its reason
(`BUDGET_<NAME>`).

Spend for the administrators' view (storage_service.usage_spend): settles may carry their use
by module and provider, added to `usage_spend` per scope and day in the settle's transaction
(after the counter rows: the lock order; a duplicate settle adds nothing); reserve records on
each counter row the limits it carried, so the view shows use against limits without storage
knowing ranks.

The tables and the values passed in and out are storage_service.usage_records.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table, delete, select, update
from sqlalchemy.orm import Session, sessionmaker
from system.storage.v1 import player_data_pb2

from services.runtime.errors import FailedPrecondition, InvalidArgument
from storage_service.db import PREFERENCES, rowcount, upsert_ignore
from storage_service.usage_budgets import (
    CounterChanges,
    budget_levels,
    counter_keys,
    counter_limit,
    least_room,
    lock_row,
    refuse_tightest,
    release,
)
from storage_service.usage_records import (
    _COUNTERS,
    _HOLDS,
    _PLAYERS,
    _TOTALS,
    AMOUNT_FIELDS,
    MAX_SETTLE_BATCH,
    SETTLED_MEMORY_SECONDS,
    SWEEP_BATCH,
    SWEEP_INTERVAL_SECONDS,
    BudgetUse,
    Grant,
    Limits,
    Settled,
    SettleItem,
    Spend,
    _check_amount,
    _check_cost,
    _check_player,
    _check_reservation_id,
    _check_ttl,
    scope_of,
)
from storage_service.usage_spend import add_spend

__all__ = ["UsageLedger"]


def _today() -> dt.date:
    return dt.datetime.now(dt.UTC).date()


class UsageLedger:
    """Reserve and settle; each method is one transaction.

    Args:
        sessions: the storage service's session factory.
        sweep_interval_seconds: how often a reservation also releases expired holds.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        sweep_interval_seconds: float = SWEEP_INTERVAL_SECONDS,
    ) -> None:
        self._sessions = sessions
        self._sweep_interval = sweep_interval_seconds
        self._next_sweep = 0.0  # time.monotonic() of the next sweep

    def reserve(
        self,
        reservation_id: str,
        player_id: str,
        tokens: int,
        web_searches: int,
        limits: Limits,
        ttl_seconds: int,
        *,
        extra_tokens: int = 0,
        extra_web_searches: int = 0,
        cost_micros: int = 0,
        extra_cost_micros: int = 0,
    ) -> Grant:
        """Holds `tokens`, `web_searches` and `cost_micros` on today's (and this month's)
        budgets, and as much of `extra_*` as the limits leave room for. Returns what is held,
        the day charged and every limited budget as it stands now.

        Raises:
            InvalidArgument: a malformed id or amount.
            FailedPrecondition: the player turned external services off.
            ResourceExhausted: an amount asked would pass a limit (nothing is held then); the
                tightest such limit is named, with its reset, and is the error's reason.
        """
        _check_reservation_id(reservation_id)
        _check_player(player_id)
        for name, value in (
            ("tokens", tokens),
            ("web_searches", web_searches),
            ("extra_tokens", extra_tokens),
            ("extra_web_searches", extra_web_searches),
        ):
            _check_amount(name, value)
        _check_cost("cost_micros", cost_micros)
        _check_cost("extra_cost_micros", extra_cost_micros)
        if tokens == 0 and web_searches == 0:
            raise InvalidArgument("a reservation must hold tokens or web_searches")
        _check_ttl(ttl_seconds)
        now = dt.datetime.now(dt.UTC)
        day = now.date()
        with self._sessions.begin() as session:
            totals = lock_row(session, _TOTALS, day=day)
            if player_id and not _external_enabled(session, player_id):
                raise FailedPrecondition(
                    f"player {player_id} turned external services off; nothing is sent "
                    "outside for them (use the local fallback)"
                )
            # Inserted first: a refusal below rolls it back with everything else. The amounts
            # are set once the extras are known.
            inserted = session.execute(
                upsert_ignore(
                    session,
                    _HOLDS,
                    reservation_id=reservation_id,
                    player_id=player_id,
                    day=day,
                    tokens=0,
                    web_searches=0,
                    scope=scope_of(player_id),
                    cost_micros=0,
                    expires_at=now + dt.timedelta(seconds=ttl_seconds),
                    settled_sequence=0,
                    closed=False,
                )
            )
            if rowcount(inserted) != 1:  # a repeated request: answer what it holds now
                row = session.execute(
                    select(_HOLDS).where(_HOLDS.c.reservation_id == reservation_id)
                ).one()
                return Grant(row.day, row.tokens, row.web_searches, row.cost_micros)
            if time.monotonic() >= self._next_sweep:
                self._next_sweep = time.monotonic() + self._sweep_interval
                if self._sweep(session, now):
                    totals = session.execute(select(_TOTALS).where(_TOTALS.c.day == day)).one()
            player = (
                lock_row(session, _PLAYERS, player_id=player_id, day=day) if player_id else None
            )
            keys = counter_keys(player_id, scope_of(player_id), day)
            counters = {
                key: lock_row(session, _COUNTERS, budget=key[0], period=key[1])
                for key in sorted(keys)
            }
            levels = budget_levels(player_id, day, limits, totals, player, counters)
            asked = {"tokens": tokens, "web_searches": web_searches, "cost": cost_micros}
            refuse_tightest(levels, asked)
            extra = {"tokens": extra_tokens, "web_searches": extra_web_searches}
            extra["cost"] = extra_cost_micros
            held = {
                unit: asked[unit] + _fit(extra[unit], least_room(levels, unit), asked[unit])
                for unit in asked
            }
            session.execute(
                update(_HOLDS)
                .where(_HOLDS.c.reservation_id == reservation_id)
                .values(
                    tokens=held["tokens"],
                    web_searches=held["web_searches"],
                    cost_micros=held["cost"],
                )
            )
            if player is not None:
                key = _player_key(player_id, day)
                self._hold(session, _PLAYERS, key, held["tokens"], held["web_searches"])
            self._hold(session, _TOTALS, _TOTALS.c.day == day, held["tokens"], held["web_searches"])
            changes = CounterChanges()
            for budget, period in keys:
                changes.hold(budget, period, held["tokens"], held["cost"])
                changes.limit(budget, period, *counter_limit(budget, period, limits))
            changes.apply(session)
        uses = tuple(
            BudgetUse(
                level.budget,
                level.scope,
                level.period,
                level.used + level.held + held[level.unit],
                level.limit,
            )
            for level in levels
        )
        return Grant(day, held["tokens"], held["web_searches"], held["cost"], uses)

    def settle(
        self,
        reservation_id: str,
        player_id: str,
        used: player_data_pb2.UsageAmounts,
        *,
        sequence: int = 0,
        keep: tuple[int, int] | None = None,
        ttl_seconds: int = 0,
        keep_cost_micros: int = 0,
    ) -> Settled:
        """Records `used` and releases the hold: all of it, or with `keep` (tokens, web
        searches) all but that much, the reservation staying open for `ttl_seconds` more.
        A `sequence` at or below the last applied one changes nothing.

        Raises:
            InvalidArgument: a malformed id, amount or ttl, or the reservation is another
                player's.
        """
        amounts = {name: getattr(used, name) for name in AMOUNT_FIELDS}
        item = SettleItem(
            reservation_id,
            player_id,
            amounts,
            sequence,
            keep,
            ttl_seconds,
            cost_micros=used.cost_micros,
            keep_cost_micros=keep_cost_micros,
            spend=tuple(Spend.from_proto(s) for s in used.spend),
        )
        return self.settle_many([item])[0]

    def settle_many(self, items: Sequence[SettleItem]) -> list[Settled]:
        """Applies each settle as `settle` would, in one transaction per day the reservations
        count on (so a day's totals row is locked and written once for all of them). Returns
        the outcomes in the order given.

        Raises:
            InvalidArgument: any item `settle` would refuse, a reservation given twice, or more
                than MAX_SETTLE_BATCH items; nothing is applied then.
        """
        if len(items) > MAX_SETTLE_BATCH:
            raise InvalidArgument(
                f"{len(items)} settles in one batch; the most is {MAX_SETTLE_BATCH}"
            )
        for item in items:
            item.check()
        ids = [item.reservation_id for item in items]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("a batch settles each reservation at most once")
        with self._sessions.begin() as session:
            # Read without a lock first, to lock each day's totals row before its reservations
            # (the order every reserve takes too); a reservation's day never changes.
            known = {
                row.reservation_id: row
                for row in session.execute(
                    select(_HOLDS.c.reservation_id, _HOLDS.c.player_id, _HOLDS.c.day).where(
                        _HOLDS.c.reservation_id.in_(ids)
                    )
                )
            }
        days: dict[dt.date, list[SettleItem]] = {}
        for item in items:
            row = known.get(item.reservation_id)
            if row is not None and row.player_id != item.player_id:
                raise InvalidArgument(
                    f"reservation {item.reservation_id} belongs to player {row.player_id!r}, "
                    f"not {item.player_id!r}"
                )
            days.setdefault(row.day if row is not None else _today(), []).append(item)
        outcomes: dict[str, Settled] = {}
        # One transaction per day: none ever holds two days' totals rows, as a reserve's
        # sweep may (today's, then older ones), so the two cannot deadlock.
        for day in sorted(days):
            outcomes.update(self._settle_day(day, days[day]))
        return [outcomes[reservation_id] for reservation_id in ids]

    def _settle_day(self, day: dt.date, items: list[SettleItem]) -> dict[str, Settled]:
        now = dt.datetime.now(dt.UTC)
        outcomes: dict[str, Settled] = {}
        with self._sessions.begin() as session:
            lock_row(session, _TOTALS, day=day)
            # Read again under the day's lock: every writer of these rows holds it too.
            holds = {
                row.reservation_id: row
                for row in session.execute(
                    select(_HOLDS).where(
                        _HOLDS.c.reservation_id.in_([item.reservation_id for item in items])
                    )
                )
            }
            enabled = _external_enabled_many(session, {item.player_id for item in items})
            released_total = (0, 0)
            used_total = dict.fromkeys(AMOUNT_FIELDS, 0)
            changes = CounterChanges()
            spent: dict[tuple[str, str, str], list[int]] = {}
            for item in sorted(items, key=lambda item: item.player_id):  # player rows in order
                hold = holds.get(item.reservation_id)
                allowed = enabled.get(item.player_id, True)
                if hold is not None and item.sequence and item.sequence <= hold.settled_sequence:
                    outcomes[item.reservation_id] = Settled(
                        not hold.closed,
                        True,
                        hold.tokens,
                        hold.web_searches,
                        allowed,
                        hold.cost_micros,
                    )
                    continue
                released, kept = self._close_or_keep(session, item, hold, now)
                if item.player_id and (any(released[:2]) or any(item.used.values())):
                    lock_row(session, _PLAYERS, player_id=item.player_id, day=day)
                    key = _player_key(item.player_id, day)
                    self._record(session, _PLAYERS, key, released[:2], item.used)
                released_total = (
                    released_total[0] + released[0],
                    released_total[1] + released[1],
                )
                for name, amount in item.used.items():
                    used_total[name] += amount
                scope = hold.scope if hold is not None else scope_of(item.player_id)
                used_tokens = item.used.get("prompt_tokens", 0)
                used_tokens += item.used.get("completion_tokens", 0)
                for budget, period in counter_keys(item.player_id, scope, day):
                    changes.release(budget, period, released[0], released[2])
                    changes.use(budget, period, used_tokens, item.cost_micros)
                for line in item.spend:
                    row = spent.setdefault((scope, line.module_id, line.provider), [0, 0])
                    row[0] += line.tokens
                    row[1] += line.cost_micros
                found = hold is not None and not hold.closed
                outcomes[item.reservation_id] = Settled(
                    found, False, kept[0], kept[1], allowed, kept[2]
                )
            self._record(session, _TOTALS, _TOTALS.c.day == day, released_total, used_total)
            changes.apply(session)
            add_spend(session, day.isoformat(), spent)  # last, in key order: the lock order
        return outcomes

    @staticmethod
    def _close_or_keep(
        session: Session, item: SettleItem, hold: Any, now: dt.datetime
    ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Updates the reservation for one settle; returns what it released and what it
        keeps holding (tokens, web searches, cost micros)."""
        if hold is None:  # never made (or long forgotten): the use is recorded all the same
            return (0, 0, 0), (0, 0, 0)
        found = not hold.closed
        stays_open = found and item.keep is not None
        kept = (0, 0, 0)
        if stays_open:
            assert item.keep is not None
            kept = (
                min(item.keep[0], hold.tokens),
                min(item.keep[1], hold.web_searches),
                min(item.keep_cost_micros, hold.cost_micros),
            )
            expires = now + dt.timedelta(seconds=item.ttl_seconds)
        elif found:
            expires = now + dt.timedelta(seconds=SETTLED_MEMORY_SECONDS)
        else:
            expires = hold.expires_at
        session.execute(
            update(_HOLDS)
            .where(_HOLDS.c.reservation_id == item.reservation_id)
            .values(
                tokens=kept[0],
                web_searches=kept[1],
                cost_micros=kept[2],
                settled_sequence=max(item.sequence, hold.settled_sequence),
                closed=not stays_open,
                expires_at=expires,
            )
        )
        if not found:
            return (0, 0, 0), kept
        released = (
            hold.tokens - kept[0],
            hold.web_searches - kept[1],
            hold.cost_micros - kept[2],
        )
        return released, kept

    # -- steps inside one transaction ----------------------------------------------------------

    @staticmethod
    def _hold(session: Session, table: Table, key: Any, tokens: int, searches: int) -> None:
        session.execute(
            update(table)
            .where(key)
            .values(
                reserved_tokens=table.c.reserved_tokens + tokens,
                reserved_web_searches=table.c.reserved_web_searches + searches,
            )
        )

    @staticmethod
    def _record(
        session: Session, table: Table, key: Any, held: tuple[int, int], amounts: dict[str, int]
    ) -> None:
        values: dict[str, Any] = {
            name: table.c[name] + amount for name, amount in amounts.items() if amount
        }
        if held[0]:
            values["reserved_tokens"] = release(table.c.reserved_tokens, held[0])
        if held[1]:
            values["reserved_web_searches"] = release(table.c.reserved_web_searches, held[1])
        if values:
            session.execute(update(table).where(key).values(values))

    def _sweep(self, session: Session, now: dt.datetime) -> bool:
        """Releases up to SWEEP_BATCH open reservations whose time ran out (their holders
        neither settled nor renewed them) and deletes closed ones past their memory. Returns
        whether anything was released.

        The totals rows of the reservations' days are locked before the reservations are read
        again and changed, the order a settle takes, so a sweep and a settle of the same
        reservation cannot deadlock or both release it.
        """
        expired = session.execute(
            select(_HOLDS.c.reservation_id, _HOLDS.c.day, _HOLDS.c.closed)
            .where(_HOLDS.c.expires_at < now)
            .order_by(_HOLDS.c.expires_at)
            .limit(SWEEP_BATCH)
        ).all()
        forgotten = [row.reservation_id for row in expired if row.closed]
        if forgotten:
            session.execute(
                delete(_HOLDS).where(_HOLDS.c.reservation_id.in_(forgotten) & _HOLDS.c.closed)
            )
        lapsed = [row for row in expired if not row.closed]
        if not lapsed:
            return False
        for day in sorted({row.day for row in lapsed}):
            lock_row(session, _TOTALS, day=day)
        rows = session.execute(
            select(_HOLDS).where(
                _HOLDS.c.reservation_id.in_([row.reservation_id for row in lapsed])
                & ~_HOLDS.c.closed
                & (_HOLDS.c.expires_at < now)
            )
        ).all()
        if not rows:  # settled or renewed meanwhile
            return False
        session.execute(
            update(_HOLDS)
            .where(_HOLDS.c.reservation_id.in_([row.reservation_id for row in rows]))
            .values(
                tokens=0,
                web_searches=0,
                cost_micros=0,
                closed=True,
                expires_at=now + dt.timedelta(seconds=SETTLED_MEMORY_SECONDS),
            )
        )
        changes = CounterChanges()
        for row in rows:
            held = (row.tokens, row.web_searches)
            self._record(session, _TOTALS, _TOTALS.c.day == row.day, held, {})
            if row.player_id:
                self._record(session, _PLAYERS, _player_key(row.player_id, row.day), held, {})
            for budget, period in counter_keys(row.player_id, row.scope, row.day):
                changes.release(budget, period, row.tokens, row.cost_micros)
        changes.apply(session)  # after every day's totals row: the lock order
        return True


def _player_key(player_id: str, day: dt.date) -> Any:
    return (_PLAYERS.c.player_id == player_id) & (_PLAYERS.c.day == day)


def _external_enabled_many(session: Session, player_ids: set[str]) -> dict[str, bool]:
    """The preference of those of `player_ids` who stored one ("" is no player)."""
    wanted = [player_id for player_id in player_ids if player_id]
    if not wanted:
        return {}
    rows = session.execute(
        select(PREFERENCES.c.player_id, PREFERENCES.c.external_enabled).where(
            PREFERENCES.c.player_id.in_(wanted)
        )
    )
    return {row.player_id: bool(row.external_enabled) for row in rows}


def _external_enabled(session: Session, player_id: str) -> bool:
    value = session.execute(
        select(PREFERENCES.c.external_enabled).where(PREFERENCES.c.player_id == player_id)
    ).scalar_one_or_none()
    return True if value is None else bool(value)  # no row: the defaults, which allow it


def _fit(extra: int, room: int | None, asked: int) -> int:
    """How much of `extra` fits besides `asked` (already checked to fit) in `room`."""
    return extra if room is None else max(0, min(extra, room - asked))
