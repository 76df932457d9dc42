"""The cards each player was shown (system.storage.v1.CardBookService, decision 0030), so that
a gateway replica checks a press on a card another replica sent.

One table, `player_cards`: a row per (scoped player, card id) holding the version on screen,
the template, whether it was closed, and the buttons as sent. A row is only ever raised: a
write at a lower version than the stored one changes nothing, one at the same version may
only close it. The rule is one conditional upsert, so writes from two replicas (a game server
that reconnected while its old stream is still open elsewhere) land in any order and leave the
newest card. Rows are read newest shown first, 64 per player (the gateway's book); a row last
shown more than `CARDS_KEPT_SECONDS` ago is neither read nor kept (every SaveCards deletes up
to `SWEEP` of them), and a replica that drops a card from its book forgets it here too.

Every call takes `now` (the storage service's clock), so tests say what time it is.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import (
    Boolean,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    String,
    and_,
    bindparam,
    case,
    delete,
    or_,
    select,
    tuple_,
)
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker
from system.storage.v1 import card_book_pb2

from services.runtime.errors import InvalidArgument
from storage_service.db import Base, rowcount, table_of
from storage_service.dialect import INSERT, DialectInsert, aware, name_of
from storage_service.validation import MAX_PLAYER_ID, check_id, check_player_id

__all__ = [
    "CARDS_KEPT_SECONDS",
    "CARDS_READ",
    "MAX_BUTTONS_BYTES",
    "MAX_CARD_ID",
    "MAX_ENTRIES",
    "MAX_TEMPLATE",
    "CardBookStore",
    "PlayerCardRow",
    "Saved",
]

MAX_CARD_ID = 64
MAX_TEMPLATE = 128
MAX_VERSION = 2**31 - 1
"""The highest version a row holds (PostgreSQL's integer)."""
MAX_BUTTONS_BYTES = 64 * 1024
"""A card's buttons, serialized."""
MAX_ENTRIES = 1000
"""Cards and forgotten cards in one SaveCards call."""
CARDS_READ = 64
"""A player's newest cards GetCards answers (the gateway's book, services.gateway.cards)."""
CARDS_KEPT_SECONDS = 24 * 3600
"""How long after it was last shown a card is kept; older ones are refused as unknown."""
SWEEP = 1000
"""Rows past their time one SaveCards deletes at most."""


class PlayerCardRow(Base):
    """A card as a player was last shown it."""

    __tablename__ = "player_cards"
    __table_args__ = (Index("ix_player_cards_shown_at", "shown_at"),)

    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), primary_key=True)
    card_id: Mapped[str] = mapped_column(String(MAX_CARD_ID), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    template: Mapped[str] = mapped_column(String(MAX_TEMPLATE))
    closed: Mapped[bool] = mapped_column(Boolean)
    buttons: Mapped[bytes] = mapped_column(LargeBinary)
    """A serialized StoredCard holding only its buttons."""
    shown_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


_CARDS = table_of(PlayerCardRow)


def _raise_statement(insert: DialectInsert) -> Any:
    """The conditional upsert (see the module docstring) in one dialect's INSERT."""
    new = insert(_CARDS).excluded
    rises = new.version > _CARDS.c.version

    def raised(column: str) -> Any:
        # A rise takes the new card whole; a close at the same version only closes.
        return case((rises, new[column]), else_=_CARDS.c[column])

    return (
        insert(_CARDS)
        .on_conflict_do_update(
            index_elements=["player_id", "card_id"],
            set_={
                "version": new.version,
                "template": raised("template"),
                "closed": new.closed,
                "buttons": raised("buttons"),
                "shown_at": raised("shown_at"),
            },
            where=or_(
                rises,
                and_(new.version == _CARDS.c.version, new.closed, ~_CARDS.c.closed),
            ),
        )
        .execution_options(preserve_rowcount=True)
    )


# Built once: SaveCards runs every linger of every gateway replica, and building these
# constructs on each call cost more than running them.
_RAISE = {name: _raise_statement(insert) for name, insert in INSERT.items()}
_FORGET = delete(_CARDS).where(
    _CARDS.c.player_id == bindparam("p"),
    _CARDS.c.card_id == bindparam("c"),
    _CARDS.c.version <= bindparam("v"),
)
_EXPIRED = (
    select(_CARDS.c.player_id, _CARDS.c.card_id)
    .where(_CARDS.c.shown_at < bindparam("cutoff"))
    .limit(SWEEP)
)


class Saved(NamedTuple):
    """What SaveCards answers."""

    written: int
    deleted: int


def _check_card(card: card_book_pb2.StoredCard, index: int) -> bytes:
    """Raises InvalidArgument for a malformed card; returns its buttons serialized."""
    where = f"cards[{index}]"
    check_player_id(card.player_id, f"{where}.player_id")
    check_id(card.card_id, f"{where}.card_id", MAX_CARD_ID)
    if not 1 <= card.version <= MAX_VERSION:
        raise InvalidArgument(
            f"{where}.version must be between 1 and {MAX_VERSION} (the version on screen), "
            f"got {card.version}"
        )
    check_id(card.template, f"{where}.template", MAX_TEMPLATE, required=False)
    buttons = card_book_pb2.StoredCard(buttons=card.buttons).SerializeToString()
    if len(buttons) > MAX_BUTTONS_BYTES:
        raise InvalidArgument(
            f"{where}.buttons take {len(buttons)} bytes serialized; at most "
            f"{MAX_BUTTONS_BYTES} are kept per card"
        )
    return buttons


def _newer(a: card_book_pb2.StoredCard, b: card_book_pb2.StoredCard) -> bool:
    """Whether `a` would replace `b` (the upsert's rule, for duplicates within one call)."""
    return a.version > b.version or (a.version == b.version and a.closed and not b.closed)


class CardBookStore:
    """The card rules over a database (see the module docstring)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def save(
        self,
        cards: Sequence[card_book_pb2.StoredCard],
        forgotten: Sequence[card_book_pb2.ForgottenCard],
        now: dt.datetime,
    ) -> Saved:
        """Raises or closes each card (see the module docstring), forgets the forgotten ones
        at their version or lower, and deletes up to SWEEP rows past their time."""
        if len(cards) + len(forgotten) > MAX_ENTRIES:
            raise InvalidArgument(
                f"{len(cards)} cards and {len(forgotten)} forgotten cards; at most "
                f"{MAX_ENTRIES} in all go in one call"
            )
        newest: dict[tuple[str, str], tuple[card_book_pb2.StoredCard, bytes]] = {}
        for index, card in enumerate(cards):
            buttons = _check_card(card, index)
            key = (card.player_id, card.card_id)
            known = newest.get(key)
            if known is None or _newer(card, known[0]):
                newest[key] = (card, buttons)
        for index, gone in enumerate(forgotten):
            check_player_id(gone.player_id, f"forgotten[{index}].player_id")
            check_id(gone.card_id, f"forgotten[{index}].card_id", MAX_CARD_ID)
        rows = [
            {
                "player_id": card.player_id,
                "card_id": card.card_id,
                "version": card.version,
                "template": card.template,
                "closed": card.closed,
                "buttons": buttons,
                # A gateway's clock ahead of storage's never keeps a card past its time.
                "shown_at": min(card.shown_at.ToDatetime(dt.UTC), now)
                if card.HasField("shown_at")
                else now,
            }
            for card, buttons in newest.values()
        ]
        written = deleted = 0
        with self._sessions.begin() as session:
            if rows:
                # Executed with the rows as its parameter sets (executemany), so that the
                # statement, built once, is compiled once and cached.
                written = rowcount(session.execute(_RAISE[name_of(session)], rows))
            if forgotten:
                deleted += rowcount(
                    session.execute(
                        _FORGET,
                        [
                            {"p": gone.player_id, "c": gone.card_id, "v": gone.version}
                            for gone in forgotten
                        ],
                    )
                )
            cutoff = now - dt.timedelta(seconds=CARDS_KEPT_SECONDS)
            expired = session.execute(_EXPIRED, {"cutoff": cutoff}).all()
            if expired:
                deleted += rowcount(
                    session.execute(
                        delete(_CARDS).where(
                            tuple_(_CARDS.c.player_id, _CARDS.c.card_id).in_(
                                [tuple(row) for row in expired]
                            )
                        )
                    )
                )
        return Saved(written, deleted)

    def cards(self, player_id: str, now: dt.datetime) -> list[card_book_pb2.StoredCard]:
        """The player's cards kept now, newest shown first, at most CARDS_READ."""
        check_player_id(player_id)
        cutoff = now - dt.timedelta(seconds=CARDS_KEPT_SECONDS)
        with self._sessions() as session:
            rows = session.execute(
                select(
                    _CARDS.c.card_id,
                    _CARDS.c.version,
                    _CARDS.c.template,
                    _CARDS.c.closed,
                    _CARDS.c.buttons,
                    _CARDS.c.shown_at,
                )
                .where(_CARDS.c.player_id == player_id, _CARDS.c.shown_at >= cutoff)
                .order_by(_CARDS.c.shown_at.desc(), _CARDS.c.card_id)
                .limit(CARDS_READ)
            ).all()
        found = []
        for card_id, version, template, closed, buttons, shown_at in rows:
            card = card_book_pb2.StoredCard.FromString(buttons)
            card.player_id = player_id
            card.card_id = card_id
            card.version = version
            card.template = template
            card.closed = closed
            card.shown_at.FromDatetime(aware(shown_at))
            found.append(card)
        return found
