"""Exact command and alias matching, derived from the engine's catalogue.

`/help`, `help`, `帮助`, `/system help` and `/HELP` all reach `system:help`; arguments are
kept as typed. A malformed explicit command (one that starts with `/`) is an input error; an
unknown slash command is reported as such and never reaches the model; plain text that is not
exactly a command goes on to the next routing stage.

Without a slash, an alias is a command when it is the whole text, or (issue 15) when it is a
Chinese alias followed by whitespace and an argument, of a command that requires one, of a
module without write steps: `查询物品 钻石` is `/item 钻石`. Everything else with words after
the alias is left to the later stages: a Latin-script alias, since that is how ordinary English
sentences start (`help me find diamonds`, `search for a village`, `item frames are cool`); an
alias whose argument is optional, which is mostly an everyday word too (`帮助 我 找钻石`,
`商店 在哪`); and a write (`领取邮件 3`), which still needs its slash or a button.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from google.protobuf import struct_pb2
from system.common.v1 import catalog_pb2, common_pb2

from services.commands import usage
from services.runtime.errors import InvalidArgument
from services.runtime.permissions import module_available
from services.texts import pick

__all__ = ["CommandIndex", "CommandLead", "CommandMatch", "UnknownCommand", "after_alias"]

SYSTEM_PREFIX = "/system"
_HAN = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_WORD = re.compile(r"[a-z0-9_]+")

# What a player reads about a command they typed wrong, in their language.
_SYSTEM_ALONE = {
    "zh": "/system 后面需要一条指令，例如 /system help",
    "en": "/system needs an instruction, for example /system help",
}
_NO_ARGUMENT = {
    "zh": "/{name} 不带参数；请写 {usage}",
    "en": "/{name} takes no argument; write {usage}",
}
_NEEDS_ARGUMENT = {
    "zh": "/{name} 需要参数；请写 {usage}",
    "en": "/{name} needs an argument; write {usage}",
}
_UNKNOWN = {
    "zh": "/{name} 不是指令；输入 /help 查看全部指令",
    "en": "/{name} is not a command; /help lists the commands",
}


@dataclasses.dataclass(frozen=True)
class CommandMatch:
    """A text that is exactly a command."""

    action: common_pb2.ModuleAction


@dataclasses.dataclass(frozen=True)
class UnknownCommand:
    """An explicit slash command that no module (available to this player) declares."""

    name: str

    def message(self, language: str) -> str:
        """What the player reads: that it is no command, and where the commands are."""
        return pick(_UNKNOWN, language, name=self.name)


@dataclasses.dataclass(frozen=True)
class CommandLead:
    """A slash-less text that begins with a command's name and goes on with its argument
    (`buy 2 bread`, `转账 alex 50`, `买两个面包`): the command, and the argument as typed."""

    module_id: str
    command: catalog_pb2.CommandDeclaration
    argument: str
    head: str
    """What the text began with: an alias or a Chinese verb."""

    @property
    def chinese(self) -> bool:
        """Begun in Chinese (`转账`, `买`), as a sentence seldom is unless it means the command;
        English sentences begin with such words (`pay attention`, `buy time`)."""
        return _HAN.search(self.head) is not None

    def typed(self) -> str:
        """The command as the player would type it: `/buy 2 bread`."""
        return f"/{self.command.aliases[0]} {self.argument}"


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


def _plain_command(
    name: str, argument: str, kind: int, module: catalog_pb2.ModuleDescriptor
) -> bool:
    """Whether slash-less text that starts with alias `name` is that command: the alias alone
    (when the command needs no argument), or a Chinese alias, whitespace and an argument for a
    command that requires one, of a module without write steps."""
    if not argument:
        return kind != catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT
    return (
        kind == catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT
        and _HAN.search(name) is not None
        and module.write_steps == 0
    )


def after_alias(text: str, aliases: Iterable[str]) -> str | None:
    """`text` less a leading alias (`buy 2 bread` → `2 bread`, `购买钻石` → `钻石`), the longest
    that leads it: a Latin alias only as a whole word (`questions about golems` is no
    `question`), and only with words after it; else None."""
    folded = text.casefold()
    for alias in sorted(aliases, key=len, reverse=True):
        name = alias.casefold()
        if not folded.startswith(name) or len(folded) == len(name):
            continue
        rest = text[len(name) :]
        if name.isascii() and not rest[0].isspace():
            continue
        if any(ch.isalnum() for ch in rest):
            return rest.strip()
    return None


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

    def named_in(self, text: str) -> frozenset[str]:
        """Modules one of whose aliases `text` holds: as a word, or, in Chinese, anywhere (two
        characters or more: `签到` in `我要签到`)."""
        folded = text.casefold()
        words = set(_WORD.findall(folded))
        return frozenset(
            entry.module.module_id
            for alias, entry in self._entries.items()
            if alias in words or (len(alias) >= 2 and _HAN.search(alias) and alias in folded)
        )

    def holding(self, words: Iterable[str]) -> frozenset[str]:
        """Modules one of whose Chinese aliases holds one of the Chinese `words` (`买` in
        `购买`): a verb the text says that is part of a command's name."""
        chinese = [w for w in words if _HAN.search(w)]
        return frozenset(
            entry.module.module_id
            for alias, entry in self._entries.items()
            if _HAN.search(alias) and any(w in alias for w in chinese)
        )

    def leading(self, text: str, verbs: Iterable[str] = ()) -> CommandLead | None:
        """The command that slash-less `text` begins with, followed by an argument, for a
        command that takes one: one of its aliases leads (`转账 alex 50`), or one of the
        Chinese `verbs` the text says (its write words) that one command's Chinese alias alone
        holds (`买` of `购买`: `买两个面包`). None otherwise, and for an explicit command."""
        text = text.strip()
        if text.startswith("/"):
            return None
        heads: dict[str, _Entry] = {}
        for verb in verbs:
            holders = {
                entry.module.module_id: entry
                for alias, entry in self._entries.items()
                if _HAN.search(verb) and _HAN.search(alias) and verb in alias
            }
            if len(holders) == 1:
                heads[verb] = next(iter(holders.values()))
        heads.update(self._entries)
        for head, entry in sorted(heads.items(), key=lambda item: len(item[0]), reverse=True):
            if entry.command.argument_kind == catalog_pb2.ARGUMENT_KIND_UNSPECIFIED:
                continue
            argument = after_alias(text, (head,))
            if argument is not None:
                return CommandLead(entry.module.module_id, entry.command, argument, head)
        return None

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
                    raise InvalidArgument(pick(_SYSTEM_ALONE, player.language))
                name, argument = _split_word(argument)
            name = name.removeprefix("/")
        entry = self._entries.get(name.casefold())
        if entry is None or not module_available(entry.module, player):
            return UnknownCommand(name) if explicit else None
        kind = entry.command.argument_kind
        if not explicit and not _plain_command(name, argument, kind, entry.module):
            # "help me find diamonds" is a sentence for the later routing stages, not the help
            # command; "查询物品 钻石" is the item command.
            return None
        wrong = None
        if kind == catalog_pb2.ARGUMENT_KIND_UNSPECIFIED and argument:
            wrong = _NO_ARGUMENT
        elif kind == catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT and not argument:
            wrong = _NEEDS_ARGUMENT
        if wrong is not None:  # the usage is written only for the message
            written = usage(name, entry.command, player.language)
            raise InvalidArgument(pick(wrong, player.language, name=name, usage=written))
        data = struct_pb2.Struct()
        if argument and entry.command.argument_field:
            data.update({entry.command.argument_field: argument})
        return CommandMatch(common_pb2.ModuleAction(module_id=entry.module.module_id, input=data))
