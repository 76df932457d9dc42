"""State of one game server's connection: its players, its outbound frames, the player
requests in progress and the game-tool calls waiting for an answer."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

from services.gateway.players import PlayerState
from services.runtime.errors import AlreadyExists, NotFound, Unavailable

__all__ = ["Connection", "ConnectionRegistry"]

log = logging.getLogger("system.gateway.connection")


@dataclasses.dataclass
class RunningRequest:
    """A player request in progress."""

    request_id: str
    player_id: str
    task: asyncio.Task[None]


class Connection:
    """One open Connect stream."""

    def __init__(self, server_id: str, session_id: str, hello: gateway_pb2.Hello) -> None:
        self.server_id = server_id
        self.session_id = session_id
        self.features = tuple(hello.features)
        self.tools = {tool.name: tool for tool in hello.tools}
        self.players: dict[str, common_pb2.PlayerContext] = {}
        self.states: dict[str, PlayerState] = {}
        self.outbox: asyncio.Queue[gateway_pb2.ConnectResponse | None] = asyncio.Queue()
        self.running: dict[str, RunningRequest] = {}
        self.tool_calls: dict[str, asyncio.Future[gateway_pb2.ToolResult]] = {}
        self.closed = False

    def send(self, frame: gateway_pb2.ConnectResponse) -> None:
        if not self.closed:
            self.outbox.put_nowait(frame)

    def running_for(self, player_id: str) -> list[RunningRequest]:
        return [r for r in self.running.values() if r.player_id == player_id]

    def cancel_player(self, player_id: str) -> int:
        """Cancels the player's requests in progress; returns how many."""
        doomed = self.running_for(player_id)
        for request in doomed:
            request.task.cancel()
        return len(doomed)

    def close(self) -> None:
        """Cancels everything in progress; waiting tool calls fail with UNAVAILABLE."""
        self.closed = True
        for request in list(self.running.values()):
            request.task.cancel()
        for future in self.tool_calls.values():
            if not future.done():
                future.set_exception(Unavailable(f"game server {self.server_id} disconnected"))
        self.outbox.put_nowait(None)


class ConnectionRegistry:
    """Open connections by server id, and which connection each player is on."""

    def __init__(self) -> None:
        self._by_server: dict[str, Connection] = {}

    def add(self, connection: Connection) -> None:
        if connection.server_id in self._by_server:
            raise AlreadyExists(
                f"server {connection.server_id} already has an open connection; close it first"
            )
        self._by_server[connection.server_id] = connection

    def remove(self, connection: Connection) -> None:
        if self._by_server.get(connection.server_id) is connection:
            del self._by_server[connection.server_id]

    def __len__(self) -> int:
        return len(self._by_server)

    def players(self) -> int:
        return sum(len(c.players) for c in self._by_server.values())

    def for_player(self, player_id: str) -> Connection:
        for connection in self._by_server.values():
            if player_id in connection.players:
                return connection
        raise NotFound(f"player {player_id} is not connected")
