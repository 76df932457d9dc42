"""Checks a module input against the module's JSON Schema.

Supports the subset module inputs use: an object with typed properties (string, integer,
number, boolean), `required`, `additionalProperties: false`, `maxLength`, `minimum`, `maximum`.
"""

from __future__ import annotations

import math
from typing import Any

from services.runtime.errors import InvalidArgument

__all__ = ["check_input"]

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int, float),  # Struct carries every number as a double
    "number": (int, float),
    "boolean": (bool,),
}


def check_input(module_id: str, schema: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
    """Returns `value` with integers normalised, or raises InvalidArgument naming the field."""
    properties: dict[str, dict[str, Any]] = schema.get("properties", {})
    for name in schema.get("required", []):
        if name not in value:
            raise InvalidArgument(f"{module_id}: input field '{name}' is required")
    if schema.get("additionalProperties", True) is False:
        extra = sorted(set(value) - set(properties))
        if extra:
            raise InvalidArgument(
                f"{module_id}: unknown input field(s) {', '.join(extra)}; "
                f"known fields are {', '.join(sorted(properties)) or 'none'}"
            )
    checked = dict(value)
    for name, rule in properties.items():
        if name not in value:
            continue
        item = value[name]
        kind = rule.get("type", "string")
        allowed = _TYPES.get(kind, (object,))
        if isinstance(item, bool) and kind != "boolean" or not isinstance(item, allowed):
            raise InvalidArgument(f"{module_id}: input field '{name}' must be a {kind}")
        if kind in ("integer", "number") and not math.isfinite(item):
            raise InvalidArgument(f"{module_id}: input field '{name}' must be a finite number")
        if kind == "integer":
            if float(item) != int(item):
                raise InvalidArgument(f"{module_id}: input field '{name}' must be a whole number")
            checked[name] = item = int(item)
        if kind == "string" and "maxLength" in rule and len(item) > rule["maxLength"]:
            raise InvalidArgument(
                f"{module_id}: input field '{name}' is longer than {rule['maxLength']} characters"
            )
        if "minimum" in rule and item < rule["minimum"]:
            raise InvalidArgument(
                f"{module_id}: input field '{name}' must be at least {rule['minimum']}"
            )
        if "maximum" in rule and item > rule["maximum"]:
            raise InvalidArgument(
                f"{module_id}: input field '{name}' must be at most {rule['maximum']}"
            )
    return checked
