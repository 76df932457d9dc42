"""The gateway's internal relay (system.relay.v1.ToolRelayService): engine replicas' game-tool
calls and notices, sent over the player's game-server connection. Served on the internal port
only (see services.gateway.app).

Players are named by the scoped ids the gateway gave out (decision 0012): a call goes to the
connection that player is attached to now, and only when that connection's server is in the
player's scope; the ToolCall or notice written to the game server carries its own id of the
player."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import grpc
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2
from system.relay.v1 import relay_pb2, relay_pb2_grpc
from system.router.v1 import router_pb2

from services.gateway.config import GatewayConfig
from services.gateway.connection import Connection, ConnectionRegistry, PendingCall
from services.gateway.players import PlayerState
from services.gateway.scopes import PlayerScopes, split
from services.gateway.validation import MAX_NAME, MAX_PERMISSION, check_id, shown
from services.runtime.context import remaining_seconds
from services.runtime.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from services.runtime.multiplex import MultiplexServer

__all__ = ["ToolRelayServicer"]


class ToolRelayServicer(relay_pb2_grpc.ToolRelayServiceServicer):
    """Relays the engine's game-tool calls over the player's game-server connection."""

    def __init__(
        self,
        config: GatewayConfig,
        registry: ConnectionRegistry,
        forget: Callable[[common_pb2.PlayerContext, router_pb2.ClearReason], None] | None = None,
    ) -> None:
        """`forget(player, reason)` drops the player's routing scope (the router's intent
        cache) when their permissions shrink; None: nothing to drop."""
        self._config = config
        self._registry = registry
        self._forget = forget
        self._scopes = PlayerScopes(config.player_scopes())
        self._multiplex = MultiplexServer(
            relay_pb2.DESCRIPTOR.services_by_name["ToolRelayService"],
            {"CallGameTool": self.CallGameTool, "NotifyPlayer": self.NotifyPlayer},
        )

    async def MultiplexCalls(
        self,
        request_iterator: AsyncIterator[relay_pb2.MultiplexCallsRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[relay_pb2.MultiplexCallsResponse]:
        # CallGameTool and NotifyPlayer, many on one stream (services.runtime.multiplex); a
        # handler reads its deadline from the request scope, which each call's timeout_ms sets.
        async for response in self._multiplex.serve(request_iterator, context):
            yield response

    async def CallGameTool(
        self, request: relay_pb2.CallGameToolRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> relay_pb2.CallGameToolResponse:
        check_id("call_id", request.call_id)
        check_id("player_id", request.player_id)
        check_id("tool", request.tool, MAX_NAME)
        connection, player_id = self._attachment(request.player_id, request.server_id)
        if request.tool not in connection.tools:
            raise NotFound(f"game server {connection.server_id} does not offer tool {request.tool}")
        if request.call_id in connection.tool_calls:
            raise AlreadyExists(f"game-tool call {request.call_id} is already waiting")
        timeout = remaining_seconds(self._config.tool_call_timeout_seconds) or 0.0
        future: asyncio.Future[gateway_pb2.ToolResult] = asyncio.get_running_loop().create_future()
        pending = PendingCall(future, player_id, request.tool)
        connection.tool_calls[request.call_id] = pending
        connection.send(
            gateway_pb2.ConnectResponse(
                tool_call=gateway_pb2.ToolCall(
                    call_id=request.call_id,
                    player_id=player_id,
                    tool=request.tool,
                    input=request.input,
                    timeout_ms=int(timeout * 1000),
                )
            )
        )
        try:
            result = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise DeadlineExceeded(
                f"game server {connection.server_id} did not answer {request.tool} in time"
            ) from None
        finally:
            if connection.tool_calls.get(request.call_id) is pending:
                del connection.tool_calls[request.call_id]
        return relay_pb2.CallGameToolResponse(result=result)

    async def NotifyPlayer(
        self, request: relay_pb2.NotifyPlayerRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> relay_pb2.NotifyPlayerResponse:
        check_id("player_id", request.player_id)
        if request.min_permission_level or request.every_server:
            return self._notify_admins(request)
        if request.binding not in gateway_pb2.BindingChange.values():
            raise InvalidArgument(f"binding {request.binding} is not a BindingChange")
        for index, feature in enumerate(request.player_features):
            check_id(f"player_features[{index}]", feature)
        if request.player_features and not request.features_changed:
            raise InvalidArgument("player_features is read only with features_changed")
        notice = request.result.status != common_pb2.RESULT_STATUS_UNSPECIFIED
        if not notice and not request.binding and not request.features_changed:
            raise InvalidArgument("result.status is required: say how the work ended")
        connection, player_id = self._attachment(request.player_id, request.server_id)
        if request.binding:
            self._binding_changed(connection, player_id, request.binding)
        if request.features_changed:
            self._features_changed(connection, player_id, tuple(request.player_features))
        if notice:
            # A notice is best effort: a full outbox drops the oldest waiting one.
            connection.send(
                gateway_pb2.ConnectResponse(
                    response=gateway_pb2.PlayerResponse(
                        player_id=player_id,
                        notice=gateway_pb2.Notice(result=request.result),
                    )
                ),
                droppable=True,
            )
        return relay_pb2.NotifyPlayerResponse()

    def _notify_admins(
        self, request: relay_pb2.NotifyPlayerRequest
    ) -> relay_pb2.NotifyPlayerResponse:
        """The notice for every player at or above `min_permission_level` on the player's game
        server (or on every server of this replica), each in their language."""
        level = request.min_permission_level
        if not 1 <= level <= MAX_PERMISSION:
            raise InvalidArgument(
                f"min_permission_level must be 1..{MAX_PERMISSION} (every_server needs it)"
            )
        if request.binding or request.features_changed:
            raise InvalidArgument("a notice to administrators changes no binding or features")
        results = dict(request.results_by_language)
        if set(results) - {"zh", "en"}:
            raise InvalidArgument("results_by_language keys are zh and en")
        for result in (request.result, *results.values()):
            if result.status == common_pb2.RESULT_STATUS_UNSPECIFIED:
                raise InvalidArgument("result.status is required: say how the work ended")
        if request.every_server:
            connections = self._registry.connections()
        else:
            parts = split(request.player_id)
            connection = self._registry.attached(request.player_id) if parts else None
            if connection is None and parts is not None:  # offline: their scope's own server
                connection = self._registry.server(request.server_id or parts[0])
            if connection is None or (
                parts is not None and self._scopes.scope_of(connection.server_id) != parts[0]
            ):
                raise FailedPrecondition(
                    f"the game server of {shown(request.player_id)} is not connected here"
                )
            connections = [connection]
        notified = 0
        for connection in connections:
            for own_id, player in list(connection.players.items()):
                if player.permission_level < level:
                    continue
                result = results.get(player.language, request.result)
                connection.send(
                    gateway_pb2.ConnectResponse(
                        response=gateway_pb2.PlayerResponse(
                            player_id=own_id, notice=gateway_pb2.Notice(result=result)
                        )
                    ),
                    droppable=True,
                )
                notified += 1
        return relay_pb2.NotifyPlayerResponse(notified=notified)

    @staticmethod
    def _binding_changed(connection: Connection, player_id: str, change: int) -> None:
        """Applies a binding change to the player on this connection at once: REVOKED refuses
        their requests from now on and cancels those running; INVALIDATED (a reset) forgets
        what this connection kept of them; BOUND serves them again. The game server hears it
        in a Binding frame."""
        state = connection.player_state(player_id)
        state.revoked = change == gateway_pb2.BINDING_CHANGE_REVOKED
        if change == gateway_pb2.BINDING_CHANGE_REVOKED:
            connection.cancel_player(player_id, "the player's access was revoked")
        elif change == gateway_pb2.BINDING_CHANGE_INVALIDATED:
            connection.states[player_id] = PlayerState(revoked=False)
        connection.send(
            gateway_pb2.ConnectResponse(
                response=gateway_pb2.PlayerResponse(
                    player_id=player_id,
                    binding=gateway_pb2.Binding(change=cast(gateway_pb2.BindingChange, change)),
                )
            )
        )

    def _features_changed(
        self, connection: Connection, player_id: str, granted: tuple[str, ...]
    ) -> None:
        """The features granted to the player alone are now `granted`, from their next request
        on. A feature taken back also cancels their running requests (none runs on with what
        they lost) and drops their routing scope."""
        state = connection.player_state(player_id)
        before = state.granted_features
        state.granted_features = granted
        if before is not None and not set(before) <= set(granted):
            connection.cancel_player(player_id, "a feature of the player was taken back")
            player = connection.players.get(player_id)
            if player is not None and self._forget is not None:
                self._forget(player, router_pb2.CLEAR_REASON_PERMISSIONS_CHANGED)

    def _attachment(self, scoped_id: str, server_id: str) -> tuple[Connection, str]:
        """The connection the player is attached to and the game server's own id of them.
        PERMISSION_DENIED when `server_id` names a server outside the player's scope;
        FAILED_PRECONDITION when they are on no connection, not NOT_FOUND: the engine must
        tell "player offline, try when they join" apart from "this server has no such
        tool". Nothing was sent then."""
        parts = split(scoped_id)
        if server_id and parts is not None and self._scopes.scope_of(server_id) != parts[0]:
            raise PermissionDenied(
                f"player {shown(scoped_id)} does not belong to game server {shown(server_id)}"
            )
        connection = self._registry.attached(scoped_id) if parts is not None else None
        if connection is None or parts is None:
            raise FailedPrecondition(f"player {shown(scoped_id)} is not connected")
        return connection, parts[1]
