"""State of one game server's connection: its players, its outbound frames, the player
requests in progress and the game-tool calls waiting for an answer; and the registry of open
connections and of which connection each (scoped) player is attached to."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging

from prometheus_client import Counter
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

from services.gateway.card_books import CardBookStore
from services.gateway.players import PlayerState
from services.runtime.errors import Unavailable

__all__ = ["Connection", "ConnectionRegistry", "PendingCall", "RunningRequest"]

log = logging.getLogger("system.gateway.connection")

NOTICES_DROPPED = Counter(
    "gateway_notices_dropped_total",
    "Notices dropped because their game server's outbox was full (oldest first).",
)
CONNECTIONS_ENDED = Counter(
    "gateway_connections_ended_total",
    "Game-server connections the gateway ended, by why.",
    ["reason"],
)


@dataclasses.dataclass
class RunningRequest:
    """A player request in progress."""

    request_id: str
    player_id: str
    """The game server's own id of the player."""
    task: asyncio.Task[None]
    work: bytes = b""
    """What a run-like request (chat, invoke, button) asks, serialized; empty for controls and
    preferences. Two alike may share one engine run; two different ones are BUSY."""


@dataclasses.dataclass
class PendingCall:
    """A game-tool call sent to the game server, waiting for its ToolResult."""

    future: asyncio.Future[gateway_pb2.ToolResult]
    player_id: str
    """The game server's own id of the player it runs for."""
    tool: str


@dataclasses.dataclass
class _Outgoing:
    frame: gateway_pb2.ConnectResponse
    size: int
    droppable: bool


class Connection:
    """One open Connect stream.

    Outbound frames wait in a bounded outbox (`outbox_frames` frames, `outbox_bytes` bytes)
    while the stream writes them. Notices (unsolicited, best effort) may be dropped: when the
    outbox is full the oldest waiting notice makes room, and a new notice finding none is
    dropped itself (`gateway_notices_dropped_total`). Any other frame (an answer, a tool call,
    a FrameError) is never dropped: when it finds no room, the connection ends
    RESOURCE_EXHAUSTED, since a game server that reads nothing cannot be served.
    """

    def __init__(
        self,
        server_id: str,
        session_id: str,
        hello: gateway_pb2.Hello,
        scope: str = "",
        outbox_frames: int = 1024,
        outbox_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.server_id = server_id
        self.session_id = session_id
        self.scope = scope or server_id
        self.features = tuple(hello.features)
        self.tools = {tool.name: tool for tool in hello.tools}
        self.unavailable_modules: tuple[str, ...] = ()
        """Modules this server's players cannot use: it lacks a game tool they need (the
        hello's tool check), for the PlayerContexts made on this connection."""
        self.players: dict[str, common_pb2.PlayerContext] = {}
        """Joined players by the game server's own id; their contexts carry the scoped id."""
        self.states: dict[str, PlayerState] = {}
        self.moved: collections.OrderedDict[str, str] = collections.OrderedDict()
        """Players who moved to another server of the network (own id → that server), so
        their later frames here are refused with a clear message. Bounded."""
        self.running: dict[str, RunningRequest] = {}
        self.tool_calls: dict[str, PendingCall] = {}
        self.closed = False
        self.ended: tuple[str, str] | None = None
        """(status code name, message) when the gateway ended the connection."""
        self.notices_dropped = 0
        self.card_books: CardBookStore | None = None
        """Where its players' card books are kept beyond the connection (decision 0030);
        None: in this connection alone. Set by the registry."""
        self._outbox: collections.deque[_Outgoing] = collections.deque()
        self._outbox_bytes = 0
        self._frames_limit = outbox_frames
        self._bytes_limit = outbox_bytes
        self._ready = asyncio.Event()
        self.done = asyncio.Event()
        """Set once the connection is closed, by the game server or by the gateway."""

    # -- outbound frames ---------------------------------------------------------------------

    def __len__(self) -> int:
        """Frames waiting to be written."""
        return len(self._outbox)

    @property
    def outbox_bytes(self) -> int:
        return self._outbox_bytes

    def send(self, frame: gateway_pb2.ConnectResponse, *, droppable: bool = False) -> bool:
        """Queues `frame` for the game server; False when it was dropped (a notice finding a
        full outbox) or the connection is closed. See the class docstring for the policy."""
        if self.closed:
            return False
        size = frame.ByteSize()
        while self._full(size):
            if not self._drop_oldest_notice():
                if droppable:
                    self._count_drop()
                    return False
                self.end(
                    "RESOURCE_EXHAUSTED",
                    f"the game server is not reading its frames: {len(self._outbox)} frames "
                    f"({self._outbox_bytes} bytes) wait to be written; reconnect and read "
                    "every frame as it arrives",
                )
                return False
        self._track_card(frame)
        self._outbox.append(_Outgoing(frame, size, droppable))
        self._outbox_bytes += size
        self._ready.set()
        return True

    def _track_card(self, frame: gateway_pb2.ConnectResponse) -> None:
        """Records the card an answer or notice shows (numbering its version: cards.py), so
        presses of its buttons can be checked, and closes the cards an answer closes."""
        if not frame.HasField("response"):
            return
        response = frame.response
        body = response.WhichOneof("body")
        if body == "reply":
            result = response.reply.result
        elif body == "notice":
            result = response.notice.result
        else:
            return
        state = self.player_state(response.player_id)
        for ref in response.reply.closes if body == "reply" else ():
            state.cards.close(ref.card_id)
        if result.HasField("card"):
            state.cards.show(result.card)

    def player_state(self, player_id: str) -> PlayerState:
        """What the gateway remembers of a joined player (by the game server's own id)."""
        state = self.states.get(player_id)
        if state is None:
            player = self.players.get(player_id)
            if self.card_books is not None and player is not None:
                state = PlayerState(cards=self.card_books.book(player.player_id))
            else:
                state = PlayerState()
            self.states[player_id] = state
        return state

    def _full(self, size: int) -> bool:
        return bool(self._outbox) and (
            len(self._outbox) >= self._frames_limit or self._outbox_bytes + size > self._bytes_limit
        )

    def _drop_oldest_notice(self) -> bool:
        for index, item in enumerate(self._outbox):
            if item.droppable:
                del self._outbox[index]
                self._outbox_bytes -= item.size
                self._count_drop()
                return True
        return False

    def _count_drop(self) -> None:
        self.notices_dropped += 1
        NOTICES_DROPPED.inc()

    async def next_frame(self) -> gateway_pb2.ConnectResponse | None:
        """The next frame to write; None once the connection is closed and every frame
        queued before was handed out."""
        while not self._outbox:
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        item = self._outbox.popleft()
        self._outbox_bytes -= item.size
        return item.frame

    # -- work in progress --------------------------------------------------------------------

    def running_for(self, player_id: str) -> list[RunningRequest]:
        return [r for r in self.running.values() if r.player_id == player_id]

    def cancel_player(self, player_id: str, reason: str = "") -> int:
        """Cancels the player's requests in progress and, with a `reason`, fails their game-tool
        calls waiting here UNAVAILABLE; returns how many requests."""
        doomed = self.running_for(player_id)
        for request in doomed:
            request.task.cancel()
        if reason:
            for call_id, call in list(self.tool_calls.items()):
                if call.player_id == player_id:
                    del self.tool_calls[call_id]
                    if not call.future.done():
                        call.future.set_exception(Unavailable(reason))
        return len(doomed)

    def remember_move(self, player_id: str, server_id: str, limit: int) -> None:
        self.moved[player_id] = server_id
        self.moved.move_to_end(player_id)
        while len(self.moved) > limit:
            self.moved.popitem(last=False)

    def end(self, code: str, message: str) -> None:
        """Ends the connection from the gateway's side: the stream closes with `code` once its
        handler sees it (the first reason given is kept)."""
        if self.ended is None:
            self.ended = (code, message)
            CONNECTIONS_ENDED.labels(code).inc()
            log.warning(
                "ending a game server's connection: %s",
                message,
                extra={"server_id": self.server_id, "session_id": self.session_id, "code": code},
            )
        self.close()

    def close(self) -> None:
        """Cancels everything in progress; waiting tool calls fail with UNAVAILABLE."""
        if self.closed:
            return
        self.closed = True
        self.done.set()
        for request in list(self.running.values()):
            request.task.cancel()
        reason = (
            f"game server {self.server_id}'s connection was replaced by a newer one"
            if self.ended and self.ended[0] == "ABORTED"
            else f"game server {self.server_id} disconnected"
        )
        for call in self.tool_calls.values():
            if not call.future.done():
                call.future.set_exception(Unavailable(reason))
        self.tool_calls.clear()
        if self.ended is not None:  # nothing more is written to a stream the gateway ends
            self._outbox.clear()
            self._outbox_bytes = 0
        self._ready.set()


class ConnectionRegistry:
    """Open connections by server id, and the connection each scoped player is attached to."""

    def __init__(self, card_books: CardBookStore | None = None) -> None:
        self._by_server: dict[str, Connection] = {}
        self._attached: dict[str, Connection] = {}
        self.card_books = card_books
        """Where the connections' card books are kept (decision 0030), if anywhere."""

    def add(self, connection: Connection) -> Connection | None:
        """Registers `connection`; returns the older connection of the same server it
        replaces (the caller ends it), if one was still registered."""
        connection.card_books = self.card_books
        older = self._by_server.get(connection.server_id)
        self._by_server[connection.server_id] = connection
        return older

    def remove(self, connection: Connection) -> None:
        if self._by_server.get(connection.server_id) is connection:
            del self._by_server[connection.server_id]
        for player in connection.players.values():
            self.detach(player.player_id, connection)

    def server(self, server_id: str) -> Connection | None:
        return self._by_server.get(server_id)

    def connections(self) -> list[Connection]:
        """Every open connection (a notice to every game server)."""
        return list(self._by_server.values())

    def attach(self, scoped_id: str, connection: Connection) -> Connection | None:
        """Attaches the player to `connection`; returns the other connection they were
        attached to (a move within a network, or a replaced connection), if any."""
        before = self._attached.get(scoped_id)
        self._attached[scoped_id] = connection
        return before if before is not connection else None

    def detach(self, scoped_id: str, connection: Connection) -> None:
        """Ends the attachment, if the player is still attached to `connection`."""
        if self._attached.get(scoped_id) is connection:
            del self._attached[scoped_id]

    def attached(self, scoped_id: str) -> Connection | None:
        return self._attached.get(scoped_id)

    def __len__(self) -> int:
        return len(self._by_server)

    def players(self) -> int:
        return len(self._attached)

    def pending(self) -> int:
        """Player requests in progress on every connection."""
        return sum(len(connection.running) for connection in self._by_server.values())
