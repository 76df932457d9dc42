"""Chinese typos read as the catalogue's words they sound like (issue 17, round 15).

A Chinese player types with a pinyin input method, and a typo is the wrong character of the same
sound: `打开伤店` for `打开商店`, `我的余鹅` for `我的余额`, `查看历使记录` for `查看历史记录`,
`帮主` for `帮助`. The mistyped word is one the catalogue does not know, so it lowers the score
and, as an unknown content word, stops the n-gram scorer's route: on the own corpus 4 of the
`test` split's 39 Chinese typo cases routed before this, 28 with it (none wrongly).

`Homophones.correct` reads a stretch of a text, one to four consecutive words as the analyzer
cuts it (2-4 Han characters), as a word of the catalogue's examples when exactly one such word
fits it this way:

- at least one of the stretch's words is one the router does not know (the examples' words,
  the lexicon's, stopwords): `哪首歌`, cut `哪` `首歌`, both known, stays, though `那首歌` is
  another module's example; and the stretch is whole words (`我接下来` is `我` `接下来`, so `我接`
  is never read as `我家`);
- the stretch and the word differ in exactly one character, and the two characters sound alike
  once tones are dropped (pypinyin, each character's usual reading): `伤` and `商` are both
  `shang`, `鹅` and `额` both `e`;
- the word is at least `LIKELIER` (five times) likelier Chinese than what was typed, by jieba's
  dictionary counts (the words of the stretch as cut, multiplied): `帮主`, a gang's leader, is
  written about 7 times less often than `帮助`, and `余` `鹅` (a remainder, a goose) far less
  often than `余额`; but `都是` (`都` `是`, all is) is likelier than `都市`, and `权利` against
  `权力` is a real pair of words, so neither is read as the other.

Two or more characters wrong (`实践` against `时间`), or a sound that differs (`社么` for `什么`),
are left as typed. What it changes is the text the index and the n-gram scorer match, as the
Latin speller's (`spelling.py`) does: the guards read the typed and the corrected text, the
argument extractor what was typed. On the Chinese development set it changes 2 of 1,960 texts
(`两格` to `两个`, `加里`, a name, to `家里`) and no route.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence

# Only single characters are read here: pypinyin's documented switches leave its phrase table
# (about 40 MB and 0.5 s at import) unloaded and its character table uncopied (10 MB in all).
os.environ.setdefault("PYPINYIN_NO_PHRASES", "1")
os.environ.setdefault("PYPINYIN_NO_DICT_COPY", "1")

from pypinyin import Style, pinyin  # noqa: E402 - after the switches it reads at import

from router_service.semantic.text import HAN  # noqa: E402

__all__ = ["LIKELIER", "MAX_LENGTH", "MIN_LENGTH", "Homophones"]

MIN_LENGTH = 2
"""Shortest stretch corrected, and shortest correction (one character is too little to tell
a typo from another word)."""
MAX_LENGTH = 4
"""Longest stretch corrected."""
LIKELIER = math.log(5)
"""How much likelier (in log) the catalogue's word must be than what was typed, by jieba's
dictionary, for what was typed to be read as its typo: five times."""

_HAN_RUN = re.compile(f"[{HAN}]+")


@functools.lru_cache(maxsize=8192)
def _sounds(character: str) -> frozenset[str]:
    """The character's usual reading without its tone (`伤`, `商`: `shang`); empty for one
    pypinyin does not know."""
    readings = pinyin(character, style=Style.NORMAL, heteronym=False, errors="ignore")
    return frozenset(readings[0]) if readings else frozenset()


class Homophones:
    """Reads same-sound Chinese typos as the catalogue's words. Immutable; thread-safe."""

    def __init__(
        self,
        words: Iterable[str],
        known: Iterable[str],
        segment: Callable[[str], list[str]],
        log_probability: Callable[[str], float],
    ) -> None:
        """
        Args:
            words: the words of the catalogue's Chinese examples (the corrections).
            known: other words never corrected (the lexicon's, stopwords).
            segment: a run of Han characters cut into words, as the analyzer cuts it
                (`Analyzer.cut`: the text is normalised already).
            log_probability: how likely a word is written, as jieba's dictionary says (its
                count over all counts, in log; a word it lacks counts once).
        """
        words = set(words)
        targets = {w for w in words if MIN_LENGTH <= len(w) <= MAX_LENGTH and _HAN_RUN.fullmatch(w)}
        self._known = frozenset({*words, *known})
        self._segment = segment
        self._log_probability = log_probability
        # Each target under every one of its characters masked: a stretch one character away
        # from it finds it by the same key.
        self._by_mask: dict[tuple[int, str], list[str]] = {}
        for word in sorted(targets):
            for position in range(len(word)):
                self._by_mask.setdefault((position, _masked(word, position)), []).append(word)

    def correction(self, words: Sequence[str]) -> str | None:
        """The one catalogue word that the stretch of `words` (consecutive words of a text as
        the analyzer cut it) is a same-sound typo of, else None."""
        stretch = "".join(words)
        if not MIN_LENGTH <= len(stretch) <= MAX_LENGTH or stretch in self._known:
            return None
        if all(word in self._known for word in words):
            return None  # words the catalogue knows, each as typed (`哪` `首歌`)
        found = {
            word
            for position in range(len(stretch))
            for word in self._by_mask.get((position, _masked(stretch, position)), ())
            if _sounds(stretch[position]) & _sounds(word[position])
        }
        if len(found) != 1:
            return None
        (word,) = found
        typed = sum(self._log_probability(w) for w in words)
        if self._log_probability(word) < typed + LIKELIER:
            return None  # what was typed is as likely Chinese as the correction
        return word

    def correct(self, normalized: str) -> str:
        """`normalized` with its same-sound typos corrected, the longest stretch first from the
        left; the same string when there are none."""
        if not self._by_mask:
            return normalized
        return _HAN_RUN.sub(lambda run: self._correct_run(run.group()), normalized)

    def _correct_run(self, run: str) -> str:
        # A stretch is whole words of the run as the analyzer cuts it: `我接下来` is `我` and
        # `接下来`, and `我接` is no stretch of it (it would read as `我家`).
        words = self._segment(run)
        if all(word in self._known for word in words):
            return run  # the usual case: nothing typed that the catalogue lacks
        out: list[str] = []
        start = 0
        while start < len(words):
            for end in range(min(len(words), start + MAX_LENGTH), start, -1):
                word = self.correction(words[start:end])
                if word is not None:
                    out.append(word)
                    start = end
                    break
            else:
                out.append(words[start])
                start += 1
        return "".join(out)


def _masked(word: str, position: int) -> str:
    return word[:position] + "\0" + word[position + 1 :]
