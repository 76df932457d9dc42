"""What usage reservations store, and the values that go in and out of the usage ledger.

The tables (`usage_totals`, everyone's use per UTC day; `usage_reservations`, one row per
reservation; `usage_budget_counters`, the nested budgets' counters; `usage_spend`, spend by
scope, module and provider per day; a player's daily use is player_data's `player_usage`), the
limits a reservation is checked against, what a reserve and a settle answer, and the checks of
their inputs. The ledger itself, reserve and settle, is storage_service.usage.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re

from sqlalchemy import BigInteger, Boolean, Date, DateTime, Index, String, false
from sqlalchemy.orm import Mapped, mapped_column
from system.storage.v1 import player_data_pb2

from services.runtime.errors import InvalidArgument
from storage_service.db import Base, table_of
from storage_service.player_data import KEEP_ON_RESET, MAX_USAGE_INCREMENT, UsageRow
from storage_service.validation import MAX_PLAYER_ID, check_id, check_player_id

__all__ = [
    "AMOUNT_FIELDS",
    "BudgetCounterRow",
    "BudgetUse",
    "Grant",
    "Limits",
    "ReservationRow",
    "SettleItem",
    "Settled",
    "Spend",
    "SpendRow",
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
# Longest module id and provider name a spend item may carry, and most items per settle.
MAX_MODULE_ID = 128
MAX_PROVIDER = 64
MAX_SPEND_ITEMS = 256
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
    scope: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), server_default="", default="")
    """The game server (or network) scope of the player id, before its `/`; "" for none."""
    cost_micros: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)
    """Money held, in millionths of the prices' currency."""
    settled_sequence: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)
    """The highest settle sequence applied; a settle numbered at or below it is a repeat."""
    closed: Mapped[bool] = mapped_column(Boolean, server_default=false(), default=False)
    """Settled for good or expired: holds nothing."""


class BudgetCounterRow(Base):
    """Tokens and money used and held on one budget for one period: a player's, a game
    server's or the network's day (`period` `YYYY-MM-DD`), or the network's month (`YYYY-MM`).
    `budget` is `player:<id>`, `server:<scope>` or `network`. Web searches stay in the
    player_usage and usage_totals rows. Kept by ResetPlayer (usage figures stay)."""

    __tablename__ = "usage_budget_counters"
    __table_args__ = {"info": {KEEP_ON_RESET: True}}

    budget: Mapped[str] = mapped_column(String(80), primary_key=True)
    period: Mapped[str] = mapped_column(String(10), primary_key=True)
    used_tokens: Mapped[int] = mapped_column(BigInteger)
    reserved_tokens: Mapped[int] = mapped_column(BigInteger)
    used_cost_micros: Mapped[int] = mapped_column(BigInteger)
    reserved_cost_micros: Mapped[int] = mapped_column(BigInteger)
    limit_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)
    """The token limit the period's last reservation carried for this budget; 0: none."""
    limit_cost_micros: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)
    """The money limit the period's last reservation carried; 0: none."""


class SpendRow(Base):
    """Tokens and money one scope's calls for one module spent on one provider on one UTC
    day (`period` `YYYY-MM-DD`), for the administrators' spend view. Written by settles that
    carry spend items; kept by ResetPlayer (no player in it)."""

    __tablename__ = "usage_spend"
    __table_args__ = {"info": {KEEP_ON_RESET: True}}

    period: Mapped[str] = mapped_column(String(10), primary_key=True)
    scope: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), primary_key=True)
    module_id: Mapped[str] = mapped_column(String(MAX_MODULE_ID), primary_key=True)
    provider: Mapped[str] = mapped_column(String(MAX_PROVIDER), primary_key=True)
    tokens: Mapped[int] = mapped_column(BigInteger)
    cost_micros: Mapped[int] = mapped_column(BigInteger)


_TOTALS = table_of(UsageTotalRow)
_COUNTERS = table_of(BudgetCounterRow)
_HOLDS = table_of(ReservationRow)
_SPEND = table_of(SpendRow)
_PLAYERS = table_of(UsageRow)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Limits per UTC day (per month for `monthly_*`); 0 is no limit. Money in micros."""

    player_tokens: int = 0
    player_web_searches: int = 0
    global_tokens: int = 0
    global_web_searches: int = 0
    player_cost_micros: int = 0
    global_cost_micros: int = 0
    server_tokens: int = 0
    server_cost_micros: int = 0
    monthly_tokens: int = 0
    monthly_cost_micros: int = 0

    @classmethod
    def from_proto(cls, limits: player_data_pb2.UsageLimits) -> Limits:
        return cls(**{f.name: getattr(limits, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class BudgetUse:
    """One limited budget a reservation counts on, as it stands after it."""

    budget: str
    """`player_daily_tokens`, `server_daily_cost`, `network_monthly_tokens`, ..."""
    scope: str
    """The player id, the server scope, or "" for the network."""
    period: str
    used: int
    """Used and held, tokens or micros."""
    limit: int


@dataclasses.dataclass(frozen=True)
class Grant:
    """What a reservation holds, and the day it counts on."""

    day: dt.date
    tokens: int
    web_searches: int
    cost_micros: int = 0
    budgets: tuple[BudgetUse, ...] = dataclasses.field(default=(), compare=False)
    """Every limited budget it counts on, as it stands after it (none for a repeat)."""


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
    held_cost_micros: int = 0
    """Money the reservation holds now."""


@dataclasses.dataclass(frozen=True)
class Spend:
    """What one module's calls on one provider used (a settle's spend item)."""

    module_id: str
    provider: str
    tokens: int
    cost_micros: int

    @classmethod
    def from_proto(cls, item: player_data_pb2.SpendItem) -> Spend:
        return cls(item.module_id, item.provider, item.tokens, item.cost_micros)

    def check(self, name: str) -> None:
        """Raises InvalidArgument for a malformed module id or provider, or an amount out
        of range."""
        check_id(self.module_id, f"{name}.module_id", MAX_MODULE_ID, required=False)
        if self.module_id and ":" not in self.module_id:
            raise InvalidArgument(
                f"{name}.module_id must be `namespace:path` (or empty), got {self.module_id!r}"
            )
        check_id(self.provider, f"{name}.provider", MAX_PROVIDER)
        _check_amount(f"{name}.tokens", self.tokens)
        _check_cost(f"{name}.cost_micros", self.cost_micros)


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
    cost_micros: int = 0
    """Money the use cost (micros), recorded on the money budgets."""
    keep_cost_micros: int = 0
    """Money to keep holding, with `keep`."""
    spend: tuple[Spend, ...] = ()
    """What the use was spent on, by module and provider (optional)."""

    def check(self) -> None:
        """Raises InvalidArgument for a malformed id, amount or ttl."""
        _check_reservation_id(self.reservation_id)
        _check_player(self.player_id)
        for name in AMOUNT_FIELDS:
            _check_amount(f"used.{name}", self.used.get(name, 0))
        _check_cost("used.cost_micros", self.cost_micros)
        _check_cost("keep_cost_micros", self.keep_cost_micros)
        if set(self.used) - set(AMOUNT_FIELDS):
            raise InvalidArgument(f"unknown amounts {sorted(set(self.used) - set(AMOUNT_FIELDS))}")
        if self.keep is not None:
            _check_ttl(self.ttl_seconds)
        if len(self.spend) > MAX_SPEND_ITEMS:
            raise InvalidArgument(
                f"used.spend has {len(self.spend)} items; the most is {MAX_SPEND_ITEMS}"
            )
        for index, item in enumerate(self.spend):
            item.check(f"used.spend[{index}]")


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


# Most money one call (or one lease) may hold or record: 10^15 micros, a billion in the
# prices' currency; far above any real call, low enough that sums never overflow BigInteger.
MAX_COST_MICROS = 10**15


def _check_cost(name: str, value: int) -> None:
    if value > MAX_COST_MICROS:
        raise InvalidArgument(f"{name} is {value}; the most is {MAX_COST_MICROS}")


def scope_of(player_id: str) -> str:
    """The game server (or network) scope of a scoped player id: what comes before the first
    `/` (decision 0012); "" for an unscoped id or no player."""
    scope, slash, _ = player_id.partition("/")
    return scope if slash else ""


def _check_ttl(ttl_seconds: int) -> None:
    if not 1 <= ttl_seconds <= MAX_TTL_SECONDS:
        raise InvalidArgument(
            f"ttl_seconds must be between 1 and {MAX_TTL_SECONDS}, got {ttl_seconds}"
        )
