"""engine_service.schema keeps each schema's verdicts per value: a repeated check must give the
verdict a fresh one gives, for valid and invalid values alike, and never another schema's."""

from __future__ import annotations

from typing import Any

import pytest

from engine_service import schema as schema_module
from engine_service.schema import check_input, violation
from services.runtime.errors import InvalidArgument

STACKS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "item": {"type": "string"},
                    "count": {"type": "integer", "minimum": 1},
                },
                "required": ["item", "count"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}

VALUES: list[Any] = [
    {"items": [{"item": "minecraft:diamond", "count": 2}]},
    {"items": [{"item": "minecraft:diamond", "count": 2.0}]},
    {"items": [{"item": "minecraft:diamond", "count": 2.5}]},
    {"items": [{"count": 2, "item": "minecraft:diamond"}]},
    {"items": [{"item": "minecraft:diamond", "count": 0}]},
    {"items": [{"item": "minecraft:diamond"}]},
    {"items": []},
    {"items": [{"item": "minecraft:diamond", "count": 1, "extra": True}]},
    {},
    {"items": [{"item": "x" * 2000, "count": 1}]},  # too long to keep a verdict for
]


def _fresh(schema: dict[str, Any], value: Any) -> Any:
    return schema_module._first_violation(schema, value)  # noqa: SLF001


@pytest.mark.parametrize("value", VALUES)
def test_a_repeated_check_gives_a_fresh_checks_verdict(value: Any) -> None:
    expected = _fresh(STACKS, value)
    assert violation(STACKS, value) == expected
    assert violation(STACKS, value) == expected  # the kept verdict, when there is one


def test_a_kept_verdict_belongs_to_its_schema_object_only() -> None:
    value = {"items": [{"item": "minecraft:diamond", "count": 2}]}
    assert violation(STACKS, value) is None
    stricter = {**STACKS, "properties": {"items": {"type": "array", "maxItems": 0}}}
    found = violation(stricter, value)
    assert found is not None and found.path == "items"
    assert violation(STACKS, value) is None
    # An id reused by another schema object (as after the first was freed) never matches:
    # the kept entry names its schema object, and only that object gets its verdict.
    key = (id(STACKS), schema_module._canonical(value))  # noqa: SLF001
    schema_module._VERDICTS[key] = (stricter, found)  # noqa: SLF001
    assert violation(STACKS, value) is None


def test_check_input_refuses_a_repeated_bad_value_each_time() -> None:
    bad = {"items": [{"item": "minecraft:diamond", "count": 0}]}
    for _ in range(2):
        with pytest.raises(
            InvalidArgument, match=r"input field 'items\[0\]\.count' must be at least 1"
        ):
            check_input("mod:x", STACKS, bad)
    # Whole numbers still come back as int on a kept verdict.
    good = {"items": [{"item": "minecraft:diamond", "count": 3.0}]}
    for _ in range(2):
        assert check_input("mod:x", STACKS, good) == {
            "items": [{"item": "minecraft:diamond", "count": 3}]
        }


def test_kept_verdicts_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema_module, "_MAX_VERDICTS", 4)
    schema_module._VERDICTS.clear()  # noqa: SLF001
    for count in range(1, 20):
        violation(STACKS, {"items": [{"item": "minecraft:diamond", "count": count}]})
        assert len(schema_module._VERDICTS) <= 4  # noqa: SLF001
