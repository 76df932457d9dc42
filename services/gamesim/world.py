"""The simulated game's state and the game tools it offers."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from system.gateway.v1 import gateway_pb2

__all__ = ["World"]

# The schemas as docs/game-tools.md documents them (a plugin copies them the same way).
_ITEM_ID = {
    "type": "string",
    "minLength": 1,
    "maxLength": 128,
    "description": "Item id, namespace:path (for example minecraft:bread).",
}
_INVENTORY_INPUT = {"type": "object", "properties": {}, "additionalProperties": False}
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


class World:
    """Players' inventories, and the tools that read and change them."""

    def __init__(self) -> None:
        self.inventories: dict[str, Counter[str]] = {}

    def inventory(self, player_id: str) -> Counter[str]:
        return self.inventories.setdefault(
            player_id, Counter({"minecraft:bread": 12, "minecraft:torch": 32})
        )

    @staticmethod
    def tools() -> list[gateway_pb2.GameTool]:
        """The tools of the hello, with the catalogue's schemas and flags (docs/game-tools.md)."""
        return [
            gateway_pb2.GameTool(
                name="minecraft:inventory.read",
                description="List the items in the player's inventory.",
                input_schema=json.dumps(_INVENTORY_INPUT),
                output_schema=json.dumps(_INVENTORY_OUTPUT),
                read_only=True,
                idempotent=True,
                event_allowed=True,
            ),
            gateway_pb2.GameTool(
                name="minecraft:item.give",
                description="Give the player some items.",
                input_schema=json.dumps(_GIVE_INPUT),
                output_schema=json.dumps(_GIVE_OUTPUT),
                read_only=False,
                idempotent=False,
                event_allowed=True,
            ),
        ]

    def call(self, player_id: str, tool: str, data: dict[str, Any]) -> dict[str, Any]:
        """Runs a tool. Raises ValueError with a message for bad input or unknown tools."""
        inventory = self.inventory(player_id)
        if tool == "minecraft:inventory.read":
            return {"items": [{"item": k, "count": v} for k, v in sorted(inventory.items())]}
        if tool == "minecraft:item.give":
            item, count = data.get("item"), data.get("count")
            if not isinstance(item, str) or not isinstance(count, int | float) or count < 1:
                raise ValueError("item.give needs an item id and a positive count")
            inventory[item] += int(count)
            return {"item": item, "count": inventory[item]}
        raise ValueError(f"unknown tool {tool}")
