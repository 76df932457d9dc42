"""Which gateway replica a player's game-tool calls and notices go to (decision 0023).

A player's game server is connected to one gateway replica; storage's PresenceService says
which, and at what internal address. `RelayRoutes` asks it (keeping each answer for
ROUTE_SECONDS, dropped early when that replica answers that the player is not connected
there; a task's claim carries the answer too, `remember`) and keeps one relay stream per
replica address, each on its own channel (services.runtime.channels), closed once idle for
IDLE_SECONDS. A player storage knows no
replica for (offline, or presence not written yet, or storage not reachable) goes to the
configured `gateway_target`: with one gateway replica that is where every player is.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc
from system.relay.v1 import relay_pb2, relay_pb2_grpc
from system.storage.v1 import presence_pb2, presence_pb2_grpc

from services.runtime.channels import ChannelSettings, Dependency
from services.runtime.multiplex import StreamedCalls

__all__ = ["IDLE_SECONDS", "LOCATE_SECONDS", "ROUTE_SECONDS", "RelayRoute", "RelayRoutes"]

log = logging.getLogger("system.engine.relay")

ROUTE_SECONDS = 5.0
"""How long a player's replica, as storage said, is used without asking again."""
LOCATE_SECONDS = 1.0
"""Longest a lookup may take; then the call goes to `gateway_target`."""
IDLE_SECONDS = 60.0
"""A replica's relay channel unused this long is closed (the default target's never is)."""
_LOCATE = "system.storage.v1.PresenceService/LocatePlayer"


@dataclasses.dataclass
class RelayRoute:
    """The relay stream to one gateway replica's internal address."""

    address: str
    dependency: Dependency[relay_pb2_grpc.ToolRelayServiceAsyncStub]
    calls: StreamedCalls
    in_flight: int = 0
    last_used: float = 0.0

    async def aclose(self) -> None:
        await self.calls.aclose()
        await self.dependency.aclose()


class RelayRoutes:
    """The relay route of each player.

    Args:
        gateway_target: where players storage knows no replica for are sent.
        storage_target: the storage service (PresenceService.LocatePlayer); None: every
            player goes to `gateway_target`.
        settings: the engine's channel settings (its credential).
    """

    def __init__(
        self,
        gateway_target: str,
        storage_target: str | None = None,
        settings: ChannelSettings | None = None,
        *,
        route_seconds: float = ROUTE_SECONDS,
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        self._settings = settings
        self.route_seconds = route_seconds
        """How long a lookup's answer is used (and how often idle routes are swept)."""
        self.idle_seconds = idle_seconds
        """How long a replica's route may go unused before its channel is closed."""
        self.default = self._open(gateway_target)
        self._routes: dict[str, RelayRoute] = {gateway_target: self.default}
        self._located: dict[str, tuple[str, float]] = {}
        self._presence = (
            Dependency(
                storage_target,
                presence_pb2_grpc.PresenceServiceStub,
                idempotent_methods=[_LOCATE],
                settings=settings,
            )
            if storage_target
            else None
        )
        self._swept = 0.0
        self.lookups = 0
        """LocatePlayer calls made (what the cache saved is the rest)."""

    def _open(self, address: str) -> RelayRoute:
        dependency = Dependency(
            address, relay_pb2_grpc.ToolRelayServiceStub, settings=self._settings
        )
        calls = StreamedCalls(dependency, relay_pb2.DESCRIPTOR.services_by_name["ToolRelayService"])
        return RelayRoute(address, dependency, calls)

    async def route(self, player_id: str, *, fresh: bool = False) -> RelayRoute:
        """The route to the replica the player is connected to (asked anew with `fresh`)."""
        await self._close_idle()
        address = self.default.address
        cached = None if fresh else self._located.get(player_id)
        now = time.monotonic()
        if cached is not None and cached[1] > now:
            address = cached[0]
        elif self._presence is not None:
            found = await self._locate(player_id)
            if found is not None and found.connected and found.address:
                address = found.address
                self._located[player_id] = (address, now + self.route_seconds)
            else:
                self._located.pop(player_id, None)
        route = self._routes.get(address)
        if route is None:
            route = self._routes[address] = self._open(address)
        route.last_used = now
        return route

    def remember(self, player_id: str, address: str) -> None:
        """Storage said (with a task's claim) that the player is attached to the replica at
        `address`: used as a lookup's answer would be, for `route_seconds`."""
        if address and self._presence is not None:
            self._located[player_id] = (address, time.monotonic() + self.route_seconds)

    async def located(self, player_id: str) -> bool:
        """Whether storage names a gateway replica for the player now (asked anew); False
        when it names none or cannot be reached."""
        found = await self._locate(player_id)
        return found is not None and found.connected

    async def _locate(self, player_id: str) -> presence_pb2.LocatePlayerResponse | None:
        """Storage's answer for the player; None without presence or when storage could not
        say."""
        if self._presence is None:
            return None
        self.lookups += 1
        try:
            return await self._presence.stub.LocatePlayer(
                presence_pb2.LocatePlayerRequest(player_id=player_id), timeout=LOCATE_SECONDS
            )
        except grpc.aio.AioRpcError as exc:
            log.info("player not located (%s); using the gateway target", exc.code().name)
            return None

    @property
    def addresses(self) -> list[str]:
        """The addresses with an open route (the default target's always)."""
        return list(self._routes)

    def forget(self, player_id: str) -> None:
        """The player's replica said they are not there (or could not be reached)."""
        self._located.pop(player_id, None)

    async def _close_idle(self) -> None:
        now = time.monotonic()
        # At most once per route_seconds (or idle_seconds, if shorter): not on every call.
        if now - self._swept < min(self.route_seconds, self.idle_seconds):
            return
        self._swept = now
        for player_id, (_, until) in list(self._located.items()):
            if until <= now:
                del self._located[player_id]
        for address, route in list(self._routes.items()):
            if route is self.default or route.in_flight:
                continue
            if now - route.last_used >= self.idle_seconds:
                del self._routes[address]
                await route.aclose()

    async def aclose(self) -> None:
        for route in list(self._routes.values()):
            await route.aclose()
        self._routes.clear()
        if self._presence is not None:
            await self._presence.aclose()
