"""What the engine calls: the storage service (runs begun and finished, history pages) and
the gateway's tool relay."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2
from google.protobuf.message import Message
from system.common.v1 import common_pb2
from system.relay.v1 import relay_pb2
from system.storage.v1 import journal_pb2, journal_pb2_grpc, storage_pb2, storage_pb2_grpc

from engine_service.relay_routes import RelayRoutes
from engine_service.runs import RunStart
from services.results import AgentFailure, ModuleFailure, NotDelivered, failure_text
from services.runtime.channels import ChannelSettings, Dependency
from services.runtime.errors import ResourceExhausted, Unavailable, never_sent
from services.runtime.logging import RepeatedLines
from services.runtime.multiplex import StreamedCalls
from services.texts import pick

__all__ = ["NOT_OFFERED", "GatewayGameTools", "JournalRuns", "JournalStream", "StorageHistory"]

_JOURNAL = "system.storage.v1.JournalService"


class JournalStream(StreamedCalls):
    """The engine's hot journal calls (every event's task, every step's receipts, every run's
    begin and finish) on one `JournalService.MultiplexCalls` stream, which costs both processes
    a fraction of a unary call each (services.runtime.multiplex, decisions 0008 and 0021); unary
    calls on `journal`'s stub against a storage service without the stream (or without the
    method on it). Calls name their unary RPC: `call("Commit", request, timeout)`."""

    def __init__(self, journal: Dependency[journal_pb2_grpc.JournalServiceAsyncStub]) -> None:
        super().__init__(journal, journal_pb2.DESCRIPTOR.services_by_name["JournalService"])


class JournalRuns:
    """The RunJournal over the storage service's JournalService: BeginRun and FinishRun (and
    RenewLease for a long run) on the engine's journal stream.

    All three are safe to repeat (a retried finish writes its exchange once), so transport
    failures are retried. A lease held by another owner is BUSY (ResourceExhausted); a
    storage service that cannot be reached is Unavailable: the run must not start.
    """

    def __init__(
        self, target: str, timeout: float = 2.0, settings: ChannelSettings | None = None
    ) -> None:
        self._timeout = timeout
        self._dep = Dependency(
            target,
            journal_pb2_grpc.JournalServiceStub,
            settings=settings,
            idempotent_methods=[
                f"{_JOURNAL}/BeginRun",
                f"{_JOURNAL}/FinishRun",
                f"{_JOURNAL}/RenewLease",
            ],
        )
        self._calls = JournalStream(self._dep)

    async def begin(
        self, player_id: str, owner: str, lease_seconds: int, history_entries: int
    ) -> RunStart:
        """Takes the player's lease and reads what the run reads first."""
        try:
            response = await self._calls.call(
                "BeginRun",
                journal_pb2.BeginRunRequest(
                    player_id=player_id,
                    owner=owner,
                    lease_seconds=lease_seconds,
                    history_entries=history_entries,
                ),
                self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise ResourceExhausted(
                    "another request of this player is in progress; try again shortly"
                ) from None
            raise Unavailable(f"the player's run could not begin: {exc.details()}") from None
        return RunStart(
            int(response.lease.token),
            response.lease.name,
            response.preferences.history_enabled,
            list(response.history) if history_entries else None,
        )

    async def renew(self, lease: str, owner: str, token: int, lease_seconds: int) -> None:
        """Extends the player's lease. Raises grpc.aio.AioRpcError when it was lost or not
        reachable."""
        await self._calls.call(
            "RenewLease",
            journal_pb2.RenewLeaseRequest(
                name=lease, owner=owner, token=token, ttl_seconds=lease_seconds
            ),
            self._timeout,
        )

    async def finish(
        self, player_id: str, owner: str, token: int, entries: list[common_pb2.HistoryEntry]
    ) -> None:
        """Stores the run's exchange and gives the lease back."""
        await self._calls.call(
            "FinishRun",
            journal_pb2.FinishRunRequest(
                player_id=player_id, owner=owner, token=token, entries=entries
            ),
            self._timeout,
        )

    async def aclose(self) -> None:
        await self._calls.aclose()
        await self._dep.aclose()


class StorageHistory:
    """HistoryStore over the storage service's RPCs."""

    def __init__(self, target: str, settings: ChannelSettings | None = None) -> None:
        self._dep = Dependency(
            target,
            storage_pb2_grpc.StorageServiceStub,
            idempotent_methods=["system.storage.v1.StorageService/ListHistory"],
            settings=settings,
        )

    async def append_history(self, player_id: str, entries: list[common_pb2.HistoryEntry]) -> None:
        await self._dep.stub.AppendHistory(
            storage_pb2.AppendHistoryRequest(player_id=player_id, entries=entries)
        )

    async def list_history(self, player_id: str, page_size: int) -> list[common_pb2.HistoryEntry]:
        response = await self._dep.stub.ListHistory(
            storage_pb2.ListHistoryRequest(player_id=player_id, page_size=page_size)
        )
        return list(response.entries)

    async def aclose(self) -> None:
        await self._dep.aclose()


class GatewayGameTools:
    """GameTools over the gateway's `ToolRelayService.CallGameTool`, and PlayerNotices over
    its `NotifyPlayer`, sent to the gateway replica the player is connected to
    (engine_service.relay_routes, decision 0023).

    Calls are never retried where they may have reached the game server: a game tool may
    write, and the relay cannot tell whether the game server ran a call whose answer was
    lost. FAILED_PRECONDITION (the player is not connected to that replica) means nothing was
    sent, so the player is looked up again and, when storage names another replica now (they
    reconnected there), the call goes there once. Errors become catalogued module failures:
    FAILED_PRECONDITION (player not connected) and NOT_FOUND (their server does not offer the
    tool) are TOOL_UNAVAILABLE, raised as `NotDelivered` since the call never left; a lost answer
    of a non-idempotent tool is EFFECT_UNKNOWN (an event step of a tool that honours call ids
    then waits and is resent: engine_service.steps.ResendLater), of any other
    TIMEOUT or TOOL_UNAVAILABLE; a failure the game server reports keeps its catalogue key. A
    call that never left because the replica could not be reached at all
    (services.runtime.errors.never_sent) is retried once where storage names another replica,
    and otherwise raised as `NotDelivered` like a player offline.
    """

    def __init__(
        self,
        target: str,
        settings: ChannelSettings | None = None,
        storage_target: str | None = None,
    ) -> None:
        self.routes = RelayRoutes(target, storage_target, settings)
        # The default target's route: every call to it on one MultiplexCalls stream.
        self._dep = self.routes.default.dependency
        self._calls = self.routes.default.calls

    async def _send(
        self, player_id: str, method: str, request: Message, timeout: float, fresh: bool = False
    ) -> Any:
        """Sends the call to the player's replica (asked of storage anew with `fresh`); once
        more to another replica when the first answered that the player is not connected
        there."""
        deadline = time.monotonic() + timeout
        route = await self.routes.route(player_id, fresh=fresh)
        retried = False
        while True:
            route.in_flight += 1
            try:
                return await route.calls.call(
                    method, request, max(0.0, deadline - time.monotonic())
                )
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                    raise
                self.routes.forget(player_id)
                # Nothing was sent (the player is not there, or that replica could not be
                # reached at all): where storage names another replica now, try it once.
                undelivered = code == grpc.StatusCode.FAILED_PRECONDITION or never_sent(exc)
                if not undelivered or retried:
                    raise
                retried = True
                moved = await self.routes.route(player_id, fresh=True)
                if moved.address == route.address:
                    raise
            finally:
                route.in_flight -= 1
            route = moved

    async def call(
        self,
        player_id: str,
        call_id: str,
        tool_id: str,
        data: dict[str, Any],
        timeout: float,
        idempotent: bool,
        server_id: str = "",
        language: str = "en",
    ) -> dict[str, Any]:
        request = relay_pb2.CallGameToolRequest(
            call_id=call_id,
            player_id=player_id,
            tool=tool_id,
            input=_struct(data),
            server_id=server_id,
        )
        try:
            response = await self._send(player_id, "CallGameTool", request, timeout)
        except grpc.aio.AioRpcError as exc:
            raise _failure(exc, tool_id, idempotent, language) from None
        result = response.result
        if result.WhichOneof("outcome") == "failure":
            failure = AgentFailure.from_key(result.failure.key)
            # The plugin's own words are the player's (the plugin guide says so); without any,
            # its failure key's text.
            raise ModuleFailure(failure, result.failure.message or failure_text(failure, language))
        return json_format.MessageToDict(result.output)

    async def notify(
        self,
        player_id: str,
        result: common_pb2.AgentResult,
        timeout: float,
        server_id: str = "",
        binding: int = 0,
        features: Sequence[str] | None = None,
    ) -> None:
        """Shows `result` to the player of game server `server_id` as a notice
        (PlayerNotices), on whichever gateway replica they are connected to; with `binding`
        (a gateway.v1.BindingChange), tells that replica their binding changed, with
        `features` (all those granted to the player alone, now) that their grants changed
        (`result` may then be empty). Raises grpc.aio.AioRpcError when it could not be sent
        (FAILED_PRECONDITION: offline).

        A binding or feature change asks storage where the player is, never the cached
        route: a player who just joined on another replica may still be attached to the old
        one until its next renewal, and a change told only there would never reach the
        replica that now serves them (found by tests/test_revoke_replicas.py)."""
        request = relay_pb2.NotifyPlayerRequest(
            player_id=player_id, result=result, server_id=server_id
        )
        request.binding = binding  # type: ignore[assignment]
        if features is not None:
            request.features_changed = True
            request.player_features[:] = features
        changed = bool(binding) or features is not None
        await self._send(player_id, "NotifyPlayer", request, timeout, fresh=changed)

    async def aclose(self) -> None:
        await self.routes.aclose()


def _struct(data: dict[str, Any]) -> struct_pb2.Struct:
    value = struct_pb2.Struct()
    value.update(data)
    return value


log = logging.getLogger("system.engine")
_repeated = RepeatedLines(log)

# What a player reads when a game-tool call got no answer from the game server (the log names
# the tool and the transport's words). The game server's own refusals pass through as it wrote
# them: the plugin guide makes those the player's text.
_OFFLINE = {"zh": "你需要在线才能完成这一步。", "en": "You need to be online for this."}
_UNREACHABLE = {
    "zh": "暂时连不上你所在的游戏服务器，这一步没有执行，请稍后再试。",
    "en": "Your game server cannot be reached right now; nothing was done. Try again shortly.",
}
NOT_OFFERED = {
    "zh": "这个游戏服务器没有提供这项功能。",
    "en": "This game server does not offer that.",
}
"""A tool the player's game server lacks: not offered, or of a feature it does not have."""
_UNKNOWN = {
    "zh": "游戏服务器没有回应：这一步可能已经完成，也可能没有，不会自动重复。",
    "en": "The game server did not answer: it may or may not have happened, and it is not "
    "repeated.",
}
_SLOW = {
    "zh": "游戏服务器响应超时，请再试一次。",
    "en": "The game server took too long to answer; try again.",
}
_AWAY = {
    "zh": "游戏服务器暂时无法完成这一步，请稍后再试。",
    "en": "The game server cannot do that right now; try again shortly.",
}
_BROKEN = {
    "zh": "游戏服务器没能完成这一步，请再试一次。",
    "en": "The game server could not do that; try again.",
}


def _failure(
    exc: grpc.aio.AioRpcError, tool_id: str, idempotent: bool, language: str
) -> ModuleFailure:
    """A relayed call's transport error as the failure the player reads, in `language`."""
    code = exc.code()
    _repeated.log(
        logging.WARNING,
        code.name,
        "game tool %s got no answer: %s %s",
        tool_id,
        code.name,
        (exc.details() or "")[:256],
    )
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return NotDelivered(AgentFailure.TOOL_UNAVAILABLE, pick(_OFFLINE, language), True)
    if never_sent(exc):
        # The player's gateway replica could not be reached at all (it died, and their game
        # server has not reconnected elsewhere yet): like a player offline, nothing ran.
        return NotDelivered(AgentFailure.TOOL_UNAVAILABLE, pick(_UNREACHABLE, language), True)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotDelivered(AgentFailure.TOOL_UNAVAILABLE, pick(NOT_OFFERED, language), False)
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
        if not idempotent:
            # The game server may have run it: never guess, never repeat.
            return ModuleFailure(AgentFailure.EFFECT_UNKNOWN, pick(_UNKNOWN, language))
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return ModuleFailure(AgentFailure.TIMEOUT, pick(_SLOW, language))
        return ModuleFailure(AgentFailure.TOOL_UNAVAILABLE, pick(_AWAY, language))
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ModuleFailure(AgentFailure.INVALID_INPUT, pick(_BROKEN, language))
    return ModuleFailure(AgentFailure.MODULE_FAILED, pick(_BROKEN, language))
