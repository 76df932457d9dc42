"""The module registry: a module declares itself once; commands, help, the router's catalogue
and execution all derive from that declaration. Registration freezes at start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from typing import Any, Protocol

from google.protobuf import struct_pb2
from system.common.v1 import catalog_pb2, common_pb2

from engine_service.schema import check_schema
from engine_service.tools import ToolRegistry, ToolRegistryError, ToolSpec
from services.runtime.config import ConfigError
from services.runtime.permissions import CORE_FEATURE, module_available

__all__ = [
    "CommandSpec",
    "ExecutionPolicy",
    "Module",
    "ModuleContext",
    "ModuleRegistry",
    "ModuleSpec",
    "RegistryError",
    "SemanticSpec",
    "load_entry_point_modules",
]

log = logging.getLogger("system.engine.registry")

IDENTIFIER = re.compile(r"^[a-z0-9_.-]+:[a-z0-9_./-]+$")
ENTRY_POINT_GROUP = "system.modules"


class RegistryError(ConfigError):
    """A registration conflicts with what is registered, or came after the freeze. At start
    this is a deployment error (say, two installed modules claim one alias): the engine refuses
    to start, like any other invalid configuration."""


@dataclasses.dataclass(frozen=True)
class CommandSpec:
    """A command reaching a module. The first alias is the canonical name."""

    aliases: tuple[str, ...]
    argument: str = ""
    """Input field that receives the argument text; empty for literal commands."""
    argument_required: bool = False
    argument_label: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """How help writes the argument per language (`{"zh": "玩家 金额", "en": "player amount"}` for
    `/pay <player amount>`); a language without one reads the English, else the field's name."""

    def descriptor(self) -> catalog_pb2.CommandDeclaration:
        if not self.argument:
            kind = catalog_pb2.ARGUMENT_KIND_UNSPECIFIED
        elif self.argument_required:
            kind = catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT
        else:
            kind = catalog_pb2.ARGUMENT_KIND_OPTIONAL_TEXT
        return catalog_pb2.CommandDeclaration(
            aliases=list(self.aliases),
            argument_kind=kind,
            argument_name=self.argument_label.get("en") or self.argument,
            argument_field=self.argument,
            argument_label=catalog_pb2.LocalizedText(text=dict(self.argument_label)),
        )


@dataclasses.dataclass(frozen=True)
class SemanticSpec:
    """How local semantic routing may use a module (seed 004's RoutingProfile)."""

    examples: dict[str, tuple[str, ...]]
    """Example sentences per language code."""
    extractor: str = ""
    """Argument extractor re-parsing the input from the player's text (`item_id`,
    `list_index`, `name`, `item`, `price`: router_service/semantic/extractors.py), or empty for
    modules without arguments."""
    choice_label: str = ""
    """Translation key of the label when offered as a choice."""
    shortcut: bool = False
    """True when the no-argument form may be offered as a read-only shortcut button."""

    def profile(self, read_only_tools: bool) -> catalog_pb2.SemanticProfile:
        return catalog_pb2.SemanticProfile(
            examples=_examples(self.examples),
            extractor=self.extractor,
            choice_label=self.choice_label,
            read_only_tools=read_only_tools,
            shortcut=self.shortcut,
        )


def _examples(examples: dict[str, tuple[str, ...]]) -> list[catalog_pb2.LanguageExamples]:
    return [
        catalog_pb2.LanguageExamples(language=language, examples=list(sentences))
        for language, sentences in sorted(examples.items())
    ]


@dataclasses.dataclass(frozen=True)
class ExecutionPolicy:
    """A module's budgets for one run (seed 000's ExecutionPolicy). The execution context
    enforces each; running out ends the run with `system.error.budget_exhausted` (or
    `system.error.timeout` for `seconds`)."""

    rounds: int = 1
    """Reasoning rounds (ReAct iterations) a run may take."""
    model_calls: int = 1
    """Model calls a run may make."""
    tool_calls: int = 8
    """Tool calls (server and game tools together, required and optional alike)."""
    steps: int = 16
    """Steps in all: every tool call and every model call is one step."""
    seconds: float = 30.0
    """Longest a run may take; the caller's deadline wins when it is earlier."""
    write_steps: int = 0
    """Calls of tools that are not read-only; 0 for read-only workflows."""
    model_call_seconds: float = 20.0
    """Longest one model call may take (the run's own deadline wins when it is earlier)."""

    def __post_init__(self) -> None:
        for name in ("rounds", "model_calls", "tool_calls", "steps", "write_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RegistryError(f"policy.{name} must be a whole number >= 0, not {value!r}")
        if self.rounds < 1 or self.steps < 1:
            raise RegistryError("policy.rounds and policy.steps must be at least 1")
        if not (isinstance(self.seconds, int | float) and math.isfinite(self.seconds)):
            raise RegistryError(f"policy.seconds must be a finite number, not {self.seconds!r}")
        if self.seconds <= 0:
            raise RegistryError("policy.seconds must be positive")
        if not (
            isinstance(self.model_call_seconds, int | float)
            and math.isfinite(self.model_call_seconds)
            and self.model_call_seconds > 0
        ):
            raise RegistryError(
                f"policy.model_call_seconds must be a positive number, not {self.model_call_seconds!r}"
            )
        if self.write_steps > self.tool_calls:
            raise RegistryError(
                f"policy.write_steps ({self.write_steps}) cannot exceed "
                f"policy.tool_calls ({self.tool_calls}): every write step is a tool call"
            )


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    """Everything a module declares about itself."""

    module_id: str
    description: dict[str, str]
    """Description per language code (`zh`, `en`) for help and the model."""
    input_schema: dict[str, Any]
    commands: tuple[CommandSpec, ...] = ()
    routing_mode: catalog_pb2.RoutingMode = catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY
    owner_feature: str = CORE_FEATURE
    min_permission_level: int = 0
    interactive: bool = True
    event_allowed: bool = False
    semantic: SemanticSpec | None = None
    """Local routing profile; None when the module is reached only by commands and the model."""
    tools: tuple[str, ...] = ()
    """Tools the module needs (ids of server or game tools). Only declared tools may be called."""
    optional_tools: tuple[str, ...] = ()
    """Tools the module uses when their exporting feature is enabled for the player; their
    absence never disables the module. Never overlaps `tools`."""
    policy: ExecutionPolicy = dataclasses.field(default_factory=ExecutionPolicy)
    """Budgets of one run."""
    history_entries: int = 0
    """How many of the player's newest history entries an interactive run reads: they come
    with the run's begin call (JournalService.BeginRun) instead of a call of their own."""
    events: tuple[str, ...] = ()
    """Game event types (`minecraft:advancement`) the module handles: each such event becomes a
    persisted task running this module with the event's data as input. Needs
    `event_allowed`, and every tool it declares must be event-allowed."""
    question_field: str = ""
    """The input field that takes a question in the player's own words: a selection card
    offers the module, the whole text in that field, for a text that asks something when no
    model can be asked. One of `input_schema`'s string properties, of a module without write
    steps; empty for modules that answer no free question."""

    @property
    def write_steps(self) -> int:
        """Write steps the policy allows (what the catalogue publishes)."""
        return self.policy.write_steps

    @property
    def needs_player_lease(self) -> bool:
        """Whether an interactive run holds the player's storage lease (decision 0020): a
        run that may write, so that one such run per player goes on across replicas, and a
        run that reads the history, so that it sees the exchange answered before it. Other
        runs read only the game and what this request carries: they take no lease, and the
        gateway already lets a player have one request in progress at a time."""
        return self.policy.write_steps > 0 or self.history_entries > 0

    def descriptor(self, read_only_tools: bool = True) -> catalog_pb2.ModuleDescriptor:
        """The catalogue entry. `read_only_tools` says whether every declared tool is read-only;
        the registry, which knows the tools, passes it (see `ModuleRegistry.descriptor`)."""
        semantic = self.semantic.profile(read_only_tools=read_only_tools) if self.semantic else None
        return catalog_pb2.ModuleDescriptor(
            module_id=self.module_id,
            owner_feature=self.owner_feature,
            description=catalog_pb2.LocalizedText(text=self.description),
            input_schema=json.dumps(self.input_schema, sort_keys=True),
            commands=[c.descriptor() for c in self.commands],
            routing_mode=self.routing_mode,
            min_permission_level=self.min_permission_level,
            interactive=self.interactive,
            event_allowed=self.event_allowed,
            write_steps=self.write_steps,
            semantic=semantic,
            question_field=self.question_field,
        )


class ModuleContext(Protocol):
    """What a running module may use. The engine gives each run its own."""

    player: common_pb2.PlayerContext
    registry: ModuleRegistry
    source: int
    """How the module was chosen (`system.engine.v1.RouteSource`)."""

    async def tool(self, tool_id: str, data: dict[str, Any] | None = None) -> dict[str, Any]: ...

    async def tools(
        self, calls: Sequence[tuple[str, dict[str, Any] | None]]
    ) -> list[dict[str, Any]]:
        """Tools whose calls do not depend on one another, called together (see
        `ExecutionContext.tools`)."""
        ...

    def charge_model_call(self) -> None: ...

    def partial(self, failure: Any, message: str) -> common_pb2.AgentResult: ...

    async def list_history(self, page_size: int) -> list[common_pb2.HistoryEntry]: ...


class Module(Protocol):
    """A workflow. `run` gets the checked input and returns the result to show."""

    spec: ModuleSpec

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult: ...


def _alias_key(alias: str) -> str:
    # English aliases match case-insensitively; casefold leaves CJK untouched.
    return alias.strip().casefold()


class ModuleRegistry:
    """Holds modules by id. Register everything, then `freeze()`; lookups work after that.

    Args:
        tools: the tool registry modules' tools are checked against; it freezes with this one.
    """

    def __init__(self, tools: ToolRegistry | None = None) -> None:
        self.tools = tools if tools is not None else ToolRegistry()
        self._modules: dict[str, Module] = {}
        self._descriptors: dict[str, catalog_pb2.ModuleDescriptor] = {}
        self._rejects: dict[str, dict[str, tuple[str, ...]]] = {}
        self._aliases: dict[str, str] = {}
        self._handlers: dict[str, list[str]] = {}
        self._frozen = False
        self._generation = ""

    def register(self, module: Module) -> None:
        """Adds a module after checking its id, its aliases and its schema.

        Raises:
            RegistryError: frozen, malformed id, duplicate id or alias, or a bad schema.
        """
        spec = module.spec
        if self._frozen:
            raise RegistryError(f"cannot register {spec.module_id}: the registry is frozen")
        if not IDENTIFIER.match(spec.module_id):
            raise RegistryError(f"module id {spec.module_id!r} is not of the form namespace:path")
        if spec.module_id in self._modules:
            raise RegistryError(f"module {spec.module_id} is already registered")
        try:
            check_schema(spec.input_schema)
        except ValueError as exc:
            raise RegistryError(f"{spec.module_id}: input_schema: {exc}") from None
        if not spec.description:
            raise RegistryError(f"{spec.module_id}: a description is required")
        seen: dict[str, str] = {}
        for command in spec.commands:
            if not command.aliases:
                raise RegistryError(f"{spec.module_id}: a command needs at least one alias")
            for alias in command.aliases:
                key = _alias_key(alias)
                if not key or any(ch.isspace() for ch in alias) or key.startswith("/"):
                    raise RegistryError(
                        f"{spec.module_id}: alias {alias!r} must be one word without a leading /"
                    )
                owner = self._aliases.get(key) or seen.get(key)
                if owner:
                    raise RegistryError(
                        f"{spec.module_id}: alias {alias!r} is already used by {owner}"
                    )
                seen[key] = spec.module_id
            if command.argument and command.argument not in spec.input_schema.get("properties", {}):
                raise RegistryError(
                    f"{spec.module_id}: command argument {command.argument!r} is not an input field"
                )
        tools = self._check_tools(spec)
        self._check_events(spec, tools)
        read_only = all(tool.read_only for tool in tools)
        if spec.question_field:
            field = spec.input_schema.get("properties", {}).get(spec.question_field)
            if not isinstance(field, dict) or field.get("type") != "string":
                raise RegistryError(
                    f"{spec.module_id}: question_field {spec.question_field!r} is not a string "
                    "input field"
                )
            if spec.write_steps or not read_only:
                raise RegistryError(
                    f"{spec.module_id}: a module that answers questions from a selection card "
                    "must only read (no write steps, read-only tools)"
                )
        for event_type in spec.events:
            self._handlers.setdefault(event_type, []).append(spec.module_id)
        self._modules[spec.module_id] = module
        self._descriptors[spec.module_id] = spec.descriptor(read_only_tools=read_only)
        self._aliases.update(seen)

    def amend(self, module_id: str, **changes: Any) -> None:
        """Replaces fields of a registered module's spec (configuration: a budget, the admin
        level) on this registry's own module object, and its catalogue entry with it. Only
        before `freeze`."""
        if self._frozen:
            raise RegistryError(f"cannot amend {module_id}: the registry is frozen")
        module = self._modules[module_id]
        module.spec = dataclasses.replace(module.spec, **changes)
        read_only = all(tool.read_only for tool in self._check_tools(module.spec))
        self._descriptors[module_id] = module.spec.descriptor(read_only_tools=read_only)

    def _check_tools(self, spec: ModuleSpec) -> list[ToolSpec]:
        """Resolves the module's declared tools, checking they exist and fit its policy."""
        overlap = sorted(set(spec.tools) & set(spec.optional_tools))
        if overlap:
            raise RegistryError(
                f"{spec.module_id}: {', '.join(overlap)} declared both required and optional"
            )
        for group in (spec.tools, spec.optional_tools):
            if len(set(group)) != len(group):
                raise RegistryError(f"{spec.module_id}: a tool is declared twice")
        try:
            tools = [self.tools.resolve(t) for t in (*spec.tools, *spec.optional_tools)]
        except ToolRegistryError as exc:
            raise RegistryError(f"{spec.module_id}: {exc}") from None
        for tool in tools:
            if tool.tool_id in spec.optional_tools and not tool.read_only:
                raise RegistryError(
                    f"{spec.module_id}: optional tool {tool.tool_id} must be read-only"
                )
        writes = [t.tool_id for t in tools if not t.read_only]
        if writes and spec.policy.write_steps == 0:
            raise RegistryError(
                f"{spec.module_id}: declares write tools ({', '.join(writes)}) "
                "but its policy allows no write steps"
            )
        if spec.routing_mode == catalog_pb2.ROUTING_MODE_READ and (
            writes or spec.policy.write_steps
        ):
            raise RegistryError(
                f"{spec.module_id}: READ routing (local matches) needs read-only tools and "
                "no write steps; use HINTS for workflows that write"
            )
        return tools

    @staticmethod
    def _check_events(spec: ModuleSpec, tools: list[ToolSpec]) -> None:
        """An event handler must be allowed to run from events, with event-allowed tools
        only: otherwise every task it gets would fail at its first step."""
        if not spec.events:
            return
        if not spec.event_allowed:
            raise RegistryError(f"{spec.module_id}: handles events but is not event_allowed")
        if len(set(spec.events)) != len(spec.events):
            raise RegistryError(f"{spec.module_id}: an event type is declared twice")
        for event_type in spec.events:
            if not IDENTIFIER.match(event_type):
                raise RegistryError(
                    f"{spec.module_id}: event type {event_type!r} is not of the form namespace:path"
                )
        refused = [t.tool_id for t in tools if not t.event_allowed]
        if refused:
            raise RegistryError(
                f"{spec.module_id}: handles events but declares tools events may not call: "
                f"{', '.join(refused)}"
            )

    def handlers(self, event_type: str) -> list[Module]:
        """Modules handling `event_type`, in registration order."""
        return [self._modules[m] for m in self._handlers.get(event_type, ())]

    def reject(self, profile_id: str, examples: Mapping[str, tuple[str, ...]]) -> None:
        """Registers a reject profile: examples that take part in routing margins and fallbacks
        but never execute (say, small talk that looks like a command).

        Raises:
            RegistryError: frozen, malformed or taken id, or no examples.
        """
        if self._frozen:
            raise RegistryError(
                f"cannot register reject profile {profile_id}: the registry is frozen"
            )
        if not IDENTIFIER.match(profile_id):
            raise RegistryError(
                f"reject profile id {profile_id!r} is not of the form namespace:path"
            )
        if profile_id in self._modules or profile_id in self._rejects:
            raise RegistryError(f"reject profile {profile_id} clashes with a registered id")
        if not any(examples.values()):
            raise RegistryError(f"reject profile {profile_id} needs examples")
        self._rejects[profile_id] = dict(examples)

    def reject_profiles(self) -> list[catalog_pb2.RejectProfile]:
        return [
            catalog_pb2.RejectProfile(profile_id=profile_id, examples=_examples(examples))
            for profile_id, examples in self._rejects.items()
        ]

    def freeze(self) -> None:
        """Ends registration (of modules and tools) and fixes the generation (a hash of the
        whole catalogue)."""
        self._frozen = True
        self.tools.freeze()
        digest = hashlib.sha256()
        for descriptor in self._descriptors.values():
            digest.update(descriptor.SerializeToString(deterministic=True))
        for reject in self.reject_profiles():
            digest.update(reject.SerializeToString(deterministic=True))
        self._generation = digest.hexdigest()[:16]

    @property
    def generation(self) -> str:
        return self._generation

    def get(self, module_id: str) -> Module | None:
        return self._modules.get(module_id)

    def descriptor(self, module_id: str) -> catalog_pb2.ModuleDescriptor:
        """The catalogue entry of a registered module.

        Raises:
            KeyError: no such module.
        """
        return self._descriptors[module_id]

    def allows(self, module_id: str, player: common_pb2.PlayerContext) -> bool:
        """True when `player` may use the registered module `module_id` now: their permission
        and features allow it, and their game server offers the game tools it needs (it is not
        in `player.unavailable_modules`, which the gateway sets from the hello's check)."""
        descriptor = self._descriptors.get(module_id)
        return descriptor is not None and module_available(descriptor, player)

    def modules(self) -> list[Module]:
        """Every module, in registration order."""
        return list(self._modules.values())

    def available(self, player: common_pb2.PlayerContext | None) -> list[Module]:
        """Modules `player` may use (all of them when player is None)."""
        if player is None:
            return self.modules()
        return [m for m in self._modules.values() if self.allows(m.spec.module_id, player)]

    def descriptors(
        self, player: common_pb2.PlayerContext | None
    ) -> list[catalog_pb2.ModuleDescriptor]:
        return [self._descriptors[m.spec.module_id] for m in self.available(player)]


def load_entry_point_modules(disabled: Iterable[str] = ()) -> list[Module]:
    """Modules installed by other packages under the `system.modules` entry-point group.

    Each entry point names a zero-argument callable (usually the module class) returning a
    Module. A broken entry point is logged and skipped, never fatal.
    """
    skip = set(disabled)
    found: list[Module] = []
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in skip:
            continue
        try:
            found.append(entry.load()())
        except Exception:  # noqa: BLE001 - a third-party module must not stop the engine
            log.exception("cannot load module entry point %s", entry.name)
    return found


def struct_to_dict(value: struct_pb2.Struct) -> dict[str, Any]:
    """A Struct as plain Python values."""
    from google.protobuf import json_format

    return json_format.MessageToDict(value)
