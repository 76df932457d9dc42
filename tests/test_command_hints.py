"""A selection card suggests the command of a change the text clearly asks for (a purchase, a
payment, a sign-in), which no card button and no typed words may run: `resembled_change`, over
the built-in modules' routing profiles (router_service/corpus/profiles.json)."""

from __future__ import annotations

from pathlib import Path

import pytest
from system.common.v1 import catalog_pb2

from router_service.commands import CommandIndex
from router_service.semantic import Mode, SemanticConfig, SemanticRouter
from router_service.semantic.guards import write_words
from router_service.semantic.profiles import load_profiles

PROFILES = load_profiles(
    Path(__file__).resolve().parent.parent / "router_service" / "corpus" / "profiles.json"
)[1]


@pytest.fixture(scope="module")
def router() -> SemanticRouter:
    return SemanticRouter(PROFILES, SemanticConfig())


@pytest.mark.parametrize(
    ("text", "language", "module_id"),
    [
        ("buy 3 bread", "en", "system:shop_buy"),
        ("买钻石", "zh", "system:shop_buy"),
        ("pay alex 10", "en", "system:pay"),
        ("给Alex转10块", "zh", "system:pay"),
        ("claim my daily reward", "en", "system:signin"),
        # Not clearly one change: a wrong suggestion misleads more than none.
        ("claim the mail attachment", "en", None),
        ("领取任务奖励", "zh", None),
        ("how do I buy things", "en", None),
        # The best match reads: its button is on the card already.
        ("show my inventory", "en", None),
        ("tell me a joke", "en", None),
    ],
)
def test_a_clear_change_is_suggested_as_its_command(
    router: SemanticRouter, text: str, language: str, module_id: str | None
) -> None:
    decided = router.decide(text, language)
    assert router.resembled_change(text, language, None, decided) == module_id
    assert router.resembled_change(text, language) == module_id  # without the decision too


def test_the_change_a_text_begins_with_is_suggested_where_it_matches_well_enough(
    router: SemanticRouter,
) -> None:
    # `buy 1 diamond` matches the payment best (a number and a thing), the purchase at 0.5+.
    assert router.resembled_change("buy 1 diamond", "en") is None
    assert router.resembled_change("buy 1 diamond", "en", leading="system:shop_buy") == (
        "system:shop_buy"
    )
    # A sentence that only begins with the word matches the payment too little.
    assert router.resembled_change("pay attention to me", "en", leading="system:pay") is None
    # A module that reads is no change to suggest.
    assert router.resembled_change("buy 1 diamond", "en", leading="system:shop") is None


def test_a_change_the_player_may_not_use_or_an_observing_router_suggests_nothing() -> None:
    enforcing = SemanticRouter(PROFILES, SemanticConfig())
    allowed = {p.module_id for p in PROFILES} - {"system:shop_buy"}
    assert enforcing.resembled_change("buy 3 bread", "en", allowed) is None
    shadow = SemanticRouter(PROFILES, SemanticConfig(mode=Mode.SHADOW))
    assert shadow.resembled_change("buy 3 bread", "en") is None


def test_changes_tied_for_the_best_are_told_apart_by_the_command_the_text_names(
    router: SemanticRouter,
) -> None:
    # `我要签到`: the sign-in, the purchase and the payment tie on their write word alone.
    assert router.resembled_change("我要签到", "zh") is None
    assert router.resembled_change("我要签到", "zh", named={"system:signin"}) == "system:signin"
    assert router.resembled_change("我要签到", "zh", named={"system:help"}) is None
    both = {"system:signin", "system:pay"}
    assert router.resembled_change("我要签到", "zh", named=both) is None


@pytest.mark.parametrize(
    ("text", "language"),
    [
        ("turn off history", "en"),
        ("switch me to offline mode", "en"),
        ("turn off external services", "en"),
        ("关闭对话记录", "zh"),
        ("切换到离线模式", "zh"),
        ("关闭外部服务", "zh"),
    ],
)
def test_a_settings_change_finds_the_settings_card_among_the_choices(
    router: SemanticRouter, text: str, language: str
) -> None:
    # The settings card reads; each change is a press of one of its buttons. A typed request
    # for one is not run (a write), but its card is offered, and no command is suggested.
    decided = router.decide(text, language)
    assert decided.outcome != "direct"
    choices = [c.module_id for c in router.fallback_candidates(text, language, None, decided)]
    assert "system:settings" in choices
    assert router.resembled_change(text, language, None, decided) is None


@pytest.mark.parametrize(
    ("text", "language", "kept"),
    [
        # The number is a payment's or a purchase's, not a quest's: no quest choice.
        ("给alex转50", "zh", None),
        ("buy 2 bread", "en", None),
        # A quest number among other requests is still offered with its number, first.
        ("show quest 2 and my mail", "en", {"index": 2}),
        ("quest 2 progress?", "en", {"index": 2}),
    ],
)
def test_a_choice_with_an_argument_needs_a_plausible_match(
    router: SemanticRouter, text: str, language: str, kept: dict[str, int] | None
) -> None:
    decided = router.decide(text, language)
    assert decided.outcome != "direct"
    choices = router.fallback_candidates(text, language, None, decided)
    quest = [dict(c.input) for c in choices if c.module_id == "system:quest_detail"]
    assert quest == ([kept] if kept else [])
    if kept:
        assert choices[0].module_id == "system:quest_detail"


def test_a_chinese_write_verb_names_the_command_whose_name_holds_it(
    router: SemanticRouter,
) -> None:
    # `我想买面包` is most like the purchase, but not by its margin over the sign-in and the
    # payment (they share the write feature); the verb `买` is part of the purchase's command
    # name `购买`, so that one is suggested. A verb only the press-only claims' names hold
    # (`领取` of `领取邮件`) suggests no sign-in.
    from engine_service.app import build_registry
    from engine_service.config import EngineConfig
    from router_service.commands import CommandIndex
    from router_service.semantic.guards import write_words

    index = CommandIndex(build_registry(EngineConfig()).descriptors(None), "test")
    assert write_words("我想买面包") == {"买"} and write_words("buy bread") == {"buy"}
    assert index.named_in("我想买面包") == frozenset()
    assert router.resembled_change("我想买面包", "zh") is None
    named = index.holding(write_words("我想买面包"))
    assert "system:shop_buy" in named and "system:signin" not in named
    assert router.resembled_change("我想买面包", "zh", named=named) == "system:shop_buy"
    for text in ("领取任务奖励", "我要领取"):
        held = index.named_in(text) or index.holding(write_words(text))
        assert router.resembled_change(text, "zh", named=held) is None, text
    assert index.holding({"buy"}) == frozenset()  # English aliases are whole words


def _index() -> CommandIndex:
    modules = [
        catalog_pb2.ModuleDescriptor(
            module_id=module_id,
            commands=[
                catalog_pb2.CommandDeclaration(
                    aliases=aliases,
                    argument_kind=kind,
                    argument_field="text" if kind else "",
                )
            ],
        )
        for module_id, aliases, kind in (
            ("system:shop_buy", ["buy", "购买"], catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT),
            ("system:pay", ["pay", "转账", "付款"], catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT),
            ("system:signin", ["signin", "签到"], catalog_pb2.ARGUMENT_KIND_UNSPECIFIED),
            (
                "system:mail_claim",
                ["mailclaim", "领取邮件"],
                catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT,
            ),
            (
                "system:quest_claim",
                ["questclaim", "领取任务"],
                catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT,
            ),
        )
    ]
    return CommandIndex(modules, "1")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("buy 2 bread", ("system:shop_buy", "2 bread", "/buy 2 bread")),
        ("  BUY diamond  ", ("system:shop_buy", "diamond", "/buy diamond")),
        ("转账 alex 50", ("system:pay", "alex 50", "/pay alex 50")),
        ("付款alex 50", ("system:pay", "alex 50", "/pay alex 50")),
        ("购买钻石", ("system:shop_buy", "钻石", "/buy 钻石")),
        # A write verb that one command's Chinese name alone holds (`买` of `购买`).
        ("买两个面包", ("system:shop_buy", "两个面包", "/buy 两个面包")),
        # `领取` is in two commands' names: which one it means is not said.
        ("领取 3", None),
        ("buying bread", None),  # a Latin alias only as a whole word
        ("buy", None),  # nothing after it
        ("buy ?!", None),
        ("签到 今天", None),  # a command that takes no argument
        ("/buy 2 bread", None),  # typed as the command: the command stage's
        ("i want to buy bread", None),
    ],
)
def test_a_command_typed_without_its_slash_is_read_with_its_argument(
    text: str, expected: tuple[str, str, str] | None
) -> None:
    lead = _index().leading(text, write_words(text))
    found = None if lead is None else (lead.module_id, lead.argument, lead.typed())
    assert found == expected
