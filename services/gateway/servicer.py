"""The gateway's public gRPC service: the game servers' Connect stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import Counter, Gauge
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from system.router.v1 import router_pb2

from services.gateway.config import PROTOCOL_VERSION, GatewayConfig
from services.gateway.connection import Connection, ConnectionRegistry, RunningRequest
from services.gateway.players import PlayerRequests, PlayerState
from services.gateway.presence import PresenceReporter
from services.gateway.scopes import PlayerScopes, split
from services.gateway.tokens import TokenBook
from services.gateway.tool_contract import ContractCheck, check_tools
from services.gateway.validation import (
    MAX_INPUT_BYTES,
    MAX_NAME,
    check_card_action,
    check_event,
    check_hello,
    check_id,
    check_presence,
    check_struct,
    check_tool_result,
    normalize_language,
    shown,
)
from services.results import AgentFailure, failed
from services.runtime import tracing
from services.runtime.context import new_request_id, request_scope
from services.runtime.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
)
from services.runtime.logging import RepeatedLines

__all__ = ["GatewayServicer"]

log = logging.getLogger("system.gateway")

ARRIVAL_SECONDS = 2.0
"""Longest an event or a task resume of a player who just joined waits for storage to name
this replica for them; then it goes on anyway (storage slow or down)."""
CONNECTIONS = Gauge("gateway_connections", "Game servers connected now.")
PLAYERS = Gauge("gateway_players", "Players joined on all connections now.")
FRAMES_REFUSED = Counter(
    "gateway_frames_refused_total", "Frames from game servers answered with a FrameError."
)
BUSY_AT_GATEWAY = Counter(
    "gateway_busy_total",
    "Player requests answered BUSY by the gateway before routing (another request of the "
    "player in progress).",
)
_CONTROL_ACTIONS = set(gateway_pb2.ControlAction.values()) - {
    gateway_pb2.CONTROL_ACTION_UNSPECIFIED
}
_RUN_LIKE = ("chat", "invoke", "card_action")
_ENDED = {"ABORTED": Aborted, "RESOURCE_EXHAUSTED": ResourceExhausted}

_UNDECODABLE = "a frame could not be decoded as a ConnectRequest (corrupt or truncated protobuf)"
_BUSY = "another request of yours is in progress; try again when it has been answered"


def _code_number(code_name: str) -> int:
    return int(getattr(grpc.StatusCode, code_name).value[0])


class GatewayServicer(gateway_pb2_grpc.GameGatewayServiceServicer):
    """Accepts game servers' connections and serves their players."""

    def __init__(
        self,
        config: GatewayConfig,
        registry: ConnectionRegistry,
        players: PlayerRequests,
        presence: PresenceReporter | None = None,
    ) -> None:
        self._config = config
        self._reporter = presence
        """Records in storage which players this replica holds (decision 0023)."""
        if presence is not None:
            presence.on_taken = self._taken_elsewhere
        self._tokens = TokenBook(config.tokens, config.tokens_file)
        self._scopes = PlayerScopes(config.player_scopes())
        self._registry = registry
        self._players = players
        self._tasks: set[asyncio.Task[None]] = set()
        # Refused frames and BUSY answers can come thousands a second: one line per kind
        # per 10 s, with how many were left out.
        self._repeated = RepeatedLines(log)

    async def _check_tools(self, connection: Connection, hello: gateway_pb2.Hello) -> ContractCheck:
        """Checks the hello's tools against the engine's game-tool catalogue
        (services.gateway.tool_contract): refused tools leave the connection's tool set, the
        modules needing them become unavailable to its players, and the problems are logged
        once. Without the catalogue (engine unreachable) the tools are taken as offered; the
        engine still checks every answer."""
        catalogue = await self._players.game_tool_catalog()
        if catalogue is None:
            return ContractCheck((), frozenset(), ())
        checked = check_tools(hello.tools, catalogue, hello.features)
        for name in checked.refused:
            connection.tools.pop(name, None)
        connection.unavailable_modules = checked.unavailable_modules
        if checked.problems:
            log.warning(
                "game server %s: %d game-tool problem(s); unavailable modules: %s; %s",
                connection.server_id,
                len(checked.problems),
                ", ".join(checked.unavailable_modules) or "none",
                shown(" | ".join(f"{p.tool}: {p.problem}" for p in checked.problems), 4096),
                extra={"server_id": connection.server_id},
            )
        return checked

    def _authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        metadata = dict(context.invocation_metadata() or ())
        header = str(metadata.get("authorization", ""))
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated(
                "send the server's token as `authorization: Bearer <token>` metadata"
            )
        server_id = self._tokens.server_of(token.strip())
        if not server_id:
            raise Unauthenticated("the token is not valid for any game server")
        return server_id

    # Reads and writes the stream through `context` (grpc.aio), which the generated base's
    # iterator-returning signature does not describe.
    async def Connect(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[gateway_pb2.ConnectRequest],
        context: grpc.aio.ServicerContext[gateway_pb2.ConnectRequest, gateway_pb2.ConnectResponse],
    ) -> None:
        server_id = self._authenticate(context)
        timeout = self._config.hello_timeout_seconds
        try:
            first = await asyncio.wait_for(context.read(), timeout)
        except TimeoutError:
            raise DeadlineExceeded(
                f"no hello within {timeout:g} s of opening the stream; send the hello as the "
                "first frame"
            ) from None
        except DecodeError:
            raise InvalidArgument(_UNDECODABLE + "; the first frame must be a hello") from None
        # read() gives EOF when the client closed the stream; the stub leaves EOF out.
        if first is grpc.aio.EOF:  # type: ignore[comparison-overlap]
            return
        if first.WhichOneof("frame") != "hello":
            raise InvalidArgument("the first frame of a connection must be a hello")
        check_hello(first.hello, server_id, PROTOCOL_VERSION)
        connection = Connection(
            server_id,
            uuid.uuid4().hex,
            first.hello,
            scope=self._scopes.scope_of(server_id),
            outbox_frames=self._config.outbox_frames,
            outbox_bytes=self._config.outbox_bytes,
        )
        tool_check = await self._check_tools(connection, first.hello)
        older = self._registry.add(connection)
        if older is not None:
            # The newer wins: a stalled or half-dead link must not lock its server out. The
            # old stream ends ABORTED; its players are re-attached here as this one joins them.
            older.end(
                "ABORTED",
                f"replaced by a newer connection of server {server_id} "
                f"(session {connection.session_id})",
            )
        CONNECTIONS.set(len(self._registry))
        log.info(
            "game server connected",
            extra={
                "server_id": server_id,
                "session_id": connection.session_id,
                "tools": len(connection.tools),
                "replaced": older.session_id if older is not None else "",
            },
        )
        await context.write(
            gateway_pb2.ConnectResponse(
                welcome=gateway_pb2.Welcome(
                    session_id=connection.session_id,
                    protocol_version=PROTOCOL_VERSION,
                    max_text_chars=self._config.max_text_chars,
                    tool_problems=tool_check.problems,
                )
            )
        )
        writer = asyncio.create_task(self._write(connection, context))
        reader = asyncio.create_task(self._read(connection, context))
        ended = asyncio.create_task(connection.done.wait())
        try:
            await asyncio.wait((writer, reader, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, ended):
                task.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await task
            connection.close()
            for player in connection.players.values():
                self._players.forget(player, router_pb2.CLEAR_REASON_DISCONNECTED)
            self._registry.remove(connection)
            for player in connection.players.values():
                self._left_replica(player.player_id)
            CONNECTIONS.set(len(self._registry))
            PLAYERS.set(self._registry.players())
            # Writes what is left, unless the gateway ended the stream (then its outbox is
            # empty). Never cancelled: a write cancelled while it waits for a stalled reader
            # leaves the stream unable to send its status. A stalled peer holds this one
            # frame until it reads, goes away, or misses its keepalive pings.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer
            log.info(
                "game server disconnected",
                extra={"server_id": server_id, "session_id": connection.session_id},
            )
        if connection.ended is not None:
            code, message = connection.ended
            raise _ENDED[code](message)

    async def _read(
        self, connection: Connection, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Handles frames until the game server half-closes (then answers what is in
        progress first) or the gateway ends the connection."""
        while not connection.closed:
            try:
                frame = await context.read()
            except DecodeError:
                # The bytes are consumed; the stream can go on, like any refused frame.
                self._refused(connection, "", "INVALID_ARGUMENT", _UNDECODABLE)
                continue
            if frame is grpc.aio.EOF:
                running = [r.task for r in connection.running.values()]
                await asyncio.gather(*running, return_exceptions=True)
                return
            self._dispatch(connection, frame)

    @staticmethod
    async def _write(connection: Connection, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        while True:
            frame = await connection.next_frame()
            if frame is None:
                return
            await context.write(frame)

    def _refused(self, connection: Connection, request_id: str, code: str, message: str) -> None:
        FRAMES_REFUSED.inc()
        self._repeated.log(
            logging.INFO,
            "frame_refused",
            "frame refused: %s",
            message,
            extra={"server_id": connection.server_id},
        )
        connection.send(
            gateway_pb2.ConnectResponse(
                error=gateway_pb2.FrameError(
                    request_id=request_id[:64], code=_code_number(code), message=message
                )
            )
        )

    def _dispatch(self, connection: Connection, frame: gateway_pb2.ConnectRequest) -> None:
        """Handles one frame after the hello; a bad frame is answered with a FrameError and
        touches nothing else."""
        kind = frame.WhichOneof("frame")
        if kind == "request":
            request_id = frame.request.request_id
        elif kind == "event":
            request_id = frame.event.event_key  # what the game server knows the event by
        elif kind == "tool_result":
            request_id = frame.tool_result.call_id
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
            self._refused(connection, request_id, exc.code, exc.message)

    # -- players -------------------------------------------------------------------------------

    def _moved(self, connection: Connection, player_id: str) -> None:
        """Refuses a frame for a player who moved to another server of the network."""
        elsewhere = connection.moved.get(player_id)
        if elsewhere is not None:
            raise FailedPrecondition(
                f"player {shown(player_id)} moved to server {elsewhere} of network "
                f"{connection.scope}; frames for them go there until they join here again"
            )

    def _presence(self, connection: Connection, presence: gateway_pb2.PlayerPresence) -> None:
        check_presence(presence, self._scopes.max_player_id(connection.server_id))
        player_id = presence.player_id
        known = player_id in connection.players
        if presence.kind == gateway_pb2.PRESENCE_KIND_LEAVE:
            if not known:
                self._moved(connection, player_id)
                raise NotFound(f"player {player_id} has not joined on this connection")
            connection.cancel_player(player_id)
            left = connection.players.pop(player_id)
            connection.states.pop(player_id, None)
            self._registry.detach(left.player_id, connection)
            self._left_replica(left.player_id)
            self._players.forget(left, router_pb2.CLEAR_REASON_DISCONNECTED)
        else:
            if presence.kind == gateway_pb2.PRESENCE_KIND_UPDATE and not known:
                self._moved(connection, player_id)
                raise NotFound(f"player {player_id} has not joined; send JOIN before UPDATE")
            if not known and len(connection.players) >= self._config.max_players_per_connection:
                raise ResourceExhausted(
                    f"this connection already has {self._config.max_players_per_connection} players"
                )
            player = common_pb2.PlayerContext(
                server_id=connection.server_id,
                player_id=self._scopes.scoped(connection.server_id, player_id),
                player_name=presence.player_name,
                language=normalize_language(presence.language),
                permission_level=presence.permission_level,
                features=connection.features,
                unavailable_modules=connection.unavailable_modules,
            )
            previous = connection.players.get(player_id)
            connection.players[player_id] = player
            if previous is not None and player.permission_level < previous.permission_level:
                # A level taken away holds at once: nothing of theirs runs on with the old
                # level, and the router forgets what it routed for them under it.
                connection.cancel_player(player_id, "the player's permission level went down")
                self._players.forget(player, router_pb2.CLEAR_REASON_PERMISSIONS_CHANGED)
            if not known:
                connection.moved.pop(player_id, None)
                before = self._registry.attach(player.player_id, connection)
                if self._reporter is not None:
                    # Takes the player over from any other replica they were attached to.
                    self._reporter.attached(player.player_id)
                if before is not None:
                    self._take_from(before, player_id, connection)
                self._players.resume_tasks(
                    player,
                    self._arrival(player.player_id),
                    staying=lambda: self._registry.attached(player.player_id) is connection,
                )
        PLAYERS.set(self._registry.players())

    def _arrival(self, scoped_id: str) -> Awaitable[bool] | None:
        """Done once storage names this replica for the player (at most ARRIVAL_SECONDS):
        an event task queued before that would not find them, and wait for a join that
        already happened."""
        if self._reporter is None:
            return None
        return self._reporter.written(scoped_id, ARRIVAL_SECONDS)

    def _left_replica(self, scoped_id: str) -> None:
        """The player's attachment here ended: unless another connection of this replica has
        them, storage stops naming this replica for them."""
        if self._reporter is not None and self._registry.attached(scoped_id) is None:
            self._reporter.detached(scoped_id)

    def _taken_elsewhere(self, scoped_ids: list[str]) -> None:
        """Storage says these players joined on another gateway replica since they joined
        here (their game server reconnected there while its stream here has not ended yet,
        or they moved within their network): their attachment here ends as it would for a
        newer connection on this replica, and the engine's calls for them go there."""
        for scoped_id in scoped_ids:
            connection = self._registry.attached(scoped_id)
            parts = split(scoped_id)
            if connection is None or parts is None:
                continue
            player_id = parts[1]
            connection.cancel_player(
                player_id, f"player {shown(player_id)} joined on another gateway replica"
            )
            connection.players.pop(player_id, None)
            connection.states.pop(player_id, None)
            self._registry.detach(scoped_id, connection)
            log.info(
                "player taken over by another gateway replica",
                extra={"server_id": connection.server_id, "session_id": connection.session_id},
            )
        PLAYERS.set(self._registry.players())

    def _take_from(self, before: Connection, player_id: str, now: Connection) -> None:
        """The player joined on `now` while attached to `before` (another server of their
        network, or an older connection of the same server): that attachment ends, its
        requests and tool calls for the player are cancelled, and a server they left
        refuses their later frames."""
        moved = before.server_id != now.server_id
        reason = (
            f"player {shown(player_id)} moved to server {now.server_id}"
            if moved
            else f"player {shown(player_id)} joined on a newer connection"
        )
        before.cancel_player(player_id, reason)
        old = before.players.pop(player_id, None)
        before.states.pop(player_id, None)
        if moved:
            before.remember_move(player_id, now.server_id, self._config.max_players_per_connection)
            log.info(
                "player moved within network %s",
                now.scope,
                extra={"from_server": before.server_id, "to_server": now.server_id},
            )
        if old is not None:
            self._players.forget(old, router_pb2.CLEAR_REASON_DISCONNECTED)

    def _event(self, connection: Connection, event: gateway_pb2.GameEvent) -> None:
        check_event(event, self._scopes.max_player_id(connection.server_id))
        player = connection.players.get(event.player_id)
        online = player is not None
        if player is None:
            self._moved(connection, event.player_id)
            scoped = self._scopes.scoped(connection.server_id, event.player_id)
            elsewhere = self._registry.attached(scoped)
            if elsewhere is not None and elsewhere.server_id != connection.server_id:
                raise FailedPrecondition(
                    f"player {shown(event.player_id)} is on server {elsewhere.server_id} of "
                    f"network {connection.scope}; their events come from there"
                )
            # Not online: the task waits until the player joins (on this server, or on any
            # server of its network), under the connection's features and no operator level.
            player = common_pb2.PlayerContext(
                server_id=connection.server_id,
                player_id=scoped,
                features=connection.features,
                unavailable_modules=connection.unavailable_modules,
            )

        def refused(code: grpc.StatusCode, message: str) -> None:
            self._refused(connection, event.event_key, code.name, shown(message, 1024))

        # An online player's standing is what this connection keeps of them; an offline
        # player's is read for the event.
        state = connection.player_state(event.player_id) if online else PlayerState()
        self._players.submit_event(
            player,
            event,
            online,
            refused,
            self._arrival(player.player_id) if online else None,
            state,
            staying=lambda: not connection.closed,
        )

    # -- requests --------------------------------------------------------------------------------

    def _check_body(self, request: gateway_pb2.PlayerRequest, kind: str | None) -> None:
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
        elif kind == "invoke":
            if not request.invoke.call.module_id:
                raise InvalidArgument("invoke.call.module_id is required")
            check_id("invoke.call.module_id", request.invoke.call.module_id, MAX_NAME)
            check_struct("invoke.call.input", request.invoke.call.input, MAX_INPUT_BYTES)
        elif kind == "control" and request.control.action not in _CONTROL_ACTIONS:
            raise InvalidArgument("control.action must be STATE, CANCEL, HISTORY or CLEAR_HISTORY")
        elif kind == "preferences" and (
            request.preferences.HasField("mode")
            and request.preferences.mode not in common_pb2.ConversationMode.values()
        ):
            raise InvalidArgument(
                "preferences.mode must be OFFLINE, STANDARD, EXTENDED, FREE, or UNSPECIFIED "
                "(follow the server's default)"
            )
        elif kind == "card_action":
            if not request.card_action.action_id:
                raise InvalidArgument("card_action.action_id is required")
            check_card_action(request.card_action)

    def _request(self, connection: Connection, request: gateway_pb2.PlayerRequest) -> None:
        check_id("request.request_id", request.request_id)
        if request.request_id in connection.running:
            raise AlreadyExists(f"request {request.request_id} is already in progress")
        player = connection.players.get(request.player_id)
        if player is None:
            self._moved(connection, request.player_id)
            raise NotFound(
                f"player {shown(request.player_id)!r} has not joined on this connection; "
                "send a JOIN presence first"
            )
        kind = request.WhichOneof("body")
        self._check_body(request, kind)
        if len(connection.running) >= self._config.max_pending_requests:
            raise ResourceExhausted(
                f"{self._config.max_pending_requests} requests are already in progress on this connection"
            )
        # Runs only: a cancel or a state query must get through when the gateway is full.
        if (
            kind in _RUN_LIKE
            and self._registry.pending() >= self._config.max_pending_requests_total
        ):
            raise ResourceExhausted(
                f"the gateway has {self._config.max_pending_requests_total} requests in progress "
                "on all its game servers; retry shortly"
            )
        others = connection.running_for(request.player_id)
        work = b""
        if kind in _RUN_LIKE:
            # Admission before routing: one run per player at a time (the engine's rule), so
            # a different request while one runs is BUSY here, at once, without a router or
            # engine call. The same request again may share the run in progress (the engine
            # joins duplicates), so it goes on.
            work = kind.encode() + getattr(request, kind).SerializeToString(deterministic=True)
            if any(other.work and other.work != work for other in others):
                self._busy(connection, request)
                return
        if kind == "control" and request.control.action == gateway_pb2.CONTROL_ACTION_CANCEL:
            connection.cancel_player(request.player_id)
            self._players.cancel_runs(player)
        busy = next((other.request_id for other in others if other.work), "")
        task = asyncio.create_task(self._serve(connection, player, request, busy))
        connection.running[request.request_id] = RunningRequest(
            request.request_id, request.player_id, task, work
        )
        task.add_done_callback(lambda done: self._finished(connection, request, done))

    def _busy(self, connection: Connection, request: gateway_pb2.PlayerRequest) -> None:
        BUSY_AT_GATEWAY.inc()
        self._repeated.log(
            logging.INFO,
            "busy",
            "request answered BUSY before routing: the player has another in progress",
            extra={"server_id": connection.server_id},
        )
        connection.send(
            gateway_pb2.ConnectResponse(
                response=_failure_response(request, AgentFailure.BUSY, _BUSY)
            )
        )

    async def _serve(
        self,
        connection: Connection,
        player: common_pb2.PlayerContext,
        request: gateway_pb2.PlayerRequest,
        busy: str,
    ) -> None:
        with (
            request_scope(new_request_id(), self._config.request_timeout_seconds) as request_id,
            tracing.request_span(
                "gateway/PlayerRequest",
                {"system.request_id": request_id, "system.server_id": connection.server_id},
            ),
        ):
            try:
                state = connection.player_state(request.player_id)
                response = await self._players.handle(player, request, busy, state)
                response.player_id = request.player_id  # the game server's own id
            except asyncio.CancelledError:
                response = _failure_response(request, AgentFailure.CANCELLED, "cancelled")
            except Exception:
                log.exception("request %s failed", request.request_id)
                response = _failure_response(request, AgentFailure.MODULE_FAILED, "internal error")
            connection.send(gateway_pb2.ConnectResponse(response=response))

    @staticmethod
    def _finished(
        connection: Connection,
        request: gateway_pb2.PlayerRequest,
        task: asyncio.Task[None],
    ) -> None:
        """Runs however the request's task ended, even when it was cancelled before it started
        (then `_serve` never ran): the request leaves the running set and is always answered."""
        connection.running.pop(request.request_id, None)
        if task.cancelled():
            response = _failure_response(request, AgentFailure.CANCELLED, "cancelled")
            connection.send(gateway_pb2.ConnectResponse(response=response))

    # -- tool results ----------------------------------------------------------------------------

    def _tool_result(self, connection: Connection, result: gateway_pb2.ToolResult) -> None:
        check_id("tool_result.call_id", result.call_id)
        call = connection.tool_calls.pop(result.call_id, None)
        if call is None:
            raise NotFound(f"no game-tool call {result.call_id!r} is waiting (late or unknown)")
        try:
            check_tool_result(result)
        except InvalidArgument as exc:
            # This call alone fails: its caller hears why; nothing else on the relay does.
            tool = connection.tools.get(call.tool)
            failure = (
                AgentFailure.MODULE_FAILED
                if tool is not None and tool.read_only
                else AgentFailure.EFFECT_UNKNOWN
            )
            if not call.future.done():
                call.future.set_result(
                    gateway_pb2.ToolResult(
                        call_id=result.call_id,
                        failure=common_pb2.Failure(
                            key=failure.value,
                            message=f"game server {connection.server_id} answered {call.tool} "
                            f"with an answer the gateway refused: {exc.message}",
                        ),
                    )
                )
            raise
        if not call.future.done():
            call.future.set_result(result)


def _failure_response(
    request: gateway_pb2.PlayerRequest, failure: AgentFailure, message: str
) -> gateway_pb2.PlayerResponse:
    return gateway_pb2.PlayerResponse(
        request_id=request.request_id,
        player_id=request.player_id,
        reply=gateway_pb2.Reply(result=failed(failure, message)),
    )
