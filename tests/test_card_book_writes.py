"""The gateway's card-book writer (services/gateway/card_books.py, decision 0030, issue 16):
changes that come one at a time within a linger go to storage in one SaveCards; `written()`
waits for them; a read joins what is still waiting; shutdown writes what is left. Storage is
the real CardBookService on loopback, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from sqlalchemy.orm import Session, sessionmaker
from system.storage.v1 import card_book_pb2_grpc

from services.gateway import card_books
from services.gateway.card_books import LINGER_SECONDS, CardBookStore
from services.gateway.cards import ShownCard
from storage_service import card_book as stored_cards
from storage_service.card_book_servicer import CardBookServicer
from storage_service.dialect import utc_now


@pytest.fixture
async def storage(
    sessions: sessionmaker[Session],
) -> AsyncIterator[tuple[stored_cards.CardBookStore, str]]:
    """Storage's card store, and the address of its CardBookService."""
    cards = stored_cards.CardBookStore(sessions)
    server = grpc.aio.server()
    card_book_pb2_grpc.add_CardBookServiceServicer_to_server(CardBookServicer(cards), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield cards, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def _kept(cards: stored_cards.CardBookStore, player_id: str) -> list[tuple[str, int]]:
    """(card id, version) of the player's cards in storage."""
    return [(card.card_id, card.version) for card in cards.cards(player_id, utc_now())]


def _card(version: int) -> ShownCard:
    return ShownCard(version=version, template="system:mail", shown=(), shown_at=time.time())


async def test_notices_one_at_a_time_are_one_write(
    storage: tuple[stored_cards.CardBookStore, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cards, target = storage
    # A linger far longer than the notes' spacing: a slow machine's late wake-ups must not
    # split them over two writes (0.1 s shipped; 5 ms apart).
    monkeypatch.setattr(card_books, "LINGER_SECONDS", 1.0)
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
        assert store.writes == 1
        for i in (1, 2, 3, 4):
            assert _kept(cards, f"sim/p{i}") == [("notice", 1)]
        assert _kept(cards, "sim/p0") == []
    finally:
        await store.aclose()


async def test_a_read_joins_the_waiting_changes(
    storage: tuple[stored_cards.CardBookStore, str],
) -> None:
    cards, target = storage
    store = CardBookStore(target)
    store.start()
    try:
        store.note("sim/steve", "mail", _card(3), 3)
        read = await store.read("sim/steve")
        assert read is not None and [(i, c.version) for i, c in read] == [("mail", 3)]
    finally:
        await store.aclose()


async def test_shutdown_writes_what_is_left_without_waiting_out_the_linger(
    storage: tuple[stored_cards.CardBookStore, str],
) -> None:
    cards, target = storage
    store = CardBookStore(target)
    store.start()
    store.note("sim/steve", "mail", _card(2), 2)
    await asyncio.sleep(0)  # the writer is lingering
    await store.aclose()
    assert _kept(cards, "sim/steve") == [("mail", 2)]
    assert store.settled and store.writes == 1
