"""The card rules in storage (storage_service.card_book, decision 0030) on SQLite and
PostgreSQL: a card only ever rises (a late write never replaces a newer card, whichever
replica sends it), a close sticks at its version, a forget never deletes a newer version,
a player reads their own newest 64, cards end 24 hours after they were shown; and the
migration that makes the table."""

from __future__ import annotations

import datetime as dt

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, inspect
from sqlalchemy.orm import Session, sessionmaker
from system.common.v1 import common_pb2
from system.storage.v1 import card_book_pb2

from services.runtime.errors import InvalidArgument
from storage_service.card_book import (
    CARDS_KEPT_SECONDS,
    CARDS_READ,
    MAX_BUTTONS_BYTES,
    MAX_ENTRIES,
    CardBookStore,
    PlayerCardRow,
)
from storage_service.db import make_engine, table_of
from storage_service.migrate import _config, upgrade

T0 = dt.datetime(2026, 12, 2, 0, 0, tzinfo=dt.UTC)
STEVE, ALEX = "sim/steve", "sim/alex"


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def card(
    card_id: str,
    version: int,
    *,
    player: str = STEVE,
    closed: bool = False,
    page: int = 1,
    shown: float | None = None,
) -> card_book_pb2.StoredCard:
    stored = card_book_pb2.StoredCard(
        player_id=player,
        card_id=card_id,
        version=version,
        template="system:inbox",
        closed=closed,
        buttons=[
            common_pb2.CardButton(
                action_id="invoke",
                label="Next page",
                args={"module_id": "system:inbox", "input": f'{{"page": {page}}}'},
            )
        ],
    )
    if shown is not None:
        stored.shown_at.FromDatetime(at(shown))
    return stored


def forget(card_id: str, version: int, player: str = STEVE) -> card_book_pb2.ForgottenCard:
    return card_book_pb2.ForgottenCard(player_id=player, card_id=card_id, version=version)


@pytest.fixture
def store(sessions: sessionmaker[Session]) -> CardBookStore:
    return CardBookStore(sessions)


def held(store: CardBookStore, player: str = STEVE, when: float = 10) -> dict[str, tuple]:  # type: ignore[type-arg]
    return {
        c.card_id: (c.version, c.closed, c.buttons[0].args["input"] if c.buttons else "")
        for c in store.cards(player, at(when))
    }


def test_a_card_only_rises_whichever_write_lands_last(store: CardBookStore) -> None:
    assert store.save([card("mail", 1, shown=0)], [], at(0)).written == 1
    # Replica B sends version 3; replica A's write of version 2 lands after it.
    assert store.save([card("mail", 3, page=3, shown=2)], [], at(2)).written == 1
    assert store.save([card("mail", 2, page=2, shown=1)], [], at(3)).written == 0
    assert held(store) == {"mail": (3, False, '{"page": 3}')}
    # The same version again (a retried call) changes nothing; closing it sticks.
    assert store.save([card("mail", 3, page=3, shown=2)], [], at(4)).written == 0
    assert store.save([card("mail", 3, closed=True, shown=2)], [], at(4)).written == 1
    assert store.save([card("mail", 3, page=3, shown=2)], [], at(5)).written == 0
    assert held(store) == {"mail": (3, True, '{"page": 3}')}
    # Within one call too: the highest version of a card is the one kept.
    store.save([card("quote", 5, shown=6), card("quote", 4, shown=6)], [], at(6))
    assert held(store)["quote"][0] == 5


def test_a_forget_never_deletes_a_newer_version(store: CardBookStore) -> None:
    store.save([card("mail", 2, shown=0), card("help", 1, shown=0)], [], at(0))
    # Replica A dropped version 1 of mail; B has sent version 2 since: it stays.
    assert store.save([], [forget("mail", 1), forget("help", 1)], at(1)).deleted == 1
    assert held(store) == {"mail": (2, False, '{"page": 1}')}


def test_a_player_reads_their_own_newest_cards(store: CardBookStore) -> None:
    cards = [card(f"c{i:03}", 1, shown=i) for i in range(CARDS_READ + 6)]
    store.save(cards, [], at(100))
    store.save([card("theirs", 1, player=ALEX, shown=1)], [], at(100))
    read = store.cards(STEVE, at(100))
    assert [c.card_id for c in read] == [f"c{i:03}" for i in range(CARDS_READ + 5, 5, -1)]
    assert read[0].shown_at.ToDatetime(dt.UTC) == at(CARDS_READ + 5)
    assert read[0].buttons[0].label == "Next page" and read[0].template == "system:inbox"
    assert set(held(store, ALEX, 100)) == {"theirs"}


def test_cards_end_a_day_after_they_were_shown(store: CardBookStore) -> None:
    store.save([card("old", 1, shown=0), card("new", 1, shown=3600)], [], at(3600))
    day = CARDS_KEPT_SECONDS
    assert set(held(store, when=day - 1)) == {"old", "new"}
    assert set(held(store, when=day + 1)) == {"new"}
    # The next write deletes what ended.
    assert store.save([card("newer", 1)], [], at(day + 1)).deleted == 1
    # A gateway clock ahead of storage's keeps nothing past its time.
    store.save([card("ahead", 1, shown=10 * day)], [], at(day + 2))
    assert set(held(store, when=2 * day + 3)) == set()


def test_bad_writes_say_what_to_fix(store: CardBookStore) -> None:
    with pytest.raises(InvalidArgument, match=r"cards\[0\]\.version must be between 1"):
        store.save([card("mail", 0)], [], at(0))
    with pytest.raises(InvalidArgument, match=r"cards\[1\]\.card_id is required"):
        store.save([card("mail", 1), card("", 1)], [], at(0))
    with pytest.raises(InvalidArgument, match=r"forgotten\[0\]\.player_id is required"):
        store.save([], [forget("mail", 1, player="")], at(0))
    big = card("mail", 1)
    big.buttons[0].args["input"] = "x" * MAX_BUTTONS_BYTES
    with pytest.raises(InvalidArgument, match="buttons take"):
        store.save([big], [], at(0))
    with pytest.raises(InvalidArgument, match=f"at most {MAX_ENTRIES}"):
        store.save([card(f"c{i}", 1) for i in range(MAX_ENTRIES + 1)], [], at(0))
    with pytest.raises(InvalidArgument, match="player_id is required"):
        store.cards("", at(0))
    assert held(store, when=0) == {}  # nothing of a refused call was written


def test_the_migration_makes_the_declared_table(fresh_database_url: str) -> None:
    engine = make_engine(fresh_database_url)
    try:
        upgrade(engine, "0010")
        declared = MetaData()
        table_of(PlayerCardRow).to_metadata(declared)
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection,
                opts={
                    "compare_type": True,
                    "include_name": lambda name, kind, _: kind != "table" or name == "player_cards",
                },
            )
            assert compare_metadata(context, declared) == []
        with engine.begin() as connection:
            command.downgrade(_config(connection), "0009")
        assert "player_cards" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
