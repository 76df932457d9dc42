"""Voice-style commands for the buttons of the notification on screen (seed 004, 通知按钮向量).

When a notification is visible, "确认", "show details" or "领取" may mean one of its buttons.
This matcher has its own small TF-IDF index over the visible buttons' labels plus per-key,
per-language phrasings from `notification-buttons.json`; it shares nothing with the module
router. Its features keep the original verbs and characters: the module router folds claim, buy
and pay into one write feature, here 领取 and 购买 must stay different buttons.

A text matches first as the whole label or phrasing, then by cosine similarity with at least
0.9 score, 0.9 coverage (share of the text's features found in the matched label or phrasing,
so unknown topics cannot ride on one familiar word) and 0.15 lead over the best other action.
Negation, conditions and questions that the matched label does not itself contain, labels that
several actions share, and low scores fall back to ordinary chat routing. Only the actions the
notification carries can result; the caller still checks busy state, the notification's and
connection's lifetime and the server's authorisation.

Indexes hold button templates only, never players' texts; one is kept per (button set,
language) in a small LRU.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib.resources
import json
import logging
import re
import threading
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer

from router_service.semantic.text import normalize
from services.runtime.config import read_json_file, write_file_atomically

if TYPE_CHECKING:
    import jieba

__all__ = [
    "Button",
    "ButtonMatch",
    "ButtonMatcher",
    "ButtonReason",
    "Phrasings",
    "ensure_phrasings",
    "features",
    "load_phrasings",
    "validate_phrasings",
]

Phrasings = Mapping[str, Mapping[str, Sequence[str]]]
"""Per button label key, per language code, extra ways to say it."""

Button = tuple[str, str, str]
"""(action id, label translation key, label text as shown in the player's language)."""

log = logging.getLogger("system.router")

PHRASINGS_FILE = "notification-buttons.json"

MIN_SCORE = 0.9
MIN_COVERAGE = 0.9
MIN_MARGIN = 0.15


class ButtonReason(enum.StrEnum):
    """Why a text did or did not press a button."""

    EXACT = "exact"
    """The whole text is one action's label or phrasing."""
    MATCHED = "matched"
    """Similar enough to one action's label or phrasing, and clear of the others."""
    NO_BUTTONS = "no_buttons"
    EMPTY_TEXT = "empty_text"
    DUPLICATE_LABEL = "duplicate_label"
    """The best label is shown on buttons of different actions."""
    AMBIGUOUS_PHRASING = "ambiguous_phrasing"
    """The best label or phrasing belongs to buttons of different actions."""
    NEGATION = "negation"
    CONDITION = "condition"
    QUESTION = "question"
    LOW_SCORE = "low_score"
    LOW_COVERAGE = "low_coverage"
    LOW_MARGIN = "low_margin"


@dataclasses.dataclass(frozen=True)
class ButtonMatch:
    """The outcome; `action_id` is None when the text should go to chat routing."""

    action_id: str | None
    reason: ButtonReason
    score: float = 0.0
    margin: float = 0.0
    coverage: float = 0.0


# -- phrasings file ---------------------------------------------------------------------------


def load_phrasings(path: str | Path | None = None) -> dict[str, dict[str, list[str]]]:
    """Reads and validates a phrasings file (`{"key": {"zh": [...], "en": [...]}}`); without a
    path, the one bundled with the router.

    Raises:
        ValueError: the file cannot be read or is not JSON of that shape; the message names
            the file and the place.
    """
    if path is not None:
        return validate_phrasings(read_json_file(path, "button phrasings file"), str(path))
    resource = importlib.resources.files("router_service") / PHRASINGS_FILE
    try:
        data = json.loads(resource.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{PHRASINGS_FILE}: not JSON: {error}") from error
    return validate_phrasings(data, PHRASINGS_FILE)


def ensure_phrasings(path: str | Path) -> tuple[dict[str, dict[str, list[str]]], bool]:
    """The phrasings at `path`, written there first as a copy of the bundled file when no file
    exists (as `system-semantic.json` is written on the first start), so an operator has every
    phrasing in front of them to edit and reload. Returns them and whether the file was
    written; a folder that cannot be written leaves the bundled phrasings in force, unwritten.

    Raises:
        ValueError: as `load_phrasings`, for a file that exists.
    """
    target = Path(path)
    if target.exists():
        return load_phrasings(target), False
    resource = importlib.resources.files("router_service") / PHRASINGS_FILE
    text = resource.read_text(encoding="utf-8")
    try:
        write_file_atomically(target, text)
    except OSError as exc:
        log.warning("could not write the default %s (%s); using the bundled phrasings", target, exc)
        return load_phrasings(), False
    return load_phrasings(target), True


def validate_phrasings(data: Any, where: str = "phrasings") -> dict[str, dict[str, list[str]]]:
    """Checks the shape of phrasings and returns a plain copy.

    Raises:
        ValueError: the message names the offending key and language.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object of label keys, got {type(data).__name__}")
    result: dict[str, dict[str, list[str]]] = {}
    for key, languages in data.items():
        if not key:
            raise ValueError(f"{where}: an empty label key")
        if not isinstance(languages, dict):
            raise ValueError(f"{where}: {key!r} must map language codes to lists of phrasings")
        result[key] = {}
        for language, phrases in languages.items():
            if not isinstance(phrases, list) or not all(
                isinstance(p, str) and p.strip() for p in phrases
            ):
                raise ValueError(
                    f"{where}: {key!r}.{language!r} must be a list of non-empty strings"
                )
            result[key][_language(language)] = list(phrases)
    return result


# -- features ---------------------------------------------------------------------------------

_HAN = r"\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_RUN = re.compile(rf"(?P<han>[{_HAN}]+)|(?P<word>[a-z0-9]+(?:'[a-z]+)*)|(?P<other>\S)")

# Politeness, the player themself and "it" (the notification) do not change which button is
# meant; removed from labels and texts alike. Chinese after segmentation, so 帮 goes only when
# jieba splits it off (帮我), never out of a word such as 帮助.
_FILLER_TEXT = """
    请 帮 帮我 给我 我 我要 我想 麻烦 一下 吧 啊 呀 哦 嗯 了 它
    please pls plz the a an now it me can could would you just
"""
_FILLER = frozenset(_FILLER_TEXT.split())

# Guard terms: substrings for Chinese (no spaces to split on), words for English. A guard
# counts only when the matched label or phrasing does not contain it itself (不再提醒, not now).
_GUARD_TEXT = {
    ButtonReason.NEGATION: (
        "不 别 没 勿 莫 甭 无需 休想",
        "not no never nope nothing neither nor without dont doesnt didnt wont cant",
    ),
    ButtonReason.CONDITION: (
        "如果 假如 要是 若是 倘若 万一 的话 除非 只要 等到 之后 以后",
        "if unless when whenever once after before until till later",
    ),
    ButtonReason.QUESTION: ("吗 么 呢 是否 能否 为何", ""),
}
_GUARDS_HAN = {reason: tuple(han.split()) for reason, (han, _) in _GUARD_TEXT.items()}
_GUARDS_WORD = {reason: frozenset(words.split()) for reason, (_, words) in _GUARD_TEXT.items()}
_QUESTION_OPENERS_TEXT = "what why how who where which whose whom is are was were does did"
_QUESTION_OPENERS = frozenset(_QUESTION_OPENERS_TEXT.split())


def _normalize(text: str) -> str:
    # The router's normalisation: NFKC, case folding, control characters dropped, curly
    # apostrophes straightened (so "don’t" is a negation), whitespace collapsed.
    return normalize(text)


def _language(code: str) -> str:
    return code.strip().casefold().replace("_", "-")


def _is_noise(char: str) -> bool:
    # Punctuation, separators and control/format characters carry no meaning for a button.
    return unicodedata.category(char)[0] in "PZC"


def _compact(normalized: str) -> str:
    """The form compared for an exact match: no punctuation, single spaces."""
    return " ".join("".join(" " if _is_noise(c) else c for c in normalized).split())


def _guards(normalized: str) -> set[tuple[ButtonReason, str]]:
    """The guard terms a normalised text contains."""
    found: set[tuple[ButtonReason, str]] = set()
    for reason, terms in _GUARDS_HAN.items():
        found.update((reason, term) for term in terms if term in normalized)
    words = re.findall(r"[a-z0-9]+(?:'[a-z]+)*", normalized)
    for word in words:
        bare = word.replace("'", "")
        for reason, word_terms in _GUARDS_WORD.items():
            if bare in word_terms or word.endswith("n't"):
                found.add((reason if bare in word_terms else ButtonReason.NEGATION, bare))
    if words and words[0] in _QUESTION_OPENERS:
        found.add((ButtonReason.QUESTION, words[0]))
    if normalized.rstrip().endswith("?"):
        found.add((ButtonReason.QUESTION, "?"))
    return found


def features(text: str, segment: Callable[[str], Iterable[str]]) -> list[str]:
    """The features of a text, in order, repeats kept.

    Han runs give jieba words (`w:`), characters (`c:`) and adjacent character pairs (`b:`);
    letters and digits give words (`w:`) and adjacent word pairs (`p:`); any other visible
    character (emoji, other scripts) is kept as itself, so unknown content lowers coverage
    instead of vanishing. Verbs are never folded together.
    """
    out: list[str] = []
    previous_word: str | None = None
    for run in _RUN.finditer(_normalize(text)):
        han, word, other = run.group("han"), run.group("word"), run.group("other")
        if han:
            previous_word = None
            kept = [w for w in segment(han) if w.strip() and w not in _FILLER]
            out.extend(f"w:{w}" for w in kept)
            chars = "".join(kept)
            out.extend(f"c:{c}" for c in chars)
            out.extend(f"b:{a}{b}" for a, b in zip(chars, chars[1:], strict=False))
        elif word:
            if word in _FILLER:
                continue
            out.append(f"w:{word}")
            if previous_word is not None:
                out.append(f"p:{previous_word}_{word}")
            previous_word = word
        elif other and not _is_noise(other):
            previous_word = None
            out.append(f"o:{other}")
    return out


# -- index ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Document:
    text: str
    """Compact normalised label or phrasing (a button template, never a player's text)."""
    positions: frozenset[int]
    """Buttons (by position in the notification) this text belongs to."""
    features: frozenset[str]
    guards: frozenset[tuple[ButtonReason, str]]


class _Index:
    """TF-IDF vectors of one button set's labels and phrasings in one language."""

    def __init__(
        self,
        labels: Sequence[tuple[str, str]],
        language: str,
        phrasings: Phrasings,
        segment: Callable[[str], Iterable[str]],
    ) -> None:
        by_text: dict[str, set[int]] = collections.defaultdict(set)
        originals: dict[str, str] = {}
        self.label_texts: list[str] = []
        for position, (key, label) in enumerate(labels):
            self.label_texts.append(_compact(_normalize(label)))
            for phrase in (label, *_phrases(phrasings, key, language)):
                compact = _compact(_normalize(phrase))
                if compact:
                    by_text[compact].add(position)
                    originals.setdefault(compact, _normalize(phrase))
        self.documents: list[_Document] = []
        for text, positions in by_text.items():
            self.documents.append(
                _Document(
                    text,
                    frozenset(positions),
                    frozenset(features(text, segment)),
                    frozenset(_guards(originals[text])),
                )
            )
        self.exact = {document.text: i for i, document in enumerate(self.documents)}
        self._vectorizer: TfidfVectorizer | None = None
        if any(document.features for document in self.documents):
            self._vectorizer = TfidfVectorizer(
                analyzer=lambda text: features(text, segment), sublinear_tf=True
            )
            self._matrix = self._vectorizer.fit_transform([d.text for d in self.documents])

    def scores(self, text: str) -> np.ndarray:
        """Cosine similarity of `text` with every document."""
        if self._vectorizer is None:
            return np.zeros(len(self.documents))
        vector = self._vectorizer.transform([text])
        return np.asarray((self._matrix @ vector.T).toarray()).ravel()


def _phrases(phrasings: Phrasings, key: str, language: str) -> Sequence[str]:
    per_language = phrasings.get(key, {})
    if language in per_language:
        return per_language[language]
    return per_language.get(language.split("-")[0], ())


# -- matcher ----------------------------------------------------------------------------------


class ButtonMatcher:
    """Matches a player's text to a button of the visible notification (see the module
    docstring). Thread-safe.

    Args:
        phrasings: Extra phrasings per label key and language, as `load_phrasings` returns.
        min_score: Least cosine similarity for a non-exact match.
        min_coverage: Least share of the text's features present in the matched template.
        min_margin: Least lead over the best score of a different action.
        cache_size: Button-set indexes kept.
        segment: Chinese word segmentation; a private jieba tokenizer when not given.
    """

    def __init__(
        self,
        phrasings: Phrasings,
        *,
        min_score: float = MIN_SCORE,
        min_coverage: float = MIN_COVERAGE,
        min_margin: float = MIN_MARGIN,
        cache_size: int = 64,
        segment: Callable[[str], Iterable[str]] | None = None,
    ) -> None:
        for name, value in (("min_score", min_score), ("min_margin", min_margin)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within 0..1, got {value!r}")
        if not 0.5 <= min_coverage <= 1.0:
            raise ValueError(f"min_coverage must be within 0.5..1, got {min_coverage!r}")
        if cache_size <= 0:
            raise ValueError(f"cache_size must be positive, got {cache_size!r}")
        self._phrasings = validate_phrasings(
            {k: {lang: list(p) for lang, p in v.items()} for k, v in phrasings.items()}
        )
        self._min_score = min_score
        self._min_coverage = min_coverage
        self._min_margin = min_margin
        self._cache_size = cache_size
        self._segment = segment
        self._lock = threading.Lock()
        self._indexes: collections.OrderedDict[tuple[Any, ...], _Index] = collections.OrderedDict()
        self._generation = 0  # bumped by each replace: an index built before it is never kept

    @property
    def phrasings(self) -> Phrasings:
        """The phrasings in force."""
        return self._phrasings

    def replace_phrasings(self, phrasings: Phrasings) -> list[str]:
        """Puts new phrasings in force at once (a reload); the indexes built from the old ones
        go. Returns the label keys whose phrasings changed (added, removed or edited), sorted.

        Raises:
            ValueError: `phrasings` is not of the `validate_phrasings` shape; nothing changes.
        """
        new = validate_phrasings(
            {k: {lang: list(p) for lang, p in v.items()} for k, v in phrasings.items()}
        )
        with self._lock:
            old = self._phrasings
            self._phrasings = new
            self._generation += 1
            self._indexes.clear()
        return sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))

    def _segmenter(self) -> Callable[[str], Iterable[str]]:
        if self._segment is None:
            with self._lock:
                if self._segment is None:
                    self._segment = _private_jieba().lcut
        return self._segment

    def _index(self, labels: tuple[tuple[str, str], ...], language: str) -> _Index:
        key = (language, labels)
        with self._lock:
            index = self._indexes.get(key)
            if index is not None:
                self._indexes.move_to_end(key)
                return index
            phrasings, generation = self._phrasings, self._generation
        index = _Index(labels, language, phrasings, self._segmenter())
        with self._lock:
            if generation != self._generation:
                return index  # built from phrasings a reload replaced meanwhile: used once
            self._indexes[key] = index
            self._indexes.move_to_end(key)
            while len(self._indexes) > self._cache_size:
                self._indexes.popitem(last=False)
        return index

    def phrasing_key(self, text: str, lang: str) -> str | None:
        """The label key one of whose phrasings in `lang` the whole text is (`确认`, `claim
        it`: punctuation and case aside), else None: words that only press a button."""
        compact = _compact(_normalize(text))
        if not compact:
            return None
        language = _language(lang)
        phrasings = self._phrasings
        return next(
            (
                key
                for key in sorted(phrasings)
                if any(
                    _compact(_normalize(p)) == compact for p in _phrases(phrasings, key, language)
                )
            ),
            None,
        )

    def warm_up(self) -> None:
        """Loads jieba now (about a second) rather than on the first Chinese text."""
        self._segmenter()

    def match(self, text: str, lang: str, buttons: Sequence[Button]) -> ButtonMatch:
        """Which of `buttons` the text presses, if any.

        Args:
            text: What the player said or typed.
            lang: The player's language code.
            buttons: The visible notification's buttons, as (action id, label key, label).
        """
        if not buttons:
            return ButtonMatch(None, ButtonReason.NO_BUTTONS)
        normalized = _normalize(text)
        compact = _compact(normalized)
        if not compact:
            return ButtonMatch(None, ButtonReason.EMPTY_TEXT)
        index = self._index(tuple((key, label) for _, key, label in buttons), _language(lang))
        if not index.documents:
            return ButtonMatch(None, ButtonReason.LOW_SCORE)
        actions = [action for action, _, _ in buttons]
        scores = index.scores(compact)

        # The whole label or phrasing first, else the most similar one.
        exact = index.exact.get(compact)
        best = exact if exact is not None else int(np.argmax(scores))
        document = index.documents[best]
        winners = {actions[p] for p in document.positions}
        score = 1.0 if exact is not None else _unit(scores[best])
        others = [
            float(scores[i])
            for i, d in enumerate(index.documents)
            if any(actions[p] not in winners for p in d.positions)
        ]
        margin = _unit(score - max(others, default=0.0))
        input_features = set(features(compact, self._segmenter()))
        if input_features:
            coverage = len(input_features & document.features) / len(input_features)
        else:  # only filler words: nothing to compare but the exact text
            coverage = 1.0 if exact is not None else 0.0

        def refuse(reason: ButtonReason) -> ButtonMatch:
            return ButtonMatch(None, reason, score, margin, coverage)

        labels = {index.label_texts[p] for p in document.positions} - {""}
        if len(winners) > 1:
            shared_label = document.text in labels
            return refuse(
                ButtonReason.DUPLICATE_LABEL if shared_label else ButtonReason.AMBIGUOUS_PHRASING
            )
        (winner,) = winners
        # The winner's own label shown on a button of another action: the player cannot tell
        # them apart either, whatever phrasing they used.
        if any(
            label in labels and action != winner
            for action, label in zip(actions, index.label_texts, strict=True)
        ):
            return refuse(ButtonReason.DUPLICATE_LABEL)
        extra_guards = _guards(normalized) - document.guards
        for reason in (ButtonReason.NEGATION, ButtonReason.CONDITION, ButtonReason.QUESTION):
            if any(kind is reason for kind, _ in extra_guards):
                return refuse(reason)
        if exact is not None:
            return ButtonMatch(winner, ButtonReason.EXACT, score, margin, coverage)
        if score < self._min_score:
            return refuse(ButtonReason.LOW_SCORE)
        if coverage < self._min_coverage:
            return refuse(ButtonReason.LOW_COVERAGE)
        if margin < self._min_margin:
            return refuse(ButtonReason.LOW_MARGIN)
        return ButtonMatch(winner, ButtonReason.MATCHED, score, margin, coverage)


def _unit(value: float) -> float:
    # Cosines of unit vectors stray past 1 by rounding; diagnostics want 0..1.
    return min(1.0, max(0.0, float(value)))


def _private_jieba() -> jieba.Tokenizer:
    """A jieba tokenizer of its own: words the module router adds to the global one (domain
    aliases) must not change how buttons are split."""
    import jieba

    jieba.setLogLevel(logging.WARNING)
    segmenter = jieba.Tokenizer()
    segmenter.initialize()
    return segmenter
