"""`system:binding.change`: an administrator grants, revokes or resets a player (storage's
PlayerDataService.GrantBinding / ResetPlayer), and the change reaches the gateway replica the
player is connected to at once (ToolRelayService.NotifyPlayer with `binding`), which from a
revoke on refuses every request of theirs. A player who is offline hears it when they join:
the gateway reads their binding then.
"""

from __future__ import annotations

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

__all__ = ["BINDING_CHANGE", "BindingNotifier", "BindingTools", "StorageBindings"]

BINDING_CHANGE = "system:binding.change"
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

    async def change(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        if self._store is None:
            raise ModuleFailure(AgentFailure.STORAGE_UNAVAILABLE, "this engine has no storage")
        name, scoped = scoped_player(ctx, payload["player"])
        action = payload["action"]
        try:
            await self._store.change(scoped, action, min(STORAGE_TIMEOUT_SECONDS, ctx.remaining()))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ModuleFailure(AgentFailure.INVALID_INPUT, exc.details() or "") from None
            raise ModuleFailure(
                AgentFailure.STORAGE_UNAVAILABLE,
                f"the player could not be changed: {exc.details() or exc.code().name}",
            ) from None
        notified = False
        if self._notifier is not None:
            try:
                await self._notifier.notify(
                    scoped,
                    common_pb2.AgentResult(),
                    min(NOTIFY_TIMEOUT_SECONDS, ctx.remaining()),
                    server_id=ctx.player.server_id,
                    binding=_CHANGES[action],
                )
                notified = True
            except grpc.aio.AioRpcError:
                notified = False  # offline: the gateway reads the binding when they join
        return {"player": name, "action": action, "notified": notified}
