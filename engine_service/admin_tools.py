"""The server tools behind the administrators' in-game commands: the router's diagnostics
(`system:routing.diagnostics`) and a reload of its semantic config and button phrasings together
with this engine's event rules (`system:config.reload`).

The router checks the player's permission level itself (its `ADMIN_LEVEL`), from the player
context the gateway vouched for; the admin modules are also hidden below that level, so an
ordinary player never sees them (help, completion, routing).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc
from google.protobuf import json_format
from system.common.v1 import common_pb2
from system.router.v1 import router_pb2, router_pb2_grpc

from engine_service.advancements import AdvancementConfig
from engine_service.context import ExecutionContext
from engine_service.tools import ToolRegistry, ToolSpec
from services.results import AgentFailure, ModuleFailure
from services.runtime.channels import ChannelSettings, Dependency
from services.runtime.config import ConfigError

__all__ = [
    "ADMIN_LEVEL",
    "CONFIG_RELOAD",
    "ROUTING_DIAGNOSTICS",
    "AdminTools",
    "RouterAdmin",
    "RouterDiagnostics",
]

ADMIN_LEVEL = 3
"""Least permission level of the admin commands (the router's own check uses the same)."""
ROUTING_DIAGNOSTICS = "system:routing.diagnostics"
CONFIG_RELOAD = "system:config.reload"
TIMEOUT_SECONDS = 5.0

_EMPTY_INPUT: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_COUNTS = {"type": "object", "additionalProperties": {"type": "integer"}}

DIAGNOSTICS_SPEC = ToolSpec(
    tool_id=ROUTING_DIAGNOSTICS,
    description="The router's state: mode, index size, decisions per source, gates that stopped "
    "local routes and fallback reasons, and the last local match.",
    input_schema=_EMPTY_INPUT,
    output_schema={
        "type": "object",
        "properties": {
            "mode": {"type": "string"},
            "status": {"type": "string"},
            "algorithm": {"type": "string"},
            "examples": {"type": "integer"},
            "cache_entries": {"type": "integer"},
            "decisions": _COUNTS,
            "gates": _COUNTS,
            "last_module_id": {"type": "string"},
            "last_match": {"type": "object"},
        },
        "required": ["mode", "status", "decisions", "gates"],
    },
    read_only=True,
    idempotent=True,
    needs_context=True,
)
RELOAD_SPEC = ToolSpec(
    tool_id=CONFIG_RELOAD,
    description="Reloads the router's system-semantic.json and notification button phrasings, "
    "and this engine's event rules; says what applied, what needs a restart, and any error "
    "naming the file and the key.",
    input_schema=_EMPTY_INPUT,
    output_schema={
        "type": "object",
        "properties": {
            "applied": {"type": "array", "items": {"type": "string"}},
            "needs_restart": {"type": "array", "items": {"type": "string"}},
            "semantic_error": {"type": "string"},
            "event_rules": {"type": "string"},
            "event_rules_error": {"type": "string"},
        },
        "required": ["applied", "needs_restart"],
    },
    read_only=False,
    idempotent=True,
    needs_context=True,
)


class RouterAdmin(Protocol):
    """The router's admin calls (RouterDiagnostics over gRPC in production)."""

    async def diagnostics(
        self, player: common_pb2.PlayerContext, timeout: float
    ) -> router_pb2.GetDiagnosticsResponse: ...

    async def reload(
        self, player: common_pb2.PlayerContext, timeout: float
    ) -> router_pb2.ReloadConfigResponse: ...


class RouterDiagnostics:
    """RouterAdmin over the router's `GetDiagnostics` and `ReloadConfig`."""

    def __init__(self, target: str, settings: ChannelSettings | None = None) -> None:
        self._dep = Dependency(
            target,
            router_pb2_grpc.RouterServiceStub,
            idempotent_methods=[
                "system.router.v1.RouterService/GetDiagnostics",
                "system.router.v1.RouterService/ReloadConfig",
            ],
            settings=settings,
        )

    async def diagnostics(
        self, player: common_pb2.PlayerContext, timeout: float
    ) -> router_pb2.GetDiagnosticsResponse:
        return await self._dep.stub.GetDiagnostics(
            router_pb2.GetDiagnosticsRequest(player=player), timeout=timeout
        )

    async def reload(
        self, player: common_pb2.PlayerContext, timeout: float
    ) -> router_pb2.ReloadConfigResponse:
        return await self._dep.stub.ReloadConfig(
            router_pb2.ReloadConfigRequest(player=player), timeout=timeout
        )

    async def aclose(self) -> None:
        await self._dep.aclose()


def _router_failure(exc: grpc.aio.AioRpcError, what: str) -> ModuleFailure:
    code = exc.code()
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return ModuleFailure(AgentFailure.PERMISSION_DENIED, exc.details() or what)
    return ModuleFailure(
        AgentFailure.MODULE_FAILED, f"{what}: {exc.details() or code.name} ({code.name})"
    )


class AdminTools:
    """The handlers of the admin server tools.

    Args:
        router: the router's admin calls; None when the engine has no router configured.
        advancements: this engine's event rules, reloaded with the router's config.
    """

    def __init__(
        self, router: RouterAdmin | None, advancements: AdvancementConfig | None = None
    ) -> None:
        self._router = router
        self.advancements = advancements

    def register(self, tools: ToolRegistry) -> None:
        tools.server(DIAGNOSTICS_SPEC, self.diagnostics)
        tools.server(RELOAD_SPEC, self.reload)

    def _need_router(self) -> RouterAdmin:
        if self._router is None:
            raise ModuleFailure(
                AgentFailure.TOOL_UNAVAILABLE, "this engine has no router configured"
            )
        return self._router

    async def diagnostics(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        router = self._need_router()
        try:
            answer = await router.diagnostics(
                ctx.live_player(), min(TIMEOUT_SECONDS, ctx.remaining())
            )
        except grpc.aio.AioRpcError as exc:
            raise _router_failure(exc, "the router's diagnostics could not be read") from None
        return {
            "mode": answer.mode,
            "status": answer.status,
            "algorithm": answer.algorithm,
            "examples": answer.example_count,
            "cache_entries": answer.cache_entries,
            "decisions": {c.name: c.count for c in answer.decisions},
            "gates": {c.name: c.count for c in answer.gates},
            "last_module_id": answer.last_module_id,
            "last_match": json_format.MessageToDict(answer.last_match),
        }

    async def reload(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        router = self._need_router()
        out: dict[str, Any] = {"applied": [], "needs_restart": []}
        try:
            answer = await router.reload(ctx.live_player(), min(TIMEOUT_SECONDS, ctx.remaining()))
            out["applied"], out["needs_restart"] = list(answer.applied), list(answer.needs_restart)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise _router_failure(exc, "the router's config could not be reloaded") from None
            out["semantic_error"] = exc.details() or "refused"  # names the file and the key
        if self.advancements is not None:
            try:
                rules = await asyncio.to_thread(self.advancements.reload)
                out["event_rules"] = f"{len(rules.rules)} rules from {rules.source}"
            except ConfigError as exc:
                out["event_rules_error"] = f"{exc}; the rules in force stay"
        return out
