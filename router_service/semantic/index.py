"""The semantic index: sparse TF-IDF vectors of every profile's examples, one index per
language, and cosine matching of a text against them.

Examples are fitted once per language by scikit-learn's `TfidfVectorizer` over the analyzer's
features (sublinear tf, smoothed idf, l2 norm); the fitted matrix is kept transposed (feature →
examples, CSR), rows grouped by module. A query then touches only the examples that share one
of its features: each of its few non-zero weights adds, in one vectorised step, into a
per-example score array; `numpy.maximum.reduceat` takes each module's best example, and only
the top modules are looked at in Python. When the text's features touch few examples (a small
catalogue, or rare features), the same sums are made in plain Python over the touched examples
only: each numpy call costs about a microsecond whatever its size, more than a few dozen
additions. Both ways add the same products in the same order, so they give identical scores,
ranks and examples (tested).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Collection, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer

from router_service.semantic.config import SemanticConfig
from router_service.semantic.profiles import Profile
from router_service.semantic.text import Analysis, Analyzer, default_analyzer
from services.runtime.config import ConfigError

__all__ = ["Match", "ModuleScore", "Profile", "SemanticIndex"]

log = logging.getLogger("system.router.semantic")

_MASK_CACHE_SIZE = 256
_FULL_SORT_MODULES = 256  # below this, one argsort beats argpartition plus a sort
SPARSE_ROWS = 1024
"""Languages with at most this many examples also keep their postings as Python tuples (about
70 bytes a posting), for the plain-Python scoring; bigger ones score with numpy only."""
SPARSE_POSTINGS = 64
"""Up to this many (example, feature) postings touched by a text (and at most
`_FULL_SORT_MODULES` modules), `match` scores in plain Python; above it, with numpy (measured:
about where the two cost the same)."""


@dataclasses.dataclass(frozen=True)
class ModuleScore:
    """A module's best example for one text."""

    module_id: str
    score: float
    """Cosine similarity of the text and the example, 0..1 (not a probability). The text's
    vector keeps its unknown unigrams, weighted with the largest idf, so they lower the score;
    unknown bigrams are dropped."""
    example_id: str
    """`module@lang#n`: the n-th example of that module in that language (registered examples
    first, then the config's extra examples)."""


@dataclasses.dataclass(frozen=True)
class Match:
    """How one text matches the index of one language."""

    language: str
    candidates: tuple[ModuleScore, ...]
    """Best example per module, best first, only modules scoring above 0; reject profiles
    included (they take part in the margin)."""
    s1: float
    """Score of the best module (0 when none)."""
    s2: float
    """Score of the best *different* module (0 when none)."""
    coverage: float
    """Feature coverage: the share of the input's unigram feature weight that the index knows.
    Each unigram weighs its tf-idf weight (sublinear tf × idf); a feature no example has gets
    the largest idf the index could give (that of a feature in no example), so one unfamiliar
    word weighs at least as much as any familiar one. 0 when the text has no features."""
    topic_coverage: float
    """Topic coverage: the share of the input's content features (unigrams other than generic
    `action` words such as view/open/what; unknown words, placeholders and write words
    included) that appear among the unigrams of the best module's best example. 0 when the
    text has no content feature, so a bare verb never confirms a topic."""
    seconds: float
    """Time spent analysing and matching."""

    @property
    def margin(self) -> float:
        """`s1 - s2`."""
        return self.s1 - self.s2

    @property
    def top(self) -> ModuleScore | None:
        """The best module, if any scored above 0."""
        return self.candidates[0] if self.candidates else None


@dataclasses.dataclass(frozen=True)
class _LanguageIndex:
    language: str
    vocabulary: Mapping[str, int]
    idf: list[float]  # a list: scalar lookups on it are cheaper than on an array
    unknown_idf: float
    postings: list[tuple[np.ndarray, np.ndarray]]
    """Per feature column, the example rows holding it and their tf-idf values (views of the
    transposed CSR matrix)."""
    posting_lists: list[tuple[tuple[int, ...], tuple[float, ...]]] | None
    """The same postings as Python rows and values, for the plain-Python scoring; None above
    `SPARSE_ROWS` examples."""
    posting_sizes: list[int]
    row_modules: list[int]
    """Module position of each example row."""
    rows: int
    module_ids: tuple[str, ...]  # in index order
    module_starts: np.ndarray  # first row of each module; rows of a module are contiguous
    starts_list: list[int]
    ends_list: list[int]
    always: np.ndarray  # reject profiles: considered whatever the player may use
    example_ids: tuple[str, ...]
    example_unigrams: tuple[frozenset[str], ...]
    matrix: object  # the fitted examples x features CSR matrix (training data of the scorer)


class SemanticIndex:
    """Examples of every profile, vectorised per language. Immutable once built; `match` is
    thread-safe."""

    def __init__(
        self,
        profiles: Mapping[str, Profile],
        languages: dict[str, _LanguageIndex],
        analyzer: Analyzer,
        ignored_examples: tuple[str, ...],
        build_seconds: float,
    ) -> None:
        self.profiles: Mapping[str, Profile] = MappingProxyType(dict(profiles))
        """Every profile, by module id."""
        self.analyzer = analyzer
        self.ignored_examples = ignored_examples
        """Modules named in the config's `examples` that no profile declares (ignored)."""
        self.build_seconds = build_seconds
        self._languages = languages
        self._masks: dict[tuple[str, frozenset[str]], _Mask] = {}

    @classmethod
    def build(
        cls,
        profiles: Iterable[Profile],
        config: SemanticConfig,
        analyzer: Analyzer | None = None,
    ) -> SemanticIndex:
        """Vectorises the profiles' examples, plus the config's extra examples, for every
        language in `config.languages`.

        Raises:
            ConfigError: two profiles share a module id.
        """
        started = time.perf_counter()
        analyzer = analyzer or default_analyzer()
        by_id: dict[str, Profile] = {}
        for profile in profiles:
            if profile.module_id in by_id:
                raise ConfigError(f"module {profile.module_id} has two routing profiles")
            by_id[profile.module_id] = profile
        ignored = tuple(sorted(set(config.examples) - set(by_id)))
        if ignored:
            log.warning(
                "system-semantic.json has examples for unregistered modules, ignored: %s",
                ", ".join(ignored),
            )
        languages: dict[str, _LanguageIndex] = {}
        for language in config.languages:
            index = _build_language(language, by_id.values(), config, analyzer)
            if index is not None:
                languages[language] = index
        return cls(by_id, languages, analyzer, ignored, time.perf_counter() - started)

    @property
    def languages(self) -> tuple[str, ...]:
        """Languages with at least one example."""
        return tuple(self._languages)

    @property
    def example_count(self) -> int:
        """Examples over all languages."""
        return sum(index.rows for index in self._languages.values())

    def analyze(self, text: str) -> Analysis:
        """The features of `text`."""
        return self.analyzer.analyze(text)

    def training_set(self, lang: str) -> tuple[Any, tuple[str, ...]] | None:
        """The examples of `lang` as the index vectorised them (a CSR matrix, one l2-normalised
        tf-idf row per example) and each row's module id; None without an index for `lang`."""
        index = self._languages.get(lang)
        if index is None:
            return None
        labels: list[str] = []
        for module_id, start, end in zip(
            index.module_ids, index.starts_list, index.ends_list, strict=True
        ):
            labels.extend([module_id] * (end - start))
        return index.matrix, tuple(labels)

    def query_vector(self, analysis: Analysis, lang: str) -> tuple[list[int], list[float]] | None:
        """`analysis` as a sparse row over the features of `lang`: columns and values, scaled
        exactly as `match` scales them (sublinear tf x idf, divided by a norm that keeps the
        unknown unigrams at the largest idf). None when no feature is known."""
        index = self._languages.get(lang)
        if index is None or not analysis.unigrams:
            return None
        columns, weights, unknown_squares, _ = _weights(index, analysis)
        if not columns:
            return None
        norm = math.sqrt(sum(w * w for w in weights) + unknown_squares)
        return columns, [w / norm for w in weights]

    def match(
        self,
        text: str,
        lang: str,
        *,
        allowed: Collection[str] | None = None,
        limit: int = 5,
        analysis: Analysis | None = None,
    ) -> Match:
        """Matches `text` against the examples of `lang`.

        Args:
            text: the player's text (normalised here).
            lang: the index to use; an unknown language gives an empty match.
            allowed: module ids the player may use; None for all. Reject profiles always take
                part.
            limit: how many candidates to return at most.
            analysis: `text` already analysed (the router analyses once for index and scorer).
        """
        started = time.perf_counter()
        if analysis is None:
            analysis = self.analyzer.analyze(text)
        index = self._languages.get(lang)
        if index is None or not analysis.unigrams:
            return Match(lang, (), 0.0, 0.0, 0.0, 0.0, time.perf_counter() - started)
        columns, weights, unknown_squares, coverage = _weights(index, analysis)
        if not columns:
            return Match(lang, (), 0.0, 0.0, coverage, 0.0, time.perf_counter() - started)

        # Cosine = dot product of l2-normalised vectors; only the examples holding one of the
        # text's features get a contribution. Unlike TfidfVectorizer.transform, the text's norm
        # keeps its unknown unigrams (at the largest idf): unfamiliar content lowers the score
        # instead of vanishing. Unknown bigrams of known words are left out, as a new
        # combination of familiar words is not new content.
        norm = math.sqrt(sum(w * w for w in weights) + unknown_squares)
        mask = None if allowed is None else self._mask(index, allowed)
        count = min(limit + 1, len(index.module_ids))  # one more than asked, for s2
        sizes = index.posting_sizes
        if (
            index.posting_lists is not None
            and len(index.module_ids) <= _FULL_SORT_MODULES
            and sum(sizes[c] for c in columns) <= SPARSE_POSTINGS
        ):
            ranked = _rank_sparse(index, columns, weights, norm, mask, count)
        else:
            ranked = _rank_dense(index, columns, weights, norm, mask, count)
        candidates = [
            ModuleScore(index.module_ids[position], min(score, 1.0), index.example_ids[row])
            for position, score, row in ranked
        ]
        best_rows = [row for _, _, row in ranked]
        if not candidates:
            return Match(lang, (), 0.0, 0.0, coverage, 0.0, time.perf_counter() - started)
        s1 = candidates[0].score
        s2 = candidates[1].score if len(candidates) > 1 else 0.0
        content = analysis.content
        covered = len(content & index.example_unigrams[best_rows[0]])
        topic = covered / len(content) if content else 0.0
        return Match(
            lang,
            tuple(candidates[:limit]),
            s1,
            s2,
            coverage,
            topic,
            time.perf_counter() - started,
        )

    def _mask(self, index: _LanguageIndex, allowed: Collection[str]) -> _Mask:
        key = (index.language, frozenset(allowed))
        mask = self._masks.get(key)
        if mask is None:
            array = index.always | np.fromiter(
                (m in key[1] for m in index.module_ids), dtype=bool, count=len(index.module_ids)
            )
            mask = _Mask(array, array.tolist())
            if len(self._masks) >= _MASK_CACHE_SIZE:
                self._masks.clear()
            self._masks[key] = mask
        return mask


@dataclasses.dataclass(frozen=True)
class _Mask:
    """Modules a player's `allowed` set lets take part (reject profiles always do)."""

    array: np.ndarray
    flags: list[bool]  # the same, for scalar lookups from Python


_Ranked = list[tuple[int, float, int]]
"""(module position, best score, best example row), best first, scores above 0 only."""


def _rank_dense(
    index: _LanguageIndex,
    columns: list[int],
    weights: list[float],
    norm: float,
    mask: _Mask | None,
    count: int,
) -> _Ranked:
    """The top `count` modules, one vectorised update per feature (large postings)."""
    scores = np.zeros(index.rows)
    for column, weight in zip(columns, weights, strict=True):
        rows, values = index.postings[column]
        scores[rows] += values * (weight / norm)
    best = np.maximum.reduceat(scores, index.module_starts)
    if mask is not None:
        best[~mask.array] = -1.0
    if best.size > _FULL_SORT_MODULES:
        top = np.argpartition(-best, count - 1)[:count]
        top = top[np.argsort(-best[top], kind="stable")]
    else:
        top = np.argsort(-best, kind="stable")[:count]
    starts, ends = index.starts_list, index.ends_list
    ranked: _Ranked = []
    for position, score in zip(top.tolist(), best[top].tolist(), strict=True):
        if score <= 1e-12:
            break
        row = starts[position] + int(scores[starts[position] : ends[position]].argmax())
        ranked.append((position, score, row))
    return ranked


def _rank_sparse(
    index: _LanguageIndex,
    columns: list[int],
    weights: list[float],
    norm: float,
    mask: _Mask | None,
    count: int,
) -> _Ranked:
    """What `_rank_dense` returns, in plain Python over the touched rows only (few postings).

    The same products are added in the same order, so every score is bit-identical; an
    untouched row scores 0 and never ranks; ties go to the lower module position (the stable
    argsort) and, within a module, to the lower row (argmax).
    """
    postings = index.posting_lists
    assert postings is not None
    scores: dict[int, float] = {}
    get = scores.get
    for column, weight in zip(columns, weights, strict=True):
        scale = weight / norm
        rows, values = postings[column]
        for row, value in zip(rows, values, strict=True):
            scores[row] = get(row, 0.0) + value * scale
    row_modules = index.row_modules
    best: dict[int, tuple[float, int]] = {}
    for row, score in scores.items():
        position = row_modules[row]
        held = best.get(position)
        if held is None or score > held[0] or (score == held[0] and row < held[1]):
            best[position] = (score, row)
    flags = mask.flags if mask is not None else None
    ranked = [
        (position, score, row)
        for position, (score, row) in best.items()
        if score > 1e-12 and (flags is None or flags[position])
    ]
    ranked.sort(key=lambda r: (-r[1], r[0]))
    return ranked[:count]


def _count(items: tuple[str, ...]) -> dict[str, int]:
    """Occurrences in first-seen order, like `Counter` (whose set-up costs more than counting
    a text's few features)."""
    counts: dict[str, int] = {}
    get = counts.get
    for item in items:
        counts[item] = get(item, 0) + 1
    return counts


def _weights(
    index: _LanguageIndex, analysis: Analysis
) -> tuple[list[int], list[float], float, float]:
    """The text's known feature columns and their tf-idf weights (not normalised), the squared
    weight of its unknown unigrams, and its feature coverage."""
    vocabulary, idf = index.vocabulary, index.idf
    columns: list[int] = []
    weights: list[float] = []
    for feature, count in _count(analysis.features).items():
        column = vocabulary.get(feature)
        if column is not None:
            columns.append(column)
            weights.append((1.0 + math.log(count)) * idf[column])
    known = total = unknown_squares = 0.0
    for feature, count in _count(analysis.unigrams).items():
        column = vocabulary.get(feature)
        if column is not None:
            weight = (1.0 + math.log(count)) * idf[column]
            known += weight
        else:
            weight = (1.0 + math.log(count)) * index.unknown_idf
            unknown_squares += weight * weight
        total += weight
    return columns, weights, unknown_squares, known / total


def _build_language(
    language: str, profiles: Iterable[Profile], config: SemanticConfig, analyzer: Analyzer
) -> _LanguageIndex | None:
    texts: list[str] = []
    example_ids: list[str] = []
    module_ids: list[str] = []
    starts: list[int] = []
    always: list[bool] = []
    for profile in profiles:
        examples = (
            *profile.examples.get(language, ()),
            *config.examples.get(profile.module_id, {}).get(language, ()),
        )
        if not examples:
            continue
        module_ids.append(profile.module_id)
        starts.append(len(texts))
        always.append(profile.kind == "reject")
        for n, example in enumerate(examples):
            texts.append(example)
            example_ids.append(f"{profile.module_id}@{language}#{n}")
    if not texts:
        log.info("no examples in %s: no semantic index for it", language)
        return None
    vectorizer = TfidfVectorizer(analyzer=analyzer, sublinear_tf=True, norm="l2")
    try:
        matrix = vectorizer.fit_transform(texts)
    except ValueError:  # every example of the language had no features at all
        log.warning("the %s examples have no features: no semantic index for it", language)
        return None
    transposed = matrix.T.tocsr()
    transposed.sort_indices()
    indptr, indices = transposed.indptr, transposed.indices.astype(np.intp)
    postings = [
        (indices[indptr[j] : indptr[j + 1]], transposed.data[indptr[j] : indptr[j + 1]])
        for j in range(transposed.shape[0])
    ]
    ends = [*starts[1:], len(texts)]
    row_modules = [
        p for p, (a, b) in enumerate(zip(starts, ends, strict=True)) for _ in range(a, b)
    ]
    vocabulary = {str(k): int(v) for k, v in vectorizer.vocabulary_.items()}
    unigrams = tuple(frozenset(analyzer.analyze(t).unigrams) for t in texts)
    return _LanguageIndex(
        language=language,
        vocabulary=vocabulary,
        idf=[float(v) for v in vectorizer.idf_],
        # smooth idf of a feature in no example: ln((1 + n) / 1) + 1
        unknown_idf=math.log(1 + len(texts)) + 1.0,
        postings=postings,
        posting_lists=[(tuple(r.tolist()), tuple(v.tolist())) for r, v in postings]
        if len(texts) <= SPARSE_ROWS
        else None,
        posting_sizes=[len(r) for r, _ in postings],
        row_modules=row_modules,
        rows=len(texts),
        module_ids=tuple(module_ids),
        module_starts=np.asarray(starts, dtype=np.intp),
        starts_list=starts,
        ends_list=ends,
        always=np.asarray(always, dtype=bool),
        example_ids=tuple(example_ids),
        example_unigrams=unigrams,
        matrix=matrix.tocsr(),
    )
