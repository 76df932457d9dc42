"""`system:binding.change`: an administrator grants, revokes or resets a player (storage's
PlayerDataService.GrantBinding / ResetPlayer), and the change reaches the gateway replica the
player is connected to at once (ToolRelayService.NotifyPlayer with `binding`), which from a
revoke on refuses every request of theirs. `system:feature.change`: an administrator grants one
player a feature (web search, `system:search`) or takes it back (SetPlayerFeature), and that
replica uses the player's new grants from their next request on (NotifyPlayer with
`features_changed`), cancelling their running requests when one was taken back. A player who is
offline hears either when they join: the gateway reads their binding and grants then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import grpc
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2
from system.storage.v1 import player_data_pb2, player_data_pb2_grpc

from engine_service.context import ExecutionContext
from engine_service.tools import ToolRegistry, ToolSpec
from engine_service.usage_tools import scoped_player
from services.results import AgentFailure, ModuleFailure
from services.runtime.channels import ChannelSettings, Dependency

__all__ = [
    "BINDING_CHANGE",
    "FEATURE_CHANGE",
    "GRANTABLE_FEATURES",
    "BindingNotifier",
    "BindingTools",
    "StorageBindings",
]

BINDING_CHANGE = "system:binding.change"
FEATURE_CHANGE = "system:feature.change"
GRANTABLE_FEATURES = ("system:search",)
"""Features an administrator may grant one player in game: the engine's own (web search),
whose tools run here. A game server's installed features (`ftbquests`) come with its hello."""
STORAGE_TIMEOUT_SECONDS = 10.0
NOTIFY_TIMEOUT_SECONDS = 5.0
ACTIONS = ("grant", "revoke", "reset")

BINDING_CHANGE_SPEC = ToolSpec(
    tool_id=BINDING_CHANGE,
    description=(
        "Grant a player the assistant, revoke them (their data is deleted and every request "
        "refused), or reset them (their data is deleted). Administrators only."
    ),
    input_schema={
        "type": "object",
        "properties": {
            "player": {"type": "string", "minLength": 1, "maxLength": 63},
            "action": {"enum": list(ACTIONS)},
        },
        "required": ["player", "action"],
        "additionalProperties": False,
    },
    read_only=False,
    idempotent=True,  # granting, revoking or resetting twice leaves what once does
    needs_context=True,
)

FEATURE_CHANGE_SPEC = ToolSpec(
    tool_id=FEATURE_CHANGE,
    description=(
        "Grant one player a feature (system:search: web search) or take it back, for that "
        "player alone. Administrators only."
    ),
    input_schema={
        "type": "object",
        "properties": {
            "player": {"type": "string", "minLength": 1, "maxLength": 63},
            "feature": {"enum": list(GRANTABLE_FEATURES)},
            "granted": {"type": "boolean"},
        },
        "required": ["player", "feature", "granted"],
        "additionalProperties": False,
    },
    read_only=False,
    idempotent=True,  # granting or taking back twice leaves what once does
    needs_context=True,
)

_CHANGES = {
    "grant": gateway_pb2.BINDING_CHANGE_BOUND,
    "revoke": gateway_pb2.BINDING_CHANGE_REVOKED,
    "reset": gateway_pb2.BINDING_CHANGE_INVALIDATED,
}


class BindingNotifier(Protocol):
    """How a binding change reaches the player's gateway replica (the relay in production)."""

    async def notify(
        self,
        player_id: str,
        result: common_pb2.AgentResult,
        timeout: float,
        server_id: str = "",
        binding: int = 0,
        features: Sequence[str] | None = None,
    ) -> None: ...


class StorageBindings:
    """GrantBinding and ResetPlayer over storage's PlayerDataService."""

    def __init__(self, target: str, settings: ChannelSettings | None = None) -> None:
        self._dep = Dependency(
            target, player_data_pb2_grpc.PlayerDataServiceStub, settings=settings
        )

    async def change(self, player_id: str, action: str, timeout: float) -> None:
        stub = self._dep.stub
        if action == "grant":
            await stub.GrantBinding(
                player_data_pb2.GrantBindingRequest(player_id=player_id), timeout=timeout
            )
            return
        mode = (
            player_data_pb2.RESET_MODE_REVOKE
            if action == "revoke"
            else player_data_pb2.RESET_MODE_RESET
        )
        await stub.ResetPlayer(
            player_data_pb2.ResetPlayerRequest(player_id=player_id, mode=mode), timeout=timeout
        )

    async def set_feature(
        self, player_id: str, feature: str, granted: bool, timeout: float
    ) -> list[str]:
        """Every feature granted to the player after the change."""
        done = await self._dep.stub.SetPlayerFeature(
            player_data_pb2.SetPlayerFeatureRequest(
                player_id=player_id, feature=feature, granted=granted
            ),
            timeout=timeout,
        )
        return list(done.features)

    async def aclose(self) -> None:
        await self._dep.aclose()


class BindingTools:
    """The handler of `system:binding.change`.

    Args:
        store: storage's bindings; None: no storage (STORAGE_UNAVAILABLE).
        notifier: the relay to the player's gateway; None: the change waits for their next
            join.
    """

    def __init__(self, store: StorageBindings | None, notifier: BindingNotifier | None) -> None:
        self._store = store
        self._notifier = notifier

    def register(self, tools: ToolRegistry) -> None:
        tools.server(BINDING_CHANGE_SPEC, self.change)
        tools.server(FEATURE_CHANGE_SPEC, self.change_feature)

    async def change(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        store = self._storage()
        name, scoped = scoped_player(ctx, payload["player"])
        action = payload["action"]
        try:
            await store.change(scoped, action, min(STORAGE_TIMEOUT_SECONDS, ctx.remaining()))
        except grpc.aio.AioRpcError as exc:
            raise _failure(exc) from None
        notified = await self._notify(ctx, scoped, binding=_CHANGES[action])
        return {"player": name, "action": action, "notified": notified}

    async def change_feature(
        self, payload: dict[str, Any], ctx: ExecutionContext
    ) -> dict[str, Any]:
        store = self._storage()
        name, scoped = scoped_player(ctx, payload["player"])
        feature, granted = payload["feature"], bool(payload["granted"])
        try:
            features = await store.set_feature(
                scoped, feature, granted, min(STORAGE_TIMEOUT_SECONDS, ctx.remaining())
            )
        except grpc.aio.AioRpcError as exc:
            raise _failure(exc) from None
        notified = await self._notify(ctx, scoped, features=features)
        return {"player": name, "feature": feature, "granted": granted, "notified": notified}

    def _storage(self) -> StorageBindings:
        if self._store is None:
            raise ModuleFailure(AgentFailure.STORAGE_UNAVAILABLE, "this engine has no storage")
        return self._store

    async def _notify(
        self,
        ctx: ExecutionContext,
        scoped: str,
        binding: int = 0,
        features: Sequence[str] | None = None,
    ) -> bool:
        """Whether the player's gateway replica heard of the change now; False: offline, and
        the gateway reads it from storage when they join."""
        if self._notifier is None:
            return False
        try:
            await self._notifier.notify(
                scoped,
                common_pb2.AgentResult(),
                min(NOTIFY_TIMEOUT_SECONDS, ctx.remaining()),
                server_id=ctx.player.server_id,
                binding=binding,
                features=features,
            )
        except grpc.aio.AioRpcError:
            return False
        return True


def _failure(exc: grpc.aio.AioRpcError) -> ModuleFailure:
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return ModuleFailure(AgentFailure.INVALID_INPUT, exc.details() or "")
    return ModuleFailure(
        AgentFailure.STORAGE_UNAVAILABLE,
        f"the player could not be changed: {exc.details() or exc.code().name}",
    )
