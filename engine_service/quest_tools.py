"""The game tools of FTB Quests (`ftbquests:quest.*`) and the shared gift list
(`minecraft:gift.list`): their contracts, as the game-tool catalogue publishes them.

The quest tools belong to the `ftbquests` feature: a game server offers them only with the
FTB Quests mod installed (its hello lists the feature), and the modules calling them
(engine_service/modules/quests.py) belong to the feature too. The gift list is a core tool:
gifts are the game server's, and quests are one user of them.

Seed 000 fixes the shapes: `quest.query` (quests in progress or with a reward to claim: the
default view) and `quest.find` (by name) answer a list of briefs; `quest.detail` answers one
quest, whose `starter_gift` only names the gift (the module asks `minecraft:gift.list` for
its items); an unknown quest, or one the player may not see yet, answers found false.
"""

from __future__ import annotations

from typing import Any

# The item-stack and names schemas are the mail's: one rule, written once in tools.py.
from engine_service.tools import _NAMES, _STACK, ToolKind, ToolSpec

__all__ = [
    "FEATURE",
    "GIFT_LIST",
    "QUEST_CLAIM",
    "QUEST_DETAIL",
    "QUEST_FIND",
    "QUEST_GAME_TOOLS",
    "QUEST_LIST_LIMIT",
    "QUEST_QUERY",
    "QUEST_STATUSES",
]

FEATURE = "ftbquests"
"""The optional feature (a game server's hello `features`) that quests belong to."""
QUEST_QUERY = "ftbquests:quest.query"
QUEST_FIND = "ftbquests:quest.find"
QUEST_DETAIL = "ftbquests:quest.detail"
QUEST_CLAIM = "ftbquests:quest.claim"
GIFT_LIST = "minecraft:gift.list"
QUEST_LIST_LIMIT = 10
"""Most quests one `quest.query` or `quest.find` answer holds."""
QUEST_STATUSES = ("locked", "in_progress", "claimable", "claimed")
"""A quest's state for the player: locked (a required quest is not complete yet),
in_progress (open, tasks not all done), claimable (done, reward not claimed), claimed."""

_QUEST_ID = {
    "type": "string",
    "minLength": 1,
    "maxLength": 64,
    "description": "The quest's id, as the game server names it (q4).",
}
_QUEST_INPUT = {
    "type": "object",
    "properties": {"quest_id": _QUEST_ID},
    "required": ["quest_id"],
    "additionalProperties": False,
}
_STATUS = {
    "type": "string",
    "enum": list(QUEST_STATUSES),
    "description": "locked (a required quest is not complete), in_progress, claimable (all "
    "tasks done, reward not claimed yet) or claimed.",
}
_PROGRESS = {
    "type": "integer",
    "minimum": 0,
    "maximum": 100,
    "description": "How much of the quest's tasks is done, in percent.",
}
_BRIEF_PROPERTIES: dict[str, Any] = {
    "id": _QUEST_ID,
    "title": {**_NAMES, "description": "The quest's title per language."},
    "chapter": {**_NAMES, "description": "The title of the quest's chapter per language."},
    "status": _STATUS,
    "progress": _PROGRESS,
}
_BRIEF = {
    "type": "object",
    "properties": _BRIEF_PROPERTIES,
    "required": sorted(_BRIEF_PROPERTIES),
}
_LIST_OUTPUT = {
    "type": "object",
    "properties": {
        "total": {
            "type": "integer",
            "minimum": 0,
            "description": "How many quests matched (quests holds the first ones).",
        },
        "quests": {
            "type": "array",
            "maxItems": QUEST_LIST_LIMIT,
            "description": "The quests, in the quest book's order (chapter, then quest).",
            "items": _BRIEF,
        },
    },
    "required": ["quests", "total"],
}
_TASK = {
    "type": "object",
    "properties": {
        "kind": {
            "type": "string",
            "enum": ["item", "kill", "checkmark"],
            "description": "item (have items), kill (kill mobs) or checkmark (tick it off).",
        },
        "target": {
            "type": "string",
            "maxLength": 128,
            "description": "The item or mob id; empty for a checkmark.",
        },
        "name": {**_NAMES, "description": "The item's or mob's name, or the checkmark's text."},
        "done": {"type": "integer", "minimum": 0, "description": "How many are done."},
        "required": {"type": "integer", "minimum": 1, "description": "How many are needed."},
    },
    "required": ["done", "kind", "name", "required", "target"],
}
_QUEST = {
    "type": "object",
    "properties": {
        **_BRIEF_PROPERTIES,
        "description": {**_NAMES, "description": "The quest's text per language."},
        "tasks": {"type": "array", "minItems": 1, "description": "What to do.", "items": _TASK},
        "rewards": {
            "type": "array",
            "description": "The item stacks a claim delivers (a starter gift quest's reward is "
            "its gift: see starter_gift).",
            "items": _STACK,
        },
        "starter_gift": {
            "type": "string",
            "maxLength": 64,
            "description": "The gift's id when this is a starter gift quest (its items come "
            "from minecraft:gift.list and a claim delivers them); empty otherwise.",
        },
        "requires": {
            "type": "array",
            "description": "Quests that must be complete before this one opens.",
            "items": {
                "type": "object",
                "properties": {"id": _QUEST_ID, "title": _NAMES},
                "required": ["id", "title"],
            },
        },
    },
    "required": sorted(
        [*_BRIEF_PROPERTIES, "description", "requires", "rewards", "starter_gift", "tasks"]
    ),
}
_STACKS_EXAMPLE = [
    {"item": "minecraft:furnace", "name": {"zh": "熔炉", "en": "Furnace"}, "count": 1}
]
_BRIEF_EXAMPLE = {
    "id": "q3",
    "title": {"zh": "石器时代", "en": "Stone Age"},
    "chapter": {"zh": "新手入门", "en": "Getting Started"},
    "status": "in_progress",
    "progress": 62,
}
_QUEST_EXAMPLE = {
    **_BRIEF_EXAMPLE,
    "description": {
        "zh": "收集一组圆石，做一个熔炉。",
        "en": "Gather a stack of cobblestone and build a furnace.",
    },
    "tasks": [
        {
            "kind": "item",
            "target": "minecraft:cobblestone",
            "name": {"zh": "圆石", "en": "Cobblestone"},
            "done": 40,
            "required": 64,
        }
    ],
    "rewards": _STACKS_EXAMPLE,
    "starter_gift": "",
    "requires": [],
}

QUEST_GAME_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        tool_id=QUEST_QUERY,
        description=(
            "List the player's quests that are in progress or have a reward to claim (FTB "
            "Quests), in the quest book's order, at most "
            f"{QUEST_LIST_LIMIT}. Locked, hidden and claimed quests are left out."
        ),
        input_schema={"type": "object", "properties": {}, "additionalProperties": False},
        output_schema=_LIST_OUTPUT,
        read_only=True,
        idempotent=True,
        event_allowed=True,
        owner_feature=FEATURE,
        kind=ToolKind.GAME,
        example_input={},
        example_output={"total": 1, "quests": [_BRIEF_EXAMPLE]},
    ),
    ToolSpec(
        tool_id=QUEST_FIND,
        description=(
            "Find the quests the player can see whose title (in any language, case and width "
            "ignored) contains the name, in the quest book's order, at most "
            f"{QUEST_LIST_LIMIT}; whatever their state. None is an empty list, not an error."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "name": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 64,
                    "description": "Part of a quest's title (石器, stone age).",
                }
            },
            "required": ["name"],
            "additionalProperties": False,
        },
        output_schema=_LIST_OUTPUT,
        read_only=True,
        idempotent=True,
        event_allowed=True,
        owner_feature=FEATURE,
        kind=ToolKind.GAME,
        example_input={"name": "石器"},
        example_output={"total": 1, "quests": [_BRIEF_EXAMPLE]},
    ),
    ToolSpec(
        tool_id=QUEST_DETAIL,
        description=(
            "Read one quest by id, with the player's progress on each task, its rewards and "
            "whether it is a starter gift quest. An unknown quest, or a hidden one the player "
            "cannot see yet, answers found false."
        ),
        input_schema=_QUEST_INPUT,
        output_schema={
            "type": "object",
            "properties": {
                "found": {
                    "type": "boolean",
                    "description": "False when there is no such quest the player can see.",
                },
                "quest": {**_QUEST, "description": "The quest; present when found."},
            },
            "required": ["found"],
        },
        read_only=True,
        idempotent=True,
        event_allowed=True,
        owner_feature=FEATURE,
        kind=ToolKind.GAME,
        example_input={"quest_id": "q3"},
        example_output={"found": True, "quest": _QUEST_EXAMPLE},
    ),
    ToolSpec(
        tool_id=QUEST_CLAIM,
        description=(
            "Claim a completed quest's reward: its items (a starter gift quest's: the gift's) "
            "go into the player's inventory and the quest is marked claimed, in one step on "
            "the game thread (together or not at all). Once per quest: claiming it again gives "
            "nothing and answers already_claimed, so a repeated call has the effect of one."
        ),
        input_schema=_QUEST_INPUT,
        output_schema={
            "type": "object",
            "properties": {
                "outcome": {
                    "type": "string",
                    "enum": ["claimed", "already_claimed", "not_complete", "not_found"],
                    "description": "claimed (delivered now), already_claimed (delivered "
                    "before; nothing given), not_complete (tasks left; nothing given) or "
                    "not_found (no such quest the player can see).",
                },
                "items": {
                    "type": "array",
                    "description": "The stacks this call delivered; empty unless claimed.",
                    "items": _STACK,
                },
            },
            "required": ["items", "outcome"],
        },
        read_only=False,
        idempotent=True,
        event_allowed=False,
        owner_feature=FEATURE,
        kind=ToolKind.GAME,
        example_input={"quest_id": "q4"},
        example_output={"outcome": "claimed", "items": _STACKS_EXAMPLE},
    ),
    ToolSpec(
        tool_id=GIFT_LIST,
        description=(
            "List a gift's items (a starter kit, say). An unknown gift answers found false, "
            "not an error. Reading changes nothing; it gives nothing."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "gift_id": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 64,
                    "description": "The gift's id (starter_kit).",
                }
            },
            "required": ["gift_id"],
            "additionalProperties": False,
        },
        output_schema={
            "type": "object",
            "properties": {
                "found": {"type": "boolean", "description": "False when there is no such gift."},
                "gift": {
                    "type": "object",
                    "description": "The gift; present when found.",
                    "properties": {
                        "id": {"type": "string", "minLength": 1, "maxLength": 64},
                        "name": {**_NAMES, "description": "The gift's name per language."},
                        "items": {
                            "type": "array",
                            "minItems": 1,
                            "description": "The item stacks it holds.",
                            "items": _STACK,
                        },
                    },
                    "required": ["id", "items", "name"],
                },
            },
            "required": ["found"],
        },
        read_only=True,
        idempotent=True,
        event_allowed=True,
        kind=ToolKind.GAME,
        example_input={"gift_id": "starter_kit"},
        example_output={
            "found": True,
            "gift": {
                "id": "starter_kit",
                "name": {"zh": "新手礼包", "en": "Starter Kit"},
                "items": [
                    {
                        "item": "minecraft:stone_sword",
                        "name": {"zh": "石剑", "en": "Stone Sword"},
                        "count": 1,
                    }
                ],
            },
        },
    ),
)
"""The quest tools and the gift list, registered with the built-in modules
(`engine_service.modules.register_builtins`)."""
