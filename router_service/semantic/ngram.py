"""The n-gram scorer: a supervised classifier over word and character n-grams, trained per
catalogue at start, whose acceptance threshold is set from the catalogue's own examples (exact
leave-one-out) and from shipped background text (chat, questions, other games' commands).

Why: the seed's sparse matcher (`index.py`) compares a text with the nearest example, and its
fixed 0.9 / 0.15 / 0.9 gates fit phrasings close to the examples; unseen phrasings of the same
intent mostly fall below them. A discriminative model over many small features (jieba and
lexicon words, their adjacent pairs, character n-grams that survive typos and inflection)
generalises further, but its raw probability is not a precision: how high it must be depends on
the catalogue (how many modules, how close they are). So the threshold is measured, not fixed.

Per language, at start:

1. **Features** (`NgramFeaturizer`): the analyzer's unigrams and unordered bigrams (`w:`: jieba
   and lexicon words), and character n-grams of the normalised text (`c:`): 2..4-grams inside
   each Latin word padded with spaces, 1..3-grams of each Han run. Each block is tf-idf
   weighted (sublinear tf, smoothed idf from the examples) and l2-normalised on its own; a
   feature no example has keeps the largest idf in the norm, so unfamiliar content lowers every
   score (the seed: unfamiliar words are not dropped).
2. **Classes**: every module with at least two examples in the language (read, hints and
   reject profiles alike: hints and rejects compete, and the router never routes them).
3. **Model**: a one-vs-rest ridge classifier (targets +1 / -1, penalty `RIDGE`) solved in
   closed form in the examples' space (`n x n`, n = examples), so training takes a fraction of a
   second even for 150 modules x 10 examples; past `MAX_EXAMPLES` the mean of such fits on
   chunks of the examples that together hold all of them (`_chunks`, `_ridge`). A text's
   confidence is its **margin**: the top module's score minus the second's.
4. **Threshold**, the larger of:
   - *leave-one-out*: ridge gives every example's leave-one-out scores exactly from the one fit
     (`y_i - alpha_i / [(K + RIDGE I)^-1]_ii`; for chunks, of the mean fit); the least margin
     at which the examples' leave-one-out top module is right at least `LOO_PRECISION` of the
     time (a held-out example is harder than
     a new text: it has one example fewer, often the only one of its phrasing, so this target
     is lower than the precision wanted of direct routes);
   - *background*: the margin that at most `BACKGROUND_ACCEPT` of the shipped background texts
     (`background.json`) reach, those the catalogue itself resembles left out (nearest example
     cosine >= `BACKGROUND_OVERLAP`: a catalogue with a greeting module keeps its greetings);
   - `MIN_MARGIN`.

At run time `top` scores one text: the sparse row times the coefficient rows of its known
features. `router.py` lets it stand in for the seed's fixed score and margin gates: the top
module routes when its margin reaches the threshold, the text's topics and unknown words all
appear among that module's examples (the seed's topic coverage, over the module's examples
together: `LanguageModel.topic_coverage`; the lexicon's generic words are not asked of them),
a word sharing an inflection's base with one of theirs counting as held (`word_forms`), the seed's feature
coverage passes or fails only on generic words, and the guards, profile
kinds and argument extractor allow it. A module whose examples each name their own things
(`LanguageModel.open_words`, measured on its examples by leaving one out) may also take a text
holding as many words its examples lack as one of its examples typically does, so long as none
of them is held by the examples of a module that competes for the text (the scorer's next
`RIVALS` modules: `ScorerTop.missing_elsewhere`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from types import MappingProxyType

import numpy as np
import scipy.linalg
import scipy.sparse as sp
from threadpoolctl import threadpool_limits

from router_service.semantic.profiles import Profile
from router_service.semantic.spelling import inflection_bases
from router_service.semantic.text import Analysis, Analyzer

__all__ = [
    "BACKGROUND",
    "LanguageModel",
    "NgramFeaturizer",
    "NgramScorer",
    "ScorerTop",
    "load_background",
    "word_forms",
]

log = logging.getLogger("system.router.semantic")

BACKGROUND = "<background>"
"""The class of out-of-scope text."""
RIDGE = 1.0
"""l2 penalty of the ridge classifier (rows are l2-normalised, so K = X X^T has a unit
diagonal). 2 until open modules' unknown words had to be unknown to the whole catalogue
(`ScorerTop.missing_elsewhere`): with that rule 1 gives the same coverage at the same precision
on the development set and fewer false directs when modules are held out."""
LOO_PRECISION = 0.97
"""Leave-one-out precision of the examples that the threshold must reach. (0.96 until direct
routes could hold a module's typical unknown words, `LanguageModel.open_words`; held-out
examples hold such words too, so the same rule covers them at the stricter target.)"""
BACKGROUND_ACCEPT = 0.05
"""Share of the (unclaimed) background texts that may reach the threshold."""
BACKGROUND_OVERLAP = 0.6
"""A background text whose cosine (word and character features) to some catalogue example
reaches this is left out: the catalogue claims it."""
MIN_MARGIN = 0.3
"""The threshold is never below this margin."""
RIVALS = 2
"""How many modules after the top one count as its rivals for a text: an open module's unknown
word that a rival's examples hold is that rival's evidence (`ScorerTop.missing_elsewhere`).
Until issue 17's round 8 every module's examples counted, and `what movies are playing this
week` missed the recommendations module because a calendar module's examples say `week`. With
1, `slow the volume speaker` reached volume-up on a held-out draw (volume-down out; `slow` is
the traffic module's word); 2 or more add no wrong route on the development set or its draws."""

MAX_EXAMPLES = 2500
"""Most examples of one language one closed-form fit takes: it is cubic in them (a Cholesky
factor and its inverse; 2,500 take about a second on a 2-core machine). A catalogue with more
(150 modules x 100 examples) is fitted in chunks of at most this many, each holding as many of
every module's examples as fit (`_per_class`), together all of them (`_chunks`); the weights
are the chunks' fits' mean (`_ridge`). Until issue 17's round 13 such a catalogue fitted one
spread of each module's examples and left the rest out: on the development set with 20 of each
intent's test texts added as examples (30-shot), capped so that 10 of each fit, 13.8 % coverage
against 30.4 % in chunks and 29.8 % for one fit of all (`router_service/corpus/README.md`)."""
MIN_FITTED = 10
"""Fewest examples of each module a chunk must hold (the 10-shot sets are what the scorer and
its threshold were measured on); with fewer (1,000 modules x 20 examples) the language routes
with the seed's gates alone, and the start-up log says so. It also bounds the weights' memory:
features x modules, 250 modules at the most."""

_HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_RUN = re.compile(rf"[{_HAN}]+|[^\s{_HAN}]+")
_HAN_RUN = re.compile(rf"^[{_HAN}]+$")


def word_forms(word: str) -> frozenset[str]:
    """`word` and its forms with one English inflection taken off (`spelling.inflection_bases`,
    the speller's reading of inflections): a text's word is known to a module when these meet
    the forms of one of its examples' words (`played` and `playing` share `play`; issue 17,
    round 6)."""
    return frozenset({word} | inflection_bases(word))


def load_background(languages: Iterable[str] | None = None) -> dict[str, tuple[str, ...]]:
    """The shipped background texts by language (`background.json` beside this module)."""
    data = json.loads(
        resources.files("router_service.semantic").joinpath("background.json").read_text("utf-8")
    )
    wanted = None if languages is None else set(languages)
    return {
        lang: tuple(texts)
        for lang, texts in data["texts"].items()
        if wanted is None or lang in wanted
    }


def _char_ngrams(text: str) -> list[str]:
    grams: list[str] = []
    for run in _RUN.findall(text):
        if _HAN_RUN.match(run):
            sizes, padded = (1, 2, 3), run
        else:
            sizes, padded = (2, 3, 4), f" {run} "
        length = len(padded)
        for n in sizes:
            grams += ["c:" + padded[i : i + n] for i in range(length - n + 1)]
    return grams


class NgramFeaturizer:
    """Word and character n-gram tf-idf rows for one language's training texts and queries."""

    def __init__(self, analyses: Sequence[Analysis]) -> None:
        docs = [self._features(a) for a in analyses]
        df: Counter[str] = Counter()
        for words, chars in docs:
            df.update(set(words))
            df.update(set(chars))
        self.vocabulary: dict[str, int] = {f: i for i, f in enumerate(sorted(df))}
        """Feature -> column (read-only after construction)."""
        n = len(docs)
        self.idf = [math.log((1 + n) / (1 + df[f])) + 1.0 for f in sorted(df)]
        self.unknown_idf = math.log(1 + n) + 1.0
        self.matrix = self._matrix(docs)

    @staticmethod
    def _features(analysis: Analysis) -> tuple[Counter[str], Counter[str]]:
        words = Counter("w:" + f for f in analysis.features)
        chars = Counter(_char_ngrams(analysis.normalized))
        return words, chars

    def row(self, analysis: Analysis) -> tuple[list[int], list[float]]:
        """The known features' columns and weights of one text (unknown ones only lower the
        norm)."""
        return self._row(*self._features(analysis))

    def _row(self, words: Counter[str], chars: Counter[str]) -> tuple[list[int], list[float]]:
        columns: list[int] = []
        values: list[float] = []
        vocabulary, idf, unknown, log = self.vocabulary, self.idf, self.unknown_idf, math.log
        for block in (words, chars):
            start = len(values)
            norm = 0.0
            for feature, count in block.items():
                column = vocabulary.get(feature)
                weight = unknown if column is None else idf[column]
                if count > 1:
                    weight *= 1.0 + log(count)
                norm += weight * weight
                if column is not None:
                    columns.append(column)
                    values.append(weight)
            if norm > 0 and len(values) > start:
                scale = 1.0 / math.sqrt(2.0 * norm)  # each block contributes half the norm
                values[start:] = [v * scale for v in values[start:]]
        return columns, values

    def _matrix(self, docs: list[tuple[Counter[str], Counter[str]]]) -> sp.csr_matrix:
        indptr, indices, data = [0], [], []
        for words, chars in docs:
            columns, values = self._row(words, chars)
            indices.extend(columns)
            data.extend(values)
            indptr.append(len(indices))
        return sp.csr_matrix(
            (np.asarray(data, dtype=float), np.asarray(indices, dtype=np.int64), indptr),
            shape=(len(docs), len(self.vocabulary)),
        )


@dataclasses.dataclass(frozen=True)
class LanguageModel:
    """One language's trained scorer."""

    classes: tuple[str, ...]
    featurizer: NgramFeaturizer
    weights: np.ndarray
    """features x classes (ridge coefficients in feature space; float32)."""
    threshold: float
    """Least margin of the top module for a direct route."""
    loo_threshold: float
    """The leave-one-out part of `threshold`."""
    background_threshold: float
    """The background part of `threshold`."""
    background_kept: int
    """Background texts that took part (the catalogue did not claim them)."""
    unigrams: Mapping[str, frozenset[str]]
    """Per class, the unigram features of all its examples (for module topic coverage)."""
    loo: tuple[tuple[float, bool], ...] = dataclasses.field(repr=False)
    """Every example's leave-one-out (margin, top module right)."""
    generic: frozenset[str] = frozenset()
    """The language's generic words (`Lexicon.generic`): not required of a module's examples."""
    open_words: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Per class, how many content words its examples lack a text may still hold: the mean
    number of content words (generic ones left out) that one of its examples holds and its
    other examples lack, rounded down (`_open_words`). 0 for a module asked in fixed words (every
    built-in module); 1 or 2 for one whose examples each name their own things (`weather in
    chicago`, `play jazz by miles davis`)."""
    stems: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict, repr=False)
    """Per class, the `word_forms` of all its `unigrams`: a text's word with a form among these
    counts as known to the module (`played` for examples that say `playing`)."""
    chunks: int = 1
    """How many closed-form fits the weights are the mean of (`_chunks`): 1 unless the
    language has more examples than `MAX_EXAMPLES`."""

    def topic_coverage(self, analysis: Analysis, module_id: str) -> float:
        """The share of the text's content unigrams (topics and unknown words) that appear in
        some example of `module_id`: the seed's topic coverage over the module's examples
        together rather than its single best example. A generic word the module's examples
        lack is left out rather than counted missing. 0 without content."""
        content, missing = self.content(analysis, module_id)
        if not content:
            return 0.0
        return (len(content) - missing) / len(content)

    def missing_words(self, analysis: Analysis, module_id: str) -> set[str]:
        """The text's content words (as `content` counts them) that `module_id`'s examples
        lack, neither as written nor by a shared form (`word_forms`)."""
        return {
            u for u in analysis.content if u not in self.generic and not self.holds(module_id, u)
        }

    def holds(self, module_id: str, word: str) -> bool:
        """Whether `module_id`'s examples hold `word`, as written or by a shared form
        (`word_forms`)."""
        if word in self.unigrams.get(module_id, ()):
            return True
        return not self.stems.get(module_id, frozenset()).isdisjoint(word_forms(word))

    def content(self, analysis: Analysis, module_id: str) -> tuple[set[str], int]:
        """The text's content words as `topic_coverage` counts them (a generic word left out
        unless `module_id`'s examples hold it), and how many of them its examples lack
        (`missing_words`: a word sharing a form with one of theirs is not lacking)."""
        known = self.unigrams.get(module_id, frozenset())
        content = {u for u in analysis.content if u in known or u not in self.generic}
        return content, len(self.missing_words(analysis, module_id))

    def held_by(self, words: Iterable[str], module_ids: Iterable[str]) -> int:
        """How many of `words` the examples of one of `module_ids` hold, as written or by a
        shared form (`word_forms`)."""
        ids = tuple(module_ids)
        return sum(1 for u in words if any(self.holds(m, u) for m in ids))

    def only_generic_unknown(self, analysis: Analysis) -> bool:
        """Whether every unigram of the text that no example holds is a generic word."""
        vocabulary, generic = self.featurizer.vocabulary, self.generic
        return all(u in generic or "w:" + u in vocabulary for u in analysis.unigrams)

    def scores(self, analysis: Analysis) -> np.ndarray | None:
        """Every class's score, in `classes` order; None when no feature of the text is known."""
        columns, values = self.featurizer.row(analysis)
        if not columns:
            return None
        # Broadcast and sum rather than a BLAS product: one small product a call, and BLAS's
        # thread pool costs milliseconds at the tail for it.
        scores: np.ndarray = (self.weights[columns] * np.asarray(values)[:, None]).sum(axis=0)
        return scores


@dataclasses.dataclass(frozen=True)
class ScorerTop:
    """The scorer's best module for one text."""

    module_id: str
    margin: float
    """Its score minus the second module's."""
    threshold: float
    """The language's threshold (before any configured offset)."""
    topic_coverage: float
    """`LanguageModel.topic_coverage` of the text for the module."""
    only_generic_unknown: bool = False
    """`LanguageModel.only_generic_unknown`: the words the catalogue lacks are generic ones."""
    missing: int = 0
    """`LanguageModel.missing`: the text's content words the module's examples lack."""
    open_words: int = 0
    """`LanguageModel.open_words` of the module: how many such words it may hold."""
    content: int = 0
    """The text's content words counted for `topic_coverage`."""
    missing_elsewhere: int = 0
    """Of the `missing` words, those the examples of a rival hold (one of the `RIVALS` modules
    scored next for this text): evidence for that module's meaning rather than a name the
    module's examples leave open (`turn the volume down` to a volume-up module whose examples
    lack `down`, volume-down scored next). A word only a module far down the ranking holds is
    its incidental vocabulary (`week` in a calendar module's examples when asking for movies
    playing this week), not a rival reading of the text."""


class NgramScorer:
    """Module scores and thresholds per language. Immutable once trained; thread-safe."""

    def __init__(self, models: Mapping[str, LanguageModel], train_seconds: float) -> None:
        self._models = MappingProxyType(dict(models))
        self.train_seconds = train_seconds

    @classmethod
    def train(
        cls,
        profiles: Iterable[Profile],
        languages: Iterable[str],
        analyzer: Analyzer,
        *,
        extra_examples: Mapping[str, Mapping[str, Sequence[str]]] | None = None,
        background: Mapping[str, Sequence[str]] | None = None,
    ) -> NgramScorer:
        """Fits one model per language from the profiles' examples (and the config's extra
        examples, as the index takes them); `background` defaults to the shipped texts."""
        started = time.perf_counter()
        profiles = list(profiles)
        if background is None:
            background = load_background()
        models: dict[str, LanguageModel] = {}
        for lang in languages:
            texts: list[str] = []
            labels: list[str] = []
            for profile in profiles:
                extra = (extra_examples or {}).get(profile.module_id, {}).get(lang, ())
                for text in (*profile.examples.get(lang, ()), *extra):
                    texts.append(text)
                    labels.append(profile.module_id)
            model = _fit_language(
                texts,
                labels,
                list(background.get(lang, ())),
                analyzer,
                analyzer.lexicon.generic.get(lang, frozenset()),
            )
            if model is not None:
                models[lang] = model
                log.info(
                    "semantic scorer (%s): %d modules in %d fit(s), threshold %.3f "
                    "(leave-one-out %.3f, background %.3f over %d texts)",
                    lang,
                    len(model.classes),
                    model.chunks,
                    model.threshold,
                    model.loo_threshold,
                    model.background_threshold,
                    model.background_kept,
                )
            else:
                log.warning(
                    "semantic scorer (%s): no model (fewer than two modules, or fewer than %d "
                    "examples of each fit in %d); the seed's gates alone route it",
                    lang,
                    MIN_FITTED,
                    MAX_EXAMPLES,
                )
        return cls(models, time.perf_counter() - started)

    @property
    def languages(self) -> tuple[str, ...]:
        """Languages with a model."""
        return tuple(self._models)

    def model(self, lang: str) -> LanguageModel | None:
        return self._models.get(lang)

    def threshold(self, lang: str) -> float | None:
        """The derived threshold of `lang`; None without a model."""
        model = self._models.get(lang)
        return model.threshold if model else None

    def top(self, analysis: Analysis, lang: str) -> ScorerTop | None:
        """The best module and its margin; None without a model or a known feature."""
        model = self._models.get(lang)
        if model is None:
            return None
        scores = model.scores(analysis)
        if scores is None:
            return None
        if len(scores) < 2:  # pragma: no cover - a model has two classes at least
            return None
        # The best module and its rivals, best first: the second sets the margin.
        ranked = min(len(scores), RIVALS + 1)
        order = np.argpartition(scores, len(scores) - ranked)[-ranked:]
        best, *rivals = order[np.argsort(-scores[order])].tolist()
        second = rivals[0]
        module_id = model.classes[best]
        content, _ = model.content(analysis, module_id)
        missing_words = model.missing_words(analysis, module_id)
        missing = len(missing_words)
        return ScorerTop(
            module_id,
            float(scores[best] - scores[second]),
            model.threshold,
            (len(content) - missing) / len(content) if content else 0.0,
            model.only_generic_unknown(analysis),
            missing,
            model.open_words.get(module_id, 0),
            len(content),
            model.held_by(missing_words, (model.classes[r] for r in rivals)) if missing else 0,
        )


def _fit_language(
    texts: list[str],
    labels: list[str],
    background: list[str],
    analyzer: Analyzer,
    generic: frozenset[str] = frozenset(),
) -> LanguageModel | None:
    counts = Counter(labels)
    keep = [counts[label] >= 2 for label in labels]  # a single example has no leave-one-out
    texts = [t for t, k in zip(texts, keep, strict=True) if k]
    labels = [y for y, k in zip(labels, keep, strict=True) if k]
    classes = tuple(sorted(set(labels)))
    if len(classes) < 2:
        return None
    # More examples than one closed-form fit takes: the fit is the mean of fits on chunks of
    # them (`_chunks`), which together hold every example; topic coverage and open words come
    # from every example as always.
    per_class = _per_class(Counter(labels).values(), MAX_EXAMPLES)
    if per_class is not None and per_class < MIN_FITTED:
        return None
    analyses = [analyzer.analyze(t) for t in texts]
    featurizer = NgramFeaturizer(analyses)
    n, k = len(labels), len(classes)
    position = {c: i for i, c in enumerate(classes)}
    encoded = np.fromiter((position[y] for y in labels), dtype=np.int64, count=n)
    targets = -np.ones((n, k))
    targets[np.arange(n), encoded] = 1.0
    chunks = [list(range(n))] if per_class is None else _chunks(labels, per_class)
    weights, loo_scores = _ridge(featurizer.matrix, targets, chunks)
    # Kept in float32, row-major for `scores`' row gather: half the memory (139 -> 70 MB for
    # 150 modules x 100 examples), `decide` no slower, and every routing figure the same; the
    # margins are summed in float64.
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    loo = [
        (margin, top == truth)
        for margin, top, truth in zip(*_margins(loo_scores), encoded.tolist(), strict=True)
    ]
    loo_threshold = _loo_threshold(loo)
    kept = _unclaimed(featurizer, background, analyzer)
    background_margins = sorted(
        (m for m in (_margin(featurizer, weights, a) for a in kept) if m is not None),
        reverse=True,
    )
    background_threshold = MIN_MARGIN
    allowed = int(BACKGROUND_ACCEPT * len(kept))
    if len(background_margins) > allowed:
        background_threshold = background_margins[allowed] + 1e-9
    examples: dict[str, list[Analysis]] = {c: [] for c in classes}
    for analysis, label in zip(analyses, labels, strict=True):
        if label in examples:
            examples[label].append(analysis)
    unigrams = {
        c: frozenset(u for a in held for u in a.unigrams) - _only_modifying(held)
        for c, held in examples.items()
    }
    return LanguageModel(
        classes=classes,
        featurizer=featurizer,
        weights=weights,
        threshold=max(loo_threshold, background_threshold, MIN_MARGIN),
        loo_threshold=loo_threshold,
        background_threshold=background_threshold,
        background_kept=len(kept),
        unigrams=MappingProxyType(unigrams),
        stems=MappingProxyType(
            {c: frozenset().union(*map(word_forms, us)) for c, us in unigrams.items()}
        ),
        loo=tuple(loo),
        generic=generic,
        open_words=MappingProxyType(_open_words(analyses, labels, classes, generic)),
        chunks=len(chunks),
    )


def _only_modifying(examples: Iterable[Analysis]) -> set[str]:
    """The words only one of a module's examples holds, there only as a modifier (`X的Y`):
    `灯` of a smart-socket module's `打开灯的插座` (the lamp's socket). Such a word names what
    that example's thing belongs to, not what the module is asked about, so it covers no word
    of a text: `打开灯` (turn on the light) is a light module's request, which the catalogue may
    lack (issue 17, round 12)."""
    holders: Counter[str] = Counter()
    modifying: set[str] = set()
    for analysis in examples:
        words = Counter(analysis.unigrams)
        holders.update(words.keys())
        modifying.update(u for u in analysis.modifiers if words[u] == 1)
    return {u for u in modifying if holders[u] == 1}


def _per_class(sizes: Iterable[int], most: int) -> int | None:
    """How many examples of each class fit when at most `most` may: the largest share that
    fits once the classes with fewer keep all of theirs. None when every example fits."""
    ordered = sorted(sizes)
    left = most
    for count, size in enumerate(ordered):
        share = left // (len(ordered) - count)
        if size > share:
            return share
        left -= size
    return None


def _chunks(labels: Sequence[str], per_class: int) -> list[list[int]]:
    """The examples in chunks of at most `per_class` of each class, which together hold every
    example: as many chunks as the largest class needs; a class with `per_class` or fewer is in
    every chunk whole, a larger one is dealt round the chunks (its every `count`-th example
    from a different start, so a catalogue that lists one phrasing after another spreads each
    over the chunks) and topped up from the next deal, so each chunk holds `per_class` of it."""
    rows: dict[str, list[int]] = {}
    for i, label in enumerate(labels):
        rows.setdefault(label, []).append(i)
    count = max(math.ceil(len(members) / per_class) for members in rows.values())
    chunks: list[list[int]] = [[] for _ in range(count)]
    for members in rows.values():
        deals = [members[start::count] for start in range(count)]
        for c, chunk in enumerate(chunks):
            rotated = [i for turn in range(count) for i in deals[(c + turn) % count]]
            chunk += rotated[:per_class]
    return [sorted(chunk) for chunk in chunks]


def _ridge(
    matrix: sp.csr_matrix, targets: np.ndarray, chunks: Sequence[Sequence[int]]
) -> tuple[np.ndarray, np.ndarray]:
    """The one-vs-rest ridge weights (features x classes): the mean of one closed-form fit per
    chunk of examples; and every example's exact leave-one-out scores under that mean.

    A chunk's fit solves `(K + RIDGE I) alpha = Y` over its examples (K their Gram matrix) by
    Cholesky; its leave-one-out score of an example it holds is `y_i - alpha_i / [(K + RIDGE
    I)^-1]_ii` (the closed form of refitting without it), and a chunk that does not hold the
    example scores it as new text. The mean of those is the mean fit refitted without it."""
    n, k = targets.shape
    dual = np.zeros((n, k))  # each example's coefficients, summed over its chunks
    own = np.zeros((n, k))  # its leave-one-out scores less its fitted ones, likewise
    with threadpool_limits(1):
        for chunk in chunks:
            rows = matrix[chunk]
            system = (rows @ rows.T).toarray()
            system[np.diag_indices_from(system)] += RIDGE
            lower = scipy.linalg.cholesky(system, lower=True, check_finite=False)
            y = targets[chunk]
            alpha = scipy.linalg.cho_solve((lower, True), y, check_finite=False)
            inverse_lower, info = scipy.linalg.lapack.dtrtri(lower, lower=1)
            if info != 0:  # pragma: no cover - K + RIDGE I is positive definite
                raise np.linalg.LinAlgError(f"dtrtri failed ({info})")
            inverse_diagonal = np.einsum("ij,ij->j", inverse_lower, inverse_lower)
            dual[chunk] += alpha
            # fitted = y - RIDGE alpha; leave-one-out = y - alpha / inverse_diagonal
            own[chunk] += alpha * (RIDGE - 1.0 / inverse_diagonal[:, None])
        weights = np.asarray(matrix.T @ dual) / len(chunks)
        loo_scores = np.asarray(matrix @ weights) + own / len(chunks)
    return weights, loo_scores


def _open_words(
    analyses: Sequence[Analysis],
    labels: Sequence[str],
    classes: Sequence[str],
    generic: frozenset[str],
) -> dict[str, int]:
    """Per class, the mean count of content words (generic ones left out) that one example
    holds and the class's other examples lack, rounded down: how many words unknown to the
    module a text of it typically holds, measured on the catalogue by leaving one example out."""
    contents: dict[str, list[frozenset[str]]] = {c: [] for c in classes}
    for analysis, label in zip(analyses, labels, strict=True):
        contents[label].append(analysis.content - generic)
    out: dict[str, int] = {}
    for c, sets in contents.items():
        counts = Counter(u for words in sets for u in words)  # examples holding each word
        novel = sum(sum(1 for u in words if counts[u] == 1) for words in sets)
        out[c] = math.floor(novel / len(sets)) if sets else 0
    return out


def _margins(scores: np.ndarray) -> tuple[list[float], list[int]]:
    order = np.argsort(-scores, axis=1)
    rows = np.arange(len(scores))
    margins = scores[rows, order[:, 0]] - scores[rows, order[:, 1]]
    return margins.tolist(), order[:, 0].tolist()


def _margin(featurizer: NgramFeaturizer, weights: np.ndarray, analysis: Analysis) -> float | None:
    columns, values = featurizer.row(analysis)
    if not columns:
        return None
    scores = np.asarray(values) @ weights[columns]
    second, best = np.partition(scores, len(scores) - 2)[-2:]
    return float(best - second)


def _loo_threshold(loo: list[tuple[float, bool]]) -> float:
    """The least margin at which the examples' leave-one-out routes reach `LOO_PRECISION`;
    above the largest margin when none does."""
    best = max((m for m, _ in loo), default=0.0) + 1e-9
    right = wrong = 0
    for margin, ok in sorted(loo, reverse=True):
        right += ok
        wrong += not ok
        if right / (right + wrong) >= LOO_PRECISION:
            best = margin
    return best


def _unclaimed(
    featurizer: NgramFeaturizer, background: list[str], analyzer: Analyzer
) -> list[Analysis]:
    """Background texts whose cosine to every example is under `BACKGROUND_OVERLAP`."""
    if not background:
        return []
    analyses = [analyzer.analyze(t) for t in background]
    indptr, indices, data = [0], [], []
    for analysis in analyses:
        columns, values = featurizer.row(analysis)
        indices.extend(columns)
        data.extend(values)
        indptr.append(len(indices))
    queries = sp.csr_matrix(
        (np.asarray(data, dtype=float), np.asarray(indices, dtype=np.int64), indptr),
        shape=(len(analyses), featurizer.matrix.shape[1]),
    )
    # Both sides are normalised over known and unknown features alike: a true cosine.
    nearest = (queries @ featurizer.matrix.T).max(axis=1).toarray().ravel()
    return [a for a, s in zip(analyses, nearest, strict=True) if s < BACKGROUND_OVERLAP]
