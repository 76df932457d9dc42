"""The simulated game's state and the game tools it offers.

Players have an inventory, a balance in the server currency, a level and a play time; the item
registry, the mobs and the shop listings are in `items.py`. Tools run one at a time (the
client calls them from its one reader task, as a game runs them on its main thread).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from system.gateway.v1 import gateway_pb2

from services.gamesim import items

__all__ = [
    "STARTING_BALANCE",
    "STARTING_LEVEL",
    "STARTING_PLAY_SECONDS",
    "PlayerState",
    "World",
]

STARTING_BALANCE = 1000
"""Every player's balance (in items.CURRENCY) the first time the world sees them."""
STARTING_LEVEL = 12
"""Every player's experience level at first sight."""
STARTING_PLAY_SECONDS = 5 * 3600 + 20 * 60
"""Play time before the simulator first saw the player (5 h 20 min); sessions add to it."""

# The schemas as docs/game-tools.md documents them, descriptions left out (a plugin copies
# them the same way; tests/test_tool_contract.py checks the hello against the catalogue).
_ITEM_ID = {"type": "string", "minLength": 1, "maxLength": 128}
_NAMES = {
    "type": "object",
    "properties": {
        "zh": {"type": "string", "minLength": 1},
        "en": {"type": "string", "minLength": 1},
    },
    "required": ["zh", "en"],
}
_NO_INPUT = {"type": "object", "properties": {}, "additionalProperties": False}
_INVENTORY_OUTPUT = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"item": _ITEM_ID, "count": {"type": "integer", "minimum": 0}},
                "required": ["item", "count"],
            },
        }
    },
    "required": ["items"],
}
_GIVE_INPUT = {
    "type": "object",
    "properties": {"item": {"type": "string"}, "count": {"type": "integer", "minimum": 1}},
    "required": ["item", "count"],
    "additionalProperties": False,
}
_GIVE_OUTPUT = {
    "type": "object",
    "properties": {"item": _ITEM_ID, "count": {"type": "integer", "minimum": 0}},
    "required": ["item", "count"],
}
_PROFILE_OUTPUT = {
    "type": "object",
    "properties": {
        "balance": {"type": "integer", "minimum": 0},
        "currency": _NAMES,
        "level": {"type": "integer", "minimum": 0},
        "play_seconds": {"type": "integer", "minimum": 0},
    },
    "required": ["balance", "currency", "level", "play_seconds"],
}
_LOOKUP_INPUT = {
    "type": "object",
    "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 64}},
    "required": ["query"],
    "additionalProperties": False,
}
_REF = {
    "type": "object",
    "properties": {"id": _ITEM_ID, "name": _NAMES},
    "required": ["id", "name"],
}
_COUNTED_REF = {
    "type": "object",
    "properties": {"id": _ITEM_ID, "name": _NAMES, "count": {"type": "integer", "minimum": 1}},
    "required": ["count", "id", "name"],
}


def _list_of(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "array",
        "items": {"type": "object", "properties": properties, "required": sorted(properties)},
    }


_LOOKUP_OUTPUT = {
    "type": "object",
    "properties": {
        "exact": {"type": "boolean"},
        "total": {"type": "integer", "minimum": 0},
        "items": {
            "type": "array",
            "maxItems": items.LOOKUP_LIMIT,
            "items": {
                "type": "object",
                "properties": {
                    "id": _ITEM_ID,
                    "name": _NAMES,
                    "sources": {
                        "type": "object",
                        "properties": {
                            "crafting": _list_of(
                                {
                                    "count": {"type": "integer", "minimum": 1},
                                    "inputs": {
                                        "type": "array",
                                        "minItems": 1,
                                        "items": _COUNTED_REF,
                                    },
                                }
                            ),
                            "smelting": _list_of({"input": _REF}),
                            "drops": _list_of({"mob": _REF}),
                            "mining": _list_of({"block": _REF}),
                            "shop": _list_of(
                                {
                                    "price": {"type": "integer", "minimum": 0},
                                    "stock": {"type": "integer", "minimum": 0},
                                    "currency": _NAMES,
                                }
                            ),
                        },
                        "required": ["crafting", "smelting", "drops", "mining", "shop"],
                    },
                },
                "required": ["id", "name", "sources"],
            },
        },
    },
    "required": ["exact", "total", "items"],
}


@dataclasses.dataclass
class PlayerState:
    """One player as the world knows them."""

    inventory: Counter[str] = dataclasses.field(
        default_factory=lambda: Counter({"minecraft:bread": 12, "minecraft:torch": 32})
    )
    balance: int = STARTING_BALANCE
    """Money, in items.CURRENCY."""
    level: int = STARTING_LEVEL
    played_seconds: float = STARTING_PLAY_SECONDS
    """Play time of the sessions that ended."""
    online_since: float | None = None
    """Clock reading at the current session's join; None while offline."""

    def play_seconds(self, now: float) -> int:
        """Play time, the current session included."""
        session = now - self.online_since if self.online_since is not None else 0.0
        return int(self.played_seconds + max(session, 0.0))


def _tool(
    name: str,
    description: str,
    input_schema: dict[str, Any],
    output_schema: dict[str, Any],
    *,
    read_only: bool,
    idempotent: bool,
    event_allowed: bool = True,
) -> gateway_pb2.GameTool:
    return gateway_pb2.GameTool(
        name=name,
        description=description,
        input_schema=json.dumps(input_schema),
        output_schema=json.dumps(output_schema),
        read_only=read_only,
        idempotent=idempotent,
        event_allowed=event_allowed,
    )


class World:
    """Players, the item registry and the shop, and the tools that read and change them.

    Args:
        clock: seconds of a monotonic clock; play time counts with it (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.players: dict[str, PlayerState] = {}
        self.items = items.ITEMS
        self.shop = items.SHOP

    def player(self, player_id: str) -> PlayerState:
        """The player's state, created with the starting values on first sight."""
        return self.players.setdefault(player_id, PlayerState())

    def inventory(self, player_id: str) -> Counter[str]:
        return self.player(player_id).inventory

    def join(self, player_id: str) -> None:
        """The player came online: their play time runs."""
        state = self.player(player_id)
        if state.online_since is None:
            state.online_since = self.clock()

    def leave(self, player_id: str) -> None:
        """The player went offline: the session's time is added to their play time."""
        state = self.player(player_id)
        if state.online_since is not None:
            state.played_seconds += max(self.clock() - state.online_since, 0.0)
            state.online_since = None

    @staticmethod
    def tools() -> list[gateway_pb2.GameTool]:
        """The tools of the hello, with the catalogue's schemas and flags (docs/game-tools.md)."""
        return [
            _tool(
                "minecraft:inventory.read",
                "List the items in the player's inventory.",
                _NO_INPUT,
                _INVENTORY_OUTPUT,
                read_only=True,
                idempotent=True,
            ),
            _tool(
                "minecraft:item.give",
                "Give the player some items.",
                _GIVE_INPUT,
                _GIVE_OUTPUT,
                read_only=False,
                idempotent=False,
            ),
            _tool(
                "minecraft:player.profile",
                "Read the player's balance, level and play time.",
                _NO_INPUT,
                _PROFILE_OUTPUT,
                read_only=True,
                idempotent=True,
            ),
            _tool(
                "minecraft:item.lookup",
                "Find items by registry id or by name, with where each comes from.",
                _LOOKUP_INPUT,
                _LOOKUP_OUTPUT,
                read_only=True,
                idempotent=True,
            ),
        ]

    def call(self, player_id: str, tool: str, data: dict[str, Any]) -> dict[str, Any]:
        """Runs a tool. Raises ValueError with a message for bad input or unknown tools."""
        if tool == "minecraft:inventory.read":
            inventory = self.inventory(player_id)
            return {"items": [{"item": k, "count": v} for k, v in sorted(inventory.items())]}
        if tool == "minecraft:item.give":
            item, count = data.get("item"), data.get("count")
            if not isinstance(item, str) or not isinstance(count, int | float) or count < 1:
                raise ValueError("item.give needs an item id and a positive count")
            inventory = self.inventory(player_id)
            inventory[item] += int(count)
            return {"item": item, "count": inventory[item]}
        if tool == "minecraft:player.profile":
            if data:
                raise ValueError("player.profile takes no input")
            state = self.player(player_id)
            return {
                "balance": state.balance,
                "currency": dict(items.CURRENCY),
                "level": state.level,
                "play_seconds": state.play_seconds(self.clock()),
            }
        if tool == "minecraft:item.lookup":
            query = data.get("query")
            if not isinstance(query, str) or not query.strip() or len(query) > 64:
                raise ValueError("item.lookup needs a query of 1 to 64 characters")
            return items.lookup(query, self.items, self.shop)
        raise ValueError(f"unknown tool {tool}")
