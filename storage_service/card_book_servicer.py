"""gRPC face of the players' cards: converts messages and runs the store off the event loop."""

from __future__ import annotations

from typing import Any

import grpc
from system.storage.v1 import card_book_pb2, card_book_pb2_grpc

from storage_service.card_book import CardBookStore
from storage_service.dbcall import run_db
from storage_service.dialect import utc_now

__all__ = ["CardBookServicer"]


class CardBookServicer(card_book_pb2_grpc.CardBookServiceServicer):
    """Thin: every method delegates to CardBookStore in a worker thread, at the storage
    service's time. Typed errors the store raises become status codes in the server
    interceptor."""

    def __init__(self, store: CardBookStore) -> None:
        self._store = store

    async def SaveCards(
        self,
        request: card_book_pb2.SaveCardsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> card_book_pb2.SaveCardsResponse:
        saved = await run_db(
            self._store.save, list(request.cards), list(request.forgotten), utc_now()
        )
        return card_book_pb2.SaveCardsResponse(written=saved.written, deleted=saved.deleted)

    async def GetCards(
        self,
        request: card_book_pb2.GetCardsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> card_book_pb2.GetCardsResponse:
        cards = await run_db(self._store.cards, request.player_id, utc_now())
        return card_book_pb2.GetCardsResponse(cards=cards)
