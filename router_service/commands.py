"""Exact command and alias matching, derived from the engine's catalogue.

`/help`, `help`, `帮助`, `/system help` and `/HELP` all reach `system:help`; arguments are
kept as typed. A malformed explicit command (one that starts with `/`) is an input error; an
unknown slash command is reported as such and never reaches the model; plain text that is not
exactly a command goes on to the next routing stage.
"""

from __future__ import annotations

import dataclasses

from google.protobuf import struct_pb2
from system.common.v1 import catalog_pb2, common_pb2

from services.runtime.errors import InvalidArgument
from services.runtime.permissions import module_available

__all__ = ["CommandIndex", "CommandMatch", "UnknownCommand"]

SYSTEM_PREFIX = "/system"


@dataclasses.dataclass(frozen=True)
class CommandMatch:
    """A text that is exactly a command."""

    action: common_pb2.ModuleAction


@dataclasses.dataclass(frozen=True)
class UnknownCommand:
    """An explicit slash command that no module (available to this player) declares."""

    name: str


@dataclasses.dataclass(frozen=True)
class _Entry:
    module: catalog_pb2.ModuleDescriptor
    command: catalog_pb2.CommandDeclaration


def _split_word(text: str) -> tuple[str, str]:
    """The first word and the rest. Any whitespace separates them (the full-width space of CJK
    input methods too, as aliases never contain whitespace); the rest is kept as typed."""
    parts = text.split(maxsplit=1)
    if not parts:
        return "", ""
    return parts[0], parts[1].strip() if len(parts) > 1 else ""


def _usage(alias: str, command: catalog_pb2.CommandDeclaration) -> str:
    if command.argument_kind == catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT:
        return f"/{alias} <{command.argument_name}>"
    if command.argument_kind == catalog_pb2.ARGUMENT_KIND_OPTIONAL_TEXT:
        return f"/{alias} [{command.argument_name}]"
    return f"/{alias}"


class CommandIndex:
    """Alias lookup over one catalogue generation."""

    def __init__(self, modules: list[catalog_pb2.ModuleDescriptor], generation: str) -> None:
        self.generation = generation
        self._entries: dict[str, _Entry] = {}
        for module in modules:
            for command in module.commands:
                for alias in command.aliases:
                    self._entries.setdefault(alias.casefold(), _Entry(module, command))

    def __len__(self) -> int:
        return len(self._entries)

    def match(
        self, text: str, player: common_pb2.PlayerContext
    ) -> CommandMatch | UnknownCommand | None:
        """Matches `text` as a command for `player`; None when it is plain text.

        Raises:
            InvalidArgument: an explicit command with a missing or unexpected argument.
        """
        stripped = text.strip()
        explicit = stripped.startswith("/")
        name, argument = _split_word(stripped)
        if explicit:
            if name.casefold() == SYSTEM_PREFIX:  # `/system <instruction>` forwards the rest
                if not argument:
                    raise InvalidArgument("/system needs an instruction, for example /system help")
                name, argument = _split_word(argument)
            name = name.removeprefix("/")
        entry = self._entries.get(name.casefold())
        if entry is None or not module_available(entry.module, player):
            return UnknownCommand(name) if explicit else None
        kind = entry.command.argument_kind
        if not explicit and (argument or kind == catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT):
            # Plain text counts only when it is exactly a command word: "help me find
            # diamonds" is a sentence for the later routing stages, not the help command.
            return None
        usage = _usage(name, entry.command)
        if kind == catalog_pb2.ARGUMENT_KIND_UNSPECIFIED and argument:
            raise InvalidArgument(f"/{name} takes no argument; write {usage}")
        if kind == catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT and not argument:
            raise InvalidArgument(f"/{name} needs an argument; write {usage}")
        data = struct_pb2.Struct()
        if argument and entry.command.argument_field:
            data.update({entry.command.argument_field: argument})
        return CommandMatch(common_pb2.ModuleAction(module_id=entry.module.module_id, input=data))
