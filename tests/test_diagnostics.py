"""Router diagnostics: counting, the snapshot, and that no text or player id can get in."""

from __future__ import annotations

import enum
import inspect
import threading

import pytest

from router_service.diagnostics import DecisionSource, RouterDiagnostics


class Reason(enum.Enum):
    NO_MODEL = "no_model"
    LOW_SCORE = "low_score"


class Gate(enum.Enum):
    MARGIN = 1
    NEGATION = 2


def test_counts_per_source_reason_and_gate() -> None:
    diagnostics = RouterDiagnostics()
    diagnostics.record_decision(DecisionSource.LOCAL)
    diagnostics.record_decision(DecisionSource.LOCAL)
    diagnostics.record_decision(
        DecisionSource.LOCAL_FALLBACK, reason=Reason.NO_MODEL, failed_gate=Gate.MARGIN
    )
    diagnostics.record_decision(DecisionSource.MODEL, failed_gate=Gate.NEGATION)
    diagnostics.record_decision(DecisionSource.MODEL, failed_gate=Gate.MARGIN)
    counts = diagnostics.counts()
    assert counts["LOCAL"] == 2
    assert counts["MODEL"] == 2
    assert counts["LOCAL_FALLBACK"] == 1
    assert counts["CACHE"] == 0
    assert set(counts) == {s.value for s in DecisionSource}
    snapshot = diagnostics.snapshot(
        mode="ENFORCE", status="READY", example_count=1, cache_entries=0
    )
    assert snapshot["fallback_reasons"] == {"NO_MODEL": 1}
    assert snapshot["failed_gates"] == {"MARGIN": 2, "NEGATION": 1}


def test_snapshot_contents() -> None:
    diagnostics = RouterDiagnostics()
    assert (
        diagnostics.snapshot(mode="OFF", status="DISABLED", example_count=0, cache_entries=0)[
            "last_match"
        ]
        is None
    )
    diagnostics.record_decision(DecisionSource.SHADOW_DIRECT)
    diagnostics.record_match("system:shop", "zh", 0.93, 0.4, 1.0)
    diagnostics.record_match("system:help", "en", 0.95, 0.2, 0.9)  # replaces the first
    snapshot = diagnostics.snapshot(
        mode="SHADOW", status="READY", example_count=120, cache_entries=7
    )
    assert snapshot == {
        "algorithm": "lexical-tfidf-v1",
        "mode": "SHADOW",
        "status": "READY",
        "example_count": 120,
        "cache_entries": 7,
        "decisions": {s.value: int(s is DecisionSource.SHADOW_DIRECT) for s in DecisionSource},
        "fallback_reasons": {},
        "failed_gates": {},
        "last_match": {
            "module_id": "system:help",
            "language": "en",
            "score": 0.95,
            "margin": 0.2,
            "coverage": 0.9,
            "candidates": (),
            "gate": "",
        },
    }
    custom = diagnostics.snapshot(
        algorithm="lexical-tfidf-v2",
        mode="ENFORCE",
        status="READY",
        example_count=1,
        cache_entries=0,
    )
    assert custom["algorithm"] == "lexical-tfidf-v2"
    diagnostics.reset()
    assert diagnostics.last_match is None
    assert sum(diagnostics.counts().values()) == 0


def test_api_takes_no_text_or_player_parameters() -> None:
    forbidden = {"text", "player", "player_id", "uuid", "query", "message", "name"}
    for name, member in inspect.getmembers(RouterDiagnostics, inspect.isfunction):
        if name.startswith("_"):
            continue
        parameters = set(inspect.signature(member).parameters)
        assert not parameters & forbidden, name


@pytest.mark.parametrize(
    "module_id",
    ["where do I get diamonds", "我想看商店", "system:shop please", "SYSTEM:SHOP", "", "x" * 300],
)
def test_free_text_cannot_pose_as_a_module_id(module_id: str) -> None:
    diagnostics = RouterDiagnostics()
    with pytest.raises(ValueError, match="module_id"):
        diagnostics.record_match(module_id, "en", 0.9, 0.2, 0.9)
    assert diagnostics.last_match is None


@pytest.mark.parametrize("language", ["open the shop", "中文", "e", "0123e4567-e89b"])
def test_free_text_cannot_pose_as_a_language(language: str) -> None:
    with pytest.raises(ValueError, match="language"):
        RouterDiagnostics().record_match("system:shop", language, 0.9, 0.2, 0.9)


@pytest.mark.parametrize("value", [float("nan"), -0.1, 1.5, float("inf")])
def test_scores_are_bounded(value: float) -> None:
    with pytest.raises(ValueError, match="within 0..1"):
        RouterDiagnostics().record_match("system:shop", "en", value, 0.2, 0.9)


def test_reasons_must_be_enum_members() -> None:
    diagnostics = RouterDiagnostics()
    with pytest.raises(TypeError, match="enum member"):
        diagnostics.record_decision(DecisionSource.NONE, reason="player typed this")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enum member"):
        diagnostics.record_decision(DecisionSource.NONE, failed_gate="550e8400-e29b")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        diagnostics.record_decision("free text")  # type: ignore[arg-type]
    assert sum(diagnostics.counts().values()) == 0


def test_concurrent_counting_loses_nothing() -> None:
    diagnostics = RouterDiagnostics()

    def worker() -> None:
        for _ in range(1000):
            diagnostics.record_decision(DecisionSource.CACHE, reason=Reason.LOW_SCORE)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert diagnostics.counts()["CACHE"] == 8000
    snapshot = diagnostics.snapshot(
        mode="ENFORCE", status="READY", example_count=0, cache_entries=0
    )
    assert snapshot["fallback_reasons"] == {"LOW_SCORE": 8000}


def test_the_last_match_keeps_its_top_candidates_and_gate_and_no_text() -> None:
    diagnostics = RouterDiagnostics()
    diagnostics.record_match(
        "system:shop",
        "zh",
        0.8,
        0.1,
        0.95,
        [("system:shop", 0.8), ("system:item", 0.7), ("system:help", 0.2), ("system:mail", 0.1)],
        "margin",
    )
    last = diagnostics.snapshot(mode="ENFORCE", status="ready", example_count=1, cache_entries=0)[
        "last_match"
    ]
    assert last["candidates"] == (
        ("system:shop", 0.8),
        ("system:item", 0.7),
        ("system:help", 0.2),
    )
    assert last["gate"] == "margin"
    with pytest.raises(ValueError):
        diagnostics.record_match("system:shop", "zh", 0.8, 0.1, 0.9, [("打开商店", 0.8)])
    with pytest.raises(ValueError):
        diagnostics.record_match("system:shop", "zh", 0.8, 0.1, 0.9, (), "open the shop")
