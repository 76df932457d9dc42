"""The hello check: the game tools a game server offers, against the engine's game-tool
catalogue (`EngineService.GetGameToolCatalog`, docs/game-tools.md). Pure: no gRPC, no I/O.

A tool the catalogue declares is *compatible* when the offered `GameTool`

- carries the catalogue's `read_only`, `idempotent` and `event_allowed` flags, and
  `honours_call_id` where the catalogue says the tool honours call ids;
- has an `input_schema` and an `output_schema` that are each empty ("as the catalogue says") or
  a JSON object that is a draft 2020-12 JSON Schema, and then:
  - accepts the catalogue's example (call input, answer);
  - output: requires every key the catalogue's output schema requires, so no answer the
    server means to give lacks a key the modules read;
  - input: requires no key the catalogue's input schema does not require, so every call the
    engine makes is one the server accepts;
  - names, where both schemas name a `type` for the same place, the same type.

Keys and places are followed through `properties` and array `items` only (`items[].item`):
this is a check of the plain object schemas the catalogue uses, not a proof of inclusion of
any two schemas. A schema that hides required keys behind `$ref` or `allOf` reads as requiring
none; the catalogue's own schema, copied as is, always passes.

Any tool, catalogued or not, whose schema is not JSON, not an object or not a valid JSON Schema
is refused. A tool the catalogue lists as required by some module and the hello does not offer
is a problem too, unless every module requiring it belongs to an optional feature the hello
does not list (`features`): those modules are unavailable there anyway, and a server without
FTB Quests is not expected to offer the quest tools. The modules requiring a refused or missing
tool are unavailable to the game server's players; tools the catalogue has no declaration for
(`declared` false) are checked for presence only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match
from system.engine.v1 import engine_pb2
from system.gateway.v1 import gateway_pb2

from services.runtime.permissions import CORE_FEATURE

__all__ = ["ContractCheck", "check_tools"]

_FLAGS = ("read_only", "idempotent", "event_allowed")
MAX_ISSUES = 3
"""Issues named per tool; a tool with more says how many more."""


@dataclasses.dataclass(frozen=True)
class ContractCheck:
    """What the gateway does with a hello's tools."""

    problems: tuple[gateway_pb2.ToolProblem, ...]
    """For `Welcome.tool_problems`, by tool name."""
    refused: frozenset[str]
    """Offered tools the gateway will not call (dropped from the connection's tools)."""
    unavailable_modules: tuple[str, ...]
    """Modules requiring a refused or missing tool, sorted: `PlayerContext.unavailable_modules`
    of the server's players."""


def _path(parts: Iterable[Any]) -> str:
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _parse(name: str, text: str) -> tuple[dict[str, Any] | None, str]:
    """The schema a hello sent as JSON text (None for empty), or a problem."""
    if not text.strip():
        return None, ""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return None, f"{name} is not JSON: {exc}"
    if not isinstance(schema, dict):
        return None, f"{name} must be a JSON object (a JSON Schema), not {type(schema).__name__}"
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = _path(exc.absolute_path)
        return None, (
            f"{name} is not a valid JSON Schema (draft 2020-12)"
            f"{' at ' + where if where else ''}: {exc.message[:120]}"
        )
    except RecursionError:
        return None, f"{name} is nested too deeply"
    return schema, ""


def _required(schema: Any, prefix: str = "", depth: int = 0) -> set[str]:
    """Paths of the keys `schema` requires, through `properties` and array `items`."""
    if not isinstance(schema, dict) or depth > 32:
        return set()
    found: set[str] = set()
    required = schema.get("required", [])
    for key in required if isinstance(required, list) else []:
        found.add(f"{prefix}.{key}" if prefix else str(key))
    properties = schema.get("properties", {})
    if isinstance(properties, dict):
        for key, sub in properties.items():
            found |= _required(sub, f"{prefix}.{key}" if prefix else str(key), depth + 1)
    if isinstance(schema.get("items"), dict):
        found |= _required(schema["items"], f"{prefix}[]", depth + 1)
    return found


def _types(schema: Any, prefix: str = "", depth: int = 0) -> dict[str, frozenset[str]]:
    """The `type` named at each place of `schema`, through `properties` and array `items`."""
    if not isinstance(schema, dict) or depth > 32:
        return {}
    found: dict[str, frozenset[str]] = {}
    kind = schema.get("type")
    if isinstance(kind, str):
        found[prefix] = frozenset([kind])
    elif isinstance(kind, list):
        found[prefix] = frozenset(str(k) for k in kind)
    properties = schema.get("properties", {})
    if isinstance(properties, dict):
        for key, sub in properties.items():
            found.update(_types(sub, f"{prefix}.{key}" if prefix else str(key), depth + 1))
    if isinstance(schema.get("items"), dict):
        found.update(_types(schema["items"], f"{prefix}[]", depth + 1))
    return found


def _loads(text: str) -> Any:
    return json.loads(text) if text else None


def _compare(
    side: str, offered: dict[str, Any], catalogue: dict[str, Any], example: Any
) -> list[str]:
    """Why `offered` (the hello's `<side>_schema`) is incompatible with the catalogue's."""
    name = f"{side}_schema"
    issues = []
    if example is not None:
        error = best_match(Draft202012Validator(offered).iter_errors(example))
        if error is not None:
            where = _path(error.absolute_path)
            what = "call input" if side == "input" else "answer"
            issues.append(
                f"{name} refuses the catalogue's example {what}"
                f"{' at ' + where if where else ''}: {error.message[:120]}"
            )
    mine, theirs = _required(offered), _required(catalogue)
    if side == "output":
        issues += [
            f"{name}: {path} is required by the catalogue but missing"
            for path in sorted(theirs - mine)
        ]
    else:
        issues += [
            f"{name}: {path} is required here but the catalogue does not require it "
            "(the engine may call without it)"
            for path in sorted(mine - theirs)
        ]
    offered_types, catalogue_types = _types(offered), _types(catalogue)
    for place in sorted(set(offered_types) & set(catalogue_types)):
        if offered_types[place] != catalogue_types[place]:
            issues.append(
                f"{name}: {place or 'the ' + side} has type "
                f"{'/'.join(sorted(offered_types[place]))}; the catalogue says "
                f"{'/'.join(sorted(catalogue_types[place]))}"
            )
    return issues


def _issues(tool: gateway_pb2.GameTool, entry: engine_pb2.GameToolEntry | None) -> list[str]:
    issues = []
    schemas: dict[str, dict[str, Any] | None] = {}
    for side in ("input", "output"):
        schema, problem = _parse(f"{side}_schema", getattr(tool, f"{side}_schema"))
        if problem:
            issues.append(problem)
        schemas[side] = schema
    if entry is None or not entry.declared:
        return issues
    for flag in _FLAGS:
        offered, expected = getattr(tool, flag), getattr(entry.tool, flag)
        if offered != expected:
            issues.append(
                f"{flag} is {str(offered).lower()}; the catalogue says {str(expected).lower()}"
            )
    if entry.tool.honours_call_id and not tool.honours_call_id:
        # The engine retries interrupted calls of this tool with the same call id: a server
        # that does not deduplicate on it could run them twice. (Saying yes where the
        # catalogue does not ask is a harmless promise.)
        issues.append(
            "honours_call_id is false; the catalogue says true (interrupted calls are retried "
            "with the same call id)"
        )
    examples = {"input": entry.example_input, "output": entry.example_output}
    for side in ("input", "output"):
        offered_schema = schemas[side]
        catalogue_text = getattr(entry.tool, f"{side}_schema")
        if offered_schema is None or not catalogue_text:
            continue
        issues += _compare(side, offered_schema, _loads(catalogue_text), _loads(examples[side]))
    return issues


def _problem(tool: str, issues: list[str], modules: Sequence[str]) -> gateway_pb2.ToolProblem:
    text = "; ".join(issues[:MAX_ISSUES])
    if len(issues) > MAX_ISSUES:
        text += f"; and {len(issues) - MAX_ISSUES} more"
    return gateway_pb2.ToolProblem(tool=tool, problem=text, unavailable_modules=list(modules))


def check_tools(
    offered: Sequence[gateway_pb2.GameTool],
    catalogue: Sequence[engine_pb2.GameToolEntry],
    features: Iterable[str] = (),
) -> ContractCheck:
    """Checks a hello's tools against the catalogue (see the module docstring); `features`
    are the hello's.

    Never raises on what a game server sent: anything malformed becomes a problem.
    """
    installed = {"", CORE_FEATURE, *features}
    entries = {entry.tool.name: entry for entry in catalogue}
    problems: list[gateway_pb2.ToolProblem] = []
    refused: set[str] = set()
    unavailable: set[str] = set()
    for tool in offered:
        entry = entries.get(tool.name)
        try:
            issues = _issues(tool, entry)
        except RecursionError:
            issues = ["a schema is nested too deeply to check"]
        if not issues:
            continue
        modules = [n.module_id for n in entry.needed_by if n.required] if entry else []
        problems.append(_problem(tool.name, issues, modules))
        refused.add(tool.name)
        unavailable.update(modules)
    names = {tool.name for tool in offered}
    for name, entry in entries.items():
        # Modules of a feature this server lacks are unavailable anyway: their tools may be
        # missing.
        modules = [
            n.module_id for n in entry.needed_by if n.required and n.owner_feature in installed
        ]
        if name in names or not modules:
            continue
        problems.append(_problem(name, [f"not offered; required by {', '.join(modules)}"], modules))
        unavailable.update(modules)
    problems.sort(key=lambda p: p.tool)
    return ContractCheck(tuple(problems), frozenset(refused), tuple(sorted(unavailable)))
