"""Orders a game server has decided, remembered by (player, order id): the one idempotency
mechanism of the simulated shop and payments (docs/game-tools.md: each order id is decided
once; a repeat answers the first outcome with `replayed` true and changes nothing)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

__all__ = ["MEMORY", "DecidedOrders"]

MEMORY = 65536
"""Most outcomes remembered per book (oldest forgotten first)."""


class DecidedOrders:
    """First outcomes by player and order id, the oldest forgotten beyond MEMORY."""

    def __init__(self) -> None:
        self._outcomes: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()

    def get(self, player_id: str, order_id: str) -> dict[str, Any] | None:
        key = (player_id, order_id)
        if key not in self._outcomes:
            return None
        self._outcomes.move_to_end(key)
        return self._outcomes[key]

    def decide(self, player_id: str, order_id: str, outcome: dict[str, Any]) -> None:
        self._outcomes[(player_id, order_id)] = outcome
        while len(self._outcomes) > MEMORY:
            self._outcomes.popitem(last=False)
