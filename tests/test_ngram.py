"""The n-gram scorer (`router_service.semantic.ngram`) and scorer mode `ngram` (the default):
thresholds derived from the catalogue, exact leave-one-out, background chat rejected, writes and
guarded requests never direct, and the eval's threshold sweep and plot."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest
import scipy.sparse as sp

from router_service import eval as routing_eval
from router_service.eval import iter_cases
from router_service.semantic import (
    Analyzer,
    Profile,
    SemanticConfig,
    SemanticRouter,
    guards,
    load_profiles,
    ngram,
    normalize,
)
from router_service.semantic import router as semantic_router
from router_service.semantic.config import Scorer, parse_semantic_config
from router_service.semantic.guards import changes_state, directions, negates, opposite
from router_service.semantic.router import _scorer_covers

CORPUS = Path(__file__).resolve().parents[1] / "router_service" / "corpus"

# A second, unrelated catalogue (its own examples only), to show thresholds follow the catalogue.
WEATHER = [
    Profile(
        "demo:forecast",
        "read",
        {"en": ["weather tomorrow", "will it rain", "forecast for the week", "is it sunny"]},
    ),
    Profile(
        "demo:clock",
        "read",
        {"en": ["what time is it", "current time", "tell me the time", "time now please"]},
    ),
    Profile(
        "demo:timer",
        "read",
        {"en": ["start a timer", "timer for ten minutes", "countdown please", "new timer"]},
    ),
]


@pytest.fixture(scope="module")
def analyzer() -> Analyzer:
    return Analyzer()


@pytest.fixture(scope="module")
def profiles() -> list[Profile]:
    return load_profiles(CORPUS / "profiles.json")[1]


@pytest.fixture(scope="module")
def router(analyzer: Analyzer, profiles: list[Profile]) -> SemanticRouter:
    return SemanticRouter(profiles, SemanticConfig(), analyzer=analyzer)


def test_ngram_is_the_default_and_is_trained_per_language(router: SemanticRouter) -> None:
    assert SemanticConfig().scorer.mode == "ngram"
    assert router.ngram is not None and router.scorer is None
    assert set(router.ngram.languages) == {"zh", "en"}
    for lang in ("zh", "en"):
        model = router.ngram.model(lang)
        assert model is not None
        assert model.threshold == max(
            model.loo_threshold, model.background_threshold, ngram.MIN_MARGIN
        )
        assert model.background_kept > 100  # the shipped background texts took part


def test_thresholds_come_from_the_catalogue(analyzer: Analyzer, profiles: list[Profile]) -> None:
    """The same code derives different thresholds for different catalogues, and they are what
    the leave-one-out rule and the background rule give for that catalogue's own examples."""
    own = ngram.NgramScorer.train(profiles, ["en"], analyzer).model("en")
    other = ngram.NgramScorer.train(WEATHER, ["en"], analyzer).model("en")
    assert own is not None and other is not None
    assert own.loo_threshold != other.loo_threshold
    assert own.loo_threshold == ngram._loo_threshold(list(own.loo))
    assert len(own.loo) == sum(len(p.examples.get("en", ())) for p in profiles)
    # No background text at all: the background rule has nothing to say.
    bare = ngram.NgramScorer.train(WEATHER, ["en"], analyzer, background={}).model("en")
    assert bare is not None and bare.background_kept == 0
    assert bare.threshold == max(bare.loo_threshold, ngram.MIN_MARGIN)


def test_leave_one_out_equals_refitting_without_the_example(analyzer: Analyzer) -> None:
    model = ngram.NgramScorer.train(WEATHER, ["en"], analyzer, background={}).model("en")
    assert model is not None
    matrix = model.featurizer.matrix
    labels = [p.module_id for p in WEATHER for _ in p.examples["en"]]
    targets = -np.ones((len(labels), len(model.classes)))
    for row, label in enumerate(labels):
        targets[row, model.classes.index(label)] = 1.0
    for held in (0, 5, 11):
        keep = [i for i in range(len(labels)) if i != held]
        x = matrix[keep]
        gram = (x @ x.T).toarray()
        alpha = np.linalg.solve(gram + ngram.RIDGE * np.eye(len(keep)), targets[keep])
        scores = (matrix[held] @ x.T).toarray() @ alpha
        ordered = np.sort(scores.ravel())
        margin, right = model.loo[held]
        assert margin == pytest.approx(ordered[-1] - ordered[-2], abs=1e-9)
        assert right == (model.classes[int(scores.argmax())] == labels[held])


def test_a_paraphrase_routes_through_the_scorer(router: SemanticRouter) -> None:
    decision = router.decide("shop goods please", "en")
    assert decision.outcome == "direct" and decision.module_id == "system:shop"
    assert decision.route == "scorer" and decision.s1 < 0.9  # the seed's score gate failed
    assert decision.scorer_margin is not None and decision.scorer_threshold is not None
    assert decision.scorer_margin >= decision.scorer_threshold
    # The seed's own gates still route what they routed, and say so.
    assert router.decide("打开商店", "zh").route == "gates"


def test_the_scorer_rejects_background_chat(router: SemanticRouter) -> None:
    # Chat written for this test (not in background.json): never a direct route.
    for text, lang in [
        ("hello friend how are you", "en"),
        ("that creeper scared me lol", "en"),
        ("anyone up for a nether trip", "en"),
        ("what's the tallest mountain on earth", "en"),
        ("你好呀朋友", "zh"),
        ("今天天气不错", "zh"),
        ("刚才那个苦力怕吓死我了", "zh"),
        ("谁想一起去下界", "zh"),
    ]:
        decision = router.decide(text, lang)
        assert decision.outcome == "no_direct", (text, decision)


def test_background_the_catalogue_claims_is_left_out(analyzer: Analyzer) -> None:
    claimed = {"en": ["what time is it", "tell me the time", "hi there", "nice castle"]}
    model = ngram.NgramScorer.train(WEATHER, ["en"], analyzer, background=claimed).model("en")
    assert model is not None
    assert model.background_kept == 2  # the two time questions are the catalogue's own


def test_writes_and_guarded_requests_never_route_directly(router: SemanticRouter) -> None:
    for case in iter_cases(CORPUS / "cases.jsonl", split="all"):
        if case.category in ("write", "negation", "condition", "reference", "compound"):
            decision = router.decide(case.text, case.lang)
            assert decision.outcome != "direct", case
    # A write phrased like the scorer's own paraphrase of a read module does not route.
    assert router.decide("buy the shop goods please", "en").outcome == "no_direct"


def test_a_modules_own_phrasing_is_not_a_guard(router: SemanticRouter) -> None:
    # `有没有` is how the inbox's examples ask: its 没 is no negation there.
    assert router.decide("有没有新邮件", "zh").module_id == "system:inbox"
    assert router.decide("不要打开收件箱", "zh").gate_failed == "guard:negation"
    assert router.decide("没有新邮件就别打开", "zh").outcome == "no_direct"


def test_generic_words_need_not_be_in_the_examples(analyzer: Analyzer) -> None:
    model = ngram.NgramScorer.train(WEATHER, ["en"], analyzer).model("en")
    assert model is not None and "right" in model.generic
    sunny = analyzer.analyze("is it sunny right now")
    assert model.only_generic_unknown(sunny)
    assert model.topic_coverage(sunny, "demo:forecast") == 1.0
    paris = analyzer.analyze("is it sunny in paris")  # a content word no example has
    assert not model.only_generic_unknown(paris)
    assert model.topic_coverage(paris, "demo:forecast") == 0.5


def test_an_inflection_of_an_example_word_is_known_to_the_module(analyzer: Analyzer) -> None:
    forms = ngram.word_forms
    assert all("play" in forms(w) for w in ("playing", "played", "plays", "play"))
    assert forms("deleting") & forms("delete") and "stop" in forms("stopped")
    assert "try" in forms("tries") and forms("商店") == {"商店"}
    assert forms("class").isdisjoint(forms("clasp"))
    model = ngram.NgramScorer.train(WEATHER, ["en"], analyzer).model("en")
    assert model is not None
    raining = analyzer.analyze("is it raining")  # the examples say `rain`
    assert model.missing_words(raining, "demo:forecast") == set()
    assert model.topic_coverage(raining, "demo:forecast") == 1.0
    assert model.missing_words(raining, "demo:clock") == {"raining"}


def test_open_words_are_measured_on_the_modules_own_examples(analyzer: Analyzer) -> None:
    cities = Profile(
        "demo:city_weather",
        "read",
        {
            "en": [
                "weather in paris",
                "weather in rome",
                "weather for berlin",
                "weather in oslo",
                "weather in lima",
            ]
        },
    )
    model = ngram.NgramScorer.train([*WEATHER, cities], ["en"], analyzer).model("en")
    assert model is not None
    # Each example names a city the others lack: one word each, so one is allowed.
    assert model.open_words["demo:city_weather"] == 1
    # The fixed phrasings of the weather demo share their words less: none allowed.
    assert model.open_words["demo:clock"] == 0
    top = ngram.NgramScorer({"en": model}, 0.0).top(analyzer.analyze("weather in tokyo"), "en")
    assert top is not None and top.module_id == "demo:city_weather"
    assert (top.missing, top.open_words, top.content) == (1, 1, 2)
    assert top.missing_elsewhere == 0
    assert _scorer_covers(top, ["coverage", "topic_coverage"], 0.9)


def test_an_open_modules_unknown_word_must_be_unknown_to_the_catalogue(
    analyzer: Analyzer,
) -> None:
    """A word the module's examples lack but another module's examples hold is no open name:
    it is what the other module is asked with (`new` is the timer's word)."""
    cities = Profile(
        "demo:city_weather",
        "read",
        {"en": ["weather in paris", "weather in rome", "weather for berlin", "weather in oslo"]},
    )
    model = ngram.NgramScorer.train([*WEATHER, cities], ["en"], analyzer).model("en")
    assert model is not None and model.open_words["demo:city_weather"] == 1
    scorer = ngram.NgramScorer({"en": model}, 0.0)
    top = scorer.top(analyzer.analyze("weather in berlin new"), "en")
    assert top is not None and top.module_id == "demo:city_weather"
    assert top.margin >= top.threshold
    assert (top.missing, top.missing_elsewhere) == (1, 1)
    assert not _scorer_covers(top, ["coverage", "topic_coverage"], 0.9)


def test_only_a_rivals_word_counts_against_an_open_module(analyzer: Analyzer) -> None:
    """A word the routed module's examples lack counts as another module's evidence only where a
    module scored next to it for this text holds it (`ngram.RIVALS`, issue 17 round 8): `week`
    in calendar, list and alarm examples does not stop `what movies are playing this week`
    while the song and game modules are the movie module's rivals, and does stop `movies
    playing this week`, where the alarm module is one."""
    catalogue = [
        Profile(
            "demo:movies",
            "read",
            {
                "en": [
                    "movies playing near me",
                    "what movies are showing in paris",
                    "movies with tom hanks",
                    "cartoon movies for kids",
                ]
            },
        ),
        Profile(
            "demo:song",
            "read",
            {
                "en": [
                    "what song is playing",
                    "what is playing now",
                    "name of the song playing",
                    "who is playing this song",
                ]
            },
        ),
        Profile(
            "demo:game",
            "read",
            {
                "en": [
                    "who is playing tonight",
                    "what game is playing",
                    "score of the game playing",
                    "which teams are playing",
                ]
            },
        ),
        Profile(
            "demo:calendar",
            "read",
            {"en": ["my meetings", "calendar for next week", "what is on my calendar", "lunch"]},
        ),
        Profile(
            "demo:lists",
            "read",
            {"en": ["my shopping list", "groceries for the week", "what is on my list", "lists"]},
        ),
        Profile(
            "demo:alarm",
            "read",
            {"en": ["alarms this week", "my alarms", "when is my alarm", "alarm for six"]},
        ),
    ]
    model = ngram.NgramScorer.train(catalogue, ["en"], analyzer).model("en")
    assert model is not None and model.open_words["demo:movies"] >= 1
    scorer = ngram.NgramScorer({"en": model}, 0.0)
    top = scorer.top(analyzer.analyze("what movies are playing this week"), "en")
    assert top is not None and top.module_id == "demo:movies"
    assert (top.missing, top.missing_elsewhere) == (1, 0)
    assert _scorer_covers(top, ["coverage", "topic_coverage"], 0.9)
    rival = scorer.top(analyzer.analyze("movies playing this week"), "en")
    assert rival is not None and rival.module_id == "demo:movies"
    assert (rival.missing, rival.missing_elsewhere) == (1, 1)
    assert not _scorer_covers(rival, ["coverage", "topic_coverage"], 0.9)


def test_the_built_in_modules_allow_no_unknown_words_but_an_items_name(
    router: SemanticRouter,
) -> None:
    """Every built-in module routing directly is asked in fixed words, but the item lookup,
    asked about an item by name (`火把怎么合成`: the name is the one word its examples need
    not hold)."""
    allowed = {("system:item", "zh"): 1}
    for lang in ("zh", "en"):
        model = router.ngram.model(lang)
        assert model is not None
        for module_id, profile in router.profiles.items():
            if profile.routes_directly and module_id in model.open_words:
                expected = allowed.get((module_id, lang), 0)
                assert model.open_words[module_id] == expected, (module_id, lang)


def test_each_built_in_example_routes_to_its_module_when_typed(router: SemanticRouter) -> None:
    """A module's own examples, typed as written (punctuation and case aside), route to it,
    even the two the seed's gates stop: `what can you do` reads as small talk's `how are you`
    (both only a question word to the lexicon), and `我的信息` holds no topic word."""
    stopped = []
    for profile in router.profiles.values():
        if not profile.routes_directly:
            continue
        for lang, examples in profile.examples.items():
            for example in examples:
                for typed in (example, example.upper() + "?"):
                    decision = router.decide(typed, lang)
                    if (decision.outcome, decision.module_id) != ("direct", profile.module_id):
                        stopped.append((profile.module_id, typed))
    assert stopped == []
    assert router.decide("What can you do?", "en").route == "example"
    assert router.decide("我的信息", "zh").route == "example"


def test_an_example_two_profiles_hold_routes_by_the_gates_alone() -> None:
    """A text that is an example of two profiles (here a module and small talk) says nothing
    about which one it means: it gets no route of its own."""
    profiles = [
        Profile("demo:help", "read", {"en": ("what can you do", "show help", "list commands")}),
        Profile("demo:talk", "reject", {"en": ("what can you do", "how are you", "hello")}),
        Profile("demo:shop", "read", {"en": ("open the shop", "show the shop", "shop items")}),
    ]
    router = SemanticRouter(profiles, SemanticConfig())
    decision = router.decide("what can you do", "en")
    assert decision.route != "example"
    assert router.decide("show help", "en").module_id == "demo:help"
    assert router.decide("what can you do", "en", allowed={"demo:shop"}).outcome != "direct"


def test_a_bare_number_never_routes(router: SemanticRouter) -> None:
    for text, lang in [("666", "zh"), ("3", "en"), ("minecraft:diamond", "en"), ("第2个", "zh")]:
        decision = router.decide(text, lang)
        assert (decision.outcome, decision.gate_failed) == ("no_direct", "no_words"), text


def test_the_scorer_respects_profiles_and_allowed(router: SemanticRouter) -> None:
    assert router.decide("shop goods please", "en", allowed={"system:help"}).outcome != "direct"
    for profile in router.profiles.values():
        if not profile.routes_directly:
            for lang, examples in profile.examples.items():
                for text in examples:
                    assert router.decide(text, lang).module_id != profile.module_id


def test_offset_moves_the_threshold_live(router: SemanticRouter) -> None:
    config = router.config
    try:
        stricter = dataclasses.replace(config, scorer=Scorer("ngram", offset=1.0))
        assert router.apply_config(stricter) == ["scorer: applies live"]
        decision = router.decide("shop goods please", "en")
        assert decision.outcome == "no_direct" and decision.gate_failed == "score"
        assert router.decide("打开商店", "zh").outcome == "direct"  # the seed's gates remain
    finally:
        router.apply_config(config)
    parsed = parse_semantic_config({"scorer": {"offset": -0.2}})
    assert parsed.scorer == Scorer("ngram", 0.8, -0.2)


def test_gates_mode_trains_no_ngram_scorer(analyzer: Analyzer, profiles: list[Profile]) -> None:
    gates = SemanticRouter(profiles, SemanticConfig(scorer=Scorer("gates")), analyzer=analyzer)
    assert gates.ngram is None
    decision = gates.decide("shop goods please", "en")
    assert decision.outcome == "no_direct" and decision.scorer_module is None


def test_features_mix_words_and_characters(analyzer: Analyzer) -> None:
    featurizer = ngram.NgramFeaturizer([analyzer.analyze(normalize("查看商店 open shop"))])
    features = set(featurizer.vocabulary)
    assert {"c:商", "c:商店", "c:查看商", "c: op", "c:shop", "c:op"} <= features
    assert any(f.startswith("w:") for f in features)
    columns, values = featurizer.row(analyzer.analyze(normalize("查看商店 open shop")))
    assert sum(v * v for v in values) == pytest.approx(1.0)
    # Unknown content keeps its weight in the norm: the known part of the row shrinks.
    _, partial = featurizer.row(analyzer.analyze(normalize("查看商店 open shop 龙蛋")))
    assert sum(v * v for v in partial) < 1.0


def test_eval_writes_the_plot_and_the_sweep(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    profiles = tmp_path / "profiles.json"
    profiles.write_text(
        json.dumps(
            {
                "language": "en",
                "modules": [
                    {"id": p.module_id, "examples": {"en": list(p.examples["en"])}} for p in WEATHER
                ],
            }
        ),
        encoding="utf-8",
    )
    cases = tmp_path / "cases.jsonl"
    lines = [
        {"text": "weather for tomorrow please", "expected": "demo:forecast"},
        {"text": "what is the time now", "expected": "demo:clock"},
        {"text": "timer ten minutes", "expected": "demo:timer"},
        {"text": "sing me a song", "expected": None},
    ]
    cases.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    plot, report = tmp_path / "plot.png", tmp_path / "report.json"
    code = routing_eval.main(
        [
            "--profiles",
            str(profiles),
            "--cases",
            str(cases),
            "--plot",
            str(plot),
            "--json",
            str(report),
            "--no-progress",
        ]
    )
    assert code == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads(report.read_text(encoding="utf-8"))
    assert document["sweep"]["parameter"] == "scorer.offset"
    assert document["sweep"]["shipped"] == 0.0
    assert len(document["sweep"]["points"]) > 10
    assert set(document["scorer_thresholds"]) == {"en"}


def test_a_catalogue_beyond_the_scorers_size_routes_with_the_gates_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from router_service.semantic import ngram

    examples = [
        ("test:a", ["open the shop", "browse the store"]),
        ("test:b", ["show my mail", "read my inbox"]),
    ]
    texts = [t for _, ts in examples for t in ts]
    labels = [m for m, ts in examples for _ in ts]
    analyzer = ngram.Analyzer()
    assert ngram._fit_language(texts, labels, [], analyzer) is not None
    monkeypatch.setattr(ngram, "MAX_EXAMPLES", 3)
    assert ngram._fit_language(texts, labels, [], analyzer) is None


def test_a_catalogue_beyond_the_fits_size_is_fitted_in_chunks_that_hold_every_example(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More examples than one closed-form fit takes (a 100-shot catalogue): the fit is the mean
    of fits on chunks of at most `per_class` of each module, which together hold every example
    (its features and leave-one-out margins too); with fewer than `MIN_FITTED` of each module
    in a chunk, the gates alone route."""
    from router_service.semantic import ngram

    examples = [
        ("test:a", ["open the shop", "open the shop today", "browse the store"]),
        ("test:b", ["show my mail", "show my mail today", "read my inbox"]),
    ]
    texts = [t for _, ts in examples for t in ts]
    labels = [m for m, ts in examples for _ in ts]
    analyzer = ngram.Analyzer()
    assert ngram._per_class([3, 3], 4) == 2 and ngram._per_class([3, 3], 6) is None
    assert ngram._per_class([1, 5, 9], 10) == 4  # the class of 1 keeps it; 4 each for the rest
    monkeypatch.setattr(ngram, "MAX_EXAMPLES", 4)
    monkeypatch.setattr(ngram, "MIN_FITTED", 2)
    model = ngram._fit_language(texts, labels, [], analyzer)
    assert model is not None
    assert len(model.loo) == 6  # every example has its leave-one-out margin
    assert model.chunks == 2  # two of each module in a chunk: three examples need two
    assert "w:today" in model.featurizer.vocabulary
    assert "today" in model.unigrams["test:a"] and "inbox" in model.unigrams["test:b"]
    monkeypatch.setattr(ngram, "MIN_FITTED", 3)
    assert ngram._fit_language(texts, labels, [], analyzer) is None


def test_chunks_deal_each_modules_examples_round_them() -> None:
    from router_service.semantic import ngram

    labels = ["a"] * 7 + ["b"] * 2 + ["c"] * 4
    chunks = ngram._chunks(labels, 3)
    assert len(chunks) == 3  # the 7 of `a` need three chunks of 3
    assert set().union(*chunks) == set(range(len(labels)))  # every example is fitted
    for chunk in chunks:
        held = [labels[i] for i in chunk]
        assert held.count("a") == 3 and held.count("c") == 3
        assert [i for i in chunk if labels[i] == "b"] == [7, 8]  # 2 fit whole, in every chunk
    # Dealt, not cut: a catalogue that lists one phrasing after another spreads each of them.
    assert [i for i in chunks[0] if labels[i] == "a"] == [0, 3, 6]
    assert [i for i in chunks[1] if labels[i] == "a"] == [1, 2, 4]
    assert [i for i in chunks[2] if labels[i] == "a"] == [0, 2, 5]


def test_chunked_leave_one_out_equals_refitting_the_chunks_without_the_example() -> None:
    """Each example's leave-one-out scores are the mean fit's, every chunk that holds it
    refitted without it, and the weights the mean of the chunks' fits."""
    from router_service.semantic import ngram

    rng = np.random.default_rng(3)
    dense = rng.random((9, 12)) * (rng.random((9, 12)) < 0.4)
    matrix = sp.csr_matrix(dense / np.maximum(np.linalg.norm(dense, axis=1), 1e-9)[:, None])
    labels = [0, 0, 0, 0, 1, 1, 1, 2, 2]
    targets = -np.ones((9, 3))
    targets[np.arange(9), labels] = 1.0
    chunks = ngram._chunks([str(y) for y in labels], 2)
    weights, loo = ngram._ridge(matrix, targets, chunks)

    def fit(rows: list[int]) -> np.ndarray:
        x = matrix[rows].toarray()
        alpha = np.linalg.solve(x @ x.T + ngram.RIDGE * np.eye(len(rows)), targets[rows])
        return np.asarray(x.T @ alpha)

    np.testing.assert_allclose(weights, np.mean([fit(c) for c in chunks], axis=0), atol=1e-10)
    for i in range(9):
        refitted = np.mean([fit([j for j in c if j != i]) for c in chunks], axis=0)
        np.testing.assert_allclose(loo[i], matrix[i].toarray()[0] @ refitted, atol=1e-10)


def test_a_change_module_takes_no_text_without_a_change_word(analyzer: Analyzer) -> None:
    """A module whose examples are phrased with a state-changing word (`delete`, `remove`) is
    not reached by the scorer without one: `my events tomorrow` is a read of a sibling it lacks."""
    removal = Profile(
        "demo:event_remove",
        "read",
        {
            "en": [
                "delete my event",
                "remove the meeting event",
                "delete the event tomorrow",
                "remove my dentist event",
                "clear my events",
            ]
        },
    )
    config = SemanticConfig(scorer=Scorer("ngram", 0.8, -1.0))  # threshold out of the way
    router = SemanticRouter([*WEATHER, removal], config, analyzer=analyzer)
    assert router._meanings[("demo:event_remove", "en")] == (changes_state,)
    assert ("demo:clock", "en") not in router._meanings
    # Removing is a direction too (`add` / `remove`): that rule is tested on its own below.
    router._directions = MappingProxyType({})
    read = router.decide("my events tomorrow", "en")
    assert read.scorer_module == "demo:event_remove"
    assert read.outcome == "no_direct"
    # The rule is what stops it: without it the scorer would route the read there.
    unguarded = SemanticRouter([*WEATHER, removal], config, analyzer=analyzer)
    unguarded._meanings = unguarded._directions = MappingProxyType({})
    assert unguarded.decide("my events tomorrow", "en").outcome == "direct"
    # With the module's own change word it still reaches the module.
    change = router.decide("delete my events for tomorrow", "en")
    assert change.outcome == "direct" and change.module_id == "demo:event_remove"


def test_a_negating_module_takes_no_text_without_a_negation(analyzer: Analyzer) -> None:
    """A module most of whose examples say no (`不对`, `not`) is not reached by the scorer from
    a text that says none: `你理解对了我的意思` (you understood what I meant) is the request of an affirming
    sibling the catalogue lacks (issue 17, round 14)."""
    negating = Profile(
        "demo:negate",
        "read",
        {
            "zh": [
                "不对，你理解错了",
                "你理解得不对",
                "我不是这个意思",
                "没听懂我的意思",
                "你弄错了",
            ]
        },
    )
    forecast = Profile(
        "demo:forecast_zh",
        "read",
        {"zh": ["明天天气怎么样", "今天会下雨吗", "这周的天气预报", "外面冷不冷", "今天出太阳吗"]},
    )
    catalogue = [forecast, negating]
    config = SemanticConfig(scorer=Scorer("ngram", 0.8, -1.0))  # threshold out of the way
    router = SemanticRouter(catalogue, config, analyzer=analyzer)
    assert router._meanings[("demo:negate", "zh")] == (negates,)  # 4 of 5 negate
    assert ("demo:forecast_zh", "zh") not in router._meanings  # 1 of 5 (`冷不冷`)
    affirming = router.decide("你理解对了我的意思", "zh")
    assert affirming.scorer_module == "demo:negate"
    assert affirming.outcome == "no_direct"
    unguarded = SemanticRouter(catalogue, config, analyzer=analyzer)
    unguarded._meanings = MappingProxyType({})
    assert unguarded.decide("你理解对了我的意思", "zh").outcome == "direct"
    # A text that says no still reaches it.
    denial = router.decide("你理解得不对，我不是这个意思", "zh")
    assert (denial.outcome, denial.route, denial.module_id) == ("direct", "scorer", "demo:negate")
    # Under the share (3 of 5) the module is not a negating one.
    fewer = Profile("demo:negate", "read", {"zh": [*negating.examples["zh"][1:], "错了"]})
    assert ("demo:negate", "zh") not in SemanticRouter(
        [forecast, fewer], config, analyzer=analyzer
    )._meanings


def test_a_module_asked_in_one_direction_takes_no_text_saying_the_opposite(
    analyzer: Analyzer,
) -> None:
    """A module most of whose examples say one direction (`down`, `decrease`, `lower`) is not
    reached by the scorer from a text saying the other (`turn the volume up`): that is the
    request of a sibling the catalogue lacks (issue 17, round 7)."""
    lower = Profile(
        "demo:volume_down",
        "read",
        {
            "en": [
                "volume down",
                "turn the music down",
                "decrease the volume",
                "lower the volume please",
                "make the speaker quieter",
            ]
        },
    )
    config = SemanticConfig(scorer=Scorer("ngram", 0.8, -1.0))  # threshold out of the way
    router = SemanticRouter([*WEATHER, lower], config, analyzer=analyzer)
    assert router._directions[("demo:volume_down", "en")].usual == {"en0-"}
    assert directions("Increased the volume") == {"en0+"}  # any inflection
    assert opposite("en0-") == "en0+"
    # Chinese poles: `静音` (mute) is not the `静音` of `取消静音` or `取消音箱静音` (unmute);
    # to mute says `down` too, to unmute `up` (`_IMPLIED`).
    mute, unmute = directions("把音箱静音"), directions("取消静音")
    assert len(mute) == len(unmute) == 2 and {opposite(pole) for pole in mute} == unmute
    assert directions("现在取消音箱静音") == unmute
    assert directions("音量调低一点") < mute and directions("把音量调大") < unmute
    assert directions("音量调低一点") == {opposite(next(iter(directions("音量调高"))))}
    assert directions("下一首歌") and directions("这个亮点是什么") == frozenset()
    up = router.decide("turn the volume up on the speaker", "en")
    assert up.scorer_module == "demo:volume_down"
    assert up.outcome == "no_direct"
    # The rule is what stops it: without it the scorer would route the text there.
    unguarded = SemanticRouter([*WEATHER, lower], config, analyzer=analyzer)
    unguarded._directions = MappingProxyType({})
    assert unguarded.decide("turn the volume up on the speaker", "en").outcome == "direct"
    # Its own direction still reaches it.
    decision = router.decide("turn the speaker volume down", "en")
    assert decision.outcome == "direct" and decision.module_id == "demo:volume_down"


def test_a_module_asked_in_a_direction_takes_no_text_saying_none_of_its_poles(
    analyzer: Analyzer,
) -> None:
    """A module nearly all of whose examples say a direction (`dim`, `lower`, `down`) is not
    reached by the scorer from a text that says none of their poles: `make the lights pink` is
    a colour-changing sibling's request, `turn the lights off` a light-off one's (issue 17,
    round 14). A module fewer of whose examples say one still takes such a text."""
    examples = [
        "dim the living room lights",
        "please turn the lights down",
        "lower the light level in my house",
        "darken the lights in the kitchen",
        "make the kitchen lights dimmer",
    ]
    config = SemanticConfig(scorer=Scorer("ngram", 0.8, -1.0))  # threshold out of the way
    dimming = Profile("demo:lights_dim", "read", {"en": examples})
    router = SemanticRouter([*WEATHER, dimming], config, analyzer=analyzer)
    assert router._directions[("demo:lights_dim", "en")].directed
    for text in ("make the kitchen lights pink", "turn the kitchen lights off"):
        decision = router.decide(text, "en")
        assert decision.scorer_module == "demo:lights_dim", text
        assert decision.outcome == "no_direct", text
    unguarded = SemanticRouter([*WEATHER, dimming], config, analyzer=analyzer)
    unguarded._directions = MappingProxyType({})
    assert unguarded.decide("make the kitchen lights pink", "en").outcome == "direct"
    own = router.decide("the living room lights dimmer please", "en")
    assert (own.outcome, own.module_id) == ("direct", "demo:lights_dim")
    # 3 of 5 examples saying a direction: under `DIRECTED_SHARE`, the colour text routes.
    fewer = Profile(
        "demo:lights_dim", "read", {"en": [*examples[:3], "the lights in the kitchen", "my lights"]}
    )
    loose = SemanticRouter([*WEATHER, fewer], config, analyzer=analyzer)
    assert not loose._directions[("demo:lights_dim", "en")].directed
    assert loose.decide("make the kitchen lights pink", "en").outcome == "direct"


def test_to_mute_is_to_turn_the_volume_down(
    analyzer: Analyzer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A volume-up module (one of whose examples unmutes) takes no scorer route from a text that
    mutes, in either language: that is the request of a mute module the catalogue lacks
    (issue 17, round 12: `音箱静音` reached volume-up when volume-mute was held out)."""
    louder = Profile(
        "demo:volume_up",
        "read",
        {
            "en": [
                "volume up",
                "turn the speaker volume up",
                "increase the volume",
                "make the speaker louder",
                "unmute the speaker",
            ],
            "zh": ["音量调大", "把音箱音量调高", "大声一点", "请把音量调大一点", "取消音箱静音"],
        },
    )
    chinese = {  # the catalogue's other modules in Chinese too
        "demo:forecast": ["明天天气怎么样", "会下雨吗", "这周的天气预报", "今天是晴天吗"],
        "demo:clock": ["现在几点", "告诉我时间", "现在是什么时间", "几点了"],
    }
    catalogue = [
        dataclasses.replace(p, examples={**p.examples, "zh": tuple(chinese[p.module_id])})
        if p.module_id in chinese
        else p
        for p in [*WEATHER, louder]
    ]
    config = SemanticConfig(scorer=Scorer("ngram", 0.8, -1.0))  # threshold out of the way
    router = SemanticRouter(catalogue, config, analyzer=analyzer)
    muting = {"en": "mute the speaker volume", "zh": "把音箱音量静音"}
    for lang, text in muting.items():
        decision = router.decide(text, lang)
        assert decision.scorer_module == "demo:volume_up", text
        assert decision.outcome == "no_direct", text
    for lang, text in {"en": "turn the speaker volume up", "zh": "把音箱音量调大"}.items():
        decision = router.decide(text, lang)  # its own direction still reaches it
        assert decision.outcome == "direct" and decision.module_id == "demo:volume_up", text
    # What stops the Chinese text is that muting says `down`: without it the text says no
    # pole, which a module asked in a direction takes no text of (`DIRECTED_SHARE`), and
    # without that rule either the module's `取消音箱静音` holds the text's words and the text
    # goes through. (The English one would stay out all the same: `unmute` does not hold its
    # word `mute`.)
    monkeypatch.setattr(guards, "_IMPLIED", {})
    assert (
        SemanticRouter(catalogue, config, analyzer=analyzer).decide(muting["zh"], "zh").outcome
        == "no_direct"
    )
    monkeypatch.setattr(semantic_router, "DIRECTED_SHARE", 2.0)
    alone = SemanticRouter(catalogue, config, analyzer=analyzer)
    assert alone.decide(muting["zh"], "zh").outcome == "direct"


def test_a_word_one_example_only_modifies_covers_no_word_of_a_text(
    analyzer: Analyzer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Chinese word that one example of a module holds only as a modifier (`灯` of
    `打开灯的插座`, the lamp's socket) is not the module's topic: `打开灯` (turn on the light) is
    not a smart-socket request, whatever the scorer ranks first (issue 17, round 12)."""
    assert analyzer.analyze("打开灯的插座").modifiers == {"灯"}
    assert analyzer.analyze("我的闹钟").modifiers == frozenset()  # a stopword is no topic
    socket = Profile(
        "demo:socket_on",
        "read",
        {"zh": ["打开智能插座", "请打开我的智能插座", "打开灯的插座", "把插座打开", "插座开"]},
    )
    forecast = Profile("demo:forecast", "read", {"zh": ["明天天气怎么样", "会下雨吗", "天气预报"]})
    config = SemanticConfig(scorer=Scorer("ngram", 0.8, -1.0))  # threshold out of the way
    router = SemanticRouter([socket, forecast], config, analyzer=analyzer)
    light = router.decide("打开灯", "zh")
    assert light.scorer_module == "demo:socket_on"
    assert light.outcome == "no_direct"
    own = router.decide("打开插座", "zh")
    assert own.outcome == "direct" and own.module_id == "demo:socket_on"
    # The rule is what stops it: with the modifier counted, the text goes through.
    monkeypatch.setattr(ngram, "_only_modifying", lambda examples: set())
    counted = SemanticRouter([socket, forecast], config, analyzer=analyzer)
    assert counted.decide("打开灯", "zh").outcome == "direct"
