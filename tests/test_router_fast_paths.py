"""The router's per-call shortcuts give exactly what the plain computations give: plain-Python
scoring of small postings against numpy's, phrase lookups only where a phrase starts, the
allowed-module and shortcut sets remembered per permission set, prebuilt argument-less
actions, and diagnostics names checked once."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from system.common.v1 import catalog_pb2, common_pb2
from system.router.v1 import router_pb2

from router_service.buttons import ButtonMatcher, load_phrasings
from router_service.cache import IntentCache
from router_service.catalog import CatalogCache, standalone_catalog
from router_service.diagnostics import DecisionSource, RouterDiagnostics
from router_service.router import Router, _bare_action
from router_service.semantic import (
    Profile,
    SemanticConfig,
    SemanticIndex,
    SemanticRouter,
    load_profiles,
)
from router_service.semantic import index as index_module
from router_service.semantic.text import Analyzer, normalize
from services.runtime.permissions import module_available

CORPUS = Path(__file__).resolve().parent.parent / "router_service" / "corpus"
PROFILES = CORPUS / "profiles.json"


@pytest.fixture(scope="module")
def analyzer() -> Analyzer:
    return Analyzer()


@pytest.fixture(scope="module")
def corpus_router(analyzer: Analyzer) -> SemanticRouter:
    _, profiles = load_profiles(PROFILES)
    return SemanticRouter(profiles, SemanticConfig(), analyzer=analyzer)


@pytest.fixture(scope="module")
def corpus_texts() -> list[str]:
    cases = [json.loads(line) for line in (CORPUS / "cases.jsonl").read_text().splitlines()]
    return [c["text"] for c in cases]


def _match_both_ways(
    monkeypatch: pytest.MonkeyPatch,
    index: SemanticIndex,
    text: str,
    lang: str,
    allowed: frozenset[str] | None,
) -> tuple[Any, Any]:
    """`index.match` with numpy only, then in plain Python whenever the index allows it."""
    answers = []
    for postings in (-1, 10**9):
        monkeypatch.setattr(index_module, "SPARSE_POSTINGS", postings)
        match = index.match(normalize(text), lang, allowed=allowed, limit=8)
        answers.append(dataclasses.replace(match, seconds=0.0))
    return answers[0], answers[1]


# --- scoring ----------------------------------------------------------------------------------


def test_plain_python_scoring_equals_numpy_on_the_corpus(
    monkeypatch: pytest.MonkeyPatch, corpus_router: SemanticRouter, corpus_texts: list[str]
) -> None:
    index = corpus_router.index
    assert index is not None
    modules = sorted(corpus_router.profiles)
    allowed_sets = [None, frozenset(modules[::2]), frozenset(modules[1::3]), frozenset()]
    compared = 0
    for text in corpus_texts:
        for lang in ("zh", "en"):
            for allowed in allowed_sets:
                dense, sparse = _match_both_ways(monkeypatch, index, text, lang, allowed)
                assert sparse == dense, (text, lang, allowed)  # bit-identical floats
                compared += bool(dense.candidates)
    assert compared > 1000


def test_ties_go_to_the_first_module_and_its_first_example(
    monkeypatch: pytest.MonkeyPatch, analyzer: Analyzer
) -> None:
    twin = {"en": ["open the shop", "open the shop", "shop"]}
    profiles = [
        Profile("test:a", "read", {"en": ["view quests"]}),
        Profile("test:b", "read", twin),
        Profile("test:c", "read", twin),
    ]
    index = SemanticIndex.build(profiles, SemanticConfig(), analyzer)
    dense, sparse = _match_both_ways(monkeypatch, index, "open the shop", "en", None)
    assert sparse == dense
    assert [c.module_id for c in dense.candidates][:2] == ["test:b", "test:c"]
    assert dense.candidates[0].example_id == "test:b@en#0"
    assert dense.candidates[0].score == dense.candidates[1].score


def test_big_indexes_score_with_numpy_only(
    monkeypatch: pytest.MonkeyPatch, analyzer: Analyzer, corpus_texts: list[str]
) -> None:
    _, profiles = load_profiles(PROFILES)
    small = SemanticIndex.build(profiles, SemanticConfig(), analyzer)
    monkeypatch.setattr(index_module, "SPARSE_ROWS", 10)
    big = SemanticIndex.build(profiles, SemanticConfig(), analyzer)
    assert all(lang.posting_lists is None for lang in big._languages.values())
    assert all(lang.posting_lists is not None for lang in small._languages.values())
    monkeypatch.setattr(index_module, "SPARSE_POSTINGS", 10**9)  # asked, but not possible
    for text in corpus_texts[:200]:
        one = small.match(normalize(text), "en", limit=8)
        other = big.match(normalize(text), "en", limit=8)
        assert dataclasses.replace(one, seconds=0.0) == dataclasses.replace(other, seconds=0.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "a b", "<num>"]), max_size=12))
def test_feature_counts_are_counters_in_first_seen_order(items: list[str]) -> None:
    counts = index_module._count(tuple(items))
    assert list(counts.items()) == list(Counter(items).items())


# --- analysis ---------------------------------------------------------------------------------


class _Everything:
    def __contains__(self, item: object) -> bool:
        return True


def test_phrases_are_looked_up_only_where_one_starts(
    analyzer: Analyzer, corpus_texts: list[str]
) -> None:
    everywhere = Analyzer(analyzer.lexicon)
    everywhere._phrase_starts = _Everything()  # type: ignore[assignment]  # the old behaviour
    extra = ["sign in please", "please sign in and log in", "look up diamonds", "sign", "in"]
    assert analyzer._phrase_starts
    for text in [*corpus_texts, *extra]:
        assert analyzer.analyze(text) == everywhere.analyze(text), text


# --- the pipeline -----------------------------------------------------------------------------


def _router(semantic: SemanticConfig | None = None) -> tuple[Router, CatalogCache]:
    config = semantic or SemanticConfig()
    catalog = CatalogCache(None, 30, config, static=standalone_catalog(str(PROFILES), config))
    router = Router(
        catalog,
        IntentCache(config.cache_entries, config.cache_seconds, config.entries_per_player),
        ButtonMatcher(load_phrasings()),
        RouterDiagnostics(),
        None,
    )
    return router, catalog


def _player(level: int = 0, features: tuple[str, ...] = ()) -> common_pb2.PlayerContext:
    return common_pb2.PlayerContext(
        server_id="s", player_id="p", language="en", permission_level=level, features=features
    )


def test_allowed_modules_follow_permissions_features_and_the_catalogue() -> None:
    router, cache = _router()
    catalog = cache.current
    assert catalog is not None
    gated = catalog_pb2.ModuleDescriptor(module_id="test:gated", min_permission_level=2)
    owned = catalog_pb2.ModuleDescriptor(module_id="test:owned", owner_feature="quests")
    catalog.modules.update({"test:gated": gated, "test:owned": owned})
    for player in (_player(), _player(3), _player(0, ("quests",)), _player(3, ("quests",))):
        expected = {m.module_id for m in catalog.modules.values() if module_available(m, player)}
        assert router._allowed(catalog, player) == expected
        assert router._allowed(catalog, player) == expected  # remembered, unchanged
    assert "test:gated" not in router._allowed(catalog, _player())
    assert "test:owned" in router._allowed(catalog, _player(0, ("quests",)))
    replaced = dataclasses.replace(catalog, modules={"test:gated": gated})
    assert router._allowed(replaced, _player(3)) == {"test:gated"}  # a new catalogue: anew


async def test_routes_match_the_uncached_shortcuts_for_every_allowed_set() -> None:
    router, cache = _router()
    catalog = cache.current
    assert catalog is not None
    semantic = catalog.semantic
    players = [_player(), _player(3, ("quests",))]
    shortcut_cards = 0
    for text in ("tell me a joke", "推荐一个模组", "what is the weather like", "🙂"):
        for player in players:
            allowed = router._allowed(catalog, player)
            expected = [
                p.module_id
                for p in semantic.profiles.values()
                if p.is_shortcut and p.module_id in allowed
            ][:5]
            first = await router.route(router_pb2.RouteRequest(player=player, text=text))
            again = await router.route(router_pb2.RouteRequest(player=player, text=text))
            assert first == again
            cards = semantic.fallback_candidates(text, "en", allowed)
            assert [c.module_id for c in first.candidates] == [c.module_id for c in cards]
            if all(c.source == "shortcut" for c in cards):
                assert [c.module_id for c in cards] == expected
                shortcut_cards += 1
    assert shortcut_cards
    shortcuts = semantic.fallback_candidates("tell me a joke", "en", None)
    shortcuts.clear()  # a caller's list is its own
    assert semantic.fallback_candidates("tell me a joke", "en", None)


def test_prebuilt_actions_are_copied_into_responses() -> None:
    action = _bare_action("test:shortcut")
    assert action == common_pb2.ModuleAction(module_id="test:shortcut", input={})
    assert action.HasField("input")
    response = router_pb2.RouteResponse()
    response.candidates.extend([action])
    response.candidates[0].module_id = "changed"
    assert _bare_action("test:shortcut").module_id == "test:shortcut"


async def test_the_match_is_reported_even_when_it_saw_nothing() -> None:
    router, _ = _router()
    response = await router.route(router_pb2.RouteRequest(player=_player(), text="🙂"))
    assert response.HasField("local")
    assert response.source in (
        router_pb2.DECISION_SOURCE_LOCAL_FALLBACK,
        router_pb2.DECISION_SOURCE_NONE,
    )


# --- diagnostics ------------------------------------------------------------------------------


def test_checked_names_still_refuse_free_text() -> None:
    diagnostics = RouterDiagnostics()
    for _ in range(2):  # the second time from the remembered set
        diagnostics.record_gate("score")
        diagnostics.record_match("system:shop", "en", 0.9, 0.2, 0.9)
        diagnostics.record_decision(DecisionSource.LOCAL)
    bad: list[Any] = ["player typed this", ["score"], 3, "Score"]
    for gate in bad:
        with pytest.raises(ValueError):
            diagnostics.record_gate(gate)
    for module_id, language in [("free text", "en"), ("system:shop", "english!"), (["x"], "en")]:
        with pytest.raises(ValueError):
            diagnostics.record_match(module_id, language, 0.9, 0.2, 0.9)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        diagnostics.record_match("system:shop", "en", 1.5, 0.2, 0.9)  # numbers always checked
    snapshot = diagnostics.snapshot(
        mode="ENFORCE", status="ready", example_count=1, cache_entries=0
    )
    assert snapshot["failed_gates"] == {"score": 2}
    assert snapshot["decisions"]["LOCAL"] == 2
    assert diagnostics.counts()["LOCAL"] == 2
