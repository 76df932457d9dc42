"""The routing pipeline. This first cut has the command stage; the intent cache, local lexical
matching and the model fallback join it in the same order (see seed 004)."""

from __future__ import annotations

from system.common.v1 import common_pb2
from system.router.v1 import router_pb2

from router_service.catalog import CatalogCache
from router_service.commands import CommandMatch, UnknownCommand
from services.runtime.errors import InvalidArgument

__all__ = ["Router"]


class Router:
    """Turns a player's text into a routing decision."""

    def __init__(self, catalog: CatalogCache, max_text_chars: int) -> None:
        self._catalog = catalog
        self._max_text_chars = max_text_chars

    async def route(self, player: common_pb2.PlayerContext, text: str) -> router_pb2.RouteResponse:
        if not player.player_id:
            raise InvalidArgument("player.player_id is required")
        if not text.strip():
            raise InvalidArgument("text is empty; send what the player typed")
        if len(text) > self._max_text_chars:
            raise InvalidArgument(
                f"text has {len(text)} characters; the router accepts at most {self._max_text_chars}"
            )
        index = await self._catalog.index()
        match = index.match(text, player)
        if isinstance(match, CommandMatch):
            return router_pb2.RouteResponse(
                source=router_pb2.DECISION_SOURCE_COMMAND, action=match.action
            )
        if isinstance(match, UnknownCommand):
            return router_pb2.RouteResponse(
                source=router_pb2.DECISION_SOURCE_NONE,
                no_route_reason=router_pb2.NO_ROUTE_REASON_UNKNOWN_COMMAND,
                detail=f"/{match.name} is not a command; /help lists the commands",
            )
        return router_pb2.RouteResponse(
            source=router_pb2.DECISION_SOURCE_NONE,
            no_route_reason=router_pb2.NO_ROUTE_REASON_NO_MATCH,
            detail="no command matched; /help lists the commands",
        )
