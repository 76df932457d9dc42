"""Knowledge: a private table per player and the shared `system:knowledge` table, searchable in
Chinese and English. The question module reads it before it ever thinks of the web.

Domain code: no gRPC here.

How text becomes searchable
    `tokens()` turns text into words: NFKC (full-width letters and digits become ASCII) and
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
    after dropping question and function words (哪里, 怎么, the, how) unless nothing else is
    left. Entries in the asking player's language come first (the starter set and many
    operators' documents exist in both), then best first; equal scores go to the most
    recently updated entry.

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
import re
import threading
import unicodedata
from typing import TYPE_CHECKING, Any

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
from storage_service.pages import PageTokens
from storage_service.validation import MAX_PLAYER_ID, check_player_id

if TYPE_CHECKING:
    import jieba

__all__ = [
    "KnowledgeEntry",
    "KnowledgeHit",
    "KnowledgeRow",
    "KnowledgeStore",
    "create_search_index",
    "drop_search_index",
    "include_name",
    "query_tokens",
    "tokens",
    "warm_up",
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
MAX_TOKEN_CHARS = 64
"""Longer words are cut: no real word is that long, and PostgreSQL ignores lexemes over 2 KB."""
MAX_QUERY_TOKENS = 32
"""Distinct words a query uses, first come first used."""

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


# -- words ------------------------------------------------------------------------------------

_HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_RUN = re.compile(r"[^\W_]+")  # letters and digits, any script
_HAN_PARTS = re.compile(f"([{_HAN}]+)")

# Question and function words, and verbs and quantifiers so common that an entry sharing only
# them with a question says nothing about it (get, make, 获得, 需要). Dropped from queries only:
# OR-combined, they would make almost every entry a hit, and the question module must see
# "nothing local" to consider the web.
_STOPWORD_TEXT = """
    的 了 在 是 我 你 他 她 它 我们 你们 他们 这 那 这个 那个 这些 那些 有 和 与 及 或 或者 就 都
    也 还 吗 呢 吧 啊 呀 哦 嘛 么 什么 怎么 怎么样 怎样 如何 为什么 为何 哪 哪里 哪儿 哪个 哪些 谁 几
    多少 请问 请 一下 可以 能 能不能 会 要 想 得 地 着 过 把 被 给 对 从 到 之 其 该 个 做 弄 搞
    a an the is are was were be been being am do does did of to in on at by for from with about
    as into and or not no but if then so what where when which who whom whose why how can could
    should would will shall may might must i me my you your he she it its we our they them their
    this that these those there here please tell
    get gets got getting make makes made making use uses used using need needs want wants know
    have has had having go goes going find finds found some any much many thing things way ways
    work works worked working
    获得 获取 得到 拿到 找到 使用 用 需要 知道 东西 一些 方法 办法
"""
_STOPWORDS = frozenset(_STOPWORD_TEXT.split())

_jieba_lock = threading.Lock()
_jieba: jieba.Tokenizer | None = None


def _segmenter() -> jieba.Tokenizer:
    """jieba, built once on first use (about a second: it loads its bundled dictionary and may
    cache it in the temp dir). A private Tokenizer: words another component adds to the global
    one in this process must not change how knowledge is indexed."""
    global _jieba
    if _jieba is None:
        with _jieba_lock:
            if _jieba is None:
                import jieba

                jieba.setLogLevel(logging.WARNING)
                segmenter = jieba.Tokenizer()
                segmenter.initialize()
                _jieba = segmenter
    return _jieba


def warm_up() -> None:
    """Loads jieba now rather than on the first request."""
    _segmenter()


def _normalise(text: str) -> str:
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())


def tokens(text: str) -> list[str]:
    """The words of `text`, in order, repeats kept: normalised, Han runs segmented by jieba."""
    words: list[str] = []
    for run in _RUN.findall(_normalise(text)):
        for i, part in enumerate(_HAN_PARTS.split(run)):
            if not part:
                continue
            if i % 2:  # a Han run (split() puts captured parts at odd positions)
                words.extend(w for w in _segmenter().lcut_for_search(part) if w.isalnum())
            else:
                words.append(part)
    return [w[:MAX_TOKEN_CHARS] for w in words]


def query_tokens(query: str) -> list[str]:
    """Distinct words of a query, stopwords dropped unless that leaves none, each English word
    followed by its other number (`diamonds` also asks for `diamond`, `torch` for `torches`),
    at most 32."""
    distinct = list(dict.fromkeys(tokens(query)))
    meaningful = [w for w in distinct if w not in _STOPWORDS]
    if not meaningful:
        return distinct[:MAX_QUERY_TOKENS]
    asked = [form for word in meaningful for form in (word, *_other_number(word))]
    return list(dict.fromkeys(asked))[:MAX_QUERY_TOKENS]


_SIBILANT = ("s", "x", "z", "ch", "sh")


def _other_number(word: str) -> tuple[str, ...]:
    """The English singular of a plural word and the plurals of a singular one, by rule (an
    irregular or wrong form only asks for a word no entry holds). Not for Chinese, digits or
    words of fewer than four letters."""
    if len(word) < 4 or not word.isascii() or not word.isalpha():
        return ()
    if word.endswith("ies"):
        return (word[:-3] + "y",)
    if word.endswith("es") and word[:-2].endswith(_SIBILANT):
        return (word[:-2],)
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return (word[:-1],)
    if word.endswith("y") and word[-2] not in "aeiou":
        return (word[:-1] + "ies",)
    if word.endswith(_SIBILANT):
        return (word + "es",)
    return (word + "s",)


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
