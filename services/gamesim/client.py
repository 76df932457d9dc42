"""A game server's side of the gateway protocol, in Python. A Java plugin does the same with
stubs generated from protos/system/gateway/v1/gateway.proto."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from services.gamesim.world import World
from services.runtime.keepalive import KeepalivePolicy

__all__ = ["FrameRefused", "GameServerClient", "GatewayRefused"]

log = logging.getLogger("system.gamesim")
PROTOCOL_VERSION = 1
CLOSE_DRAIN_SECONDS = 5.0
"""Longest `GameServerClient.close` waits for requests in flight before half-closing."""
HELLO_RACE_ATTEMPTS = 3
"""Connections tried when the gateway's refusal raced the hello (see `connect`)."""
CORE_WRITE_RACE = "Internal error from Core"
"""What grpc reports, instead of the server's status, for a write on a stream the server
has just ended (the gateway's own INTERNAL reads otherwise)."""


class GatewayRefused(Exception):
    """The gateway ended the connection with a status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class FrameRefused(Exception):
    """The gateway refused one of our frames with a FrameError."""

    def __init__(self, error: gateway_pb2.FrameError) -> None:
        self.code = next(
            (c for c in grpc.StatusCode if c.value[0] == error.code), grpc.StatusCode.UNKNOWN
        )
        super().__init__(f"{self.code.name}: {error.message}")
        self.error = error
        self.message = error.message


class GameServerClient:
    """One connection to the gateway, multiplexing any number of players.

    Args:
        target: the gateway's `host:port`.
        server_id: this game server's id.
        token: its token.
        world: game state the tools act on.
        tls_ca: PEM of the CA to trust: connect over TLS. None: plaintext.
        keepalive: ping policy of the connection (the stack's one policy by default).
    """

    def __init__(
        self,
        target: str,
        server_id: str,
        token: str,
        world: World | None = None,
        features: tuple[str, ...] = (),
        *,
        tls_ca: bytes | None = None,
        keepalive: KeepalivePolicy | None = None,
    ) -> None:
        self.tls_ca = tls_ca
        self.keepalive = keepalive or KeepalivePolicy()
        self.target = target
        self.server_id = server_id
        self.token = token
        self.world = world or World()
        self.features = features
        self.welcome: gateway_pb2.Welcome | None = None
        self.frame_errors: list[gateway_pb2.FrameError] = []
        self.notices: asyncio.Queue[gateway_pb2.PlayerResponse] = asyncio.Queue()
        self.ended: GatewayRefused | None = None
        """How the gateway ended the stream, once it did (ABORTED: a newer connection of this
        server replaced it; reconnect only if that was not us)."""
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future[gateway_pb2.PlayerResponse]] = {}
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._closed: asyncio.Future[None] | None = None
        # grpc.aio allows one write in flight per stream; a second concurrent write fails the
        # whole call (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS). Players' requests and tool results
        # are written from different tasks, so every write takes this lock.
        self._write_lock = asyncio.Lock()

    async def connect(self, timeout: float = 10.0) -> gateway_pb2.Welcome:
        """Opens the stream and sends the hello. Raises GatewayRefused if refused."""
        for _ in range(HELLO_RACE_ATTEMPTS - 1):
            try:
                return await self._connect_once(timeout)
            except GatewayRefused as exc:
                if exc.code != grpc.StatusCode.INTERNAL or exc.details != CORE_WRITE_RACE:
                    raise
                # The gateway refused the stream while the hello was on its way out: grpc
                # then reports only its own INTERNAL, not why. Asking again tells.
        return await self._connect_once(timeout)

    async def _connect_once(self, timeout: float) -> gateway_pb2.Welcome:
        # A plugin's settings: the stack's keepalive policy (services.runtime.keepalive), and
        # TLS when the gateway's public port serves it.
        options = self.keepalive.channel_options()
        if self.tls_ca is not None:
            self._channel = grpc.aio.secure_channel(
                self.target, grpc.ssl_channel_credentials(self.tls_ca), options=options
            )
        else:
            self._channel = grpc.aio.insecure_channel(self.target, options=options)
        stub = gateway_pb2_grpc.GameGatewayServiceStub(self._channel)
        self._call = stub.Connect(metadata=(("authorization", f"Bearer {self.token}"),))
        hello = gateway_pb2.Hello(
            server_id=self.server_id,
            protocol_version=PROTOCOL_VERSION,
            # The world's own features (FTB Quests, by default) and any the caller adds.
            features=list(dict.fromkeys((*self.features, *self.world.features))),
            tools=self.world.hello_tools(),
            software="system-gamesim/0.1",
        )
        try:
            await self._call.write(gateway_pb2.ConnectRequest(hello=hello))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # The gateway ended the stream before the hello left (a refused token, say): grpc
            # then reports the write as INTERNAL ("Internal error from Core") or a finished
            # RPC, and the call's own status says why.
            async with asyncio.timeout(timeout):
                code, details = await self._call.code(), await self._call.details()
            await self.close()
            raise GatewayRefused(code, details or "") from None
        try:
            first = await asyncio.wait_for(self._call.read(), timeout)
        except grpc.aio.AioRpcError as exc:
            await self.close()
            raise GatewayRefused(exc.code(), exc.details() or "") from None
        if first is grpc.aio.EOF or first.WhichOneof("frame") != "welcome":
            await self.close()
            raise GatewayRefused(grpc.StatusCode.UNKNOWN, "the gateway did not welcome the hello")
        self.welcome = first.welcome
        self._closed = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read())
        return self.welcome

    async def send(self, frame: gateway_pb2.ConnectRequest) -> None:
        """Writes one frame. Raises GatewayRefused (UNAVAILABLE) when the stream has ended
        under it: the frame never left, as a plugin finds its connection down."""
        async with self._write_lock:
            try:
                await self._call.write(frame)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                # grpc raises INTERNAL ("Internal error from Core") or InvalidStateError for a
                # write on a stream whose gateway has just gone, before the reader saw the end.
                raise GatewayRefused(
                    grpc.StatusCode.UNAVAILABLE, f"the connection ended before the write: {exc}"
                ) from None

    async def join(
        self, player_id: str, name: str, language: str = "en_us", permission_level: int = 0
    ) -> None:
        self.world.join(player_id, name)  # play time runs from here, as on a game server
        await self.send(
            gateway_pb2.ConnectRequest(
                presence=gateway_pb2.PlayerPresence(
                    kind=gateway_pb2.PRESENCE_KIND_JOIN,
                    player_id=player_id,
                    player_name=name,
                    language=language,
                    permission_level=permission_level,
                )
            )
        )

    async def update(self, player_id: str, language: str, permission_level: int = 0) -> None:
        await self.send(
            gateway_pb2.ConnectRequest(
                presence=gateway_pb2.PlayerPresence(
                    kind=gateway_pb2.PRESENCE_KIND_UPDATE,
                    player_id=player_id,
                    language=language,
                    permission_level=permission_level,
                )
            )
        )

    async def leave(self, player_id: str) -> None:
        self.world.leave(player_id)
        await self.send(
            gateway_pb2.ConnectRequest(
                presence=gateway_pb2.PlayerPresence(
                    kind=gateway_pb2.PRESENCE_KIND_LEAVE, player_id=player_id
                )
            )
        )

    async def event(
        self, player_id: str, event_type: str, event_key: str, data: dict[str, Any]
    ) -> None:
        """Reports a game event (an advancement, say). Not answered unless refused: a refusal
        arrives as a FrameError (in `frame_errors`) whose request id is the event key."""
        payload = struct_pb2.Struct()
        payload.update(data)
        await self.send(
            gateway_pb2.ConnectRequest(
                event=gateway_pb2.GameEvent(
                    player_id=player_id, event_type=event_type, event_key=event_key, data=payload
                )
            )
        )

    async def request(
        self, player_id: str, timeout: float = 30.0, **body: Any
    ) -> gateway_pb2.PlayerResponse:
        """Sends a PlayerRequest with `body` (e.g. chat=Chat(text=...)) and waits for its answer.

        Raises:
            FrameRefused: the gateway refused the frame.
            GatewayRefused: the connection ended.
        """
        request_id = f"r{next(self._ids)}"
        future: asyncio.Future[gateway_pb2.PlayerResponse] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[request_id] = future
        try:
            await self.send(
                gateway_pb2.ConnectRequest(
                    request=gateway_pb2.PlayerRequest(
                        request_id=request_id, player_id=player_id, **body
                    )
                )
            )
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(request_id, None)

    async def chat(
        self,
        player_id: str,
        text: str,
        timeout: float = 30.0,
        viewing: common_pb2.Card | None = None,
    ) -> gateway_pb2.PlayerResponse:
        """Sends chat text; `viewing`: the card the player is looking at while typing."""
        chat = gateway_pb2.Chat(text=text)
        if viewing is not None:
            chat.viewing.CopyFrom(viewing.ref)
        return await self.request(player_id, timeout, chat=chat)

    async def press(
        self, player_id: str, card: common_pb2.Card, button: common_pb2.CardButton
    ) -> gateway_pb2.PlayerResponse:
        return await self.request(
            player_id,
            card_action=gateway_pb2.CardAction(
                source=card.ref, action_id=button.action_id, args=button.args
            ),
        )

    async def control(
        self, player_id: str, action: gateway_pb2.ControlAction
    ) -> gateway_pb2.PlayerResponse:
        return await self.request(player_id, control=gateway_pb2.Control(action=action))

    async def _read(self) -> None:
        try:
            while True:
                frame = await self._call.read()
                if frame is grpc.aio.EOF:
                    self._fail_pending(
                        GatewayRefused(grpc.StatusCode.OK, "the gateway closed the stream")
                    )
                    return
                kind = frame.WhichOneof("frame")
                if kind == "response":
                    future = self._pending.get(frame.response.request_id)
                    if future is not None and not future.done():
                        future.set_result(frame.response)
                    else:
                        self.notices.put_nowait(frame.response)
                elif kind == "error":
                    self.frame_errors.append(frame.error)
                    future = self._pending.get(frame.error.request_id)
                    if future is not None and not future.done():
                        future.set_exception(FrameRefused(frame.error))
                elif kind == "tool_call":
                    await self.send(self._run_tool(frame.tool_call))
        except grpc.aio.AioRpcError as exc:
            self.ended = GatewayRefused(exc.code(), exc.details() or "")
            self._fail_pending(self.ended)
        except Exception as exc:  # noqa: BLE001 - a tool result that could not be written
            self.ended = GatewayRefused(grpc.StatusCode.UNAVAILABLE, f"the stream broke: {exc!r}")
            self._fail_pending(self.ended)
        finally:
            if self._closed is not None and not self._closed.done():
                self._closed.set_result(None)

    def _run_tool(self, call: gateway_pb2.ToolCall) -> gateway_pb2.ConnectRequest:
        result = gateway_pb2.ToolResult(call_id=call.call_id)
        try:
            output = self.world.call_with_id(
                call.player_id, call.tool, json_format.MessageToDict(call.input), call.call_id
            )
            result.output.update(output)
        except ValueError as exc:
            result.failure.CopyFrom(
                common_pb2.Failure(key="system.error.invalid_input", message=str(exc))
            )
        return gateway_pb2.ConnectRequest(tool_result=result)

    def _fail_pending(self, exc: Exception) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)

    async def wait_closed(self) -> None:
        if self._closed is not None:
            await self._closed

    async def close(self) -> None:
        """Lets the requests in flight finish (at most CLOSE_DRAIN_SECONDS: their tool calls
        need this side of the stream open), half-closes the stream, lets the gateway finish,
        and closes the channel; a request still unanswered then fails GatewayRefused."""
        pending = [f for f in self._pending.values() if not f.done()]
        if pending and self._call is not None:
            await asyncio.wait(pending, timeout=CLOSE_DRAIN_SECONDS)
        if self._call is not None:
            with contextlib.suppress(Exception):
                async with self._write_lock:
                    await self._call.done_writing()
        if self._reader is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._reader, 5.0)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        self._fail_pending(
            GatewayRefused(grpc.StatusCode.UNAVAILABLE, "the game server closed its connection")
        )
