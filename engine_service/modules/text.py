"""Choosing text by the player's language."""

from __future__ import annotations

__all__ = ["pick"]


def pick(texts: dict[str, str], language: str) -> str:
    """The text for `language`, else English, else any."""
    return texts.get(language) or texts.get("en") or next(iter(texts.values()), "")
