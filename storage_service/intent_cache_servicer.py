"""gRPC face of the shared intent cache: converts messages and runs the store off the event
loop."""

from __future__ import annotations

from typing import Any

import grpc
from system.storage.v1 import intent_cache_pb2, intent_cache_pb2_grpc

from services.runtime.errors import InvalidArgument
from storage_service.dbcall import run_db
from storage_service.dialect import utc_now
from storage_service.intent_cache import IntentCacheStore

__all__ = ["IntentCacheServicer"]


class IntentCacheServicer(intent_cache_pb2_grpc.IntentCacheServiceServicer):
    """Thin: every method delegates to IntentCacheStore in a worker thread, at the storage
    service's time. Typed errors the store raises become status codes in the server
    interceptor."""

    def __init__(self, store: IntentCacheStore) -> None:
        self._store = store

    async def LookupIntent(
        self,
        request: intent_cache_pb2.LookupIntentRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> intent_cache_pb2.LookupIntentResponse:
        found = await run_db(
            self._store.lookup,
            request.player_id,
            request.text_sha256,
            request.language,
            request.runtime_generation,
            utc_now(),
        )
        return intent_cache_pb2.LookupIntentResponse(
            found=found.module_id is not None,
            module_id=found.module_id or "",
            generation=found.generation,
        )

    async def RecordIntent(
        self,
        request: intent_cache_pb2.RecordIntentRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> intent_cache_pb2.RecordIntentResponse:
        recorded = await run_db(
            self._store.record,
            request.player_id,
            request.text_sha256,
            request.language,
            request.runtime_generation,
            request.module_id,
            request.generation,
            utc_now(),
        )
        return intent_cache_pb2.RecordIntentResponse(
            recorded=recorded.recorded, evicted=recorded.evicted
        )

    async def ClearIntents(
        self,
        request: intent_cache_pb2.ClearIntentsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> intent_cache_pb2.ClearIntentsResponse:
        if request.reason not in intent_cache_pb2.IntentClearReason.values() or not request.reason:
            raise InvalidArgument(
                "reason must be an IntentClearReason (MEMORY_CLEARED, PREFERENCES_CHANGED, "
                "REVOKED, DISCONNECTED or PERMISSIONS_CHANGED)"
            )
        removed, generation = await run_db(self._store.clear, request.player_id)
        return intent_cache_pb2.ClearIntentsResponse(removed=removed, generation=generation)
