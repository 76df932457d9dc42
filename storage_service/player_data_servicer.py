"""gRPC face of player data: converts messages and runs the store off the event loop."""

from __future__ import annotations

from typing import Any

import grpc
from system.storage.v1 import player_data_pb2, player_data_pb2_grpc

from storage_service.budget_alerts import BudgetAlertClaims
from storage_service.dbcall import run_db
from storage_service.dialect import utc_now
from storage_service.player_data import PlayerDataStore
from storage_service.usage import UsageLedger
from storage_service.usage_records import AMOUNT_FIELDS, Limits, Settled, SettleItem, Spend
from storage_service.usage_spend import SpendView

__all__ = ["PlayerDataServicer"]


class PlayerDataServicer(player_data_pb2_grpc.PlayerDataServiceServicer):
    """Thin: every method delegates to PlayerDataStore in a worker thread. Typed errors the
    store raises become status codes in the server interceptor."""

    def __init__(
        self,
        store: PlayerDataStore,
        ledger: UsageLedger,
        spend: SpendView,
        alerts: BudgetAlertClaims,
    ) -> None:
        self._store = store
        self._ledger = ledger
        self._spend = spend
        self._alerts = alerts

    async def GetDocument(
        self,
        request: player_data_pb2.GetDocumentRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> player_data_pb2.GetDocumentResponse:
        document = await run_db(self._store.get_document, request.key)
        return player_data_pb2.GetDocumentResponse(document=document)

    async def ListDocuments(
        self,
        request: player_data_pb2.ListDocumentsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> player_data_pb2.ListDocumentsResponse:
        documents = await run_db(
            self._store.list_documents, request.player_id, request.owner_module
        )
        return player_data_pb2.ListDocumentsResponse(documents=documents)

    async def GetUsage(
        self, request: player_data_pb2.GetUsageRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> player_data_pb2.GetUsageResponse:
        days = await run_db(
            self._store.get_usage,
            request.player_id,
            request.from_day,
            request.to_day,
            request.scope,
        )
        if days:  # the range was checked by get_usage; the money is on the budget counters
            budget = f"server:{request.scope}" if request.scope else f"player:{request.player_id}"
            costs = await run_db(self._spend.daily_cost, budget, days[0].day, days[-1].day)
            for day in days:
                day.cost_micros = costs.get(day.day, 0)
        return player_data_pb2.GetUsageResponse(days=days)

    async def GetSpend(
        self, request: player_data_pb2.GetSpendRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> player_data_pb2.GetSpendResponse:
        return await run_db(self._spend.spend, request.scope, request.period, request.max_lines)

    async def GrantBinding(
        self,
        request: player_data_pb2.GrantBindingRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> player_data_pb2.GrantBindingResponse:
        state = await run_db(self._store.grant_binding, request.player_id)
        return player_data_pb2.GrantBindingResponse(state=state)

    async def GetBinding(
        self,
        request: player_data_pb2.GetBindingRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> player_data_pb2.GetBindingResponse:
        state, changed_at, features = await run_db(self._store.get_binding, request.player_id)
        response = player_data_pb2.GetBindingResponse(state=state, features=features)
        if changed_at is not None:
            response.changed_at.FromDatetime(changed_at)
        return response

    async def SetPlayerFeature(
        self,
        request: player_data_pb2.SetPlayerFeatureRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> player_data_pb2.SetPlayerFeatureResponse:
        features, changed = await run_db(
            self._store.set_player_feature, request.player_id, request.feature, request.granted
        )
        return player_data_pb2.SetPlayerFeatureResponse(features=features, changed=changed)

    async def ResetPlayer(
        self,
        request: player_data_pb2.ResetPlayerRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> player_data_pb2.ResetPlayerResponse:
        deleted, state = await run_db(self._store.reset_player, request.player_id, request.mode)
        # `deleted` is uint32 on the wire; a count past it is reported as its largest value.
        return player_data_pb2.ResetPlayerResponse(deleted=min(deleted, 2**32 - 1), state=state)

    async def ReserveUsage(
        self,
        request: player_data_pb2.ReserveUsageRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> player_data_pb2.ReserveUsageResponse:
        grant = await run_db(
            self._ledger.reserve,
            request.reservation_id,
            request.player_id,
            request.tokens,
            request.web_searches,
            Limits.from_proto(request.limits),
            request.ttl_seconds,
            extra_tokens=request.extra_tokens,
            extra_web_searches=request.extra_web_searches,
            cost_micros=request.cost_micros,
            extra_cost_micros=request.extra_cost_micros,
        )
        return player_data_pb2.ReserveUsageResponse(
            day=grant.day.isoformat(),
            tokens=grant.tokens,
            web_searches=grant.web_searches,
            cost_micros=grant.cost_micros,
            budgets=[
                player_data_pb2.BudgetUse(
                    budget=use.budget,
                    scope=use.scope,
                    period=use.period,
                    used=use.used,
                    limit=use.limit,
                )
                for use in grant.budgets
            ],
        )

    async def SettleUsage(
        self,
        request: player_data_pb2.SettleUsageRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> player_data_pb2.SettleUsageResponse:
        [settled] = await run_db(self._ledger.settle_many, [_settle_item(request)])
        return _settled(settled)

    async def SettleUsageBatch(
        self,
        request: player_data_pb2.SettleUsageBatchRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> player_data_pb2.SettleUsageBatchResponse:
        items = [_settle_item(settle) for settle in request.settles]
        outcomes = await run_db(self._ledger.settle_many, items)
        return player_data_pb2.SettleUsageBatchResponse(results=[_settled(o) for o in outcomes])

    async def ClaimBudgetAlert(
        self,
        request: player_data_pb2.ClaimBudgetAlertRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> player_data_pb2.ClaimBudgetAlertResponse:
        claim = await run_db(
            self._alerts.claim,
            request.budget,
            request.scope,
            request.period,
            request.percent,
            request.claimant,
            utc_now(),
        )
        return player_data_pb2.ClaimBudgetAlertResponse(
            claimed=claim.claimed, gateway_addresses=claim.gateway_addresses
        )


def _settle_item(request: player_data_pb2.SettleUsageRequest) -> SettleItem:
    return SettleItem(
        reservation_id=request.reservation_id,
        player_id=request.player_id,
        used={name: getattr(request.used, name) for name in AMOUNT_FIELDS},
        sequence=request.sequence,
        keep=(request.keep_tokens, request.keep_web_searches) if request.keep_open else None,
        ttl_seconds=request.ttl_seconds,
        cost_micros=request.used.cost_micros,
        keep_cost_micros=request.keep_cost_micros if request.keep_open else 0,
        spend=tuple(Spend.from_proto(item) for item in request.used.spend),
    )


def _settled(settled: Settled) -> player_data_pb2.SettleUsageResponse:
    return player_data_pb2.SettleUsageResponse(
        found=settled.found,
        duplicate=settled.duplicate,
        held_tokens=settled.held_tokens,
        held_web_searches=settled.held_web_searches,
        external_enabled=settled.external_enabled,
        held_cost_micros=settled.held_cost_micros,
    )
