"""Reservations of external use against daily budgets, and their settlement.

Domain code: no gRPC here. The model gateway calls a provider only after `UsageLedger.reserve`
has held the call's worst case (prompt estimate + max answer tokens, or one web search) against
the day's limits, for the player (`player_usage`) and for everyone together (`usage_totals`).
After the call, `settle` releases the hold and records what was actually used. A hold that is
never settled (a gateway replica died mid-call) is released by a later reservation once its
`expires_at` has passed.

Concurrency: each reserve and settle is one transaction that first locks the day's
`usage_totals` row (made if missing, in the same statement), so every reservation of a day is serialized on that row and a check of
"used + held + asked <= limit" cannot interleave with another (on any number of gateway
replicas). Player rows and reservation rows are locked only after it, which keeps the lock
order the same everywhere and so free of deadlocks. On SQLite, BEGIN IMMEDIATE serializes the
writers anyway (see db.py).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import time
from typing import Any

from sqlalchemy import (
    BigInteger,
    Date,
    DateTime,
    Index,
    String,
    Table,
    case,
    delete,
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

__all__ = ["Limits", "ReservationRow", "UsageLedger", "UsageTotalRow"]

MAX_RESERVATION_ID = 64
RESERVATION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
MAX_TTL_SECONDS = 3600
# Expired holds released per reservation; the rest wait for the next one, so one call never
# pays for a backlog left by a crash.
SWEEP_BATCH = 64
# Expired holds are looked for at most this often per process: they are rare (a replica died
# mid-call), and looking costs every reservation a query.
SWEEP_INTERVAL_SECONDS = 1.0

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
    """One open hold. `player_id` is "" for use on no player's behalf. Kept by ResetPlayer:
    deleting it would leave its amounts held in the usage rows for good."""

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
    ) -> dt.date:
        """Holds `tokens` and `web_searches` on today's budgets. Returns the day charged.

        Raises:
            InvalidArgument: a malformed id or amount.
            FailedPrecondition: the player turned external services off.
            ResourceExhausted: a limit would be exceeded (nothing is held then).
        """
        _check_reservation_id(reservation_id)
        _check_player(player_id)
        _check_amount("tokens", tokens)
        _check_amount("web_searches", web_searches)
        if tokens == 0 and web_searches == 0:
            raise InvalidArgument("a reservation must hold tokens or web_searches")
        if not 1 <= ttl_seconds <= MAX_TTL_SECONDS:
            raise InvalidArgument(
                f"ttl_seconds must be between 1 and {MAX_TTL_SECONDS}, got {ttl_seconds}"
            )
        now = dt.datetime.now(dt.UTC)
        day = now.date()
        with self._sessions.begin() as session:
            totals = _lock_row(session, _TOTALS, day=day)
            if player_id and not _external_enabled(session, player_id):
                raise FailedPrecondition(
                    f"player {player_id} turned external services off; nothing is sent "
                    "outside for them (use the local fallback)"
                )
            # Inserted first: a refusal below rolls it back with everything else.
            inserted = session.execute(
                upsert_ignore(
                    session,
                    _HOLDS,
                    reservation_id=reservation_id,
                    player_id=player_id,
                    day=day,
                    tokens=tokens,
                    web_searches=web_searches,
                    expires_at=now + dt.timedelta(seconds=ttl_seconds),
                )
            )
            if inserted.rowcount != 1:  # a repeated request: already held
                return session.execute(
                    select(_HOLDS.c.day).where(_HOLDS.c.reservation_id == reservation_id)
                ).scalar_one()
            if time.monotonic() >= self._next_sweep:
                self._next_sweep = time.monotonic() + self._sweep_interval
                if self._sweep(session, now):
                    totals = session.execute(select(_TOTALS).where(_TOTALS.c.day == day)).one()
            global_limits = (limits.global_tokens, limits.global_web_searches)
            _check("everyone together", totals, tokens, web_searches, *global_limits)
            if player_id:
                player = _lock_row(session, _PLAYERS, player_id=player_id, day=day)
                player_limits = (limits.player_tokens, limits.player_web_searches)
                _check(f"player {player_id}", player, tokens, web_searches, *player_limits)
                self._hold(session, _PLAYERS, _player_key(player_id, day), tokens, web_searches)
            self._hold(session, _TOTALS, _TOTALS.c.day == day, tokens, web_searches)
        return day

    def settle(
        self, reservation_id: str, player_id: str, used: player_data_pb2.UsageAmounts
    ) -> bool:
        """Releases the hold and records `used`. Returns whether the hold was still there.

        Raises:
            InvalidArgument: a malformed id or amount, or the reservation is another player's.
        """
        _check_reservation_id(reservation_id)
        _check_player(player_id)
        amounts = {name: getattr(used, name) for name in AMOUNT_FIELDS}
        for name, value in amounts.items():
            _check_amount(f"used.{name}", value)
        with self._sessions.begin() as session:
            # Read without a lock first, to lock the day's totals row before the hold (the
            # order every reserve takes too).
            hold = session.execute(
                select(_HOLDS).where(_HOLDS.c.reservation_id == reservation_id)
            ).one_or_none()
            if hold is not None and hold.player_id != player_id:
                raise InvalidArgument(
                    f"reservation {reservation_id} belongs to player {hold.player_id!r}, "
                    f"not {player_id!r}"
                )
            day = hold.day if hold is not None else _today()
            _lock_row(session, _TOTALS, day=day)
            released = session.execute(
                delete(_HOLDS)
                .where(_HOLDS.c.reservation_id == reservation_id)
                .returning(_HOLDS.c.tokens, _HOLDS.c.web_searches)
            ).one_or_none()
            held = (released.tokens, released.web_searches) if released else (0, 0)
            if player_id:
                _lock_row(session, _PLAYERS, player_id=player_id, day=day)
                self._record(session, _PLAYERS, _player_key(player_id, day), held, amounts)
            self._record(session, _TOTALS, _TOTALS.c.day == day, held, amounts)
        return released is not None

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
        """Releases up to SWEEP_BATCH holds whose time ran out (their callers never settled).

        The totals rows of the holds' days are locked before the holds themselves, the order
        a settle takes, so a sweep and a settle of the same hold cannot deadlock.
        """
        expired = session.execute(
            select(_HOLDS.c.reservation_id, _HOLDS.c.day)
            .where(_HOLDS.c.expires_at < now)
            .order_by(_HOLDS.c.expires_at)
            .limit(SWEEP_BATCH)
        ).all()
        if not expired:
            return False
        for day in sorted({row.day for row in expired}):
            _lock_row(session, _TOTALS, day=day)
        rows = session.execute(
            delete(_HOLDS)
            .where(_HOLDS.c.reservation_id.in_([row.reservation_id for row in expired]))
            .returning(_HOLDS.c.player_id, _HOLDS.c.day, _HOLDS.c.tokens, _HOLDS.c.web_searches)
        ).all()
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


def _external_enabled(session: Session, player_id: str) -> bool:
    value = session.execute(
        select(PreferenceRow.external_enabled).where(PreferenceRow.player_id == player_id)
    ).scalar_one_or_none()
    return True if value is None else bool(value)  # no row: the defaults, which allow it


def _check(
    who: str, row: Any, tokens: int, searches: int, max_tokens: int, max_searches: int
) -> None:
    """Raises ResourceExhausted when holding `tokens` / `searches` more would pass a limit."""
    used_tokens = row.prompt_tokens + row.completion_tokens
    if max_tokens and tokens and used_tokens + row.reserved_tokens + tokens > max_tokens:
        raise ResourceExhausted(
            f"daily token budget of {who} exhausted: {used_tokens} used and "
            f"{row.reserved_tokens} held by calls in progress of {max_tokens} today (UTC); this "
            f"call needs up to {tokens}. The budget renews at 00:00 UTC"
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
