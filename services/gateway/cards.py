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
"""

from __future__ import annotations

import collections
import dataclasses

from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

__all__ = ["CARDS_KEPT", "CardBook", "ShownCard"]

CARDS_KEPT = 64
"""Cards remembered per player; a press on an older one is refused as stale."""


_REFUSALS = {
    "unknown": {
        "zh": "这张卡片已失效（来自重新连接之前，或太久以前），请重新打开。",
        "en": "That card is no longer active (it is from before a reconnect, or too old); "
        "ask again.",
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

    def carries(self, action: gateway_pb2.CardAction) -> bool:
        """Whether one of its buttons has the action's id and arguments exactly."""
        pressed = _button_key(action.action_id, dict(action.args))
        return any(_button_key(b.action_id, dict(b.args)) == pressed for b in self.shown)


class CardBook:
    """One player's cards on one connection, newest last, at most `limit`."""

    def __init__(self, limit: int = CARDS_KEPT) -> None:
        self._cards: collections.OrderedDict[str, ShownCard] = collections.OrderedDict()
        self._limit = limit

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
        self._cards[card.ref.card_id] = ShownCard(
            version=card.ref.version,
            template=card.template,
            shown=tuple(card.buttons),
        )
        self._cards.move_to_end(card.ref.card_id)
        while len(self._cards) > self._limit:
            self._cards.popitem(last=False)

    def close(self, card_id: str) -> None:
        """Marks a card as removed from screen: its buttons are refused from now on."""
        known = self._cards.get(card_id)
        if known is not None:
            known.closed = True

    def refusal(self, action: gateway_pb2.CardAction, language: str = "en") -> str | None:
        """Why `action` may not run, in the player's language (zh or en); None when it may."""
        ref = action.source
        known = self._cards.get(ref.card_id) if ref.card_id else None
        if known is None:
            reason = "unknown"
        elif known.closed:
            reason = "closed"
        elif ref.version != known.version:
            reason = "updated"
        elif not known.carries(action):
            reason = "not_on_card"
        else:
            return None
        texts = _REFUSALS[reason]
        text = texts.get(language) or texts["en"]
        return text.format(shown=known.version if known else 0, pressed=ref.version)

    def current(self, ref: common_pb2.CardRef) -> ShownCard | None:
        """The card `ref` names when it is on screen in that version (not closed); else None."""
        known = self._cards.get(ref.card_id) if ref.card_id else None
        if known is None or known.closed or known.version != ref.version:
            return None
        return known

    def shown(self, card_id: str) -> ShownCard | None:
        """The card with `card_id` as it is on screen, if remembered."""
        return self._cards.get(card_id)
