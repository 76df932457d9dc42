"""gRPC face of the storage service: converts messages and runs the store off the event loop."""

from __future__ import annotations

from typing import Any

import grpc
from system.storage.v1 import storage_pb2, storage_pb2_grpc

from storage_service.dbcall import run_db
from storage_service.history import ConversationStore

__all__ = ["StorageServicer"]


class StorageServicer(storage_pb2_grpc.StorageServiceServicer):
    """Thin: every method delegates to ConversationStore in a worker thread."""

    def __init__(self, store: ConversationStore) -> None:
        self._store = store

    async def AppendHistory(
        self, request: storage_pb2.AppendHistoryRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.AppendHistoryResponse:
        recorded, evicted = await run_db(
            self._store.append, request.player_id, list(request.entries)
        )
        return storage_pb2.AppendHistoryResponse(recorded=recorded, evicted=evicted)

    async def ListHistory(
        self, request: storage_pb2.ListHistoryRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.ListHistoryResponse:
        entries, token = await run_db(
            self._store.list, request.player_id, request.page_size, request.page_token
        )
        return storage_pb2.ListHistoryResponse(entries=entries, next_page_token=token)

    async def ClearHistory(
        self, request: storage_pb2.ClearHistoryRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> storage_pb2.ClearHistoryResponse:
        deleted = await run_db(self._store.clear, request.player_id)
        return storage_pb2.ClearHistoryResponse(deleted=deleted)

    async def GetPreferences(
        self,
        request: storage_pb2.GetPreferencesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> storage_pb2.GetPreferencesResponse:
        prefs = await run_db(self._store.get_preferences, request.player_id)
        return storage_pb2.GetPreferencesResponse(preferences=prefs.message())

    async def UpdatePreferences(
        self,
        request: storage_pb2.UpdatePreferencesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> storage_pb2.UpdatePreferencesResponse:
        prefs = await run_db(
            self._store.update_preferences,
            request.player_id,
            request.history_enabled if request.HasField("history_enabled") else None,
            request.external_enabled if request.HasField("external_enabled") else None,
            request.conversation_mode if request.HasField("conversation_mode") else None,
        )
        return storage_pb2.UpdatePreferencesResponse(preferences=prefs.message())
