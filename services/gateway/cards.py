"""The cards a player was shown on one connection, so a button press can be checked against
the card it came from (gateway.proto, CardAction).

A card is remembered by id with the version shown, its template and its buttons. A press
names a card and a version: it is accepted only for the version on screen, and only for a
button that card carried (action id and arguments exactly as sent). Modules choose card ids: a
fresh one per card by default, or one id the module keeps for a card it updates (the shop's
`system:shop.quote`). The gateway numbers the versions: a card with the id of one on screen is
its next version. An answer to a press that comes as a new card of the pressed card's template
is made an update of it, so the older version's buttons go stale at once. A card can also be
closed (removed from screen).

A player's book outlives the connection and the replica (decision 0030): every card shown,
updated, closed or dropped is reported (`on_change`) to be written to storage behind the
reply, and a book made on a new connection reads what storage holds (`load`) before the
player's first request there, and again when a press names a card it does not know or a
version above the one it knows (a write from another replica that landed after the first
read). Books join by version: of two records of one card the higher version wins, and at the
same version a closed one, the order in which they arrive does not matter, and a client
that keeps the highest version shows the card the book names.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable

from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

__all__ = ["CARDS_KEPT", "CardBook", "CardChange", "CardLoader", "ShownCard"]

CARDS_KEPT = 64
"""Cards remembered per player; a press on an older one is refused as stale."""
LOAD_RETRY_SECONDS = 5.0
"""How soon a book whose read from storage failed asks again (it serves meanwhile with what
it has)."""


_REFUSALS = {
    "unknown": {
        "zh": "这张卡片已失效（太久以前的，或不是发给你的），请重新打开。",
        "en": "That card is no longer active (too old, or not one sent to you); ask again.",
    },
    "closed": {"zh": "这张卡片已关闭，请重新打开。", "en": "That card was closed; ask again."},
    "updated": {
        "zh": "这张卡片已更新（当前是第 {shown} 版，按钮来自第 {pressed} 版），请使用最新的卡片。",
        "en": "That card was updated (version {shown} is on screen, the button was on version "
        "{pressed}); use the newest one.",
    },
    "not_on_card": {
        "zh": "卡片上没有这个按钮，请使用卡片自己的按钮。",
        "en": "That button is not on the card; use the card's own buttons.",
    },
}


def _button_key(action_id: str, args: dict[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    return action_id, tuple(sorted(args.items()))


@dataclasses.dataclass
class ShownCard:
    """A card as it is on the player's screen."""

    version: int
    template: str
    shown: tuple[common_pb2.CardButton, ...] = ()
    """The buttons as sent, in order."""
    closed: bool = False
    shown_at: float = 0.0
    """When this version was sent (seconds since the epoch): a player's newest cards are
    kept."""

    def replaces(self, other: ShownCard) -> bool:
        """Whether this record of a card wins over `other`, another record of the same card
        (the join of two books: the higher version, at the same version a closed one)."""
        return self.version > other.version or (
            self.version == other.version and self.closed and not other.closed
        )

    def carries(self, action: gateway_pb2.CardAction) -> bool:
        """Whether one of its buttons has the action's id and arguments exactly."""
        return self.button(action) is not None

    def button(self, action: gateway_pb2.CardAction) -> common_pb2.CardButton | None:
        """The button with the action's id and arguments exactly, if the card carries one."""
        pressed = _button_key(action.action_id, dict(action.args))
        return next(
            (b for b in self.shown if _button_key(b.action_id, dict(b.args)) == pressed), None
        )


CardChange = Callable[[str, "ShownCard | None", int], None]
"""Called with (card id, the card as it is now, its version) when a card is shown, updated or
closed; with None for the card when it is dropped from the book."""
CardLoader = Callable[[], Awaitable["list[tuple[str, ShownCard]] | None"]]
"""Reads the cards storage holds for the player; None when storage could not answer."""


class CardBook:
    """One player's cards, newest last, at most `limit`.

    Args:
        limit: cards remembered.
        loader: reads the player's cards from storage (see the module docstring); without
            one the book holds what this connection sent alone.
        on_change: told of every change made here, to write it to storage.
    """

    def __init__(
        self,
        limit: int = CARDS_KEPT,
        *,
        loader: CardLoader | None = None,
        on_change: CardChange | None = None,
    ) -> None:
        self._cards: collections.OrderedDict[str, ShownCard] = collections.OrderedDict()
        self._limit = limit
        self._loader = loader
        self._on_change = on_change
        self.loaded = loader is None
        """Whether what storage holds was read into the book."""
        self._retry_at = 0.0

    def __len__(self) -> int:
        return len(self._cards)

    def show(self, card: common_pb2.Card) -> None:
        """Records `card` as about to be sent. A card with a new id is a new card; one with the
        id of a card on screen updates it and is numbered here, one version above the card on
        screen, whatever version its module gave (a module's own numbering may start again,
        as the shop's does after a purchase): versions of an id only ever increase as sent,
        so a client that keeps the highest never shows an older card over a newer one."""
        if not card.ref.card_id:
            return
        known = self._cards.get(card.ref.card_id)
        if known is not None:
            card.ref.version = known.version + 1
        shown = ShownCard(
            version=card.ref.version,
            template=card.template,
            shown=tuple(card.buttons),
            shown_at=time.time(),
        )
        self._cards[card.ref.card_id] = shown
        self._cards.move_to_end(card.ref.card_id)
        self._changed(card.ref.card_id, shown)
        self._trim()

    def close(self, card_id: str) -> None:
        """Marks a card as removed from screen: its buttons are refused from now on."""
        known = self._cards.get(card_id)
        if known is not None and not known.closed:
            known.closed = True
            self._changed(card_id, known)

    def merge(self, cards: Iterable[tuple[str, ShownCard]]) -> None:
        """Joins records of cards read from storage into the book (see `ShownCard.replaces`),
        keeping the `limit` newest shown."""
        for card_id, card in cards:
            known = self._cards.get(card_id)
            if known is None or card.replaces(known):
                self._cards[card_id] = card
        self._cards = collections.OrderedDict(
            sorted(self._cards.items(), key=lambda item: item[1].shown_at)
        )
        self._trim()

    async def load(self) -> None:
        """Reads what storage holds for the player into the book, once (a failed read is
        tried again at a later request, no sooner than LOAD_RETRY_SECONDS)."""
        if not self.loaded:
            await self._read()

    async def _read(self) -> bool:
        if self._loader is None or time.monotonic() < self._retry_at:
            return False
        found = await self._loader()
        if found is None:
            self._retry_at = time.monotonic() + LOAD_RETRY_SECONDS
            return False
        self.merge(found)
        self.loaded = True
        return True

    def _reason(self, action: gateway_pb2.CardAction) -> str | None:
        ref = action.source
        known = self._cards.get(ref.card_id) if ref.card_id else None
        if known is None:
            return "unknown"
        if known.closed:
            return "closed"
        if ref.version != known.version:
            return "updated"
        if not known.carries(action):
            return "not_on_card"
        return None

    def refusal(self, action: gateway_pb2.CardAction, language: str = "en") -> str | None:
        """Why `action` may not run, in the player's language (zh or en); None when it may."""
        reason = self._reason(action)
        if reason is None:
            return None
        known = self._cards.get(action.source.card_id) if action.source.card_id else None
        texts = _REFUSALS[reason]
        text = texts.get(language) or texts["en"]
        return text.format(shown=known.version if known else 0, pressed=action.source.version)

    async def check(self, action: gateway_pb2.CardAction, language: str = "en") -> str | None:
        """As `refusal`, but a press this book cannot place (a card it does not know, or a
        version above the one it knows) first reads storage again: another replica may have
        sent that card, its write landing after this book's first read."""
        reason = self._reason(action)
        known = self._cards.get(action.source.card_id)
        if reason == "unknown" or (
            reason == "updated" and known is not None and action.source.version > known.version
        ):
            await self._read()
        return self.refusal(action, language)

    def current(self, ref: common_pb2.CardRef) -> ShownCard | None:
        """The card `ref` names when it is on screen in that version (not closed); else None."""
        known = self._cards.get(ref.card_id) if ref.card_id else None
        if known is None or known.closed or known.version != ref.version:
            return None
        return known

    def shown(self, card_id: str) -> ShownCard | None:
        """The card with `card_id` as it is on screen, if remembered."""
        return self._cards.get(card_id)

    def _changed(self, card_id: str, card: ShownCard | None, version: int = 0) -> None:
        if self._on_change is not None:
            self._on_change(card_id, card, card.version if card is not None else version)

    def _trim(self) -> None:
        while len(self._cards) > self._limit:
            card_id, dropped = self._cards.popitem(last=False)
            self._changed(card_id, None, dropped.version)
