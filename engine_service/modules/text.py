"""Choosing text by the player's language."""

from __future__ import annotations

from services.texts import counted, pick

__all__ = ["counted", "language_name", "pick", "singular"]

_LANGUAGE_NAMES = {"zh": "Simplified Chinese", "en": "English"}


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
