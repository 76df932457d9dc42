"""`system-semantic.json`: the local semantic routing settings of seed 004.

The file is one JSON object; every field is optional and defaults to the seed's value:

```json
{
  "mode": "ENFORCE",
  "maxCharacters": 240,
  "minCoverage": 0.9,
  "defaultThreshold": {"score": 0.9, "margin": 0.15},
  "languages": ["zh", "en"],
  "lexicalThresholds": {"system:shop@zh": {"score": 0.95, "margin": 0.2}},
  "examples": {"system:shop": {"zh": ["逛逛系统商铺"]}},
  "cacheEntries": 1024,
  "cacheSeconds": 300,
  "entriesPerPlayer": 32,
  "scorer": {"mode": "ngram", "target": 0.8, "offset": 0.0},
  "modeScores": {"freeChat": 0.95}
}
```

`modeScores` (seed 004) sets the conversation modes' local routing: offline and standard use
the `functions` thresholds (`defaultThreshold` and `lexicalThresholds`); extended mode also
needs the best example's score to reach `freeChat`, since text it does not route confidently
is answered in conversation rather than lost.

`scorer` (beyond the seed) picks how direct routes are decided: `ngram` (the default: the seed's
gates, or, for a text that failed only the score or margin gate, the word and character n-gram
scorer of `ngram.py` with its threshold derived from the catalogue at start, plus `offset`),
`gates` (the seed's fixed score/margin/coverage gates alone), `strict` (the gates and a
calibrated probability of the top module of at least `target`), `calibrated` (that probability
may also stand in for a failed score or margin gate). Guards, write rules, profile kinds and
arguments always apply. `target` and `offset` apply on reload; a scorer is trained at start for
the start config's mode only, so switching to a mode whose scorer was not trained needs a
restart.

Mode, thresholds, text limit and cache sizes apply on reload; the index is built once at start,
so changed examples, changed languages, or leaving an OFF the router started with, need a
restart (`reload_changes` says which).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from services.runtime.config import ConfigError, read_json_file, write_file_atomically

__all__ = [
    "Mode",
    "SCORER_MODES",
    "Scorer",
    "SemanticConfig",
    "Threshold",
    "ensure_semantic_config",
    "load_semantic_config",
    "parse_semantic_config",
    "reload_changes",
    "trained_scorer",
]

log = logging.getLogger("system.router.semantic")

_MODULE_ID = re.compile(r"^[a-z0-9_.-]+:[a-z0-9_./-]+$")
_LANGUAGE = re.compile(r"^[a-z]{2,3}(?:-[a-z0-9]{2,8})?$")


class Mode(enum.StrEnum):
    """What local matching may do."""

    ENFORCE = "ENFORCE"
    """Confident read-only requests route directly; the rest go to the single model call."""
    SHADOW = "SHADOW"
    """Candidates are computed and counted but never route, cache or reach the model."""
    OFF = "OFF"
    """No local index and no intent cache; commands and model routing remain."""


@dataclasses.dataclass(frozen=True)
class Threshold:
    """Score and margin a module's best example must reach to route directly."""

    score: float = 0.9
    """Cosine similarity of the best example, 0..1."""
    margin: float = 0.15
    """Lead of the best module over the best different module, 0..1."""


SCORER_MODES = ("ngram", "gates", "strict", "calibrated")
_PROBABILITY_MODES = frozenset({"strict", "calibrated"})


@dataclasses.dataclass(frozen=True)
class Scorer:
    """The supervised scorer (`router_service.semantic.classifier`) and how it takes part."""

    mode: str = "ngram"
    """`ngram`: a text routes when the seed's gates pass, or when it failed only the score or
    margin gate and the n-gram scorer's top module leads the second by the threshold derived
    from the catalogue (`router_service.semantic.ngram`);
    `gates`: the seed's gates alone; `strict`: a direct route also needs the top module's
    calibrated probability >= `target`; `calibrated`: as strict, and a text that failed only
    the score or margin gate routes when that probability >= `target`."""
    target: float = 0.8
    """`strict` / `calibrated`: least calibrated probability of the top module, 0.5..1."""
    offset: float = 0.0
    """`ngram`: added to the derived thresholds (positive: stricter), -1..1."""

    def __post_init__(self) -> None:
        if self.mode not in SCORER_MODES:
            raise ConfigError(
                f"scorer.mode must be one of {', '.join(SCORER_MODES)}, got {self.mode!r}"
            )


@dataclasses.dataclass(frozen=True)
class SemanticConfig:
    """The parsed `system-semantic.json`. Field docs give the JSON name and the allowed range."""

    mode: Mode = Mode.ENFORCE
    """`mode`: ENFORCE, SHADOW or OFF (case-insensitive in the file)."""
    max_characters: int = 240
    """`maxCharacters`: longest text matched locally; positive."""
    min_coverage: float = 0.9
    """`minCoverage`: least feature coverage and topic coverage for a direct route, 0.5..1."""
    default_threshold: Threshold = Threshold()
    """`defaultThreshold`: score and margin used where no override applies, each 0..1."""
    languages: tuple[str, ...] = ("zh", "en")
    """`languages`: languages that get an index; others fall back to the model."""
    lexical_thresholds: Mapping[str, Threshold] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )
    """`lexicalThresholds`: overrides keyed `module` or `module@lang`; the language key wins."""
    examples: Mapping[str, Mapping[str, tuple[str, ...]]] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )
    """`examples`: extra examples per module and language; only registered profiles use them."""
    cache_entries: int = 1024
    """`cacheEntries`: intent cache capacity over all players; positive."""
    cache_seconds: float = 300.0
    """`cacheSeconds`: time to live of a new intent cache entry; positive."""
    entries_per_player: int = 32
    """`entriesPerPlayer`: intent cache capacity of one player; positive."""
    scorer: Scorer = Scorer()
    """`scorer`: `{"mode": "ngram" | "gates" | "strict" | "calibrated", "target": 0.5..1,
    "offset": -1..1}`."""
    free_chat_score: float = 0.95
    """`modeScores.freeChat`: least best-example score for a direct local route in extended
    mode, 0..1 (offline and standard use the `functions` thresholds above)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))  # accept "SHADOW" from code too

    def threshold_for(self, module_id: str, language: str) -> Threshold:
        """The threshold for `module_id` in `language`: `module@lang`, else `module`, else the
        default."""
        return (
            self.lexical_thresholds.get(f"{module_id}@{language}")
            or self.lexical_thresholds.get(module_id)
            or self.default_threshold
        )

    def to_json(self) -> dict[str, Any]:
        """The file form, for writing a first `system-semantic.json`."""
        return {
            "mode": self.mode.value,
            "maxCharacters": self.max_characters,
            "minCoverage": self.min_coverage,
            "defaultThreshold": dataclasses.asdict(self.default_threshold),
            "languages": list(self.languages),
            "lexicalThresholds": {
                k: dataclasses.asdict(v) for k, v in self.lexical_thresholds.items()
            },
            "examples": {
                m: {lang: list(texts) for lang, texts in by_lang.items()}
                for m, by_lang in self.examples.items()
            },
            "cacheEntries": self.cache_entries,
            "cacheSeconds": self.cache_seconds,
            "entriesPerPlayer": self.entries_per_player,
            "scorer": dataclasses.asdict(self.scorer),
            "modeScores": {"freeChat": self.free_chat_score},
        }


# JSON name -> dataclass field. Fields not listed here have the same name.
_FIELDS = {
    "mode": "mode",
    "maxCharacters": "max_characters",
    "minCoverage": "min_coverage",
    "defaultThreshold": "default_threshold",
    "languages": "languages",
    "lexicalThresholds": "lexical_thresholds",
    "examples": "examples",
    "cacheEntries": "cache_entries",
    "cacheSeconds": "cache_seconds",
    "entriesPerPlayer": "entries_per_player",
    "scorer": "scorer",
    "modeScores": "free_chat_score",
}


def _number(source: str, name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{source}: {name} must be a number in {low:g}..{high:g}, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{source}: {name} must be in {low:g}..{high:g}, got {value!r}")
    return float(value)


def _positive(source: str, name: str, value: Any, *, integer: bool) -> Any:
    kind = "a positive integer" if integer else "a positive number"
    ok_type = int if integer else int | float
    if (
        isinstance(value, bool)
        or not isinstance(value, ok_type)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{source}: {name} must be {kind}, got {value!r}")
    return value if integer else float(value)


def _object(source: str, name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {name} must be a JSON object, got {value!r}")
    return value


def _threshold(source: str, name: str, value: Any, base: Threshold) -> Threshold:
    value = _object(source, name, value)
    unknown = sorted(set(value) - {"score", "margin"})
    if unknown:
        raise ConfigError(
            f"{source}: {name} has unknown key(s) {', '.join(unknown)}; allowed: score, margin"
        )
    score = _number(source, f"{name}.score", value.get("score", base.score), 0, 1)
    margin = _number(source, f"{name}.margin", value.get("margin", base.margin), 0, 1)
    return Threshold(score=score, margin=margin)


def _language(source: str, name: str, value: Any) -> str:
    if not isinstance(value, str) or not _LANGUAGE.match(value):
        raise ConfigError(
            f"{source}: {name} must be a lower-case language code such as 'zh' or 'en', "
            f"got {value!r}"
        )
    return value


def _module_id(source: str, name: str, value: str) -> str:
    if not _MODULE_ID.match(value):
        raise ConfigError(
            f"{source}: {name} key {value!r} is not a module identifier `namespace:path`"
        )
    return value


def parse_semantic_config(data: Any, source: str = "system-semantic.json") -> SemanticConfig:
    """Builds a config from the decoded JSON document.

    Raises:
        ConfigError: naming the field, what it must be and what it was.
    """
    data = _object(source, "the document", data)
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(
            f"{source}: unknown field(s) {', '.join(unknown)}; known fields are "
            f"{', '.join(_FIELDS)}"
        )
    defaults = SemanticConfig()
    values: dict[str, Any] = {}
    if "mode" in data:
        mode = data["mode"]
        if not isinstance(mode, str) or mode.upper() not in Mode.__members__:
            raise ConfigError(f"{source}: mode must be ENFORCE, SHADOW or OFF, got {mode!r}")
        values["mode"] = Mode(mode.upper())
    if "maxCharacters" in data:
        values["max_characters"] = _positive(
            source, "maxCharacters", data["maxCharacters"], integer=True
        )
    if "minCoverage" in data:
        values["min_coverage"] = _number(source, "minCoverage", data["minCoverage"], 0.5, 1)
    default_threshold = defaults.default_threshold
    if "defaultThreshold" in data:
        default_threshold = _threshold(
            source, "defaultThreshold", data["defaultThreshold"], Threshold()
        )
        values["default_threshold"] = default_threshold
    if "languages" in data:
        languages = data["languages"]
        if not isinstance(languages, list) or not languages:
            raise ConfigError(
                f"{source}: languages must be a non-empty list of language codes, got {languages!r}"
            )
        codes = [_language(source, "languages[]", code) for code in languages]
        if len(set(codes)) != len(codes):
            raise ConfigError(f"{source}: languages lists a language twice: {codes!r}")
        values["languages"] = tuple(codes)
    if "lexicalThresholds" in data:
        overrides: dict[str, Threshold] = {}
        for key, value in _object(source, "lexicalThresholds", data["lexicalThresholds"]).items():
            module_id, _, language = key.partition("@")
            _module_id(source, "lexicalThresholds", module_id)
            if language:
                _language(source, f"lexicalThresholds[{key!r}] language", language)
            # A partial override takes the missing value from defaultThreshold.
            overrides[key] = _threshold(
                source, f"lexicalThresholds[{key!r}]", value, default_threshold
            )
        values["lexical_thresholds"] = MappingProxyType(overrides)
    if "examples" in data:
        examples: dict[str, Mapping[str, tuple[str, ...]]] = {}
        for module_id, by_lang in _object(source, "examples", data["examples"]).items():
            _module_id(source, "examples", module_id)
            texts_by_lang: dict[str, tuple[str, ...]] = {}
            for language, texts in _object(source, f"examples[{module_id!r}]", by_lang).items():
                _language(source, f"examples[{module_id!r}] key", language)
                where = f"examples[{module_id!r}][{language!r}]"
                if not isinstance(texts, list) or not all(
                    isinstance(t, str) and t.strip() for t in texts
                ):
                    raise ConfigError(
                        f"{source}: {where} must be a list of non-empty strings, got {texts!r}"
                    )
                texts_by_lang[language] = tuple(texts)
            examples[module_id] = MappingProxyType(texts_by_lang)
        values["examples"] = MappingProxyType(examples)
    if "cacheEntries" in data:
        values["cache_entries"] = _positive(
            source, "cacheEntries", data["cacheEntries"], integer=True
        )
    if "cacheSeconds" in data:
        values["cache_seconds"] = _positive(
            source, "cacheSeconds", data["cacheSeconds"], integer=False
        )
    if "entriesPerPlayer" in data:
        values["entries_per_player"] = _positive(
            source, "entriesPerPlayer", data["entriesPerPlayer"], integer=True
        )
    if "scorer" in data:
        values["scorer"] = _scorer(source, data["scorer"])
    if "modeScores" in data:
        scores = _object(source, "modeScores", data["modeScores"])
        unknown = sorted(set(scores) - {"freeChat"})
        if unknown:
            raise ConfigError(
                f"{source}: modeScores has unknown key(s) {', '.join(unknown)}; allowed: "
                "freeChat (the functions thresholds are defaultThreshold and lexicalThresholds)"
            )
        if "freeChat" in scores:
            values["free_chat_score"] = _number(
                source, "modeScores.freeChat", scores["freeChat"], 0, 1
            )
    return SemanticConfig(**values)


def _scorer(source: str, value: Any) -> Scorer:
    value = _object(source, "scorer", value)
    unknown = sorted(set(value) - {"mode", "target", "offset"})
    if unknown:
        raise ConfigError(
            f"{source}: scorer has unknown key(s) {', '.join(unknown)}; allowed: mode, target, "
            f"offset"
        )
    base = Scorer()
    mode = value.get("mode", base.mode)
    if not isinstance(mode, str) or mode.lower() not in SCORER_MODES:
        raise ConfigError(
            f"{source}: scorer.mode must be one of {', '.join(SCORER_MODES)}, got {mode!r}"
        )
    target = _number(source, "scorer.target", value.get("target", base.target), 0.5, 1)
    offset = _number(source, "scorer.offset", value.get("offset", base.offset), -1, 1)
    return Scorer(mode=mode.lower(), target=target, offset=offset)


def trained_scorer(mode: str) -> str:
    """Which scorer a router started in scorer `mode` trains: `ngram`, `probability` (the
    calibrated `classifier.ModuleScorer`, for strict and calibrated) or `none`."""
    if mode == "ngram":
        return "ngram"
    return "probability" if mode in _PROBABILITY_MODES else "none"


def ensure_semantic_config(path: str | Path) -> tuple[SemanticConfig, bool]:
    """The config at `path`, written there with the defaults first when no file exists (seed
    004: the first start writes `system-semantic.json` with mode ENFORCE, so an operator has
    every field in front of them to edit). Returns the config and whether it was written.
    A file that exists is read as `load_semantic_config` reads it; a folder that cannot be
    written (a read-only mount) leaves the defaults in force, unwritten.

    Raises:
        ConfigError: as `load_semantic_config`, for a file that exists.
    """
    target = Path(path)
    if target.exists():
        return load_semantic_config(target), False
    defaults = SemanticConfig()
    text = json.dumps(defaults.to_json(), indent=2, ensure_ascii=False) + "\n"
    try:
        write_file_atomically(target, text)
    except OSError as exc:
        log.warning("could not write the default %s (%s); using the defaults", target, exc)
        return defaults, False
    return defaults, True


def load_semantic_config(path: str | Path) -> SemanticConfig:
    """Reads and validates `system-semantic.json` at `path`.

    Raises:
        ConfigError: the file is missing, not JSON, or a field is unknown, of the wrong type or
            out of range; the message names the file and the field.
    """
    return parse_semantic_config(read_json_file(path, "semantic config file"), str(path))


def reload_changes(
    old: SemanticConfig, new: SemanticConfig, *, built_with: SemanticConfig | None = None
) -> list[str]:
    """What a reload from `old` to `new` changes, one line per changed field, each saying
    whether it applies live or needs a restart.

    Args:
        old: the config in use before the reload.
        new: the config just read.
        built_with: the config the index was built with at start (default `old`). Examples and
            languages are compared with it, and a start in OFF built no index, so leaving OFF
            needs a restart even after several reloads.

    Returns:
        Lines such as `"mode: applies live"` or `"examples: needs a restart (...)"`, in field
        order; empty when nothing changed.
    """
    built = built_with or old
    changes: list[str] = []
    for json_name, field in _FIELDS.items():
        before, after = getattr(old, field), getattr(new, field)
        if json_name == "mode":
            if built.mode is Mode.OFF and after is not Mode.OFF:
                changes.append(
                    f"mode: needs a restart (the router started with OFF and built no index; "
                    f"{after.value} takes effect after it)"
                )
            elif before != after:
                changes.append("mode: applies live")
        elif json_name == "scorer":
            need, have = trained_scorer(after.mode), trained_scorer(built.scorer.mode)
            if need != "none" and need != have:
                changes.append(
                    f"scorer: needs a restart (the router started with scorer mode "
                    f"{built.scorer.mode} and did not train the scorer {after.mode} uses; "
                    f"{after.mode} takes effect after it)"
                )
            elif before != after:
                changes.append("scorer: applies live")
        elif json_name in ("examples", "languages"):
            if getattr(built, field) != after:
                changes.append(f"{json_name}: needs a restart (the index is built once at start)")
        elif before != after:
            changes.append(f"{json_name}: applies live")
    return changes
