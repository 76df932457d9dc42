"""The gateway's card-book writer (services/gateway/card_books.py, decision 0030, issue 16):
changes that come one at a time within a linger go to storage in one SaveCards; `written()`
waits for them; a read joins what is still waiting; shutdown writes what is left."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from system.storage.v1 import card_book_pb2, card_book_pb2_grpc

from services.gateway.card_books import LINGER_SECONDS, CardBookStore
from services.gateway.cards import ShownCard


class _Storage(card_book_pb2_grpc.CardBookServiceServicer):
    """Records every SaveCards; GetCards answers nothing (so a read shows what is pending)."""

    def __init__(self) -> None:
        self.saves: list[card_book_pb2.SaveCardsRequest] = []

    async def SaveCards(
        self, request: card_book_pb2.SaveCardsRequest, context: Any
    ) -> card_book_pb2.SaveCardsResponse:
        self.saves.append(request)
        return card_book_pb2.SaveCardsResponse(written=len(request.cards))

    async def GetCards(
        self, request: card_book_pb2.GetCardsRequest, context: Any
    ) -> card_book_pb2.GetCardsResponse:
        return card_book_pb2.GetCardsResponse()


@pytest.fixture
async def storage() -> AsyncIterator[tuple[_Storage, str]]:
    servicer = _Storage()
    server = grpc.aio.server()
    card_book_pb2_grpc.add_CardBookServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def _card(version: int) -> ShownCard:
    return ShownCard(version=version, template="system:mail", shown=(), shown_at=1.0)


async def test_notices_one_at_a_time_are_one_write(storage: tuple[_Storage, str]) -> None:
    servicer, target = storage
    store = CardBookStore(target)
    store.start()
    try:
        for i in range(5):  # five players' notices, each alone, inside one linger
            store.note(f"sim/p{i}", "notice", _card(1), 1)
            await asyncio.sleep(LINGER_SECONDS / 20)
        store.note("sim/p0", "notice", None, 1)  # dropped again: the latest change wins
        assert not store.settled
        assert await store.written(5.0)
        assert store.settled
        assert len(servicer.saves) == store.writes == 1
        (save,) = servicer.saves
        assert sorted(card.player_id for card in save.cards) == [f"sim/p{i}" for i in (1, 2, 3, 4)]
        assert [(f.player_id, f.version) for f in save.forgotten] == [("sim/p0", 1)]
    finally:
        await store.aclose()


async def test_a_read_joins_the_waiting_changes(storage: tuple[_Storage, str]) -> None:
    servicer, target = storage
    store = CardBookStore(target)
    store.start()
    try:
        store.note("sim/steve", "mail", _card(3), 3)
        cards = await store.read("sim/steve")
        assert cards is not None and [(i, c.version) for i, c in cards] == [("mail", 3)]
    finally:
        await store.aclose()


async def test_shutdown_writes_what_is_left_without_waiting_out_the_linger(
    storage: tuple[_Storage, str],
) -> None:
    servicer, target = storage
    store = CardBookStore(target)
    store.start()
    store.note("sim/steve", "mail", _card(2), 2)
    await asyncio.sleep(0)  # the writer is lingering
    await store.aclose()
    assert [card.card_id for save in servicer.saves for card in save.cards] == ["mail"]
    assert store.settled
