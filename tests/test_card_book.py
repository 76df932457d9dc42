"""The gateway's card book (services/gateway/cards.py, decision 0030) as a unit: books join by
version whatever the order, a card read from storage is numbered on (never below what is on
screen), and a press the book cannot place reads storage again, once, before it is refused."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

from services.gateway.cards import CardBook, ShownCard

BUTTON = common_pb2.CardButton(action_id="invoke", label="Buy", args={"module_id": "system:shop"})

records = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.integers(min_value=1, max_value=4),
        st.booleans(),
        st.floats(min_value=0, max_value=100),
    ),
    max_size=12,
)


def _book_of(items: list[tuple[str, int, bool, float]]) -> dict[str, tuple[int, bool]]:
    book = CardBook()
    book.merge(
        (card_id, ShownCard(version, "t", (), closed, shown_at))
        for card_id, version, closed, shown_at in items
    )
    found = {}
    for card_id in ("a", "b", "c"):
        card = book.shown(card_id)
        if card is not None:
            found[card_id] = (card.version, card.closed)
    return found


@given(records, records)
def test_books_join_the_same_in_any_order(one: list, other: list) -> None:  # type: ignore[type-arg]
    assert _book_of(one + other) == _book_of(other + one) == _book_of(one + other + one)
    for card_id, (version, closed) in _book_of(one + other).items():
        mine = [(v, c) for i, v, c, _ in one + other if i == card_id]
        assert version == max(v for v, _ in mine)
        assert closed == any(c for v, c in mine if v == version)


def _press(card_id: str, version: int) -> gateway_pb2.CardAction:
    return gateway_pb2.CardAction(
        source=common_pb2.CardRef(card_id=card_id, version=version),
        action_id=BUTTON.action_id,
        args=BUTTON.args,
    )


async def test_a_card_from_storage_is_numbered_on_and_its_press_checked() -> None:
    stored: list[tuple[str, ShownCard]] = [("quote", ShownCard(5, "system:shop", (BUTTON,)))]
    reads = 0

    async def load() -> list[tuple[str, ShownCard]]:
        nonlocal reads
        reads += 1
        return list(stored)

    changes: list[tuple[str, int]] = []
    book = CardBook(loader=load, on_change=lambda i, card, v: changes.append((i, v)))
    await book.load()
    await book.load()
    assert reads == 1 and book.loaded
    assert await book.check(_press("quote", 5)) is None
    # The module numbers its quote 1 again: it goes out above the one on screen.
    card = common_pb2.Card(ref=common_pb2.CardRef(card_id="quote", version=1), buttons=[BUTTON])
    book.show(card)
    assert card.ref.version == 6 and changes == [("quote", 6)]
    assert (await book.check(_press("quote", 5)) or "").startswith("That card was updated")
    assert reads == 1  # a lower version is stale here: no read


async def test_a_press_the_book_cannot_place_reads_storage_again() -> None:
    stored: list[tuple[str, ShownCard]] = []
    reads = 0

    async def load() -> list[tuple[str, ShownCard]]:
        nonlocal reads
        reads += 1
        return list(stored)

    book = CardBook(loader=load)
    await book.load()
    # Written by another replica after the first read: found by the read on the miss.
    stored.append(("late", ShownCard(2, "system:shop", (BUTTON,))))
    assert await book.check(_press("late", 2)) is None and reads == 2
    # A version above the one known reads again too; still unknown there: refused.
    refusal = await book.check(_press("late", 3))
    assert reads == 3 and (refusal or "").startswith("That card was updated")
    assert (await book.check(_press("nowhere", 1)) or "").startswith("That card is no longer")


async def test_a_failed_read_serves_with_what_the_book_has_and_asks_later() -> None:
    async def load() -> None:
        return None

    book = CardBook(loader=load)
    await book.load()
    assert not book.loaded
    refusal = await book.check(_press("x", 1))
    assert (refusal or "").startswith("That card is no longer active")
