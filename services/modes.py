"""Conversation modes by name (system.common.v1.ConversationMode): what operators write in
configuration and what players type, one table for every service."""

from __future__ import annotations

from system.common.v1 import common_pb2

__all__ = ["MODES", "mode_by_name", "mode_name"]

MODES: dict[str, common_pb2.ConversationMode] = {
    "offline": common_pb2.CONVERSATION_MODE_OFFLINE,
    "standard": common_pb2.CONVERSATION_MODE_STANDARD,
    "extended": common_pb2.CONVERSATION_MODE_EXTENDED,
    "free": common_pb2.CONVERSATION_MODE_FREE,
}
"""Each mode's name, in the order of the enum (and of a settings card's buttons)."""


def mode_by_name(name: str) -> common_pb2.ConversationMode | None:
    """The mode called `name` (any case, surrounding spaces ignored); None for another name."""
    return MODES.get(name.strip().lower())


def mode_name(mode: int) -> str:
    """`offline`, `standard`, `extended` or `free`; empty for UNSPECIFIED or an unknown number."""
    for name, value in MODES.items():
        if value == mode:
            return name
    return ""
