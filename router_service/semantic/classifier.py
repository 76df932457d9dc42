"""The supervised scorer: a calibrated probability that a text asks for a given module.

The index's cosine scores are similarities, not probabilities, and its thresholds are fixed
constants. `ModuleScorer` is trained once, at start, from the registered examples on the very
features the index matches on (its fitted TF-IDF rows; a query is vectorised exactly as `match`
vectorises it, unknown unigrams kept in the norm so unfamiliar content lowers the confidence):

- one multinomial `LogisticRegression` per language, every module with examples a class
  (read, hints and reject profiles alike: hints and rejects compete for the probability mass
  but the router never routes them directly);
- wrapped in `CalibratedClassifierCV` (sigmoid, `k`-fold stratified cross-validation over the
  examples, `k = min(3, fewest examples of a class)`, shuffled with a fixed seed): each fold's
  model is calibrated on the examples it did not see, and the folds' probabilities are averaged;
- a module with a single example in a language is left out of that language's classes (no
  cross-validation is possible): its probability there is None, so `strict` and `calibrated`
  never route it directly; a language with fewer than two classes gets no model.

Prediction does not call scikit-learn: the folds' coefficients and sigmoid parameters are
stacked into one matrix at training, and a query touches only the rows of its few features
(tested to equal `CalibratedClassifierCV.predict_proba`). Training and prediction are
deterministic.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
from sklearn.calibration import CalibratedClassifierCV
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold
from threadpoolctl import threadpool_limits

from router_service.semantic.index import SemanticIndex
from router_service.semantic.text import Analysis

__all__ = ["ModuleScorer"]

log = logging.getLogger("system.router.semantic")

MAX_FOLDS = 3
RANDOM_STATE = 0
C = 10.0
"""Inverse l2 regularisation of the logistic regression (rows are l2-normalised tf-idf)."""
METHOD = "temperature"
"""Calibration: `temperature` (one inverse temperature per fold, softmax of the scaled logits)
or `sigmoid` (Platt, one-vs-rest, renormalised)."""


@dataclasses.dataclass(frozen=True)
class _LanguageModel:
    classes: tuple[str, ...]
    class_index: Mapping[str, int]
    weights: np.ndarray
    """features x (folds * logits): every fold's coefficients, side by side."""
    intercepts: np.ndarray
    method: str
    slopes: np.ndarray
    """`sigmoid`: `a` per fold and logit, p = 1 / (1 + exp(a * z + b)); `temperature`: the
    inverse temperature per fold and logit, p = softmax(beta * z) per fold."""
    offsets: np.ndarray
    """`sigmoid`: `b` per fold and logit; `temperature`: zeros."""
    folds: int
    estimator: CalibratedClassifierCV
    """The fitted scikit-learn model (kept for tests and inspection)."""

    def predict(self, columns: list[int], values: list[float]) -> np.ndarray:
        """Class probabilities, in `classes` order, of one sparse row."""
        logits = np.asarray(values) @ self.weights[columns] + self.intercepts
        k = len(self.classes)
        if self.method == "temperature":
            scaled = (self.slopes * logits).reshape(self.folds, -1)
            if k == 2:  # one logit x per fold: the two classes' logits are (-x, x)
                scaled = np.hstack((-scaled, scaled))
            scaled -= scaled.max(axis=1, keepdims=True)
            exp = np.exp(scaled)
            scores: np.ndarray = np.clip((exp / exp.sum(axis=1, keepdims=True)).mean(axis=0), 0, 1)
            return scores
        calibrated = 1.0 / (1.0 + np.exp(self.slopes * logits + self.offsets))
        if k == 2:  # one logit per fold: the probability of classes[1]
            positive = calibrated
            per_fold = np.stack((1.0 - positive, positive), axis=1)
        else:
            per_fold = calibrated.reshape(self.folds, k)
            sums = per_fold.sum(axis=1, keepdims=True)
            per_fold = np.divide(
                per_fold, sums, out=np.full_like(per_fold, 1.0 / k), where=sums != 0
            )
        averaged: np.ndarray = np.clip(per_fold.mean(axis=0), 0.0, 1.0)
        return averaged


class ModuleScorer:
    """Calibrated module probabilities per language. Immutable once trained; thread-safe."""

    def __init__(
        self,
        index: SemanticIndex,
        models: Mapping[str, _LanguageModel],
        skipped: Mapping[str, tuple[str, ...]],
        train_seconds: float,
    ) -> None:
        self._index = index
        self._models = MappingProxyType(dict(models))
        self.skipped: Mapping[str, tuple[str, ...]] = MappingProxyType(dict(skipped))
        """Per language, modules left out for having a single example there."""
        self.train_seconds = train_seconds

    @classmethod
    def train(cls, index: SemanticIndex) -> ModuleScorer:
        """Fits one calibrated model per language of `index` from its examples."""
        started = time.perf_counter()
        models: dict[str, _LanguageModel] = {}
        skipped: dict[str, tuple[str, ...]] = {}
        for lang in index.languages:
            data = index.training_set(lang)
            if data is None:
                continue
            matrix, labels = data
            counts = Counter(labels)
            rare = tuple(sorted(m for m, n in counts.items() if n < 2))
            if rare:
                skipped[lang] = rare
                log.warning(
                    "semantic scorer (%s): one example only, no probability for %s",
                    lang,
                    ", ".join(rare),
                )
            keep = np.fromiter((counts[m] >= 2 for m in labels), dtype=bool, count=len(labels))
            kept_counts = [n for n in counts.values() if n >= 2]
            if len(kept_counts) < 2:
                log.warning("semantic scorer (%s): fewer than two modules, no model", lang)
                continue
            models[lang] = _fit(matrix[keep], np.asarray(labels, dtype=object)[keep])
        return cls(index, models, skipped, time.perf_counter() - started)

    @property
    def languages(self) -> tuple[str, ...]:
        """Languages with a model."""
        return tuple(self._models)

    def classes(self, lang: str) -> tuple[str, ...]:
        """The modules the model of `lang` tells apart (empty without a model)."""
        model = self._models.get(lang)
        return model.classes if model else ()

    def estimator(self, lang: str) -> CalibratedClassifierCV | None:
        """The fitted scikit-learn model of `lang`."""
        model = self._models.get(lang)
        return model.estimator if model else None

    def probability(self, analysis: Analysis, lang: str, module_id: str) -> float | None:
        """The calibrated probability that the analysed text asks for `module_id`; None when
        there is no model, the module is no class of it, or no feature of the text is known."""
        model = self._models.get(lang)
        if model is None:
            return None
        position = model.class_index.get(module_id)
        if position is None:
            return None
        row = self._index.query_vector(analysis, lang)
        if row is None:
            return None
        return float(model.predict(*row)[position])


def _fit(matrix: object, labels: np.ndarray) -> _LanguageModel:
    names, encoded = np.unique(labels.astype(str), return_inverse=True)
    folds = min(MAX_FOLDS, int(np.bincount(encoded).min()))
    estimator = CalibratedClassifierCV(
        LogisticRegression(C=C, max_iter=1000),
        method=METHOD,
        cv=StratifiedKFold(n_splits=folds, shuffle=True, random_state=RANDOM_STATE),
    )
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore")  # convergence chatter on tiny example sets
        estimator.fit(matrix, encoded)
    classes = tuple(str(n) for n in names)
    weights, intercepts, slopes, offsets = [], [], [], []
    for fold in estimator.calibrated_classifiers_:
        lr = fold.estimator
        # Stratified folds hold every class, so each fold's logits (and calibrators) come in
        # `classes` order; a binary model has one logit, that of classes[1].
        if list(lr.classes_) != list(range(len(classes))):  # pragma: no cover
            raise AssertionError("a fold's classes differ from the model's")
        weights.append(lr.coef_.T)
        intercepts.append(lr.intercept_)
        logits = lr.coef_.shape[0]
        if METHOD == "temperature":
            slopes.append([float(fold.calibrators[0].beta_)] * logits)
            offsets.append([0.0] * logits)
        else:
            slopes.append([c.a_ for c in fold.calibrators])
            offsets.append([c.b_ for c in fold.calibrators])
    return _LanguageModel(
        classes=classes,
        class_index=MappingProxyType({c: i for i, c in enumerate(classes)}),
        weights=np.ascontiguousarray(np.hstack(weights)),
        intercepts=np.concatenate(intercepts),
        slopes=np.asarray(slopes, dtype=float).ravel(),
        offsets=np.asarray(offsets, dtype=float).ravel(),
        method=METHOD,
        folds=len(estimator.calibrated_classifiers_),
        estimator=estimator,
    )
