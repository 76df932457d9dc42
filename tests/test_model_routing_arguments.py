"""The model's routing choice of a free-text command gets the player's words as its argument
when the model left the field out; other choices are left as they are."""

from __future__ import annotations

from system.common.v1 import catalog_pb2

from router_service.model_routing import CLARIFY, ModelChoice, with_text_argument


def _module(module_id: str, kind: int, field: str = "question") -> catalog_pb2.ModuleDescriptor:
    return catalog_pb2.ModuleDescriptor(
        module_id=module_id,
        commands=[
            catalog_pb2.CommandDeclaration(
                aliases=["question"], argument_kind=kind, argument_field=field
            )
        ],
    )


MODULES = [
    _module("system:question", catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT),
    _module("system:history", catalog_pb2.ARGUMENT_KIND_OPTIONAL_TEXT, "count"),
]


def test_a_required_text_field_the_model_left_out_gets_the_players_words() -> None:
    choice = with_text_argument(ModelChoice("system:question", {}), MODULES, "铁傀儡怎么造")
    assert choice == ModelChoice("system:question", {"question": "铁傀儡怎么造"})


def test_what_the_model_filled_in_is_kept() -> None:
    given = ModelChoice("system:question", {"question": "how to build an iron golem"})
    assert with_text_argument(given, MODULES, "golem?") == given


def test_optional_fields_clarify_and_unknown_modules_are_left_alone() -> None:
    for choice in (
        ModelChoice("system:history", {}),
        ModelChoice(CLARIFY, {}),
        ModelChoice("test:unknown", {}),
    ):
        assert with_text_argument(choice, MODULES, "text") == choice


def test_the_players_words_are_read_as_the_command_reads_them() -> None:
    buy = catalog_pb2.ModuleDescriptor(
        module_id="system:shop_buy",
        commands=[
            catalog_pb2.CommandDeclaration(
                aliases=["buy", "购买"],
                argument_kind=catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT,
                argument_field="item",
            )
        ],
    )
    modules = [*MODULES, buy]
    for text, words in [
        ("buy 2 bread", "2 bread"),
        ("BUY  a diamond sword ", "a diamond sword"),
        ("购买钻石", "钻石"),
        ("购买 3 个面包", "3 个面包"),
        # A Latin alias only as a whole word; never the whole text.
        ("buying bread", "buying bread"),
        ("buy", "buy"),
        ("buy?", "buy?"),
        ("I want to buy bread", "I want to buy bread"),
    ]:
        choice = with_text_argument(ModelChoice("system:shop_buy", {}), modules, text)
        assert choice.arguments == {"item": words}, text
    question = with_text_argument(ModelChoice("system:question", {}), MODULES, "question: why?")
    assert question.arguments == {"question": "question: why?"}  # `question:` is no whole word
