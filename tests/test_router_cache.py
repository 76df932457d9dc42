"""The exact intent cache: isolation, bounds, TTL, late writes and that no text is kept."""

from __future__ import annotations

import gc
import threading
import types
from typing import Any

import pytest

from router_service.cache import (
    CachedIntent,
    ClearReason,
    IntentCache,
    PlayerScope,
    WriteOutcome,
)
from router_service.semantic.text import normalize

RUNTIME = "runtime-1"
_CODE = type | types.ModuleType | types.FunctionType | types.BuiltinFunctionType | types.MethodType
TEXT = "where do I get diamonds"
ARGS = {"item": "minecraft:diamond"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write(
    cache: IntentCache,
    scope: PlayerScope,
    text: str = TEXT,
    *,
    memory: int = 1,
    lang: str = "en",
    module: str = "system:item_source",
    model_args: dict[str, Any] | None = None,
    reparsed: dict[str, Any] | None = None,
    read_only: bool = True,
    direct: bool = True,
    runtime: str = RUNTIME,
) -> WriteOutcome:
    model_args = ARGS if model_args is None else model_args
    reparsed = model_args if reparsed is None else reparsed
    return cache.record_success(
        scope, runtime, memory, lang, text, module, model_args, reparsed, read_only, direct
    )


def read(
    cache: IntentCache,
    scope: PlayerScope,
    text: str = TEXT,
    *,
    memory: int = 1,
    lang: str = "en",
    runtime: str = RUNTIME,
) -> CachedIntent | None:
    return cache.get(scope, runtime, memory, lang, text)


def test_hit_returns_module_and_reparsed_arguments() -> None:
    cache = IntentCache()
    alice = cache.scope("s1/alice")
    assert read(cache, alice) is None
    assert write(cache, alice) is WriteOutcome.WRITTEN
    hit = read(cache, alice)
    assert hit is not None
    assert hit.module_id == "system:item_source"
    assert dict(hit.arguments) == ARGS
    assert len(cache) == 1


def test_normalised_variants_share_an_entry() -> None:
    cache = IntentCache()
    alice = cache.scope("alice")
    write(cache, alice, "Where do I get  DIAMONDS ")
    assert read(cache, alice, "where do i get diamonds") is not None
    assert read(cache, alice, "ｗｈｅｒｅ do I get diamonds") is not None  # full-width
    assert read(cache, alice, "where do I get diamond") is None


def test_players_never_share_entries() -> None:
    cache = IntentCache()
    alice, bob = cache.scope("alice"), cache.scope("bob")
    write(cache, alice)
    assert read(cache, bob) is None
    # Forging a scope for another player with a copied generation still misses: the player
    # id is part of the key.
    assert read(cache, PlayerScope("bob", alice.generation)) is None
    assert read(cache, alice) is not None


def test_language_runtime_and_memory_generation_are_part_of_the_key() -> None:
    cache = IntentCache()
    alice = cache.scope("alice")
    write(cache, alice)
    assert read(cache, alice, lang="zh") is None
    assert read(cache, alice, runtime="runtime-2") is None
    assert read(cache, alice, memory=1) is not None


def test_ttl_expires_entries_with_injected_clock() -> None:
    clock = FakeClock()
    cache = IntentCache(ttl_seconds=300, clock=clock)
    alice = cache.scope("alice")
    write(cache, alice)
    clock.now += 299
    assert read(cache, alice) is not None
    clock.now += 1
    assert read(cache, alice) is None
    assert len(cache) == 0


def test_hits_do_not_extend_the_ttl() -> None:
    clock = FakeClock()
    cache = IntentCache(ttl_seconds=10, clock=clock)
    alice = cache.scope("alice")
    write(cache, alice)
    for _ in range(3):
        clock.now += 3
        assert read(cache, alice) is not None
    clock.now += 1
    assert read(cache, alice) is None


def test_global_bound_evicts_least_recently_used() -> None:
    cache = IntentCache(max_entries=3, per_player=10)
    scopes = [cache.scope(f"p{i}") for i in range(4)]
    for scope in scopes[:3]:
        write(cache, scope)
    assert read(cache, scopes[0]) is not None  # p0 becomes most recently used
    write(cache, scopes[3])
    assert read(cache, scopes[1]) is None  # p1 was least recently used
    assert all(read(cache, s) is not None for s in (scopes[0], scopes[2], scopes[3]))
    assert len(cache) == 3


def test_per_player_bound_evicts_only_that_players_oldest() -> None:
    cache = IntentCache(max_entries=100, per_player=2)
    alice, bob = cache.scope("alice"), cache.scope("bob")
    write(cache, bob, "bob asks")
    write(cache, alice, "one")
    write(cache, alice, "two")
    read(cache, alice, "one")  # "two" is now alice's least recently used
    write(cache, alice, "three")
    assert read(cache, alice, "two") is None
    assert read(cache, alice, "one") is not None
    assert read(cache, alice, "three") is not None
    assert read(cache, bob, "bob asks") is not None
    assert len(cache) == 3  # alice's two and bob's one


def test_resize_trims_at_once_and_new_ttl_applies_to_new_entries() -> None:
    clock = FakeClock()
    cache = IntentCache(max_entries=10, ttl_seconds=100, per_player=10, clock=clock)
    alice, bob = cache.scope("alice"), cache.scope("bob")
    for i in range(4):
        write(cache, alice, f"a{i}")
    write(cache, bob, "b0")
    cache.resize(max_entries=2, ttl_seconds=10, per_player=3)
    assert len(cache) == 2
    assert read(cache, bob, "b0") is not None
    assert read(cache, alice, "a3") is not None
    write(cache, bob, "b1")  # written under the new 10 s TTL
    clock.now += 50
    assert read(cache, bob, "b1") is None
    assert read(cache, alice, "a3") is not None
    with pytest.raises(ValueError, match="per_player must be positive"):
        cache.resize(max_entries=2, ttl_seconds=10, per_player=0)


def test_clear_player_drops_entries_and_late_writes() -> None:
    cache = IntentCache()
    alice, bob = cache.scope("alice"), cache.scope("bob")
    write(cache, alice, "old")
    write(cache, bob)
    in_flight = cache.scope("alice")  # routing began before the clear
    assert cache.clear_player("alice", ClearReason.MEMORY_CLEARED) == 1
    assert write(cache, in_flight) is WriteOutcome.STALE_SCOPE
    assert read(cache, in_flight) is None
    fresh = cache.scope("alice")
    assert fresh.generation != alice.generation
    assert read(cache, fresh, "old") is None
    assert write(cache, fresh) is WriteOutcome.WRITTEN
    assert read(cache, fresh) is not None
    assert read(cache, bob) is not None  # other players untouched


def test_clear_player_before_any_entry_still_invalidates_scopes() -> None:
    cache = IntentCache()
    in_flight = cache.scope("carol")
    cache.clear_player("carol", ClearReason.DISCONNECTED)
    assert write(cache, in_flight) is WriteOutcome.STALE_SCOPE


def test_stale_memory_generation_write_is_dropped() -> None:
    cache = IntentCache()
    alice = cache.scope("alice")
    write(cache, alice, "before", memory=1)
    assert read(cache, alice, "x", memory=2) is None  # a newer generation is seen
    assert write(cache, alice, memory=1) is WriteOutcome.STALE_MEMORY
    assert len(cache) == 0  # the generation-1 entry can never hit again
    assert write(cache, alice, memory=2) is WriteOutcome.WRITTEN


@pytest.mark.parametrize(
    ("kwargs", "outcome"),
    [
        ({"read_only": False}, WriteOutcome.NOT_READ_ONLY),
        ({"direct": False}, WriteOutcome.NOT_DIRECT),
        ({"reparsed": {"item": "minecraft:emerald"}}, WriteOutcome.ARGUMENTS_DIFFER),
        ({"reparsed": {"item": "minecraft:diamond", "page": 2}}, WriteOutcome.ARGUMENTS_DIFFER),
    ],
)
def test_write_refused(kwargs: dict[str, Any], outcome: WriteOutcome) -> None:
    cache = IntentCache()
    alice = cache.scope("alice")
    assert write(cache, alice, **kwargs) is outcome
    assert len(cache) == 0
    assert read(cache, alice) is None


def test_write_refused_when_arguments_do_not_parse_or_topics_uncovered() -> None:
    cache = IntentCache()
    alice = cache.scope("alice")
    common = (alice, RUNTIME, 1, "en", TEXT, "system:item_source", ARGS)
    assert cache.record_success(*common, None, True, True) is WriteOutcome.ARGUMENTS_UNPARSED
    assert (
        cache.record_success(*common, ARGS, True, True, topics_covered=False)
        is WriteOutcome.TOPIC_GAP
    )
    assert len(cache) == 0


def test_empty_text_is_never_cached() -> None:
    cache = IntentCache()
    alice = cache.scope("alice")
    assert write(cache, alice, " \u3000 ") is WriteOutcome.EMPTY_TEXT
    assert read(cache, alice, "   ") is None


def test_lone_surrogates_hash_without_raising() -> None:
    cache = IntentCache()
    alice = cache.scope("alice")
    assert write(cache, alice, "bad \ud800 text") is WriteOutcome.WRITTEN
    assert read(cache, alice, "bad \ud800 text") is not None


def test_no_text_is_retained() -> None:
    text = "Where can I find " + "ancient debris"  # built at run time, not a shared constant
    cache = IntentCache()
    alice = cache.scope("alice")
    assert write(cache, alice, text, model_args={"item": "minecraft:ancient_debris"}) == (
        WriteOutcome.WRITTEN
    )
    assert read(cache, alice, text) is not None
    forbidden = {text, normalize(text), text.casefold()}
    seen: set[int] = set()
    stack: list[object] = [cache]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, str):
            assert obj not in forbidden
            for part in forbidden:
                assert part not in obj
            continue
        if isinstance(obj, bytes | int | float | bool | type(None) | _CODE):
            continue  # code: classes, modules and functions hold no request data
        stack.extend(gc.get_referents(obj))
    assert 20 < len(seen) < 500  # the walk reached the entries and stayed in the cache


def test_concurrent_use_keeps_bounds() -> None:
    cache = IntentCache(max_entries=50, per_player=5)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(200):
                scope = cache.scope(f"p{(n + i) % 20}")
                write(cache, scope, f"text {i % 13}")
                read(cache, scope, f"text {i % 7}")
                if i % 50 == 0:
                    cache.clear_player(f"p{n}", ClearReason.PREFERENCES_CHANGED)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(cache) <= 50
    for n in range(20):
        scope = cache.scope(f"p{n}")
        held = [read(cache, scope, f"text {i}") for i in range(13)]
        assert sum(entry is not None for entry in held) <= 5


def test_too_many_tracked_players_starts_over() -> None:
    cache = IntentCache(max_tracked_players=3)
    alice = cache.scope("alice")
    write(cache, alice)
    for name in ("p1", "p2", "p3"):
        cache.clear_player(name, ClearReason.DISCONNECTED)
    assert len(cache) == 0
    assert write(cache, alice) is WriteOutcome.STALE_SCOPE


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_entries must be positive"):
        IntentCache(max_entries=0)
    with pytest.raises(ValueError, match="ttl_seconds must be positive"):
        IntentCache(ttl_seconds=-1)
    with pytest.raises(ValueError):
        IntentCache().clear_player("alice", "bogus")  # type: ignore[arg-type]
