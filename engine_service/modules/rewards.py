"""`system:advancement_reward`: when a player earns an advancement, gives the reward listed
for it, one `minecraft:item.give` per stack. It runs only from the `minecraft:advancement`
event, as a persisted task: each give is a write step with a receipt, so a crash never gives
a reward twice (an interrupted give is reported EFFECT_UNKNOWN instead of repeated)."""

from __future__ import annotations

from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.modules.text import pick
from engine_service.registry import ExecutionPolicy, ModuleContext, ModuleSpec
from services.results import card, succeeded

__all__ = ["ADVANCEMENT_EVENT", "REWARDS", "AdvancementRewardModule"]

ADVANCEMENT_EVENT = "minecraft:advancement"
ITEM_GIVE = "minecraft:item.give"

REWARDS: dict[str, tuple[tuple[str, int], ...]] = {
    "minecraft:story/mine_stone": (("minecraft:bread", 3),),
    "minecraft:story/smelt_iron": (("minecraft:torch", 16),),
    "minecraft:story/mine_diamond": (("minecraft:diamond", 1), ("minecraft:experience_bottle", 5)),
    "minecraft:nether/root": (("minecraft:golden_apple", 1), ("minecraft:fire_charge", 4)),
    "minecraft:end/kill_dragon": (("minecraft:elytra", 1), ("minecraft:firework_rocket", 32)),
}
"""Reward stacks per advancement; any other advancement earns DEFAULT_REWARD. At most two
stacks each: the policy allows two write steps."""
DEFAULT_REWARD: tuple[tuple[str, int], ...] = (("minecraft:experience_bottle", 1),)

_TITLE = {"zh": "成就奖励", "en": "Advancement reward"}


class AdvancementRewardModule:
    """Gives the stacks REWARDS lists for the advancement in the event."""

    spec = ModuleSpec(
        module_id="system:advancement_reward",
        description={
            "zh": "获得成就时发放奖励。",
            "en": "Gives a reward when you earn an advancement.",
        },
        input_schema={
            "type": "object",
            "properties": {"advancement": {"type": "string", "minLength": 1, "maxLength": 128}},
            "required": ["advancement"],
            "additionalProperties": False,
        },
        routing_mode=catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY,
        interactive=False,
        event_allowed=True,
        events=(ADVANCEMENT_EVENT,),
        tools=(ITEM_GIVE,),
        policy=ExecutionPolicy(
            rounds=1, model_calls=0, tool_calls=2, steps=2, seconds=30.0, write_steps=2
        ),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        stacks = REWARDS.get(data["advancement"], DEFAULT_REWARD)
        lines = []
        for item, count in stacks:
            await ctx.tool(ITEM_GIVE, {"item": item, "count": count})
            lines.append(f"{item} × {count}")
        return succeeded(card("system:reward", pick(_TITLE, ctx.player.language), lines))
