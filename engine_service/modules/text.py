"""Choosing text by the player's language."""

from __future__ import annotations

from typing import Any

__all__ = ["language_name", "pick"]

_LANGUAGE_NAMES = {"zh": "Simplified Chinese", "en": "English"}


def pick(texts: dict[str, str], language: str, **values: Any) -> str:
    """The text for `language`, else English, else any; formatted with `values` when given."""
    text = texts.get(language) or texts.get("en") or next(iter(texts.values()), "")
    return text.format(**values) if values else text


def language_name(language: str) -> str:
    """The language's name as model instructions spell it ("Answer in <name>"); English for
    one without a name here."""
    return _LANGUAGE_NAMES.get(language, "English")
