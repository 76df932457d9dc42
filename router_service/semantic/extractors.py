"""Argument extractors: a module's input re-parsed from the player's text of this request.

Never from the matched example, never from history: a missing or ambiguous argument gives None,
and None blocks a direct route (the model or a card decides instead).

| extractor    | input it returns        | accepts                                           |
|--------------|-------------------------|---------------------------------------------------|
| `item_id`    | `{"item_id": "ns:path"}` | exactly one registry id (`minecraft:diamond`)     |
| `list_index` | `{"index": 3}`          | exactly one list number: `查看 1`, `view 2`, `第3个`, `第三个`, `#4`, `the 2nd quest` |
| `name`       | `{"name": "Dragon"}`    | exactly one quoted name, else the text after a leading verb (`查看 任务名`, `view Dragon Slayer`) |
| `item`       | `{"item_id": ...}` or `{"query": "火把"}` | what `item_id` accepts; else, with no registry id in the text, the item a question about making or getting it names: the words around its frame (`火把怎么合成`, `怎么制作蛋糕`, `钻石在哪里找`, `铁锭的来源`, `how do I craft a torch`, `where does obsidian come from`, `recipe for a chest`) |
| `price`      | `{"query": "钻石"}` or `{}` | the item a price question names (`钻石多少钱`, `火把在商店卖多少钱`, `金锭的价格`, `how much is a diamond`, `how much do torches cost in the shop`, `price of iron ingots`); `{}` for a text that asks no price (`open the shop`); None for a price question about no item (`我有多少钱`, `how much is that`) |
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from router_service.semantic.text import ITEM_ID, clean, normalize
from services.texts import CHINESE_NUMERALS, chinese_number

__all__ = ["EXTRACTORS", "extract", "item", "item_id", "list_index", "list_pick", "name", "price"]

MAX_INDEX = 9999
MAX_NAME_CHARS = 64

_INDEX = re.compile(
    rf"第\s*(?P<ordinal>[0-9]+|[{CHINESE_NUMERALS}]+)\s*[个项条页位号]?"
    r"|(?<![a-z0-9_])#?(?P<number>[0-9]+)(?:st|nd|rd|th)?(?![a-z0-9_])"
)
_QUOTED = re.compile(
    r'"(?P<a>[^"]+)"|“(?P<b>[^”]+)”|「(?P<c>[^」]+)」|『(?P<d>[^』]+)』|《(?P<e>[^》]+)》'
    r"|(?<!\w)'(?P<f>[^']+)'(?!\w)"
)
_AFTER_VERB = re.compile(
    r"^(?:please\s+|请|帮我)?"
    r"(?:查看|查询|查找|搜索|找找|找|看看|看|打开|详情|view|show|open|find|search(?:\s+for)?"
    r"|look\s*up|look\s+for|details?\s+(?:of|for))"
    r"(?:\s+|(?<=[\u3400-\u9fff]))(?P<name>.+?)"
    r"[\s.?!。？！]*(?:吧|吗|呢|please|pls)?[\s.?!。？！]*$",
    re.IGNORECASE,
)
_SEPARATORS = re.compile(r"[,，、;；]|\s(?:and|or)\s|和|或")


def item_id(text: str) -> dict[str, Any] | None:
    """`{"item_id": id}` when the text holds exactly one registry id (repeats count once)."""
    ids = {m.group() for m in ITEM_ID.finditer(normalize(text))}
    return {"item_id": ids.pop()} if len(ids) == 1 else None


def list_index(text: str) -> dict[str, Any] | None:
    """`{"index": n}` when the text holds exactly one list number, 1..9999."""
    masked = ITEM_ID.sub(" ", normalize(text))  # `minecraft:stone_2` is no list number
    found = list(_INDEX.finditer(masked))
    if len(found) != 1:
        return None
    match = found[0]
    if match.group("number") is not None:
        value: int | None = int(match.group("number"))
    else:
        ordinal = match.group("ordinal")
        value = int(ordinal) if ordinal.isdigit() else chinese_number(ordinal)
    if value is None or not 1 <= value <= MAX_INDEX:
        return None
    return {"index": value}


_ORDINAL_WORDS = {
    w: i + 1
    for i, w in enumerate(
        ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth")
    )
}
_PICK = re.compile(
    r"^/?(?:please\s+|请|麻烦)?"
    r"(?:(?:view|show(?:\s+me)?|open|pick|choose|select|see|check|look\s+at|go\s+to|take"
    r"|i(?:'ll|\s+will)?\s+(?:want|choose|pick|take))\s+)?"
    r"(?:查看|看看|看|打开|点开|选择|选|我要|要|就)?\s*"
    r"(?:the\s+|number\s+|no\.\s*)?"
    rf"(?P<index>第\s*(?:[0-9]+|[{CHINESE_NUMERALS}]+)|#?[0-9]+(?:st|nd|rd|th)?"
    r"|first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)"
    r"\s*(?:个|项|条|位|号|one|item|entry)?"
    r"\s*(?:吧|呢|please|pls)?[\s.?!。？！]*$",
    re.IGNORECASE,
)


def list_pick(text: str) -> int | None:
    """The number when the whole text only picks from a numbered list (`2`, `查看 2`, `view 2`,
    `/view 2`, `第二个`, `the second one`, `#3`), else None: a text that says more asks for
    something of its own (`buy 3 bread`, `give me 5 diamonds`), whatever list is shown."""
    match = _PICK.match(normalize(text).strip())
    if match is None:
        return None
    index = match.group("index")
    if index in _ORDINAL_WORDS:
        return _ORDINAL_WORDS[index]
    found = list_index(index)
    return int(found["index"]) if found else None


def name(text: str) -> dict[str, Any] | None:
    """`{"name": ...}` from exactly one quoted span, else from the text after a leading verb;
    kept as typed (case included). None when missing, ambiguous or longer than 64 characters."""
    cleaned = clean(text)
    quoted = [next(g for g in m.groups() if g is not None) for m in _QUOTED.finditer(cleaned)]
    if quoted:
        value = quoted[0].strip() if len(quoted) == 1 else ""
    else:
        match = _AFTER_VERB.match(cleaned)
        value = match.group("name").strip() if match else ""
        if _SEPARATORS.search(value):
            return None  # a list of names is ambiguous
    if not value or len(value) > MAX_NAME_CHARS:
        return None
    return {"name": value}


# An item question's frame (`item`): how to make or get it, where it is found or comes from,
# its recipe or source (what the item card shows); the item is the words the frame leaves.
# Only whole-text matches count, so a sentence that says more than the question is not read
# as a name.
_ZH_HOW = r"(?:要?怎么|要?怎样|如何|咋)(?:才能|能|可以)?"
_ZH_MAKE = r"(?:合成|制作|制造|获得|得到|获取|弄到|拿到|搞到|找到)"
# `物品栏` is the inventory, not a lookup of `栏`.
_ZH_BEFORE = rf"(?:请|帮我)?(?:(?:查询|查看|查找|查一下|查下|搜索|搜一下|看看|看一下)物品(?!栏)|{_ZH_HOW}{_ZH_MAKE})"
_ZH_AFTER = (
    rf"(?:{_ZH_HOW}{_ZH_MAKE}"
    r"|(?:从|在|去)?(?:哪里|哪儿|哪)(?:能|可以)?(?:获得|得到|获取|找到|找|弄到|挖到|刷到)"
    r"|(?:哪里|哪儿)有|从(?:哪里|哪儿)来"
    r"|的?(?:合成|制作)?(?:配方|合成表|合成方法|做法|来源|获取方式|获得方式|获取方法|获得方法))"
)
_ZH_ITEM_QUESTION = re.compile(
    rf"^(?:{_ZH_BEFORE}\s*(.+?)\s*(?:{_ZH_AFTER})?"
    rf"|(.+?)\s*{_ZH_AFTER})"
    r"[\s?!。？！]*(?:呀|啊|呢|吗|嘛|啦)?[\s?!。？！]*$"
)
_EN_ARTICLE = r"(?:(?:a|an|the|some)\s+)?"
_EN_ITEM_QUESTION = re.compile(
    r"^(?:please\s+)?(?:"
    rf"(?:how\s+(?:do|can|would|should)\s+(?:i|you|we|one)\s+|how\s+to\s+)"
    rf"(?:craft|make|get|obtain|find|smelt|brew)\s+{_EN_ARTICLE}(.+?)"
    rf"|where\s+(?:(?:do|can|would)\s+(?:i|you|we|one)|to)\s+(?:find|get|obtain|mine|farm)\s+"
    rf"{_EN_ARTICLE}(.+?)"
    rf"|where\s+(?:does|do)\s+{_EN_ARTICLE}(.+?)\s+come\s+from"
    rf"|(?:crafting\s+)?recipe\s+(?:for|of)\s+{_EN_ARTICLE}(.+?)"
    rf"|(?:look\s*up|find|search(?:\s+for)?|show)\s+(?:the\s+)?item\s+(.+?)"
    rf"|{_EN_ARTICLE}(.+?)\s+(?:crafting\s+)?recipe"
    r")[\s.?!]*(?:please|pls)?[\s.?!]*$",
    re.IGNORECASE,
)
_NOT_AN_ITEM = re.compile(
    r"^(?:(?:它|它们|这|那|这个|那个|这些|那些|东西|物品|你|我|他|她"
    r"|it|this|that|these|those|them|one|items?|thing|you)$"
    r"|(?:我|你|他|她|我们|你们)的"
    r"|(?:my|your|our|his|her|their|to|into|from|out|back|rid|better|more|there|here|home)\b)",
    re.IGNORECASE,
)
"""What an item question's frame may leave that names no item: a reference, a person or the
word `item` itself (the reference guard and the model take those), a player's own thing
(`我的背包`, `my balance`), which the item lookup does not know, or a place or way (`how do I
get to the nether`, `get better`)."""


def item(text: str) -> dict[str, Any] | None:
    """`item_id`'s answer when the text holds a registry id (None for two or more); else
    `{"query": name}` for the item a lookup question names (see `_ZH_ITEM_QUESTION`,
    `_EN_ITEM_QUESTION`), kept as typed: the lookup finds it by name. None when no frame
    holds the whole text, or what it leaves is a reference, a list or over 64 characters."""
    if ITEM_ID.search(normalize(text)):
        return item_id(text)
    cleaned = clean(text)
    match = _ZH_ITEM_QUESTION.match(cleaned) or _EN_ITEM_QUESTION.match(cleaned)
    if match is None:
        return None
    value = next(group for group in match.groups() if group)  # one frame's name matched
    if len(value) > MAX_NAME_CHARS or _NOT_AN_ITEM.search(value) or _SEPARATORS.search(value):
        return None
    return {"query": value}


# A price question's frame (`price`): what an item costs, in the shop or not; the item is the
# words the frame leaves. Whole-text matches only, as for `item`.
_ZH_SHOP = r"(?:在|到)?(?:商店|商城|商铺|店里)(?:里)?"
_ZH_PRICE_QUESTION = re.compile(
    r"^(?:请问|请|帮我)?(?:看看|看一下|查看|查询|查一下|查下|显示|浏览)?"
    rf"(?:{_ZH_SHOP}的?)?(.*?)\s*(?:{_ZH_SHOP})?"
    r"(?:(?:要|卖|买|需要)?(?:多少钱|多少金币|几个金币|什么价(?:格|钱)?|怎么卖)"
    r"|的?(?:价格|价钱|售价|单价)(?:是)?(?:多少|几何)?)"
    r"[\s?!。？！]*(?:呀|啊|呢|吗|嘛|啦)?[\s?!。？！]*$"
)
_EN_SHOP = r"(?:\s+(?:in|at|from)\s+the\s+(?:shop|store|market))?"
_EN_PRICE_QUESTION = re.compile(
    r"^(?:please\s+)?(?:"
    rf"how\s+much\s+(?:is|are|does|do)\s+{_EN_ARTICLE}(.+?){_EN_SHOP}(?:\s+cost)?{_EN_SHOP}"
    rf"|what\s+(?:is|'s)\s+the\s+price\s+of\s+{_EN_ARTICLE}(.+?){_EN_SHOP}"
    rf"|(?:the\s+)?price\s+(?:of|for)\s+{_EN_ARTICLE}(.+?){_EN_SHOP}"
    rf"|what\s+(?:does|do)\s+{_EN_ARTICLE}(.+?)\s+cost{_EN_SHOP}"
    r")[\s.?!]*(?:please|pls)?[\s.?!]*$",
    re.IGNORECASE,
)
_NOT_FOR_SALE = re.compile(
    r"^(?:我|你|咱)"  # `我有多少钱`, `我还剩多少金币`: the player's own money
    r"|^(?:还有|现在|一共|总共|they|money|coins?|gold|(?:这|那)(?:个|些|件|种|样)?(?:商品|东西|物品)?)$",
    re.IGNORECASE,
)
"""What a price frame may leave that is not for sale, beyond `_NOT_AN_ITEM` (also asked): a
player's own money (`我有多少钱`, `how much money`: the profile's balance) or a reference to
goods (`那个商品`: the reference guard and the model)."""
_ANY_GOODS = re.compile(
    r"^(?:商品|东西|物品|所有商品|全部商品|所有东西|items?|things|everything)?$"
)
"""What a price frame leaves when it asks about the goods in general (`看看商店的价格`,
`查看商品价格`): a browse of the shop, no search."""


def price(text: str) -> dict[str, Any] | None:
    """`{"query": name}` for the item a price question names (see `_ZH_PRICE_QUESTION`,
    `_EN_PRICE_QUESTION`), kept as typed; `{}` for a text that asks no price, or the price of
    the goods in general (the shop, no search); None for a price question whose words name
    nothing for sale: the player's own money, a reference, a list, or over 64 characters."""
    cleaned = clean(text)
    match = _ZH_PRICE_QUESTION.match(cleaned) or _EN_PRICE_QUESTION.match(cleaned)
    if match is None:
        return {}
    value = next((group for group in match.groups() if group), "")
    if _ANY_GOODS.match(value):
        return {}
    if (
        len(value) > MAX_NAME_CHARS
        or _NOT_FOR_SALE.search(value)
        or _NOT_AN_ITEM.search(value)
        or _SEPARATORS.search(value)
    ):
        return None
    return {"query": value}


EXTRACTORS: Mapping[str, Callable[[str], dict[str, Any] | None]] = MappingProxyType(
    {"item_id": item_id, "list_index": list_index, "name": name, "item": item, "price": price}
)
"""Extractor name → function of the text."""


def extract(extractor: str | None, text: str) -> dict[str, Any] | None:
    """Runs the named extractor on `text`; `{}` for a module without one (no arguments).

    Raises:
        KeyError: an extractor name that does not exist.
    """
    if extractor is None:
        return {}
    return EXTRACTORS[extractor](text)
