"""`system:item` (物品): looks an item up by registry id or by name (物品 ID 查询) and shows
where it comes from (物品来源: crafting, smelting, mob drops, mining, the shop), read from the
game server's registry through the game tool `minecraft:item.lookup`.

`/item 钻石`, `/item diamond` and `/item minecraft:diamond` give the item's card; a name that
matches several items (`/item 剑`) gives a card of candidates, one button each (pressing one,
or `查看 2`, opens that item); an unknown item gives a NOT_FOUND card saying what was looked
for. Local routing passes the id it parsed from the text (`查询物品 minecraft:diamond`) as
`item_id`, or the name an item question asks about (`火把怎么合成`, `where do I find diamonds`:
the router's `item` extractor) as `query`; an English plural that names nothing is looked up
once more as its singular (`diamonds`, `torches`).
"""

from __future__ import annotations

from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.modules.buttons import invoke
from engine_service.modules.text import pick, singular
from engine_service.registry import (
    CommandSpec,
    ExecutionPolicy,
    ModuleContext,
    ModuleSpec,
    SemanticSpec,
)
from services.results import AgentFailure, card, failed, succeeded

__all__ = ["ITEM_LOOKUP", "ItemModule"]

ITEM_LOOKUP = "minecraft:item.lookup"
MODULE_ID = "system:item"
_OTHER_LANGUAGE = {"zh": "en", "en": "zh"}

_TITLE = {"zh": "物品：{name}", "en": "Item: {name}"}
_ID = {"zh": "ID：{id}", "en": "ID: {id}"}
_OTHER_NAME = {"zh": "英文名：{name}", "en": "Chinese name: {name}"}
_SOURCES = {"zh": "来源：", "en": "Where it comes from:"}
_NO_SOURCE = {"zh": "  暂无已知来源。", "en": "  No known source."}
_CRAFTING = {"zh": "  合成：{inputs} → {count} 个", "en": "  Crafting: {inputs} → {count}"}
_SMELTING = {"zh": "  熔炼：{input}", "en": "  Smelting: {input}"}
_DROPS = {"zh": "  生物掉落：{mobs}", "en": "  Dropped by: {mobs}"}
_MINING = {"zh": "  挖掘：{blocks}", "en": "  Mined from: {blocks}"}
_SHOP = {
    "zh": "  商店：{price} {currency}（库存 {stock}）",
    "en": "  Shop: {price:~~{currency}} ({stock} in stock)",
}
_SEPARATOR = {"zh": "、", "en": ", "}
_CANDIDATES_TITLE = {"zh": "找到 {total} 个物品", "en": "{total} items match"}
_CANDIDATES_INTRO = {
    "zh": "「{query}」对应多个物品，选一个查看：",
    "en": "Several items match “{query}”; pick one:",
}
_MORE = {
    "zh": "另有 {more} 个未列出，请输入更完整的名称。",
    "en": "{more} more not listed; type more of the name.",
}
_NOT_FOUND_TITLE = {"zh": "没有找到物品", "en": "No such item"}
_NOT_FOUND = {
    "zh": "没有找到「{query}」。可以输入物品 ID（minecraft:diamond）或名称（钻石、diamond）。",
    "en": "Nothing matches “{query}”. Type an item id (minecraft:diamond) or a name "
    "(diamond, 钻石).",
}


class ItemModule:
    """One lookup; the item's card, a card of candidates, or NOT_FOUND."""

    spec = ModuleSpec(
        module_id=MODULE_ID,
        description={
            "zh": "按物品 ID 或名称查询物品及其来源（合成、掉落、商店）。",
            "en": "Look up an item by id or name, and where it comes from "
            "(crafting, drops, the shop).",
        },
        input_schema={
            "type": "object",
            "properties": {
                "query": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 64,
                    "description": "An item id or name as the player typed it (钻石, diamond).",
                },
                "item_id": {
                    "type": "string",
                    "maxLength": 128,
                    "pattern": "^[a-z0-9_.-]+:[a-z0-9_./-]+$",
                    "description": "A registry id, namespace:path (minecraft:diamond).",
                },
            },
            "minProperties": 1,
            "maxProperties": 1,
            "additionalProperties": False,
        },
        commands=(
            CommandSpec(
                ("item", "物品", "查询物品"),
                argument="query",
                argument_required=True,
                argument_label={"zh": "物品 ID 或名称", "en": "item id or name"},
            ),
        ),
        routing_mode=catalog_pb2.ROUTING_MODE_READ,
        semantic=SemanticSpec(
            examples={
                "zh": (
                    "查询物品 minecraft:diamond",
                    "查看物品 minecraft:iron_ingot 的信息",
                    "minecraft:elytra 是什么",
                    "查一下 minecraft:redstone",
                    "minecraft:beacon 这个物品是什么",
                    "物品ID minecraft:apple 的资料",
                    "查看 minecraft:stone 的用途",
                    "minecraft:iron_ingot 的物品来源",
                    "火把怎么合成",
                    "钻石剑怎么制作",
                    "铁锭从哪里获得",
                    "工作台的合成配方",
                    "末影珍珠在哪里找",
                    "面包怎么得到",
                    "怎么合成熔炉",
                ),
                "en": (
                    "look up item minecraft:diamond",
                    "what is minecraft:elytra",
                    "show item info for minecraft:iron_ingot",
                    "item details minecraft:beacon",
                    "check item id minecraft:oak_log",
                    "what is the item minecraft:redstone used for",
                    "info about minecraft:apple",
                    "item info minecraft:stone",
                    "where does minecraft:ender_pearl come from",
                    "how do I get minecraft:iron_ingot",
                    "torch crafting recipe",
                    "where to find iron ore",
                    "crafting recipe for a furnace",
                    "where to get ender pearls",
                    "diamond sword recipe",
                ),
            },
            extractor="item",
            choice_label="system.item.choice",
        ),
        tools=(ITEM_LOOKUP,),
        policy=ExecutionPolicy(rounds=1, model_calls=0, tool_calls=2, steps=2, seconds=10.0),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        by_id = "item_id" in data
        query = str(data["item_id"] if by_id else data["query"]).strip()
        # Checked against the tool's output schema before it gets here (docs/game-tools.md).
        found = await ctx.tool(ITEM_LOOKUP, {"query": query})
        items = found["items"]
        if by_id:  # an id names one item or none: never show near misses for it
            items = [i for i in items if i["id"] == query]
        again = None if by_id or items else singular(query)
        if again is not None:
            found = await ctx.tool(ITEM_LOOKUP, {"query": again})
            items = found["items"]
        if not items:
            return failed(
                AgentFailure.NOT_FOUND,
                pick(_NOT_FOUND, language, query=query),
                title=pick(_NOT_FOUND_TITLE, language),
            )
        if len(items) == 1 and (found["exact"] or found["total"] == 1):
            return succeeded(self._item_card(items[0], language))
        return succeeded(self._candidates_card(query, items, found["total"], language))

    @staticmethod
    def _item_card(item: dict[str, Any], language: str) -> common_pb2.Card:
        name = pick(item["name"], language)
        other = item["name"].get(_OTHER_LANGUAGE.get(language, "zh"), "")
        lines: list[str | tuple[str, str]] = [pick(_ID, language, id=item["id"])]
        if other and other != name:
            lines.append(pick(_OTHER_NAME, language, name=other))
        lines.append(pick(_SOURCES, language))
        sources = item["sources"]
        join = pick(_SEPARATOR, language).join
        for recipe in sources["crafting"]:
            inputs = join(f"{i['count']} × {pick(i['name'], language)}" for i in recipe["inputs"])
            first = recipe["inputs"][0]["id"]
            lines.append(
                (
                    pick(_CRAFTING, language, inputs=inputs, count=recipe["count"]),
                    f"/item {first}",
                )
            )
        for smelt in sources["smelting"]:
            lines.append(
                (
                    pick(_SMELTING, language, input=pick(smelt["input"]["name"], language)),
                    f"/item {smelt['input']['id']}",
                )
            )
        if sources["drops"]:
            mobs = join(pick(d["mob"]["name"], language) for d in sources["drops"])
            lines.append(pick(_DROPS, language, mobs=mobs))
        if sources["mining"]:
            blocks = join(pick(m["block"]["name"], language) for m in sources["mining"])
            lines.append(pick(_MINING, language, blocks=blocks))
        for listing in sources["shop"]:
            lines.append(
                pick(
                    _SHOP,
                    language,
                    price=listing["price"],
                    currency=pick(listing["currency"], language),
                    stock=listing["stock"],
                )
            )
        if not any(sources[kind] for kind in ("crafting", "smelting", "drops", "mining", "shop")):
            lines.append(pick(_NO_SOURCE, language))
        return card(MODULE_ID, pick(_TITLE, language, name=name), lines)

    @staticmethod
    def _candidates_card(
        query: str, items: list[dict[str, Any]], total: int, language: str
    ) -> common_pb2.Card:
        lines: list[str | tuple[str, str]] = [pick(_CANDIDATES_INTRO, language, query=query)]
        buttons = []
        for number, item in enumerate(items, 1):
            name = pick(item["name"], language)
            lines.append((f"{number}. {name} ({item['id']})", f"/item {item['id']}"))
            buttons.append(invoke(MODULE_ID, name, {"item_id": item["id"]}))
        if total > len(items):
            lines.append(pick(_MORE, language, more=total - len(items)))
        return card(MODULE_ID, pick(_CANDIDATES_TITLE, language, total=total), lines, buttons)
