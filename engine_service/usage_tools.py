"""`system:usage.read`: a player's external-service use (model calls, tokens, web searches, and
what the calls cost) per day, or with the player `*` the sum over every player of the asker's
game server (or network), read from storage's PlayerDataService.GetUsage, for the
administrators' `/system usage`. `system:spend.read`: what the asker's game server (or network)
spent today or this month, by player, module and provider, and its budgets against their limits
(PlayerDataService.GetSpend), for `/system spend`.

Players are named as their game server knows them; the tool reads them in the asking
administrator's player scope (their game server, or its network: decision 0012), so an
administrator of one server never reads another server's players.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Protocol

import grpc
from system.storage.v1 import player_data_pb2, player_data_pb2_grpc

from engine_service.context import ExecutionContext
from engine_service.tools import ToolRegistry, ToolSpec
from services.results import AgentFailure, ModuleFailure
from services.runtime.channels import ChannelSettings, Dependency

__all__ = [
    "EVERYONE",
    "SPEND_READ",
    "USAGE_DAYS",
    "USAGE_READ",
    "StorageUsage",
    "UsageReader",
    "UsageTools",
    "scoped_player",
]

USAGE_READ = "system:usage.read"
SPEND_READ = "system:spend.read"
SPEND_LINES = 5
"""Players, modules and providers shown each, the largest spenders first."""
EVERYONE = "*"
"""The player name that asks for the whole server's use (no player id holds `*`)."""
USAGE_DAYS = 7
"""Days shown, today (UTC) included."""
STORAGE_TIMEOUT_SECONDS = 5.0

USAGE_READ_SPEC = ToolSpec(
    tool_id=USAGE_READ,
    description=(
        "Read one player's use of external services (model calls, tokens, web searches) per "
        "day over the last week, or with player `*` the sum over the whole server, for "
        "administrators."
    ),
    input_schema={
        "type": "object",
        "properties": {"player": {"type": "string", "minLength": 1, "maxLength": 63}},
        "required": ["player"],
        "additionalProperties": False,
    },
    read_only=True,
    idempotent=True,
    needs_context=True,
)


SPEND_READ_SPEC = ToolSpec(
    tool_id=SPEND_READ,
    description=(
        "Read what this server's players spent on the model (tokens and money) today or this "
        "month, by player, module and provider, with the budgets' use against their limits, "
        "for administrators."
    ),
    input_schema={
        "type": "object",
        "properties": {"period": {"type": "string", "enum": ["day", "month"]}},
        "required": ["period"],
        "additionalProperties": False,
    },
    read_only=True,
    idempotent=True,
    needs_context=True,
)


def scoped_player(ctx: ExecutionContext, name: str) -> tuple[str, str]:
    """`name` (a player id as the game server knows it) and its scoped id in the asking
    player's scope (their server, or its network): an administrator of one server never
    reaches another server's players. INVALID_INPUT for a name that is no player id."""
    name = name.strip()
    if not name or "/" in name or not name.isprintable():
        raise ModuleFailure(
            AgentFailure.INVALID_INPUT,
            f"{name!r} is not a player id; give the id the game server knows them by",
        )
    # The asker's scoped id is `<scope>/<id>`: the player named is in the same scope.
    scope = ctx.player.player_id.rpartition("/")[0]
    return name, f"{scope}/{name}" if scope else name


class UsageReader(Protocol):
    """Where usage is read (storage in production)."""

    async def days(
        self, player_id: str, first: str, last: str, timeout: float, scope: str = ""
    ) -> list[player_data_pb2.DailyUsage]: ...

    async def spend(
        self, scope: str, period: str, max_lines: int, timeout: float
    ) -> player_data_pb2.GetSpendResponse: ...


class StorageUsage:
    """UsageReader over `PlayerDataService.GetUsage` (a read: retried on UNAVAILABLE)."""

    def __init__(self, target: str, settings: ChannelSettings | None = None) -> None:
        self._dep = Dependency(
            target,
            player_data_pb2_grpc.PlayerDataServiceStub,
            idempotent_methods=[
                "system.storage.v1.PlayerDataService/GetUsage",
                "system.storage.v1.PlayerDataService/GetSpend",
            ],
            settings=settings,
        )

    async def days(
        self, player_id: str, first: str, last: str, timeout: float, scope: str = ""
    ) -> list[player_data_pb2.DailyUsage]:
        response = await self._dep.stub.GetUsage(
            player_data_pb2.GetUsageRequest(
                player_id=player_id, from_day=first, to_day=last, scope=scope
            ),
            timeout=timeout,
        )
        return list(response.days)

    async def spend(
        self, scope: str, period: str, max_lines: int, timeout: float
    ) -> player_data_pb2.GetSpendResponse:
        response: player_data_pb2.GetSpendResponse = await self._dep.stub.GetSpend(
            player_data_pb2.GetSpendRequest(scope=scope, period=period, max_lines=max_lines),
            timeout=timeout,
        )
        return response

    async def aclose(self) -> None:
        await self._dep.aclose()


def _server_scope(ctx: ExecutionContext, refusal: str) -> str:
    """The asking administrator's player scope (their game server, or its network); `refusal`
    says why not when their players are not scoped."""
    scope = ctx.player.player_id.rpartition("/")[0]
    if not scope:
        raise ModuleFailure(AgentFailure.INVALID_INPUT, refusal)
    return scope


def _read_failure(exc: grpc.aio.AioRpcError, what: str) -> ModuleFailure:
    """A refused read (INVALID_ARGUMENT) as INVALID_INPUT, any other error as storage
    unavailable: `what` could not be read."""
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return ModuleFailure(AgentFailure.INVALID_INPUT, exc.details() or "")
    return ModuleFailure(
        AgentFailure.STORAGE_UNAVAILABLE, f"{what} could not be read; try again later"
    )


class UsageTools:
    """The handlers of `system:usage.read` and `system:spend.read`; `reader` None: no storage
    (STORAGE_UNAVAILABLE)."""

    def __init__(self, reader: UsageReader | None) -> None:
        self._reader = reader

    def register(self, tools: ToolRegistry) -> None:
        tools.server(USAGE_READ_SPEC, self.read)
        tools.server(SPEND_READ_SPEC, self.spend)

    def _need_reader(self) -> UsageReader:
        if self._reader is None:
            raise ModuleFailure(AgentFailure.STORAGE_UNAVAILABLE, "this engine has no storage")
        return self._reader

    async def spend(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        reader = self._need_reader()
        scope = _server_scope(
            ctx, "this server's players are not scoped, so its spend cannot be told apart"
        )
        today = dt.datetime.now(dt.UTC).date()
        monthly = payload["period"] == "month"
        period = today.strftime("%Y-%m") if monthly else today.isoformat()
        try:
            found = await reader.spend(
                scope, period, SPEND_LINES, min(STORAGE_TIMEOUT_SECONDS, ctx.remaining())
            )
        except grpc.aio.AioRpcError as exc:
            raise _read_failure(exc, "spend") from None

        def lines(found: Any, strip: bool = False) -> list[dict[str, Any]]:
            return [
                {
                    # Players as their game server knows them: the asker's scope is implied.
                    "name": line.name.partition("/")[2] if strip else line.name,
                    "tokens": line.tokens,
                    "cost_micros": line.cost_micros,
                }
                for line in found
            ]

        return {
            "period": found.period,
            "monthly": monthly,
            "total": {"tokens": found.total.tokens, "cost_micros": found.total.cost_micros},
            "network": {"tokens": found.network.tokens, "cost_micros": found.network.cost_micros},
            "players": lines(found.players, strip=True),
            "player_count": found.player_count,
            "modules": lines(found.modules),
            "providers": lines(found.providers),
            "budgets": [
                {
                    "budget": b.budget,
                    "period": b.period,
                    "spent": b.used - b.held,
                    "held": b.held,
                    "limit": b.limit,
                }
                for b in found.budgets
            ],
        }

    async def read(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        reader = self._need_reader()
        scope = ""
        if payload["player"].strip() == EVERYONE:
            name, scoped = EVERYONE, ""
            scope = _server_scope(
                ctx,
                "this server's players are not scoped, so its use cannot be told apart; "
                "ask for one player",
            )
        else:
            name, scoped = scoped_player(ctx, payload["player"])
        today = dt.datetime.now(dt.UTC).date()
        first = (today - dt.timedelta(days=USAGE_DAYS - 1)).isoformat()
        try:
            days = await reader.days(
                scoped,
                first,
                today.isoformat(),
                min(STORAGE_TIMEOUT_SECONDS, ctx.remaining()),
                scope=scope,
            )
        except grpc.aio.AioRpcError as exc:
            raise _read_failure(exc, "usage") from None
        return {
            "player": name,
            "days": [
                {
                    "day": d.day,
                    "model_calls": d.model_calls,
                    "prompt_tokens": d.prompt_tokens,
                    "completion_tokens": d.completion_tokens,
                    "web_searches": d.web_searches,
                    "cost_micros": d.cost_micros,
                }
                for d in days
            ],
        }
