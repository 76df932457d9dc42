"""The storage service's usage calls (PlayerDataService.ReserveUsage / SettleUsage), in the
lease meter's terms.

All may be sent twice: a reservation is idempotent by its id, and every settle the gateway
sends carries a sequence number, so the channel retries them on UNAVAILABLE.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable

import grpc
from system.storage.v1 import player_data_pb2, player_data_pb2_grpc

from services.model_gateway.budgets import BudgetAlerts, BudgetPlan, Use
from services.model_gateway.lease import Amount, Answer, Batch
from services.model_gateway.metering import BudgetExhausted, Budgets, ExternalServicesOff
from services.runtime.channels import ChannelSettings, Dependency
from services.runtime.context import remaining_seconds
from services.runtime.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ServiceError,
    Unavailable,
    error_reason,
)

__all__ = ["Grant", "Settle", "UsageStore"]

RESERVE = "system.storage.v1.PlayerDataService/ReserveUsage"
SETTLE = "system.storage.v1.PlayerDataService/SettleUsage"
SETTLE_BATCH = "system.storage.v1.PlayerDataService/SettleUsageBatch"
# Settles per SettleUsageBatch call (storage takes up to 1000).
MAX_BATCH = 500

_PASSED_ON: dict[grpc.StatusCode, type[ServiceError]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: BudgetExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: ExternalServicesOff,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
}


@dataclasses.dataclass(frozen=True)
class Settle:
    """One settle to send: a lease's batch."""

    reservation_id: str
    player_id: str
    batch: Batch
    ttl_seconds: int


@dataclasses.dataclass(frozen=True)
class Grant:
    """What a reservation holds, the UTC day it counts on, and the rank whose per-player
    limits it was checked against."""

    day: dt.date
    held: Amount
    rank: str = ""


class UsageStore:
    """Reserve and settle through the storage service.

    Args:
        target: `host:port` of the storage service.
        budgets: the limits sent with every reservation (the rank's, for the player): a
            BudgetPlan, or the flat daily Budgets.
        timeout: seconds one call may take (a reservation also within the caller's deadline).
        notify: told of each budget alert besides its log line (`alerts.AdminNotices`).
    """

    def __init__(
        self,
        target: str,
        budgets: Budgets | BudgetPlan,
        timeout: float,
        settings: ChannelSettings | None = None,
        notify: Callable[[Use, int, str], None] | None = None,
    ) -> None:
        self._timeout = timeout
        self._storage = Dependency(
            target,
            player_data_pb2_grpc.PlayerDataServiceStub,
            idempotent_methods=[RESERVE, SETTLE, SETTLE_BATCH],
            settings=settings,
        )
        plan = (
            budgets
            if isinstance(budgets, BudgetPlan)
            else BudgetPlan.flat(**dataclasses.asdict(budgets))
        )
        self._plan = plan
        self._limits = {
            rank.name: player_data_pb2.UsageLimits(**plan.limits(rank)) for rank in plan.ranks
        }
        self._alerts = BudgetAlerts(plan.alert_percent, notify)

    def rank_of(self, level: int | None) -> str:
        """The rank name of a permission level (the lowest rank for None)."""
        return self._plan.rank(level).name

    async def reserve(
        self,
        reservation_id: str,
        player_id: str,
        need: Amount,
        extra: Amount,
        ttl_seconds: int,
        level: int | None = None,
    ) -> Grant:
        """Holds `need` (refused unless it fits) and as much of `extra` as fits, against the
        limits of the rank of permission `level`.

        Raises:
            BudgetExhausted, ExternalServicesOff, InvalidArgument: storage refused.
            DeadlineExceeded: the caller's deadline passed meanwhile.
            Unavailable: storage did not answer; nothing is held.
        """
        rank = self.rank_of(level)
        request = player_data_pb2.ReserveUsageRequest(
            reservation_id=reservation_id,
            player_id=player_id,
            tokens=need.tokens,
            web_searches=need.web_searches,
            limits=self._limits[rank],
            ttl_seconds=ttl_seconds,
            extra_tokens=extra.tokens,
            extra_web_searches=extra.web_searches,
            cost_micros=need.cost,
            extra_cost_micros=extra.cost,
        )
        try:
            response = await self._storage.stub.ReserveUsage(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _reserve_error(exc) from None
        self._alerts.observe(
            (
                Use(use.budget, use.scope, use.period, use.used, use.limit)
                for use in response.budgets
            ),
            player_id,
        )
        return Grant(
            dt.date.fromisoformat(response.day),
            Amount(response.tokens, response.web_searches, response.cost_micros),
            rank,
        )

    async def settle(
        self, reservation_id: str, player_id: str, batch: Batch, ttl_seconds: int
    ) -> Answer:
        """Sends one settle of a reservation (safe to send again: it has a sequence).

        Raises:
            Unavailable: storage did not answer or refused; the batch is to be sent again.
        """
        request = _settle_request(Settle(reservation_id, player_id, batch, ttl_seconds))
        try:
            response = await self._storage.stub.SettleUsage(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(
                f"usage of {reservation_id} not written ({exc.code().name}: {exc.details()})"
            ) from None
        return _answer(response)

    async def settle_many(self, settles: list[Settle]) -> list[Answer]:
        """Sends settles of several reservations in one call (SettleUsageBatch).

        Raises:
            Unavailable: storage did not answer or refused; every batch is to be sent again.
        """
        answers: list[Answer] = []
        for start in range(0, len(settles), MAX_BATCH):
            request = player_data_pb2.SettleUsageBatchRequest(
                settles=[_settle_request(s) for s in settles[start : start + MAX_BATCH]]
            )
            try:
                response = await self._storage.stub.SettleUsageBatch(request, timeout=self._timeout)
            except grpc.aio.AioRpcError as exc:
                raise Unavailable(
                    f"usage of {len(request.settles)} leases not written ({exc.code().name}: "
                    f"{exc.details()})"
                ) from None
            answers.extend(_answer(result) for result in response.results)
        return answers

    async def aclose(self) -> None:
        await self._storage.aclose()


def _settle_request(settle: Settle) -> player_data_pb2.SettleUsageRequest:
    batch = settle.batch
    return player_data_pb2.SettleUsageRequest(
        reservation_id=settle.reservation_id,
        player_id=settle.player_id,
        used=player_data_pb2.UsageAmounts(**dataclasses.asdict(batch.used)),
        sequence=batch.sequence,
        keep_open=batch.keep is not None,
        keep_tokens=batch.keep.tokens if batch.keep else 0,
        keep_web_searches=batch.keep.web_searches if batch.keep else 0,
        keep_cost_micros=batch.keep.cost if batch.keep else 0,
        ttl_seconds=settle.ttl_seconds if batch.keep is not None else 0,
    )


def _answer(response: player_data_pb2.SettleUsageResponse) -> Answer:
    return Answer(
        found=response.found,
        held=Amount(response.held_tokens, response.held_web_searches, response.held_cost_micros),
        external_enabled=response.external_enabled,
    )


def _reserve_error(exc: grpc.aio.AioRpcError) -> ServiceError:
    kind = _PASSED_ON.get(exc.code())
    if kind is not None:
        return kind(exc.details() or exc.code().name, error_reason(exc))
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and remaining_seconds() == 0:
        return DeadlineExceeded("the caller's deadline passed while the budget was checked")
    return Unavailable(
        f"the storage service that keeps usage budgets did not answer ({exc.code().name}: "
        f"{exc.details()}); nothing was sent to the provider"
    )
