"""Conversation history and preferences: bounded per player, written atomically.

Domain code: no gRPC here. Entries travel as system.common.v1.HistoryEntry messages; the
assistant's result is stored encoded, so replaying it gives back exactly what was shown.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Integer,
    String,
    bindparam,
    delete,
    exists,
    func,
    insert,
    select,
    true,
    update,
)
from sqlalchemy.engine import Row
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql.dml import Delete
from system.common.v1 import common_pb2
from system.storage.v1 import storage_pb2

from services.runtime.errors import InvalidArgument
from storage_service.db import HISTORY, PREFERENCES, rowcount, upsert_ignore
from storage_service.dialect import aware
from storage_service.intent_cache import invalidate as invalidate_intents
from storage_service.ledgers import lock_player
from storage_service.pages import PageTokens
from storage_service.validation import check_player_id

__all__ = ["ConversationStore", "HistoryBounds", "Preferences"]

MAX_PAGE_SIZE = 100
DEFAULT_PAGE_SIZE = 20


@dataclasses.dataclass(frozen=True)
class HistoryBounds:
    """Per-player limits of the history ledger."""

    max_entries: int
    max_bytes: int
    max_text_chars: int


@dataclasses.dataclass(frozen=True)
class Preferences:
    """A player's preferences."""

    history_enabled: bool = True
    external_enabled: bool = True
    conversation_mode: int = 0
    """A `ConversationMode` number; 0 (UNSPECIFIED) follows the server's default."""

    def message(self) -> storage_pb2.PlayerPreferences:
        return storage_pb2.PlayerPreferences(
            history_enabled=self.history_enabled,
            external_enabled=self.external_enabled,
            conversation_mode=cast(common_pb2.ConversationMode, self.conversation_mode),
        )


_PAGES = PageTokens("h")
"""ListHistory's page tokens: an entry's row id."""
_ENTRY_COLUMNS = ["player_id", "role", "text", "result", "request_id", "size_bytes", "created_at"]
_ENTRY_READ_COLUMNS = tuple(
    HISTORY.c[name] for name in ("id", "role", "text", "request_id", "result", "created_at")
)
"""What a read of entries selects (`_entry`; `id` orders pages)."""
_PREFERENCE_COLUMNS = tuple(PREFERENCES.c[field.name] for field in dataclasses.fields(Preferences))
"""A player's preference columns, in `Preferences`' field order."""
_PLAYER = bindparam("player_id", type_=String)
_NEWEST_ENTRY = (
    select(HISTORY.c.request_id, HISTORY.c.seq, HISTORY.c.bytes_through)
    .where(HISTORY.c.player_id == _PLAYER)
    .order_by(HISTORY.c.id.desc())
    .limit(1)
)
# Every interactive run's finish asks it first (a retried finish must not append twice).
_NEWEST_REQUEST_ID = _NEWEST_ENTRY.with_only_columns(HISTORY.c.request_id)
_NEWEST_TOTALS = _NEWEST_ENTRY.with_only_columns(HISTORY.c.seq, HISTORY.c.bytes_through)
"""The running totals of the player's newest entry, which an append goes on from and which
eviction sets every older entry's against."""


def _newest(column: str) -> Any:
    """The player's newest entry's running total `column` (0 without history)."""
    return func.coalesce(_NEWEST_TOTALS.with_only_columns(HISTORY.c[column]).scalar_subquery(), 0)


# Every interactive request appends its exchange, one statement an entry: inserted only if the
# player has not turned history off (the row count says which), its running totals
# one past the player's newest entry's (the entry before it in the same exchange included);
# then one DELETE of what no longer fits. The entries go as one executemany (psycopg sends its
# statements to the server together: one round trip).
_INSERT_IF_ENABLED = (
    insert(HISTORY).from_select(
        [*_ENTRY_COLUMNS, "seq", "bytes_through"],
        select(
            *(bindparam(name, type_=HISTORY.c[name].type) for name in _ENTRY_COLUMNS),
            _newest("seq") + 1,
            _newest("bytes_through") + bindparam("size_bytes", type_=Integer),
        ).where(
            ~exists().where(
                PREFERENCES.c.player_id == _PLAYER,
                PREFERENCES.c.history_enabled.is_(False),
            )
        ),
    )
).execution_options(preserve_rowcount=True)


_BEYOND_EVERY_ID = 2**62
"""Past every entry's id: with no entry that may stay, every entry of the player goes."""


def _evict_statement() -> Delete:
    """Deletes the player's oldest entries until both bounds hold. The entries kept are those
    from the oldest one whose running totals, set against the newest entry's, leave at most
    `max_entries` entries and `max_bytes` bytes from it to the newest: found walking the
    player's entries from the oldest, so an append reads the entries it evicts and one more,
    not the whole history. None fits (a bound lowered below the newest entry): all go."""
    newest = _NEWEST_TOTALS.subquery("newest")
    kept = HISTORY.alias("kept")
    oldest_kept = (
        select(kept.c.id)
        .select_from(kept.join(newest, true()))
        .where(
            kept.c.player_id == _PLAYER,
            newest.c.seq - kept.c.seq < bindparam("max_entries", type_=Integer),
            newest.c.bytes_through - kept.c.bytes_through + kept.c.size_bytes
            <= bindparam("max_bytes", type_=BigInteger),
        )
        .order_by(kept.c.id)
        .limit(1)
        .scalar_subquery()
    )
    return delete(HISTORY).where(
        HISTORY.c.player_id == _PLAYER,
        HISTORY.c.id < func.coalesce(oldest_kept, _BEYOND_EVERY_ID),
    )


_EVICT = _evict_statement()


class ConversationStore:
    """Reads and writes history and preferences. Each method is one transaction."""

    def __init__(self, sessions: sessionmaker[Session], bounds: HistoryBounds) -> None:
        self._sessions = sessions
        self._bounds = bounds

    # -- preferences -----------------------------------------------------------------------

    def get_preferences(self, player_id: str) -> Preferences:
        check_player_id(player_id)
        with self._sessions() as session:
            return self.preferences_in(session, player_id)

    def update_preferences(
        self,
        player_id: str,
        history_enabled: bool | None,
        external_enabled: bool | None,
        conversation_mode: int | None = None,
    ) -> Preferences:
        check_player_id(player_id)
        if conversation_mode is not None and (
            conversation_mode not in common_pb2.ConversationMode.values()
        ):
            raise InvalidArgument(
                f"conversation_mode {conversation_mode} is not a ConversationMode (0..4)"
            )
        with self._sessions.begin() as session:
            # Make sure the row exists before locking it: FOR UPDATE cannot lock a missing row,
            # and two first-time updates would otherwise both insert.
            session.execute(
                upsert_ignore(
                    session, PREFERENCES, player_id=player_id, **dataclasses.asdict(Preferences())
                )
            )
            changes = {
                name: value
                for name, value in (
                    ("history_enabled", history_enabled),
                    ("external_enabled", external_enabled),
                    ("conversation_mode", conversation_mode),
                )
                if value is not None
            }
            mine = PREFERENCES.c.player_id == player_id
            statement = (
                update(PREFERENCES).where(mine).values(**changes).returning(*_PREFERENCE_COLUMNS)
                if changes
                else select(*_PREFERENCE_COLUMNS).where(mine).with_for_update()
            )
            row = session.execute(statement).one()
            invalidate_intents(session, player_id)  # the routers' cached intents go with it
            return Preferences(*row)

    # -- history ---------------------------------------------------------------------------

    def append(self, player_id: str, entries: list[common_pb2.HistoryEntry]) -> tuple[bool, int]:
        """Appends entries atomically. Returns (recorded, evicted)."""
        rows = self.rows(player_id, entries)
        with self._sessions.begin() as session:
            return self.append_in(session, player_id, rows)

    def rows(self, player_id: str, entries: list[common_pb2.HistoryEntry]) -> list[dict[str, Any]]:
        """The entries checked against the bounds, as rows for `append_in`. Raises
        InvalidArgument naming the entry that breaks them."""
        check_player_id(player_id)
        if not entries:
            raise InvalidArgument("entries must hold at least one entry")
        return [self._row(player_id, i, entry) for i, entry in enumerate(entries)]

    def append_in(
        self, session: Session, player_id: str, rows: list[dict[str, Any]]
    ) -> tuple[bool, int]:
        """Appends `rows` (from `rows`) in the session's transaction, unless the player turned
        history off, and evicts what no longer fits. Returns (recorded, evicted)."""
        # Every interactive request appends its exchange: two statements (see
        # _INSERT_IF_ENABLED) rather than ORM objects and a flush. The running totals go on
        # from the newest entry's, so the player's appends take turns (on PostgreSQL at the
        # player's lock, which a grouped FinishRun already holds; SQLite's writers always
        # take turns).
        lock_player(session, player_id)
        inserted = rowcount(session.execute(_INSERT_IF_ENABLED, rows))
        evicted = rowcount(session.execute(_EVICT, self._evict_params(player_id)))
        # No row: the player turned history off (the eviction ran all the same).
        return inserted > 0, evicted

    def newest_request_id(self, session: Session, player_id: str) -> str | None:
        """The request id of the player's newest entry (None: no history)."""
        found = session.execute(_NEWEST_REQUEST_ID, {"player_id": player_id}).first()
        return None if found is None else found[0]

    def tail_in(
        self, session: Session, player_id: str, count: int
    ) -> list[common_pb2.HistoryEntry]:
        """The player's newest `count` entries, oldest first, in the session's transaction."""
        rows = session.execute(
            select(*_ENTRY_READ_COLUMNS)
            .where(HISTORY.c.player_id == player_id)
            .order_by(HISTORY.c.id.desc())
            .limit(count)
        ).all()
        return [_entry(row) for row in reversed(rows)]

    @staticmethod
    def preferences_in(session: Session, player_id: str) -> Preferences:
        """The player's preferences, in the session's transaction."""
        row = session.execute(
            select(*_PREFERENCE_COLUMNS).where(PREFERENCES.c.player_id == player_id)
        ).one_or_none()
        return Preferences() if row is None else Preferences(*row)  # no row: the defaults

    def _row(self, player_id: str, index: int, entry: common_pb2.HistoryEntry) -> dict[str, Any]:
        if entry.role not in (common_pb2.HISTORY_ROLE_PLAYER, common_pb2.HISTORY_ROLE_ASSISTANT):
            raise InvalidArgument(f"entries[{index}].role must be PLAYER or ASSISTANT")
        if len(entry.text) > self._bounds.max_text_chars:
            raise InvalidArgument(
                f"entries[{index}].text has {len(entry.text)} characters; "
                f"the limit is {self._bounds.max_text_chars}"
            )
        if "\x00" in entry.text or "\x00" in entry.request_id:
            # PostgreSQL text cannot hold NUL; reject it the same way on every database.
            raise InvalidArgument(f"entries[{index}] text and request_id must not contain NUL")
        result = entry.result.SerializeToString() if entry.HasField("result") else None
        size = len(entry.text.encode()) + len(result or b"")
        if size > self._bounds.max_bytes:
            raise InvalidArgument(
                f"entries[{index}] encodes to {size} bytes, over the {self._bounds.max_bytes} byte bound"
            )
        return {
            "player_id": player_id,
            "role": entry.role,
            "text": entry.text,
            "result": result,
            "request_id": entry.request_id[:64],
            "size_bytes": size,
            "created_at": dt.datetime.now(dt.UTC),
        }

    def _evict_params(self, player_id: str) -> dict[str, Any]:
        return {
            "player_id": player_id,
            "max_entries": self._bounds.max_entries,
            "max_bytes": self._bounds.max_bytes,
        }

    def list(
        self, player_id: str, page_size: int, page_token: str
    ) -> tuple[list[common_pb2.HistoryEntry], str]:
        """A page of entries, oldest first within the page, and the token for older ones."""
        check_player_id(player_id)
        if page_size < 0:
            raise InvalidArgument("page_size must not be negative")
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        query = select(*_ENTRY_READ_COLUMNS).where(HISTORY.c.player_id == player_id)
        if page_token:
            query = query.where(HISTORY.c.id < _PAGES.decode_number(page_token))
        with self._sessions() as session:
            rows, token = _PAGES.read(
                session, query.order_by(HISTORY.c.id.desc()), size, lambda row: row.id
            )
        return [_entry(row) for row in reversed(rows)], token

    def clear(self, player_id: str) -> int:
        check_player_id(player_id)
        with self._sessions.begin() as session:
            result = session.execute(delete(HISTORY).where(HISTORY.c.player_id == player_id))
            invalidate_intents(session, player_id)  # the routers' cached intents go with it
            return int(rowcount(result) or 0)


def _entry(row: Row[Any]) -> common_pb2.HistoryEntry:
    """The entry a row of `_ENTRY_READ_COLUMNS` holds."""
    # The column holds a HistoryRole number, checked when the entry was appended.
    role = cast(common_pb2.HistoryRole, row.role)
    entry = common_pb2.HistoryEntry(role=role, text=row.text, request_id=row.request_id)
    if row.result is not None:
        entry.result.ParseFromString(row.result)
    entry.created_at.FromDatetime(aware(row.created_at))
    return entry
