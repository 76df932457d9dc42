"""Players' texts: the language chosen, and English counts in agreement with their noun."""

from __future__ import annotations

import pytest

from engine_service.modules.inventory import _TOTAL
from engine_service.modules.signin import streak_line
from services.texts import counted, pick, singular


@pytest.mark.parametrize(
    ("n", "noun", "expected"),
    [
        (1, "day", "1 day"),
        (0, "day", "0 days"),
        (2, "day", "2 days"),
        (1, "entry|entries", "1 entry"),
        (3, "entry|entries", "3 entries"),
        (1, "kind of item|kinds of items", "1 kind of item"),
        (1.0, "second", "1.0 second"),
    ],
)
def test_counted_agrees_with_its_number(n: float, noun: str, expected: str) -> None:
    assert counted(n, noun) == expected


def test_pick_counts_in_english_and_leaves_chinese_alone() -> None:
    texts = {"zh": "共 {n} 条，{name}", "en": "{n:~entry|entries} for {name}"}
    assert pick(texts, "en", n=1, name="Steve") == "1 entry for Steve"
    assert pick(texts, "en", n=2, name="Steve") == "2 entries for Steve"
    assert pick(texts, "zh", n=1, name="Steve") == "共 1 条，Steve"
    assert pick(texts, "fr", n=5, name="Steve") == "5 entries for Steve"  # English otherwise
    # Other format specs still work, and a text without values is returned as written.
    assert pick({"en": "{x:>4}|{{braces}}"}, "en", x=7) == "   7|{braces}"
    assert pick({"en": "{{as written}}"}, "en") == "{{as written}}"
    # A template's value may be called `language` (a knowledge entry's).
    assert pick({"en": "{entry} ({language})"}, "en", entry="faq", language="zh") == "faq (zh)"


def test_an_amount_agrees_with_a_currency_named_in_its_plural() -> None:
    # A game server names its currency once, in the plural (`coins`); an amount of one reads
    # `1 coin` (the shop's torch). Names without an English plural are left as given.
    price = {"zh": "{price} {currency}", "en": "Price: {price:~~{currency}} each"}
    assert pick(price, "en", price=1, currency="coins") == "Price: 1 coin each"
    assert pick(price, "en", price=5, currency="coins") == "Price: 5 coins each"
    assert pick(price, "en", price=1, currency="gold") == "Price: 1 gold each"
    assert pick(price, "en", price=1, currency="emeralds") == "Price: 1 emerald each"
    assert pick(price, "zh", price=1, currency="金币") == "1 金币"
    assert [singular(w) for w in ("torches", "berries", "glass", "金币", "gold")] == [
        "torch",
        "berry",
        None,
        None,
        None,
    ]


def test_a_first_sign_in_reads_one_day_not_one_days() -> None:
    status = {"streak": 1, "days_this_month": 1}
    assert streak_line(status, "en") == "Sign-in streak: 1 day, 1 this month"
    assert streak_line({"streak": 4, "days_this_month": 9}, "en") == (
        "Sign-in streak: 4 days, 9 this month"
    )
    assert streak_line(status, "zh") == "连续签到 1 天，本月签到 1 天"
    # None this month: how to sign in, not two zeros; a broken streak still counts the month.
    none = {"streak": 0, "days_this_month": 0}
    assert streak_line(none, "en") == "No sign-in this month yet (type /signin)"
    assert streak_line(none, "zh") == "本月还没有签到（输入 /signin 签到）"
    assert streak_line({"streak": 0, "days_this_month": 3}, "en") == (
        "Sign-in streak: 0 days, 3 this month"
    )
    assert pick(_TOTAL, "en", kinds=1) == "1 kind of item."
