"""Keeps the players' card books in storage (decision 0030), so that a press on a card this
replica sent is checked on another replica after the game server reconnected there.

Every change a book reports (a card shown, updated, closed, or dropped from the book) is
written behind the reply by one task per replica: gathered for a short linger
(`LINGER_SECONDS`) after the first change, coalesced per card (the latest wins), batched
(`BATCH` a call), tried again while storage is away, and flushed when the gateway shuts down
(decision 0035: replies with a card mostly come one at a time, an event task's notice alone,
and without the linger each card was a SaveCards call and a storage transaction of its own).
A book reads storage's cards for its player before their first request on a connection, and
again on a press it cannot place (cards.py); what this replica has not written yet is joined
into what storage answers, so a book made on a newer connection here never misses a card the
older one showed a moment ago.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging

import grpc
from prometheus_client import Counter
from system.storage.v1 import card_book_pb2, card_book_pb2_grpc

from services.gateway.cards import CardBook, ShownCard
from services.runtime.channels import ChannelSettings, Dependency

__all__ = ["BATCH", "LINGER_SECONDS", "CardBookStore"]

log = logging.getLogger("system.gateway.card_books")

CARD_BOOK_FAILURES = Counter(
    "gateway_card_book_failures_total",
    "Card-book calls to storage that failed (writes are tried again; a failed read leaves "
    "the book with the cards this connection sent).",
    ["call"],
)
CARD_BOOK_READS = Counter(
    "gateway_card_book_reads_total",
    "Card books read from storage: a player's first request on a connection, or a press on "
    "a card the book did not know.",
)
CARDS_DROPPED = Counter(
    "gateway_card_writes_dropped_total",
    "Card writes given up: storage refused them as malformed, or too many waited while "
    "storage was away (oldest first).",
)

_SERVICE = "system.storage.v1.CardBookService"
BATCH = 500
"""Cards in one SaveCards call (storage takes up to 1000)."""
LINGER_SECONDS = 0.1
"""How long the writer gathers changes after the first one before it writes them (unless a
batch is already full): a card reaches storage at most this much later, and a gateway writes
at most one SaveCards per linger while cards come one at a time."""
MAX_PENDING = 100_000
"""Card writes kept while storage is away; beyond it the oldest are given up."""
MAX_BUTTONS_BYTES = 64 * 1024
"""Storage's limit on a card's buttons: a card over it is written without them (its
version still counts; its buttons are refused on another replica)."""
READ_SECONDS = 1.0
"""Deadline of a read: a player's request waits at most this long for their book."""
WRITE_SECONDS = 5.0
"""Deadline of one SaveCards call."""
RETRY_SECONDS = 1.0
"""How soon writes storage did not take are tried again."""
FLUSH_SECONDS = 5.0
"""How long a gateway shutting down tries to write what is left."""

_Key = tuple[str, str]
"""(scoped player id, card id)."""
_Entry = tuple[ShownCard | None, int]
"""The card as it is now (None: dropped from the book) and its version."""


def _stored(scoped_id: str, card_id: str, card: ShownCard) -> card_book_pb2.StoredCard:
    stored = card_book_pb2.StoredCard(
        player_id=scoped_id,
        card_id=card_id,
        version=card.version,
        template=card.template,
        closed=card.closed,
        buttons=card.shown,
    )
    if stored.ByteSize() > MAX_BUTTONS_BYTES:
        del stored.buttons[:]
    stored.shown_at.FromDatetime(dt.datetime.fromtimestamp(card.shown_at, dt.UTC))
    return stored


def _shown(stored: card_book_pb2.StoredCard) -> ShownCard:
    return ShownCard(
        version=stored.version,
        template=stored.template,
        shown=tuple(stored.buttons),
        closed=stored.closed,
        shown_at=stored.shown_at.ToDatetime(dt.UTC).timestamp(),
    )


class CardBookStore:
    """This replica's side of storage's CardBookService.

    Args:
        storage_target: the storage service's address.
        settings: the gateway's channel settings (its credential).
    """

    def __init__(self, storage_target: str, settings: ChannelSettings | None = None) -> None:
        self._dep = Dependency(
            storage_target,
            card_book_pb2_grpc.CardBookServiceStub,
            # The same call again leaves the same rows (cards only ever rise).
            idempotent_methods=[f"{_SERVICE}/SaveCards", f"{_SERVICE}/GetCards"],
            settings=settings,
        )
        self._pending: dict[_Key, _Entry] = {}
        """Changes not written yet, oldest first."""
        self._in_flight: dict[_Key, _Entry] = {}
        """Changes in the SaveCards call under way."""
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self.writes = 0
        """SaveCards calls storage took."""

    def book(self, scoped_id: str) -> CardBook:
        """A new book for the player, read from and written to storage."""

        def changed(card_id: str, card: ShownCard | None, version: int) -> None:
            self.note(scoped_id, card_id, card, version)

        async def load() -> list[tuple[str, ShownCard]] | None:
            return await self.read(scoped_id)

        return CardBook(loader=load, on_change=changed)

    # -- writes ---------------------------------------------------------------------------------

    def note(self, scoped_id: str, card_id: str, card: ShownCard | None, version: int) -> None:
        """A change to write: the card as it is now, or None when it was dropped (forgotten
        in storage at `version` or lower)."""
        key = (scoped_id, card_id)
        self._pending.pop(key, None)  # to the end: the oldest changes go first
        self._pending[key] = (card, version)
        while len(self._pending) > MAX_PENDING:
            del self._pending[next(iter(self._pending))]
            CARDS_DROPPED.inc()
        self._idle.clear()
        self._wake.set()

    @property
    def settled(self) -> bool:
        """Whether every change noted so far was written."""
        return not self._pending and not self._in_flight

    async def written(self, timeout: float) -> bool:
        """Waits, at most `timeout` seconds, until every change noted so far was written."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        """Stops the writer, writes what is left (at most FLUSH_SECONDS), closes the channel."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._restore(self._in_flight)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FLUSH_SECONDS):
                while self._pending and await self._write_batch():
                    pass
        if self._pending:
            log.warning("%d card writes not made before shutdown", len(self._pending))
        await self._dep.aclose()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            if len(self._pending) < BATCH:
                await asyncio.sleep(LINGER_SECONDS)  # gather what the next moments bring
            self._wake.clear()
            while self._pending:
                if not await self._write_batch():
                    await asyncio.sleep(RETRY_SECONDS)  # a back-off, not a poll
            if not self._pending:
                self._idle.set()

    async def _write_batch(self) -> bool:
        """Writes up to BATCH pending changes; whether storage took them (or refused them as
        malformed: given up)."""
        keys = list(self._pending)[:BATCH]
        self._in_flight = {key: self._pending.pop(key) for key in keys}
        request = card_book_pb2.SaveCardsRequest()
        for (scoped_id, card_id), (card, version) in self._in_flight.items():
            if card is None:
                request.forgotten.add(player_id=scoped_id, card_id=card_id, version=version)
            else:
                request.cards.append(_stored(scoped_id, card_id, card))
        try:
            await self._dep.stub.SaveCards(request, timeout=WRITE_SECONDS)
        except grpc.aio.AioRpcError as exc:
            CARD_BOOK_FAILURES.labels("SaveCards").inc()
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                log.error("storage refused card writes, given up: %s", exc.details())
                CARDS_DROPPED.inc(len(self._in_flight))
                self._in_flight = {}
                return True
            log.warning("cards not written: %s %s", exc.code().name, exc.details())
            self._restore(self._in_flight)
            self._in_flight = {}
            return False
        self._in_flight = {}
        self.writes += 1
        return True

    def _restore(self, batch: dict[_Key, _Entry]) -> None:
        """Puts changes back in front of the pending ones, unless a newer one waits."""
        kept = {key: entry for key, entry in batch.items() if key not in self._pending}
        self._pending = {**kept, **self._pending}

    # -- reads ----------------------------------------------------------------------------------

    async def read(self, scoped_id: str) -> list[tuple[str, ShownCard]] | None:
        """The player's cards in storage with those this replica has not written yet; None
        when storage could not answer (at most READ_SECONDS)."""
        try:
            found = await self._dep.stub.GetCards(
                card_book_pb2.GetCardsRequest(player_id=scoped_id), timeout=READ_SECONDS
            )
        except grpc.aio.AioRpcError as exc:
            CARD_BOOK_FAILURES.labels("GetCards").inc()
            log.info("card book not read (%s); serving with what it has", exc.code().name)
            return None
        CARD_BOOK_READS.inc()
        cards = [(stored.card_id, _shown(stored)) for stored in found.cards]
        for changes in (self._in_flight, self._pending):
            for (player, card_id), (card, _) in changes.items():
                if player == scoped_id and card is not None:
                    cards.append((card_id, dataclasses.replace(card)))
        return cards
