"""gRPC face of the knowledge store: converts messages and runs the store off the event loop.

Validation and error mapping live in `storage_service.knowledge` (typed errors, which the
server interceptor turns into status codes); this module only translates.
"""

from __future__ import annotations

from typing import Any

import grpc
from system.storage.v1 import knowledge_pb2, knowledge_pb2_grpc

from storage_service.dbcall import run_db
from storage_service.knowledge import KnowledgeEntry, KnowledgeStore

__all__ = ["SERVICE_NAME", "KnowledgeServicer"]

SERVICE_NAME = knowledge_pb2.DESCRIPTOR.services_by_name["KnowledgeService"].full_name


def _message(entry: KnowledgeEntry) -> knowledge_pb2.KnowledgeEntry:
    message = knowledge_pb2.KnowledgeEntry(
        player_id=entry.player_id,
        entry_id=entry.entry_id,
        title=entry.title,
        body=entry.body,
        language=entry.language,
        source=entry.source,
    )
    message.updated_at.FromDatetime(entry.updated_at)
    return message


class KnowledgeServicer(knowledge_pb2_grpc.KnowledgeServiceServicer):
    """Thin: every method delegates to KnowledgeStore in a worker thread."""

    def __init__(self, store: KnowledgeStore) -> None:
        self._store = store

    async def PutKnowledge(
        self,
        request: knowledge_pb2.PutKnowledgeRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> knowledge_pb2.PutKnowledgeResponse:
        e = request.entry
        entry, created = await run_db(
            self._store.put, e.player_id, e.entry_id, e.title, e.body, e.language, e.source
        )
        return knowledge_pb2.PutKnowledgeResponse(entry=_message(entry), created=created)

    async def DeleteKnowledge(
        self,
        request: knowledge_pb2.DeleteKnowledgeRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> knowledge_pb2.DeleteKnowledgeResponse:
        await run_db(self._store.delete, request.player_id, request.entry_id)
        return knowledge_pb2.DeleteKnowledgeResponse()

    async def ListKnowledge(
        self,
        request: knowledge_pb2.ListKnowledgeRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> knowledge_pb2.ListKnowledgeResponse:
        entries, token = await run_db(
            self._store.list_entries, request.player_id, request.page_size, request.page_token
        )
        return knowledge_pb2.ListKnowledgeResponse(
            entries=[_message(e) for e in entries], next_page_token=token
        )

    async def SearchKnowledge(
        self,
        request: knowledge_pb2.SearchKnowledgeRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> knowledge_pb2.SearchKnowledgeResponse:
        hits = await run_db(
            self._store.search,
            request.player_id,
            request.query,
            request.limit,
            request.private_only,
            request.language,
        )
        return knowledge_pb2.SearchKnowledgeResponse(
            hits=[knowledge_pb2.KnowledgeHit(entry=_message(h.entry), score=h.score) for h in hits]
        )
