"""Player module data (the seed's ModuleData), daily usage, bindings, and revoke/reset.

Domain code: no gRPC here. A player's module document is keyed by (player, owning module,
storage type) and carries a version that every write bumps by one; writes are compare-and-set
on that version. Document writes, deletes, version checks and usage increments are
session-level functions that run inside a caller's transaction, so JournalService.Commit can
apply them atomically with task and receipt writes; `PlayerDataStore` holds the reads, the
bindings and the reset, one transaction per method.

Concurrency: on SQLite every write transaction starts with BEGIN IMMEDIATE (see db.py), so
writers are serialized. On PostgreSQL (READ COMMITTED) a put of a new document is an
INSERT … ON CONFLICT DO NOTHING whose affected-row count says whether this writer won, a put
or delete of an existing one is an UPDATE/DELETE guarded by `version = expected` (PostgreSQL
re-checks the guard on the newest row after waiting for a concurrent writer), and a version
check locks the row FOR UPDATE so it cannot change before the caller commits.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Date,
    DateTime,
    LargeBinary,
    String,
    Table,
    and_,
    bindparam,
    delete,
    func,
    select,
    update,
)
from sqlalchemy.engine import Row
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.sql.elements import ColumnElement
from system.storage.v1 import journal_pb2, player_data_pb2

from services.runtime.errors import Aborted, InvalidArgument, NotFound
from storage_service.db import KEEP_ON_RESET, Base, rowcount, table_of, upsert_ignore
from storage_service.dialect import advisory_lock, aware, is_postgresql, utc_now
from storage_service.intent_cache import invalidate as invalidate_intents
from storage_service.player_features import player_features, set_player_feature
from storage_service.validation import MAX_PLAYER_ID, check_player_id

__all__ = [
    "BindingRow",
    "DocumentRow",
    "KEEP_ON_RESET",
    "PlayerDataStore",
    "UsageRow",
    "add_usage",
    "check_player_id",
    "check_version",
    "delete_document",
    "parse_day",
    "put_document",
    "validate_key",
]

MAX_IDENTIFIER = 128
MAX_CODEC_ID = 128
MAX_USAGE_DAYS = 366
# One increment above this is a bug in the caller, not usage; it would also bring the BIGINT
# counters within reach of overflow.
MAX_USAGE_INCREMENT = 2**40
# Versions live in a signed BIGINT; the next version must still fit.
MAX_VERSION = 2**63 - 2

IDENTIFIER = re.compile(r"^[a-z0-9_.-]+:[a-z0-9_./-]+$")
DAY = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")

LEASES_TABLE = "leases"


# -- tables ------------------------------------------------------------------------------------


class DocumentRow(Base):
    """One player module document (the seed's ModuleData entry). `data` is opaque bytes that
    the codec named by `codec_id` decodes."""

    __tablename__ = "player_documents"

    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), primary_key=True)
    owner_module: Mapped[str] = mapped_column(String(MAX_IDENTIFIER), primary_key=True)
    storage_type: Mapped[str] = mapped_column(String(MAX_IDENTIFIER), primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    codec_id: Mapped[str] = mapped_column(String(MAX_CODEC_ID))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class UsageRow(Base):
    """A player's usage on one UTC day. Kept when the player is revoked or reset."""

    __tablename__ = "player_usage"
    __table_args__ = {"info": {KEEP_ON_RESET: True}}

    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), primary_key=True)
    day: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    model_calls: Mapped[int] = mapped_column(BigInteger, default=0)
    web_searches: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_cache_hit_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    prompt_cache_miss_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # Held by open reservations (storage_service.usage); released or settled to actual use.
    reserved_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    reserved_web_searches: Mapped[int] = mapped_column(BigInteger, server_default="0")


class BindingRow(Base):
    """A player's binding; absent means UNBOUND. `state` is the lower-case state name
    (`bound`, `revoked`). Kept by ResetPlayer, which sets it itself for REVOKE."""

    __tablename__ = "player_bindings"
    __table_args__ = {"info": {KEEP_ON_RESET: True}}

    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), primary_key=True)
    state: Mapped[str] = mapped_column(String(16))
    changed_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


_DOCS = table_of(DocumentRow)
_USAGE = table_of(UsageRow)
_BINDINGS = table_of(BindingRow)
_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "model_calls", "web_searches")
_SUMMED_USAGE = (*_USAGE_FIELDS, "prompt_cache_hit_tokens", "prompt_cache_miss_tokens")

BOUND = "bound"
REVOKED = "revoked"
_STATES: dict[str, player_data_pb2.BindingState] = {
    BOUND: player_data_pb2.BINDING_STATE_BOUND,
    REVOKED: player_data_pb2.BINDING_STATE_REVOKED,
}


# -- validation --------------------------------------------------------------------------------


def _check_identifier(value: str, field: str) -> None:
    if not value:
        raise InvalidArgument(f"{field} is required (a `namespace:path` identifier)")
    if len(value) > MAX_IDENTIFIER:
        raise InvalidArgument(f"{field} is longer than {MAX_IDENTIFIER} characters")
    if not IDENTIFIER.match(value):
        raise InvalidArgument(
            f"{field} {value!r} is not a `namespace:path` identifier "
            "(lower-case letters, digits, `_.-`, and `/` in the path)"
        )


def validate_key(key: journal_pb2.DocumentKey) -> None:
    """Raises InvalidArgument unless every field of a document key is well formed."""
    check_player_id(key.player_id, "key.player_id")
    _check_identifier(key.owner_module, "key.owner_module")
    _check_identifier(key.storage_type, "key.storage_type")


def _check_codec(codec_id: str) -> None:
    if not codec_id:
        raise InvalidArgument("codec_id is required: name the codec that decodes the data")
    if len(codec_id) > MAX_CODEC_ID:
        raise InvalidArgument(f"codec_id is longer than {MAX_CODEC_ID} characters")
    if not codec_id.isprintable():  # NUL and other control characters included
        raise InvalidArgument("codec_id must hold printable characters only")


def _check_expected(expected_version: int) -> None:
    if expected_version < 0 or expected_version > MAX_VERSION:
        raise InvalidArgument(f"expected_version must be between 0 and {MAX_VERSION}")


def parse_day(day: str, field: str = "day") -> dt.date:
    """A `YYYY-MM-DD` day; empty means today in UTC."""
    if not day:
        return dt.datetime.now(dt.UTC).date()
    if not DAY.match(day):
        raise InvalidArgument(f"{field} must be a day as YYYY-MM-DD, got {day!r}")
    try:
        return dt.date.fromisoformat(day)
    except ValueError:
        raise InvalidArgument(f"{field} {day!r} is not a calendar day") from None


def _describe(key: journal_pb2.DocumentKey) -> str:
    return (
        f"(player_id={key.player_id!r}, owner_module={key.owner_module!r}, "
        f"storage_type={key.storage_type!r})"
    )


def _version_text(version: int) -> str:
    return f"{version} (absent)" if version == 0 else str(version)


def _conflict(key: journal_pb2.DocumentKey, expected: int, actual: int) -> Aborted:
    return Aborted(
        f"version conflict on document {_describe(key)}: expected version "
        f"{_version_text(expected)}, actual version {_version_text(actual)}; "
        "read the document again and retry"
    )


def _key_clause(key: journal_pb2.DocumentKey) -> ColumnElement[bool]:
    return and_(
        _DOCS.c.player_id == key.player_id,
        _DOCS.c.owner_module == key.owner_module,
        _DOCS.c.storage_type == key.storage_type,
    )


def _current_version(session: Session, key: journal_pb2.DocumentKey, lock: bool = False) -> int:
    query = select(_DOCS.c.version).where(_key_clause(key))
    if lock:
        # FOR UPDATE on PostgreSQL; SQLite ignores it (BEGIN IMMEDIATE already serializes).
        query = query.with_for_update()
    version = session.execute(query).scalar_one_or_none()
    return int(version or 0)


# -- session-level writes (inside the caller's transaction; never commit here) ----------------


def _lock_key(session: Session, key: journal_pb2.DocumentKey) -> None:
    """On PostgreSQL, serialises every transaction that checks a document's absence or creates
    it, until that transaction ends. SQLite needs nothing: its write transactions begin
    IMMEDIATE and so run one at a time."""
    if not is_postgresql(session):
        return
    name = "\x1f".join(("document", key.player_id, key.owner_module, key.storage_type))
    session.execute(select(advisory_lock(bindparam("name", type_=String))), {"name": name})


def check_version(session: Session, key: journal_pb2.DocumentKey, expected_version: int) -> None:
    """Raises Aborted unless the document is at `expected_version` (0: must not exist).

    An existing row stays locked until the caller's transaction ends, so it cannot change
    between this check and the commit. A missing row cannot be locked, so on PostgreSQL a check
    for absence takes a transaction-scoped advisory lock on the key, which every creation of
    that document also takes (see `_lock_key`).
    """
    validate_key(key)
    _check_expected(expected_version)
    if expected_version == 0:
        _lock_key(session, key)
    actual = _current_version(session, key, lock=True)
    if actual != expected_version:
        raise _conflict(key, expected_version, actual)


def put_document(
    session: Session,
    key: journal_pb2.DocumentKey,
    expected_version: int,
    data: bytes,
    codec_id: str,
    max_bytes: int,
) -> int:
    """Writes a document when it is at `expected_version` (0: must not exist).

    Returns the new version (1 for a new document). Of two writers racing from the same
    version exactly one succeeds; the other gets Aborted.
    """
    validate_key(key)
    _check_expected(expected_version)
    _check_codec(codec_id)
    if len(data) > max_bytes:
        raise InvalidArgument(
            f"document {_describe(key)} is {len(data)} bytes, over the {max_bytes} byte limit"
        )
    now = utc_now()
    if expected_version == 0:
        _lock_key(session, key)
        # The primary key decides: a concurrent insert of the same key makes this one do
        # nothing (PostgreSQL waits for the other transaction, then sees its row).
        inserted = session.execute(
            upsert_ignore(
                session,
                _DOCS,
                player_id=key.player_id,
                owner_module=key.owner_module,
                storage_type=key.storage_type,
                version=1,
                data=data,
                codec_id=codec_id,
                updated_at=now,
            )
        )
        if rowcount(inserted) != 1:
            raise _conflict(key, 0, _current_version(session, key))
        return 1
    # The guard on the version makes this compare-and-set: the UPDATE locks the row, and a
    # writer that waited on a concurrent one re-checks the guard against its committed row.
    updated = session.execute(
        update(_DOCS)
        .where(_key_clause(key), _DOCS.c.version == expected_version)
        .values(version=expected_version + 1, data=data, codec_id=codec_id, updated_at=now)
    )
    if rowcount(updated) != 1:
        raise _conflict(key, expected_version, _current_version(session, key))
    return expected_version + 1


def delete_document(session: Session, key: journal_pb2.DocumentKey, expected_version: int) -> None:
    """Deletes a document when it is at `expected_version`; Aborted when missing or moved on."""
    validate_key(key)
    _check_expected(expected_version)
    if expected_version == 0:
        raise InvalidArgument(
            f"expected_version of a delete of {_describe(key)} must be the document's "
            "current version (1 or more); 0 means the document must not exist"
        )
    deleted = session.execute(
        delete(_DOCS).where(_key_clause(key), _DOCS.c.version == expected_version)
    )
    if rowcount(deleted) != 1:
        raise _conflict(key, expected_version, _current_version(session, key))


def add_usage(session: Session, player_id: str, increment: journal_pb2.UsageIncrement) -> None:
    """Adds to the player's usage of `increment.day` (empty: today in UTC).

    The row is made first (INSERT … ON CONFLICT DO NOTHING), then each counter is raised in
    the database (`x = x + n`), so concurrent callers never lose an increment.
    """
    check_player_id(player_id)
    day = parse_day(increment.day, "usage.day")
    amounts = {name: getattr(increment, name) for name in _USAGE_FIELDS}
    for name, amount in amounts.items():
        if amount > MAX_USAGE_INCREMENT:
            raise InvalidArgument(
                f"usage.{name} is {amount}; one increment may add at most {MAX_USAGE_INCREMENT}"
            )
    amounts = {name: amount for name, amount in amounts.items() if amount}
    if not amounts:
        return
    session.execute(
        upsert_ignore(
            session,
            _USAGE,
            player_id=player_id,
            day=day,
            **dict.fromkeys(_USAGE_FIELDS, 0),
        )
    )
    session.execute(
        update(_USAGE)
        .where(_USAGE.c.player_id == player_id, _USAGE.c.day == day)
        .values({name: _USAGE.c[name] + amount for name, amount in amounts.items()})
    )


# -- the store --------------------------------------------------------------------------------


def _document(row: Row[*tuple[Any, ...]]) -> journal_pb2.Document:
    document = journal_pb2.Document(
        key=journal_pb2.DocumentKey(
            player_id=row.player_id, owner_module=row.owner_module, storage_type=row.storage_type
        ),
        version=row.version,
        data=row.data,
        codec_id=row.codec_id,
    )
    document.updated_at.FromDatetime(aware(row.updated_at))
    return document


def _daily(row: Row[*tuple[Any, ...]]) -> player_data_pb2.DailyUsage:
    # int(): a SUM comes back as Decimal on PostgreSQL.
    return player_data_pb2.DailyUsage(
        day=row.day.isoformat(), **{name: int(getattr(row, name)) for name in _SUMMED_USAGE}
    )


def _reset_tables() -> Iterable[Table]:
    """Tables whose rows of a player ResetPlayer deletes, dependents before what they refer to.

    Every table of the metadata with a `player_id` column counts, unless its `info` marks it
    KEEP_ON_RESET, so tables added by other modules are covered without being named here.
    """
    for table in reversed(Base.metadata.sorted_tables):
        if "player_id" in table.c and not table.info.get(KEEP_ON_RESET):
            yield table


def _leases_table() -> Table | None:
    """The lease table, when a module that defines it has been imported."""
    return Base.metadata.tables.get(LEASES_TABLE)


class PlayerDataStore:
    """Reads documents and usage; bindings; revoke and reset. Each method is one transaction."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    # -- documents -----------------------------------------------------------------------------

    def get_document(self, key: journal_pb2.DocumentKey) -> journal_pb2.Document:
        validate_key(key)
        with self._sessions() as session:
            row = session.execute(select(_DOCS).where(_key_clause(key))).one_or_none()
        if row is None:
            raise NotFound(f"no document {_describe(key)}")
        return _document(row)

    def list_documents(self, player_id: str, owner_module: str = "") -> list[journal_pb2.Document]:
        """The player's documents, by owning module then storage type."""
        check_player_id(player_id)
        query = select(_DOCS).where(_DOCS.c.player_id == player_id)
        if owner_module:
            _check_identifier(owner_module, "owner_module")
            query = query.where(_DOCS.c.owner_module == owner_module)
        with self._sessions() as session:
            rows = list(session.execute(query))
        # Sorted here, not by ORDER BY: PostgreSQL orders text by the database's collation,
        # which may not be code-point order as on SQLite.
        rows.sort(key=lambda row: (row.owner_module, row.storage_type))
        return [_document(row) for row in rows]

    # -- usage ---------------------------------------------------------------------------------

    def get_usage(
        self, player_id: str, from_day: str = "", to_day: str = "", scope: str = ""
    ) -> list[player_data_pb2.DailyUsage]:
        """Days with any usage in [from_day, to_day], oldest first, of one player or, with
        `scope`, summed over every player whose id is `<scope>/...`. Empty from_day: today;
        empty to_day: from_day."""
        if scope:
            if player_id:
                raise InvalidArgument("set player_id or scope, not both")
            check_player_id(scope, "scope")
        else:
            check_player_id(player_id)
        first = parse_day(from_day, "from_day")
        last = parse_day(to_day, "to_day") if to_day else first
        if last < first:
            raise InvalidArgument(f"to_day {last} is before from_day {first}")
        span = (last - first).days + 1
        if span > MAX_USAGE_DAYS:
            raise InvalidArgument(
                f"the range holds {span} days; ask for at most {MAX_USAGE_DAYS} at a time"
            )
        in_days = _USAGE.c.day.between(first, last)
        if not scope:
            query = select(_USAGE).where(_USAGE.c.player_id == player_id, in_days)
        else:
            # Summed in SQL: a server may have many players. `autoescape`: a scope's own `_`
            # or `%` are characters, not patterns.
            query = (
                select(
                    _USAGE.c.day,
                    *(func.sum(_USAGE.c[name]).label(name) for name in _SUMMED_USAGE),
                )
                .where(_USAGE.c.player_id.startswith(f"{scope}/", autoescape=True), in_days)
                .group_by(_USAGE.c.day)
            )
        with self._sessions() as session:
            return [_daily(row) for row in session.execute(query.order_by(_USAGE.c.day))]

    # -- bindings ------------------------------------------------------------------------------

    def grant_binding(self, player_id: str) -> player_data_pb2.BindingState:
        """Marks the player BOUND; granting a bound player changes nothing. Returns the state."""
        check_player_id(player_id)
        now = utc_now()
        with self._sessions.begin() as session:
            invalidate_intents(session, player_id)  # the routers' cached intents go with it
            inserted = session.execute(
                upsert_ignore(session, _BINDINGS, player_id=player_id, state=BOUND, changed_at=now)
            )
            if rowcount(inserted) != 1:
                session.execute(
                    update(_BINDINGS)
                    .where(_BINDINGS.c.player_id == player_id, _BINDINGS.c.state != BOUND)
                    .values(state=BOUND, changed_at=now)
                )
        return player_data_pb2.BINDING_STATE_BOUND

    def get_binding(
        self, player_id: str
    ) -> tuple[player_data_pb2.BindingState, dt.datetime | None, list[str]]:
        """(state, changed_at, the features granted to the player); a player never granted is
        (UNBOUND, None, ...)."""
        check_player_id(player_id)
        with self._sessions() as session:
            row = session.execute(
                select(_BINDINGS).where(_BINDINGS.c.player_id == player_id)
            ).one_or_none()
            features = player_features(session, player_id)
        if row is None:
            return player_data_pb2.BINDING_STATE_UNBOUND, None, features
        return _state(row.state), aware(row.changed_at), features

    def set_player_feature(
        self, player_id: str, feature: str, granted: bool
    ) -> tuple[list[str], bool]:
        """Grants or takes back one feature of the player (storage_service.player_features);
        returns (their features afterwards, whether anything changed)."""
        with self._sessions.begin() as session:
            features, changed = set_player_feature(session, player_id, feature, granted)
            if changed:
                invalidate_intents(session, player_id)  # the routers' cached intents go with it
            return features, changed

    # -- revoke / reset ------------------------------------------------------------------------

    def reset_player(self, player_id: str, mode: int) -> tuple[int, player_data_pb2.BindingState]:
        """Deletes the player's data in every table but usage and bindings, in one transaction.

        REVOKE also marks the binding REVOKED; RESET leaves it. Returns (rows deleted, binding
        state afterwards).
        """
        check_player_id(player_id)
        if mode not in (player_data_pb2.RESET_MODE_REVOKE, player_data_pb2.RESET_MODE_RESET):
            raise InvalidArgument("mode must be RESET_MODE_REVOKE or RESET_MODE_RESET")
        now = utc_now()
        deleted = 0
        with self._sessions.begin() as session:
            invalidate_intents(session, player_id)  # the routers' cached intents go with it
            for table in _reset_tables():
                result = session.execute(delete(table).where(table.c.player_id == player_id))
                deleted += int(rowcount(result) or 0)
            leases = _leases_table()
            if leases is not None and "name" in leases.c and "player_id" not in leases.c:
                # A player's interactive-run lease is named after them; the lease table has no
                # player column, so it is not covered above.
                result = session.execute(
                    delete(leases).where(leases.c.name == f"player:{player_id}")
                )
                deleted += int(rowcount(result) or 0)
            if mode == player_data_pb2.RESET_MODE_REVOKE:
                inserted = session.execute(
                    upsert_ignore(
                        session, _BINDINGS, player_id=player_id, state=REVOKED, changed_at=now
                    )
                )
                if rowcount(inserted) != 1:
                    session.execute(
                        update(_BINDINGS)
                        .where(_BINDINGS.c.player_id == player_id, _BINDINGS.c.state != REVOKED)
                        .values(state=REVOKED, changed_at=now)
                    )
                return deleted, player_data_pb2.BINDING_STATE_REVOKED
            state = session.execute(
                select(_BINDINGS.c.state).where(_BINDINGS.c.player_id == player_id)
            ).scalar_one_or_none()
        return deleted, (
            _state(state) if state is not None else player_data_pb2.BINDING_STATE_UNBOUND
        )


def _state(name: str) -> player_data_pb2.BindingState:
    try:
        return _STATES[name]
    except KeyError:
        # A value this code never writes: say so instead of guessing a state.
        raise ValueError(f"unknown binding state {name!r} in player_bindings") from None
