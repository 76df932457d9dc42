"""Typo tolerance for local matching, from the catalogue's own words (issue 17, round 4).

Players mistype (`opne the shop`, `shwo my chat histroy`, `inbxo`). A mistyped word is a word
the catalogue does not know, so it lowers the score and the margin and, as an unknown content
word, stops the n-gram scorer's route: on the own corpus 3 of 38 English typo cases routed.
`Speller.correct` reads a Latin word the router does not know as the word of the catalogue's
examples it becomes when two neighbouring letters are swapped back, when there is exactly one;
failing that, as the example word it inflects (`-s`, `-es`, `-d`, `-ed`, `-ing`, a doubled last
consonant undone: `deleted` -> `delete`, `lists` -> `list`, `talking` -> `talk`), when there is
exactly one (the analyzer's own stemming only takes plurals off, and the character n-grams of
`talking` are not those of `talk`).

A letter changed, added or dropped turns too many real words into catalogue words (measured on
the development set's held-out draws: `clean` to `clear`, `ready` to `read`, `rewind` to
`remind`, `wrote` to `write`, `favourite` to `favorite`), while two real words one swap apart
(`form`, `from`) are rare, and the router never corrects a word it knows. So beyond the swap
only a dropped letter is read (round 15), and only in a word that is no word of English
(`english_words`: counted `ENGLISH_COUNT` times or more in the frequency list pyspellchecker
ships): `histry`, `invntory`, `chck`, `balace` are read as `history`, `inventory`, `check`,
`balance`, while `plane` is never `planet`; and, failing that, a letter doubled by a slip in
such a word (round 25: `ballance`, `shopp`, `inventtory`). Any other letter added, or one
changed, is left as typed even in a word outside English: those were names and slang
(`petey` to `peter`, `wifi` to `wife`, `yeap` to `year`, `udrive` to `drive` on the
development set).

- Only Latin words of at least `MIN_LENGTH` letters, outside item registry ids (an id is the
  extractor's and is kept as typed: `minecraft:diamnod` is a wrong id, not a typo to fix).
- Never a word the router knows: any word of the examples, the lexicon's words, stopwords and
  generic words.
- Only into a word of the examples that is not a stopword or generic word, at least
  `MIN_LENGTH` long (an inflection's base at least 3).

What it changes is the text the index and the n-gram scorer match; the guards read both the
typed and the corrected text (either firing stops a route, so a correction never hides a
negation or a write word, and `ordering` read as `order` is one), and the argument extractor
reads what was typed. Chinese typos are of another kind (a pinyin input method's wrong
character of the same sound, `打开伤店`): `homophones.py` reads them, in the same pass
(`Speller.correct`).
"""

from __future__ import annotations

import functools
import gzip
import importlib.resources
import json
import re
from collections.abc import Iterable

from router_service.semantic.homophones import Homophones
from router_service.semantic.text import ITEM_ID, normalize

__all__ = ["ENGLISH_COUNT", "MIN_LENGTH", "Speller", "english_words", "inflection_bases"]

MIN_LENGTH = 4
"""Shortest word corrected, and shortest correction."""

_LATIN = re.compile(r"[a-z]+")

ENGLISH_COUNT = 100
"""How often a word must be counted in pyspellchecker's English frequency list (built from the
OpenSubtitles corpus) to be a word of English: `rewind` (2,769) is one, `ballance` (50) is not."""


@functools.cache
def english_words() -> frozenset[str]:
    """The words of English (`ENGLISH_COUNT`), from the frequency list pyspellchecker ships:
    loaded once per process (0.3 s, 5 MB kept)."""
    resource = importlib.resources.files("spellchecker") / "resources" / "en.json.gz"
    counts: dict[str, int] = json.loads(gzip.decompress(resource.read_bytes()))
    return frozenset(word for word, count in counts.items() if count >= ENGLISH_COUNT)


_SUFFIXES = ("s", "es", "d", "ed", "ing")
"""English inflections an unknown word may carry on an example word (no `-er`, `-ly`: those
make other words, `player`, `lately`)."""


def inflection_bases(word: str) -> set[str]:
    """The forms of `word` with one inflection taken off (`played`: `play`, `playe`; `tries`:
    `try`; `setting`: `sett`, `sette`, `set`)."""
    out = {word[:-3] + "y"} if word.endswith(("ies", "ied")) else set()
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            stem = word[: -len(suffix)]
            out |= {stem, stem + "e"}
            if len(stem) > 3 and stem[-1] == stem[-2]:
                out.add(stem[:-1])
    return out


def _swaps(word: str) -> set[str]:
    """`word` with each pair of neighbouring (different) letters swapped, one pair at a time."""
    return {
        word[:i] + word[i + 1] + word[i] + word[i + 2 :]
        for i in range(len(word) - 1)
        if word[i] != word[i + 1]
    }


def _undoubled(word: str) -> set[str]:
    """`word` with one letter of a doubled pair taken out, one pair at a time (`ballance`:
    `balance`; `shopp`: `shop`)."""
    return {word[:i] + word[i + 1 :] for i in range(len(word) - 1) if word[i] == word[i + 1]}


class Speller:
    """Reads typos of the catalogue's words as those words: swapped letters, inflections, a
    letter short outside English, and (`homophones`) Chinese characters of the same sound.
    Immutable; thread-safe."""

    def __init__(
        self,
        examples: Iterable[str],
        known: Iterable[str],
        plain: Iterable[str],
        homophones: Homophones | None = None,
        english: frozenset[str] | None = None,
    ) -> None:
        """
        Args:
            examples: the catalogue's example texts, every language.
            known: other words or phrases never corrected (the lexicon's words, stopwords,
                generic words).
            plain: words never corrected *into* (stopwords, generic words).
            homophones: what reads the Chinese typos (`homophones.py`); None: none are.
            english: the words of English (`english_words`): a word outside it may be read as
                the one example word it is a letter short of; None: no such reading.
        """
        self._homophones = homophones
        self._english = english
        words = {w for text in examples for w in _LATIN.findall(normalize(text))}
        plain_words = {w for phrase in plain for w in _LATIN.findall(normalize(phrase))}
        self._known = frozenset(
            {*words, *(w for phrase in known for w in _LATIN.findall(normalize(phrase)))}
        )
        self._targets = frozenset(w for w in words if len(w) >= MIN_LENGTH and w not in plain_words)
        self._bases = frozenset(w for w in words if len(w) >= 3 and w not in plain_words)
        # Each target under every form with one letter dropped (`history`: `histry`, ...).
        self._dropped: dict[str, set[str]] = {}
        for target in self._targets:
            for i in range(len(target)):
                self._dropped.setdefault(target[:i] + target[i + 1 :], set()).add(target)

    def correction(self, word: str) -> str | None:
        """The one word of the examples that `word` is a swapped-letter typo of, else the one
        it inflects, else (outside English) the one it is a letter short of; None when `word`
        is known, short, or has no single such word."""
        if len(word) < MIN_LENGTH or word in self._known:
            return None
        found = _swaps(word) & self._targets or inflection_bases(word) & self._bases
        if not found and self._english is not None and word not in self._english:
            # The words it is a letter short of, else those it doubles a letter of.
            found = self._dropped.get(word, set()) or _undoubled(word) & self._targets
        return next(iter(found)) if len(found) == 1 else None

    def correct(self, normalized: str) -> str:
        """`normalized` (a `normalize`d text) with its typos corrected; the same string when
        there are none. Item registry ids are left as typed."""
        if self._homophones is not None:
            normalized = self._homophones.correct(normalized)
        if not self._bases:
            return normalized
        spans = [m.span() for m in ITEM_ID.finditer(normalized)]

        def fix(match: re.Match[str]) -> str:
            word = match.group()
            if any(a <= match.start() < b for a, b in spans):
                return word
            return self.correction(word) or word

        return _LATIN.sub(fix, normalized)
