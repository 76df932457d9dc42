"""How a command is written for a player, in their language: `/buy <物品 [数量]>` for a Chinese
player and `/buy <item [count]>` for an English one. The engine's help and the router's
messages about a command's argument both write it here, from the command's declaration."""

from __future__ import annotations

from system.common.v1 import catalog_pb2

__all__ = ["argument_label", "usage"]


def argument_label(command: catalog_pb2.CommandDeclaration, language: str) -> str:
    """The argument as `language` writes it: the declaration's label in that language, else its
    name (`item [count]`)."""
    return command.argument_label.text.get(language) or command.argument_name


def usage(alias: str, command: catalog_pb2.CommandDeclaration, language: str) -> str:
    """`/alias`, `/alias <argument>` (required) or `/alias [argument]` (optional)."""
    if command.argument_kind == catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT:
        return f"/{alias} <{argument_label(command, language)}>"
    if command.argument_kind == catalog_pb2.ARGUMENT_KIND_OPTIONAL_TEXT:
        return f"/{alias} [{argument_label(command, language)}]"
    return f"/{alias}"
