"""The labelled routing corpus and the eval command (`python -m router_service.eval`).

The corpus checks are pure data checks. The eval's figures are checked on a tiny profile set
with the real matcher when `router_service.semantic` is importable, and with a stub that
returns fixed decisions when it is not, so the arithmetic is tested either way.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import unicodedata
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from router_service import eval as ev
from router_service.semantic.profiles import EXTRACTOR_NAMES

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "router_service" / "corpus"
PROFILES = CORPUS / "profiles.json"
CASES = CORPUS / "cases.jsonl"
CATEGORIES = {
    "plain",
    "paraphrase",
    "typo",
    "mixed_script",
    "out_of_scope",
    "write",
    "negation",
    "condition",
    "reference",
    "compound",
}
NEVER_DIRECT = {"out_of_scope", "write", "negation", "condition", "reference", "compound"}

try:
    from router_service.semantic import SemanticRouter  # noqa: F401

    REAL_MATCHER = True
except ImportError:
    REAL_MATCHER = False


def _profiles() -> dict[str, Any]:
    return json.loads(PROFILES.read_text(encoding="utf-8"))


def _rows() -> list[dict[str, Any]]:
    with CASES.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _norm(text: str) -> str:
    """Case, width, punctuation and emoji folded away: what a matcher would compare."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.sub(r"[^\w:\u4e00-\u9fff]+", " ", text).split())


# --- the shipped profile set and corpus -------------------------------------------------------


def test_profile_set_has_the_builtin_modules_in_the_standalone_format() -> None:
    doc = _profiles()
    assert doc["language"] == "zh"
    ids = [m["id"] for m in doc["modules"]]
    assert len(ids) == len(set(ids))
    kinds = {m["id"]: m["kind"] for m in doc["modules"]}
    assert {i for i, k in kinds.items() if k == "read"} == {
        "system:help",
        "system:history",
        "system:settings",
        "system:inventory",
        "system:profile",
        "system:inbox",
        "system:shop",
        "system:item",
        "system:quests",
        "system:quest_detail",
    }
    assert {i for i, k in kinds.items() if k == "hints"} == {
        "system:signin",
        "system:shop_buy",
        "system:pay",
    }
    assert "reject" in kinds.values()
    for module in doc["modules"]:
        assert module["extractor"] in (None, *EXTRACTOR_NAMES), module["id"]
        # Only read profiles may route directly; writes and chit-chat never do.
        assert module["direct"] is (module["kind"] == "read"), module["id"]
        for lang in ("zh", "en"):
            assert 8 <= len(module["examples"][lang]) <= 15, (module["id"], lang)
    if REAL_MATCHER:  # the matcher's own loader accepts it and agrees on what may go direct
        from router_service.semantic import load_profiles

        language, profiles = load_profiles(PROFILES)
        assert language == "zh"
        assert {p.module_id for p in profiles if p.routes_directly} == {
            i for i, k in kinds.items() if k == "read"
        }


def test_corpus_is_large_balanced_and_labelled_against_the_profile_set() -> None:
    rows = _rows()
    assert len(rows) >= 800
    langs = Counter(r["lang"] for r in rows)
    assert set(langs) == {"zh", "en"}
    assert abs(langs["zh"] - langs["en"]) <= 0.05 * len(rows)
    readable = {m["id"] for m in _profiles()["modules"] if m["kind"] == "read" and m["direct"]}
    for r in rows:
        assert set(r) == {"text", "lang", "expected", "category", "split"}, r
        assert r["category"] in CATEGORIES, r
        assert r["split"] in ("tune", "test"), r
        assert r["expected"] is None or r["expected"] in readable, r
        if r["category"] in NEVER_DIRECT:
            assert r["expected"] is None, r
    present = {(r["lang"], r["category"]) for r in rows}
    assert present == {(lang, c) for lang in ("zh", "en") for c in CATEGORIES}
    # Every direct-capable module is expected somewhere, in both languages.
    assert {(r["lang"], r["expected"]) for r in rows if r["expected"]} == {
        (lang, m) for lang in ("zh", "en") for m in readable
    }


def test_corpus_split_holds_out_most_cases_and_never_repeats_the_examples() -> None:
    rows = _rows()
    tune = sum(r["split"] == "tune" for r in rows)
    assert 0.15 <= tune / len(rows) <= 0.25
    for lang in ("zh", "en"):
        assert {r["split"] for r in rows if r["lang"] == lang} == {"tune", "test"}
    texts = [_norm(r["text"]) for r in rows]
    assert len(texts) == len(set(texts)), [t for t, n in Counter(texts).items() if n > 1]
    examples = {
        _norm(text)
        for module in _profiles()["modules"]
        for texts_ in module["examples"].values()
        for text in texts_
    }
    # A fair test: no case is a profile example in disguise.
    assert not examples & set(texts)


def test_every_shipped_line_parses() -> None:
    ids = [m["id"] for m in _profiles()["modules"]]
    assert sum(1 for _ in ev.iter_cases(CASES, split="all", known_modules=ids)) == len(_rows())
    test = list(ev.iter_cases(CASES, known_modules=ids))
    assert test and all(c.split == "test" for c in test)


# --- malformed input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "open the shop", "lang": "en", "expected": ', "not valid JSON"),
        ('["open the shop"]', "expected a JSON object"),
        ('{"lang": "en", "expected": null}', '"text" must be a non-empty string'),
        ('{"text": "   ", "lang": "en", "expected": null}', '"text" must be a non-empty string'),
        ('{"text": "open the shop", "lang": "en"}', '"expected" is missing'),
        ('{"text": "open the shop", "lang": "en", "expected": "shop"}', "ns:path"),
        ('{"text": "open the shop", "lang": "en", "expected": "x:nope"}', "not in the profile"),
        ('{"text": "hi", "lang": "en", "expected": null, "split": "train"}', '"split"'),
        ('{"text": "hi", "lang": 3, "expected": null}', '"lang"'),
    ],
)
def test_malformed_case_line_is_reported_with_its_line_number(
    tmp_path: Path, line: str, message: str
) -> None:
    cases = tmp_path / "cases.jsonl"
    good = '{"text": "open the shop", "lang": "en", "expected": "x:shop"}'
    cases.write_text(f"{good}\n\n{line}\n{good}\n", encoding="utf-8")
    with pytest.raises(ev.CaseError) as raised:
        list(ev.iter_cases(cases, split="all", known_modules=["x:shop"]))
    assert raised.value.line == 3
    assert f"{cases}:3:" in str(raised.value)
    assert message in str(raised.value)


def test_cases_without_split_or_category_are_held_out_and_unlabelled(tmp_path: Path) -> None:
    cases = tmp_path / "cases.jsonl"
    cases.write_text('{"text": "帮助", "expected": null}\n', encoding="utf-8")
    (case,) = ev.iter_cases(cases, default_lang="zh")
    assert (case.lang, case.category, case.split, case.line) == ("zh", "unlabelled", "test", 1)
    assert list(ev.iter_cases(cases, split="tune")) == []


def test_percentiles_are_nearest_rank() -> None:
    ordered = list(range(1, 101))
    assert ev._percentile(ordered, 0.5) == 50
    assert ev._percentile(ordered, 0.99) == 99
    assert ev._percentile([7], 0.9) == 7
    assert ev._percentile([], 0.5) is None


# --- figures on a tiny set whose outcome is obvious ------------------------------------------

TINY_PROFILES = {
    "language": "en",
    "modules": [
        {
            "id": "test:shop",
            "examples": {"en": ["open the shop", "browse the store"], "zh": ["打开商店"]},
        },
        {
            "id": "test:mail",
            "examples": {"en": ["check my mailbox", "read my letters"], "zh": ["查看邮箱"]},
        },
    ],
}
# One routed right, one routed to the wrong module, one out-of-scope false direct, one in-scope
# miss and one out-of-scope case rightly left alone.
TINY_CASES = [
    {"text": "open the shop", "lang": "en", "expected": "test:shop", "category": "plain"},
    {"text": "check my mailbox", "lang": "en", "expected": "test:shop", "category": "plain"},
    {"text": "read my letters", "lang": "en", "expected": None, "category": "out_of_scope"},
    {"text": "zebra quantum violin", "lang": "en", "expected": "test:mail", "category": "typo"},
    {"text": "purple elephants dance", "lang": "en", "expected": None, "category": "write"},
]
STUB = {
    "open the shop": ("direct", "test:shop"),
    "check my mailbox": ("direct", "test:mail"),
    "read my letters": ("direct", "test:mail"),
}


def _stub_decide(text: str, lang: str) -> Any:
    outcome, module = STUB.get(text, ("no_direct", None))
    return SimpleNamespace(
        outcome=outcome,
        module_id=module,
        input=None,
        candidates=[(module, 1.0, f"{module}#0")] if module else [],
        s1=1.0 if module else 0.0,
        s2=0.2 if module else 0.0,
        margin=0.8 if module else 0.0,
        coverage=1.0 if module else 0.0,
        topic_coverage=1.0 if module else 0.0,
        gate_failed=None if module else "score",
    )


def _stub_router(profiles: str, config: str | None, *_: Any) -> tuple[Any, dict[str, Any]]:
    ids = [m["id"] for m in json.loads(Path(profiles).read_text(encoding="utf-8"))["modules"]]
    meta = {"profiles": len(ids), "language": "en", "mode": "STUB", "module_ids": ids}
    return _stub_decide, meta


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(TINY_PROFILES), encoding="utf-8")
    cases = tmp_path / "cases.jsonl"
    cases.write_text("".join(json.dumps(c) + "\n" for c in TINY_CASES), encoding="utf-8")
    if not REAL_MATCHER:
        monkeypatch.setattr(ev, "_build_router", _stub_router)
    return profiles, cases


def _args(tiny: tuple[Path, Path]) -> list[str]:
    """The eval's arguments for the tiny set, without a progress bar."""
    profiles, cases = tiny
    return ["--profiles", str(profiles), "--cases", str(cases), "--no-progress"]


def _split_output(out: str) -> tuple[str, dict[str, Any]]:
    """The table, then the JSON document (which starts at the first line that is `{`)."""
    table, _, document = out.partition("\n{\n")
    return table, json.loads("{\n" + document)


def test_eval_counts_right_wrong_and_false_direct_routes(
    tiny: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    profiles, cases = tiny
    code = ev.main(["--profiles", str(profiles), "--cases", str(cases), "--no-progress"])
    assert code == 0
    table, report = _split_output(capsys.readouterr().out)
    overall = report["overall"]
    assert overall["cases"] == 5
    assert (overall["in_scope"], overall["out_of_scope"]) == (3, 2)
    assert (overall["direct"], overall["correct_direct"], overall["wrong_direct"]) == (3, 1, 2)
    assert overall["coverage"] == pytest.approx(1 / 3)
    assert overall["precision"] == pytest.approx(1 / 3)
    assert (overall["false_direct"], overall["false_direct_rate"]) == (1, 0.5)
    assert (overall["write_cases"], overall["write_direct"]) == (1, 0)
    assert report["by_language"]["en"]["precision"] == pytest.approx(1 / 3)
    assert report["by_category"]["plain"]["coverage"] == 0.5
    assert report["by_category"]["out_of_scope"]["false_direct_rate"] == 1.0
    assert report["by_category"]["typo"]["direct"] == 0
    assert report["by_expected_module"]["test:shop"]["correct_direct"] == 1
    assert report["wrong_direct_count"] == 2
    wrong = {(c["text"], c["expected"], c["got"]) for c in report["wrong_direct"]}
    assert wrong == {
        ("check my mailbox", "test:shop", "test:mail"),
        ("read my letters", None, "test:mail"),
    }
    assert all(c["s1"] is not None and c["candidates"] for c in report["wrong_direct"])
    assert set(report["latency_ms"]) == {"p50", "p90", "p99", "max", "mean"}
    assert report["latency_ms"]["p99"] >= report["latency_ms"]["p50"] >= 0
    assert "coverage" in table and "precision" in table and "33.3%" in table
    assert "wrong direct routes: 2" in table
    assert "'read my letters': expected None got test:mail" in table


def test_fail_under_precision_sets_the_exit_status(
    tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiles, cases = tiny
    base = ["--profiles", str(profiles), "--cases", str(cases), "--no-progress"]
    out = tmp_path / "report.json"
    assert ev.main([*base, "--fail-under-precision", "0.3", "--json", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8"))["overall"]["direct"] == 3
    assert ev.main([*base, "--fail-under-precision", "0.5"]) == 1
    assert "FAIL: precision" in capsys.readouterr().err
    # The tiny set is all "test"; asking for the tuning split evaluates nothing.
    assert ev.main([*base, "--split", "tune"]) == 0
    _, report = _split_output(capsys.readouterr().out)
    assert report["overall"]["cases"] == 0 and report["overall"]["precision"] is None


def test_cli_reports_a_malformed_line_and_exits_2(
    tiny: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    profiles, cases = tiny
    with cases.open("a", encoding="utf-8") as f:
        f.write('{"text": "hi", "lang": "en", "expected": "test:nope"}\n')
    assert ev.main(["--profiles", str(profiles), "--cases", str(cases), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"error: {cases}:6:" in err and "test:nope" in err


@pytest.mark.skipif(not REAL_MATCHER, reason="needs the real matcher")
def test_hold_out_leaves_modules_out_and_their_cases_out_of_scope(
    tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiles, cases = tiny
    base = ["--profiles", str(profiles), "--cases", str(cases), "--no-progress"]
    out = tmp_path / "held.json"
    assert ev.main([*base, "--hold-out", "1", "--seed", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    (held,) = report["held_out"]
    kept = sum(c["expected"] not in (None, held) for c in TINY_CASES)
    assert report["overall"]["in_scope"] == kept
    assert report["overall"]["out_of_scope"] == len(TINY_CASES) - kept
    assert report["profiles"] == 1
    capsys.readouterr()
    assert ev.main([*base, "--hold-out", "1", "--compare"]) == 2
    assert "--hold-out" in capsys.readouterr().err


@pytest.mark.skipif(not REAL_MATCHER, reason="needs the real matcher")
def test_seeds_route_one_draw_each_and_sum_them_up(
    tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _args(tiny)
    out = tmp_path / "draws.json"
    assert ev.main([*base, "--hold-out", "1", "--seeds", "1-4", "--json", str(out)]) == 0
    document = json.loads(out.read_text(encoding="utf-8"))
    draws, summary = document["draws"], document["summary"]
    assert [d["seed"] for d in draws] == [1, 2, 3, 4]
    # Each draw is what `--seed N` alone reports.
    single = tmp_path / "one.json"
    assert ev.main([*base, "--hold-out", "1", "--seed", "3", "--json", str(single)]) == 0
    assert draws[2]["overall"] == json.loads(single.read_text(encoding="utf-8"))["overall"]
    overalls = [d["overall"] for d in draws]
    assert summary["false_direct"] == sum(o["false_direct"] for o in overalls)
    assert summary["out_of_scope"] == sum(o["out_of_scope"] for o in overalls)
    assert summary["coverage_worst"] == min(o["coverage"] for o in overalls)
    capsys.readouterr()
    # Judged on the worst draw; refused without --hold-out, with --plot, or a bad range.
    assert ev.main([*base, "--hold-out", "1", "--seeds", "1-4", "--fail-under-coverage", "1"]) == 1
    assert ev.main([*base, "--seeds", "1-4"]) == 2
    assert ev.main([*base, "--hold-out", "1", "--seeds", "1-2", "--plot", "x.png"]) == 2
    with pytest.raises(SystemExit):
        ev.main([*base, "--hold-out", "1", "--seeds", "4-1"])


def test_more_shots_moves_each_modules_first_cases_into_its_examples(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    profiles, cases = tiny
    out = tmp_path / "more"
    script = ROOT / "scripts" / "more_shots.py"
    run = [sys.executable, str(script), "--set", str(profiles.parent), "--move", "1"]
    done = subprocess.run([*run, "--out", str(out)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    moved = json.loads((out / "profiles.json").read_text(encoding="utf-8"))
    examples = {m["id"]: m["examples"]["en"] for m in moved["modules"]}
    # The first case of each module, in the file's order, in the language it is labelled in.
    assert examples["test:shop"] == ["open the shop", "browse the store", "open the shop"]
    assert examples["test:mail"][-1] == "zebra quantum violin"
    left = [json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines()]
    assert [c["text"] for c in left] == [
        "check my mailbox",  # test:shop's second case stays a case
        "read my letters",
        "purple elephants dance",  # out of scope: never moved
    ]
    (profiles.parent / "cases.jsonl").write_text('{"text": "x", "expected": "test:no"}\n')
    bad = subprocess.run([*run, "--out", str(out)], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "test:no" in bad.stderr


@pytest.mark.skipif(not REAL_MATCHER, reason="needs the real matcher")
def test_fit_size_fits_in_chunks_for_the_run_only(
    tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from router_service.semantic import ngram

    base = _args(tiny)
    before = ngram.MAX_EXAMPLES, ngram.MIN_FITTED
    out = tmp_path / "chunks.json"
    assert ev.main([*base, "--json", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8"))["scorer_chunks"] == {"en": 1}
    # Two examples of each of two modules, at most two examples a fit: two fits of one each.
    assert ev.main([*base, "--fit-size", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8"))["scorer_chunks"] == {"en": 2}
    assert before == (ngram.MAX_EXAMPLES, ngram.MIN_FITTED)  # restored for the process
    capsys.readouterr()
    assert ev.main([*base, "--fit-size", "1"]) == 2
    assert "--fit-size" in capsys.readouterr().err


def test_progress_bar_goes_to_stderr(
    tiny: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    profiles, cases = tiny
    assert ev.main(["--profiles", str(profiles), "--cases", str(cases), "--progress"]) == 0
    captured = capsys.readouterr()
    assert "5/5" in captured.err and "5/5" not in captured.out


# --- the shipped corpus through the command line ----------------------------------------------


def test_cli_runs_on_the_shipped_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--profiles", str(PROFILES), "--cases", str(CASES), "--json", str(tmp_path / "r.json")]
    if REAL_MATCHER:
        done = subprocess.run(
            [sys.executable, "-m", "router_service.eval", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        out = done.stdout
    else:
        monkeypatch.setattr(ev, "_build_router", _stub_router)
        assert ev.main([*args, "--no-progress"]) == 0
        out = capsys.readouterr().out
    table, report = _split_output(out)
    assert table.splitlines()[1].split()[:3] == ["group", "cases", "in"]
    assert "lang zh" in table and "lang en" in table
    assert report == json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    held_out = sum(r["split"] == "test" for r in _rows())
    assert report["overall"]["cases"] == held_out
    assert set(report["by_category"]) == CATEGORIES
    assert set(report["by_language"]) == {"zh", "en"}


def test_compare_prints_the_modes_side_by_side(
    tiny: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    profiles, cases = tiny

    def routers(profiles: str, config: str | None) -> tuple[dict[str, Any], str, dict[str, Any]]:
        decide, meta = _stub_router(profiles, config)
        never = lambda text, lang: SimpleNamespace(outcome="no_direct", module_id=None)  # noqa: E731
        return {"gates": never, "strict": never, "calibrated": decide}, "gates", meta

    monkeypatch.setattr(ev, "_build_routers", routers)
    base = ["--profiles", str(profiles), "--cases", str(cases), "--compare"]
    assert ev.main([*base, "--fail-under-precision", "0.5"]) == 0  # judged on the own mode
    table, report = _split_output(capsys.readouterr().out)
    assert table.splitlines()[0] == "split=test compare: gates, strict, calibrated"
    assert "gates cov" in table and "calibrated cov" in table
    assert set(report["compare"]) == {"gates", "strict", "calibrated"}
    assert report["compare"]["gates"]["overall"]["direct"] == 0
    assert report["compare"]["calibrated"]["overall"]["direct"] == 3


def test_every_profile_is_a_registered_module_with_its_examples() -> None:
    """The profile set is the engine's catalogue as the router sees it: no profile of a module
    that does not exist, and each with the registration's examples and routing kind."""
    from system.common.v1 import catalog_pb2

    from engine_service.app import build_registry
    from engine_service.config import EngineConfig

    registry = build_registry(EngineConfig())
    for profile in _profiles()["modules"]:
        if profile["kind"] == "reject":
            continue
        descriptor = registry.descriptor(profile["id"])  # KeyError: not a registered module
        examples = {e.language: list(e.examples) for e in descriptor.semantic.examples}
        assert examples == profile["examples"], profile["id"]
        read = descriptor.routing_mode == catalog_pb2.ROUTING_MODE_READ
        assert (profile["kind"] == "read") is read, profile["id"]
        assert (descriptor.semantic.extractor or None) == profile["extractor"], profile["id"]
