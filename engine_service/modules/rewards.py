"""`system:advancement_reward`: gives the item stacks in its input, one `minecraft:item.give`
per stack. It runs only from `minecraft:advancement` events, as a persisted task whose input
an advancement rule set (`engine_service.advancements`: which advancement gives what is
configuration, not code). Each give is a write step with a receipt, so a crash never gives a
reward twice (an interrupted give is reported EFFECT_UNKNOWN instead of repeated)."""

from __future__ import annotations

from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.advancements import ADVANCEMENT_EVENT
from engine_service.modules.text import pick, stack_line
from engine_service.registry import IDENTIFIER, ExecutionPolicy, ModuleContext, ModuleSpec
from engine_service.schema import LOCALIZED_NAME
from services.results import card, succeeded

__all__ = ["ADVANCEMENT_EVENT", "MAX_STACK", "AdvancementRewardModule"]

ITEM_GIVE = "minecraft:item.give"
MAX_STACK = 64
"""Most items one stack (one give) may hold."""

_TITLE = {"zh": "成就奖励", "en": "Advancement reward"}
_TITLE_NAMED = {"zh": "成就奖励：{name}", "en": "Advancement reward: {name}"}


class AdvancementRewardModule:
    """Gives the stacks its input lists, in order."""

    spec = ModuleSpec(
        module_id="system:advancement_reward",
        description={
            "zh": "获得成就时发放奖励。",
            "en": "Gives a reward when you earn an advancement.",
        },
        input_schema={
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 16,
                    "description": "The stacks to give, in order; one write step each.",
                    "items": {
                        "type": "object",
                        "properties": {
                            "item": {
                                "type": "string",
                                "maxLength": 128,
                                "pattern": IDENTIFIER.pattern,
                                "description": "Item registry id (minecraft:diamond).",
                            },
                            "count": {"type": "integer", "minimum": 1, "maximum": MAX_STACK},
                            "name": {
                                **LOCALIZED_NAME,
                                "description": "The item's name as the reward card shows it, "
                                "per language (zh, en); the card shows the id without one.",
                            },
                        },
                        "required": ["item", "count"],
                        "additionalProperties": False,
                    },
                },
                "advancement_name": {
                    **LOCALIZED_NAME,
                    "description": "The advancement's name as the reward card's title shows it "
                    "(成就奖励：钻石！), per language (zh, en); a plain title without one.",
                },
            },
            "required": ["items"],
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

    def planned_write_steps(self, data: dict[str, Any]) -> int:
        """One give, hence one write step, per stack (rules are checked against the policy)."""
        return len(data["items"])

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        stacks = data["items"]
        # The gives do not depend on one another: sent together (one relay message).
        await ctx.tools([(ITEM_GIVE, {"item": s["item"], "count": s["count"]}) for s in stacks])
        language = ctx.player.language
        lines = [stack_line(s["item"], s["count"], s.get("name"), language) for s in stacks]
        named = data.get("advancement_name")
        title = pick(_TITLE_NAMED, language, name=pick(named, language)) if named else None
        return succeeded(card("system:reward", title or pick(_TITLE, language), lines))
