"""The LOCAL_FALLBACK card reuses `decide`'s match instead of matching the text again: the
candidates must be exactly those a fresh match gives, for any text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router_service.semantic import Analyzer, Mode, SemanticConfig, SemanticRouter
from tests.test_semantic import PROFILES

TEXTS = [
    "minecraft:diamond 这个东西怎么样",
    "物品",
    "天气",
    "打开商城",
    "查看任务",
    "show my quests",
    "open the shop please",
    "",
    "x" * 300,
]


@pytest.fixture(scope="module")
def routers() -> dict[Mode, SemanticRouter]:
    analyzer = Analyzer()
    return {
        mode: SemanticRouter(PROFILES, SemanticConfig(mode=mode), analyzer=analyzer)
        for mode in (Mode.ENFORCE, Mode.SHADOW)
    }


def _same(router: SemanticRouter, text: str, lang: str, allowed: set[str] | None) -> None:
    decided = router.decide(text, lang, allowed)
    assert router.fallback_candidates(text, lang, allowed, decided) == (
        router.fallback_candidates(text, lang, allowed)
    )


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("lang", ["zh", "en", "fr"])
@pytest.mark.parametrize("mode", [Mode.ENFORCE, Mode.SHADOW])
def test_reused_match_gives_the_same_candidates(
    routers: dict[Mode, SemanticRouter], text: str, lang: str, mode: Mode
) -> None:
    _same(routers[mode], text, lang, None)
    _same(routers[mode], text, lang, {"system:help", "system:item", "system:quests"})


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60), lang=st.sampled_from(["zh", "en"]))
def test_reused_match_gives_the_same_candidates_for_any_text(
    routers: dict[Mode, SemanticRouter], text: str, lang: str
) -> None:
    _same(routers[Mode.ENFORCE], text, lang, None)


def test_a_decision_in_another_language_is_not_reused(
    routers: dict[Mode, SemanticRouter],
) -> None:
    router = routers[Mode.ENFORCE]
    decided = router.decide("查看任务", "zh")
    assert router.fallback_candidates("查看任务", "en", None, decided) == (
        router.fallback_candidates("查看任务", "en")
    )
