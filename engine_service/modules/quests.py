"""FTB Quests: `system:quests` (任务列表), `system:quest_detail` (任务详情) and
`system:quest_claim` (领取任务奖励), over the game tools of engine_service/quest_tools.py.

All three belong to the `ftbquests` feature: a player whose game server's hello does not list
it never sees them (help, completion, routing, the model's catalogue) and cannot run them,
even from an old card's button.

`system:quests` reads only, so local routing may pick it: `/quests` (查看任务, 我的任务) lists
the quests in progress or with a reward to claim, `/quests <name>` those whose title contains
the name; one button per quest, so `查看 2` / `/view 2` opens the second (the gateway numbers
the card's buttons).

`system:quest_detail` shows one quest: by id (a button, `/quest q4`), by the number in the
quest list (`查看任务 2`, `/quest 2`: the routing profile's `list_index` extractor gives
`index`) or by name (`/quest 石器时代`); a name several quests match shows them as buttons.
A starter gift quest's detail only names its gift; this module asks `minecraft:gift.list`
for the gift's items.

`system:quest_claim` is a write and is never routed from free text, the intent cache or the
model (STRUCTURED_ONLY): only the claim button on a completed quest's card (marked
`press_only`, so a typed number never presses it) and `/questclaim <id>` reach it. The claim
is one game-tool call that delivers the reward and marks the quest claimed together, once per
quest: a second press gives nothing and says so.
"""

from __future__ import annotations

import re
from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.modules.buttons import invoke
from engine_service.modules.text import pick
from engine_service.quest_tools import (
    FEATURE,
    GIFT_LIST,
    QUEST_CLAIM,
    QUEST_DETAIL,
    QUEST_FIND,
    QUEST_QUERY,
)
from engine_service.registry import (
    CommandSpec,
    ExecutionPolicy,
    ModuleContext,
    ModuleSpec,
    SemanticSpec,
)
from services.results import AgentFailure, card, failed, succeeded

__all__ = ["QuestClaimModule", "QuestDetailModule", "QuestsModule"]

QUESTS = "system:quests"
DETAIL = "system:quest_detail"
CLAIM = "system:quest_claim"
MAX_INDEX = 1000

_QUEST_ID = {
    "type": "string",
    "minLength": 1,
    "maxLength": 64,
    "description": "The quest's id, as the list's buttons carry it (q4).",
}
_NAME = {
    "type": "string",
    "minLength": 1,
    "maxLength": 64,
    "description": "Part of a quest's title, in Chinese or English (石器, iron).",
}
_NUMBER = re.compile(r"^#?\s*([0-9]{1,4})$")

_STATUS = {
    "in_progress": {"zh": "进行中", "en": "in progress"},
    "claimable": {"zh": "可领取奖励", "en": "reward ready"},
    "claimed": {"zh": "奖励已领取", "en": "reward claimed"},
    "locked": {"zh": "未解锁", "en": "locked"},
}
_ENTRY = {"zh": "{n}. {title} · {chapter} — {status}", "en": "{n}. {title} · {chapter} — {status}"}
_LIST_TITLE = {"zh": "进行中的任务（共 {total} 个）", "en": "Quests in progress ({total})"}
_FOUND_TITLE = {
    "zh": "任务搜索“{name}”（共 {total} 个）",
    "en": "Quests matching “{name}” ({total})",
}
_EMPTY = {
    "zh": "目前没有进行中或可领奖的任务。",
    "en": "You have no quests in progress or to claim.",
}
_NONE_FOUND = {
    "zh": "没有找到名称包含“{name}”的任务。",
    "en": "No quest you can see has “{name}” in its title.",
}
_MORE = {"zh": "只显示前 {shown} 个。", "en": "Showing the first {shown}."}
_CANDIDATES_TITLE = {
    "zh": "有 {total} 个任务符合“{name}”",
    "en": "{total} quests match “{name}”",
}
_PICK_ONE = {"zh": "选择一个查看详情。", "en": "Pick one to see it."}

_CHAPTER = {"zh": "章节：{chapter}", "en": "Chapter: {chapter}"}
_STATUS_LINE = {
    "in_progress": {"zh": "状态：进行中（{progress}%）", "en": "Status: in progress ({progress}%)"},
    "claimable": {
        "zh": "状态：已完成，奖励可领取",
        "en": "Status: complete, the reward is ready to claim",
    },
    "claimed": {"zh": "状态：已完成，奖励已领取", "en": "Status: complete, reward claimed"},
    "locked": {
        "zh": "状态：未解锁，需先完成：{requires}",
        "en": "Status: locked; first complete: {requires}",
    },
}
_TASKS = {"zh": "任务要求：", "en": "Tasks:"}
_TASK = {
    "item": {"zh": "  收集 {name} {done}/{required}", "en": "  Collect {name} {done}/{required}"},
    "kill": {"zh": "  击杀 {name} {done}/{required}", "en": "  Kill {name} {done}/{required}"},
    "checkmark": {"zh": "  {name} {done}/{required}", "en": "  {name} {done}/{required}"},
}
_REWARDS = {"zh": "奖励：", "en": "Rewards:"}
_STACK = {"zh": "  {name} × {count}", "en": "  {name} × {count}"}
_GIFT = {
    "zh": "新手礼包任务：奖励是“{gift}”，内含：",
    "en": "Starter gift quest: the reward is the {gift}, holding:",
}
_NO_GIFT = {
    "zh": "新手礼包任务：礼包 {gift_id} 暂时无法查看。",
    "en": "Starter gift quest: the gift {gift_id} cannot be listed right now.",
}
_CLAIM_BUTTON = {"zh": "领取奖励", "en": "Claim reward"}
_BACK = {"zh": "返回任务列表", "en": "Back to quests"}

_NO_QUEST_TITLE = {"zh": "没有这个任务", "en": "No such quest"}
_NO_QUEST = {
    "zh": "没有编号为 {quest_id} 的任务，或者它还没有解锁。输入 /quests 查看任务列表。",
    "en": "There is no quest {quest_id} you can see. Type /quests to see your quests.",
}
_NO_INDEX = {
    "zh": "任务列表里没有第 {index} 项（共 {total} 项）。输入 /quests 查看任务列表。",
    "en": "Your quest list has no number {index} (it has {total}). Type /quests to see it.",
}
_CLAIM_BY_INDEX = {
    "zh": "没有编号为 {quest_id} 的任务。要领取任务列表里第 {quest_id} 项的奖励，请先打开它"
    "（/quest {quest_id}），再按任务卡片上的“领取奖励”。",
    "en": "There is no quest {quest_id}. To claim the reward of number {quest_id} of your quest "
    "list, open it (/quest {quest_id}) and press Claim on its card.",
}
_CLAIMED_TITLE = {"zh": "已领取任务奖励", "en": "Quest reward claimed"}
_DELIVERED = {"zh": "以上物品已放入背包。", "en": "These items are now in your inventory."}
_ALREADY_TITLE = {"zh": "任务奖励已领取过", "en": "Already claimed"}
_ALREADY = {
    "zh": "任务 {quest_id} 的奖励之前已经领取，这次没有再发放物品。",
    "en": "You claimed the reward of quest {quest_id} before; nothing was given this time.",
}
_NOT_COMPLETE_TITLE = {"zh": "任务尚未完成", "en": "Quest not complete"}
_NOT_COMPLETE = {
    "zh": "任务 {quest_id} 还没有完成，暂时没有可领取的奖励。",
    "en": "Quest {quest_id} is not complete yet; there is no reward to claim.",
}

_POLICY = ExecutionPolicy(rounds=1, model_calls=0, tool_calls=1, steps=1, seconds=10.0)


def _back(language: str) -> common_pb2.CardButton:
    return invoke(QUESTS, pick(_BACK, language), {}, label_key="back")


def _stacks(stacks: list[dict[str, Any]], language: str) -> list[str | tuple[str, str]]:
    return [
        (
            pick(_STACK, language, name=pick(s["name"], language), count=s["count"]),
            f"/item {s['item']}",
        )
        for s in stacks
    ]


def _status(brief: dict[str, Any], language: str) -> str:
    status = pick(_STATUS[brief["status"]], language)
    return f"{status} {brief['progress']}%" if brief["status"] == "in_progress" else status


def _entries(
    quests: list[dict[str, Any]], language: str
) -> tuple[list[str | tuple[str, str]], list[common_pb2.CardButton]]:
    """Numbered lines and one detail button per quest, in the same order (查看 2 = line 2)."""
    lines: list[str | tuple[str, str]] = []
    buttons = []
    for number, quest in enumerate(quests, 1):
        text = pick(
            _ENTRY,
            language,
            n=number,
            title=pick(quest["title"], language),
            chapter=pick(quest["chapter"], language),
            status=_status(quest, language),
        )
        lines.append((text, f"/quest {quest['id']}"))
        buttons.append(invoke(DETAIL, pick(quest["title"], language), {"quest_id": quest["id"]}))
    return lines, buttons


def _not_found(quest_id: str, language: str, claiming: bool = False) -> common_pb2.AgentResult:
    # `/questclaim 2` meant the list's second quest: a write names its quest, by its button.
    text = _CLAIM_BY_INDEX if claiming and quest_id.isdigit() else _NO_QUEST
    return failed(
        AgentFailure.NOT_FOUND,
        pick(text, language, quest_id=quest_id),
        title=pick(_NO_QUEST_TITLE, language),
    )


class QuestsModule:
    """Lists the quests in progress or claimable, or those matching a name."""

    spec = ModuleSpec(
        module_id=QUESTS,
        description={
            "zh": "查看任务（FTB 任务）：进行中和可领奖的任务列表，或按名称搜索任务。",
            "en": "Your quests (FTB Quests): those in progress or with a reward to claim, or "
            "the quests whose title contains a name.",
        },
        input_schema={
            "type": "object",
            "properties": {
                "name": {**_NAME, "description": "Search by title instead of the default list."}
            },
            "additionalProperties": False,
        },
        commands=(
            CommandSpec(
                ("quests", "任务", "任务列表"),
                argument="name",
                argument_label={"zh": "名称", "en": "name"},
            ),
        ),
        routing_mode=catalog_pb2.ROUTING_MODE_READ,
        owner_feature=FEATURE,
        semantic=SemanticSpec(
            examples={
                "zh": (
                    "查看任务",
                    "我的任务",
                    "任务进度",
                    "进行中的任务",
                    "显示任务列表",
                    "打开任务书",
                    "还有哪些任务没完成",
                    "查看当前任务",
                    "任务清单",
                    "我在做哪些任务",
                ),
                "en": (
                    "show my quests",
                    "quest list",
                    "quest progress",
                    "open the quest book",
                    "which quests are in progress",
                    "what quests am I doing",
                    "list active quests",
                    "unfinished quests",
                ),
            },
        ),
        tools=(QUEST_QUERY, QUEST_FIND),
        policy=_POLICY,
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        name = str(data.get("name", "")).strip()
        if name:
            found = await ctx.tool(QUEST_FIND, {"name": name})
            title = pick(_FOUND_TITLE, language, name=name, total=found["total"])
            empty = pick(_NONE_FOUND, language, name=name)
        else:
            found = await ctx.tool(QUEST_QUERY, {})
            title = pick(_LIST_TITLE, language, total=found["total"])
            empty = pick(_EMPTY, language)
        lines, buttons = _entries(found["quests"], language)
        if not found["quests"]:
            lines.append(empty)
        elif found["total"] > len(found["quests"]):
            lines.append(pick(_MORE, language, shown=len(found["quests"])))
        return succeeded(card(QUESTS, title, lines, buttons))


class QuestDetailModule:
    """Shows one quest: by id, by its number in the quest list, or by name."""

    spec = ModuleSpec(
        module_id=DETAIL,
        description={
            "zh": "查看一个任务的详情（要求、进度、奖励）：按任务编号、任务列表里的序号或任务名称；"
            "名称对应多个任务时列出候选。完成的任务在详情卡片上领取奖励。",
            "en": "One quest's details (tasks, progress, rewards): by quest id, by its number in "
            "the quest list, or by name; a name several quests match lists them. Claim a "
            "completed quest's reward from its card.",
        },
        input_schema={
            "type": "object",
            "properties": {
                "quest_id": _QUEST_ID,
                "index": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAX_INDEX,
                    "description": "The quest's number in the quest list (in progress or "
                    "claimable), from 1.",
                },
                "query": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 64,
                    "description": "A list number, a quest id or (part of) a title.",
                },
            },
            "minProperties": 1,
            "maxProperties": 1,
            "additionalProperties": False,
        },
        commands=(
            CommandSpec(
                ("quest", "任务详情"),
                argument="query",
                argument_required=True,
                argument_label={"zh": "序号、编号或名称", "en": "number, id or name"},
            ),
        ),
        routing_mode=catalog_pb2.ROUTING_MODE_READ,
        owner_feature=FEATURE,
        semantic=SemanticSpec(
            examples={
                "zh": (
                    "查看任务 1",
                    "任务 2 详情",
                    "第 3 个任务的详情",
                    "打开第 1 个任务",
                    "看看任务 4 的要求",
                    "任务 5 需要做什么",
                    "查看第 2 项任务",
                    "第 6 个任务要求",
                ),
                "en": (
                    "show quest 1",
                    "quest 2 details",
                    "details of quest 3",
                    "open quest 3",
                    "what does quest 4 require",
                    "view quest number 2",
                    "requirements of the 2nd quest",
                    "quest 5 requirements",
                ),
            },
            extractor="list_index",
        ),
        tools=(QUEST_QUERY, QUEST_FIND, QUEST_DETAIL, GIFT_LIST),
        # At most: the list (for a number) or an id try and a name search, the detail, the gift.
        policy=ExecutionPolicy(rounds=1, model_calls=0, tool_calls=4, steps=4, seconds=15.0),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        if "quest_id" in data:
            return await self._show(str(data["quest_id"]).strip(), ctx)
        if "index" in data:
            return await self._by_index(int(data["index"]), ctx)
        query = str(data["query"]).strip()
        number = _NUMBER.match(query)
        if number:
            return await self._by_index(int(number.group(1)), ctx)
        found = await ctx.tool(QUEST_DETAIL, {"quest_id": query})
        if found["found"] and "quest" in found:
            return succeeded(await self._card(found["quest"], ctx))
        matches = await ctx.tool(QUEST_FIND, {"name": query})
        quests = matches["quests"]
        exact = [
            q for q in quests if query.casefold() in (t.casefold() for t in q["title"].values())
        ]
        if len(exact) == 1 or len(quests) == 1:
            return await self._show((exact or quests)[0]["id"], ctx)
        if not quests:
            return failed(
                AgentFailure.NOT_FOUND,
                pick(_NONE_FOUND, language, name=query),
                title=pick(_NO_QUEST_TITLE, language),
            )
        # Ambiguous: the candidates as buttons (查看 2 picks the second).
        lines, buttons = _entries(quests, language)
        lines.append(pick(_PICK_ONE, language))
        title = pick(_CANDIDATES_TITLE, language, total=matches["total"], name=query)
        return succeeded(card(DETAIL, title, lines, buttons))

    async def _by_index(self, index: int, ctx: ModuleContext) -> common_pb2.AgentResult:
        """The index-th quest of the default list (what /quests shows, numbered from 1)."""
        listed = await ctx.tool(QUEST_QUERY, {})
        if not 1 <= index <= len(listed["quests"]):
            language = ctx.player.language
            return failed(
                AgentFailure.NOT_FOUND,
                pick(_NO_INDEX, language, index=index, total=listed["total"]),
                title=pick(_NO_QUEST_TITLE, language),
            )
        return await self._show(listed["quests"][index - 1]["id"], ctx)

    async def _show(self, quest_id: str, ctx: ModuleContext) -> common_pb2.AgentResult:
        found = await ctx.tool(QUEST_DETAIL, {"quest_id": quest_id})
        if not found["found"] or "quest" not in found:
            return _not_found(quest_id, ctx.player.language)
        return succeeded(await self._card(found["quest"], ctx))

    @staticmethod
    async def _card(quest: dict[str, Any], ctx: ModuleContext) -> common_pb2.Card:
        language = ctx.player.language
        status = quest["status"]
        requires = ", ".join(pick(r["title"], language) for r in quest["requires"])
        lines: list[str | tuple[str, str]] = [
            pick(_CHAPTER, language, chapter=pick(quest["chapter"], language)),
            pick(_STATUS_LINE[status], language, progress=quest["progress"], requires=requires),
            pick(quest["description"], language),
            pick(_TASKS, language),
        ]
        for task in quest["tasks"]:
            text = pick(
                _TASK[task["kind"]],
                language,
                name=pick(task["name"], language),
                done=task["done"],
                required=task["required"],
            )
            lines.append((text, f"/item {task['target']}") if task["kind"] == "item" else text)
        if quest["rewards"]:
            lines.append(pick(_REWARDS, language))
            lines += _stacks(quest["rewards"], language)
        if quest["starter_gift"]:
            # starter_gift only names the gift; its items come from the shared gift list.
            gift = await ctx.tool(GIFT_LIST, {"gift_id": quest["starter_gift"]})
            if gift["found"] and "gift" in gift:
                lines.append(pick(_GIFT, language, gift=pick(gift["gift"]["name"], language)))
                lines += _stacks(gift["gift"]["items"], language)
            else:
                lines.append(pick(_NO_GIFT, language, gift_id=quest["starter_gift"]))
        buttons = []
        if status == "claimable":
            # press_only: a typed number (查看 1) never presses a write button.
            buttons.append(
                invoke(
                    CLAIM,
                    pick(_CLAIM_BUTTON, language),
                    {"quest_id": quest["id"]},
                    press_only=True,
                    label_key="claim",
                )
            )
        buttons.append(_back(language))
        return card(DETAIL, pick(quest["title"], language), lines, buttons)


class QuestClaimModule:
    """Claims one completed quest's reward: one write step."""

    spec = ModuleSpec(
        module_id=CLAIM,
        description={
            "zh": "领取已完成任务的奖励（在任务详情卡片上按“领取奖励”）。每个任务只能领取一次。",
            "en": "Claim a completed quest's reward (the Claim button on the quest's card). "
            "Once per quest.",
        },
        input_schema={
            "type": "object",
            "properties": {"quest_id": _QUEST_ID},
            "required": ["quest_id"],
            "additionalProperties": False,
        },
        commands=(
            CommandSpec(
                ("questclaim", "领取任务奖励"),
                argument="quest_id",
                argument_required=True,
                argument_label={"zh": "任务编号", "en": "quest id"},
            ),
        ),
        routing_mode=catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY,
        owner_feature=FEATURE,
        tools=(QUEST_CLAIM,),
        policy=ExecutionPolicy(
            rounds=1, model_calls=0, tool_calls=1, steps=1, seconds=15.0, write_steps=1
        ),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        quest_id = str(data["quest_id"]).strip()
        # A write step: refused from local and cached routes before it leaves the engine.
        claimed = await ctx.tool(QUEST_CLAIM, {"quest_id": quest_id})
        outcome = claimed["outcome"]
        if outcome == "not_found":
            return _not_found(quest_id, language, claiming=True)
        if outcome == "not_complete":
            return failed(
                AgentFailure.NOT_FOUND,
                pick(_NOT_COMPLETE, language, quest_id=quest_id),
                title=pick(_NOT_COMPLETE_TITLE, language),
            )
        if outcome == "already_claimed":
            return succeeded(
                card(
                    CLAIM,
                    pick(_ALREADY_TITLE, language),
                    [pick(_ALREADY, language, quest_id=quest_id)],
                    [_back(language)],
                )
            )
        lines = [*_stacks(claimed["items"], language), pick(_DELIVERED, language)]
        return succeeded(card(CLAIM, pick(_CLAIMED_TITLE, language), lines, [_back(language)]))
