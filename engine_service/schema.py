"""JSON Schema (draft 2020-12) checks: module inputs, tool inputs and game-tool outputs, one
validator for all of them (the `jsonschema` package).

A value is checked against its schema and the first error (the most relevant one, as
`jsonschema.exceptions.best_match` picks it) is described by its path in the value
(`items[0].item`) and what was expected there (`is required`, `must be a integer`). Numbers
arrive from protobuf Structs as doubles: an `integer` is any number without a fraction, and a
checked value comes back with such numbers turned into `int` wherever its schema says
`integer`. NaN and infinities are refused everywhere (JSON cannot carry them).

Validators are built once per schema object and kept (schemas are part of frozen
declarations), so a check costs the walk over the value only. Verdicts are kept too, per
schema object and value (its canonical JSON, up to 1 KiB): an event task's input, a give's
input and its output repeat from one task to the next (the rules name the same stacks), and
a repeated check costs the value's encoding instead of the walk.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError, best_match

from services.runtime.errors import InvalidArgument

__all__ = [
    "LOCALIZED_NAME",
    "SchemaViolation",
    "check_input",
    "check_schema",
    "normalise",
    "path_text",
    "violation",
]

LOCALIZED_NAME: dict[str, Any] = {
    "type": "object",
    "properties": {
        "zh": {"type": "string", "minLength": 1, "maxLength": 64},
        "en": {"type": "string", "minLength": 1, "maxLength": 64},
    },
    "additionalProperties": False,
}
"""A name per language (zh, en), 1 to 64 characters each, as a configuration file gives it for
players to read (a reward's, an item's)."""

_VALIDATORS: dict[int, tuple[dict[str, Any], Draft202012Validator]] = {}
_MAX_VALIDATORS = 4096
# (id of the schema, the value's canonical JSON) -> (the schema, its verdict). The schema is
# kept, and compared by identity, so an id reused by another schema object never matches.
_VERDICTS: dict[tuple[int, str], tuple[dict[str, Any], SchemaViolation | None]] = {}
_MAX_VERDICTS = 8192
_MAX_VERDICT_KEY = 1024


@dataclasses.dataclass(frozen=True)
class SchemaViolation:
    """The first way a value breaks its schema."""

    path: str
    """Where in the value, as `items[0].item`; empty for the value itself."""
    expected: str
    """What the schema expects there, in words (`is required`, `must be at least 1`)."""

    def text(self, what: str = "value") -> str:
        """`items[0].item is required`, or `value must be a object` at the root."""
        return f"{self.path or what} {self.expected}"


def check_schema(schema: Any) -> None:
    """Raises ValueError, saying what is wrong, unless `schema` is a draft 2020-12 JSON Schema
    of an object (`"type": "object"`)."""
    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = path_text(exc.absolute_path)
        raise ValueError(
            f"not a valid JSON Schema (draft 2020-12){' at ' + where if where else ''}: "
            f"{_short(exc.message)}"
        ) from None
    if schema.get("type") != "object":
        raise ValueError('the schema must describe an object ("type": "object")')


def _validator(schema: dict[str, Any]) -> Draft202012Validator:
    entry = _VALIDATORS.get(id(schema))
    if entry is not None and entry[0] is schema:
        return entry[1]
    if len(_VALIDATORS) >= _MAX_VALIDATORS:
        _VALIDATORS.clear()
    validator = Draft202012Validator(schema)
    _VALIDATORS[id(schema)] = (schema, validator)  # the schema is kept: its id stays unique
    return validator


def path_text(path: Any) -> str:
    """A JSON path as text: `items[0].item`."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _non_finite(value: Any, path: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    """The path of the first NaN or infinity in `value`, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, dict):
        for key, item in value.items():
            found = _non_finite(item, (*path, key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _non_finite(item, (*path, index))
            if found is not None:
                return found
    return None


def _describe(error: ValidationError) -> tuple[tuple[Any, ...], str]:
    """Where an error is (the missing key included for `required`) and what was expected."""
    path = tuple(error.absolute_path)
    kind, instance = error.validator, error.instance
    # What the failed keyword holds, and the (sub)schema holding it: JSON of whatever shape
    # the keyword takes (the stubs add an "unset" marker that a raised error never carries).
    rule: Any = error.validator_value
    schema: Any = error.schema
    if kind == "required" and isinstance(instance, dict):
        missing = next((key for key in rule if key not in instance), "")
        return (*path, missing), "is required"
    if kind == "additionalProperties" and isinstance(instance, dict):
        known = sorted(schema.get("properties", {}))
        extra = sorted(
            key
            for key in instance
            if key not in known
            and not any(re.search(pattern, key) for pattern in schema.get("patternProperties", {}))
        )
        return path, (
            f"has unknown field(s) {', '.join(extra)}; known fields are "
            f"{', '.join(known) or 'none'}"
        )
    if kind == "type":
        expected = " or ".join(rule) if isinstance(rule, list) else rule
        if (
            expected == "integer"
            and isinstance(instance, float)
            and not isinstance(instance, bool)
            and math.isfinite(instance)
        ):
            return path, "must be a whole number"
        return path, f"must be a {expected}"
    messages = {
        "maxLength": f"is longer than {rule} characters",
        "minLength": f"is shorter than {rule} characters",
        "minimum": f"must be at least {rule}",
        "maximum": f"must be at most {rule}",
        "exclusiveMinimum": f"must be more than {rule}",
        "exclusiveMaximum": f"must be less than {rule}",
        "minItems": f"must have at least {rule} items",
        "maxItems": f"must have at most {rule} items",
        "minProperties": f"must have at least {rule} fields",
        "maxProperties": f"must have at most {rule} fields",
        "pattern": f"must match the pattern {rule}",
        "const": f"must be {rule!r}",
        "uniqueItems": "must not repeat items",
    }
    if kind == "enum":
        return path, "must be one of " + ", ".join(repr(v) for v in rule)
    if kind in messages:
        return path, messages[kind]
    return path, f"does not match the schema ({kind}): {_short(error.message)}"


def violation(schema: dict[str, Any], value: Any) -> SchemaViolation | None:
    """The first way `value` breaks `schema`, or None when it conforms."""
    bad = _non_finite(value)
    if bad is not None:
        return SchemaViolation(path_text(bad), "must be a finite number")
    key = _canonical(value)
    if key is not None:
        kept = _VERDICTS.get((id(schema), key))
        if kept is not None and kept[0] is schema:
            return kept[1]
    found = _first_violation(schema, value)
    if key is not None:
        if len(_VERDICTS) >= _MAX_VERDICTS:
            _VERDICTS.clear()
        _VERDICTS[(id(schema), key)] = (schema, found)
    return found


def _canonical(value: Any) -> str | None:
    """`value` as canonical JSON (keys sorted; 2 and 2.0 differ), or None when it is not JSON
    or too long to keep a verdict for."""
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return None
    return text if len(text) <= _MAX_VERDICT_KEY else None


def _first_violation(schema: dict[str, Any], value: Any) -> SchemaViolation | None:
    error = best_match(_validator(schema).iter_errors(value))
    if error is None:
        return None
    path, expected = _describe(error)
    return SchemaViolation(path_text(path), expected)


def normalise(schema: dict[str, Any], value: Any) -> Any:
    """`value` (already checked) with whole numbers turned into `int` where `schema` says
    `integer`, following `properties` and `items`."""
    kind = schema.get("type")
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        if not properties:
            return value
        return {
            key: normalise(properties[key], item) if key in properties else item
            for key, item in value.items()
        }
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [normalise(schema["items"], item) for item in value]
    return value


def check_input(owner: str, schema: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
    """Returns `value` with integers normalised, or raises InvalidArgument naming the field
    (`<owner>: input field 'count' must be at least 1`)."""
    found = violation(schema, value)
    if found is not None:
        if found.expected.startswith("has unknown field(s)") and not found.path:
            raise InvalidArgument(
                f"{owner}: unknown input field(s) {found.expected.removeprefix('has unknown field(s) ')}"
            )
        raise InvalidArgument(f"{owner}: input field '{found.path or '.'}' {found.expected}")
    normalised: dict[str, Any] = normalise(schema, value)
    return normalised
