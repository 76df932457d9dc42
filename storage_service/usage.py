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
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Index,
    String,
    Table,
    case,
    delete,
    false,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker
from system.storage.v1 import player_data_pb2

from services.runtime.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from storage_service.db import Base, PreferenceRow, upsert_ignore
from storage_service.player_data import KEEP_ON_RESET, MAX_USAGE_INCREMENT, UsageRow
from storage_service.validation import MAX_PLAYER_ID, check_player_id

__all__ = [
    "Grant",
    "Limits",
    "ReservationRow",
    "SettleItem",
    "Settled",
    "UsageLedger",
    "UsageTotalRow",
]

MAX_RESERVATION_ID = 64
RESERVATION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
MAX_TTL_SECONDS = 3600
# How long a closed reservation is remembered, so a retried settle of it (by sequence number)
# is recognised and not recorded twice. Holders retry within seconds; an hour is ample.
SETTLED_MEMORY_SECONDS = 3600
# Expired holds released (and forgotten reservations deleted) per reservation; the rest wait
# for the next one, so one call never pays for a backlog left by a crash.
SWEEP_BATCH = 64
# Expired holds are looked for at most this often per process: they are rare (a replica died
# mid-call), and looking costs every reservation a query.
SWEEP_INTERVAL_SECONDS = 1.0
# Most settles one SettleUsageBatch may carry.
MAX_SETTLE_BATCH = 1000

AMOUNT_FIELDS = (
    "prompt_tokens",
    "completion_tokens",
    "prompt_cache_hit_tokens",
    "prompt_cache_miss_tokens",
    "model_calls",
    "web_searches",
)
_ZERO_ROW = {**dict.fromkeys(AMOUNT_FIELDS, 0), "reserved_tokens": 0, "reserved_web_searches": 0}


class UsageTotalRow(Base):
    """Everyone's use on one UTC day, calls on no player's behalf included."""

    __tablename__ = "usage_totals"

    day: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    prompt_cache_hit_tokens: Mapped[int] = mapped_column(BigInteger)
    prompt_cache_miss_tokens: Mapped[int] = mapped_column(BigInteger)
    model_calls: Mapped[int] = mapped_column(BigInteger)
    web_searches: Mapped[int] = mapped_column(BigInteger)
    reserved_tokens: Mapped[int] = mapped_column(BigInteger)
    reserved_web_searches: Mapped[int] = mapped_column(BigInteger)


class ReservationRow(Base):
    """One reservation. `player_id` is "" for use on no player's behalf. An open one holds
    `tokens` and `web_searches` until `expires_at`; a closed one holds nothing and is kept
    until `expires_at` only to recognise retried settles. Kept by ResetPlayer: deleting an
    open one would leave its amounts held in the usage rows for good."""

    __tablename__ = "usage_reservations"
    __table_args__ = (
        Index("ix_usage_reservations_expires", "expires_at"),
        {"info": {KEEP_ON_RESET: True}},
    )

    reservation_id: Mapped[str] = mapped_column(String(MAX_RESERVATION_ID), primary_key=True)
    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID))
    day: Mapped[dt.date] = mapped_column(Date)
    tokens: Mapped[int] = mapped_column(BigInteger)
    web_searches: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    settled_sequence: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)
    """The highest settle sequence applied; a settle numbered at or below it is a repeat."""
    closed: Mapped[bool] = mapped_column(Boolean, server_default=false(), default=False)
    """Settled for good or expired: holds nothing."""


_TOTALS: Table = UsageTotalRow.__table__  # type: ignore[assignment]
_HOLDS: Table = ReservationRow.__table__  # type: ignore[assignment]
_PLAYERS: Table = UsageRow.__table__  # type: ignore[assignment]


@dataclasses.dataclass(frozen=True)
class Limits:
    """Daily limits; 0 is no limit."""

    player_tokens: int = 0
    player_web_searches: int = 0
    global_tokens: int = 0
    global_web_searches: int = 0

    @classmethod
    def from_proto(cls, limits: player_data_pb2.UsageLimits) -> Limits:
        return cls(
            limits.player_tokens,
            limits.player_web_searches,
            limits.global_tokens,
            limits.global_web_searches,
        )


@dataclasses.dataclass(frozen=True)
class Grant:
    """What a reservation holds, and the day it counts on."""

    day: dt.date
    tokens: int
    web_searches: int


@dataclasses.dataclass(frozen=True)
class Settled:
    """The outcome of one settle."""

    found: bool
    """The reservation was open (held something) when the settle came."""
    duplicate: bool = False
    """Its sequence had been applied already: nothing changed."""
    held_tokens: int = 0
    """Tokens the reservation holds now."""
    held_web_searches: int = 0
    """Web searches the reservation holds now."""
    external_enabled: bool = True
    """The player's external-services preference now."""


@dataclasses.dataclass(frozen=True)
class SettleItem:
    """One settle (see `UsageLedger.settle`)."""

    reservation_id: str
    player_id: str
    used: dict[str, int]
    """Amounts by AMOUNT_FIELDS name."""
    sequence: int = 0
    keep: tuple[int, int] | None = None
    """(tokens, web searches) to keep holding, the reservation staying open; None closes it."""
    ttl_seconds: int = 0

    def check(self) -> None:
        """Raises InvalidArgument for a malformed id, amount or ttl."""
        _check_reservation_id(self.reservation_id)
        _check_player(self.player_id)
        for name in AMOUNT_FIELDS:
            _check_amount(f"used.{name}", self.used.get(name, 0))
        if set(self.used) - set(AMOUNT_FIELDS):
            raise InvalidArgument(f"unknown amounts {sorted(set(self.used) - set(AMOUNT_FIELDS))}")
        if self.keep is not None:
            _check_ttl(self.ttl_seconds)


def _check_reservation_id(reservation_id: str) -> None:
    if not RESERVATION_ID.match(reservation_id):
        raise InvalidArgument(
            "reservation_id must be 1 to 64 of A-Z a-z 0-9 _ . : - (for example a UUID), "
            f"got {reservation_id[:80]!r}"
        )


def _check_player(player_id: str) -> None:
    if player_id:  # "" is use on no player's behalf
        check_player_id(player_id)


def _check_amount(name: str, value: int) -> None:
    if value > MAX_USAGE_INCREMENT:
        raise InvalidArgument(f"{name} is {value}; one call may use at most {MAX_USAGE_INCREMENT}")


def _check_ttl(ttl_seconds: int) -> None:
    if not 1 <= ttl_seconds <= MAX_TTL_SECONDS:
        raise InvalidArgument(
            f"ttl_seconds must be between 1 and {MAX_TTL_SECONDS}, got {ttl_seconds}"
        )


def _today() -> dt.date:
    return dt.datetime.now(dt.UTC).date()


def _release(column: Any, amount: int) -> Any:
    """`column - amount`, never below zero."""
    return case((column >= amount, column - amount), else_=0)


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
    ) -> Grant:
        """Holds `tokens` and `web_searches` on today's budgets, and as much of `extra_*` as
        the limits leave room for. Returns what is held and the day charged.

        Raises:
            InvalidArgument: a malformed id or amount.
            FailedPrecondition: the player turned external services off.
            ResourceExhausted: `tokens` or `web_searches` would pass a limit (nothing is held
                then).
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
        if tokens == 0 and web_searches == 0:
            raise InvalidArgument("a reservation must hold tokens or web_searches")
        _check_ttl(ttl_seconds)
        now = dt.datetime.now(dt.UTC)
        day = now.date()
        with self._sessions.begin() as session:
            totals = _lock_row(session, _TOTALS, day=day)
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
                    expires_at=now + dt.timedelta(seconds=ttl_seconds),
                    settled_sequence=0,
                    closed=False,
                )
            )
            if inserted.rowcount != 1:  # a repeated request: answer what it holds now
                row = session.execute(
                    select(_HOLDS).where(_HOLDS.c.reservation_id == reservation_id)
                ).one()
                return Grant(row.day, row.tokens, row.web_searches)
            if time.monotonic() >= self._next_sweep:
                self._next_sweep = time.monotonic() + self._sweep_interval
                if self._sweep(session, now):
                    totals = session.execute(select(_TOTALS).where(_TOTALS.c.day == day)).one()
            global_limits = (limits.global_tokens, limits.global_web_searches)
            _check("everyone together", totals, tokens, web_searches, *global_limits)
            room = _room(totals, *global_limits)
            player = None
            if player_id:
                player = _lock_row(session, _PLAYERS, player_id=player_id, day=day)
                player_limits = (limits.player_tokens, limits.player_web_searches)
                _check(f"player {player_id}", player, tokens, web_searches, *player_limits)
                room = _narrower(room, _room(player, *player_limits))
            held_tokens = tokens + _fit(extra_tokens, room[0], tokens)
            held_searches = web_searches + _fit(extra_web_searches, room[1], web_searches)
            session.execute(
                update(_HOLDS)
                .where(_HOLDS.c.reservation_id == reservation_id)
                .values(tokens=held_tokens, web_searches=held_searches)
            )
            if player is not None:
                key = _player_key(player_id, day)
                self._hold(session, _PLAYERS, key, held_tokens, held_searches)
            self._hold(session, _TOTALS, _TOTALS.c.day == day, held_tokens, held_searches)
        return Grant(day, held_tokens, held_searches)

    def settle(
        self,
        reservation_id: str,
        player_id: str,
        used: player_data_pb2.UsageAmounts,
        *,
        sequence: int = 0,
        keep: tuple[int, int] | None = None,
        ttl_seconds: int = 0,
    ) -> Settled:
        """Records `used` and releases the hold: all of it, or with `keep` (tokens, web
        searches) all but that much, the reservation staying open for `ttl_seconds` more.
        A `sequence` at or below the last applied one changes nothing.

        Raises:
            InvalidArgument: a malformed id, amount or ttl, or the reservation is another
                player's.
        """
        amounts = {name: getattr(used, name) for name in AMOUNT_FIELDS}
        item = SettleItem(reservation_id, player_id, amounts, sequence, keep, ttl_seconds)
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
            _lock_row(session, _TOTALS, day=day)
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
            for item in sorted(items, key=lambda item: item.player_id):  # player rows in order
                hold = holds.get(item.reservation_id)
                allowed = enabled.get(item.player_id, True)
                if hold is not None and item.sequence and item.sequence <= hold.settled_sequence:
                    outcomes[item.reservation_id] = Settled(
                        not hold.closed, True, hold.tokens, hold.web_searches, allowed
                    )
                    continue
                released, kept = self._close_or_keep(session, item, hold, now)
                if item.player_id and (any(released) or any(item.used.values())):
                    _lock_row(session, _PLAYERS, player_id=item.player_id, day=day)
                    key = _player_key(item.player_id, day)
                    self._record(session, _PLAYERS, key, released, item.used)
                released_total = (
                    released_total[0] + released[0],
                    released_total[1] + released[1],
                )
                for name, amount in item.used.items():
                    used_total[name] += amount
                found = hold is not None and not hold.closed
                outcomes[item.reservation_id] = Settled(found, False, *kept, allowed)
            self._record(session, _TOTALS, _TOTALS.c.day == day, released_total, used_total)
        return outcomes

    @staticmethod
    def _close_or_keep(
        session: Session, item: SettleItem, hold: Any, now: dt.datetime
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """Updates the reservation for one settle; returns what it released and what it
        keeps holding."""
        if hold is None:  # never made (or long forgotten): the use is recorded all the same
            return (0, 0), (0, 0)
        found = not hold.closed
        stays_open = found and item.keep is not None
        kept = (0, 0)
        if stays_open:
            assert item.keep is not None
            kept = (min(item.keep[0], hold.tokens), min(item.keep[1], hold.web_searches))
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
                settled_sequence=max(item.sequence, hold.settled_sequence),
                closed=not stays_open,
                expires_at=expires,
            )
        )
        released = (hold.tokens - kept[0], hold.web_searches - kept[1]) if found else (0, 0)
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
            values["reserved_tokens"] = _release(table.c.reserved_tokens, held[0])
        if held[1]:
            values["reserved_web_searches"] = _release(table.c.reserved_web_searches, held[1])
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
            _lock_row(session, _TOTALS, day=day)
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
                closed=True,
                expires_at=now + dt.timedelta(seconds=SETTLED_MEMORY_SECONDS),
            )
        )
        for row in rows:
            held = (row.tokens, row.web_searches)
            self._record(session, _TOTALS, _TOTALS.c.day == row.day, held, {})
            if row.player_id:
                self._record(session, _PLAYERS, _player_key(row.player_id, row.day), held, {})
        return True


def _lock_row(session: Session, table: Table, **key: Any) -> Any:
    """The usage row with primary key `key`, made (all zero) when missing, and locked until
    the transaction ends: one INSERT … ON CONFLICT DO UPDATE … RETURNING, which on PostgreSQL
    takes the row lock and on SQLite runs inside the already exclusive transaction."""
    insert = sqlite_insert if session.get_bind().dialect.name == "sqlite" else postgresql_insert
    statement = insert(table).values(**key, **_ZERO_ROW)
    statement = statement.on_conflict_do_update(
        index_elements=list(key), set_={name: statement.excluded[name] for name in key}
    )
    return session.execute(statement.returning(*table.c)).one()


def _player_key(player_id: str, day: dt.date) -> Any:
    return (_PLAYERS.c.player_id == player_id) & (_PLAYERS.c.day == day)


def _external_enabled_many(session: Session, player_ids: set[str]) -> dict[str, bool]:
    """The preference of those of `player_ids` who stored one ("" is no player)."""
    wanted = [player_id for player_id in player_ids if player_id]
    if not wanted:
        return {}
    rows = session.execute(
        select(PreferenceRow.player_id, PreferenceRow.external_enabled).where(
            PreferenceRow.player_id.in_(wanted)
        )
    )
    return {row.player_id: bool(row.external_enabled) for row in rows}


def _external_enabled(session: Session, player_id: str) -> bool:
    value = session.execute(
        select(PreferenceRow.external_enabled).where(PreferenceRow.player_id == player_id)
    ).scalar_one_or_none()
    return True if value is None else bool(value)  # no row: the defaults, which allow it


Room = tuple[int | None, int | None]
"""Tokens and web searches a row's limits still leave; None is no limit."""


def _room(row: Any, max_tokens: int, max_searches: int) -> Room:
    used_tokens = row.prompt_tokens + row.completion_tokens + row.reserved_tokens
    used_searches = row.web_searches + row.reserved_web_searches
    return (
        max_tokens - used_tokens if max_tokens else None,
        max_searches - used_searches if max_searches else None,
    )


def _narrower(a: Room, b: Room) -> Room:
    def least(x: int | None, y: int | None) -> int | None:
        return y if x is None else x if y is None else min(x, y)

    return (least(a[0], b[0]), least(a[1], b[1]))


def _fit(extra: int, room: int | None, asked: int) -> int:
    """How much of `extra` fits besides `asked` (already checked to fit) in `room`."""
    return extra if room is None else max(0, min(extra, room - asked))


def _check(
    who: str, row: Any, tokens: int, searches: int, max_tokens: int, max_searches: int
) -> None:
    """Raises ResourceExhausted when holding `tokens` / `searches` more would pass a limit."""
    used_tokens = row.prompt_tokens + row.completion_tokens
    if max_tokens and tokens and used_tokens + row.reserved_tokens + tokens > max_tokens:
        raise ResourceExhausted(
            f"daily token budget of {who} exhausted: {used_tokens} used and "
            f"{row.reserved_tokens} held for calls in progress (by gateway budget leases) of "
            f"{max_tokens} today (UTC); this call needs up to {tokens}. The budget renews at "
            "00:00 UTC"
        )
    if (
        max_searches
        and searches
        and row.web_searches + row.reserved_web_searches + searches > max_searches
    ):
        raise ResourceExhausted(
            f"daily web-search budget of {who} exhausted: {row.web_searches} used and "
            f"{row.reserved_web_searches} in progress of {max_searches} today (UTC). The "
            "budget renews at 00:00 UTC"
        )
