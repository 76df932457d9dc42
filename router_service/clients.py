"""What the router calls besides the engine and the model gateway: the shared exact intent
cache in storage (system.storage.v1.IntentCacheService, decision 0024).

With router replicas behind round-robin balancing, a per-process cache misses whenever a
player's repeat lands on another replica, and a clear reaches only the replica it was sent to.
Storage keeps the entries and each player's cache generation instead, and moves the
generation in the same transaction as the clears of history, preference changes, grants,
revokes and resets.

A storage call that fails never fails routing: a lookup counts as a miss, a record as not
cached, and both are logged (at most every LOG_EVERY_SECONDS) and counted in
`router_shared_cache_failures_total`.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import grpc
from prometheus_client import Counter, Histogram
from system.storage.v1 import intent_cache_pb2, intent_cache_pb2_grpc

from router_service.cache import ClearReason
from services.runtime.channels import ChannelSettings, Dependency
from services.runtime.errors import Unavailable

__all__ = ["LOOKUP_SECONDS", "RECORD_SECONDS", "SharedIntentCache", "SharedLookup"]

log = logging.getLogger("system.router.cache")

_SERVICE = "system.storage.v1.IntentCacheService"
LOOKUP_SECONDS = 0.5
"""Deadline of one lookup (capped by the request's): it stands in front of a model call, and
a storage that is slower than this is treated as unreachable."""
RECORD_SECONDS = 2.0
"""Deadline of one record or clear."""
LOG_EVERY_SECONDS = 30.0

SHARED_CACHE_FAILURES = Counter(
    "router_shared_cache_failures_total",
    "Calls to storage's shared intent cache that failed; routing went on without the cache.",
    ["call"],
)
SHARED_CACHE_LOOKUPS = Counter(
    "router_shared_cache_lookups_total",
    "Lookups in storage's shared intent cache, by result (hit, miss, failed).",
    ["result"],
)
SHARED_CACHE_SECONDS = Histogram(
    "router_shared_cache_lookup_seconds",
    "Time of one lookup in storage's shared intent cache (in front of a model call).",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5),
)

_REASONS = {
    ClearReason.MEMORY_CLEARED: intent_cache_pb2.INTENT_CLEAR_REASON_MEMORY_CLEARED,
    ClearReason.PREFERENCES_CHANGED: intent_cache_pb2.INTENT_CLEAR_REASON_PREFERENCES_CHANGED,
    ClearReason.REVOKED: intent_cache_pb2.INTENT_CLEAR_REASON_REVOKED,
    ClearReason.DISCONNECTED: intent_cache_pb2.INTENT_CLEAR_REASON_DISCONNECTED,
    ClearReason.PERMISSIONS_CHANGED: intent_cache_pb2.INTENT_CLEAR_REASON_PERMISSIONS_CHANGED,
}


class SharedLookup(NamedTuple):
    """What a lookup found: the module (None: a miss) and the player's cache generation to
    record under."""

    module_id: str | None
    generation: int


class SharedIntentCache:
    """The router's client of storage's IntentCacheService. Owns its channel.

    Args:
        target: storage's address (services.runtime.channels.open_channel).
        settings: the router's credential, TLS and keepalive.
    """

    def __init__(self, target: str, settings: ChannelSettings | None = None) -> None:
        self._storage = Dependency(
            target,
            intent_cache_pb2_grpc.IntentCacheServiceStub,
            # A lookup only reads (and marks a use), a record writes the same entry again, a
            # clear moves a generation once more: each may go twice.
            idempotent_methods=[
                f"{_SERVICE}/LookupIntent",
                f"{_SERVICE}/RecordIntent",
                f"{_SERVICE}/ClearIntents",
            ],
            settings=settings,
        )
        self._logged_at = -LOG_EVERY_SECONDS

    def _failed(self, call: str, exc: grpc.aio.AioRpcError) -> None:
        SHARED_CACHE_FAILURES.labels(call).inc()
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_SECONDS:
            self._logged_at = now
            log.warning(
                "the shared intent cache in storage failed (%s: %s: %s); routing goes on "
                "without it",
                call,
                exc.code().name,
                exc.details(),
            )

    async def lookup(
        self, player_id: str, digest: bytes, language: str, runtime_generation: str
    ) -> SharedLookup | None:
        """The cached module and the player's generation; None when storage could not say."""
        started = time.perf_counter()
        try:
            found = await self._storage.stub.LookupIntent(
                intent_cache_pb2.LookupIntentRequest(
                    player_id=player_id,
                    text_sha256=digest,
                    language=language,
                    runtime_generation=runtime_generation,
                ),
                timeout=LOOKUP_SECONDS,
            )
        except grpc.aio.AioRpcError as exc:
            SHARED_CACHE_LOOKUPS.labels("failed").inc()
            self._failed("lookup", exc)
            return None
        SHARED_CACHE_SECONDS.observe(time.perf_counter() - started)
        SHARED_CACHE_LOOKUPS.labels("hit" if found.found else "miss").inc()
        return SharedLookup(found.module_id if found.found else None, found.generation)

    async def record(
        self,
        player_id: str,
        digest: bytes,
        language: str,
        runtime_generation: str,
        module_id: str,
        generation: int,
    ) -> bool | None:
        """Writes an entry: True written, False dropped (the generation moved), None when
        storage could not be reached."""
        try:
            recorded = await self._storage.stub.RecordIntent(
                intent_cache_pb2.RecordIntentRequest(
                    player_id=player_id,
                    text_sha256=digest,
                    language=language,
                    runtime_generation=runtime_generation,
                    module_id=module_id,
                    generation=generation,
                ),
                timeout=RECORD_SECONDS,
            )
        except grpc.aio.AioRpcError as exc:
            self._failed("record", exc)
            return None
        return recorded.recorded

    async def clear(self, player_id: str, reason: ClearReason) -> int:
        """Drops the player's entries for every replica; returns how many.

        Raises:
            Unavailable: storage could not be reached (the caller may send the clear again).
        """
        try:
            cleared = await self._storage.stub.ClearIntents(
                intent_cache_pb2.ClearIntentsRequest(player_id=player_id, reason=_REASONS[reason]),
                timeout=RECORD_SECONDS,
            )
        except grpc.aio.AioRpcError as exc:
            self._failed("clear", exc)
            raise Unavailable(
                f"the shared intent cache in storage could not be cleared ({exc.code().name}); "
                "send the clear again"
            ) from None
        return cleared.removed

    async def aclose(self) -> None:
        await self._storage.aclose()
