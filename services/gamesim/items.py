"""The simulated world's item registry: names in Chinese and English, where each item comes
from (crafting, smelting, mob drops, mining), and the shop's listings. Data only, plus the
lookup `minecraft:item.lookup` answers with (docs/game-tools.md). Fixed and deterministic: the
tests and `make run` see the same world.

Names are the game's own (zh_cn and en_us language files). A real plugin reads recipes, loot
tables and its shop configuration instead.
"""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = [
    "BLOCKS",
    "CURRENCY",
    "ITEMS",
    "LOOKUP_LIMIT",
    "MOBS",
    "SHOP",
    "Item",
    "ShopListing",
    "lookup",
    "name_of",
]

LOOKUP_LIMIT = 10
"""Most items one lookup answers with (best first); `total` says how many matched."""

CURRENCY: Mapping[str, str] = MappingProxyType({"zh": "金币", "en": "coins"})
"""The server currency's name, per language."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One registry entry and where it comes from."""

    item_id: str
    zh: str
    en: str
    crafting: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] = ()
    """Recipes: (items made, ((input item, count), ...))."""
    smelting: tuple[str, ...] = ()
    """Items that smelt into this one in a furnace."""
    drops: tuple[str, ...] = ()
    """Mobs (entity ids in MOBS) that drop it."""
    mining: tuple[str, ...] = ()
    """Blocks (ids in BLOCKS or ITEMS) that drop it when broken."""


@dataclasses.dataclass
class ShopListing:
    """An item the server shop sells. `SHOP` holds the opening listings; each world's shop
    (shop.py) sells from its own copies, whose stock and price change."""

    item_id: str
    price: int
    """Price of one, in CURRENCY."""
    stock: int
    """How many are left to sell."""
    category: str
    """Browse category: `materials`, `tools`, `food`, `misc`."""


def _item(item_id: str, zh: str, en: str, **sources: Any) -> tuple[str, Item]:
    return f"minecraft:{item_id}", Item(f"minecraft:{item_id}", zh, en, **sources)


def _ids(*paths: str) -> tuple[str, ...]:
    return tuple(f"minecraft:{p}" for p in paths)


def _recipe(made: int, *inputs: tuple[str, int]) -> tuple[int, tuple[tuple[str, int], ...]]:
    return made, tuple((f"minecraft:{item}", count) for item, count in inputs)


ITEMS: Mapping[str, Item] = MappingProxyType(
    dict(
        [
            _item(
                "diamond",
                "钻石",
                "Diamond",
                crafting=(_recipe(9, ("diamond_block", 1)),),
                mining=_ids("diamond_ore", "deepslate_diamond_ore"),
            ),
            _item(
                "diamond_block",
                "钻石块",
                "Block of Diamond",
                crafting=(_recipe(1, ("diamond", 9)),),
            ),
            _item(
                "iron_ingot",
                "铁锭",
                "Iron Ingot",
                crafting=(_recipe(9, ("iron_block", 1)), _recipe(1, ("iron_nugget", 9))),
                smelting=_ids("raw_iron"),
                drops=_ids("iron_golem", "zombie"),
            ),
            _item("raw_iron", "粗铁", "Raw Iron", mining=_ids("iron_ore")),
            _item("iron_nugget", "铁粒", "Iron Nugget", crafting=(_recipe(9, ("iron_ingot", 1)),)),
            _item("iron_block", "铁块", "Block of Iron", crafting=(_recipe(1, ("iron_ingot", 9)),)),
            _item(
                "gold_ingot",
                "金锭",
                "Gold Ingot",
                crafting=(_recipe(1, ("gold_nugget", 9)),),
                smelting=_ids("raw_gold"),
                drops=_ids("zombified_piglin"),
            ),
            _item("raw_gold", "粗金", "Raw Gold", mining=_ids("gold_ore")),
            _item(
                "gold_nugget",
                "金粒",
                "Gold Nugget",
                crafting=(_recipe(9, ("gold_ingot", 1)),),
                drops=_ids("zombified_piglin"),
            ),
            _item("coal", "煤炭", "Coal", mining=_ids("coal_ore"), drops=_ids("wither_skeleton")),
            _item("charcoal", "木炭", "Charcoal", smelting=_ids("oak_log")),
            _item("oak_log", "橡木原木", "Oak Log", mining=_ids("oak_log")),
            _item("oak_planks", "橡木木板", "Oak Planks", crafting=(_recipe(4, ("oak_log", 1)),)),
            _item(
                "stick",
                "木棍",
                "Stick",
                crafting=(_recipe(4, ("oak_planks", 2)),),
                drops=_ids("witch"),
            ),
            _item(
                "crafting_table",
                "工作台",
                "Crafting Table",
                crafting=(_recipe(1, ("oak_planks", 4)),),
            ),
            _item("torch", "火把", "Torch", crafting=(_recipe(4, ("coal", 1), ("stick", 1)),)),
            _item("cobblestone", "圆石", "Cobblestone", mining=_ids("stone")),
            _item("stone", "石头", "Stone", smelting=_ids("cobblestone")),
            _item("furnace", "熔炉", "Furnace", crafting=(_recipe(1, ("cobblestone", 8)),)),
            _item(
                "wooden_pickaxe",
                "木镐",
                "Wooden Pickaxe",
                crafting=(_recipe(1, ("oak_planks", 3), ("stick", 2)),),
            ),
            _item(
                "stone_pickaxe",
                "石镐",
                "Stone Pickaxe",
                crafting=(_recipe(1, ("cobblestone", 3), ("stick", 2)),),
            ),
            _item(
                "iron_pickaxe",
                "铁镐",
                "Iron Pickaxe",
                crafting=(_recipe(1, ("iron_ingot", 3), ("stick", 2)),),
            ),
            _item(
                "diamond_pickaxe",
                "钻石镐",
                "Diamond Pickaxe",
                crafting=(_recipe(1, ("diamond", 3), ("stick", 2)),),
            ),
            _item(
                "wooden_sword",
                "木剑",
                "Wooden Sword",
                crafting=(_recipe(1, ("oak_planks", 2), ("stick", 1)),),
            ),
            _item(
                "stone_sword",
                "石剑",
                "Stone Sword",
                crafting=(_recipe(1, ("cobblestone", 2), ("stick", 1)),),
            ),
            _item(
                "iron_sword",
                "铁剑",
                "Iron Sword",
                crafting=(_recipe(1, ("iron_ingot", 2), ("stick", 1)),),
                drops=_ids("zombie"),
            ),
            _item(
                "diamond_sword",
                "钻石剑",
                "Diamond Sword",
                crafting=(_recipe(1, ("diamond", 2), ("stick", 1)),),
            ),
            _item("wheat", "小麦", "Wheat", mining=_ids("wheat")),
            _item("bread", "面包", "Bread", crafting=(_recipe(1, ("wheat", 3)),)),
            _item("apple", "苹果", "Apple", mining=_ids("oak_leaves")),
            _item(
                "golden_apple",
                "金苹果",
                "Golden Apple",
                crafting=(_recipe(1, ("gold_ingot", 8), ("apple", 1)),),
            ),
            _item("beef", "生牛肉", "Raw Beef", drops=_ids("cow")),
            _item("cooked_beef", "牛排", "Steak", smelting=_ids("beef")),
            _item("leather", "皮革", "Leather", drops=_ids("cow")),
            _item("feather", "羽毛", "Feather", drops=_ids("chicken")),
            _item("rotten_flesh", "腐肉", "Rotten Flesh", drops=_ids("zombie")),
            _item("bone", "骨头", "Bone", drops=_ids("skeleton")),
            _item("string", "线", "String", drops=_ids("spider")),
            _item(
                "white_wool",
                "白色羊毛",
                "White Wool",
                crafting=(_recipe(1, ("string", 4)),),
                drops=_ids("sheep"),
            ),
            _item("flint", "燧石", "Flint", mining=_ids("gravel")),
            _item(
                "arrow",
                "箭",
                "Arrow",
                crafting=(_recipe(4, ("flint", 1), ("stick", 1), ("feather", 1)),),
                drops=_ids("skeleton"),
            ),
            _item(
                "bow",
                "弓",
                "Bow",
                crafting=(_recipe(1, ("stick", 3), ("string", 3)),),
                drops=_ids("skeleton"),
            ),
            _item("gunpowder", "火药", "Gunpowder", drops=_ids("creeper", "ghast", "witch")),
            _item("sand", "沙子", "Sand", mining=_ids("sand")),
            _item("glass", "玻璃", "Glass", smelting=_ids("sand")),
            _item("tnt", "TNT", "TNT", crafting=(_recipe(1, ("gunpowder", 5), ("sand", 4)),)),
            _item("ender_pearl", "末影珍珠", "Ender Pearl", drops=_ids("enderman")),
            _item("blaze_rod", "烈焰棒", "Blaze Rod", drops=_ids("blaze")),
            _item(
                "redstone",
                "红石粉",
                "Redstone Dust",
                mining=_ids("redstone_ore"),
                drops=_ids("witch"),
            ),
            _item("emerald", "绿宝石", "Emerald", mining=_ids("emerald_ore")),
            _item("experience_bottle", "附魔之瓶", "Bottle o' Enchanting"),
            _item("elytra", "鞘翅", "Elytra"),
        ]
    )
)
"""Items by registry id, in a stable order."""

BLOCKS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        f"minecraft:{block}": names
        for block, names in {
            "diamond_ore": ("钻石矿石", "Diamond Ore"),
            "deepslate_diamond_ore": ("深层钻石矿石", "Deepslate Diamond Ore"),
            "iron_ore": ("铁矿石", "Iron Ore"),
            "gold_ore": ("金矿石", "Gold Ore"),
            "coal_ore": ("煤矿石", "Coal Ore"),
            "redstone_ore": ("红石矿石", "Redstone Ore"),
            "emerald_ore": ("绿宝石矿石", "Emerald Ore"),
            "gravel": ("沙砾", "Gravel"),
            "oak_leaves": ("橡树树叶", "Oak Leaves"),
        }.items()
    }
)
"""Blocks that are no item of the registry, (zh, en) by id; blocks that are items (stone,
sand, oak logs, wheat) are named by ITEMS."""

MOBS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        f"minecraft:{mob}": names
        for mob, names in {
            "zombie": ("僵尸", "Zombie"),
            "skeleton": ("骷髅", "Skeleton"),
            "creeper": ("苦力怕", "Creeper"),
            "spider": ("蜘蛛", "Spider"),
            "enderman": ("末影人", "Enderman"),
            "blaze": ("烈焰人", "Blaze"),
            "witch": ("女巫", "Witch"),
            "ghast": ("恶魂", "Ghast"),
            "wither_skeleton": ("凋灵骷髅", "Wither Skeleton"),
            "zombified_piglin": ("僵尸猪灵", "Zombified Piglin"),
            "iron_golem": ("铁傀儡", "Iron Golem"),
            "chicken": ("鸡", "Chicken"),
            "cow": ("牛", "Cow"),
            "sheep": ("绵羊", "Sheep"),
        }.items()
    }
)
"""Mobs (zh, en) by entity id."""

SHOP: tuple[ShopListing, ...] = tuple(
    ShopListing(f"minecraft:{item}", price, stock, category)
    for item, price, stock, category in (
        ("diamond", 100, 64, "materials"),
        ("iron_ingot", 10, 256, "materials"),
        ("gold_ingot", 25, 128, "materials"),
        ("oak_log", 2, 512, "materials"),
        ("torch", 1, 1024, "misc"),
        ("ender_pearl", 50, 16, "misc"),
        ("experience_bottle", 20, 64, "misc"),
        ("iron_pickaxe", 40, 20, "tools"),
        ("diamond_pickaxe", 400, 5, "tools"),
        ("diamond_sword", 300, 5, "tools"),
        ("bow", 30, 10, "tools"),
        ("arrow", 1, 512, "tools"),
        ("bread", 5, 200, "food"),
        ("apple", 3, 200, "food"),
        ("cooked_beef", 8, 100, "food"),
        ("golden_apple", 150, 8, "food"),
    )
)
"""The shop catalogue, in display order."""


def name_of(item_or_block: str) -> dict[str, str]:
    """`{"zh", "en"}` of an item, block or mob id, or the id itself in both languages."""
    item = ITEMS.get(item_or_block)
    if item is not None:
        return {"zh": item.zh, "en": item.en}
    zh, en = BLOCKS.get(item_or_block) or MOBS.get(item_or_block) or (item_or_block,) * 2
    return {"zh": zh, "en": en}


def _ref(thing: str, count: int | None = None) -> dict[str, Any]:
    ref: dict[str, Any] = {"id": thing, "name": name_of(thing)}
    if count is not None:
        ref["count"] = count
    return ref


def _entry(item: Item, shop: Mapping[str, ShopListing]) -> dict[str, Any]:
    """An item as `minecraft:item.lookup` answers it."""
    listing = shop.get(item.item_id)
    return {
        "id": item.item_id,
        "name": {"zh": item.zh, "en": item.en},
        "sources": {
            "crafting": [
                {"count": made, "inputs": [_ref(i, n) for i, n in inputs]}
                for made, inputs in item.crafting
            ],
            "smelting": [{"input": _ref(i)} for i in item.smelting],
            "drops": [{"mob": _ref(m)} for m in item.drops],
            "mining": [{"block": _ref(b)} for b in item.mining],
            "shop": []
            if listing is None
            else [{"price": listing.price, "stock": listing.stock, "currency": dict(CURRENCY)}],
        },
    }


def _fold(text: str) -> str:
    """Width and case folded, surrounding space dropped: `Ｄｉａｍｏｎｄ ` → `diamond`."""
    return unicodedata.normalize("NFKC", text).strip().casefold()


def lookup(
    query: str,
    items: Mapping[str, Item] = ITEMS,
    shop: tuple[ShopListing, ...] = SHOP,
) -> dict[str, Any]:
    """`minecraft:item.lookup`'s answer for `query`.

    Exact matches first: the registry id (`minecraft:diamond`, or `diamond` for the
    `minecraft:` namespace) or a whole name in either language (`钻石`, `diamond`). Without an
    exact match, the items whose id path or a name contains the query (`剑`, `sword`), in
    registry order. At most LOOKUP_LIMIT items; `total` counts all matches.
    """
    folded = _fold(query)
    listings = {listing.item_id: listing for listing in shop}
    exact = [
        item
        for item in items.values()
        if folded in (item.item_id, item.item_id.partition(":")[2], _fold(item.zh), _fold(item.en))
    ]
    found = exact
    if not exact and folded and ":" not in folded:
        found = [
            item
            for item in items.values()
            if folded in item.item_id.partition(":")[2]
            or folded in _fold(item.zh)
            or folded in _fold(item.en)
        ]
    return {
        "exact": bool(exact),
        "total": len(found),
        "items": [_entry(item, listings) for item in found[:LOOKUP_LIMIT]],
    }
