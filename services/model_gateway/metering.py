"""Per-player metering and daily budgets: the types every meter shares.

Every outside call is bracketed: `reserve` holds its worst case against the player's and the
global daily budgets (and refuses players who turned external services off) before anything
is sent; `settle` records what the call actually used and releases the hold, also when the
call failed. The budgets are kept by the storage service; `leasing.LeaseMeter` draws on blocks
of them held there (leases), so most calls need no storage round trip. `NoMeter` is metering
off. The limits (per rank, game server, network per day and month, in tokens and money)
are `budgets.BudgetPlan`; storage checks them all in one reservation.

Storage failures map to typed errors (`usage_store._reserve_error`): a refused reservation keeps its code
(RESOURCE_EXHAUSTED, FAILED_PRECONDITION, INVALID_ARGUMENT) and message; storage being
unreachable is UNAVAILABLE, which callers turn into their local fallback.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from services.runtime.errors import FailedPrecondition, ResourceExhausted

__all__ = [
    "BudgetExhausted",
    "Budgets",
    "ExternalServicesOff",
    "Hold",
    "Meter",
    "NoMeter",
    "Spend",
    "Used",
    "merge_spend",
]


class BudgetExhausted(ResourceExhausted):
    """A daily budget would be exceeded; nothing was sent."""


class ExternalServicesOff(FailedPrecondition):
    """The player turned external services off; nothing was sent. Callers use their local
    fallback."""


@dataclasses.dataclass(frozen=True)
class Budgets:
    """Daily limits; 0 is no limit."""

    player_tokens: int = 0
    player_web_searches: int = 0
    global_tokens: int = 0
    global_web_searches: int = 0


@dataclasses.dataclass(frozen=True)
class Hold:
    """One call's worst case, held until the call is settled (once)."""

    player_id: str
    tokens: int = 0
    web_searches: int = 0
    lease: object | None = dataclasses.field(default=None, compare=False, repr=False)
    """The meter's lease the hold draws on; None for NoMeter."""
    cost_micros: int = 0


@dataclasses.dataclass(frozen=True)
class Spend:
    """What one module's calls on one provider used: the spend view's lines (storage's
    `usage_spend`)."""

    module_id: str
    provider: str
    tokens: int = 0
    cost_micros: int = 0


def merge_spend(a: tuple[Spend, ...], b: tuple[Spend, ...]) -> tuple[Spend, ...]:
    """`a` and `b` summed per (module, provider), in that key's order."""
    if not b:
        return a
    if not a:
        return b
    sums: dict[tuple[str, str], tuple[int, int]] = {}
    for item in (*a, *b):
        tokens, cost = sums.get((item.module_id, item.provider), (0, 0))
        sums[(item.module_id, item.provider)] = (tokens + item.tokens, cost + item.cost_micros)
    return tuple(Spend(m, p, t, c) for (m, p), (t, c) in sorted(sums.items()))


@dataclasses.dataclass(frozen=True)
class Used:
    """What one call actually used."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_cache_hit_tokens: int = 0
    prompt_cache_miss_tokens: int = 0
    model_calls: int = 0
    web_searches: int = 0
    cost_micros: int = 0
    """What the call cost at its model's prices, in millionths of the prices' currency."""
    spend: tuple[Spend, ...] = ()
    """The tokens and money by module and provider (one item for one call)."""


class Meter(Protocol):
    """Reserves before an outside call and settles after it."""

    async def reserve(
        self,
        player_id: str,
        *,
        tokens: int = 0,
        web_searches: int = 0,
        cost_micros: int = 0,
        level: int | None = None,
        hold_seconds: float,
    ) -> Hold:
        """Holds the worst case (money in micros) against the budgets of the player's rank
        (by permission `level`; None: the call does not concern the rank's limits). Raises
        ResourceExhausted, FailedPrecondition or Unavailable."""
        ...

    def settle_later(self, hold: Hold, used: Used) -> None:
        """Releases the hold and records `used`; storage learns of it in the background.
        Never raises, never waits."""
        ...

    async def drain(self) -> None:
        """Writes every use recorded so far to storage, and waits for it."""
        ...

    async def aclose(self) -> None:
        """Writes what is left and gives back every hold."""
        ...


class NoMeter:
    """Metering off (no storage target): nothing is held, checked or recorded."""

    async def reserve(
        self,
        player_id: str,
        *,
        tokens: int = 0,
        web_searches: int = 0,
        cost_micros: int = 0,
        level: int | None = None,
        hold_seconds: float,
    ) -> Hold:
        return Hold(player_id, tokens, web_searches, cost_micros=cost_micros)

    def settle_later(self, hold: Hold, used: Used) -> None:
        return None

    async def drain(self) -> None:
        return None

    async def aclose(self) -> None:
        return None
