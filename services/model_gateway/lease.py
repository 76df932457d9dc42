"""One budget lease: a block of a player's (and the global) daily budget this replica holds in
storage, drawn on by calls without a round trip each.

Pure bookkeeping, no I/O: times are passed in (monotonic seconds). The meter (`leasing.py`)
does the storage calls and keeps the leases; this module only says what is free, what to
write next, and what storage's answer means.

A lease's amounts, all in (tokens, web searches):

- `granted`: what storage holds for it, as of the last answer;
- `in_flight`: the worst cases of calls drawing on it now;
- `pending`: what finished calls actually used, not yet written;
- the `batch` being written (frozen until storage acknowledges it, and resent as it is, with
  the same sequence number, until then).

Free for new calls: `granted - in_flight - pending - batch`. Writing a batch moves its use
from `granted` to storage's used figures, so what is free does not change by it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import enum

from services.model_gateway.metering import Used, merge_spend

__all__ = ["Amount", "Answer", "Batch", "Lease", "Verdict", "amount_of"]


@dataclasses.dataclass(frozen=True)
class Amount:
    """Tokens, web searches and money (micros of the prices' currency)."""

    tokens: int = 0
    web_searches: int = 0
    cost: int = 0

    def __add__(self, other: Amount) -> Amount:
        return Amount(
            self.tokens + other.tokens,
            self.web_searches + other.web_searches,
            self.cost + other.cost,
        )

    def __sub__(self, other: Amount) -> Amount:
        """Never below zero: a call may use more than its estimate said (a provider that
        reports more tokens than the bound), and storage floors its holds the same way."""
        return Amount(
            max(0, self.tokens - other.tokens),
            max(0, self.web_searches - other.web_searches),
            max(0, self.cost - other.cost),
        )

    def covers(self, other: Amount) -> bool:
        return (
            self.tokens >= other.tokens
            and self.web_searches >= other.web_searches
            and self.cost >= other.cost
        )


def amount_of(used: Used) -> Amount:
    """The part of `used` a budget counts."""
    return Amount(used.prompt_tokens + used.completion_tokens, used.web_searches, used.cost_micros)


def _plus(a: Used, b: Used) -> Used:
    summed = {
        f.name: getattr(a, f.name) + getattr(b, f.name)
        for f in dataclasses.fields(Used)
        if f.name != "spend"
    }
    return Used(**summed, spend=merge_spend(a.spend, b.spend))


@dataclasses.dataclass(frozen=True)
class Batch:
    """One settle of a lease: use to record and what stays held (None: close it)."""

    sequence: int
    used: Used
    keep: Amount | None


@dataclasses.dataclass(frozen=True)
class Answer:
    """Storage's answer to a settle."""

    found: bool
    held: Amount
    external_enabled: bool


class Verdict(enum.Enum):
    """Whether a call may draw on a lease."""

    OK = "ok"
    STALE = "stale"
    """Enough is free, but the lease must be renewed first: its last contact with storage
    (which re-read the preference) is too old, or it would expire before the call could end."""
    SPENT = "spent"
    """Not enough free, retired, or of another day: a new lease is needed."""


class Lease:
    """One lease, as this replica keeps it.

    Args:
        reservation_id: its reservation in storage.
        player_id: the player ("" for none).
        day: the UTC day it counts on.
        granted: what storage granted.
        contacted: when the reservation was sent (monotonic): storage's clock for its expiry
            started after this, so `contacted + ttl_seconds` is never later than storage's.
        ttl_seconds: how long storage keeps it unless renewed.
        dedicated: made for one call only (retired from the start, closed when it ends).
    """

    def __init__(
        self,
        reservation_id: str,
        player_id: str,
        day: dt.date,
        granted: Amount,
        *,
        contacted: float,
        ttl_seconds: int,
        dedicated: bool = False,
        rank: str = "",
    ) -> None:
        self.reservation_id = reservation_id
        self.rank = rank  # whose per-player limits storage checked it against
        self.player_id = player_id
        self.day = day
        self.granted = granted
        self.ttl_seconds = ttl_seconds
        self.contacted = contacted
        self.expires = contacted + ttl_seconds
        self.in_flight = Amount()
        self.calls = 0
        self.pending = Used()
        self.batch: Batch | None = None
        self.sequence = 0  # of the last batch storage acknowledged
        self.retired = dedicated
        self.closed = False
        self.last_used = contacted
        # Settles of one lease go one at a time, in sequence order.
        self.sync_lock = asyncio.Lock()

    @property
    def free(self) -> Amount:
        batch = amount_of(self.batch.used) if self.batch else Amount()
        return self.granted - self.in_flight - amount_of(self.pending) - batch

    def check(
        self,
        need: Amount,
        *,
        now: float,
        today: dt.date,
        call_seconds: float,
        stale_after: float,
        rank: str | None = None,
    ) -> Verdict:
        """Whether a call needing `need` for up to `call_seconds` may draw on this lease (of
        the player's `rank`; None: any, for calls the rank's limits do not concern)."""
        if self.retired or self.closed or self.day != today or not self.free.covers(need):
            return Verdict.SPENT
        if rank is not None and rank != self.rank:  # the player's rank changed
            return Verdict.SPENT
        if now - self.contacted > stale_after or now + call_seconds > self.expires:
            return Verdict.STALE
        return Verdict.OK

    def take(self, need: Amount, now: float) -> None:
        self.in_flight = self.in_flight + need
        self.calls += 1
        self.last_used = now

    def finish(self, need: Amount, used: Used, now: float) -> None:
        self.in_flight = self.in_flight - need
        self.calls -= 1
        self.pending = _plus(self.pending, used)
        self.last_used = now

    @property
    def closing(self) -> bool:
        """Retired with no call left, not closed yet: the next settle closes it."""
        return self.retired and self.calls == 0 and not self.closed

    def next_batch(self) -> tuple[Batch, bool]:
        """The settle to send now, and whether it is a resend of one not yet acknowledged
        (after which another may be due)."""
        if self.batch is not None:
            return self.batch, True
        used, self.pending = self.pending, Used()
        if self.closing:
            keep = None
        elif self.retired:
            keep = self.in_flight  # give back all but what running calls may still use
        else:
            keep = self.granted - amount_of(used)
        self.batch = Batch(self.sequence + 1, used, keep)
        return self.batch, False

    def acknowledge(self, batch: Batch, answer: Answer, sent: float) -> None:
        """Storage applied `batch` (now or, for a duplicate, earlier)."""
        self.batch = None
        self.sequence = batch.sequence
        self.granted = answer.held
        if batch.keep is None:
            self.closed = True
            return
        self.contacted = sent
        self.expires = sent + self.ttl_seconds
        if not answer.found or not answer.external_enabled:
            # Expired in storage, or the player turned external services off: no new calls.
            self.retired = True

    def has_work(self) -> bool:
        """Use to write, or a close to send."""
        if self.closed:
            return False
        return self.batch is not None or self.pending != Used() or self.closing
