"""Choosing text by the player's language."""

from __future__ import annotations

from services.texts import counted, pick

__all__ = ["counted", "language_name", "pick"]

_LANGUAGE_NAMES = {"zh": "Simplified Chinese", "en": "English"}


def language_name(language: str) -> str:
    """The language's name as model instructions spell it ("Answer in <name>"); English for
    one without a name here."""
    return _LANGUAGE_NAMES.get(language, "English")
