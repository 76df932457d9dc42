"""`system:inventory`: lists what the player carries, read from the game server through the
game tool `minecraft:inventory.read` (relayed by the gateway; the engine holds no game state)."""

from __future__ import annotations

from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.modules.text import pick, stack_line
from engine_service.registry import (
    CommandSpec,
    ExecutionPolicy,
    ModuleContext,
    ModuleSpec,
    SemanticSpec,
)
from services.results import card, succeeded

__all__ = ["INVENTORY_READ", "InventoryModule"]

INVENTORY_READ = "minecraft:inventory.read"
_TITLE = {"zh": "背包", "en": "Inventory"}
_EMPTY = {"zh": "背包是空的。", "en": "Your inventory is empty."}
_TOTAL = {"zh": "共 {kinds} 种物品。", "en": "{kinds:~kind of item|kinds of items}."}


class InventoryModule:
    """Reads the inventory once and renders one line per item stack kind."""

    spec = ModuleSpec(
        module_id="system:inventory",
        description={"zh": "查看背包里的物品。", "en": "Show the items in your inventory."},
        input_schema={"type": "object", "properties": {}, "additionalProperties": False},
        commands=(CommandSpec(("inventory", "背包", "查看背包")),),
        routing_mode=catalog_pb2.ROUTING_MODE_READ,
        semantic=SemanticSpec(
            examples={
                "zh": (
                    "我包里有什么",
                    "查看我的背包",
                    "看看背包",
                    "打开背包",
                    "我带了哪些东西",
                    "背包里有什么物品",
                    "背包里装了什么",
                    "我的物品栏里有什么",
                ),
                "en": (
                    "show my inventory",
                    "what is in my inventory",
                    "what am I carrying",
                    "open my inventory",
                    "list my items",
                    "view my inventory",
                    "check my inventory",
                    "display my items",
                ),
            },
            choice_label="system.inventory.choice",
            shortcut=True,
        ),
        tools=(INVENTORY_READ,),
        policy=ExecutionPolicy(rounds=1, model_calls=0, tool_calls=1, steps=1, seconds=10.0),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        # The answer was checked against the tool's output schema (docs/game-tools.md): a
        # malformed one failed the step as TOOL_OUTPUT_INVALID and never gets here.
        output = await ctx.tool(INVENTORY_READ, {})
        # A name where the game server gives one, else the id; either suggests /item <id>.
        lines: list[str | tuple[str, str]] = [
            (
                stack_line(i["item"], i["count"], i.get("name"), language),
                f"/item {i['item']}",
            )
            for i in output["items"]
        ]
        if lines:
            lines.append(pick(_TOTAL, language, kinds=len(lines)))
        else:
            lines = [pick(_EMPTY, language)]
        return succeeded(card("system:inventory", pick(_TITLE, language), lines))
