"""Knowledge: a private table per player and the shared `system:knowledge` table, searchable in
Chinese and English. The question module reads it before it ever thinks of the web.

Domain code: no gRPC here.

How text becomes searchable
    `tokens()` (storage_service/knowledge_words.py) turns text into words: NFKC (full-width letters and digits become ASCII) and
    casefold, then runs of letters and digits; a run of Han characters is segmented by jieba in
    search mode (a long word also yields its parts, so 中华人民共和国 finds 共和国), any other
    run is one word. An entry's title and body become its `search_text`, the words joined by
    spaces; queries go through the same function, so index and query always agree. Words hold
    only letters and digits, so nothing a player types is ever syntax to FTS5 or tsquery.

The index, per database
    - SQLite with FTS5: the external-content table `knowledge_fts` over `search_text`, kept in
      sync by triggers, so it changes in the same transaction as the row, whatever writes it.
      Ranked by bm25.
    - SQLite without FTS5 (detected when the index is created): no index; an entry scores the
      number of distinct query words its `search_text` holds, matched with LIKE.
    - PostgreSQL: a GIN expression index on `to_tsvector('simple', search_text)` (`simple`:
      our words are already normalised, and stemming would not suit Chinese). Ranked by
      ts_rank. pg_trgm is not used: Chinese words are mostly two characters, shorter than a
      trigram, and whole-word matching is what the tokens already give.

    Query words are OR-combined (a Chinese question rarely shares every word with its answer),
    after dropping question and function words (哪里, 怎么, the, how) and words too common to
    tell entries apart (get, 获得) unless nothing else is left; an English word also asks for
    its other number (diamonds, diamond). Entries in the asking player's language come first
    (the starter set and many operators' documents exist in both), then best first; equal
    scores go to the most recently updated entry.

Schema
    `knowledge_entries` is declared on `Base`, and `Base.metadata.create_all` also builds the
    search index (DDL events). A migration creates the table with `op.create_table` and then
    calls `create_search_index(op.get_bind())`; `drop_search_index` undoes it. Alembic
    autogenerate does not know these objects: pass `include_name` to `context.configure` (and
    to `compare_metadata`) so it leaves them alone.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from typing import Any

from sqlalchemy import (
    Connection,
    DateTime,
    String,
    Text,
    UniqueConstraint,
    case,
    column,
    delete,
    event,
    func,
    literal,
    literal_column,
    or_,
    select,
    table,
    update,
)
from sqlalchemy.engine import Row
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from services.runtime.errors import InvalidArgument, NotFound
from storage_service.db import Base, rowcount, table_of, upsert_ignore
from storage_service.dialect import ID, POSTGRESQL, SQLITE, aware, is_postgresql, name_of
from storage_service.knowledge_words import query_tokens, tokens
from storage_service.pages import PageTokens
from storage_service.validation import MAX_PLAYER_ID, check_player_id

__all__ = [
    "KnowledgeEntry",
    "KnowledgeHit",
    "KnowledgeRow",
    "KnowledgeStore",
    "create_search_index",
    "drop_search_index",
    "include_name",
]

log = logging.getLogger("system.storage.knowledge")

_PAGES = PageTokens("k")
"""ListKnowledge's page tokens: an entry id."""

MAX_ENTRY_ID = 128
MAX_TITLE = 200
MAX_SOURCE = 2048
MAX_QUERY = 500
MAX_LIMIT = 50
DEFAULT_LIMIT = 10
MAX_PAGE = 200
DEFAULT_PAGE = 50
LANGUAGES = ("zh", "en")

FTS_TABLE = "knowledge_fts"
PG_INDEX = "ix_knowledge_entries_search"


class KnowledgeRow(Base):
    """One knowledge entry; `player_id` is empty for the shared `system:knowledge` table."""

    __tablename__ = "knowledge_entries"
    __table_args__ = (UniqueConstraint("player_id", "entry_id", name="uq_knowledge_entries_scope"),)

    # A stable integer key: the FTS5 index refers to rows by it (a plain rowid may change).
    id: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID))
    entry_id: Mapped[str] = mapped_column(String(MAX_ENTRY_ID))
    title: Mapped[str] = mapped_column(String(MAX_TITLE))
    body: Mapped[str] = mapped_column(Text)
    language: Mapped[str] = mapped_column(String(8))
    source: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    search_text: Mapped[str] = mapped_column(Text)
    """Normalised words of title and body, space-separated (see `tokens`)."""


_KNOWLEDGE = table_of(KnowledgeRow)


# -- the search index: DDL usable from create_all and from a migration ------------------------

_SQLITE_FTS = (
    f"CREATE VIRTUAL TABLE {FTS_TABLE} USING fts5(search_text, content='knowledge_entries', "
    "content_rowid='id', tokenize='unicode61 remove_diacritics 0')"
)
_SQLITE_TRIGGERS = (
    f"""CREATE TRIGGER IF NOT EXISTS {FTS_TABLE}_ai AFTER INSERT ON knowledge_entries BEGIN
  INSERT INTO {FTS_TABLE}(rowid, search_text) VALUES (new.id, new.search_text);
END""",
    f"""CREATE TRIGGER IF NOT EXISTS {FTS_TABLE}_ad AFTER DELETE ON knowledge_entries BEGIN
  INSERT INTO {FTS_TABLE}({FTS_TABLE}, rowid, search_text)
    VALUES ('delete', old.id, old.search_text);
END""",
    f"""CREATE TRIGGER IF NOT EXISTS {FTS_TABLE}_au AFTER UPDATE ON knowledge_entries BEGIN
  INSERT INTO {FTS_TABLE}({FTS_TABLE}, rowid, search_text)
    VALUES ('delete', old.id, old.search_text);
  INSERT INTO {FTS_TABLE}(rowid, search_text) VALUES (new.id, new.search_text);
END""",
)
_POSTGRES_INDEX = (
    f"CREATE INDEX IF NOT EXISTS {PG_INDEX} ON knowledge_entries "
    "USING gin (to_tsvector('simple', search_text))"
)


def _sqlite_has_fts_table(connection: Connection) -> bool:
    found = connection.exec_driver_sql(
        f"SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '{FTS_TABLE}'"
    ).first()
    return found is not None


def create_search_index(connection: Connection) -> bool:
    """Creates the search index of `knowledge_entries` (which must exist), idempotently.

    SQLite: the FTS5 table, its sync triggers, and a rebuild from the rows already there.
    PostgreSQL: the GIN expression index. Returns False when SQLite has no FTS5 (searches then
    score with LIKE); a warning is logged.
    """
    dialect = name_of(connection)
    if dialect == POSTGRESQL:
        connection.exec_driver_sql(_POSTGRES_INDEX)
        return True
    if dialect != SQLITE:
        raise ValueError(f"knowledge search supports sqlite and postgresql, not {dialect}")
    created = False
    if not _sqlite_has_fts_table(connection):
        try:
            connection.exec_driver_sql(_SQLITE_FTS)
        except OperationalError as exc:
            if "no such module" not in str(exc):
                raise
            log.warning("SQLite has no FTS5; knowledge search scores words with LIKE instead")
            return False
        created = True
    for statement in _SQLITE_TRIGGERS:
        connection.exec_driver_sql(statement)
    if created:
        # Index the rows that existed before the index did (a migration on a live database).
        connection.exec_driver_sql(f"INSERT INTO {FTS_TABLE}({FTS_TABLE}) VALUES ('rebuild')")
    return True


def drop_search_index(connection: Connection) -> None:
    """Drops what `create_search_index` made, idempotently; the rows stay."""
    if is_postgresql(connection):
        connection.exec_driver_sql(f"DROP INDEX IF EXISTS {PG_INDEX}")
        return
    for suffix in ("ai", "ad", "au"):
        connection.exec_driver_sql(f"DROP TRIGGER IF EXISTS {FTS_TABLE}_{suffix}")
    connection.exec_driver_sql(f"DROP TABLE IF EXISTS {FTS_TABLE}")


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Alembic `include_name` hook: hides the search index objects from autogenerate, which
    would otherwise want to drop them (they are DDL, not declared tables or indexes)."""
    if name is None:
        return True
    if type_ == "table":
        return name != FTS_TABLE and not name.startswith(f"{FTS_TABLE}_")
    if type_ == "index":
        return name != PG_INDEX
    return True


@event.listens_for(_KNOWLEDGE, "after_create")
def _after_create(target: Any, connection: Connection, **kw: Any) -> None:
    create_search_index(connection)


@event.listens_for(_KNOWLEDGE, "before_drop")
def _before_drop(target: Any, connection: Connection, **kw: Any) -> None:
    drop_search_index(connection)


# -- the store --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KnowledgeEntry:
    """A stored entry. `player_id` is empty for the shared table."""

    player_id: str
    entry_id: str
    title: str
    body: str
    language: str
    source: str
    updated_at: dt.datetime


@dataclasses.dataclass(frozen=True)
class KnowledgeHit:
    """A search hit; larger scores are better, comparable only within one search."""

    entry: KnowledgeEntry
    score: float


def _check_entry_id(entry_id: str) -> None:
    if not entry_id:
        raise InvalidArgument("entry_id is required")
    if len(entry_id) > MAX_ENTRY_ID:
        raise InvalidArgument(f"entry_id is longer than {MAX_ENTRY_ID} characters")
    if not entry_id.isprintable():
        raise InvalidArgument("entry_id must hold printable characters only")


def _no_nul(name: str, value: str) -> None:
    # PostgreSQL text cannot hold NUL; reject it the same way on every database.
    if "\x00" in value:
        raise InvalidArgument(f"{name} must not contain NUL characters")


def _scope(player_id: str) -> str:
    return "the shared table" if not player_id else f"player {player_id}'s table"


def _entry(row: Row[Any]) -> KnowledgeEntry:
    """The entry a row of `_KNOWLEDGE`'s columns holds."""
    return KnowledgeEntry(
        player_id=row.player_id,
        entry_id=row.entry_id,
        title=row.title,
        body=row.body,
        language=row.language,
        source=row.source,
        updated_at=aware(row.updated_at),
    )


class KnowledgeStore:
    """Writes and searches knowledge entries. Each method is one transaction.

    Args:
        sessions: session factory bound to the storage engine.
        max_body_chars: longest body (`StorageConfig.max_knowledge_chars`).
        use_index: None finds out (SQLite: whether the FTS5 table exists; PostgreSQL: always
            full text). False scores words with LIKE on any database, which is what SQLite
            without FTS5 gets; tests use it to cover that path on both databases.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        max_body_chars: int = 20_000,
        use_index: bool | None = None,
    ) -> None:
        self._sessions = sessions
        self._max_body_chars = max_body_chars
        self._use_index = use_index

    # -- writes ------------------------------------------------------------------------------

    def put(
        self,
        player_id: str,
        entry_id: str,
        title: str,
        body: str,
        language: str,
        source: str = "",
    ) -> tuple[KnowledgeEntry, bool]:
        """Adds or replaces an entry. Returns it and whether it was new."""
        check_player_id(player_id, required=False)
        _check_entry_id(entry_id)
        if len(title) > MAX_TITLE:
            raise InvalidArgument(f"title has {len(title)} characters; the limit is {MAX_TITLE}")
        if not body.strip():
            raise InvalidArgument("body is required")
        if len(body) > self._max_body_chars:
            raise InvalidArgument(
                f"body has {len(body)} characters; the limit is {self._max_body_chars}"
            )
        if language not in LANGUAGES:
            raise InvalidArgument(f"language must be zh or en, got {language!r}")
        if len(source) > MAX_SOURCE:
            raise InvalidArgument(f"source has {len(source)} characters; the limit is {MAX_SOURCE}")
        for name, value in (("title", title), ("body", body), ("source", source)):
            _no_nul(name, value)
        entry = KnowledgeEntry(
            player_id=player_id,
            entry_id=entry_id,
            title=title,
            body=body,
            language=language,
            source=source,
            updated_at=dt.datetime.now(dt.UTC),
        )
        values = dataclasses.asdict(entry)
        values["search_text"] = " ".join(tokens(f"{title}\n{body}"))
        with self._sessions.begin() as session:
            insert = upsert_ignore(session, _KNOWLEDGE, **values).returning(_KNOWLEDGE.c.id)
            inserted = session.execute(insert).first() is not None
            if not inserted:
                session.execute(
                    update(_KNOWLEDGE)
                    .where(_KNOWLEDGE.c.player_id == player_id, _KNOWLEDGE.c.entry_id == entry_id)
                    .values(**values)
                )
        return entry, inserted

    def delete(self, player_id: str, entry_id: str) -> None:
        """Deletes an entry; NotFound when there is none in that scope."""
        check_player_id(player_id, required=False)
        _check_entry_id(entry_id)
        with self._sessions.begin() as session:
            deleted = rowcount(
                session.execute(
                    delete(_KNOWLEDGE).where(
                        _KNOWLEDGE.c.player_id == player_id, _KNOWLEDGE.c.entry_id == entry_id
                    )
                )
            )
        if not deleted:
            raise NotFound(f"no knowledge entry {entry_id!r} in {_scope(player_id)}")

    def clear(self, player_id: str) -> int:
        """Deletes a player's private entries (revoke/reset); the shared table is never touched.
        Returns how many went."""
        check_player_id(player_id, required=False)
        if not player_id:
            raise InvalidArgument("player_id is required")
        with self._sessions.begin() as session:
            result = session.execute(delete(_KNOWLEDGE).where(_KNOWLEDGE.c.player_id == player_id))
            return int(rowcount(result) or 0)

    def list_entries(
        self, player_id: str, page_size: int = 0, page_token: str = ""
    ) -> tuple[list[KnowledgeEntry], str]:
        """A page of one scope's entries in entry id order, and the next page's token (empty
        on the last): a player's private table, or the shared one for an empty id."""
        check_player_id(player_id, required=False)
        if not 0 <= page_size <= MAX_PAGE:
            raise InvalidArgument(f"page_size must be between 0 and {MAX_PAGE}, got {page_size}")
        after = _PAGES.decode(page_token) if page_token else ""
        size = page_size or DEFAULT_PAGE
        query = select(_KNOWLEDGE).where(_KNOWLEDGE.c.player_id == player_id)
        if after:
            query = query.where(_KNOWLEDGE.c.entry_id > after)
        with self._sessions() as session:
            rows, token = _PAGES.read(
                session, query.order_by(_KNOWLEDGE.c.entry_id), size, lambda row: row.entry_id
            )
        return [_entry(row) for row in rows], token

    # -- search ------------------------------------------------------------------------------

    def search(
        self,
        player_id: str,
        query: str,
        limit: int = 0,
        private_only: bool = False,
        language: str = "",
    ) -> list[KnowledgeHit]:
        """The player's private entries and (unless `private_only`) the shared ones that share
        a word with `query`: those in `language` (the player's, zh or en; empty for no
        preference) first, best first within each. A query without words (punctuation)
        finds nothing."""
        check_player_id(player_id, required=False)
        if language and language not in LANGUAGES:
            raise InvalidArgument(f"language must be zh, en or empty, got {language!r}")
        stripped = query.strip()
        if not stripped:
            raise InvalidArgument("query is required")
        if len(stripped) > MAX_QUERY:
            raise InvalidArgument(f"query has {len(stripped)} characters; the limit is {MAX_QUERY}")
        if not 0 <= limit <= MAX_LIMIT:
            raise InvalidArgument(f"limit must be between 0 and {MAX_LIMIT}, got {limit}")
        if private_only and not player_id:
            raise InvalidArgument("private_only needs a player_id: the shared table has no owner")
        words = query_tokens(stripped)
        if not words:
            return []
        scopes = [player_id] if private_only or not player_id else [player_id, ""]
        with self._sessions() as session:
            statement = self._ranked(session, words, limit or DEFAULT_LIMIT, scopes, language)
            return [
                KnowledgeHit(_entry(row), float(row.score)) for row in session.execute(statement)
            ]

    def _ranked(
        self, session: Session, words: list[str], limit: int, scopes: list[str], language: str
    ) -> Any:
        """SELECT (every column of the entry, score) for the words, `language` first, best
        first, ties newest first."""
        # The preferred language's entries sort first (0 before 1); none preferred: all 0.
        preferred = (case((_KNOWLEDGE.c.language == language, 0), else_=1),) if language else ()
        recency = (_KNOWLEDGE.c.updated_at.desc(), _KNOWLEDGE.c.id.desc())
        in_scope = _KNOWLEDGE.c.player_id.in_(scopes)
        postgresql = is_postgresql(session)
        if self._use_index is None:
            self._use_index = postgresql or _sqlite_has_fts_table(session.connection())
        if self._use_index and not postgresql:
            # Every word quoted: a string, never an operator (words are letters and digits
            # anyway; doubling quotes keeps that true if tokens() ever changes).
            match = " OR ".join('"' + w.replace('"', '""') + '"' for w in words)
            fts = table(FTS_TABLE, column("rowid"))
            bm25 = func.bm25(literal_column(FTS_TABLE))  # smaller is better
            return (
                select(_KNOWLEDGE, (-bm25).label("score"))
                .join(fts, fts.c.rowid == _KNOWLEDGE.c.id)
                .where(literal_column(FTS_TABLE).op("MATCH")(match), in_scope)
                .order_by(*preferred, bm25, *recency)
                .limit(limit)
            )
        if self._use_index:
            # The same expression as the GIN index, so the planner can use it.
            vector = func.to_tsvector(literal_column("'simple'"), _KNOWLEDGE.c.search_text)
            tsquery = func.to_tsquery(
                literal_column("'simple'"), " | ".join(f"'{w}'" for w in words)
            )
            rank = func.ts_rank(vector, tsquery)
            return (
                select(_KNOWLEDGE, rank.label("score"))
                .where(vector.op("@@")(tsquery), in_scope)
                .order_by(*preferred, rank.desc(), *recency)
                .limit(limit)
            )
        # No index: an entry scores how often it holds each query word. With every space
        # doubled, each occurrence is " word " on its own, and removing them all shortens the
        # text by len(word) + 2 per occurrence.
        padded = literal(" ") + _KNOWLEDGE.c.search_text + literal(" ")
        hits = [padded.like(f"% {w} %") for w in words]  # words hold no LIKE wildcards
        doubled = literal(" ") + func.replace(_KNOWLEDGE.c.search_text, " ", "  ") + literal(" ")
        score = sum(
            (
                (func.length(doubled) - func.length(func.replace(doubled, f" {w} ", "")))
                / (len(w) + 2)
                for w in words
            ),
            literal(0),
        )
        return (
            select(_KNOWLEDGE, score.label("score"))
            .where(or_(*hits), in_scope)
            .order_by(*preferred, score.desc(), *recency)
            .limit(limit)
        )
