"""Player data tests: the session-level document and usage writes and PlayerDataStore on SQLite
and PostgreSQL (races included), and PlayerDataService in-process on port 0."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from sqlalchemy import Column, Engine, MetaData, String, Table, func, select
from sqlalchemy.orm import Session, sessionmaker
from system.common.v1 import common_pb2
from system.storage.v1 import journal_pb2, player_data_pb2, player_data_pb2_grpc

from services.runtime.errors import Aborted, InvalidArgument, NotFound, ResourceExhausted
from services.runtime.server import ServiceHost
from storage_service import player_data
from storage_service.budget_alerts import BudgetAlertClaims
from storage_service.config import StorageConfig
from storage_service.db import Base, HistoryRow, PreferenceRow, make_engine
from storage_service.history import ConversationStore, HistoryBounds
from storage_service.player_data import (
    BindingRow,
    DocumentRow,
    PlayerDataStore,
    UsageRow,
    add_usage,
    check_version,
    delete_document,
    put_document,
)
from storage_service.player_data_servicer import PlayerDataServicer
from storage_service.usage import UsageLedger
from storage_service.usage_spend import SpendView

MAX = 1024
CODEC = "test:raw"
UNBOUND = player_data_pb2.BINDING_STATE_UNBOUND
BOUND = player_data_pb2.BINDING_STATE_BOUND
REVOKED = player_data_pb2.BINDING_STATE_REVOKED
REVOKE = player_data_pb2.RESET_MODE_REVOKE
RESET = player_data_pb2.RESET_MODE_RESET


def _player() -> str:
    # The PostgreSQL database is shared by the whole session, so every test uses fresh players.
    return f"p-{uuid.uuid4()}"


def _key(
    player_id: str, owner: str = "system:sign_in", kind: str = "system:ledger"
) -> journal_pb2.DocumentKey:
    return journal_pb2.DocumentKey(player_id=player_id, owner_module=owner, storage_type=kind)


def _usage(day: str = "", p: int = 0, c: int = 0, m: int = 0, w: int = 0):  # type: ignore[no-untyped-def]
    return journal_pb2.UsageIncrement(
        day=day, prompt_tokens=p, completion_tokens=c, model_calls=m, web_searches=w
    )


@pytest.fixture
def store(sessions: sessionmaker[Session]) -> PlayerDataStore:
    return PlayerDataStore(sessions)


def _put(
    sessions: sessionmaker[Session],
    key: journal_pb2.DocumentKey,
    expected: int,
    data: bytes = b"x",
    codec: str = CODEC,
) -> int:
    with sessions.begin() as session:
        return put_document(session, key, expected, data, codec, MAX)


def _delete(sessions: sessionmaker[Session], key: journal_pb2.DocumentKey, expected: int) -> None:
    with sessions.begin() as session:
        delete_document(session, key, expected)


def _check(sessions: sessionmaker[Session], key: journal_pb2.DocumentKey, expected: int) -> None:
    with sessions.begin() as session:
        check_version(session, key, expected)


# -- documents --------------------------------------------------------------------------------


def test_put_get_delete_round_trip(sessions: sessionmaker[Session], store: PlayerDataStore) -> None:
    key = _key(_player())
    before = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    assert _put(sessions, key, 0, b"\x00\x01first", "system:nbt") == 1
    got = store.get_document(key)
    assert got.key == key
    assert (got.version, got.data, got.codec_id) == (1, b"\x00\x01first", "system:nbt")
    assert before <= got.updated_at.ToDatetime(dt.UTC) <= dt.datetime.now(dt.UTC)

    assert _put(sessions, key, 1, b"second") == 2
    assert _put(sessions, key, 2, b"") == 3  # empty content is content
    got = store.get_document(key)
    assert (got.version, got.data, got.codec_id) == (3, b"", CODEC)
    _check(sessions, key, 3)

    _delete(sessions, key, 3)
    with pytest.raises(NotFound, match="no document"):
        store.get_document(key)
    _check(sessions, key, 0)
    # Written again after a delete, it starts over at version 1.
    assert _put(sessions, key, 0, b"again") == 1


def test_version_conflicts_abort_naming_key_and_versions(sessions: sessionmaker[Session]) -> None:
    key = _key(_player(), kind="system:orders")
    _put(sessions, key, 0)
    cases: list[tuple[Callable[[], object], str, str]] = [
        (lambda: _put(sessions, key, 0), "expected version 0 (absent)", "actual version 1"),
        (lambda: _put(sessions, key, 5), "expected version 5", "actual version 1"),
        (lambda: _delete(sessions, key, 2), "expected version 2", "actual version 1"),
        (lambda: _check(sessions, key, 0), "expected version 0 (absent)", "actual version 1"),
        (lambda: _check(sessions, key, 4), "expected version 4", "actual version 1"),
    ]
    missing = _key(key.player_id, kind="system:missing")
    cases += [
        (lambda: _put(sessions, missing, 1), "expected version 1", "actual version 0 (absent)"),
        (lambda: _delete(sessions, missing, 1), "expected version 1", "actual version 0 (absent)"),
        (lambda: _check(sessions, missing, 1), "expected version 1", "actual version 0 (absent)"),
    ]
    for call, expected, actual in cases:
        with pytest.raises(Aborted) as caught:
            call()
        message = caught.value.message
        assert expected in message and actual in message, message
        assert key.player_id in message and key.owner_module in message, message
    with sessions() as session:
        row = session.get(DocumentRow, (key.player_id, key.owner_module, key.storage_type))
        assert row is not None and row.version == 1


def test_a_failed_operation_leaves_nothing_of_its_transaction(
    sessions: sessionmaker[Session], store: PlayerDataStore
) -> None:
    player = _player()
    first, second = _key(player, kind="system:a"), _key(player, kind="system:b")
    _put(sessions, second, 0)
    with pytest.raises(Aborted), sessions.begin() as session:
        put_document(session, first, 0, b"a", CODEC, MAX)
        add_usage(session, player, _usage("2024-05-01", p=10))
        put_document(session, second, 0, b"b", CODEC, MAX)  # conflicts: second is at 1
    with pytest.raises(NotFound):
        store.get_document(first)
    assert store.get_usage(player, "2024-05-01") == []


def test_bad_document_writes_are_invalid_argument(sessions: sessionmaker[Session]) -> None:
    player = _player()
    good = _key(player)
    bad_keys = [
        (_key(""), "key.player_id is required"),
        (_key("x" * 65), "longer than 64"),
        (_key("a\x00b"), "NUL"),
        (_key("a\nb"), "printable"),
        (_key(player, owner=""), "key.owner_module is required"),
        (_key(player, owner="sign_in"), "namespace:path"),
        (_key(player, owner="System:Sign"), "namespace:path"),
        (_key(player, owner="system:" + "a" * 130), "longer than 128"),
        (_key(player, kind="system:has space"), "key.storage_type"),
        (_key(player, kind=""), "key.storage_type is required"),
    ]
    for key, words in bad_keys:
        for call in (
            lambda k=key: _put(sessions, k, 0),
            lambda k=key: _delete(sessions, k, 1),
            lambda k=key: _check(sessions, k, 0),
        ):
            with pytest.raises(InvalidArgument, match=words):
                call()
    with pytest.raises(InvalidArgument, match=r"1025 bytes, over the 1024 byte limit"):
        _put(sessions, good, 0, b"x" * (MAX + 1))
    assert _put(sessions, good, 0, b"x" * MAX) == 1  # exactly the limit is fine
    with pytest.raises(InvalidArgument, match="codec_id is required"):
        _put(sessions, good, 1, codec="")
    with pytest.raises(InvalidArgument, match="codec_id"):
        _put(sessions, good, 1, codec="a\x00b")
    with pytest.raises(InvalidArgument, match="expected_version"):
        _put(sessions, good, 2**63)
    with pytest.raises(InvalidArgument, match="expected_version of a delete"):
        _delete(sessions, good, 0)
    with sessions() as session:
        assert session.scalar(select(func.count()).where(DocumentRow.player_id == player)) == 1


def _race(sessions: sessionmaker[Session], key: journal_pb2.DocumentKey, expected: int) -> None:
    """Two writers put the same document from the same version at the same moment."""
    barrier = threading.Barrier(2)

    def writer(tag: bytes) -> int | Aborted:
        barrier.wait()
        try:
            with sessions.begin() as session:
                version = put_document(session, key, expected, tag, CODEC, MAX)
                # Hold the transaction open a moment so the other writer runs into it.
                time.sleep(0.005)
                return version
        except Aborted as error:
            return error

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(writer, [b"left", b"right"]))
    won = [o for o in outcomes if isinstance(o, int)]
    lost = [o for o in outcomes if isinstance(o, Aborted)]
    assert won == [expected + 1] and len(lost) == 1, outcomes
    assert f"expected version {expected}" in lost[0].message
    with sessions() as session:
        row = session.get(
            DocumentRow, (key.player_id, key.owner_module, key.storage_type), populate_existing=True
        )
        assert row is not None and row.version == expected + 1


def test_two_writers_racing_on_a_new_document_one_wins(sessions: sessionmaker[Session]) -> None:
    for _ in range(20):
        _race(sessions, _key(_player()), 0)


def test_two_writers_racing_on_an_existing_document_one_wins(
    sessions: sessionmaker[Session],
) -> None:
    key = _key(_player())
    _put(sessions, key, 0)
    for version in range(1, 21):
        _race(sessions, key, version)


def test_check_version_holds_the_document_until_commit(sessions: sessionmaker[Session]) -> None:
    key = _key(_player())
    _put(sessions, key, 0)
    checked = threading.Event()
    committed_at: list[float] = []

    def checker() -> None:
        with sessions.begin() as session:
            check_version(session, key, 1)
            checked.set()
            time.sleep(0.2)
            committed_at.append(time.monotonic())

    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(checker)
        assert checked.wait(10)
        assert _put(sessions, key, 1) == 2  # waits for the checker's transaction to end
        written_at = time.monotonic()
        held.result()
    assert written_at >= committed_at[0]


# -- usage ------------------------------------------------------------------------------------


def test_usage_increments_from_eight_threads_sum_exactly(
    sessions: sessionmaker[Session], store: PlayerDataStore
) -> None:
    player = _player()
    rounds = 15

    def worker(_: int) -> None:
        for _ in range(rounds):
            with sessions.begin() as session:
                add_usage(session, player, _usage("2024-03-01", p=3, c=5, m=1, w=2))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(worker, range(8)))
    [day] = store.get_usage(player, "2024-03-01")
    total = 8 * rounds
    assert (day.prompt_tokens, day.completion_tokens, day.model_calls, day.web_searches) == (
        3 * total,
        5 * total,
        total,
        2 * total,
    )


def test_usage_days_and_ranges(sessions: sessionmaker[Session], store: PlayerDataStore) -> None:
    player, other = _player(), _player()
    with sessions.begin() as session:
        add_usage(session, player, _usage("2024-02-28", p=1))
        add_usage(session, player, _usage("2024-02-29", c=2))
        add_usage(session, player, _usage("2024-03-02", m=3))
        add_usage(session, player, _usage("2024-03-02", w=4, m=1))
        add_usage(session, player, _usage("", p=7))  # today
        add_usage(session, player, _usage("2024-03-05"))  # nothing to add: no row
        add_usage(session, other, _usage("2024-02-29", p=100))
    got = store.get_usage(player, "2024-02-01", "2024-03-31")
    assert [d.day for d in got] == ["2024-02-28", "2024-02-29", "2024-03-02"]
    assert got[2] == player_data_pb2.DailyUsage(day="2024-03-02", model_calls=4, web_searches=4)
    assert [d.day for d in store.get_usage(player, "2024-02-29")] == ["2024-02-29"]
    assert store.get_usage(player, "2024-03-03", "2024-03-31") == []
    today = dt.datetime.now(dt.UTC).date().isoformat()
    assert [(d.day, d.prompt_tokens) for d in store.get_usage(player)] == [(today, 7)]
    # 366 days, both ends included, is the longest range.
    assert len(store.get_usage(player, "2024-01-01", "2024-12-31")) == 3
    with pytest.raises(InvalidArgument, match="367 days"):
        store.get_usage(player, "2023-12-31", "2024-12-31")
    with pytest.raises(InvalidArgument, match="before from_day"):
        store.get_usage(player, "2024-03-02", "2024-03-01")
    for day, words in [
        ("2024-3-01", "YYYY-MM-DD"),
        ("20240301", "YYYY-MM-DD"),
        ("2024-02-30", "not a calendar day"),
        ("２０２４-03-01", "YYYY-MM-DD"),
        ("2024-03-01T00:00", "YYYY-MM-DD"),
    ]:
        with pytest.raises(InvalidArgument, match=words):
            store.get_usage(player, day)
        with pytest.raises(InvalidArgument, match=words):
            store.get_usage(player, "2024-03-01", day)
        with pytest.raises(InvalidArgument, match=f"usage.day.*{words}"), sessions.begin() as s:
            add_usage(s, player, _usage(day, p=1))
    with pytest.raises(InvalidArgument, match="at most"), sessions.begin() as session:
        add_usage(session, player, _usage("2024-03-01", p=2**40 + 1))
    with pytest.raises(InvalidArgument, match="player_id is required"), sessions.begin() as s:
        add_usage(s, "", _usage(p=1))


# -- bindings and reset ----------------------------------------------------------------------


def test_bindings(store: PlayerDataStore) -> None:
    player = _player()
    assert store.get_binding(player) == (UNBOUND, None, [])
    assert store.grant_binding(player) == BOUND
    state, granted_at, _ = store.get_binding(player)
    assert state == BOUND and granted_at is not None
    assert granted_at.tzinfo is not None
    assert store.grant_binding(player) == BOUND
    assert store.get_binding(player) == (BOUND, granted_at, [])  # a second grant changes nothing
    assert store.reset_player(player, REVOKE) == (0, REVOKED)
    state, revoked_at, _ = store.get_binding(player)
    assert state == REVOKED and revoked_at is not None and revoked_at >= granted_at
    assert store.reset_player(player, RESET) == (0, REVOKED)  # RESET keeps the binding
    assert store.grant_binding(player) == BOUND
    assert store.get_binding(player)[0] == BOUND
    assert store.reset_player(player, RESET) == (0, BOUND)
    fresh = _player()
    assert store.reset_player(fresh, RESET) == (0, UNBOUND)
    assert store.get_binding(fresh) == (UNBOUND, None, [])
    assert store.reset_player(fresh, REVOKE) == (0, REVOKED)


def test_usage_of_a_scope_sums_its_players_per_day(store: PlayerDataStore, sessions) -> None:  # type: ignore[no-untyped-def]
    scope = f"srv_{uuid.uuid4().hex[:8]}"
    with sessions.begin() as session:
        add_usage(session, f"{scope}/steve", _usage("2024-05-01", p=10))
        add_usage(session, f"{scope}/alex", _usage("2024-05-01", p=5))
        add_usage(session, f"{scope}/alex", _usage("2024-05-02", p=1))
        # `_` in the scope is a character, not a pattern: srvX... is another server.
        add_usage(session, f"{scope.replace('_', 'X')}/steve", _usage("2024-05-01", p=100))
        add_usage(session, f"{scope}x/steve", _usage("2024-05-01", p=1000))
    days = store.get_usage("", "2024-05-01", "2024-05-02", scope=scope)
    assert [(d.day, d.prompt_tokens) for d in days] == [("2024-05-01", 15), ("2024-05-02", 1)]
    with pytest.raises(InvalidArgument, match="not both"):
        store.get_usage(f"{scope}/steve", "2024-05-01", scope=scope)
    with pytest.raises(InvalidArgument, match="player_id is required"):
        store.get_usage("", "2024-05-01")


def test_features_granted_to_one_player(store: PlayerDataStore) -> None:
    player, other = _player(), _player()
    assert store.set_player_feature(player, "system:search", True) == (["system:search"], True)
    assert store.set_player_feature(player, "system:search", True) == (["system:search"], False)
    assert store.set_player_feature(player, "ftbquests:quests", True)[0] == [
        "ftbquests:quests",
        "system:search",
    ]
    assert store.get_binding(other) == (UNBOUND, None, [])  # grants are the player's alone
    # An operator's decision: a revoke or reset keeps it (the revoked player is refused anyway).
    store.reset_player(player, REVOKE)
    assert store.get_binding(player)[2] == ["ftbquests:quests", "system:search"]
    assert store.set_player_feature(player, "system:search", False) == (["ftbquests:quests"], True)
    assert store.set_player_feature(player, "system:search", False) == (["ftbquests:quests"], False)
    for bad, words in (
        ("", "feature is required"),
        ("Search", "not a feature id"),
        ("system:" + "x" * 64, "not a feature id"),
    ):
        with pytest.raises(InvalidArgument, match=words):
            store.set_player_feature(player, bad, True)
    with pytest.raises(InvalidArgument, match="player_id is required"):
        store.set_player_feature("", "system:search", True)
    for n in range(63):
        store.set_player_feature(other, f"test:f{n}", True)
    store.set_player_feature(other, "test:last", True)
    with pytest.raises(ResourceExhausted, match="64 granted features"):
        store.set_player_feature(other, "test:one-more", True)
    assert len(store.get_binding(other)[2]) == 64


def _seed_player(
    sessions: sessionmaker[Session], conversations: ConversationStore, player: str
) -> int:
    """Gives a player documents, history, preferences, usage and a binding. Returns the number
    of rows ResetPlayer should delete."""
    for owner, kind in [("system:sign_in", "system:ledger"), ("shop:core", "shop:orders/2024")]:
        _put(sessions, _key(player, owner, kind), 0)
    conversations.append(
        player,
        [
            common_pb2.HistoryEntry(role=common_pb2.HISTORY_ROLE_PLAYER, text="hi"),
            common_pb2.HistoryEntry(role=common_pb2.HISTORY_ROLE_ASSISTANT, text="hello"),
        ],
    )
    conversations.update_preferences(player, history_enabled=True, external_enabled=False)
    with sessions.begin() as session:
        add_usage(session, player, _usage("2024-04-01", p=10, m=1))
    PlayerDataStore(sessions).grant_binding(player)
    return 2 + 2 + 1


def _rows(sessions: sessionmaker[Session], player: str) -> dict[str, int]:
    with sessions() as session:
        return {
            row.__tablename__: session.scalar(
                select(func.count()).select_from(row).where(row.player_id == player)
            )
            or 0
            for row in (DocumentRow, HistoryRow, PreferenceRow, UsageRow, BindingRow)
        }


@pytest.mark.parametrize("mode", [REVOKE, RESET])
def test_reset_player_deletes_their_data_only_and_keeps_usage(
    sessions: sessionmaker[Session], store: PlayerDataStore, mode: int
) -> None:
    conversations = ConversationStore(sessions, HistoryBounds(100, 100_000, 1000))
    player, bystander = _player(), _player()
    expected = _seed_player(sessions, conversations, player)
    _seed_player(sessions, conversations, bystander)
    untouched = _rows(sessions, bystander)

    deleted, state = store.reset_player(player, mode)
    assert deleted == expected
    assert state == (REVOKED if mode == REVOKE else BOUND)
    assert _rows(sessions, player) == {
        "player_documents": 0,
        "history_entries": 0,
        "player_preferences": 0,
        "player_usage": 1,
        "player_bindings": 1,
    }
    assert store.get_binding(player)[0] == state
    assert store.get_usage(player, "2024-04-01")[0].prompt_tokens == 10
    assert _rows(sessions, bystander) == untouched
    assert len(store.list_documents(bystander)) == 2
    assert store.reset_player(player, mode) == (0, state)  # nothing left to delete


def test_reset_player_covers_every_table_with_a_player_column(
    engine: Engine, store: PlayerDataStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table added by another module is cleared without being named, unless it opts out;
    the player's lease goes too."""
    suffix = uuid.uuid4().hex[:8]
    extra = Table(
        f"test_extra_{suffix}",
        Base.metadata,
        Column("id", String(64), primary_key=True),
        Column("player_id", String(64)),
    )
    kept = Table(
        f"test_kept_{suffix}",
        Base.metadata,
        Column("id", String(64), primary_key=True),
        Column("player_id", String(64)),
        info={player_data.KEEP_ON_RESET: True},
    )
    leases = Table(
        f"test_leases_{suffix}", MetaData(), Column("name", String(200), primary_key=True)
    )
    try:
        extra.create(engine)
        kept.create(engine)
        leases.create(engine)
        monkeypatch.setattr(player_data, "_leases_table", lambda: leases)
        player, other = _player(), _player()
        with engine.begin() as conn:
            for table in (extra, kept):
                conn.execute(
                    table.insert(),
                    [
                        {"id": "1", "player_id": player},
                        {"id": "2", "player_id": player},
                        {"id": "3", "player_id": other},
                    ],
                )
            conn.execute(
                leases.insert(),
                [{"name": f"player:{player}"}, {"name": f"player:{other}"}, {"name": "task:t1"}],
            )
        assert store.reset_player(player, RESET) == (3, UNBOUND)
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(extra)) == 1
            assert conn.scalar(select(func.count()).select_from(kept)) == 3
            assert sorted(conn.scalars(select(leases.c.name))) == sorted(
                [f"player:{other}", "task:t1"]
            )
    finally:
        Base.metadata.remove(extra)
        Base.metadata.remove(kept)
        for table in (extra, kept, leases):
            table.drop(engine, checkfirst=True)


def test_store_rejects_bad_input(store: PlayerDataStore) -> None:
    player = _player()
    calls: list[tuple[Callable[[], object], str]] = [
        (lambda: store.get_document(_key("")), "key.player_id is required"),
        (lambda: store.get_document(_key(player, owner="x")), "key.owner_module"),
        (lambda: store.list_documents(""), "player_id is required"),
        (lambda: store.list_documents(player, "Bad Module"), "owner_module"),
        (lambda: store.get_usage(""), "player_id is required"),
        (lambda: store.grant_binding("x" * 65), "longer than 64"),
        (lambda: store.get_binding("a\x00"), "NUL"),
        (lambda: store.reset_player("", REVOKE), "player_id is required"),
        (lambda: store.reset_player(player, 0), "mode must be"),
        (lambda: store.reset_player(player, 99), "mode must be"),
    ]
    for call, words in calls:
        with pytest.raises(InvalidArgument, match=words):
            call()
    assert store.get_binding(player) == (UNBOUND, None, [])


def test_list_documents_orders_and_filters(
    sessions: sessionmaker[Session], store: PlayerDataStore
) -> None:
    player = _player()
    for owner, kind in [("b:m", "b:y"), ("a:m", "a:z"), ("b:m", "b:x"), ("a:m", "a:a")]:
        _put(sessions, _key(player, owner, kind), 0, kind.encode())
    _put(sessions, _key(_player(), "a:m", "a:a"), 0)
    listed = store.list_documents(player)
    assert [(d.key.owner_module, d.key.storage_type) for d in listed] == [
        ("a:m", "a:a"),
        ("a:m", "a:z"),
        ("b:m", "b:x"),
        ("b:m", "b:y"),
    ]
    assert [d.data for d in store.list_documents(player, "b:m")] == [b"b:x", b"b:y"]
    assert store.list_documents(player, "c:m") == []
    assert store.list_documents(_player()) == []


# -- the service, in-process on port 0 -------------------------------------------------------


@pytest.fixture
async def service(
    database_url: str,
) -> AsyncIterator[tuple[player_data_pb2_grpc.PlayerDataServiceStub, sessionmaker[Session]]]:
    """PlayerDataService on port 0 over a real database, a stub to it, and sessions to seed
    data the way Commit would."""
    engine = make_engine(database_url)
    Base.metadata.create_all(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    servicer = PlayerDataServicer(
        PlayerDataStore(sessions),
        UsageLedger(sessions),
        SpendView(sessions),
        BudgetAlertClaims(sessions),
    )
    host = ServiceHost(
        "storage",
        StorageConfig(
            port=0, metrics_port=-1, drain_seconds=0, grace_seconds=1, database_url=database_url
        ),
        [lambda s: player_data_pb2_grpc.add_PlayerDataServiceServicer_to_server(servicer, s)],
        ["system.storage.v1.PlayerDataService"],
    )
    try:
        await host.start()
        async with grpc.aio.insecure_channel(host.target) as channel:
            yield player_data_pb2_grpc.PlayerDataServiceStub(channel), sessions
    finally:
        await host.stop()
        engine.dispose()


async def test_service_round_trip(
    service: tuple[player_data_pb2_grpc.PlayerDataServiceStub, sessionmaker[Session]],
) -> None:
    stub, sessions = service
    player = _player()
    key = _key(player)
    _put(sessions, key, 0, b"v1")
    _put(sessions, key, 1, "签到 ✓".encode())
    _put(sessions, _key(player, "shop:core", "shop:orders"), 0, b"o")
    with sessions.begin() as session:
        add_usage(session, player, _usage("2024-06-01", p=12, c=34, m=2, w=1))

    got = await stub.GetDocument(player_data_pb2.GetDocumentRequest(key=key), timeout=10)
    assert (got.document.key, got.document.version) == (key, 2)
    assert got.document.data.decode() == "签到 ✓"
    assert got.document.codec_id == CODEC and got.document.updated_at.seconds > 0

    listed = await stub.ListDocuments(
        player_data_pb2.ListDocumentsRequest(player_id=player), timeout=10
    )
    assert [d.key.owner_module for d in listed.documents] == ["shop:core", "system:sign_in"]
    listed = await stub.ListDocuments(
        player_data_pb2.ListDocumentsRequest(player_id=player, owner_module="shop:core"),
        timeout=10,
    )
    assert [d.data for d in listed.documents] == [b"o"]

    usage = await stub.GetUsage(
        player_data_pb2.GetUsageRequest(
            player_id=player, from_day="2024-05-01", to_day="2024-06-30"
        ),
        timeout=10,
    )
    assert list(usage.days) == [
        player_data_pb2.DailyUsage(
            day="2024-06-01", prompt_tokens=12, completion_tokens=34, model_calls=2, web_searches=1
        )
    ]

    binding = await stub.GetBinding(player_data_pb2.GetBindingRequest(player_id=player), timeout=10)
    assert binding.state == UNBOUND and not binding.HasField("changed_at")
    granted = await stub.GrantBinding(
        player_data_pb2.GrantBindingRequest(player_id=player), timeout=10
    )
    assert granted.state == BOUND
    binding = await stub.GetBinding(player_data_pb2.GetBindingRequest(player_id=player), timeout=10)
    assert binding.state == BOUND and binding.HasField("changed_at")

    reset = await stub.ResetPlayer(
        player_data_pb2.ResetPlayerRequest(player_id=player, mode=REVOKE), timeout=10
    )
    assert (reset.deleted, reset.state) == (2, REVOKED)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetDocument(player_data_pb2.GetDocumentRequest(key=key), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no document" in (caught.value.details() or "")
    usage = await stub.GetUsage(
        player_data_pb2.GetUsageRequest(player_id=player, from_day="2024-06-01"), timeout=10
    )
    assert usage.days[0].prompt_tokens == 12  # usage survives the revoke


def _bad_calls(player: str) -> list[tuple[str, object, str]]:
    """(method, request, words the message must hold) for each kind of bad input."""
    pb = player_data_pb2
    return [
        ("GetDocument", pb.GetDocumentRequest(), "key.player_id is required"),
        ("GetDocument", pb.GetDocumentRequest(key=_key(player, owner="nocolon")), "owner_module"),
        ("GetDocument", pb.GetDocumentRequest(key=_key(player, kind="")), "storage_type"),
        ("ListDocuments", pb.ListDocumentsRequest(), "player_id is required"),
        (
            "ListDocuments",
            pb.ListDocumentsRequest(player_id=player, owner_module="UPPER:case"),
            "owner_module",
        ),
        ("GetUsage", pb.GetUsageRequest(), "player_id is required"),
        ("GetUsage", pb.GetUsageRequest(player_id=player, from_day="yesterday"), "YYYY-MM-DD"),
        (
            "GetUsage",
            pb.GetUsageRequest(player_id=player, from_day="2020-01-01", to_day="2024-01-01"),
            "at most 366",
        ),
        (
            "GetUsage",
            pb.GetUsageRequest(player_id=player, from_day="2024-01-02", to_day="2024-01-01"),
            "before from_day",
        ),
        ("GrantBinding", pb.GrantBindingRequest(player_id="x" * 65), "longer than 64"),
        ("GetBinding", pb.GetBindingRequest(player_id=""), "player_id is required"),
        ("ResetPlayer", pb.ResetPlayerRequest(player_id=player), "mode must be"),
        ("ResetPlayer", pb.ResetPlayerRequest(mode=REVOKE), "player_id is required"),
    ]


async def test_service_bad_input_is_invalid_argument_and_server_keeps_serving(
    service: tuple[player_data_pb2_grpc.PlayerDataServiceStub, sessionmaker[Session]],
) -> None:
    stub, _ = service
    player = _player()
    for method, request, words in _bad_calls(player):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await getattr(stub, method)(request, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert words in (caught.value.details() or ""), (method, caught.value.details())
        # The server keeps serving: a good call right after succeeds.
        got = await stub.GetBinding(player_data_pb2.GetBindingRequest(player_id=player), timeout=10)
        assert got.state == UNBOUND  # and the bad ResetPlayer did not revoke anyone
