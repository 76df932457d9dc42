"""FTB-style quests and the server's gifts in the simulated world: what `ftbquests:quest.query`,
`ftbquests:quest.find`, `ftbquests:quest.detail`, `ftbquests:quest.claim` and
`minecraft:gift.list` answer (docs/game-tools.md).

The quest book is fixed: three chapters, ten quests with Chinese and English titles and texts,
tasks (have items, kill mobs, tick a checkmark), item rewards, prerequisites, one hidden quest,
and two starter gift quests whose reward is a gift (`GIFTS`). Every player starts with the same
progress (`seed`): some quests claimable, some in progress, one claimed, two locked. Reading
changes nothing; a claim puts the reward into the inventory and marks the quest claimed in one
call (tools run one at a time, as on a game's main thread), once per quest.
"""

from __future__ import annotations

import dataclasses
import unicodedata
from collections import Counter
from collections.abc import Mapping
from typing import Any

from services.gamesim import items

__all__ = [
    "CHAPTERS",
    "FEATURE",
    "GIFTS",
    "LIST_LIMIT",
    "QUESTS",
    "TOOLS",
    "Gift",
    "Progress",
    "Quest",
    "Task",
    "claim",
    "detail",
    "find",
    "gift_list",
    "query",
    "seed",
]

FEATURE = "ftbquests"
"""The hello feature saying FTB Quests is installed; without it the world has no quests."""
TOOLS = (
    "ftbquests:quest.query",
    "ftbquests:quest.find",
    "ftbquests:quest.detail",
    "ftbquests:quest.claim",
)
"""The quest tools, offered only by a world with FEATURE."""
LIST_LIMIT = 10
"""Most quests one query or find answer holds."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One thing a quest asks for."""

    kind: str
    """item (have the items), kill (kill the mobs) or checkmark (tick it off)."""
    target: str = ""
    """The item or mob id; empty for a checkmark."""
    required: int = 1
    text: tuple[str, str] = ("", "")
    """A checkmark's text (zh, en); items and mobs are named by the registry."""

    def names(self) -> dict[str, str]:
        return (
            items.name_of(self.target) if self.target else {"zh": self.text[0], "en": self.text[1]}
        )


@dataclasses.dataclass(frozen=True)
class Quest:
    """One quest of the book."""

    quest_id: str
    chapter: str
    """Key of CHAPTERS."""
    title: tuple[str, str]
    """(zh, en)."""
    description: tuple[str, str]
    tasks: tuple[Task, ...]
    rewards: tuple[tuple[str, int], ...] = ()
    """(item id, count) stacks a claim delivers, besides the starter gift's items."""
    starter_gift: str = ""
    """Key of GIFTS when this is a starter gift quest: the gift is its reward."""
    requires: tuple[str, ...] = ()
    """Quests that must be complete before this one opens."""
    hidden: bool = False
    """Not shown, found or readable while locked."""


@dataclasses.dataclass(frozen=True)
class Gift:
    """A named bundle of items the server gives (a starter kit)."""

    gift_id: str
    name: tuple[str, str]
    stacks: tuple[tuple[str, int], ...]


CHAPTERS: Mapping[str, tuple[str, str]] = {
    "getting_started": ("新手入门", "Getting Started"),
    "mining": ("采矿", "Mining"),
    "adventure": ("冒险", "Adventure"),
}

GIFTS: Mapping[str, Gift] = {
    gift.gift_id: gift
    for gift in (
        Gift(
            "starter_kit",
            ("新手礼包", "Starter Kit"),
            (("minecraft:stone_sword", 1), ("minecraft:bread", 16), ("minecraft:torch", 16)),
        ),
        Gift(
            "farmer_kit",
            ("农夫礼包", "Farmer's Kit"),
            (("minecraft:bread", 8), ("minecraft:apple", 8)),
        ),
    )
}

QUESTS: tuple[Quest, ...] = (
    Quest(
        "q1",
        "getting_started",
        ("欢迎来到服务器", "Welcome to the Server"),
        (
            "打开任务书看一看，然后领取你的新手礼包。",
            "Open the quest book, then claim your starter kit.",
        ),
        (Task("checkmark", text=("打开任务书", "Open the quest book")),),
        starter_gift="starter_kit",
    ),
    Quest(
        "q2",
        "getting_started",
        ("砍树", "Getting Wood"),
        ("每段旅程都从一棵树开始。", "Every journey starts with a tree."),
        (Task("item", "minecraft:oak_log", 16),),
        rewards=(("minecraft:torch", 16),),
    ),
    Quest(
        "q3",
        "getting_started",
        ("石器时代", "Stone Age"),
        ("收集一组圆石，做一个熔炉。", "Gather a stack of cobblestone and build a furnace."),
        (Task("item", "minecraft:cobblestone", 64),),
        rewards=(("minecraft:furnace", 1),),
        requires=("q2",),
    ),
    Quest(
        "q4",
        "mining",
        ("铁器时代", "Iron Age"),
        ("冶炼十六个铁锭，换一把铁镐。", "Smelt sixteen iron ingots and earn an iron pickaxe."),
        (Task("item", "minecraft:iron_ingot", 16),),
        rewards=(("minecraft:iron_pickaxe", 1), ("minecraft:bread", 8)),
        requires=("q2",),
    ),
    Quest(
        "q5",
        "mining",
        ("闪闪发光的钻石", "Diamonds!"),
        ("往深处挖，找到五颗钻石。", "Dig deep and find five diamonds."),
        (Task("item", "minecraft:diamond", 5),),
        rewards=(("minecraft:experience_bottle", 8),),
        requires=("q4",),
    ),
    Quest(
        "q6",
        "adventure",
        ("深入下界", "Into the Nether"),
        ("打败五个烈焰人，带回它们的烈焰棒。", "Defeat five blazes and bring back their rods."),
        (Task("kill", "minecraft:blaze", 5), Task("item", "minecraft:blaze_rod", 5)),
        rewards=(("minecraft:golden_apple", 1),),
        requires=("q5",),
    ),
    Quest(
        "q7",
        "adventure",
        ("怪物猎人", "Monster Hunter"),
        ("夜晚不再可怕：清理附近的怪物。", "Make the night safe: clear out the monsters nearby."),
        (Task("kill", "minecraft:zombie", 10), Task("kill", "minecraft:skeleton", 10)),
        rewards=(("minecraft:bow", 1), ("minecraft:arrow", 32)),
    ),
    Quest(
        "q8",
        "mining",
        ("铁傀儡守卫", "Iron Guardian"),
        (
            "准备四个铁块，造一个铁傀儡守护村庄。",
            "Prepare four blocks of iron to build an iron golem.",
        ),
        (Task("item", "minecraft:iron_block", 4),),
        rewards=(("minecraft:emerald", 4),),
        requires=("q4",),
    ),
    Quest(
        "q9",
        "adventure",
        ("末地之旅", "The End"),
        ("收集末影珍珠，寻找末地传送门。", "Collect ender pearls and find the End portal."),
        (Task("item", "minecraft:ender_pearl", 12),),
        rewards=(("minecraft:elytra", 1),),
        requires=("q6",),
        hidden=True,
    ),
    Quest(
        "q10",
        "getting_started",
        ("农夫的礼物", "Farmer's Gift"),
        (
            "收获三十二个小麦，农夫会送你一份礼包。",
            "Harvest thirty-two wheat and the farmer sends you a gift.",
        ),
        (Task("item", "minecraft:wheat", 32),),
        starter_gift="farmer_kit",
    ),
)
"""The quest book, in its order (the order lists keep)."""

_BY_ID = {quest.quest_id: quest for quest in QUESTS}

_SEED_DONE: Mapping[str, tuple[int, ...]] = {
    "q1": (1,),
    "q2": (16,),
    "q3": (40,),
    "q4": (16,),
    "q7": (3, 10),
    "q8": (1,),
    "q10": (10,),
}
"""Every player's starting progress per task (quests not named: nothing done)."""


@dataclasses.dataclass
class Progress:
    """One player's progress in the quest book."""

    done: dict[str, list[int]]
    """Per quest, how much of each task is done."""
    claimed: set[str]
    """Quests whose reward was claimed."""

    def advance(self, quest_id: str, task: int, amount: int) -> None:
        """Adds to a task's count (as the game does when the player picks items up or kills),
        never past what the task requires."""
        quest = _BY_ID[quest_id]
        counts = self.done[quest_id]
        counts[task] = min(counts[task] + amount, quest.tasks[task].required)


def seed() -> Progress:
    """A new player's progress (fresh lists: one player's progress leaves the rest)."""
    return Progress(
        done={q.quest_id: list(_SEED_DONE.get(q.quest_id, (0,) * len(q.tasks))) for q in QUESTS},
        claimed={"q2"},
    )


def _complete(progress: Progress, quest: Quest) -> bool:
    counts = progress.done[quest.quest_id]
    return all(done >= task.required for done, task in zip(counts, quest.tasks, strict=True))


def _status(progress: Progress, quest: Quest) -> str:
    if quest.quest_id in progress.claimed:
        return "claimed"
    if not all(_complete(progress, _BY_ID[r]) for r in quest.requires):
        return "locked"
    return "claimable" if _complete(progress, quest) else "in_progress"


def _visible(progress: Progress, quest: Quest) -> bool:
    return not (quest.hidden and _status(progress, quest) == "locked")


def _percent(progress: Progress, quest: Quest) -> int:
    counts = progress.done[quest.quest_id]
    share = sum(min(d, t.required) / t.required for d, t in zip(counts, quest.tasks, strict=True))
    return int(100 * share / len(quest.tasks))


def _names(pair: tuple[str, str]) -> dict[str, str]:
    return {"zh": pair[0], "en": pair[1]}


def _stacks(stacks: tuple[tuple[str, int], ...]) -> list[dict[str, Any]]:
    return [{"item": i, "name": items.name_of(i), "count": n} for i, n in stacks]


def _brief(progress: Progress, quest: Quest) -> dict[str, Any]:
    return {
        "id": quest.quest_id,
        "title": _names(quest.title),
        "chapter": _names(CHAPTERS[quest.chapter]),
        "status": _status(progress, quest),
        "progress": _percent(progress, quest),
    }


def _listed(progress: Progress, quests: list[Quest]) -> dict[str, Any]:
    return {
        "total": len(quests),
        "quests": [_brief(progress, q) for q in quests[:LIST_LIMIT]],
    }


def _no_input(data: Mapping[str, Any], tool: str) -> None:
    if data:
        raise ValueError(f"{tool} takes no input")


def _text(data: Mapping[str, Any], key: str, tool: str) -> str:
    value = data.get(key)
    if set(data) != {key} or not isinstance(value, str) or not 1 <= len(value) <= 64:
        raise ValueError(f"{tool} takes a {key} of 1 to 64 characters")
    return value


def _fold(text: str) -> str:
    """Case and width folded away (ＩＲＯＮ finds Iron Age)."""
    return unicodedata.normalize("NFKC", text).casefold().strip()


def query(progress: Progress, data: Mapping[str, Any]) -> dict[str, Any]:
    """`ftbquests:quest.query`: the quests in progress or claimable, in book order."""
    _no_input(data, "quest.query")
    open_ = [q for q in QUESTS if _status(progress, q) in ("in_progress", "claimable")]
    return _listed(progress, open_)


def find(progress: Progress, data: Mapping[str, Any]) -> dict[str, Any]:
    """`ftbquests:quest.find`: visible quests whose title contains the name, in book order."""
    wanted = _fold(_text(data, "name", "quest.find"))
    if not wanted:
        raise ValueError("quest.find needs a name that is not blank")
    found = [
        q
        for q in QUESTS
        if _visible(progress, q) and any(wanted in _fold(title) for title in q.title)
    ]
    return _listed(progress, found)


def _seen(progress: Progress, quest_id: str) -> Quest | None:
    quest = _BY_ID.get(quest_id)
    return quest if quest is not None and _visible(progress, quest) else None


def detail(progress: Progress, data: Mapping[str, Any]) -> dict[str, Any]:
    """`ftbquests:quest.detail`: one quest the player can see, or found false."""
    quest = _seen(progress, _text(data, "quest_id", "quest.detail"))
    if quest is None:
        return {"found": False}
    counts = progress.done[quest.quest_id]
    return {
        "found": True,
        "quest": {
            **_brief(progress, quest),
            "description": _names(quest.description),
            "tasks": [
                {
                    "kind": task.kind,
                    "target": task.target,
                    "name": task.names(),
                    "done": done,
                    "required": task.required,
                }
                for task, done in zip(quest.tasks, counts, strict=True)
            ],
            "rewards": _stacks(quest.rewards),
            "starter_gift": quest.starter_gift,
            "requires": [{"id": r, "title": _names(_BY_ID[r].title)} for r in quest.requires],
        },
    }


def claim(progress: Progress, inventory: Counter[str], data: Mapping[str, Any]) -> dict[str, Any]:
    """`ftbquests:quest.claim`: the reward (and a starter gift's items) into `inventory` and
    the quest marked claimed, together (nothing here can fail between the two), once per
    quest."""
    quest = _seen(progress, _text(data, "quest_id", "quest.claim"))
    if quest is None:
        return {"outcome": "not_found", "items": []}
    status = _status(progress, quest)
    if status == "claimed":
        return {"outcome": "already_claimed", "items": []}
    if status != "claimable":
        return {"outcome": "not_complete", "items": []}
    stacks = quest.rewards + (GIFTS[quest.starter_gift].stacks if quest.starter_gift else ())
    for item, count in stacks:
        inventory[item] += count
    progress.claimed.add(quest.quest_id)
    return {"outcome": "claimed", "items": _stacks(stacks)}


def gift_list(data: Mapping[str, Any]) -> dict[str, Any]:
    """`minecraft:gift.list`: a gift's items, or found false."""
    gift = GIFTS.get(_text(data, "gift_id", "gift.list"))
    if gift is None:
        return {"found": False}
    return {
        "found": True,
        "gift": {"id": gift.gift_id, "name": _names(gift.name), "items": _stacks(gift.stacks)},
    }
