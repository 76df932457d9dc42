"""The server tools behind the administrators' in-game commands: the router's diagnostics
(`system:routing.diagnostics`) and a reload of its semantic config and button phrasings together
with the engines' event rules (`system:config.reload`).

A reload reaches every replica (decision 0033): the router target is resolved to each of its
addresses (`replica_addresses`: a headless Service's `dns:///` name, a static `ipv4:a,b`
list), each router replica checks its files (`validate_only`) and, when none refused, each
applies them; this engine then reloads its own event rules (a refused file stops there: no
replica changes) and calls `ReloadAdvancements` on every engine replica, at the addresses of
the engine target the routers balance over. The answer counts the replicas that reloaded and
names those that failed.

The router checks the player's permission level itself (its `ADMIN_LEVEL`), from the player
context the gateway vouched for; the admin modules are also hidden below that level, so an
ordinary player never sees them (help, completion, routing).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf import json_format
from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2, engine_pb2_grpc
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
    "EnginePeers",
    "ReplicaReload",
    "RouterAdmin",
    "RouterDiagnostics",
    "replica_addresses",
]

ADMIN_LEVEL = 3
"""Least permission level of the admin commands (the router's own check uses the same)."""
ROUTING_DIAGNOSTICS = "system:routing.diagnostics"
CONFIG_RELOAD = "system:config.reload"
TIMEOUT_SECONDS = 5.0
_ROUTER_RELOAD = "system.router.v1.RouterService/ReloadConfig"
_ENGINE_RELOAD = "system.engine.v1.EngineService/ReloadAdvancements"

_EMPTY_INPUT: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_COUNTS = {"type": "object", "additionalProperties": {"type": "integer"}}
_REPLICAS = {
    "type": "object",
    "properties": {
        "reloaded": {"type": "integer"},
        "total": {"type": "integer"},
        "failed": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["reloaded", "total", "failed"],
}
"""How many replicas of a service reloaded, of how many found, and each that failed
(`address: why`)."""

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
    "and the engines' event rules, on every replica; says what applied, what needs a restart, "
    "how many replicas reloaded, which failed, and any error naming the file and the key.",
    input_schema=_EMPTY_INPUT,
    output_schema={
        "type": "object",
        "properties": {
            "applied": {"type": "array", "items": {"type": "string"}},
            "needs_restart": {"type": "array", "items": {"type": "string"}},
            "semantic_error": {"type": "string"},
            "event_rules": {"type": "string"},
            "event_rules_error": {"type": "string"},
            "routers": _REPLICAS,
            "engines": _REPLICAS,
        },
        "required": ["applied", "needs_restart"],
    },
    read_only=False,
    idempotent=True,
    needs_context=True,
)


async def replica_addresses(target: str) -> list[str]:
    """Every address `target` names, one per replica: `ipv4:`/`ipv6:` lists as listed,
    `dns:///host:port` (a headless Service: one address per ready replica) resolved now, a
    plain `host:port` as itself (one replica, or a virtual IP that reaches only one).

    Raises:
        OSError: the name does not resolve.
    """
    scheme, _, rest = target.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return [a for a in rest.split(",") if a]
    if scheme != "dns":
        return [target]
    name = rest.lstrip("/")
    if rest.startswith("//"):  # dns://authority/host:port: the authority is a DNS server
        name = rest[2:].partition("/")[2]
    host, _, port = name.rpartition(":")
    host = host.strip("[]")
    found = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    addresses = dict.fromkeys(
        f"[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{port}"
        for info in found
    )
    return sorted(addresses)


@dataclasses.dataclass
class ReplicaReload:
    """What a reload of every replica of one service came to."""

    total: int = 0
    """Replicas found (addresses resolved; for engines, distinct replicas that answered plus
    those that did not)."""
    reloaded: int = 0
    """Replicas that reloaded."""
    failed: list[str] = dataclasses.field(default_factory=list)
    """`address: why` of each replica that could not be reached or refused."""

    def summary(self) -> dict[str, Any]:
        return {"reloaded": self.reloaded, "total": self.total, "failed": list(self.failed)}


R = TypeVar("R")


async def _each(
    addresses: Sequence[str], call: Callable[[str], Awaitable[R]]
) -> list[tuple[str, R | grpc.aio.AioRpcError]]:
    """`call` on every address at once; each answer, or the error it ended with."""

    async def one(address: str) -> tuple[str, R | grpc.aio.AioRpcError]:
        try:
            return address, await call(address)
        except grpc.aio.AioRpcError as exc:
            return address, exc

    return list(await asyncio.gather(*(one(a) for a in addresses)))


S = TypeVar("S")


@contextlib.asynccontextmanager
async def _replica(
    address: str,
    stub_factory: Callable[[grpc.aio.Channel], S],
    method: str,
    settings: ChannelSettings | None,
) -> AsyncIterator[S]:
    """A stub on one replica's address, its channel closed after (an admin command: rare).
    Its one call, `method` (`package.Service/Method`), is a reload: idempotent, retried on
    UNAVAILABLE."""
    dep = Dependency(address, stub_factory, idempotent_methods=[method], settings=settings)
    try:
        yield dep.stub
    finally:
        await dep.aclose()


def _why(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.details() or exc.code().name} ({exc.code().name})"


class RouterAdmin(Protocol):
    """The router's admin calls (RouterDiagnostics over gRPC in production)."""

    async def diagnostics(
        self, player: common_pb2.PlayerContext, timeout: float
    ) -> router_pb2.GetDiagnosticsResponse: ...

    async def addresses(self) -> list[str]: ...

    async def reload_at(
        self, address: str, player: common_pb2.PlayerContext, timeout: float, validate_only: bool
    ) -> router_pb2.ReloadConfigResponse: ...


class RouterDiagnostics:
    """RouterAdmin over the router's `GetDiagnostics`, and `ReloadConfig` on each replica."""

    def __init__(self, target: str, settings: ChannelSettings | None = None) -> None:
        self.target = target
        self._settings = settings
        self._dep = Dependency(
            target,
            router_pb2_grpc.RouterServiceStub,
            idempotent_methods=["system.router.v1.RouterService/GetDiagnostics"],
            settings=settings,
        )

    async def diagnostics(
        self, player: common_pb2.PlayerContext, timeout: float
    ) -> router_pb2.GetDiagnosticsResponse:
        return await self._dep.stub.GetDiagnostics(
            router_pb2.GetDiagnosticsRequest(player=player), timeout=timeout
        )

    async def addresses(self) -> list[str]:
        return await replica_addresses(self.target)

    async def reload_at(
        self, address: str, player: common_pb2.PlayerContext, timeout: float, validate_only: bool
    ) -> router_pb2.ReloadConfigResponse:
        """`ReloadConfig` on the one replica at `address`."""
        async with _replica(
            address, router_pb2_grpc.RouterServiceStub, _ROUTER_RELOAD, self._settings
        ) as stub:
            return await stub.ReloadConfig(
                router_pb2.ReloadConfigRequest(player=player, validate_only=validate_only),
                timeout=timeout,
            )

    async def aclose(self) -> None:
        await self._dep.aclose()


class EnginePeers:
    """`ReloadAdvancements` on one engine replica by address (this engine's credential)."""

    def __init__(self, settings: ChannelSettings | None = None) -> None:
        self._settings = settings

    async def reload_at(
        self, address: str, timeout: float
    ) -> engine_pb2.ReloadAdvancementsResponse:
        async with _replica(
            address, engine_pb2_grpc.EngineServiceStub, _ENGINE_RELOAD, self._settings
        ) as stub:
            return await stub.ReloadAdvancements(
                engine_pb2.ReloadAdvancementsRequest(), timeout=timeout
            )


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
        engines: reaches the other engine replicas to reload their event rules; None: only
            this one reloads.
        replica: this replica's lease owner name, to know itself among the engines' answers.
    """

    def __init__(
        self,
        router: RouterAdmin | None,
        advancements: AdvancementConfig | None = None,
        engines: EnginePeers | None = None,
        replica: str = "",
    ) -> None:
        self._router = router
        self.advancements = advancements
        self.engines = engines
        self.replica = replica

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
        # Three rounds of calls (check, apply, engines) share the run's time.
        timeout = min(TIMEOUT_SECONDS, ctx.remaining() / 3)
        routers, engine_target = await self._reload_routers(router, ctx, timeout, out)
        out["routers"] = routers.summary()
        if self.advancements is not None:
            try:
                rules = await asyncio.to_thread(self.advancements.reload)
            except ConfigError as exc:
                # Checked here first: a refused file is called on no other replica.
                out["event_rules_error"] = f"{exc}; the rules in force stay"
                return out
            out["event_rules"] = f"{len(rules.rules)} rules from {rules.source}"
            out["engines"] = (await self._reload_engines(engine_target, timeout)).summary()
        return out

    async def _reload_routers(
        self, router: RouterAdmin, ctx: ExecutionContext, timeout: float, out: dict[str, Any]
    ) -> tuple[ReplicaReload, str]:
        """Checks the files on every router replica, then (none refused) applies them on
        each; fills `out`'s applied, needs_restart and semantic_error. Returns the count and
        the engine target the routers named."""
        player = ctx.live_player()
        try:
            addresses = await router.addresses()
        except (OSError, ValueError) as exc:
            raise ModuleFailure(
                AgentFailure.MODULE_FAILED, f"the router's replicas could not be found: {exc}"
            ) from None
        done = ReplicaReload(total=len(addresses))
        engine_target = ""
        checked: list[str] = []
        for address, answer in await _each(
            addresses, lambda a: router.reload_at(a, player, timeout, validate_only=True)
        ):
            if isinstance(answer, grpc.aio.AioRpcError):
                if answer.code() == grpc.StatusCode.PERMISSION_DENIED:
                    raise _router_failure(answer, "the router's config could not be reloaded")
                done.failed.append(f"{address}: {_why(answer)}")
                continue
            engine_target = engine_target or answer.engine_target
            if answer.error:
                # Names the file and the key; the first refusal stops every replica.
                out.setdefault("semantic_error", answer.error)
            checked.append(address)
        if "semantic_error" in out:
            return done, engine_target
        applied: dict[str, None] = {}
        restart: dict[str, None] = {}
        for address, answer in await _each(
            checked, lambda a: router.reload_at(a, player, timeout, validate_only=False)
        ):
            if isinstance(answer, grpc.aio.AioRpcError):
                done.failed.append(f"{address}: {_why(answer)}")
                continue
            done.reloaded += 1
            applied.update(dict.fromkeys(answer.applied))
            restart.update(dict.fromkeys(answer.needs_restart))
        out["applied"], out["needs_restart"] = list(applied), list(restart)
        return done, engine_target

    async def _reload_engines(self, target: str, timeout: float) -> ReplicaReload:
        """This replica reloaded; the others at the addresses of `target` (this one among
        them, known by its replica name). Without a target or peers: this one alone."""
        done = ReplicaReload(total=1, reloaded=1)
        if not target or self.engines is None:
            return done
        engines = self.engines
        try:
            addresses = await replica_addresses(target)
        except (OSError, ValueError) as exc:
            done.failed.append(f"{target}: the engine replicas could not be found: {exc}")
            return done
        seen = {self.replica}
        for address, answer in await _each(addresses, lambda a: engines.reload_at(a, timeout)):
            if isinstance(answer, grpc.aio.AioRpcError):
                done.total += 1
                done.failed.append(f"{address}: {_why(answer)}")
            elif answer.replica not in seen:
                seen.add(answer.replica)
                done.total += 1
                done.reloaded += 1
        return done
