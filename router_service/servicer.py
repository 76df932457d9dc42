"""gRPC face of the router."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from system.router.v1 import router_pb2, router_pb2_grpc

from router_service.buttons import Phrasings, load_phrasings
from router_service.router import Router
from router_service.semantic import SemanticConfig, load_semantic_config
from services.runtime.config import ConfigError
from services.runtime.errors import FailedPrecondition

__all__ = ["RouterServicer"]


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """Validates, delegates to the Router and converts its answers."""

    def __init__(
        self,
        router: Router,
        semantic_config_path: str,
        phrasings_path: str = "",
        engine_target: str = "",
    ) -> None:
        self._router = router
        self._path = semantic_config_path
        self._phrasings_path = phrasings_path
        self._engine_target = engine_target

    async def Route(
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> router_pb2.RouteResponse:
        return await self._router.route(request)

    async def RecordOutcome(
        self, request: router_pb2.RecordOutcomeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> router_pb2.RecordOutcomeResponse:
        cached, reason = await self._router.record_outcome(request)
        return router_pb2.RecordOutcomeResponse(cached=cached, reason=reason)

    async def ClearPlayerScope(
        self,
        request: router_pb2.ClearPlayerScopeRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> router_pb2.ClearPlayerScopeResponse:
        removed = await self._router.clear_scope(
            request.player_id, request.reason, request.server_id
        )
        return router_pb2.ClearPlayerScopeResponse(removed=removed)

    async def GetDiagnostics(
        self, request: router_pb2.GetDiagnosticsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> router_pb2.GetDiagnosticsResponse:
        self._router.check_admin(request.player, "system:routing")
        snap = self._router.diagnostics_snapshot()
        last = snap.get("last_match") or {}
        return router_pb2.GetDiagnosticsResponse(
            algorithm=snap["algorithm"],
            mode=snap["mode"],
            status=snap["status"],
            example_count=snap["example_count"],
            cache_entries=snap["cache_entries"],
            decisions=[
                router_pb2.NamedCount(name=k, count=v) for k, v in snap["decisions"].items()
            ],
            gates=[
                router_pb2.NamedCount(name=k, count=v)
                for k, v in {**snap["failed_gates"], **snap["fallback_reasons"]}.items()
            ],
            last_module_id=last.get("module_id", ""),
            last_match=router_pb2.LocalMatch(
                language=last.get("language", ""),
                top_score=last.get("score", 0.0),
                margin=last.get("margin", 0.0),
                coverage=last.get("coverage", 0.0),
                gate_failed=last.get("gate", ""),
                candidates=[
                    router_pb2.ScoredCandidate(module_id=m, score=score)
                    for m, score in last.get("candidates", ())
                ],
            ),
        )

    async def ReloadConfig(
        self, request: router_pb2.ReloadConfigRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> router_pb2.ReloadConfigResponse:
        self._router.check_admin(request.player, "system:reload")
        try:
            config, phrasings = await self._read_files()
        except FailedPrecondition as exc:
            if not request.validate_only:
                raise
            # The first round of a reload of every replica: the engine still needs to know
            # where the engines are, to reload their event rules.
            return router_pb2.ReloadConfigResponse(
                engine_target=self._engine_target, error=exc.message
            )
        if request.validate_only:
            return router_pb2.ReloadConfigResponse(engine_target=self._engine_target)
        changes = self._router.reload(config, phrasings)
        return router_pb2.ReloadConfigResponse(
            applied=[c for c in changes if "restart" not in c],
            needs_restart=[c for c in changes if "restart" in c],
            engine_target=self._engine_target,
        )

    async def _read_files(self) -> tuple[SemanticConfig | None, Phrasings | None]:
        """Both files read and checked (None: that one is not configured).

        Raises:
            FailedPrecondition: neither is configured, or one is refused (naming the file and
                the key).
        """
        if not self._path and not self._phrasings_path:
            raise FailedPrecondition(
                "no system-semantic.json and no button phrasings file is configured (settings "
                "semantic_config, button_phrasings)"
            )
        # Both files are read and checked before either applies: a bad one leaves both as
        # they were, so the router never runs half a reload.
        config: SemanticConfig | None = None
        phrasings: Phrasings | None = None
        try:
            if self._path:
                config = await asyncio.to_thread(load_semantic_config, self._path)
            if self._phrasings_path:
                phrasings = await asyncio.to_thread(load_phrasings, self._phrasings_path)
        except (ConfigError, ValueError) as exc:
            raise FailedPrecondition(f"{exc}; the previous settings stay in force") from None
        return config, phrasings
