"""The shared intent cache's rules (storage_service.intent_cache) on SQLite and PostgreSQL:
bounds, expiry, generation fencing of late writes, the clears that come with clearing
history, changing preferences, granting, revoking and resetting, isolation between players,
and input refused with a message that says what to send."""

from __future__ import annotations

import datetime as dt
import hashlib

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from system.storage.v1 import player_data_pb2

from services.runtime.errors import InvalidArgument
from storage_service.db import KEEP_ON_RESET
from storage_service.history import ConversationStore, HistoryBounds
from storage_service.intent_cache import (
    SWEEP,
    IntentCacheBounds,
    IntentCacheStore,
    IntentEntryRow,
    IntentScopeRow,
)
from storage_service.player_data import PlayerDataStore

T0 = dt.datetime(2026, 12, 2, 0, 0, tzinfo=dt.UTC)
RUNTIME = "catalog-1"
STEVE, ALEX = "sim/steve", "sim/alex"


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


@pytest.fixture
def store(sessions: sessionmaker[Session]) -> IntentCacheStore:
    return IntentCacheStore(
        sessions, IntentCacheBounds(max_entries=6, per_player=3, ttl_seconds=60)
    )


def record(
    store: IntentCacheStore,
    player: str,
    text: str,
    when: float = 0,
    *,
    module: str = "system:history",
    generation: int | None = None,
    language: str = "en",
) -> bool:
    if generation is None:
        generation = store.lookup(player, digest(text), language, RUNTIME, at(when)).generation
    return store.record(
        player, digest(text), language, RUNTIME, module, generation, at(when)
    ).recorded


def hit(store: IntentCacheStore, player: str, text: str, when: float = 1, **kw: str) -> str | None:
    language = kw.get("language", "en")
    runtime = kw.get("runtime", RUNTIME)
    return store.lookup(player, digest(text), language, runtime, at(when)).module_id


def test_a_recorded_intent_is_found_for_the_same_player_language_and_runtime_only(
    store: IntentCacheStore,
) -> None:
    assert hit(store, STEVE, "what did we say") is None
    assert record(store, STEVE, "what did we say")
    assert hit(store, STEVE, "what did we say") == "system:history"
    assert hit(store, ALEX, "what did we say") is None  # players never share entries
    assert hit(store, STEVE, "what did we say", language="zh") is None
    assert hit(store, STEVE, "what did we say", runtime="catalog-2") is None
    assert hit(store, STEVE, "something else") is None


def test_no_text_is_stored_only_its_digest(
    store: IntentCacheStore, sessions: sessionmaker[Session]
) -> None:
    record(store, STEVE, "where are my diamonds")
    with sessions() as session:
        rows = list(session.scalars(select(IntentEntryRow)))
    assert [row.text_sha256 for row in rows] == [digest("where are my diamonds")]
    assert "diamonds" not in repr([vars(row) for row in rows])


def test_entries_expire(store: IntentCacheStore) -> None:
    record(store, STEVE, "remind me", when=0)
    assert hit(store, STEVE, "remind me", when=59) == "system:history"
    assert hit(store, STEVE, "remind me", when=60) is None
    # A write again gives it a new lifetime.
    record(store, STEVE, "remind me", when=61)
    assert hit(store, STEVE, "remind me", when=100) == "system:history"


def test_a_player_keeps_at_most_per_player_entries_least_recently_used_going_first(
    store: IntentCacheStore,
) -> None:
    for index, text in enumerate(["a", "b", "c"]):
        record(store, STEVE, text, when=index)
    assert hit(store, STEVE, "a", when=4)  # a is used now; b is the least recently used
    record(store, STEVE, "d", when=5)
    assert store.count(STEVE) == 3
    assert hit(store, STEVE, "b", when=6) is None
    assert {t for t in "acd" if hit(store, STEVE, t, when=6)} == set("acd")


def test_the_global_bound_evicts_expired_entries_then_the_least_recently_used(
    store: IntentCacheStore,
) -> None:
    players = [f"sim/p{i}" for i in range(4)]
    for index, player in enumerate(players):
        record(store, player, "x", when=index)
        record(store, player, "y", when=index)
    assert store.count() == 6  # eight written, max_entries 6
    assert hit(store, players[0], "x", when=10) is None  # p0's went first
    assert hit(store, players[3], "y", when=10) == "system:history"
    # Past the lifetime every old entry is expired: the next write sweeps them.
    record(store, STEVE, "z", when=200)
    record(store, ALEX, "z", when=200)
    for player in players:
        record(store, player, "w", when=201)
    assert store.count() == 6


def test_every_write_sweeps_a_few_of_everyones_expired_entries(
    sessions: sessionmaker[Session],
) -> None:
    """Players who never write again leave expired entries behind; others' writes delete them,
    SWEEP a write, oldest first, long before the global bound would."""
    store = IntentCacheStore(
        sessions, IntentCacheBounds(max_entries=1000, per_player=3, ttl_seconds=60)
    )
    gone = [f"sim/gone{i}" for i in range(SWEEP + 4)]
    for index, player in enumerate(gone):
        record(store, player, "x", when=index / 100)
    record(store, STEVE, "live", when=30)
    assert store.count() == len(gone) + 1
    record(store, ALEX, "a", when=61)  # all of the gone players' entries expired
    assert store.count() == len(gone) - SWEEP + 2
    assert {store.count(player) for player in gone[:SWEEP]} == {0}  # the oldest went first
    assert {store.count(player) for player in gone[SWEEP:]} == {1}
    record(store, ALEX, "b", when=62)
    assert store.count() == 3  # the rest of them; steve's entry is live
    assert hit(store, STEVE, "live", when=62) == "system:history"


def test_a_late_write_under_an_old_generation_is_dropped(store: IntentCacheStore) -> None:
    before = store.lookup(STEVE, digest("remind me"), "en", RUNTIME, at(0)).generation
    removed, after = store.clear(STEVE)
    assert (removed, after) == (0, before + 1)
    # The model answered after the clear: its write names the old generation.
    assert not record(store, STEVE, "remind me", generation=before)
    assert hit(store, STEVE, "remind me") is None
    assert record(store, STEVE, "remind me", generation=after)
    assert store.clear(STEVE)[0] == 1
    assert hit(store, STEVE, "remind me") is None


def test_clears_come_with_history_preferences_grants_revokes_and_resets(
    store: IntentCacheStore, sessions: sessionmaker[Session]
) -> None:
    history = ConversationStore(sessions, HistoryBounds(200, 262_144, 4000))
    players = PlayerDataStore(sessions)
    operations = [
        lambda: history.clear(STEVE),
        lambda: history.update_preferences(STEVE, None, False),
        lambda: players.grant_binding(STEVE),
        lambda: players.reset_player(STEVE, player_data_pb2.RESET_MODE_REVOKE),
        lambda: players.reset_player(STEVE, player_data_pb2.RESET_MODE_RESET),
    ]
    for operation in operations:
        scope = store.lookup(STEVE, digest("remind me"), "en", RUNTIME, at(0)).generation
        assert record(store, STEVE, "remind me", generation=scope)
        assert record(store, ALEX, "remind me")
        operation()
        assert hit(store, STEVE, "remind me") is None
        assert hit(store, ALEX, "remind me") == "system:history"  # another player's stay
        # A write routed before the operation is dropped.
        assert not record(store, STEVE, "remind me", generation=scope)
        assert store.lookup(STEVE, digest("x"), "en", RUNTIME, at(0)).generation > scope


def test_a_reset_never_takes_the_generation_back(
    store: IntentCacheStore, sessions: sessionmaker[Session]
) -> None:
    assert IntentScopeRow.__table__.info == {KEEP_ON_RESET: True}
    store.clear(STEVE)
    store.clear(STEVE)
    old = store.lookup(STEVE, digest("x"), "en", RUNTIME, at(0)).generation
    PlayerDataStore(sessions).reset_player(STEVE, player_data_pb2.RESET_MODE_RESET)
    assert store.lookup(STEVE, digest("x"), "en", RUNTIME, at(0)).generation == old + 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"player": ""}, "player_id is required"),
        ({"player": "x" * 65}, "player_id is longer than 64"),
        ({"digest": b"short"}, "32-byte SHA-256"),
        ({"language": ""}, "language is required"),
        ({"runtime": ""}, "runtime_generation is required"),
        ({"module": ""}, "module_id is required"),
        ({"module": "m" * 129}, "module_id is longer than 128"),
        ({"generation": -1}, "generation must be"),
    ],
)
def test_invalid_input_is_refused_with_what_to_send(
    store: IntentCacheStore, change: dict[str, object], message: str
) -> None:
    args: dict[str, object] = {
        "player": STEVE,
        "digest": digest("x"),
        "language": "en",
        "runtime": RUNTIME,
        "module": "system:history",
        "generation": 0,
        **change,
    }
    with pytest.raises(InvalidArgument, match=message):
        store.record(
            args["player"],  # type: ignore[arg-type]
            args["digest"],  # type: ignore[arg-type]
            args["language"],  # type: ignore[arg-type]
            args["runtime"],  # type: ignore[arg-type]
            args["module"],  # type: ignore[arg-type]
            args["generation"],  # type: ignore[arg-type]
            at(0),
        )
    if "module" not in change and "generation" not in change:
        with pytest.raises(InvalidArgument, match=message):
            store.lookup(
                args["player"],  # type: ignore[arg-type]
                args["digest"],  # type: ignore[arg-type]
                args["language"],  # type: ignore[arg-type]
                args["runtime"],  # type: ignore[arg-type]
                at(0),
            )


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="per_player must be positive"):
        IntentCacheBounds(per_player=0)
