"""Choosing a player's text by language, counting in English, and reading Chinese numerals.

A template may write a count with the noun it counts: `{streak:~day}` reads `1 day` or `3 days`,
`{n:~entry|entries}` names an irregular plural (one form, or the singular and the plural
split by `|`); `{price:~~{currency}}` counts with a noun given in its plural, as a game server
names its currency (`1 coin`, `5 coins`). Chinese templates need none: the counter word does
not change.
"""

from __future__ import annotations

import string
from typing import Any

__all__ = ["chinese_number", "counted", "pick", "singular"]


def counted(n: Any, noun: str) -> str:
    """`n` and `noun` in agreement: `counted(1, "day")` is `1 day`, `counted(2, "day")` `2 days`,
    `counted(2, "entry|entries")` `2 entries`."""
    one, _, many = noun.partition("|")
    return f"{n} {one if n == 1 else (many or one + 's')}"


_PLURAL_ENDINGS = (("ies", "y"), ("ches", "ch"), ("shes", "sh"), ("xes", "x"), ("sses", "ss"))


def singular(word: str) -> str | None:
    """The singular of an English plural (`diamonds`, `torches`, `berries`); None for anything
    else (a Chinese word, `gold`, `glass`, and words in `us` or `is`: `cactus`, `this`)."""
    folded = word.casefold()
    if not word.isascii() or len(word) < 4 or not folded.endswith("s"):
        return None
    if folded.endswith(("us", "is")):
        return None
    for plural, single in _PLURAL_ENDINGS:
        if folded.endswith(plural) and len(word) > len(plural) + 1:  # `pies` is a pie
            return word[: -len(plural)] + single
    return None if folded.endswith("ss") else word[:-1]


def _counted_plural(n: Any, plural: str) -> str:
    """`n` with a noun given in its plural: `1 coin`, `2 coins`, `1 金币`."""
    return f"{n} {(singular(plural) or plural) if n == 1 else plural}"


class _Counting(string.Formatter):
    def format_field(self, value: Any, format_spec: str) -> str:
        if format_spec.startswith("~~"):
            return _counted_plural(value, format_spec[2:])
        if format_spec.startswith("~"):
            return counted(value, format_spec[1:])
        return str(super().format_field(value, format_spec))


_FORMATTER = _Counting()


def pick(texts: dict[str, str], language: str, /, **values: Any) -> str:
    """The text for `language`, else English, else any; formatted with `values` when given
    (`{n:~noun}` counts: see the module's docstring; a template may name a value `language`)."""
    text = texts.get(language) or texts.get("en") or next(iter(texts.values()), "")
    return _FORMATTER.format(text, **values) if values else text


_DIGITS = {"零": 0, "〇": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5, "六": 6}
_DIGITS |= {"七": 7, "八": 8, "九": 9}
CHINESE_NUMERALS = "".join(_DIGITS) + "十百"
"""The characters `chinese_number` reads, for a regular expression's character class."""
MEASURE_WORDS = "个把组块张只瓶根颗份件本盒袋支枚"
"""Measure words a count of things stands before (`三个`, `两把`, `64 根`): with one, a Chinese
numeral is a count, not part of a name (`三叉戟`)."""


def chinese_number(text: str) -> int | None:
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
