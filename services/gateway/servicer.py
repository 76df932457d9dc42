"""The gateway's public gRPC service: the game servers' Connect stream."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import Gauge
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from system.router.v1 import router_pb2

from services.gateway.config import PROTOCOL_VERSION, GatewayConfig
from services.gateway.connection import Connection, ConnectionRegistry, RunningRequest
from services.gateway.players import PlayerRequests, PlayerState
from services.gateway.validation import (
    check_event,
    check_hello,
    check_id,
    check_presence,
    normalize_language,
)
from services.results import AgentFailure, failed
from services.runtime.context import new_request_id, request_scope
from services.runtime.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
)

__all__ = ["GatewayServicer"]

log = logging.getLogger("system.gateway")

CONNECTIONS = Gauge("gateway_connections", "Game servers connected now.")
PLAYERS = Gauge("gateway_players", "Players joined on all connections now.")
_CONTROL_ACTIONS = set(gateway_pb2.ControlAction.values()) - {
    gateway_pb2.CONTROL_ACTION_UNSPECIFIED
}

_UNDECODABLE = "a frame could not be decoded as a ConnectRequest (corrupt or truncated protobuf)"


def _code_number(code_name: str) -> int:
    return int(getattr(grpc.StatusCode, code_name).value[0])


class GatewayServicer(gateway_pb2_grpc.GameGatewayServiceServicer):
    """Accepts game servers' connections and serves their players."""

    def __init__(
        self, config: GatewayConfig, registry: ConnectionRegistry, players: PlayerRequests
    ) -> None:
        self._config = config
        self._tokens = config.token_book()
        self._registry = registry
        self._players = players
        self._tasks: set[asyncio.Task[None]] = set()

    def _authenticate(self, context: grpc.aio.ServicerContext) -> str:
        metadata = dict(context.invocation_metadata() or ())
        header = str(metadata.get("authorization", ""))
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated(
                "send the server's token as `authorization: Bearer <token>` metadata"
            )
        server_id = ""
        for known, owner in self._tokens.items():
            if hmac.compare_digest(known.encode(), token.strip().encode()):
                server_id = owner
        if not server_id:
            raise Unauthenticated("the token is not valid for any game server")
        return server_id

    async def Connect(self, request_iterator, context):  # type: ignore[no-untyped-def]
        server_id = self._authenticate(context)
        try:
            first = await context.read()
        except DecodeError:
            raise InvalidArgument(_UNDECODABLE + "; the first frame must be a hello") from None
        if first is grpc.aio.EOF:
            return
        if first.WhichOneof("frame") != "hello":
            raise InvalidArgument("the first frame of a connection must be a hello")
        check_hello(first.hello, server_id, PROTOCOL_VERSION)
        connection = Connection(server_id, uuid.uuid4().hex, first.hello)
        self._registry.add(connection)
        CONNECTIONS.set(len(self._registry))
        log.info(
            "game server connected",
            extra={
                "server_id": server_id,
                "session_id": connection.session_id,
                "tools": len(connection.tools),
            },
        )
        await context.write(
            gateway_pb2.ConnectResponse(
                welcome=gateway_pb2.Welcome(
                    session_id=connection.session_id,
                    protocol_version=PROTOCOL_VERSION,
                    max_text_chars=self._config.max_text_chars,
                )
            )
        )
        writer = asyncio.create_task(self._write(connection, context))
        try:
            while not writer.done():
                try:
                    frame = await context.read()
                except DecodeError:
                    # The bytes are consumed; the stream can go on, like any refused frame.
                    connection.send(
                        gateway_pb2.ConnectResponse(
                            error=gateway_pb2.FrameError(
                                code=_code_number("INVALID_ARGUMENT"), message=_UNDECODABLE
                            )
                        )
                    )
                    continue
                if frame is grpc.aio.EOF:
                    # Half-closed: answer what is in progress, then end the stream.
                    running = [r.task for r in connection.running.values()]
                    await asyncio.gather(*running, return_exceptions=True)
                    break
                self._dispatch(connection, frame)
        finally:
            connection.close()
            for player in connection.players.values():
                self._players.forget(player, router_pb2.CLEAR_REASON_DISCONNECTED)
            self._registry.remove(connection)
            CONNECTIONS.set(len(self._registry))
            PLAYERS.set(self._registry.players())
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer
            log.info("game server disconnected", extra={"server_id": server_id})

    @staticmethod
    async def _write(connection: Connection, context: grpc.aio.ServicerContext) -> None:
        while True:
            frame = await connection.outbox.get()
            if frame is None:
                return
            await context.write(frame)

    def _dispatch(self, connection: Connection, frame: gateway_pb2.ConnectRequest) -> None:
        """Handles one frame after the hello; a bad frame is answered with a FrameError."""
        kind = frame.WhichOneof("frame")
        if kind == "request":
            request_id = frame.request.request_id
        elif kind == "event":
            request_id = frame.event.event_key  # what the game server knows the event by
        else:
            request_id = ""
        try:
            if kind == "presence":
                self._presence(connection, frame.presence)
            elif kind == "request":
                self._request(connection, frame.request)
            elif kind == "tool_result":
                self._tool_result(connection, frame.tool_result)
            elif kind == "event":
                self._event(connection, frame.event)
            elif kind == "hello":
                raise FailedPrecondition("this connection already sent its hello")
            else:
                raise InvalidArgument(
                    "empty or unknown frame type; protocol 1 frames are hello, presence, request, "
                    "tool_result and event"
                )
        except ServiceError as exc:
            log.info("frame refused: %s", exc.message, extra={"server_id": connection.server_id})
            connection.send(
                gateway_pb2.ConnectResponse(
                    error=gateway_pb2.FrameError(
                        request_id=request_id[:64], code=_code_number(exc.code), message=exc.message
                    )
                )
            )

    def _presence(self, connection: Connection, presence: gateway_pb2.PlayerPresence) -> None:
        check_presence(presence)
        player_id = presence.player_id
        known = player_id in connection.players
        if presence.kind == gateway_pb2.PRESENCE_KIND_LEAVE:
            if not known:
                raise NotFound(f"player {player_id} has not joined on this connection")
            connection.cancel_player(player_id)
            self._players.forget(
                connection.players.pop(player_id), router_pb2.CLEAR_REASON_DISCONNECTED
            )
            connection.states.pop(player_id, None)
        else:
            if presence.kind == gateway_pb2.PRESENCE_KIND_UPDATE and not known:
                raise NotFound(f"player {player_id} has not joined; send JOIN before UPDATE")
            if not known and len(connection.players) >= self._config.max_players_per_connection:
                raise ResourceExhausted(
                    f"this connection already has {self._config.max_players_per_connection} players"
                )
            joined = not known
            connection.players[player_id] = common_pb2.PlayerContext(
                server_id=connection.server_id,
                player_id=player_id,
                player_name=presence.player_name,
                language=normalize_language(presence.language),
                permission_level=presence.permission_level,
                features=connection.features,
            )
            if joined:
                self._players.resume_tasks(connection.players[player_id])
        PLAYERS.set(self._registry.players())

    def _event(self, connection: Connection, event: gateway_pb2.GameEvent) -> None:
        check_event(event)
        player = connection.players.get(event.player_id)
        online = player is not None
        if player is None:
            # Not on this connection: the task waits until the player joins (here or on any
            # server), under the connection's features and no operator level.
            player = common_pb2.PlayerContext(
                server_id=connection.server_id,
                player_id=event.player_id,
                features=connection.features,
            )

        def refused(code: grpc.StatusCode, message: str) -> None:
            connection.send(
                gateway_pb2.ConnectResponse(
                    error=gateway_pb2.FrameError(
                        request_id=event.event_key[:64], code=code.value[0], message=message
                    )
                )
            )

        self._players.submit_event(player, event, online, refused)

    def _request(self, connection: Connection, request: gateway_pb2.PlayerRequest) -> None:
        check_id("request.request_id", request.request_id)
        if request.request_id in connection.running:
            raise AlreadyExists(f"request {request.request_id} is already in progress")
        player = connection.players.get(request.player_id)
        if player is None:
            raise NotFound(
                f"player {request.player_id!r} has not joined on this connection; send a JOIN presence first"
            )
        kind = request.WhichOneof("body")
        if kind is None:
            raise InvalidArgument(
                "the request has no body; set one of chat, invoke, control, preferences, card_action"
            )
        if kind == "chat":
            text = request.chat.text
            if not text.strip():
                raise InvalidArgument("chat.text is empty")
            if len(text) > self._config.max_text_chars:
                raise InvalidArgument(
                    f"chat.text has {len(text)} characters; the limit is {self._config.max_text_chars}"
                )
        elif kind == "invoke" and not request.invoke.call.module_id:
            raise InvalidArgument("invoke.call.module_id is required")
        elif kind == "control" and request.control.action not in _CONTROL_ACTIONS:
            raise InvalidArgument("control.action must be STATE, CANCEL, HISTORY or CLEAR_HISTORY")
        elif kind == "card_action" and not request.card_action.action_id:
            raise InvalidArgument("card_action.action_id is required")
        if len(connection.running) >= self._config.max_pending_requests:
            raise ResourceExhausted(
                f"{self._config.max_pending_requests} requests are already in progress on this connection"
            )
        if kind == "control" and request.control.action == gateway_pb2.CONTROL_ACTION_CANCEL:
            connection.cancel_player(player.player_id)
            self._players.cancel_runs(player)
        others = connection.running_for(player.player_id)
        busy = others[0].request_id if others else ""
        task = asyncio.create_task(self._serve(connection, player, request, busy))
        connection.running[request.request_id] = RunningRequest(
            request.request_id, player.player_id, task
        )
        task.add_done_callback(lambda done: self._finished(connection, player, request, done))

    async def _serve(
        self,
        connection: Connection,
        player: common_pb2.PlayerContext,
        request: gateway_pb2.PlayerRequest,
        busy: str,
    ) -> None:
        with request_scope(new_request_id(), self._config.request_timeout_seconds):
            try:
                state = connection.states.setdefault(player.player_id, PlayerState())
                response = await self._players.handle(player, request, busy, state)
            except asyncio.CancelledError:
                response = _failure_response(player, request, AgentFailure.CANCELLED, "cancelled")
            except Exception:
                log.exception("request %s failed", request.request_id)
                response = _failure_response(
                    player, request, AgentFailure.MODULE_FAILED, "internal error"
                )
            connection.send(gateway_pb2.ConnectResponse(response=response))

    @staticmethod
    def _finished(
        connection: Connection,
        player: common_pb2.PlayerContext,
        request: gateway_pb2.PlayerRequest,
        task: asyncio.Task[None],
    ) -> None:
        """Runs however the request's task ended, even when it was cancelled before it started
        (then `_serve` never ran): the request leaves the running set and is always answered."""
        connection.running.pop(request.request_id, None)
        if task.cancelled():
            response = _failure_response(player, request, AgentFailure.CANCELLED, "cancelled")
            connection.send(gateway_pb2.ConnectResponse(response=response))

    def _tool_result(self, connection: Connection, result: gateway_pb2.ToolResult) -> None:
        future = connection.tool_calls.pop(result.call_id, None)
        if future is None:
            raise NotFound(f"no game-tool call {result.call_id!r} is waiting (late or unknown)")
        if not future.done():
            future.set_result(result)


def _failure_response(
    player: common_pb2.PlayerContext,
    request: gateway_pb2.PlayerRequest,
    failure: AgentFailure,
    message: str,
) -> gateway_pb2.PlayerResponse:
    return gateway_pb2.PlayerResponse(
        request_id=request.request_id,
        player_id=player.player_id,
        reply=gateway_pb2.Reply(result=failed(failure, message)),
    )
