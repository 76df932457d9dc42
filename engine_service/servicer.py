"""gRPC face of the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from system.engine.v1 import engine_pb2, engine_pb2_grpc
from system.storage.v1 import journal_pb2

from engine_service.advancements import AdvancementConfig
from engine_service.engine import BoundedExecutor, Engine
from engine_service.events import EventTasks
from engine_service.registry import struct_to_dict
from engine_service.tool_catalog import game_tool_catalog, to_proto
from services.runtime.config import ConfigError
from services.runtime.errors import FailedPrecondition, InvalidArgument
from services.runtime.multiplex import MultiplexServer

__all__ = ["EngineServicer"]


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Validates requests and hands them to the Engine."""

    def __init__(
        self,
        engine: Engine,
        events: EventTasks,
        maintenance: BoundedExecutor,
        advancements: AdvancementConfig | None = None,
        replica: str = "",
    ) -> None:
        self._engine = engine
        self._events = events
        self._maintenance = maintenance
        self._advancements = advancements
        self._replica = replica
        self._game_tools: engine_pb2.GetGameToolCatalogResponse | None = None
        self._multiplex = MultiplexServer(
            engine_pb2.DESCRIPTOR.services_by_name["EngineService"],
            {"SubmitEvent": self.SubmitEvent, "ResumePlayerTasks": self.ResumePlayerTasks},
        )

    async def Execute(
        self, request: engine_pb2.ExecuteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.ExecuteResponse:
        if request.source == engine_pb2.ROUTE_SOURCE_UNSPECIFIED:
            raise InvalidArgument("source is required (how the module was chosen)")
        if request.source not in engine_pb2.RouteSource.values():
            raise InvalidArgument(f"source {request.source} is not a known RouteSource")
        result = await self._engine.execute(
            request.player,
            request.action,
            request.request_text,
            request.source,
            request.request_id,
        )
        return engine_pb2.ExecuteResponse(result=result)

    async def CancelRun(
        self, request: engine_pb2.CancelRunRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.CancelRunResponse:
        if not request.player.player_id:
            raise InvalidArgument("player.player_id is required")
        cancelled = self._engine.cancel(request.player.player_id, request.request_id)
        return engine_pb2.CancelRunResponse(cancelled=cancelled)

    async def SettleHistory(
        self, request: engine_pb2.SettleHistoryRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.SettleHistoryResponse:
        if not request.player.player_id:
            raise InvalidArgument("player.player_id is required")
        settled = await self._engine.settle_history(request.player.player_id)
        return engine_pb2.SettleHistoryResponse(settled=settled)

    async def GetCatalog(
        self, request: engine_pb2.GetCatalogRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.GetCatalogResponse:
        player = request.player if request.HasField("player") else None
        if player is not None and not player.player_id:
            raise InvalidArgument("player.player_id is required when a player is given")
        registry = self._engine.registry
        return engine_pb2.GetCatalogResponse(
            generation=registry.generation,
            modules=registry.descriptors(player),
            reject_profiles=registry.reject_profiles(),
        )

    async def GetGameToolCatalog(
        self,
        request: engine_pb2.GetGameToolCatalogRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> engine_pb2.GetGameToolCatalogResponse:
        if self._game_tools is None:  # the registry is frozen: built once
            self._game_tools = engine_pb2.GetGameToolCatalogResponse(
                generation=self._engine.registry.generation,
                tools=to_proto(game_tool_catalog(self._engine.registry)),
            )
        return self._game_tools

    async def SubmitEvent(
        self, request: engine_pb2.SubmitEventRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.SubmitEventResponse:
        try:
            data = struct_to_dict(request.data)
        except ValueError as exc:
            raise InvalidArgument(f"data is not valid JSON: {exc}") from None
        made = await self._events.submit(
            request.player, request.event_type, request.event_key, data, request.player_online
        )
        return engine_pb2.SubmitEventResponse(
            tasks=[
                engine_pb2.SubmittedTask(
                    task_id=task.task_id,
                    module_id=task.module_id,
                    created=created,
                    waiting=task.state == journal_pb2.TASK_STATE_WAITING,
                )
                for task, created in made
            ]
        )

    async def ResumePlayerTasks(
        self,
        request: engine_pb2.ResumePlayerTasksRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> engine_pb2.ResumePlayerTasksResponse:
        resumed = await self._maintenance.run(lambda: self._events.resume(request.player))
        return engine_pb2.ResumePlayerTasksResponse(resumed=resumed)

    async def ReloadAdvancements(
        self,
        request: engine_pb2.ReloadAdvancementsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> engine_pb2.ReloadAdvancementsResponse:
        if self._advancements is None:
            raise FailedPrecondition("this engine has no advancement rules to reload")
        try:
            rules = await asyncio.to_thread(self._advancements.reload)
        except ConfigError as exc:
            raise FailedPrecondition(f"{exc}; the rules in force stay") from None
        return engine_pb2.ReloadAdvancementsResponse(
            file=rules.source,
            rules=len(rules.rules),
            default_module_id=rules.default.module_id if rules.default else "",
            digest=rules.digest,
            replica=self._replica,
        )

    async def MultiplexCalls(
        self,
        request_iterator: AsyncIterator[engine_pb2.MultiplexCallsRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[engine_pb2.MultiplexCallsResponse]:
        # SubmitEvent and ResumePlayerTasks, many on one stream (services.runtime.multiplex);
        # neither handler reads its context, so a call on the stream runs as the unary one.
        async for response in self._multiplex.serve(request_iterator, context):
            yield response
