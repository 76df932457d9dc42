"""Keeps the engine's module catalogue, re-read periodically, as a CommandIndex."""

from __future__ import annotations

import asyncio
import logging
import time

from system.engine.v1 import engine_pb2, engine_pb2_grpc

from router_service.commands import CommandIndex
from services.runtime.errors import Unavailable

__all__ = ["CatalogCache"]

log = logging.getLogger("system.router.catalog")


class CatalogCache:
    """The latest catalogue. Read lazily on first use, then refreshed when older than
    `refresh_seconds`; if a refresh fails the previous catalogue keeps serving."""

    def __init__(self, engine: engine_pb2_grpc.EngineServiceStub, refresh_seconds: float) -> None:
        self._engine = engine
        self._refresh_seconds = refresh_seconds
        self._index: CommandIndex | None = None
        self._fetched_at = 0.0
        self._lock = asyncio.Lock()

    async def index(self) -> CommandIndex:
        """The current index. Raises Unavailable when no catalogue was ever read."""
        if self._index is not None and time.monotonic() - self._fetched_at < self._refresh_seconds:
            return self._index
        async with self._lock:
            if self._index is None or time.monotonic() - self._fetched_at >= self._refresh_seconds:
                await self._refresh()
        assert self._index is not None
        return self._index

    async def _refresh(self) -> None:
        try:
            response = await self._engine.GetCatalog(engine_pb2.GetCatalogRequest(), timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - any failure: keep serving the old catalogue
            if self._index is None:
                raise Unavailable(
                    f"the module catalogue could not be read from the engine: {exc}"
                ) from None
            log.warning(
                "catalogue refresh failed, keeping generation %s: %s", self._index.generation, exc
            )
            self._fetched_at = time.monotonic()
            return
        if self._index is None or self._index.generation != response.generation:
            log.info(
                "catalogue generation %s with %d modules",
                response.generation,
                len(response.modules),
            )
            self._index = CommandIndex(list(response.modules), response.generation)
        self._fetched_at = time.monotonic()
