"""The routers' shared exact intent cache (system.storage.v1.IntentCacheService, decision 0024).

"This whole normalised text, from this player, meant this read-only module" (seed 004): an
entry saves the router the model call that picks the module. Kept here rather than in each
router process so that every router replica sees the same entries and the same clears.

Two tables. `intent_cache_scopes` holds one row per player who was ever cleared or recorded:
their cache generation. It survives ResetPlayer (KEEP_ON_RESET), so a generation never goes
back and a write routed before a reset can never match again. `intent_cache_entries` holds
the entries: (player, language, SHA-256 of the normalised text) → module, the runtime
generation it was routed under, when it expires and when it was last used. The text itself
is never stored, not even normalised.

`invalidate(session, player_id)` moves the player's generation and drops their entries in the
caller's transaction: ClearHistory, UpdatePreferences, GrantBinding and ResetPlayer call it,
so a clear is atomic with the operation that causes it and never depends on someone
remembering to send one. A RecordIntent names the generation its LookupIntent answered; one
that moved since is dropped (the player cleared their memory while the model was thinking).

Bounds (`IntentCacheBounds`): entries per player, entries in all, and a lifetime; eviction is
least recently used first (a hit counts as a use), expired entries first of all. Every write
also deletes a few of everyone's oldest expired entries (`SWEEP`), so the entries of players
who do not come back never pile up to the global bound (decision 0044).

Every call takes `now` (the storage service's clock), so tests say what time it is.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import NamedTuple

from sqlalchemy import (
    BigInteger,
    DateTime,
    Index,
    LargeBinary,
    String,
    delete,
    func,
    select,
    tuple_,
)
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from services.runtime.errors import InvalidArgument
from storage_service.db import KEEP_ON_RESET, Base, rowcount, table_of, upsert_ignore
from storage_service.dialect import insert_for
from storage_service.validation import MAX_PLAYER_ID, check_id, check_player_id

__all__ = [
    "DIGEST_BYTES",
    "MAX_LANGUAGE",
    "MAX_MODULE_ID",
    "MAX_RUNTIME_GENERATION",
    "IntentCacheBounds",
    "IntentCacheStore",
    "IntentEntryRow",
    "IntentScopeRow",
    "Lookup",
    "Recorded",
    "invalidate",
]

DIGEST_BYTES = 32
"""A SHA-256."""
MAX_LANGUAGE = 8
MAX_MODULE_ID = 128
MAX_RUNTIME_GENERATION = 128


class IntentScopeRow(Base):
    """A player's cache generation; kept by ResetPlayer so it never goes back."""

    __tablename__ = "intent_cache_scopes"
    __table_args__ = {"info": {KEEP_ON_RESET: True}}

    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger)


class IntentEntryRow(Base):
    """One cached intent: a text digest of a player and the module it meant."""

    __tablename__ = "intent_cache_entries"
    __table_args__ = (
        Index("ix_intent_cache_entries_used", "used_at"),
        Index("ix_intent_cache_entries_player_used", "player_id", "used_at"),
        Index("ix_intent_cache_entries_expires", "expires_at"),
    )

    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), primary_key=True)
    language: Mapped[str] = mapped_column(String(MAX_LANGUAGE), primary_key=True)
    text_sha256: Mapped[bytes] = mapped_column(LargeBinary(DIGEST_BYTES), primary_key=True)
    runtime_generation: Mapped[str] = mapped_column(String(MAX_RUNTIME_GENERATION))
    module_id: Mapped[str] = mapped_column(String(MAX_MODULE_ID))
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    used_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


_SCOPES = table_of(IntentScopeRow)
_ENTRIES = table_of(IntentEntryRow)


@dataclasses.dataclass(frozen=True)
class IntentCacheBounds:
    """The cache's bounds (storage settings `intent_cache_*`)."""

    max_entries: int = 65536
    """Most entries in all; least recently used go first."""
    per_player: int = 32
    """Most entries of one player; their least recently used go first."""
    ttl_seconds: float = 300.0
    """Lifetime of an entry from when it was written."""

    def __post_init__(self) -> None:
        for name in ("max_entries", "per_player", "ttl_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"intent cache {name} must be positive")


SWEEP = 16
"""Expired entries, anyone's, that a write deletes besides its own player's: more than the one
entry it adds, so expired entries never pile up, and few enough to cost a write little."""


def _sweep_expired(session: Session, now: dt.datetime) -> int:
    """Deletes up to SWEEP of the oldest expired entries, in one statement. On PostgreSQL rows
    another write is deleting are skipped, not waited for (no lock order to get wrong between
    the two)."""
    key = (_ENTRIES.c.player_id, _ENTRIES.c.language, _ENTRIES.c.text_sha256)
    oldest = (
        select(*key)
        .where(_ENTRIES.c.expires_at <= now)
        .order_by(_ENTRIES.c.expires_at)
        .limit(SWEEP)
        .with_for_update(skip_locked=True)
    )
    return rowcount(session.execute(delete(_ENTRIES).where(tuple_(*key).in_(oldest))))


class Lookup(NamedTuple):
    """What LookupIntent answers."""

    module_id: str | None
    """None: no live entry."""
    generation: int


class Recorded(NamedTuple):
    """What RecordIntent answers."""

    recorded: bool
    evicted: int


def invalidate(session: Session, player_id: str) -> tuple[int, int]:
    """Moves the player's cache generation and drops their entries, in the caller's
    transaction. Returns (entries dropped, the generation now)."""
    inserted = insert_for(session)(_SCOPES).values(player_id=player_id, generation=1)
    session.execute(
        inserted.on_conflict_do_update(
            index_elements=["player_id"], set_={"generation": _SCOPES.c.generation + 1}
        )
    )
    generation = session.scalar(
        select(_SCOPES.c.generation).where(_SCOPES.c.player_id == player_id)
    )
    removed = rowcount(session.execute(delete(_ENTRIES).where(_ENTRIES.c.player_id == player_id)))
    return removed, int(generation or 0)


def _check_key(player_id: str, digest: bytes, language: str, runtime_generation: str) -> None:
    check_player_id(player_id)
    if len(digest) != DIGEST_BYTES:
        raise InvalidArgument(
            f"text_sha256 must be the 32-byte SHA-256 of the normalised text, got {len(digest)} "
            "bytes"
        )
    check_id(language, "language", MAX_LANGUAGE)
    check_id(runtime_generation, "runtime_generation", MAX_RUNTIME_GENERATION)


def _generation(session: Session, player_id: str, *, lock: bool = False) -> int:
    query = select(_SCOPES.c.generation).where(_SCOPES.c.player_id == player_id)
    if lock:
        query = query.with_for_update()
    return int(session.scalar(query) or 0)


class IntentCacheStore:
    """The cache's rules over a database (see the module docstring). Each method is one
    transaction."""

    def __init__(
        self, sessions: sessionmaker[Session], bounds: IntentCacheBounds | None = None
    ) -> None:
        self._sessions = sessions
        self.bounds = bounds or IntentCacheBounds()

    def lookup(
        self,
        player_id: str,
        digest: bytes,
        language: str,
        runtime_generation: str,
        now: dt.datetime,
    ) -> Lookup:
        """The module of the live entry for this key, if any, and the player's generation."""
        _check_key(player_id, digest, language, runtime_generation)
        key = (
            (_ENTRIES.c.player_id == player_id)
            & (_ENTRIES.c.language == language)
            & (_ENTRIES.c.text_sha256 == digest)
        )
        with self._sessions.begin() as session:
            generation = _generation(session, player_id)
            found = session.execute(
                select(_ENTRIES.c.module_id).where(
                    key,
                    _ENTRIES.c.runtime_generation == runtime_generation,
                    _ENTRIES.c.expires_at > now,
                )
            ).scalar_one_or_none()
            if found is not None:
                # Only hits write: most lookups are misses, in front of a model call.
                session.execute(_ENTRIES.update().where(key).values(used_at=now))
        return Lookup(found, generation)

    def record(
        self,
        player_id: str,
        digest: bytes,
        language: str,
        runtime_generation: str,
        module_id: str,
        generation: int,
        now: dt.datetime,
    ) -> Recorded:
        """Writes the entry unless the player's generation moved from `generation`, then
        evicts beyond the bounds."""
        _check_key(player_id, digest, language, runtime_generation)
        check_id(module_id, "module_id", MAX_MODULE_ID)
        if generation < 0:
            raise InvalidArgument(
                f"generation must be the one LookupIntent answered (0 or more), got {generation}"
            )
        bounds = self.bounds
        with self._sessions.begin() as session:
            # The row first, then a lock on it: a concurrent invalidate waits for this write or
            # this write sees its generation (FOR UPDATE cannot lock a missing row; on SQLite
            # the insert takes the database's write lock, which does the same).
            session.execute(upsert_ignore(session, _SCOPES, player_id=player_id, generation=0))
            if _generation(session, player_id, lock=True) != generation:
                return Recorded(False, 0)
            values = {
                "runtime_generation": runtime_generation,
                "module_id": module_id,
                "expires_at": now + dt.timedelta(seconds=bounds.ttl_seconds),
                "used_at": now,
            }
            inserted = insert_for(session)(_ENTRIES).values(
                player_id=player_id, language=language, text_sha256=digest, **values
            )
            session.execute(
                inserted.on_conflict_do_update(
                    index_elements=["player_id", "language", "text_sha256"], set_=values
                )
            )
            evicted = self._evict_player(session, player_id, now)
            evicted += _sweep_expired(session, now)
            evicted += self._evict_all(session, now)
        return Recorded(True, evicted)

    def _evict_player(self, session: Session, player_id: str, now: dt.datetime) -> int:
        mine = _ENTRIES.c.player_id == player_id
        evicted = rowcount(
            session.execute(delete(_ENTRIES).where(mine, _ENTRIES.c.expires_at <= now))
        )
        count = session.scalar(select(func.count()).select_from(_ENTRIES).where(mine)) or 0
        excess = count - self.bounds.per_player
        if excess > 0:
            oldest = (
                select(_ENTRIES.c.language, _ENTRIES.c.text_sha256)
                .where(mine)
                .order_by(_ENTRIES.c.used_at, _ENTRIES.c.text_sha256)
                .limit(excess)
            )
            for language, digest in list(session.execute(oldest)):
                evicted += rowcount(
                    session.execute(
                        delete(_ENTRIES).where(
                            mine, _ENTRIES.c.language == language, _ENTRIES.c.text_sha256 == digest
                        )
                    )
                )
        return evicted

    def _evict_all(self, session: Session, now: dt.datetime) -> int:
        count = session.scalar(select(func.count()).select_from(_ENTRIES)) or 0
        if count <= self.bounds.max_entries:
            return 0
        # Over the bound: expired entries of everyone go first (a sweep, paid only here, after
        # a model call that took far longer), then the least recently used.
        evicted = rowcount(session.execute(delete(_ENTRIES).where(_ENTRIES.c.expires_at <= now)))
        excess = count - evicted - self.bounds.max_entries
        if excess > 0:
            oldest = list(
                session.execute(
                    select(_ENTRIES.c.player_id, _ENTRIES.c.language, _ENTRIES.c.text_sha256)
                    .order_by(_ENTRIES.c.used_at, _ENTRIES.c.player_id, _ENTRIES.c.text_sha256)
                    .limit(excess)
                )
            )
            for player_id, language, digest in oldest:
                evicted += rowcount(
                    session.execute(
                        delete(_ENTRIES).where(
                            _ENTRIES.c.player_id == player_id,
                            _ENTRIES.c.language == language,
                            _ENTRIES.c.text_sha256 == digest,
                        )
                    )
                )
        return evicted

    def clear(self, player_id: str) -> tuple[int, int]:
        """Drops the player's entries and moves their generation: (dropped, generation)."""
        check_player_id(player_id)
        with self._sessions.begin() as session:
            return invalidate(session, player_id)

    def count(self, player_id: str = "") -> int:
        """Entries stored (of one player, or in all), expired ones included: for tests and
        operators."""
        query = select(func.count()).select_from(_ENTRIES)
        if player_id:
            query = query.where(_ENTRIES.c.player_id == player_id)
        with self._sessions() as session:
            return int(session.scalar(query) or 0)
