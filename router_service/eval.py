"""Measures local semantic routing on a labelled corpus.

```sh
python -m router_service.eval --profiles router_service/corpus/profiles.json \\
    --cases router_service/corpus/cases.jsonl [--split test|tune|all] \\
    [--config system-semantic.json] [--json OUT] [--fail-under-precision 0.99] [--compare] \\
    [--plot OUT.png]
```

`--plot OUT.png` (needs matplotlib, in the `bench` extra) routes the cases again while the
scorer's threshold moves (scorer `ngram`: `scorer.offset` from -0.5 to +1; `strict` and
`calibrated`: `scorer.target`; `gates`: `defaultThreshold.score`) and draws coverage against
precision, the shipped point marked, beside the wrong direct routes of the shipped point as a
confusion list (expected → routed, counted). The sweep's points go into the JSON under
`sweep`.

`--compare` routes the same cases under each scorer mode (`ngram`: the default, `gates`: the
seed's gates alone, `strict`, `calibrated`; the config's other settings, `scorer.target` and
`scorer.offset` kept) and prints them
side by side; the JSON document then holds one report per mode under `compare`, and the
`--fail-under-*` checks apply to the config's own scorer mode.

`--hold-out N [--seed S]` leaves N modules, drawn at random, out of the router, and their
cases become out-of-scope cases (expected null): the way public sets hold out whole intents,
on any profile set, so the threshold can be checked against out-of-scope text close to the
catalogue (a held-out sibling such as volume-down beside volume-up). The JSON names them
under `held_out`.

A case is one JSON object a line: `{"text", "lang", "expected", "category", "split"}`, where
`expected` is the module a perfect router would route *directly* (`ns:path`), or null when the
text must not route directly (out of scope, a write, a trap). `lang` defaults to the profile
set's language, `category` to `unlabelled` and `split` to `test`. The file is streamed; a
malformed line stops the run with its line number.

Figures, overall, per language and per category:
- coverage: in-scope cases (expected not null) routed directly to the expected module;
- precision: direct routes that are correct (a direct route of an expected-null case is wrong);
- false-direct rate: expected-null cases routed directly;
- writes direct: `write` cases routed directly (must be 0);
plus the latency percentiles of `decide`, the gates that stopped in-scope cases, and every
wrong direct route with its scores. A `shadow_direct` outcome (SHADOW mode) counts as a direct
route: the eval measures what the matcher would route, whatever the mode does with it.

Exit status: 0; 1 when `--fail-under-precision` (or `--fail-under-coverage`) is not met;
2 on bad input (a malformed case or profile file, an unknown module id).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

if TYPE_CHECKING:
    from router_service.semantic import SemanticRouter

__all__ = [
    "Case",
    "CaseError",
    "Decision",
    "EvalReport",
    "evaluate",
    "format_compare",
    "confusion_pairs",
    "format_table",
    "iter_cases",
    "main",
    "sweep",
    "write_plot",
]

SPLITS = ("tune", "test")
DIRECT_OUTCOMES = frozenset({"direct", "shadow_direct"})
WRITE_CATEGORY = "write"
MAX_CONFUSIONS = 1000
"""Wrong direct routes kept in full; beyond this only their count grows."""


class CaseError(ValueError):
    """A case line that cannot be evaluated; the message names the file and line."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = str(path)
        self.line = line


@dataclasses.dataclass(frozen=True)
class Case:
    """One labelled request."""

    text: str
    lang: str
    expected: str | None
    """Module a perfect router routes directly; None when it must not route directly."""
    category: str
    split: str
    line: int
    """1-based line number in the cases file."""


class Decision(Protocol):
    """What the eval reads from a decision (`router_service.semantic.LocalDecision`)."""

    @property
    def outcome(self) -> str: ...

    @property
    def module_id(self) -> str | None: ...


Decide = Callable[[str, str], Decision]


def _language_tally(lang: str) -> Callable[[EvalReport], Tally | None]:
    return lambda r: r.by_language.get(lang)


def _category_tally(cat: str) -> Callable[[EvalReport], Tally | None]:
    return lambda r: r.by_category.get(cat)


def iter_cases(
    path: str | Path,
    *,
    split: str = "test",
    known_modules: Iterable[str] | None = None,
    default_lang: str = "zh",
) -> Iterator[Case]:
    """Streams the cases of `split` ("tune", "test" or "all") from a JSON-lines file.

    Blank lines are skipped. Raises CaseError (with the line number) for a line that is not
    a JSON object, lacks a non-empty `text`, has a bad `expected`, `lang`, `category` or
    `split`, or expects a module not in `known_modules`.
    """
    if split not in (*SPLITS, "all"):
        raise ValueError(f"split must be one of tune, test, all; got {split!r}")
    known = frozenset(known_modules) if known_modules is not None else None
    with open(path, encoding="utf-8") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            case = _parse_case(path, number, raw, known, default_lang)
            if split == "all" or case.split == split:
                yield case


def _parse_case(
    path: str | Path, number: int, raw: str, known: frozenset[str] | None, default_lang: str
) -> Case:
    def fail(message: str) -> CaseError:
        return CaseError(path, number, message)

    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise fail(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        raise fail('"text" must be a non-empty string')
    lang = obj.get("lang", default_lang)
    if not isinstance(lang, str) or not lang:
        raise fail('"lang" must be a language code such as "zh" or "en"')
    if "expected" not in obj:
        raise fail('"expected" is missing; use a module id "ns:path" or null')
    expected = obj["expected"]
    if expected is not None:
        if not isinstance(expected, str) or ":" not in expected:
            raise fail(f'"expected" must be a module id "ns:path" or null, got {expected!r}')
        if known is not None and expected not in known:
            raise fail(f'"expected" names {expected!r}, which is not in the profile set')
    category = obj.get("category", "unlabelled")
    if not isinstance(category, str) or not category:
        raise fail('"category" must be a non-empty string')
    split = obj.get("split", "test")
    if split not in SPLITS:
        raise fail(f'"split" must be "tune" or "test", got {split!r}')
    return Case(text, lang, expected, category, split, number)


@dataclasses.dataclass
class Tally:
    """Counts for one group of cases (everything, one language, one category…)."""

    cases: int = 0
    in_scope: int = 0
    out_of_scope: int = 0
    routed: int = 0
    correct: int = 0
    false_direct: int = 0
    writes: int = 0
    writes_direct: int = 0
    gates: Counter[str] = dataclasses.field(default_factory=Counter)
    """Why in-scope cases did not route to their module: the failed gate, or `wrong_module`."""

    def add(self, case: Case, routed_to: str | None, gate: str | None) -> None:
        self.cases += 1
        if case.expected is None:
            self.out_of_scope += 1
            self.false_direct += routed_to is not None
        else:
            self.in_scope += 1
            if routed_to == case.expected:
                self.correct += 1
            else:
                self.gates["wrong_module" if routed_to else gate or "none"] += 1
        self.routed += routed_to is not None
        if case.category == WRITE_CATEGORY:
            self.writes += 1
            self.writes_direct += routed_to is not None

    def figures(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "in_scope": self.in_scope,
            "out_of_scope": self.out_of_scope,
            "direct": self.routed,
            "correct_direct": self.correct,
            "wrong_direct": self.routed - self.correct,
            "coverage": _ratio(self.correct, self.in_scope),
            "precision": _ratio(self.correct, self.routed),
            "false_direct": self.false_direct,
            "false_direct_rate": _ratio(self.false_direct, self.out_of_scope),
            "write_cases": self.writes,
            "write_direct": self.writes_direct,
            "missed_by_gate": dict(self.gates.most_common()),
        }


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


@dataclasses.dataclass
class EvalReport:
    """Everything one run measured; `as_dict()` is the JSON document."""

    split: str
    overall: Tally = dataclasses.field(default_factory=Tally)
    by_language: dict[str, Tally] = dataclasses.field(default_factory=dict)
    by_category: dict[str, Tally] = dataclasses.field(default_factory=dict)
    by_language_category: dict[str, Tally] = dataclasses.field(default_factory=dict)
    by_module: dict[str, Tally] = dataclasses.field(default_factory=dict)
    outcomes: Counter[str] = dataclasses.field(default_factory=Counter)
    latencies_ns: list[int] = dataclasses.field(default_factory=list)
    confusions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    confusion_count: int = 0
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def latency_ms(self) -> dict[str, float | None]:
        ordered = sorted(self.latencies_ns)
        out: dict[str, float | None] = {
            f"p{q}": _ms(_percentile(ordered, q / 100)) for q in (50, 90, 99)
        }
        out["max"] = _ms(ordered[-1] if ordered else None)
        out["mean"] = _ms(sum(ordered) / len(ordered) if ordered else None)
        return out

    def as_dict(self) -> dict[str, Any]:
        def group(tallies: dict[str, Tally]) -> dict[str, Any]:
            return {key: tallies[key].figures() for key in sorted(tallies)}

        return {
            "split": self.split,
            **self.meta,
            "overall": self.overall.figures(),
            "by_language": group(self.by_language),
            "by_category": group(self.by_category),
            "by_language_category": group(self.by_language_category),
            "by_expected_module": group(self.by_module),
            "outcomes": dict(self.outcomes.most_common()),
            "latency_ms": self.latency_ms(),
            "wrong_direct_count": self.confusion_count,
            "wrong_direct": self.confusions,
        }


def _percentile(ordered: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending sequence."""
    if not ordered:
        return None
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def _ms(ns: float | None) -> float | None:
    return None if ns is None else round(ns / 1e6, 4)


def evaluate(
    decide: Decide,
    cases: Iterable[Case],
    *,
    split: str = "test",
    on_case: Callable[[], None] | None = None,
) -> EvalReport:
    """Routes every case with `decide(text, lang)` and tallies the outcome against its label."""
    report = EvalReport(split=split)
    clock = time.perf_counter_ns
    for case in cases:
        started = clock()
        decision = decide(case.text, case.lang)
        report.latencies_ns.append(clock() - started)
        outcome = getattr(decision, "outcome", "?")
        report.outcomes[outcome] += 1
        routed_to = decision.module_id if outcome in DIRECT_OUTCOMES else None
        if outcome in DIRECT_OUTCOMES and not routed_to:
            routed_to = "?"  # a direct outcome without a module is a matcher bug; count it wrong
        gate = getattr(decision, "gate_failed", None)
        keys = (
            (report.by_language, case.lang),
            (report.by_category, case.category),
            (report.by_language_category, f"{case.lang}/{case.category}"),
        )
        report.overall.add(case, routed_to, gate)
        for tallies, key in keys:
            tallies.setdefault(key, Tally()).add(case, routed_to, gate)
        if case.expected is not None:
            report.by_module.setdefault(case.expected, Tally()).add(case, routed_to, gate)
        if routed_to is not None and routed_to != case.expected:
            report.confusion_count += 1
            if len(report.confusions) < MAX_CONFUSIONS:
                report.confusions.append(_confusion(case, routed_to, decision))
        if on_case is not None:
            on_case()
    return report


def confusion_pairs(report: EvalReport) -> Counter[tuple[str, str]]:
    """The wrong direct routes kept in `report`, counted by (expected, routed to); an
    expected-null case shows as `(none)`."""
    return Counter((c["expected"] or "(none)", c["got"]) for c in report.confusions)


def _confusion(case: Case, routed_to: str, decision: Any) -> dict[str, Any]:
    def num(name: str) -> float | None:
        value = getattr(decision, name, None)
        return None if value is None else round(float(value), 4)

    candidates = [_candidate(c) for c in list(getattr(decision, "candidates", None) or ())[:3]]
    return {
        "line": case.line,
        "text": case.text,
        "lang": case.lang,
        "category": case.category,
        "expected": case.expected,
        "got": routed_to,
        "s1": num("s1"),
        "s2": num("s2"),
        "margin": num("margin"),
        "coverage": num("coverage"),
        "topic_coverage": num("topic_coverage"),
        "route": getattr(decision, "route", None),
        "scorer_margin": num("scorer_margin"),
        "scorer_threshold": num("scorer_threshold"),
        "candidates": candidates,
    }


def _candidate(candidate: Any) -> dict[str, Any]:
    """A candidate as `ModuleScore` (module_id, score, example_id) or a plain tuple."""
    if isinstance(candidate, tuple | list):
        module, score, example = (*candidate, None, None)[:3]
    else:
        module = candidate.module_id
        score = candidate.score
        example = getattr(candidate, "example_id", None)
    return {"module": module, "score": round(float(score), 4), "example": example}


# --- output -----------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def format_table(report: EvalReport, *, max_confusions: int = 50) -> str:
    """The human-readable report: figures per group, latency, misses and wrong routes."""
    columns = ("group", "cases", "in", "direct", "coverage", "precision", "false-direct", "writes")
    rows: list[tuple[str, ...]] = []

    def row(name: str, tally: Tally) -> None:
        f = tally.figures()
        rows.append(
            (
                name,
                str(f["cases"]),
                str(f["in_scope"]),
                str(f["direct"]),
                _pct(f["coverage"]),
                _pct(f["precision"]),
                f"{_pct(f['false_direct_rate'])} ({f['false_direct']}/{f['out_of_scope']})",
                f"{f['write_direct']}/{f['write_cases']}",
            )
        )

    row("all", report.overall)
    for lang in sorted(report.by_language):
        row(f"lang {lang}", report.by_language[lang])
    for category in sorted(report.by_category):
        row(f"  {category}", report.by_category[category])
    widths = [max(len(r[i]) for r in (columns, *rows)) for i in range(len(columns))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join((first, *rest))

    meta = " ".join(f"{k}={v}" for k, v in report.meta.items() if not isinstance(v, dict))
    out = [f"split={report.split} {meta}".rstrip(), line(columns)]
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in rows)
    latency = report.latency_ms()
    out.append("")
    out.append(
        "decide latency ms: "
        + "  ".join(f"{k}={'-' if v is None else f'{v:.3f}'}" for k, v in latency.items())
    )
    out.append("outcomes: " + ", ".join(f"{k}={v}" for k, v in report.outcomes.most_common()))
    gates = report.overall.gates
    if gates:
        out.append(
            "in-scope misses by gate: " + ", ".join(f"{k}={v}" for k, v in gates.most_common())
        )
    out.append("")
    out.append(f"wrong direct routes: {report.confusion_count}")
    pairs = confusion_pairs(report)
    if pairs:
        out.append(
            "  by pair: " + ", ".join(f"{e} -> {g} x{n}" for (e, g), n in pairs.most_common())
        )
    for c in report.confusions[:max_confusions]:
        top = ", ".join(f"{x['module']} {x['score']:.2f}" for x in c["candidates"])
        out.append(
            f"  line {c['line']} [{c['lang']}/{c['category']}] {c['text']!r}: "
            f"expected {c['expected']} got {c['got']} "
            f"(s1={c['s1']} s2={c['s2']} margin={c['margin']} coverage={c['coverage']}; {top})"
        )
    if report.confusion_count > max_confusions:
        out.append(f"  … {report.confusion_count - max_confusions} more in the JSON output")
    return "\n".join(out)


def format_compare(reports: dict[str, EvalReport]) -> str:
    """The same cases under several configurations, side by side: per group, each one's
    coverage, precision, false-direct (count/out-of-scope) and writes routed directly."""
    names = list(reports)
    first = reports[names[0]]
    groups: list[tuple[str, Callable[[EvalReport], Tally | None]]] = [("all", lambda r: r.overall)]
    groups += [(f"lang {lang}", _language_tally(lang)) for lang in sorted(first.by_language)]
    groups += [(f"  {cat}", _category_tally(cat)) for cat in sorted(first.by_category)]
    header = ["group"]
    for name in names:
        header += [f"{name} cov", "prec", "false-direct", "writes"]
    rows: list[list[str]] = []
    for label, pick in groups:
        cells = [label]
        for name in names:
            tally = pick(reports[name]) or Tally()
            f = tally.figures()
            cells += [
                _pct(f["coverage"]),
                _pct(f["precision"]),
                f"{f['false_direct']}/{f['out_of_scope']}",
                f"{f['write_direct']}/{f['write_cases']}",
            ]
        rows.append(cells)
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first_cell = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join((first_cell, *rest))

    out = [f"split={first.split} compare: {', '.join(names)}", line(header)]
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in rows)
    out.append("")
    for name in names:
        latency = reports[name].latency_ms()
        out.append(
            f"{name}: wrong direct {reports[name].confusion_count}; decide ms "
            f"p50={latency['p50']} p99={latency['p99']}"
        )
    return "\n".join(out)


# --- threshold sweep and plot -------------------------------------------------------------


def _sweep_variants(config: Any) -> tuple[str, list[tuple[float, Any]]]:
    """What moves in a sweep for `config`'s scorer mode, and one config per value."""
    from router_service.semantic.config import Threshold

    mode = config.scorer.mode
    if mode == "ngram":
        values = [round(-0.5 + 0.05 * i, 3) for i in range(31)]
        return "scorer.offset", [
            (v, dataclasses.replace(config, scorer=dataclasses.replace(config.scorer, offset=v)))
            for v in values
        ]
    values = [round(0.5 + 0.025 * i, 3) for i in range(21)]
    if mode in ("strict", "calibrated"):
        return "scorer.target", [
            (v, dataclasses.replace(config, scorer=dataclasses.replace(config.scorer, target=v)))
            for v in values
        ]
    margin = config.default_threshold.margin
    return "defaultThreshold.score", [
        (v, dataclasses.replace(config, default_threshold=Threshold(score=v, margin=margin)))
        for v in values
    ]


def sweep(router: Any, config: Any, cases: Sequence[Case]) -> dict[str, Any]:
    """Routes `cases` once per threshold value (`_sweep_variants`), with `router`'s live
    reload, and puts `config` back. Returns `{"parameter", "shipped", "points": [{"value",
    "coverage", "precision", "false_direct_rate", "direct", "wrong_direct"}]}`."""
    parameter, variants = _sweep_variants(config)
    shipped = {
        "scorer.offset": config.scorer.offset,
        "scorer.target": config.scorer.target,
        "defaultThreshold.score": config.default_threshold.score,
    }[parameter]
    points = []
    try:
        for value, variant in variants:
            router.apply_config(variant)
            figures = evaluate(lambda t, lang: router.decide(t, lang), cases).overall.figures()
            points.append(
                {
                    "value": value,
                    **{
                        key: figures[key]
                        for key in (
                            "coverage",
                            "precision",
                            "false_direct_rate",
                            "direct",
                            "wrong_direct",
                        )
                    },
                }
            )
    finally:
        router.apply_config(config)
    return {"parameter": parameter, "shipped": shipped, "points": points}


def write_plot(
    path: str | Path, title: str, swept: dict[str, Any], report: EvalReport, *, max_pairs: int = 30
) -> None:
    """Coverage against precision as the threshold moves (the shipped point marked), the
    out-of-scope false-direct rate against coverage, and the shipped point's wrong direct
    routes as a confusion list, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in swept["points"] if p["precision"] is not None]
    overall = report.overall.figures()
    fig, (left, middle, right) = plt.subplots(
        1, 3, figsize=(17, 5.5), gridspec_kw={"width_ratios": [3, 3, 3]}
    )
    coverage = [p["coverage"] * 100 for p in points]
    left.plot(coverage, [p["precision"] * 100 for p in points], "o-", ms=3, label="sweep")
    for p in points[:: max(1, len(points) // 8)]:
        left.annotate(
            f"{p['value']:g}",
            (p["coverage"] * 100, p["precision"] * 100),
            fontsize=7,
            textcoords="offset points",
            xytext=(3, -9),
        )
    ship_cov = (overall["coverage"] or 0) * 100
    ship_prec = (overall["precision"] if overall["precision"] is not None else 1.0) * 100
    left.plot([ship_cov], [ship_prec], "r*", ms=14, label=f"shipped ({swept['shipped']:g})")
    left.axhline(99, color="grey", ls="--", lw=0.8)
    left.axvline(25, color="grey", ls=":", lw=0.8)
    left.set_xlabel("coverage of in-scope cases (%)")
    left.set_ylabel("precision of direct routes (%)")
    left.set_title(f"moving {swept['parameter']}")
    left.legend(loc="lower left", fontsize=8)
    fd = [(p["false_direct_rate"] or 0) * 100 for p in points]
    middle.plot(coverage, fd, "o-", ms=3, color="tab:orange")
    ship_fd = (overall["false_direct_rate"] or 0) * 100
    middle.plot([ship_cov], [ship_fd], "r*", ms=14)
    middle.axhline(0.5, color="grey", ls="--", lw=0.8)
    middle.set_xlabel("coverage of in-scope cases (%)")
    middle.set_ylabel("out-of-scope false-direct (%)")
    middle.set_title(f"false-direct {overall['false_direct']}/{overall['out_of_scope']} shipped")
    right.axis("off")
    pairs = confusion_pairs(report)
    lines = [f"wrong direct routes at the shipped point: {report.confusion_count}"]
    lines += [f"{n:>3}  {e} -> {g}" for (e, g), n in pairs.most_common(max_pairs)]
    if len(pairs) > max_pairs:
        lines.append(f"… {len(pairs) - max_pairs} more pairs in the JSON report")
    right.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self._total = max(total, 1)
        self._stream = stream
        self._done = 0
        self._drawn_at = 0.0

    def tick(self) -> None:
        self._done += 1
        now = time.monotonic()
        if now - self._drawn_at >= 0.1:
            self._drawn_at = now
            self._draw()

    def _draw(self) -> None:
        share = min(self._done / self._total, 1.0)
        bar = "#" * int(share * 30)
        self._stream.write(f"\reval [{bar:<30}] {self._done}/{self._total} {share:4.0%}")
        self._stream.flush()

    def close(self) -> None:
        self._draw()
        self._stream.write("\n")
        self._stream.flush()


def _count_cases(path: str | Path, split: str) -> int:
    """How many lines of `split` the file holds, for the progress bar (a cheap first pass)."""
    count = 0
    with open(path, encoding="utf-8") as lines:
        for raw in lines:
            if not raw.strip():
                continue
            try:
                case_split = json.loads(raw).get("split", "test")
            except (ValueError, AttributeError):
                case_split = None  # the real pass reports it with its line number
            count += split == "all" or case_split == split
    return count


# --- command line -----------------------------------------------------------------------------


def _build_router(
    profiles_path: str, config_path: str | None, hold_out: int = 0, seed: int = 0
) -> tuple[Decide, dict[str, Any], Any, Any]:
    """Loads the profile set and the matcher; returns `decide(text, lang)`, run metadata, the
    router and its config. `hold_out` modules drawn at random (`seed`) are left out of the
    router; `module_ids` in the metadata still names every module of the set and `held_out`
    the ones left out."""
    import random

    from router_service.semantic import SemanticConfig, SemanticRouter, load_profiles

    language, profiles = load_profiles(profiles_path)
    every = [_profile_id(p) for p in profiles]
    held = set(random.Random(seed).sample(sorted(every), min(hold_out, len(every))))
    profiles = [p for p in profiles if _profile_id(p) not in held]
    config = _load_config(SemanticConfig, config_path)
    started = time.perf_counter()
    router = SemanticRouter(profiles, config)
    built = time.perf_counter() - started
    examples = sum(
        len(texts)
        for p in profiles
        for texts in (getattr(p, "examples", None) or {}).values()
        if isinstance(texts, list | tuple)
    )
    meta = {
        "profiles": len(profiles),
        "examples": examples,
        "language": language,
        "mode": str(getattr(config, "mode", "?")).rsplit(".", 1)[-1],
        "scorer": getattr(getattr(config, "scorer", None), "mode", "?"),
        "build_seconds": round(built, 4),
        "module_ids": every,
    }
    if held:
        meta["held_out"] = sorted(held)
    ngram = getattr(router, "ngram", None)
    if ngram is not None:
        meta["scorer_thresholds"] = {
            lang: round(ngram.threshold(lang), 4) for lang in ngram.languages
        }
        meta["scorer_train_seconds"] = round(ngram.train_seconds, 4)
        # How many fits each language's weights are the mean of (more than 1 past the fit's
        # size, or with --fit-size).
        meta["scorer_chunks"] = {lang: ngram.model(lang).chunks for lang in ngram.languages}
    return (lambda text, lang: router.decide(text, lang)), meta, router, config


def _decide_with(router: SemanticRouter, text: str, lang: str) -> Decision:
    return router.decide(text, lang)


def _build_routers(
    profiles_path: str, config_path: str | None
) -> tuple[dict[str, Decide], str, dict[str, Any]]:
    """One router per scorer mode (the config otherwise unchanged, one analyzer shared).

    Returns `{mode: decide}`, the config's own scorer mode, and run metadata."""
    from router_service.semantic import Analyzer, SemanticConfig, SemanticRouter, load_profiles
    from router_service.semantic.config import SCORER_MODES, Scorer

    language, profiles = load_profiles(profiles_path)
    config = _load_config(SemanticConfig, config_path)
    analyzer = Analyzer()
    decides: dict[str, Decide] = {}
    meta: dict[str, Any] = {
        "profiles": len(profiles),
        "language": language,
        "mode": config.mode.value,
        "target": config.scorer.target,
        "module_ids": [_profile_id(p) for p in profiles],
    }
    for mode in SCORER_MODES:
        variant = dataclasses.replace(
            config, scorer=Scorer(mode, config.scorer.target, config.scorer.offset)
        )
        started = time.perf_counter()
        router = SemanticRouter(profiles, variant, analyzer=analyzer)
        meta[f"build_seconds_{mode}"] = round(time.perf_counter() - started, 4)
        decides[mode] = functools.partial(_decide_with, router)
    return decides, config.scorer.mode, meta


def _profile_id(profile: Any) -> str:
    for name in ("module_id", "id", "identifier"):
        value = getattr(profile, name, None)
        if isinstance(value, str):
            return value
    raise TypeError(f"cannot read the module id of profile {profile!r}")


def _load_config(config_type: Any, path: str | None) -> Any:
    if path is None:
        return config_type()
    from router_service.semantic.config import load_semantic_config

    return load_semantic_config(path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m router_service.eval",
        description="Measure local semantic routing on a labelled corpus.",
    )
    parser.add_argument("--profiles", required=True, help="profile set (JSON)")
    parser.add_argument("--cases", required=True, help="labelled cases (JSON lines)")
    parser.add_argument("--split", choices=(*SPLITS, "all"), default="test")
    parser.add_argument("--config", help="system-semantic.json (defaults when absent)")
    parser.add_argument("--json", metavar="OUT", help="also write the JSON report to OUT")
    parser.add_argument(
        "--fail-under-precision", type=float, metavar="X", help="exit 1 when precision < X"
    )
    parser.add_argument(
        "--fail-under-coverage", type=float, metavar="X", help="exit 1 when coverage < X"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="route the cases under each scorer mode (gates, strict, calibrated), side by side",
    )
    parser.add_argument(
        "--max-confusions", type=int, default=50, help="wrong routes listed in the table"
    )
    parser.add_argument(
        "--plot",
        metavar="OUT.png",
        help="also sweep the threshold and write coverage vs precision and the confusion list",
    )
    parser.add_argument(
        "--hold-out",
        type=int,
        default=0,
        metavar="N",
        help="leave N modules drawn at random out of the router; their cases become out of "
        "scope (how a public set holds out whole intents; not with --compare)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random draw of --hold-out (default 0)")
    parser.add_argument(
        "--seeds",
        type=_seed_range,
        metavar="A-B",
        help="with --hold-out: one draw per seed from A to B, each routed on its own, then "
        "their mean coverage and precision, the worst draw's precision and the false directs "
        "of all draws together (not with --plot)",
    )
    parser.add_argument(
        "--fit-size",
        type=int,
        metavar="N",
        help="fit at most N examples of a language at once (the router fits 2,500): a smaller "
        "N fits the catalogue in chunks, as a catalogue past 2,500 would be, with any number of "
        "each module in a chunk (a stand-in for a 100-shot set; scripts/more_shots.py)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    return parser


def _seed_range(text: str) -> range:
    """`A-B` (or one seed `A`) as the range of seeds from A to B."""
    first, _, last = text.partition("-")
    try:
        start, end = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed range such as 1-6") from None
    if end < start:
        raise argparse.ArgumentTypeError(f"{text!r}: the range ends before it starts")
    return range(start, end + 1)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.fit_size is None:
        return _run(args)
    if args.fit_size < 2:
        print("error: --fit-size must be 2 or more", file=sys.stderr)
        return 2
    from router_service.semantic import ngram

    # For this run's routers only: the eval measures how a larger catalogue is fitted.
    saved = ngram.MAX_EXAMPLES, ngram.MIN_FITTED
    ngram.MAX_EXAMPLES, ngram.MIN_FITTED = args.fit_size, 1
    try:
        return _run(args)
    finally:
        ngram.MAX_EXAMPLES, ngram.MIN_FITTED = saved


def _run(args: argparse.Namespace) -> int:
    if args.compare and args.hold_out:
        print("error: --hold-out does not combine with --compare", file=sys.stderr)
        return 2
    if args.compare:
        return _compare(args)
    if args.seeds is not None:
        if not args.hold_out or args.plot:
            print(
                "error: --seeds needs --hold-out and does not combine with --plot", file=sys.stderr
            )
            return 2
        return _draws(args)
    return _route(args)


def _route(args: argparse.Namespace) -> int:
    err = sys.stderr
    try:
        decide, meta, router, config = _build_router(
            args.profiles, args.config, args.hold_out, args.seed
        )
        cases = _router_cases(args, meta)
        if args.plot:
            cases = list(cases)  # routed again by the sweep
        show = args.progress if args.progress is not None else err.isatty()
        progress = _Progress(_count_cases(args.cases, args.split), err) if show else None
        try:
            report = evaluate(
                decide, cases, split=args.split, on_case=progress.tick if progress else None
            )
        finally:
            if progress is not None:
                progress.close()
    except (OSError, ValueError) as exc:  # CaseError, ConfigError are ValueErrors
        print(f"error: {exc}", file=err)
        return 2
    report.meta = meta
    document = report.as_dict()
    if args.plot:
        swept = sweep(router, config, list(cases))
        document["sweep"] = swept
        write_plot(args.plot, f"{args.profiles} / {args.cases} [{args.split}]", swept, report)
        print(f"plot written to {args.plot}", file=err)
    _emit(format_table(report, max_confusions=args.max_confusions), document, args.json)
    return _verdict(document["overall"], args, err)


def _router_cases(args: argparse.Namespace, meta: dict[str, Any]) -> Iterable[Case]:
    """The cases of `args` for the router `meta` describes (its `module_ids` taken out of
    `meta`): a held-out module's cases become out of scope, since they must not route."""
    cases = iter_cases(
        args.cases,
        split=args.split,
        known_modules=meta.pop("module_ids"),
        default_lang=meta["language"],
    )
    held = frozenset(meta.get("held_out", ()))
    if not held:
        return cases
    return (dataclasses.replace(c, expected=None) if c.expected in held else c for c in cases)


def _draws(args: argparse.Namespace) -> int:
    """One held-out draw per seed, routed as `_route` routes one; the per-draw table and a
    summary over the draws."""
    err = sys.stderr
    draws: list[dict[str, Any]] = []
    for seed in args.seeds:
        try:
            decide, meta, _, _ = _build_router(args.profiles, args.config, args.hold_out, seed)
            cases = list(_router_cases(args, meta))
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=err)
            return 2
        report = evaluate(decide, cases, split=args.split)
        report.meta = meta
        draws.append({"seed": seed, **report.as_dict()})
    summary = _draw_summary([d["overall"] for d in draws])
    print(
        f"held out: {args.hold_out} modules a draw, seeds {args.seeds.start}-{args.seeds.stop - 1}"
    )
    print(f"{'seed':>6}  {'coverage':>8}  {'precision':>9}  false-direct")
    for draw in draws:
        o = draw["overall"]
        print(
            f"{draw['seed']:>6}  {_pct(o['coverage']):>8}  {_pct(o['precision']):>9}  "
            f"{o['false_direct']}/{o['out_of_scope']}"
        )
    print(
        f"{'all':>6}  {_pct(summary['coverage_mean']):>8}  {_pct(summary['precision_mean']):>9}  "
        f"{summary['false_direct']}/{summary['out_of_scope']} (worst draw's precision "
        f"{_pct(summary['precision_worst'])})"
    )
    document = {"hold_out": args.hold_out, "summary": summary, "draws": draws}
    _emit(None, document, args.json)
    # Judged draw by draw: the worst one must hold the floor.
    judged = {"precision": summary["precision_worst"], "coverage": summary["coverage_worst"]}
    return _verdict(judged, args, err)


def _draw_summary(overalls: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean coverage and precision over the draws (a draw without direct routes has no
    precision and is left out of its mean), the worst of each, and the false directs and
    out-of-scope cases of all draws together."""
    coverages = [o["coverage"] for o in overalls if o["coverage"] is not None]
    precisions = [o["precision"] for o in overalls if o["precision"] is not None]
    return {
        "draws": len(overalls),
        "coverage_mean": statistics.fmean(coverages) if coverages else None,
        "coverage_worst": min(coverages, default=None),
        "precision_mean": statistics.fmean(precisions) if precisions else None,
        "precision_worst": min(precisions, default=None),
        "false_direct": sum(o["false_direct"] for o in overalls),
        "out_of_scope": sum(o["out_of_scope"] for o in overalls),
    }


def _compare(args: argparse.Namespace) -> int:
    err = sys.stderr
    try:
        decides, own, meta = _build_routers(args.profiles, args.config)
        cases = list(_router_cases(args, meta))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=err)
        return 2
    reports: dict[str, EvalReport] = {}
    for mode, decide in decides.items():
        report = evaluate(decide, cases, split=args.split)
        report.meta = {**meta, "scorer": mode}
        reports[mode] = report
    document = {
        "split": args.split,
        **meta,
        "scorer": own,
        "compare": {mode: report.as_dict() for mode, report in reports.items()},
    }
    _emit(format_compare(reports), document, args.json)
    return _verdict(document["compare"][own]["overall"], args, err)


def _emit(table: str | None, document: dict[str, Any], json_path: str | None) -> None:
    """Prints the table (when there is one), a blank line and the JSON document; also writes
    the document to `json_path` when given."""
    text = json.dumps(document, ensure_ascii=False, indent=2)
    if table is not None:
        print(table)
    print()
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n", encoding="utf-8")


def _verdict(overall: dict[str, Any], args: argparse.Namespace, err: TextIO) -> int:
    failed = False
    for flag, key in (("fail_under_precision", "precision"), ("fail_under_coverage", "coverage")):
        floor = getattr(args, flag)
        value = overall[key]
        # No direct route at all has no precision to fail; coverage then is 0 and can fail.
        if floor is not None and value is not None and value < floor:
            print(f"FAIL: {key} {value:.4f} is below {floor}", file=err)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
