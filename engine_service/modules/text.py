"""Choosing text by the player's language."""

from __future__ import annotations

from collections.abc import Mapping

from services.texts import pick

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


_PLURAL_ENDINGS = (("ies", "y"), ("ches", "ch"), ("shes", "sh"), ("xes", "x"), ("sses", "ss"))


def singular(query: str) -> str | None:
    """The singular of an English plural (`diamonds`, `torches`, `berries`), for a second
    lookup by name when the first found nothing; None for anything else."""
    folded = query.casefold()
    if not query.isascii() or len(query) < 4 or not folded.endswith("s"):
        return None
    for plural, single in _PLURAL_ENDINGS:
        if folded.endswith(plural):
            return query[: -len(plural)] + single
    return None if folded.endswith("ss") else query[:-1]
