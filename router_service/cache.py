"""The exact intent cache: "this whole normalised text, from this player, meant this read-only
module" (seed 004, 精确意图缓存与隔离).

An entry is written only after a model-routed module ran successfully, the module is read-only
and may be reached directly, and its arguments re-parse from the same text to exactly what the
model chose. A hit saves the model call that picks the module and nothing else: the caller
still re-parses the arguments from the current text, re-checks the module and runs it against
live data.

The key is (player scope, scope generation, runtime generation, memory generation, language,
SHA-256 of the normalised text). The text itself is never kept, not even normalised. Players
never share entries. Bounds: a global entry count, an entry count per player and a TTL, all
with access-order LRU eviction; they can change on reload (`resize`).

Late writes: a model call and the module run take time, and meanwhile the player may clear
their memory, change preferences, revoke or disconnect (`clear_player`). A caller takes a
`PlayerScope` before routing and hands it back with the write; a write whose scope or memory
generation is no longer current is dropped. A write routed under a runtime generation that was
replaced meanwhile is keyed on the old one, which no later lookup asks for.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import hashlib
import itertools
import threading
import time
import types
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from router_service.semantic.text import normalize

__all__ = [
    "CachedIntent",
    "ClearReason",
    "IntentCache",
    "PlayerScope",
    "WriteOutcome",
    "refusal",
    "text_digest",
]


class ClearReason(enum.StrEnum):
    """Why a player's scope was cleared."""

    MEMORY_CLEARED = "memory_cleared"
    PREFERENCES_CHANGED = "preferences_changed"
    REVOKED = "revoked"
    DISCONNECTED = "disconnected"
    PERMISSIONS_CHANGED = "permissions_changed"


class WriteOutcome(enum.StrEnum):
    """What `IntentCache.record_success` did; everything but WRITTEN means nothing was stored."""

    WRITTEN = "written"
    NOT_READ_ONLY = "not_read_only"
    """The module has write steps or non-read-only tools."""
    NOT_DIRECT = "not_direct"
    """The module's profile does not allow local direct routing (explicitOnly, hints, ...)."""
    TOPIC_GAP = "topic_gap"
    """The text mentions topics or unknown words its examples do not cover."""
    ARGUMENTS_UNPARSED = "arguments_unparsed"
    """The module's extractor could not parse the arguments from this text alone."""
    ARGUMENTS_DIFFER = "arguments_differ"
    """The re-parsed arguments are not the ones the model chose."""
    STALE_SCOPE = "stale_scope"
    """The player's scope was cleared after the scope was taken."""
    STALE_MEMORY = "stale_memory"
    """A newer memory generation of this player has been seen."""
    EMPTY_TEXT = "empty_text"
    """Nothing is left of the text after normalisation."""


@dataclasses.dataclass(frozen=True)
class PlayerScope:
    """A player's cache scope as it was when routing began. Pass it back unchanged to `get`
    and `record_success`; it is two plain values so it can travel between requests."""

    player_id: str
    """Whoever the cache isolates: the caller composes it (for example server id and player
    id) so that two players can never share it."""
    generation: int
    """Bumped by every clear of this player's scope (and when the cache starts over)."""


@dataclasses.dataclass(frozen=True)
class CachedIntent:
    """What a hit returns: the module and the arguments that were re-parsed when it was
    written. The caller still re-parses the arguments from the current text."""

    module_id: str
    arguments: Mapping[str, Any]
    expires_at: float
    """On the cache's clock."""


_Key = tuple[str, int, Hashable, Hashable, str, bytes]


def text_digest(text: str, normalize: Callable[[str], str] = normalize) -> bytes | None:
    """SHA-256 of the normalised text, what every cache key holds instead of the text; None
    when nothing is left of it after normalisation. The shared cache in storage
    (router_service.clients) keys on the same digest."""
    normalized = normalize(text)
    if not normalized:
        return None
    # surrogatepass: a lone surrogate from a broken client hashes instead of raising.
    return hashlib.sha256(normalized.encode("utf-8", "surrogatepass")).digest()


def refusal(
    model_arguments: Mapping[str, Any],
    reparsed_arguments: Mapping[str, Any] | None,
    read_only: bool,
    direct_allowed: bool,
    topics_covered: bool = True,
) -> WriteOutcome | None:
    """Why a model-routed success may not be cached (see `IntentCache.record_success`), or
    None when it may."""
    if not read_only:
        return WriteOutcome.NOT_READ_ONLY
    if not direct_allowed:
        return WriteOutcome.NOT_DIRECT
    if not topics_covered:
        return WriteOutcome.TOPIC_GAP
    if reparsed_arguments is None:
        return WriteOutcome.ARGUMENTS_UNPARSED
    if dict(model_arguments) != dict(reparsed_arguments):
        return WriteOutcome.ARGUMENTS_DIFFER
    return None


@dataclasses.dataclass
class _PlayerState:
    generation: int
    memory_generation: int | None = None
    keys: collections.OrderedDict[_Key, None] = dataclasses.field(
        default_factory=collections.OrderedDict
    )


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


class IntentCache:
    """A bounded, thread-safe, per-player exact intent cache (see the module docstring).

    Args:
        max_entries: Most entries in all (`cacheEntries`).
        ttl_seconds: Lifetime of a new entry (`cacheSeconds`).
        per_player: Most entries of one player (`entriesPerPlayer`).
        clock: Seconds, monotonic; tests inject their own.
        normalize: Text normalisation before hashing; by default the one every matching
            stage uses, so the cache and the local matcher see the same text.
        max_tracked_players: Players whose scope generation is remembered; past it the cache
            starts over (every entry dropped, every scope taken before made stale), which
            costs cached intents but never isolation.
    """

    def __init__(
        self,
        max_entries: int = 1024,
        ttl_seconds: float = 300,
        per_player: int = 32,
        clock: Callable[[], float] = time.monotonic,
        normalize: Callable[[str], str] = normalize,
        max_tracked_players: int = 65536,
    ) -> None:
        self._check(max_entries, ttl_seconds, per_player)
        _positive("max_tracked_players", max_tracked_players)
        self._max_entries = max_entries
        self._ttl = float(ttl_seconds)
        self._per_player = per_player
        self._clock = clock
        self._normalize = normalize
        self._max_tracked_players = max_tracked_players
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[_Key, CachedIntent] = collections.OrderedDict()
        self._players: dict[str, _PlayerState] = {}
        # Generations come from one counter, so a generation is never reused: a scope taken
        # before the cache started over (or before a player's state was forgotten) can never
        # match again.
        self._generations = itertools.count(1)
        self._floor = next(self._generations)

    @staticmethod
    def _check(max_entries: int, ttl_seconds: float, per_player: int) -> None:
        _positive("max_entries", max_entries)
        _positive("ttl_seconds", ttl_seconds)
        _positive("per_player", per_player)

    # -- scopes and generations ---------------------------------------------------------------

    def scope(self, player_id: str) -> PlayerScope:
        """The player's current scope; take it before routing, hand it back with the write."""
        if not player_id:
            raise ValueError("player_id is required")
        with self._lock:
            state = self._players.get(player_id)
            return PlayerScope(player_id, state.generation if state else self._floor)

    def clear_player(self, player_id: str, reason: ClearReason) -> int:
        """Drops the player's entries and invalidates every scope taken before: call it when
        the player's memory is cleared, preferences change, access is revoked or the player
        disconnects. Returns how many entries were dropped."""
        ClearReason(reason)
        with self._lock:
            state = self._players.get(player_id)
            dropped = 0
            if state is None:
                state = self._track(player_id)
            else:
                dropped = len(state.keys)
                for key in state.keys:
                    del self._entries[key]
                state.keys.clear()
            state.generation = next(self._generations)
            return dropped

    def _clear_all_locked(self) -> None:
        self._entries.clear()
        self._players.clear()
        self._floor = next(self._generations)

    def _track(self, player_id: str) -> _PlayerState:
        if len(self._players) >= self._max_tracked_players:
            self._clear_all_locked()
        state = _PlayerState(generation=self._floor)
        self._players[player_id] = state
        return state

    def _current(self, scope: PlayerScope) -> _PlayerState | None:
        """The player's state when `scope` is still current, else None."""
        state = self._players.get(scope.player_id)
        if state is None and scope.generation == self._floor:
            state = self._track(scope.player_id)  # may start over, which makes `scope` stale
        if state is None or state.generation != scope.generation:
            return None
        return state

    def _observe_memory(self, state: _PlayerState, memory_generation: int) -> bool:
        """Records a memory generation; False when it is older than one already seen. A newer
        one drops the player's entries of older generations, which can never hit again."""
        seen = state.memory_generation
        if seen is not None and memory_generation < seen:
            return False
        if seen is None or memory_generation > seen:
            state.memory_generation = memory_generation
            for key in [k for k in state.keys if k[3] != memory_generation]:
                self._remove(key)
        return True

    # -- lookups and writes -------------------------------------------------------------------

    def _key(
        self,
        scope: PlayerScope,
        runtime_generation: Hashable,
        memory_generation: int,
        language: str,
        text: str,
    ) -> _Key | None:
        digest = text_digest(text, self._normalize)
        if digest is None:
            return None
        return (
            scope.player_id,
            scope.generation,
            runtime_generation,
            memory_generation,
            language,
            digest,
        )

    def get(
        self,
        scope: PlayerScope,
        runtime_generation: Hashable,
        memory_generation: int,
        language: str,
        text: str,
    ) -> CachedIntent | None:
        """The cached intent for this exact text, or None. A hit becomes the most recently
        used entry; an expired entry is removed and counts as a miss."""
        with self._lock:
            state = self._current(scope)
            entry = None
            key = None
            if (
                state is not None
                and self._observe_memory(state, memory_generation)
                and state.keys  # most players have no entry: skip normalising and hashing
            ):
                key = self._key(scope, runtime_generation, memory_generation, language, text)
            if key is not None:
                entry = self._entries.get(key)
                if entry is not None and entry.expires_at <= self._clock():
                    self._remove(key)
                    entry = None
            if entry is None or state is None or key is None:
                return None
            self._entries.move_to_end(key)
            state.keys.move_to_end(key)
            return entry

    def record_success(
        self,
        scope: PlayerScope,
        runtime_generation: Hashable,
        memory_generation: int,
        language: str,
        text: str,
        module_id: str,
        model_arguments: Mapping[str, Any],
        reparsed_arguments: Mapping[str, Any] | None,
        read_only: bool,
        direct_allowed: bool,
        *,
        topics_covered: bool = True,
    ) -> WriteOutcome:
        """Records that a model-routed module succeeded for this text, if it may be cached.

        Args:
            scope: Taken with `scope()` before routing began.
            runtime_generation: The runtime generation the request was routed under.
            memory_generation: The player's memory generation the request was routed under.
            language: The player's language.
            text: The player's text; only its hash is kept.
            module_id: The module the model chose and that ran successfully.
            model_arguments: The arguments the model chose.
            reparsed_arguments: The arguments the module's extractor parsed from this text
                alone; None when it could not.
            read_only: The module's profile is read, interactive, has no write steps and
                only read-only tools.
            direct_allowed: The profile allows local direct routing (not explicitOnly, not
                hints-only or reject).
            topics_covered: The text's topics and unknown words are covered by the module's
                examples (the seed's "no unknown topic gap").

        Returns:
            WRITTEN, or why nothing was written.
        """
        outcome = self._refusal(
            model_arguments, reparsed_arguments, read_only, direct_allowed, topics_covered
        )
        key = self._key(scope, runtime_generation, memory_generation, language, text)
        with self._lock:
            if outcome is None:
                outcome = self._write_locked(
                    key, scope, memory_generation, module_id, reparsed_arguments
                )
            return outcome

    @staticmethod
    def _refusal(
        model_arguments: Mapping[str, Any],
        reparsed_arguments: Mapping[str, Any] | None,
        read_only: bool,
        direct_allowed: bool,
        topics_covered: bool,
    ) -> WriteOutcome | None:
        return refusal(
            model_arguments, reparsed_arguments, read_only, direct_allowed, topics_covered
        )

    def _write_locked(
        self,
        key: _Key | None,
        scope: PlayerScope,
        memory_generation: int,
        module_id: str,
        arguments: Mapping[str, Any] | None,
    ) -> WriteOutcome:
        if key is None:
            return WriteOutcome.EMPTY_TEXT
        state = self._current(scope)
        if state is None:
            return WriteOutcome.STALE_SCOPE
        if not self._observe_memory(state, memory_generation):
            return WriteOutcome.STALE_MEMORY
        if key in self._entries:
            self._remove(key)
        else:
            # A sweep before evicting a live entry: O(entries), but writes follow a model
            # call that takes far longer, so it is cheap where it happens.
            if len(self._entries) >= self._max_entries:
                self._purge_expired_locked()
            while len(state.keys) >= self._per_player:
                self._remove(next(iter(state.keys)))
            while len(self._entries) >= self._max_entries:
                self._remove(next(iter(self._entries)))
        frozen = types.MappingProxyType(copy.deepcopy(dict(arguments or {})))
        self._entries[key] = CachedIntent(module_id, frozen, self._clock() + self._ttl)
        state.keys[key] = None
        return WriteOutcome.WRITTEN

    def _remove(self, key: _Key) -> None:
        del self._entries[key]
        state = self._players.get(key[0])
        if state is not None:
            state.keys.pop(key, None)

    def _purge_expired_locked(self) -> None:
        now = self._clock()
        expired = [key for key, entry in self._entries.items() if entry.expires_at <= now]
        for key in expired:
            self._remove(key)

    # -- settings -----------------------------------------------------------------------------

    def resize(self, max_entries: int, ttl_seconds: float, per_player: int) -> None:
        """Applies new bounds at once (configuration reload): least recently used entries go
        until both bounds hold. The TTL applies to entries written from now on, as the seed
        says; existing entries keep their expiry."""
        self._check(max_entries, ttl_seconds, per_player)
        with self._lock:
            self._max_entries = max_entries
            self._ttl = float(ttl_seconds)
            self._per_player = per_player
            for state in list(self._players.values()):
                while len(state.keys) > per_player:
                    self._remove(next(iter(state.keys)))
            while len(self._entries) > max_entries:
                self._remove(next(iter(self._entries)))

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
