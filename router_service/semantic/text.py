"""Text normalisation and matching features.

A text becomes a sequence of unigram features, then adjacent-feature bigrams are added:

- normalisation: NFKC (full-width forms become ASCII), case folding, control, format and
  surrogate characters dropped, curly apostrophes straightened, whitespace collapsed;
- item registry ids (`minecraft:diamond`) become `<item>`; list numbers (`3`, `第3个`, `第三个`)
  and counts in Chinese numerals before a measure word (`三个`, `两把`; not `一个`) become
  `<num>`;
- Chinese runs are segmented by a private jieba tokenizer (the lexicon's words added to its
  dictionary; jieba's global tokenizer is left alone); Latin runs are split into words, the
  lexicon's multi-word phrases (`sign in`, `look up`) joined first;
- adjacent unigram features are paired into bigrams (unordered: `shop view`);
- a word the lexicon knows becomes its domain feature (`商城` and `store` both become `shop`);
  stopwords are dropped; any other word is kept as itself (English words lightly stemmed:
  `diamonds` → `diamond`), and so is an unknown Chinese character or a symbol such as an emoji,
  so unfamiliar content still counts against coverage.

Whatever the `lang` a caller names, both scripts are handled the same way, so mixed-script text
(`打开shop`) gets the features of both lexicons.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import unicodedata
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jieba

from services.runtime.config import ConfigError
from services.texts import CHINESE_NUMERALS, MEASURE_WORDS, singular

__all__ = [
    "HAN",
    "ITEM",
    "NUM",
    "Analysis",
    "Analyzer",
    "Lexicon",
    "clean",
    "default_analyzer",
    "detect_language",
    "example_key",
    "normalize",
]

ITEM = "<item>"
"""Placeholder feature of an item registry id."""
NUM = "<num>"
"""Placeholder feature of a list number."""

FEATURE_CLASSES = ("topic", "action", "write")

HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f"
"""The Han characters, as a regular expression character class's inside."""
_HAN_CHAR = re.compile(f"[{HAN}]")
_TOKEN = re.compile(rf"(?P<han>[{HAN}]+)|(?P<word>(?:(?![{HAN}])\w)+)|(?P<other>\S)")
# An item registry id: `namespace:path`, namespace starting with a letter (so `12:30` is no
# id), path segments joined by `/`, `.` or `-`, never ending in one (`minecraft:stone.` is the
# id plus a full stop). Shared with the item id extractor.
ITEM_ID = re.compile(
    r"(?<![a-z0-9_.:/-])[a-z_][a-z0-9_]*(?:[.-][a-z0-9_]+)*:[a-z0-9_]+(?:[./-][a-z0-9_]+)*"
    r"(?![a-z0-9_:])"
)
_PLACEHOLDER = re.compile(
    ITEM_ID.pattern
    + rf"|第\s*(?:[0-9]+|[{CHINESE_NUMERALS}]+)\s*[个项条页位号]?"
    + r"|(?<![a-z0-9_])[0-9]+(?![a-z0-9_])"
    # A count in Chinese numerals before its measure word (`三个面包`, `两把剑`), as `3个面包`
    # reads; a lone `一` (`一个`) is mostly an article (`有一个问题`).
    + rf"|(?<![第{CHINESE_NUMERALS}])(?!一[{MEASURE_WORDS}])"
    + rf"[{CHINESE_NUMERALS}]+(?=[{MEASURE_WORDS}])"
)
_DROPPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})
_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u02bc": "'"})
_SPACES = re.compile(r"\s+")


def example_key(normalized: str) -> str:
    """A normalized text's words and Han runs alone, one space apart: the form in which a
    typed text is compared with the catalogue's examples (`What can you do?` and `what can
    you do` are one)."""
    return " ".join(
        match.group() for match in _TOKEN.finditer(normalized) if match.lastgroup != "other"
    )


def clean(text: str) -> str:
    """NFKC, control/format/surrogate/unassigned characters replaced by a space, whitespace
    collapsed; case kept (extractors use it to keep names as typed)."""
    text = unicodedata.normalize("NFKC", _strip(text)).translate(_QUOTES)
    return _SPACES.sub(" ", text).strip()


def normalize(text: str) -> str:
    """`clean` plus case folding and traditional Chinese characters in their simplified form:
    the form every matching stage and the intent cache key use (`打開郵件` is `打开邮件`)."""
    return _simplified(clean(text).casefold())


@functools.cache
def _to_simplified() -> tuple[frozenset[str], Callable[[str], str]]:
    """The traditional characters OpenCC's conversion table changes, and its conversion
    (`t2s`, with its phrases: `乾隆` stays), loaded on first use and warmed."""
    from opencc import OpenCC  # noqa: PLC0415 - loaded with the first text, not at import

    table = resources.files("opencc") / "dictionary" / "TSCharacters.txt"
    lines = table.read_text(encoding="utf-8").splitlines()
    convert: Callable[[str], str] = OpenCC("t2s").convert
    convert("開")
    return frozenset(line.split("\t", 1)[0] for line in lines if line.strip()), convert


def _simplified(text: str) -> str:
    traditional, convert = _to_simplified()
    return text if traditional.isdisjoint(text) else convert(text)


def _strip(text: str) -> str:
    if text.isprintable():  # fast path: no control, format or surrogate characters
        return text
    return "".join(" " if unicodedata.category(ch) in _DROPPED_CATEGORIES else ch for ch in text)


def detect_language(text: str) -> str:
    """`zh` when the text holds a Chinese character, else `en`."""
    return "zh" if _HAN_CHAR.search(text) else "en"


def _stem(word: str) -> str:
    """A light English plural folding, applied the same way to examples and input: the
    shared `singular` (`torches` → `torch`, `berries` → `berry`; `this` stays)."""
    return singular(word) or word


@dataclasses.dataclass(frozen=True)
class Lexicon:
    """Per-language synonyms of domain features, their classes, stopwords and generic words."""

    synonyms: Mapping[str, Mapping[str, str]]
    """Language → normalised word or phrase → feature."""
    classes: Mapping[str, str]
    """Feature → `topic`, `action` or `write`."""
    stopwords: Mapping[str, frozenset[str]]
    """Language → words dropped from the features."""
    generic: Mapping[str, frozenset[str]] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )
    """Language → generic words (function words, number words, fillers: `have`, `right`,
    `six`, `一下`): kept as features, but a module's examples need not hold them for the n-gram
    scorer to route (`semantic/README.md`). English ones are also kept in their stemmed form,
    as the analyzer writes unknown words."""

    @classmethod
    def load(cls, path: str | Path | None = None) -> Lexicon:
        """Reads a lexicon file; without `path`, the packaged `lexicon.json`.

        Raises:
            ConfigError: the file is malformed or lists a word for two features.
        """
        if path is None:
            source = "lexicon.json"
            text = resources.files(__package__).joinpath("lexicon.json").read_text("utf-8")
        else:
            source = str(path)
            try:
                text = Path(path).read_text(encoding="utf-8")
            except OSError as exc:
                raise ConfigError(f"lexicon {source} cannot be read: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"lexicon {source} is not valid JSON: {exc}") from None
        return cls.from_dict(data, source)

    @classmethod
    def from_dict(cls, data: Any, source: str = "lexicon") -> Lexicon:
        """Builds a lexicon from its JSON form (see `lexicon.json`)."""
        if not isinstance(data, dict) or not isinstance(data.get("features"), dict):
            raise ConfigError(f"{source}: must be an object with a `features` object")
        synonyms: dict[str, dict[str, str]] = {}
        classes: dict[str, str] = {}
        for feature, entry in data["features"].items():
            if not isinstance(entry, dict) or entry.get("class") not in FEATURE_CLASSES:
                raise ConfigError(
                    f"{source}: feature {feature!r} needs a class, one of {FEATURE_CLASSES}"
                )
            classes[feature] = entry["class"]
            for language, words in entry.items():
                if language == "class":
                    continue
                if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
                    raise ConfigError(f"{source}: {feature}.{language} must be a list of strings")
                table = synonyms.setdefault(language, {})
                for word in words:
                    key = normalize(word)
                    if table.get(key, feature) != feature:
                        raise ConfigError(
                            f"{source}: {language} word {word!r} is listed for both "
                            f"{table[key]!r} and {feature!r}"
                        )
                    table[key] = feature
        stopwords = {
            language: frozenset(normalize(w) for w in words)
            for language, words in (data.get("stopwords") or {}).items()
        }
        generic = {
            language: frozenset(form for w in words for form in (normalize(w), _stem(normalize(w))))
            for language, words in (data.get("generic") or {}).items()
        }
        return cls(
            synonyms=MappingProxyType({k: MappingProxyType(v) for k, v in synonyms.items()}),
            classes=MappingProxyType(classes),
            stopwords=MappingProxyType(stopwords),
            generic=MappingProxyType(generic),
        )


@dataclasses.dataclass(frozen=True)
class Analysis:
    """The features of one text."""

    normalized: str
    """The text after `normalize`."""
    unigrams: tuple[str, ...]
    """Unigram features in text order (stopwords dropped)."""
    features: tuple[str, ...]
    """Unigrams followed by adjacent-feature bigrams, each an unordered pair written in sorted
    order (`"shop view"`): what TF-IDF sees."""
    content: frozenset[str]
    """Unigrams that name a topic: everything but `action` features (unknown words,
    placeholders and write features included). Topic coverage is measured over these."""
    modifiers: frozenset[str] = frozenset()
    """Unigrams written right before `的` somewhere in the text, the modifier of `X的Y` (`灯` in
    `打开灯的插座`, the lamp's socket): what the thing named after it belongs to."""


class Analyzer:
    """Turns text into features. Build one per process (jieba's dictionary takes a moment to
    load) and share it: analysis is read-only and thread-safe."""

    def __init__(self, lexicon: Lexicon | None = None) -> None:
        self.lexicon = lexicon or Lexicon.load()
        self._zh = self.lexicon.synonyms.get("zh", {})
        self._en = self.lexicon.synonyms.get("en", {})
        self._zh_stop = self.lexicon.stopwords.get("zh", frozenset())
        self._en_stop = self.lexicon.stopwords.get("en", frozenset())
        self._phrase_len = max((w.count(" ") + 1 for w in self._en), default=1)
        # First words of the multi-word phrases: a phrase is only looked up where one starts.
        self._phrase_starts = frozenset(w.split(" ", 1)[0] for w in self._en if " " in w)
        self._action = frozenset(f for f, c in self.lexicon.classes.items() if c == "action")
        # A private tokenizer: adding the domain words must not change jieba for anyone else.
        self._jieba = jieba.Tokenizer()
        self._jieba.initialize()
        # The words jieba's dictionary lacks, added so that it cuts them whole: their counts
        # are made up, so `word_log_probability` does not read them.
        self._added: frozenset[str] = frozenset(
            word
            for word in {*self._zh, *self._zh_stop}
            if len(word) > 1 and _HAN_CHAR.search(word) and word not in self._jieba.FREQ
        )
        for word in sorted({*self._zh, *self._zh_stop}):
            if len(word) > 1 and _HAN_CHAR.search(word):
                self._jieba.add_word(word)

    def cut(self, run: str) -> list[str]:
        """A run of Han characters (already normalised) cut into words as the analyzer cuts
        it, before synonyms and stopwords (`打开收件箱`: `打开`, `收件箱`)."""
        return list(self._jieba.cut(run, HMM=False))

    def han_words(self, text: str) -> list[str]:
        """The words of all of `text`'s Han runs (`cut`)."""
        return [
            word
            for match in _TOKEN.finditer(normalize(text))
            if match.lastgroup == "han"
            for word in self.cut(match.group())
        ]

    def word_log_probability(self, word: str) -> float:
        """How likely `word` is written, as jieba's dictionary counts it: its count over all
        counts, in log (a word it lacks, or that only the lexicon added, counts once)."""
        count = 0 if word in self._added else self._jieba.FREQ.get(word) or 0
        return math.log(max(count, 1) / self._jieba.total)

    def __call__(self, text: str) -> list[str]:
        """The TF-IDF features of `text` (the `analyzer` callable of the vectorizer)."""
        return list(self.analyze(text).features)

    def analyze(self, text: str) -> Analysis:
        """Normalises `text` and extracts its features."""
        normalized = normalize(text)
        unigrams: list[str] = []
        modifiers: set[str] = set()
        start = 0
        for match in _PLACEHOLDER.finditer(normalized):
            self._segment(normalized[start : match.start()], unigrams, modifiers)
            unigrams.append(ITEM if ":" in match.group() else NUM)
            start = match.end()
        self._segment(normalized[start:], unigrams, modifiers)
        # Unordered pairs: `逛逛商铺` and `商铺逛逛` mean the same, and so do most reorderings
        # of two domain features; a pair still says the two were adjacent.
        bigrams = [
            f"{a} {b}" if a <= b else f"{b} {a}"
            for a, b in zip(unigrams, unigrams[1:], strict=False)
        ]
        return Analysis(
            normalized=normalized,
            unigrams=tuple(unigrams),
            features=(*unigrams, *bigrams),
            content=frozenset(u for u in unigrams if u not in self._action),
            modifiers=frozenset(modifiers),
        )

    def _segment(self, text: str, out: list[str], modifiers: set[str]) -> None:
        words: list[str] = []  # a run of Latin words, joined into phrases when it ends
        for match in _TOKEN.finditer(text):
            kind = match.lastgroup
            token = match.group()
            if kind == "word":
                words.append(token)
                continue
            self._words(words, out)
            words = []
            if kind == "han":
                previous = None  # the feature of the word before in this run, if it had one
                for word in self.cut(token):
                    if word == "的" and previous is not None:
                        modifiers.add(previous)
                    feature = self._zh.get(word)
                    if feature is None and word not in self._zh_stop:
                        feature = word
                    if feature is not None:
                        out.append(feature)
                    previous = feature
            elif unicodedata.category(token).startswith("So"):
                out.append(token)  # symbols and emoji count as unknown content; punctuation not
        self._words(words, out)

    def _words(self, words: list[str], out: list[str]) -> None:
        i = 0
        while i < len(words):
            longest = (
                min(self._phrase_len, len(words) - i) if words[i] in self._phrase_starts else 1
            )
            for n in range(longest, 1, -1):
                feature = self._en.get(" ".join(words[i : i + n]))
                if feature is not None:
                    out.append(feature)
                    i += n
                    break
            else:
                word = words[i]
                i += 1
                feature = self._en.get(word)
                if feature is None and word not in self._en_stop:
                    word = _stem(word)
                    feature = self._en.get(word)
                if feature is not None:
                    out.append(feature)
                elif word not in self._en_stop:
                    out.append(word)


@functools.cache
def default_analyzer() -> Analyzer:
    """The process's analyzer over the shipped lexicon, built on first use: every catalogue
    the router builds (at start and at each catalogue change) shares it, instead of loading
    jieba's dictionary again (about 1.5 s each time)."""
    return Analyzer()
