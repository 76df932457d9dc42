"""Choosing text by the player's language."""

from __future__ import annotations

from collections.abc import Mapping

from services.texts import pick, singular

__all__ = ["language_name", "pick", "singular", "stack_line"]

_LANGUAGE_NAMES = {"zh": "Simplified Chinese", "en": "English"}


def stack_line(item: str, count: int, name: Mapping[str, str] | None, language: str) -> str:
    """`Torch × 32`: a stack by its item's name in the player's language, by its id where no
    name is given."""
    shown = pick(dict(name), language) if name else ""
    return f"{shown or item} × {count}"


def language_name(language: str) -> str:
    """The language's name as model instructions spell it ("Answer in <name>"); English for
    one without a name here."""
    return _LANGUAGE_NAMES.get(language, "English")
