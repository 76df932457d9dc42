"""Argument extractors: a module's input re-parsed from the player's text of this request.

Never from the matched example, never from history: a missing or ambiguous argument gives None,
and None blocks a direct route (the model or a card decides instead).

| extractor    | input it returns        | accepts                                           |
|--------------|-------------------------|---------------------------------------------------|
| `item_id`    | `{"item_id": "ns:path"}` | exactly one registry id (`minecraft:diamond`)     |
| `list_index` | `{"index": 3}`          | exactly one list number: `查看 1`, `view 2`, `第3个`, `第三个`, `#4` |
| `name`       | `{"name": "Dragon"}`    | exactly one quoted name, else the text after a leading verb (`查看 任务名`, `view Dragon Slayer`) |
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from router_service.semantic.text import ITEM_ID, clean, normalize

__all__ = ["EXTRACTORS", "extract", "item_id", "list_index", "name"]

MAX_INDEX = 9999
MAX_NAME_CHARS = 64

_DIGITS = {"零": 0, "〇": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5, "六": 6}
_DIGITS |= {"七": 7, "八": 8, "九": 9}
_INDEX = re.compile(
    r"第\s*(?P<ordinal>[0-9]+|[零〇一二两三四五六七八九十百]+)\s*[个项条页位号]?"
    r"|(?<![a-z0-9_])#?(?P<number>[0-9]+)(?![a-z0-9_])"
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


def _chinese_number(text: str) -> int | None:
    """`三` → 3, `十二` → 12, `二十` → 20, `一百零五` → 105; None for anything else."""
    total, current = 0, 0
    for ch in text:
        if ch in _DIGITS:
            current = _DIGITS[ch]
        elif ch == "十":
            total += (current or 1) * 10
            current = 0
        elif ch == "百":
            total += (current or 1) * 100
            current = 0
        else:
            return None
    return total + current


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
        value = int(ordinal) if ordinal.isdigit() else _chinese_number(ordinal)
    if value is None or not 1 <= value <= MAX_INDEX:
        return None
    return {"index": value}


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


EXTRACTORS: Mapping[str, Callable[[str], dict[str, Any] | None]] = MappingProxyType(
    {"item_id": item_id, "list_index": list_index, "name": name}
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
