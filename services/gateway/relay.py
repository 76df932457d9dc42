"""The gateway's internal relay (system.relay.v1.ToolRelayService): engine replicas' game-tool
calls and notices, sent over the player's game-server connection. Served on the internal port
only (see services.gateway.app)."""

from __future__ import annotations

import asyncio

from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2
from system.relay.v1 import relay_pb2, relay_pb2_grpc

from services.gateway.config import GatewayConfig
from services.gateway.connection import Connection, ConnectionRegistry
from services.gateway.validation import check_id
from services.runtime.context import remaining_seconds
from services.runtime.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from services.runtime.multiplex import MultiplexServer

__all__ = ["ToolRelayServicer"]


class ToolRelayServicer(relay_pb2_grpc.ToolRelayServiceServicer):
    """Relays the engine's game-tool calls over the player's game-server connection."""

    def __init__(self, config: GatewayConfig, registry: ConnectionRegistry) -> None:
        self._config = config
        self._registry = registry
        self._multiplex = MultiplexServer(
            relay_pb2.DESCRIPTOR.services_by_name["ToolRelayService"].full_name,
            relay_pb2.MultiplexResponse,
            relay_pb2.MultiplexAnswer,
            {
                "call_game_tool": ("CallGameTool", self.CallGameTool),
                "notify_player": ("NotifyPlayer", self.NotifyPlayer),
            },
        )

    async def Multiplex(self, request_iterator, context):  # type: ignore[no-untyped-def]
        # CallGameTool and NotifyPlayer, many on one stream (services.runtime.multiplex); a
        # handler reads its deadline from the request scope, which each call's timeout_ms sets.
        async for response in self._multiplex.serve(request_iterator):
            yield response

    async def CallGameTool(self, request, context):  # type: ignore[no-untyped-def]
        check_id("call_id", request.call_id)
        check_id("player_id", request.player_id)
        check_id("tool", request.tool)
        connection = self._connection_of(request.player_id)
        if request.tool not in connection.tools:
            raise NotFound(f"game server {connection.server_id} does not offer tool {request.tool}")
        if request.call_id in connection.tool_calls:
            raise AlreadyExists(f"game-tool call {request.call_id} is already waiting")
        timeout = remaining_seconds(self._config.tool_call_timeout_seconds) or 0.0
        future: asyncio.Future[gateway_pb2.ToolResult] = asyncio.get_running_loop().create_future()
        connection.tool_calls[request.call_id] = future
        connection.send(
            gateway_pb2.ConnectResponse(
                tool_call=gateway_pb2.ToolCall(
                    call_id=request.call_id,
                    player_id=request.player_id,
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
            connection.tool_calls.pop(request.call_id, None)
        return relay_pb2.CallGameToolResponse(result=result)

    async def NotifyPlayer(self, request, context):  # type: ignore[no-untyped-def]
        check_id("player_id", request.player_id)
        if request.result.status == common_pb2.RESULT_STATUS_UNSPECIFIED:
            raise InvalidArgument("result.status is required: say how the work ended")
        self._connection_of(request.player_id).send(
            gateway_pb2.ConnectResponse(
                response=gateway_pb2.PlayerResponse(
                    player_id=request.player_id,
                    notice=gateway_pb2.Notice(result=request.result),
                )
            )
        )
        return relay_pb2.NotifyPlayerResponse()

    def _connection_of(self, player_id: str) -> Connection:
        """The connection the player is on. FAILED_PRECONDITION when they are on none, not
        NOT_FOUND: the engine must tell "player offline, try when they join" apart from
        "this server has no such tool". Nothing was sent then."""
        try:
            return self._registry.for_player(player_id)
        except NotFound as exc:
            raise FailedPrecondition(exc.message) from None
