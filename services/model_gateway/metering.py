"""Per-player metering and daily budgets, kept by the storage service.

Every outside call is bracketed: `reserve` holds its worst case against the player's and the
global daily budgets (and refuses players who turned external services off) before anything
is sent; `settle` records what the call actually used and releases the hold, also when the
call failed. Settling happens after the answer has gone back (`settle_later`): the hold keeps
the budget safe until then, and the caller does not wait for the bookkeeping. The check is
atomic in storage (PlayerDataService.ReserveUsage), so several
gateway replicas never exceed a budget together.

Storage failures map to typed errors: a refused reservation keeps its code
(RESOURCE_EXHAUSTED, FAILED_PRECONDITION, INVALID_ARGUMENT) and message; storage being
unreachable is UNAVAILABLE, which callers turn into their local fallback. A settle that fails
is logged and dropped: the hold then expires by itself, and the answer is not lost for it.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import math
import uuid
from typing import Protocol

import grpc
from system.storage.v1 import player_data_pb2, player_data_pb2_grpc

from services.runtime.channels import Dependency
from services.runtime.context import remaining_seconds
from services.runtime.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)

__all__ = [
    "BudgetExhausted",
    "Budgets",
    "ExternalServicesOff",
    "Hold",
    "Meter",
    "NoMeter",
    "StorageMeter",
    "Used",
]

log = logging.getLogger("system.model")

RESERVE = "system.storage.v1.PlayerDataService/ReserveUsage"
# A hold outlives the call it covers by this much, so only a dead replica's holds expire.
HOLD_MARGIN_SECONDS = 30
MAX_HOLD_SECONDS = 3600


class BudgetExhausted(ResourceExhausted):
    """A daily budget would be exceeded; nothing was sent."""


class ExternalServicesOff(FailedPrecondition):
    """The player turned external services off; nothing was sent. Callers use their local
    fallback."""


_PASSED_ON: dict[grpc.StatusCode, type[ServiceError]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: BudgetExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: ExternalServicesOff,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
}


@dataclasses.dataclass(frozen=True)
class Budgets:
    """Daily limits; 0 is no limit."""

    player_tokens: int = 0
    player_web_searches: int = 0
    global_tokens: int = 0
    global_web_searches: int = 0


@dataclasses.dataclass(frozen=True)
class Hold:
    """One reservation, to be settled once."""

    reservation_id: str
    player_id: str


@dataclasses.dataclass(frozen=True)
class Used:
    """What one call actually used."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_cache_hit_tokens: int = 0
    prompt_cache_miss_tokens: int = 0
    model_calls: int = 0
    web_searches: int = 0


class Meter(Protocol):
    """Reserves before an outside call and settles after it."""

    async def reserve(
        self, player_id: str, *, tokens: int = 0, web_searches: int = 0, hold_seconds: float
    ) -> Hold:
        """Holds the worst case. Raises ResourceExhausted, FailedPrecondition or Unavailable."""
        ...

    async def settle(self, hold: Hold, used: Used) -> None:
        """Records `used` and releases the hold; never raises."""
        ...

    def settle_later(self, hold: Hold, used: Used) -> None:
        """Settles in the background; `drain` (and `aclose`) wait for it."""
        ...

    async def drain(self) -> None:
        """Waits for every settle started so far."""
        ...

    async def aclose(self) -> None: ...


class NoMeter:
    """Metering off (no storage target): nothing is held, checked or recorded."""

    async def reserve(
        self, player_id: str, *, tokens: int = 0, web_searches: int = 0, hold_seconds: float
    ) -> Hold:
        return Hold("", player_id)

    async def settle(self, hold: Hold, used: Used) -> None:
        return None

    def settle_later(self, hold: Hold, used: Used) -> None:
        return None

    async def drain(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


class StorageMeter:
    """Metering through PlayerDataService.ReserveUsage / SettleUsage.

    Args:
        target: `host:port` of the storage service.
        budgets: the daily limits sent with every reservation.
        timeout: seconds a reservation or a settle may take (a reservation also within the
            caller's deadline).
    """

    def __init__(self, target: str, budgets: Budgets, timeout: float = 2.0) -> None:
        self._timeout = timeout
        # ReserveUsage is idempotent by reservation id, so the channel may retry it on
        # UNAVAILABLE; SettleUsage is not and is never retried.
        self._storage = Dependency(
            target, player_data_pb2_grpc.PlayerDataServiceStub, idempotent_methods=[RESERVE]
        )
        self._limits = player_data_pb2.UsageLimits(
            player_tokens=budgets.player_tokens,
            player_web_searches=budgets.player_web_searches,
            global_tokens=budgets.global_tokens,
            global_web_searches=budgets.global_web_searches,
        )
        self._pending: set[asyncio.Task[None]] = set()

    async def reserve(
        self, player_id: str, *, tokens: int = 0, web_searches: int = 0, hold_seconds: float
    ) -> Hold:
        hold = Hold(uuid.uuid4().hex, player_id)
        ttl = min(MAX_HOLD_SECONDS, math.ceil(hold_seconds) + HOLD_MARGIN_SECONDS)
        request = player_data_pb2.ReserveUsageRequest(
            reservation_id=hold.reservation_id,
            player_id=player_id,
            tokens=tokens,
            web_searches=web_searches,
            limits=self._limits,
            ttl_seconds=ttl,
        )
        try:
            await self._storage.stub.ReserveUsage(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _reserve_error(exc) from None
        return hold

    async def settle(self, hold: Hold, used: Used) -> None:
        request = player_data_pb2.SettleUsageRequest(
            reservation_id=hold.reservation_id,
            player_id=hold.player_id,
            used=player_data_pb2.UsageAmounts(**dataclasses.asdict(used)),
        )
        try:
            # Not bound by the caller's deadline: the answer is ready, the record must follow.
            await self._storage.stub.SettleUsage(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "usage not recorded (%s %s); the hold expires by itself",
                exc.code().name,
                exc.details(),
                extra={"player_id": hold.player_id, **dataclasses.asdict(used)},
            )

    def settle_later(self, hold: Hold, used: Used) -> None:
        # A fresh context: the caller's deadline (which the client interceptor would apply)
        # may pass before the record is written, and must not cut it short.
        task = asyncio.get_running_loop().create_task(
            self.settle(hold, used), context=contextvars.Context()
        )
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def drain(self) -> None:
        while self._pending:
            await asyncio.gather(*list(self._pending))

    async def aclose(self) -> None:
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=self._timeout)
        await self._storage.aclose()


def _reserve_error(exc: grpc.aio.AioRpcError) -> ServiceError:
    kind = _PASSED_ON.get(exc.code())
    if kind is not None:
        return kind(exc.details() or exc.code().name)
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and remaining_seconds() == 0:
        return DeadlineExceeded("the caller's deadline passed while the budget was checked")
    return Unavailable(
        f"the storage service that keeps usage budgets did not answer ({exc.code().name}: "
        f"{exc.details()}); nothing was sent to the provider"
    )
