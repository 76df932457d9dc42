"""Knowledge tests: words (pure), the KnowledgeStore on SQLite (FTS5) and PostgreSQL (full
text), each also with the LIKE scoring SQLite uses without FTS5, and the KnowledgeService
in-process on port 0 behind a real gRPC channel."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, inspect
from sqlalchemy.orm import sessionmaker
from system.storage.v1 import knowledge_pb2, knowledge_pb2_grpc

from services.runtime.errors import InvalidArgument, NotFound
from services.runtime.server import ServiceHost
from storage_service import knowledge_cli
from storage_service.config import StorageConfig
from storage_service.db import Base, make_engine
from storage_service.knowledge import (
    FTS_TABLE,
    KnowledgeHit,
    KnowledgeStore,
    create_search_index,
    drop_search_index,
    include_name,
)
from storage_service.knowledge_files import read_entry, seed_starter, starter
from storage_service.knowledge_servicer import SERVICE_NAME, KnowledgeServicer
from storage_service.knowledge_words import query_tokens, tokens

MAX_BODY = 1000
_CHINESE = re.compile("[\u3400-\u9fff\uf900-\ufaff]")


def _player() -> str:
    return f"p-{uuid.uuid4().hex[:16]}"


def _ids(hits: list[KnowledgeHit]) -> list[str]:
    return [hit.entry.entry_id for hit in hits]


@pytest.fixture(params=["index", "like"])
def store(request: pytest.FixtureRequest, sessions: sessionmaker) -> KnowledgeStore:  # type: ignore[type-arg]
    """The store with its database's index, and with the LIKE scoring of SQLite sans FTS5."""
    return KnowledgeStore(sessions, MAX_BODY, use_index=None if request.param == "index" else False)


# -- words ------------------------------------------------------------------------------------


def test_tokens_normalise_width_case_and_segment_chinese() -> None:
    assert tokens("ＨＥＬＬＯ，世界！ｆｕｒｎａｃｅ　１２３") == ["hello", "世界", "furnace", "123"]
    assert tokens("钻石可以在地下深处的岩浆附近找到")[:2] == ["钻石", "可以"]
    assert "岩浆" in tokens("钻石可以在地下深处的岩浆附近找到")
    assert tokens("Straße iron_ingot C++") == ["strasse", "iron", "ingot", "c"]
    assert tokens("🙂 \x00 \"*'; --") == []
    assert tokens("x" * 100) == ["x" * 64]


def test_query_tokens_drop_question_words_unless_nothing_else() -> None:
    assert query_tokens("钻石在哪里找") == ["钻石", "哪里找"]
    assert query_tokens("Where is the DIAMOND? diamond!") == ["diamond", "diamonds"]
    assert query_tokens("what is it") == ["what", "is", "it"]
    # Words so common that sharing only them says nothing are dropped too.
    assert query_tokens("how do I get diamonds") == ["diamonds", "diamond"]
    assert query_tokens("怎么获得钻石") == ["钻石"]
    # So is the server, which a server's whole knowledge base is about; alone it is kept.
    assert query_tokens("what are the server rules") == ["rules", "rule"]
    assert query_tokens("服务器规则是什么") == ["规则"]
    assert query_tokens("server") == ["server"]
    assert "hose" in query_tokens("whose hose is this")  # an English word is whole


def test_query_words_ask_for_their_other_number_too() -> None:
    assert query_tokens("torches berries boxes") == [
        "torches",
        "torch",
        "berries",
        "berry",
        "boxes",
        "box",
    ]
    assert query_tokens("iron ingot glass") == [
        "iron",
        "irons",
        "ingot",
        "ingots",
        "glass",
        "glasses",
    ]
    assert query_tokens("tnt 123 钻石 bus") == ["tnt", "123", "钻石", "bus"]  # as typed
    assert len(query_tokens(" ".join(f"w{i}" for i in range(100)))) == 32


# -- KnowledgeStore ---------------------------------------------------------------------------


def test_put_returns_the_entry_and_search_finds_it(store: KnowledgeStore) -> None:
    player = _player()
    before = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    entry, created = store.put(player, "k1", "钻石", "钻石在深层", "zh", "https://wiki/钻石")
    assert created is True
    assert (entry.player_id, entry.entry_id, entry.title, entry.body) == (
        player,
        "k1",
        "钻石",
        "钻石在深层",
    )
    (hit,) = store.search(player, "钻石")
    assert hit.score >= 0
    found = hit.entry
    assert (found.language, found.source) == ("zh", "https://wiki/钻石")
    assert found.updated_at.tzinfo is not None
    assert before <= found.updated_at <= dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    assert found == entry


def test_chinese_words_inside_longer_sentences(store: KnowledgeStore) -> None:
    store.put("", "diamond", "钻石", "钻石可以在地下深处的岩浆附近找到", "zh")
    store.put("", "iron", "铁", "铁矿石在山上很常见", "zh")
    store.put("", "netherite", "升级", "用下界合金锭升级钻石装备", "zh")
    assert _ids(store.search("", "钻石在哪里找")) == ["diamond", "netherite"]
    assert _ids(store.search("", "岩浆附近有什么")) == ["diamond"]
    assert _ids(store.search("", "下界合金怎么合成")) == ["netherite"]
    assert _ids(store.search("", "山上有铁矿石吗")) == ["iron"]
    assert store.search("", "红石比较器") == []


def test_english_is_case_insensitive_and_reads_full_width(store: KnowledgeStore) -> None:
    store.put("", "furnace", "Smelting", "Smelt IRON ore in a Furnace", "en")
    store.put("", "wide", "Ｎｅｔｈｅｒｉｔｅ", "ＵＰＧＲＡＤＥ diamond gear", "en")
    for query in ("furnace", "FURNACE", "ｆｕｒｎａｃｅ", "FuRnAcE?", "Iron"):
        assert _ids(store.search("", query)) == ["furnace"], query
    for query in ("netherite", "NETHERITE", "upgrade"):
        assert _ids(store.search("", query)) == ["wide"], query
    assert _ids(store.search("", "how do I smelt iron?")) == ["furnace"]


def test_private_entries_are_never_shown_to_another_player(store: KnowledgeStore) -> None:
    alice, bob = _player(), _player()
    store.put(alice, "base", "基地", "我的秘密基地在钻石矿旁边", "zh")
    store.put("", "guide", "钻石", "钻石在地下深处", "zh")
    assert sorted(_ids(store.search(alice, "钻石"))) == ["base", "guide"]
    assert _ids(store.search(bob, "钻石")) == ["guide"]
    assert _ids(store.search(bob, "秘密基地")) == []
    assert _ids(store.search("", "秘密基地")) == []  # the shared view holds no private entry
    assert all(hit.entry.player_id in ("", bob) for hit in store.search(bob, "钻石 基地", 50))


def test_shared_entries_for_everyone_unless_private_only(store: KnowledgeStore) -> None:
    alice, bob = _player(), _player()
    store.put("", "shared", "", "Creepers explode near players", "en")
    store.put(alice, "mine", "", "My creeper farm is at spawn", "en")
    assert _ids(store.search(bob, "creepers")) == ["shared"]
    assert _ids(store.search(bob, "creepers", private_only=True)) == []
    assert _ids(store.search(alice, "creeper", private_only=True)) == ["mine"]
    assert _ids(store.search("", "creepers")) == ["shared"]


def test_same_entry_id_in_different_scopes_is_independent(store: KnowledgeStore) -> None:
    alice = _player()
    assert store.put("", "k", "", "shared lava text", "en")[1] is True
    assert store.put(alice, "k", "", "private lava text", "en")[1] is True
    bodies = sorted(hit.entry.body for hit in store.search(alice, "lava"))
    assert bodies == ["private lava text", "shared lava text"]
    store.delete(alice, "k")
    assert [hit.entry.body for hit in store.search(alice, "lava")] == ["shared lava text"]


def test_replace_updates_the_index(store: KnowledgeStore) -> None:
    player = _player()
    first, created = store.put(player, "note", "apple", "apple banana", "en")
    assert created is True
    second, created = store.put(player, "note", "西瓜", "西瓜和樱桃", "zh", "me")
    assert created is False
    assert second.updated_at >= first.updated_at
    assert store.search(player, "apple") == []
    assert store.search(player, "banana") == []
    (hit,) = store.search(player, "樱桃")
    assert (hit.entry.title, hit.entry.body, hit.entry.language, hit.entry.source) == (
        "西瓜",
        "西瓜和樱桃",
        "zh",
        "me",
    )


def test_delete_removes_from_the_index(store: KnowledgeStore) -> None:
    player = _player()
    store.put(player, "gone", "", "obsidian portal", "en")
    store.put(player, "kept", "", "obsidian tools", "en")
    store.delete(player, "gone")
    assert _ids(store.search(player, "obsidian portal")) == ["kept"]
    assert store.search(player, "portal") == []
    with pytest.raises(NotFound, match=r"no knowledge entry 'gone' in player p-"):
        store.delete(player, "gone")
    with pytest.raises(NotFound, match="in the shared table"):
        store.delete("", "kept")  # wrong scope


def test_more_relevant_entry_ranks_first(store: KnowledgeStore) -> None:
    store.put("", "trade", "", "钻石可以和村民交易", "zh")
    store.put("", "pick", "", "钻石镐需要三颗钻石和两根木棍", "zh")
    assert _ids(store.search("", "钻石镐怎么做")) == ["pick", "trade"]
    store.put("", "villager", "", "Villagers trade emeralds for diamond armour", "en")
    store.put("", "tool", "", "A diamond pickaxe mines obsidian", "en")
    assert _ids(store.search("", "diamond pickaxe"))[0] == "tool"
    scores = [hit.score for hit in store.search("", "diamond pickaxe")]
    assert scores == sorted(scores, reverse=True)


def test_equal_scores_go_to_the_newest(store: KnowledgeStore) -> None:
    store.put("", "old", "", "same words here", "en")
    store.put("", "new", "", "same words here", "en")
    assert _ids(store.search("", "words")) == ["new", "old"]
    store.put("", "old", "", "same words here", "en")  # rewritten: now the newest
    assert _ids(store.search("", "words")) == ["old", "new"]


def test_limit_defaults_to_ten(store: KnowledgeStore) -> None:
    for i in range(12):
        store.put("", f"e{i}", "", f"redstone circuit {i}", "en")
    assert len(store.search("", "redstone")) == 10
    assert len(store.search("", "redstone", limit=3)) == 3
    assert len(store.search("", "redstone", limit=50)) == 12


def test_punctuation_only_query_finds_nothing(store: KnowledgeStore) -> None:
    store.put("", "p", "", "punctuation ！？ test", "en")
    for query in ("？！。，", "...", "---", "🙂🙂"):
        assert store.search("", query) == [], query


HOSTILE = [
    '"',
    '""',
    "*",
    "diamond*",
    "NEAR(",
    "NEAR(diamond lava, 2)",
    "-",
    "-diamond",
    "OR",
    "AND",
    "NOT",
    "diamond OR",
    "OR diamond AND",
    "'; drop table knowledge_entries; --",
    "search_text:diamond",
    "knowledge_fts:x",
    "^diamond",
    "{search_text}: diamond",
    "diamond + lava",
    "(",
    ")",
    "!diamond & lava | <-> :*",
    "diamond:*A",
    "%",
    "_",
    "\\",
    "'",
    "\x00diamond",
    "🙂💎🔥",
    "钻石\u200b岩浆",
    "💎" * 500,
    ("diamond 钻石 NEAR( \"' * " * 40)[:500],
]


def test_hostile_queries_never_fail(store: KnowledgeStore) -> None:
    store.put("", "d", "", "diamond near lava 钻石 岩浆", "en")
    for query in HOSTILE:
        hits = store.search("", query)
        assert _ids(hits) in ([], ["d"]), query
    assert _ids(store.search("", "NEAR(diamond lava, 2)")) == ["d"]
    assert _ids(store.search("", "diamond")) == ["d"]  # and the index still answers


def test_hostile_text_can_be_stored_and_found(store: KnowledgeStore) -> None:
    for i, text in enumerate(HOSTILE):
        if text.strip() and "\x00" not in text:
            store.put("", f"h{i}", text[:200], f"{text} marker{i}", "en")
    assert _ids(store.search("", "marker3")) == ["h3"]
    assert _ids(store.search("", "drop")) == ["h13"]


def test_clear_removes_only_that_players_entries(store: KnowledgeStore) -> None:
    alice, bob = _player(), _player()
    store.put(alice, "a1", "", "alpha torch", "en")
    store.put(alice, "a2", "", "alpha lamp", "en")
    store.put(bob, "b1", "", "alpha torch", "en")
    store.put("", "s1", "", "alpha torch", "en")
    assert store.clear(alice) == 2
    assert _ids(store.search(alice, "alpha")) == ["s1"]
    assert _ids(store.search(bob, "alpha", private_only=True)) == ["b1"]
    with pytest.raises(InvalidArgument, match="player_id is required"):
        store.clear("")


def test_racing_first_puts_create_once(store: KnowledgeStore) -> None:
    player = _player()
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(
            pool.map(lambda i: store.put(player, "race", "", f"racing body {i}", "en"), range(8))
        )
    assert sum(created for _, created in results) == 1
    assert len(store.search(player, "racing")) == 1


_ANY_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=80),
    # Mostly Chinese, English and the characters FTS5 and tsquery treat as syntax.
    st.text(
        st.sampled_from(
            list("钻石岩浆下界合金铁矿村民交易红石附魔台abcXYZ０１ｆ 、。\"'*-:^()|&!<>")
        ),
        min_size=1,
        max_size=40,
    ),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=_ANY_TEXT.filter(lambda t: t.strip() and "\x00" not in t),
    query=_ANY_TEXT,
    pick=st.integers(0, 1000),
)
def test_any_text_is_findable_by_itself_and_any_query_is_safe(
    store: KnowledgeStore, body: str, query: str, pick: int
) -> None:
    """Index and query agree on words, whatever the database's own tokenizer makes of them:
    an entry is found by its own text, and by any of its non-Chinese words (jieba may split a
    Chinese word differently out of its context, so single Chinese words are not a property).
    No query text fails."""
    player = _player()
    store.put(player, "e", "", body, "en")
    if tokens(body):
        assert _ids(store.search(player, body, private_only=True)) == ["e"]
        latin = [w for w in tokens(body) if not _CHINESE.search(w)]
        if latin:
            word = latin[pick % len(latin)]
            assert _ids(store.search(player, word, private_only=True)) == ["e"], word
    if query.strip():
        store.search(player, query)


def _bad_calls(store: KnowledgeStore) -> list[tuple[object, str]]:
    def put(**changes: object) -> object:
        args: dict[str, object] = {
            "player_id": "p",
            "entry_id": "e",
            "title": "t",
            "body": "b",
            "language": "en",
            "source": "",
        }
        args.update(changes)
        return lambda: store.put(**args)  # type: ignore[arg-type]

    return [
        (put(entry_id=""), "entry_id is required"),
        (put(entry_id="e" * 129), "entry_id is longer than 128"),
        (put(entry_id="a\x00b"), "entry_id must hold printable"),
        (put(entry_id="a\nb"), "entry_id must hold printable"),
        (put(player_id="p" * 65), "player_id is longer than 64"),
        (put(player_id="p\x00"), "player_id must not contain NUL"),
        (put(body=""), "body is required"),
        (put(body="  \n"), "body is required"),
        (put(body="x" * (MAX_BODY + 1)), f"body has {MAX_BODY + 1} characters; the limit is"),
        (put(body="a\x00b"), "body must not contain NUL"),
        (put(title="t" * 201), "title has 201 characters; the limit is 200"),
        (put(language="fr"), "language must be zh or en, got 'fr'"),
        (put(language=""), "language must be zh or en"),
        (put(source="s" * 2049), "source has 2049 characters"),
        (lambda: store.delete("p", ""), "entry_id is required"),
        (lambda: store.delete("p" * 65, "e"), "player_id is longer than 64"),
        (lambda: store.search("p", ""), "query is required"),
        (lambda: store.search("p", "   \n"), "query is required"),
        (lambda: store.search("p", "x" * 501), "query has 501 characters; the limit is 500"),
        (lambda: store.search("p", "x", limit=-1), "limit must be between 0 and 50, got -1"),
        (lambda: store.search("p", "x", limit=51), "limit must be between 0 and 50, got 51"),
        (lambda: store.search("", "x", private_only=True), "private_only needs a player_id"),
    ]


def test_bad_input_is_invalid_argument_and_writes_nothing(store: KnowledgeStore) -> None:
    for call, message in _bad_calls(store):
        with pytest.raises(InvalidArgument) as caught:
            call()  # type: ignore[operator]
        assert message in caught.value.message
    assert store.search("p", "b t") == []
    # Exactly at the limits is fine.
    store.put("p" * 64, "e" * 128, "t" * 200, "x" * MAX_BODY, "zh", "s" * 2048)
    assert len(store.search("p" * 64, "x" * 64 + " " + "y" * 435)) == 1


# -- the index's lifecycle --------------------------------------------------------------------


def test_sqlite_without_the_fts5_table_scores_with_like(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A database made where SQLite lacked FTS5 has no index: search still works, and making
    the index later (what a migration does) indexes the rows already there."""
    engine = make_engine(f"sqlite:///{tmp_path / 'plain.db'}")
    try:
        Base.metadata.create_all(engine)
        with engine.begin() as connection:
            drop_search_index(connection)
        assert FTS_TABLE not in inspect(engine).get_table_names()
        sessions = sessionmaker(engine, expire_on_commit=False)
        plain = KnowledgeStore(sessions)
        plain.put("", "a", "", "钻石可以在地下深处的岩浆附近找到", "zh")
        plain.put("", "b", "", "岩浆很危险", "zh")
        assert _ids(plain.search("", "钻石岩浆")) == ["a", "b"]

        with engine.begin() as connection:
            assert create_search_index(connection) is True
            assert create_search_index(connection) is True  # idempotent
        indexed = KnowledgeStore(sessions)
        assert _ids(indexed.search("", "钻石在哪里")) == ["a"]
        indexed.delete("", "a")
        assert _ids(indexed.search("", "钻石岩浆")) == ["b"]
    finally:
        engine.dispose()


def test_include_name_hides_the_search_index_from_autogenerate(engine: Engine) -> None:
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"compare_type": True, "include_name": include_name}
        )
        differences = compare_metadata(context, Base.metadata)
    assert differences == []


# -- the service, in-process on port 0 -------------------------------------------------------


@pytest.fixture
async def target(database_url: str, engine: Engine) -> AsyncIterator[str]:
    """The KnowledgeService alone on port 0, with a 100-character body limit."""
    servicer = KnowledgeServicer(KnowledgeStore(sessionmaker(engine, expire_on_commit=False), 100))
    host = ServiceHost(
        "storage",
        StorageConfig(
            port=0, metrics_port=-1, drain_seconds=0, grace_seconds=1, database_url=database_url
        ),
        [lambda s: knowledge_pb2_grpc.add_KnowledgeServiceServicer_to_server(servicer, s)],
        [SERVICE_NAME],
    )
    await host.start()
    try:
        yield host.target
    finally:
        await host.stop()


@pytest.fixture
async def channel(target: str) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(target) as channel:
        yield channel


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> knowledge_pb2_grpc.KnowledgeServiceStub:
    return knowledge_pb2_grpc.KnowledgeServiceStub(channel)


def _put(
    player_id: str, entry_id: str, body: str, **fields: str
) -> knowledge_pb2.PutKnowledgeRequest:
    return knowledge_pb2.PutKnowledgeRequest(
        entry=knowledge_pb2.KnowledgeEntry(
            player_id=player_id,
            entry_id=entry_id,
            body=body,
            language=fields.pop("language", "zh"),
            **fields,
        )
    )


async def test_service_round_trip(stub: knowledge_pb2_grpc.KnowledgeServiceStub) -> None:
    player = _player()
    put = await stub.PutKnowledge(
        _put(player, "k1", "钻石可以在地下深处的岩浆附近找到", title="钻石", source="wiki"),
        timeout=10,
    )
    assert put.created is True
    assert (put.entry.player_id, put.entry.entry_id, put.entry.title) == (player, "k1", "钻石")
    assert put.entry.HasField("updated_at")
    again = await stub.PutKnowledge(_put(player, "k1", "钻石在深处"), timeout=10)
    assert again.created is False
    await stub.PutKnowledge(_put("", "shared", "岩浆会烧毁物品"), timeout=10)

    found = await stub.SearchKnowledge(
        knowledge_pb2.SearchKnowledgeRequest(player_id=player, query="钻石在哪里找"), timeout=10
    )
    assert [(h.entry.player_id, h.entry.entry_id, h.entry.body) for h in found.hits] == [
        (player, "k1", "钻石在深处")
    ]
    assert found.hits[0].entry.updated_at.ToDatetime(tzinfo=dt.UTC) <= dt.datetime.now(dt.UTC)
    both = await stub.SearchKnowledge(
        knowledge_pb2.SearchKnowledgeRequest(player_id=player, query="钻石 岩浆"), timeout=10
    )
    assert sorted(h.entry.entry_id for h in both.hits) == ["k1", "shared"]
    private = await stub.SearchKnowledge(
        knowledge_pb2.SearchKnowledgeRequest(player_id=player, query="岩浆", private_only=True),
        timeout=10,
    )
    assert list(private.hits) == []

    await stub.DeleteKnowledge(
        knowledge_pb2.DeleteKnowledgeRequest(player_id=player, entry_id="k1"), timeout=10
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.DeleteKnowledge(
            knowledge_pb2.DeleteKnowledgeRequest(player_id=player, entry_id="k1"), timeout=10
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no knowledge entry 'k1'" in (caught.value.details() or "")


async def test_service_bad_input_and_hostile_queries(
    stub: knowledge_pb2_grpc.KnowledgeServiceStub,
) -> None:
    player = _player()
    await stub.PutKnowledge(_put(player, "ok", "diamond near lava", language="en"), timeout=10)
    bad = [
        ("PutKnowledge", knowledge_pb2.PutKnowledgeRequest(), "entry_id is required"),
        ("PutKnowledge", _put(player, "e", ""), "body is required"),
        ("PutKnowledge", _put(player, "e", "x" * 101), "body has 101 characters"),
        ("PutKnowledge", _put(player, "e", "x", language="de"), "language must be zh or en"),
        ("PutKnowledge", _put(player, "e", "x", title="t" * 201), "title has 201"),
        ("PutKnowledge", _put("p" * 65, "e", "x"), "player_id is longer than 64"),
        ("DeleteKnowledge", knowledge_pb2.DeleteKnowledgeRequest(), "entry_id is required"),
        ("SearchKnowledge", knowledge_pb2.SearchKnowledgeRequest(), "query is required"),
        (
            "SearchKnowledge",
            knowledge_pb2.SearchKnowledgeRequest(query="x" * 501),
            "query has 501 characters",
        ),
        (
            "SearchKnowledge",
            knowledge_pb2.SearchKnowledgeRequest(query="x", limit=51),
            "limit must be between 0 and 50",
        ),
    ]
    good = knowledge_pb2.SearchKnowledgeRequest(player_id=player, query="diamond")
    for method, request, words in bad:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await getattr(stub, method)(request, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert words in (caught.value.details() or ""), (method, caught.value.details())
        # The server keeps serving.
        assert len((await stub.SearchKnowledge(good, timeout=10)).hits) == 1
    for query in HOSTILE:
        response = await stub.SearchKnowledge(
            knowledge_pb2.SearchKnowledgeRequest(player_id=player, query=query), timeout=10
        )
        assert [h.entry.entry_id for h in response.hits] in ([], ["ok"]), query


async def test_service_health(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    response = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


# --- Listing, files, the starter set and the operator's tool --------------------------------


def test_list_pages_one_scope_in_entry_id_order(store: KnowledgeStore) -> None:
    player = _player()
    for n in (3, 1, 2):
        store.put(player, f"e{n}", "", f"body {n}", "en")
    store.put("", "shared", "", "a shared body", "en")
    first, token = store.list_entries(player, 2)
    assert [e.entry_id for e in first] == ["e1", "e2"] and token
    rest, token = store.list_entries(player, 2, token)
    assert [e.entry_id for e in rest] == ["e3"] and token == ""
    assert [e.entry_id for e in store.list_entries("")[0]] == ["shared"]
    with pytest.raises(InvalidArgument, match="page_token is malformed"):
        store.list_entries(player, 2, "not-a-token")
    with pytest.raises(InvalidArgument, match="page_size must be between 0 and 200"):
        store.list_entries(player, 201)


def test_a_file_gives_title_body_and_language(tmp_path: Path) -> None:
    zh = tmp_path / "smelting.md"
    zh.write_text("# 熔炼铁矿\n\n把铁矿石放进熔炉，用煤炭做燃料。\n", encoding="utf-8")
    entry = read_entry(zh)
    assert (entry.entry_id, entry.title, entry.language, entry.source) == (
        "smelting",
        "熔炼铁矿",
        "zh",
        "smelting.md",
    )
    assert entry.body == "把铁矿石放进熔炉，用煤炭做燃料。"
    plain = tmp_path / "note.txt"
    plain.write_text("Iron ore smelts into iron ingots in a furnace.", encoding="utf-8")
    assert read_entry(plain).title == "note" and read_entry(plain).language == "en"
    for name, content, message in [
        ("picture.png", "x", "Markdown or plain text"),
        ("empty.md", "# Only a title\n", "no body"),
    ]:
        (tmp_path / name).write_text(content, encoding="utf-8")
        with pytest.raises(InvalidArgument, match=message):
            read_entry(tmp_path / name)


def test_the_starter_set_fills_an_empty_shared_table_once(store: KnowledgeStore) -> None:
    starters = starter()
    assert {e.language for e in starters} == {"zh", "en"}
    assert all(e.entry_id.startswith("system:") and e.title for e in starters)
    assert seed_starter(store) == len(starters)
    assert seed_starter(store) == 0  # not empty any more: nothing rewritten
    # A question about the assistant finds its answer (among the few best hits).
    assert "system:purchases.en" in _ids(store.search("", "is my purchase charged twice", 3))
    assert "system:purchases.zh" in _ids(store.search("", "购买会重复扣款吗", 3))
    assert "system:privacy.en" in _ids(store.search("", "can I turn the history off", 3))


def test_an_operators_own_entries_keep_the_starter_set_out(store: KnowledgeStore) -> None:
    store.put("", "rules", "Server rules", "No griefing.", "en")
    assert seed_starter(store) == 0
    assert [e.entry_id for e in store.list_entries("")[0]] == ["rules"]


async def test_the_operators_tool_adds_lists_and_removes(
    stub: knowledge_pb2_grpc.KnowledgeServiceStub,
    target: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`python -m storage_service.knowledge_cli` against a real KnowledgeService."""
    note = tmp_path / "rules.md"
    note.write_text("# Server rules\nNo griefing near spawn.\n", encoding="utf-8")
    cli = ["--target", target]
    assert await asyncio.to_thread(knowledge_cli.main, [*cli, "add", str(note)]) == 0
    assert "added rules (en) in the shared table: Server rules" in capsys.readouterr().out
    player = _player()
    assert (
        await asyncio.to_thread(
            knowledge_cli.main, [*cli, "add", str(note), "--player", player, "--id", "mine"]
        )
        == 0
    )
    assert await asyncio.to_thread(knowledge_cli.main, [*cli, "list"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("rules\ten\tServer rules")
    hits = await stub.SearchKnowledge(knowledge_pb2.SearchKnowledgeRequest(query="griefing"))
    assert [h.entry.entry_id for h in hits.hits] == ["rules"]
    assert await asyncio.to_thread(knowledge_cli.main, [*cli, "remove", "rules"]) == 0
    assert await asyncio.to_thread(knowledge_cli.main, [*cli, "remove", "rules"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert await asyncio.to_thread(knowledge_cli.main, [*cli, "add", str(tmp_path)]) == 2
    private = await stub.ListKnowledge(knowledge_pb2.ListKnowledgeRequest(player_id=player))
    assert [e.entry_id for e in private.entries] == ["mine"]
