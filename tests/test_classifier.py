"""The supervised scorer (`router_service.semantic.classifier`) and the scorer modes of
`SemanticRouter`: deterministic training, probabilities that match scikit-learn's, `strict`
never adding a direct route, and no mode ever routing a write or a guarded request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp

from router_service.eval import iter_cases
from router_service.semantic import (
    Analysis,
    Analyzer,
    Profile,
    SemanticConfig,
    SemanticRouter,
    load_profiles,
    normalize,
    parse_semantic_config,
    reload_changes,
)
from router_service.semantic.classifier import ModuleScorer
from router_service.semantic.config import SCORER_MODES, Scorer
from services.runtime.config import ConfigError

CORPUS = Path(__file__).resolve().parents[1] / "router_service" / "corpus"


@pytest.fixture(scope="module")
def analyzer() -> Analyzer:
    return Analyzer()


@pytest.fixture(scope="module")
def profiles() -> list[Profile]:
    return load_profiles(CORPUS / "profiles.json")[1]


@pytest.fixture(scope="module")
def routers(analyzer: Analyzer, profiles: list[Profile]) -> dict[str, SemanticRouter]:
    return {
        mode: SemanticRouter(profiles, SemanticConfig(scorer=Scorer(mode)), analyzer=analyzer)
        for mode in SCORER_MODES
    }


def _every_probability(
    scorer: ModuleScorer, analysis: Analysis, lang: str
) -> dict[str, float] | None:
    """Every class's calibrated probability for the analysed text, in `classes` order; None
    when `lang` has no model or the text has no feature the index knows."""
    got: dict[str, float] = {}
    for module in scorer.classes(lang):
        value = scorer.probability(analysis, lang, module)
        if value is None:
            return None
        got[module] = value
    return got or None


def _probabilities(router: SemanticRouter, text: str, lang: str) -> dict[str, float] | None:
    assert router.scorer is not None and router.index is not None
    return _every_probability(router.scorer, router.index.analyze(normalize(text)), lang)


def test_gates_mode_trains_nothing(routers: dict[str, SemanticRouter]) -> None:
    assert routers["gates"].scorer is None
    assert routers["strict"].scorer is not None and routers["calibrated"].scorer is not None
    decision = routers["gates"].decide("打开商店", "zh")
    assert decision.outcome == "direct" and decision.probability is None


def test_training_is_deterministic(analyzer: Analyzer, profiles: list[Profile]) -> None:
    config = SemanticConfig(scorer=Scorer("strict"))
    one, two = (SemanticRouter(profiles, config, analyzer=analyzer) for _ in range(2))
    texts = [("打开商店", "zh"), ("what quest am i on", "en"), ("今天天气不错", "zh")]
    for text, lang in texts:
        assert _probabilities(one, text, lang) == _probabilities(two, text, lang)


def test_probabilities_match_scikit_learn_and_sum_to_one(
    routers: dict[str, SemanticRouter],
) -> None:
    router = routers["calibrated"]
    assert router.scorer is not None and router.index is not None
    for lang in ("zh", "en"):
        estimator = router.scorer.estimator(lang)
        matrix, _ = router.index.training_set(lang)
        classes = router.scorer.classes(lang)
        assert "system:smalltalk" in classes and "system:pay" in classes  # reject, hints
        for case in iter_cases(CORPUS / "cases.jsonl", split="tune"):
            if case.lang != lang:
                continue
            analysis = router.index.analyze(normalize(case.text))
            got = _every_probability(router.scorer, analysis, lang)
            row = router.index.query_vector(analysis, lang)
            if row is None:
                assert got is None
                continue
            assert got is not None and list(got) == list(classes)
            values = np.array(list(got.values()))
            assert ((values >= 0) & (values <= 1)).all()
            assert values.sum() == pytest.approx(1.0)
            columns, weights = row
            x = sp.csr_matrix((weights, ([0] * len(columns), columns)), shape=(1, matrix.shape[1]))
            assert values == pytest.approx(estimator.predict_proba(x)[0], abs=1e-9)


def test_decisions_carry_the_probability(routers: dict[str, SemanticRouter]) -> None:
    decision = routers["strict"].decide("打开商店", "zh")
    assert decision.outcome == "direct"
    assert decision.probability is not None and 0.8 <= decision.probability <= 1.0


def test_strict_never_adds_a_direct_route_and_no_mode_routes_writes_or_guards(
    routers: dict[str, SemanticRouter],
) -> None:
    guarded = {"write", "negation", "condition", "reference", "compound"}
    for case in iter_cases(CORPUS / "cases.jsonl", split="all"):
        decisions = {m: r.decide(case.text, case.lang) for m, r in routers.items()}
        if decisions["strict"].outcome == "direct":
            assert decisions["gates"].outcome == "direct", case
            assert decisions["strict"].module_id == decisions["gates"].module_id
        for mode, decision in decisions.items():
            if case.category == "write":
                assert decision.outcome != "direct", (mode, case)
            if decision.outcome == "direct":
                assert not decision.gate_failed
            if decision.gate_failed.startswith("guard:") and mode == "gates":
                # whatever the scorer says, a guarded text stays guarded
                assert all(d.outcome != "direct" for d in decisions.values()), case
        if case.category in guarded and decisions["gates"].gate_failed.startswith("guard:"):
            assert decisions["calibrated"].outcome != "direct"


def test_scorer_never_overrides_profile_kind_guards_or_arguments(analyzer: Analyzer) -> None:
    profiles = [
        Profile("t:shop", "read", {"en": ["open the shop", "show the shop", "browse the shop"]}),
        Profile("t:mail", "read", {"en": ["open my mail", "show my mail", "check my mail"]}),
        Profile(
            "t:item",
            "read",
            {"en": ["look up item <item>", "what is item <item>", "item info"]},
            extractor="item_id",
        ),
        Profile("t:buy", "hints", {"en": ["buy in the shop", "purchase goods", "buy stuff"]}),
    ]
    router = SemanticRouter(
        profiles,
        SemanticConfig(scorer=Scorer("calibrated", 0.5)),
        analyzer=analyzer,
    )
    assert router.decide("open the shop", "en").outcome == "direct"
    assert router.decide("don't open the shop", "en").gate_failed == "guard:negation"
    assert router.decide("buy stuff", "en").gate_failed in ("not_direct_profile", "guard:write")
    assert router.decide("item info", "en").gate_failed == "arguments"


def test_probability_gate_blocks_when_under_target(
    analyzer: Analyzer, profiles: list[Profile]
) -> None:
    router = SemanticRouter(profiles, SemanticConfig(scorer=Scorer("strict")), analyzer=analyzer)
    decision = router.decide("打开商店", "zh")
    assert decision.outcome == "direct" and decision.probability is not None
    assert decision.probability < 1.0
    # the target applies on reload; the gates passed, so the probability gate names itself
    assert router.apply_config(SemanticConfig(scorer=Scorer("strict", 1.0))) == [
        "scorer: applies live"
    ]
    blocked = router.decide("打开商店", "zh")
    assert blocked.outcome == "no_direct" and blocked.gate_failed == "probability"
    assert blocked.probability == decision.probability
    # back to gates: the seed's decision again
    router.apply_config(SemanticConfig())
    assert router.decide("打开商店", "zh").outcome == "direct"


def test_modules_with_one_example_get_no_probability(analyzer: Analyzer) -> None:
    profiles = [
        Profile("t:shop", "read", {"en": ["open the shop", "show the shop"]}),
        Profile("t:mail", "read", {"en": ["open my mail", "show my mail"]}),
        Profile("t:help", "read", {"en": ["help"]}),
    ]
    router = SemanticRouter(
        profiles, SemanticConfig(scorer=Scorer("strict", 0.5)), analyzer=analyzer
    )
    assert router.scorer is not None and router.scorer.skipped == {"en": ("t:help",)}
    assert router.decide("help", "en").gate_failed == "probability"
    # one module only: no model, nothing routes under strict
    alone = SemanticRouter(profiles[:1], SemanticConfig(scorer=Scorer("strict")), analyzer=analyzer)
    assert alone.scorer is not None and alone.scorer.languages == ()
    assert alone.decide("open the shop", "en").gate_failed == "probability"


def test_training_time_for_100_modules_of_20_examples(analyzer: Analyzer) -> None:
    words = [f"w{i}" for i in range(400)]
    rng = np.random.default_rng(0)
    profiles = [
        Profile(
            f"bench:m{m}",
            "read",
            {"en": [" ".join(rng.choice(words, 4)) + f" topic{m}" for _ in range(20)]},
        )
        for m in range(100)
    ]
    config = SemanticConfig(languages=("en",), scorer=Scorer("strict"))
    router = SemanticRouter(profiles, config, analyzer=analyzer)
    assert router.scorer is not None
    started = time.perf_counter()
    ModuleScorer.train(router.index)  # type: ignore[arg-type]
    assert time.perf_counter() - started < 30  # measured ~2-3 s on the 2-core dev machine


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"scorer": "strict"}, "scorer must be a JSON object, got 'strict'"),
        (
            {"scorer": {"mode": "magic"}},
            "scorer.mode must be one of ngram, gates, strict, calibrated",
        ),
        (
            {"scorer": {"mode": 1}},
            "scorer.mode must be one of ngram, gates, strict, calibrated, got 1",
        ),
        ({"scorer": {"target": 0.4}}, "scorer.target must be in 0.5..1, got 0.4"),
        ({"scorer": {"target": "high"}}, "scorer.target must be a number in 0.5..1"),
        ({"scorer": {"targets": 0.9}}, "scorer has unknown key(s) targets; allowed: mode, target"),
    ],
)
def test_scorer_config_errors(document: Any, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_semantic_config(document, "semantic.json")
    assert message in str(error.value)


def test_scorer_config_parses_and_reloads() -> None:
    config = parse_semantic_config({"scorer": {"mode": "STRICT", "target": 0.95}})
    assert config.scorer == Scorer("strict", 0.95)
    assert parse_semantic_config(config.to_json()) == config
    assert SemanticConfig().scorer == Scorer("ngram", 0.8)
    with pytest.raises(ConfigError, match="scorer.mode must be one of"):
        Scorer("magic")
    gates, strict = SemanticConfig(), SemanticConfig(scorer=Scorer("strict"))
    assert reload_changes(gates, strict)[0].startswith("scorer: needs a restart")
    calibrated = SemanticConfig(scorer=Scorer("calibrated", 0.9))
    assert reload_changes(strict, calibrated) == ["scorer: applies live"]
