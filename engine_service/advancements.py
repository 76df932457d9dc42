"""Advancement rules (seed 000's AdvancementConfig): which module a `minecraft:advancement`
event runs, and with which input, read from a JSON file instead of a table in code.

```json
{
  "rules": [
    {
      "advancement": "minecraft:story/mine_diamond",
      "module": "system:advancement_reward",
      "input": {"items": [{"item": "minecraft:diamond", "count": 1}]}
    }
  ],
  "default": {
    "module": "system:advancement_reward",
    "input": {"items": [{"item": "minecraft:experience_bottle", "count": 1}]}
  }
}
```

`rules` gives one advancement (a `namespace:path` id, each at most once) a module and its
input; `default` (optional) applies to every advancement without a rule; without a `default`
such an advancement makes no task. The engine ships `advancements.json` beside this file,
used when the `advancements_file` setting is empty.

Each rule is checked against the frozen registry when the file is read, at start and on
reload: the module is registered, handles `minecraft:advancement` events and may run from
events; the input passes the module's input schema (the engine's one checker,
`engine_service.schema`); the write steps the input needs fit the module's policy (for modules
that can say, see `PlansWriteSteps`); no unknown keys, malformed or repeated advancement ids.
Every refusal is a ConfigError naming the file, the rule (`rules[2]` and its advancement, or
`default`) and the field. A bad file stops the engine at start; on reload it is refused and
the rules in force stay.

A task gets its rule's input when the event arrives and keeps it: a reload changes what later
events run, never a task already made (nor one replayed after a crash).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from engine_service.registry import IDENTIFIER, Module
from engine_service.schema import normalise, violation
from services.runtime.config import ConfigError, read_json_file
from services.runtime.errors import InvalidArgument

__all__ = [
    "ADVANCEMENT_EVENT",
    "DEFAULT_RULES_FILE",
    "EVENT_DATA_SCHEMA",
    "AdvancementConfig",
    "AdvancementRule",
    "AdvancementRules",
    "PlansWriteSteps",
    "load_advancement_rules",
    "parse_advancement_rules",
]

log = logging.getLogger("system.engine.advancements")

ADVANCEMENT_EVENT = "minecraft:advancement"
"""The game event type the rules apply to."""
DEFAULT_RULES_FILE = Path(__file__).with_name("advancements.json")
"""The shipped rules, used when the `advancements_file` setting is empty."""
MAX_ADVANCEMENT_ID = 128

EVENT_DATA_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "advancement": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_ADVANCEMENT_ID,
            "pattern": IDENTIFIER.pattern,
        }
    },
    "required": ["advancement"],
    "additionalProperties": False,
}
"""What a game server sends as a `minecraft:advancement` event's data."""

_TOP_KEYS = ("rules", "default")
_RULE_KEYS = ("advancement", "module", "input")
_DEFAULT_KEYS = ("module", "input")


class ModuleLookup(Protocol):
    """What the rules need of the module registry."""

    def get(self, module_id: str) -> Module | None: ...

    def handlers(self, event_type: str) -> list[Module]: ...


@runtime_checkable
class PlansWriteSteps(Protocol):
    """A module that can tell, from its input alone, how many write steps a run will take
    (the reward module: one give per stack). Rules naming it are checked against its policy's
    `write_steps` when read; other modules' writes are bounded at run time only."""

    def planned_write_steps(self, data: dict[str, Any]) -> int: ...


@dataclasses.dataclass(frozen=True)
class AdvancementRule:
    """One rule: the module an advancement's event runs, and the module's input."""

    module_id: str
    """The module the task runs."""
    input: Mapping[str, Any]
    """The module's input, checked against its schema (whole numbers as `int`)."""
    advancement: str = ""
    """The advancement id; empty for the default rule."""

    def data(self) -> dict[str, Any]:
        """A fresh copy of the input, for a task to store."""
        copy: dict[str, Any] = json.loads(json.dumps(self.input, default=dict))
        return copy


@dataclasses.dataclass(frozen=True)
class AdvancementRules:
    """One version of the rules, as read from `source`."""

    source: str
    """The file they were read from."""
    rules: Mapping[str, AdvancementRule]
    """Rules by advancement id, in file order."""
    default: AdvancementRule | None
    """The rule for advancements without their own; None: those make no task."""

    @property
    def digest(self) -> str:
        """16 hex digits of SHA-256 over the rules as checked: equal on replicas (and
        reloads) that hold the same rules."""
        canonical = {
            "rules": [
                {"advancement": r.advancement, "module": r.module_id, "input": r.input}
                for r in self.rules.values()
            ],
            "default": None
            if self.default is None
            else {"module": self.default.module_id, "input": self.default.input},
        }
        text = json.dumps(canonical, sort_keys=True, ensure_ascii=False, default=dict)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def rule_for(self, advancement: str) -> AdvancementRule | None:
        """The advancement's rule, else the default, else None."""
        return self.rules.get(advancement, self.default)

    def rule_for_event(self, data: dict[str, Any]) -> AdvancementRule | None:
        """The rule for a `minecraft:advancement` event with `data`.

        Raises:
            InvalidArgument: the data is not `{"advancement": "<namespace:path>"}`; the message
                names the field.
        """
        found = violation(EVENT_DATA_SCHEMA, data)
        if found is not None:
            if found.path == "advancement" and found.expected.startswith("must match"):
                raise InvalidArgument(
                    f"{ADVANCEMENT_EVENT} event: data field 'advancement' must be an "
                    "advancement id of the form namespace:path"
                )
            where = f"data field '{found.path}'" if found.path else "data"
            raise InvalidArgument(f"{ADVANCEMENT_EVENT} event: {where} {found.expected}")
        return self.rule_for(data["advancement"])


def _object(where: str, value: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a JSON object, got {json.dumps(value)[:80]}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ConfigError(
            f"{where} has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(keys)}"
        )
    return value


def _rule(
    where: str, value: dict[str, Any], registry: ModuleLookup, advancement: str = ""
) -> AdvancementRule:
    """Checks a rule's module and input (its advancement id is already checked)."""
    module_id = value.get("module")
    if not isinstance(module_id, str) or not module_id:
        raise ConfigError(
            f"{where}: module is required (a module id such as system:advancement_reward)"
        )
    handling = ", ".join(m.spec.module_id for m in registry.handlers(ADVANCEMENT_EVENT))
    module = registry.get(module_id)
    if module is None:
        raise ConfigError(
            f"{where}: module {module_id!r} is not registered; modules handling "
            f"{ADVANCEMENT_EVENT} events: {handling or 'none'}"
        )
    spec = module.spec
    if ADVANCEMENT_EVENT not in spec.events:
        raise ConfigError(
            f"{where}: module {module_id} does not handle {ADVANCEMENT_EVENT} events; "
            f"modules that do: {handling or 'none'}"
        )
    if not spec.event_allowed:
        raise ConfigError(f"{where}: module {module_id} may not run from events")
    data = value.get("input", {})
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: input must be a JSON object (the module's input)")
    found = violation(spec.input_schema, data)
    if found is not None:
        field = f"input.{found.path}" if found.path else "input"
        raise ConfigError(f"{where}: {field} {found.expected} ({module_id}'s input schema)")
    data = normalise(spec.input_schema, data)
    if isinstance(module, PlansWriteSteps):
        writes = module.planned_write_steps(data)
        if writes > spec.policy.write_steps:
            raise ConfigError(
                f"{where}: input needs {writes} write steps, but {module_id}'s policy allows "
                f"{spec.policy.write_steps} (write_steps)"
            )
    return AdvancementRule(module_id=module_id, input=_frozen(data), advancement=advancement)


def _frozen(value: Any) -> Any:
    """Read-only views of a checked input: rules are shared by every event that uses them."""
    if isinstance(value, dict):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def parse_advancement_rules(
    data: Any, registry: ModuleLookup, source: str = "advancements.json"
) -> AdvancementRules:
    """Checks the decoded JSON document against `registry` (frozen) and builds the rules.

    Raises:
        ConfigError: naming `source`, the rule (`rules[i] (<advancement>)` or `default`) and
            the field, saying what it must be.
    """
    document = _object(f"{source}: the document", data, _TOP_KEYS)
    if "rules" not in document:
        raise ConfigError(f"{source}: rules is required (a list of rules, possibly empty)")
    listed = document["rules"]
    if not isinstance(listed, list):
        raise ConfigError(f"{source}: rules must be a list of rules")
    rules: dict[str, AdvancementRule] = {}
    first: dict[str, int] = {}
    for index, value in enumerate(listed):
        where = f"{source}: rules[{index}]"
        value = _object(where, value, _RULE_KEYS)
        advancement = value.get("advancement")
        if not isinstance(advancement, str) or not advancement:
            raise ConfigError(
                f"{where}: advancement is required (an id such as minecraft:story/mine_diamond)"
            )
        if len(advancement) > MAX_ADVANCEMENT_ID or not IDENTIFIER.match(advancement):
            raise ConfigError(
                f"{where}: advancement {advancement!r} is not an advancement id of the form "
                f"namespace:path (lower case, at most {MAX_ADVANCEMENT_ID} characters)"
            )
        where = f"{where} ({advancement})"
        if advancement in first:
            raise ConfigError(
                f"{where}: advancement {advancement} already has a rule, rules[{first[advancement]}]"
            )
        first[advancement] = index
        rules[advancement] = _rule(where, value, registry, advancement)
    default = None
    if document.get("default") is not None:
        where = f"{source}: default"
        default = _rule(where, _object(where, document["default"], _DEFAULT_KEYS), registry)
    return AdvancementRules(source=source, rules=MappingProxyType(rules), default=default)


def load_advancement_rules(path: str | Path, registry: ModuleLookup) -> AdvancementRules:
    """Reads and checks the rules file at `path`.

    Raises:
        ConfigError: the file is missing, unreadable or not JSON, or a rule is refused; the
            message names the file, the rule and the field.
    """
    document = read_json_file(path, "advancement rules file (setting advancements_file)")
    return parse_advancement_rules(document, registry, str(path))


class AdvancementConfig:
    """The rules in force (seed 000's AdvancementConfig instance): read at start, replaced
    only by a reload that passes every check.

    Args:
        path: the rules file (`advancements_file`); empty for the shipped one.
        registry: the frozen module registry the rules are checked against.

    Raises:
        ConfigError: the file is refused (the engine does not start).
    """

    def __init__(self, path: str | Path, registry: ModuleLookup) -> None:
        self.path = Path(path) if path else DEFAULT_RULES_FILE
        self._registry = registry
        self._lock = threading.Lock()  # one reload at a time; readers never wait
        self._rules = load_advancement_rules(self.path, registry)
        self._log("advancement rules read", self._rules)

    def get(self) -> AdvancementRules:
        """The rules in force."""
        return self._rules

    def reload(self) -> AdvancementRules:
        """Reads the file again; its rules replace the ones in force only if all pass.
        Blocking (file and checks): call it off the event loop.

        Raises:
            ConfigError: the file is refused; the rules in force stay (and it is logged).
        """
        with self._lock:
            try:
                rules = load_advancement_rules(self.path, self._registry)
            except ConfigError as exc:
                log.error(
                    "advancement rules not reloaded; the %d rules in force (digest %s) stay: %s",
                    len(self._rules.rules),
                    self._rules.digest,
                    exc,
                )
                raise
            self._rules = rules
        self._log("advancement rules reloaded", rules)
        return rules

    @staticmethod
    def _log(what: str, rules: AdvancementRules) -> None:
        log.info(
            "%s from %s: %d rules, %s, digest %s",
            what,
            rules.source,
            len(rules.rules),
            f"default {rules.default.module_id}" if rules.default else "no default",
            rules.digest,
        )
