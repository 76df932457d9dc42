"""Routing counters and the last local match, for the admin diagnostics RPC (seed 004,
扩展与诊断).

What is recorded is closed by construction: decision sources and reasons are enum members,
the last match is a module id, a language code and three numbers, each checked on the way in.
There is no parameter through which a player's text or id could arrive. The last match is one
snapshot shared by the whole server.

The counts say how often a path was taken, not that it was right: LOCAL and CACHE are local
paths that saved a routing call, SHADOW_DIRECT counts candidates that would have been direct.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import re
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["DecisionSource", "LastMatch", "RouterDiagnostics"]

ALGORITHM = "lexical-tfidf-v1"

# Minecraft resource locations: `namespace:path`, lower case, no spaces.
_MODULE_ID = re.compile(r"[a-z0-9_.-]{1,64}:[a-z0-9_./-]{1,128}")
_GATE = re.compile(r"[a-z_]{1,32}(:[a-z_]{1,32})?")
_LANGUAGE = re.compile(r"[a-z]{2,3}(?:[-_][a-z0-9]{2,8})?")
_CHECKED_NAMES = 1024
"""Names (gates, module ids with a language) remembered as checked: a server sees the same
few on every call, and a set lookup costs a tenth of the pattern match."""


class DecisionSource(enum.StrEnum):
    """Where a routing decision came from."""

    BUTTON = "BUTTON"
    COMMAND = "COMMAND"
    CACHE = "CACHE"
    LOCAL = "LOCAL"
    MODEL = "MODEL"
    LOCAL_FALLBACK = "LOCAL_FALLBACK"
    NONE = "NONE"
    CHAT = "CHAT"
    """No module fit; answered in conversation (`system:chat`)."""
    SHADOW_DIRECT = "SHADOW_DIRECT"
    """SHADOW mode: a candidate that would have routed directly (it did not)."""


@dataclasses.dataclass(frozen=True)
class LastMatch:
    """The most recent local match, server-wide."""

    module_id: str
    language: str
    score: float
    margin: float
    coverage: float
    candidates: tuple[tuple[str, float], ...] = ()
    """The top candidates as (module id, score), best first (module ids only: no text)."""
    gate: str = ""
    """The gate that stopped a direct route; empty when it routed."""


def _label(member: enum.Enum) -> str:
    if not isinstance(member, enum.Enum):
        raise TypeError(f"expected an enum member, got {type(member).__name__}")
    return member.name


def _remember(checked: set[Any], name: Any) -> None:
    if len(checked) >= _CHECKED_NAMES:
        checked.clear()
    checked.add(name)


def _unit(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be within 0..1, got {value!r}")
    return value


class RouterDiagnostics:
    """Thread-safe routing counters (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: collections.Counter[str] = collections.Counter()
        self._reasons: collections.Counter[str] = collections.Counter()
        self._gates: collections.Counter[str] = collections.Counter()
        self._last: LastMatch | None = None
        self._checked_gates: set[str] = set()
        self._checked_matches: set[tuple[str, str]] = set()

    def record_decision(
        self,
        source: DecisionSource,
        *,
        reason: enum.Enum | None = None,
        failed_gate: enum.Enum | None = None,
    ) -> None:
        """Counts one decision.

        Args:
            source: Where the decision came from.
            reason: Why it fell back or did not route (any enum member, counted by name).
            failed_gate: The first gate a local candidate failed (any enum member).
        """
        if type(source) is not DecisionSource:
            source = DecisionSource(source)
        reason_label = None if reason is None else _label(reason)
        gate_label = None if failed_gate is None else _label(failed_gate)
        with self._lock:
            self._sources[source._value_] += 1  # `.value` is a slow enum property
            if reason_label is not None:
                self._reasons[reason_label] += 1
            if gate_label is not None:
                self._gates[gate_label] += 1

    def record_gate(self, gate: str) -> None:
        """Counts a local match stopped by `gate` (`score`, `margin`, `guard:negation`, ...).

        Raises:
            ValueError: `gate` is not a gate name (lower-case words, optionally `kind:name`);
                the check keeps free text out.
        """
        if type(gate) is not str or gate not in self._checked_gates:
            if not isinstance(gate, str) or not _GATE.fullmatch(gate):
                raise ValueError("gate must be a gate name such as score or guard:negation")
            _remember(self._checked_gates, gate)
        with self._lock:
            self._gates[gate] += 1

    def record_match(
        self,
        module_id: str,
        language: str,
        score: float,
        margin: float,
        coverage: float,
        candidates: Sequence[tuple[str, float]] = (),
        gate: str = "",
    ) -> None:
        """Replaces the last local match; `candidates` are its top (module id, score) pairs,
        `gate` the gate that stopped it (empty when it routed).

        Raises:
            ValueError: `module_id` or a candidate is not a `namespace:path` id, `language` not
                a language code, `gate` not a gate name, or a number outside 0..1; these
                checks keep free text out.
        """
        for other, _ in candidates:
            if not isinstance(other, str) or not _MODULE_ID.fullmatch(other):
                raise ValueError("candidates must be namespace:path module ids")
        if gate and (not isinstance(gate, str) or not _GATE.fullmatch(gate)):
            raise ValueError("gate must be a gate name such as score or guard:negation")
        if (
            type(module_id) is not str
            or type(language) is not str
            or (module_id, language) not in self._checked_matches
        ):
            if not isinstance(module_id, str) or not _MODULE_ID.fullmatch(module_id):
                raise ValueError("module_id must be a namespace:path module id")
            if not isinstance(language, str) or not _LANGUAGE.fullmatch(language):
                raise ValueError("language must be a language code such as zh or en")
            _remember(self._checked_matches, (module_id, language))
        match = LastMatch(
            module_id,
            language,
            _unit("score", score),
            _unit("margin", margin),
            _unit("coverage", coverage),
            tuple((other, _unit("score", value)) for other, value in candidates[:3]),
            gate,
        )
        with self._lock:
            self._last = match

    @property
    def last_match(self) -> LastMatch | None:
        with self._lock:
            return self._last

    def counts(self) -> dict[str, int]:
        """Decisions per source, every source listed."""
        with self._lock:
            return {source.value: self._sources[source.value] for source in DecisionSource}

    def reset(self) -> None:
        with self._lock:
            self._sources.clear()
            self._reasons.clear()
            self._gates.clear()
            self._last = None

    def snapshot(
        self,
        *,
        mode: str,
        status: str,
        example_count: int,
        cache_entries: int,
        algorithm: str = ALGORITHM,
    ) -> dict[str, Any]:
        """Everything the admin diagnostics RPC shows, as plain data.

        Args:
            mode: ENFORCE, SHADOW or OFF.
            status: The index's state, for example READY or DISABLED.
            example_count: Examples in the local index.
            cache_entries: Entries in the intent cache now.
            algorithm: The local matcher's name.
        """
        with self._lock:
            last = self._last
            return {
                "algorithm": algorithm,
                "mode": mode,
                "status": status,
                "example_count": int(example_count),
                "cache_entries": int(cache_entries),
                "decisions": {s.value: self._sources[s.value] for s in DecisionSource},
                "fallback_reasons": dict(sorted(self._reasons.items())),
                "failed_gates": dict(sorted(self._gates.items())),
                "last_match": None if last is None else dataclasses.asdict(last),
            }
