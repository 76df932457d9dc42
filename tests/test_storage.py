"""Storage service tests: the ConversationStore alone on SQLite and PostgreSQL, the service
in-process on port 0 behind a real gRPC channel, and a property test of the bounded history."""

from __future__ import annotations

import base64
import datetime as dt
import pathlib
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import sessionmaker
from system.common.v1 import common_pb2
from system.storage.v1 import storage_pb2, storage_pb2_grpc

from services.runtime.errors import InvalidArgument
from storage_service.app import SERVICE_NAME, StorageApp, create_app
from storage_service.config import StorageConfig
from storage_service.db import HistoryRow, make_engine
from storage_service.history import ConversationStore, HistoryBounds
from storage_service.migrate import upgrade

PLAYER = common_pb2.HISTORY_ROLE_PLAYER
ASSISTANT = common_pb2.HISTORY_ROLE_ASSISTANT
ROOMY = HistoryBounds(max_entries=1000, max_bytes=1_000_000, max_text_chars=4000)


def _player() -> str:
    # The PostgreSQL database is shared by the whole session, so every test uses fresh players.
    return f"p-{uuid.uuid4()}"


def _entry(text: str, role: int = PLAYER, request_id: str = "") -> common_pb2.HistoryEntry:
    return common_pb2.HistoryEntry(role=role, text=text, request_id=request_id)


def _result() -> common_pb2.AgentResult:
    """An assistant result with every kind of field set, maps and unicode included."""
    return common_pb2.AgentResult(
        status=common_pb2.RESULT_STATUS_PARTIALLY_SUCCEEDED,
        failure=common_pb2.Failure(
            key="system.error.busy", message="try later", args={"resource": "钻石", "n": "3"}
        ),
        card=common_pb2.Card(
            ref=common_pb2.CardRef(card_id="c-1", version=7),
            template="system:help",
            title="帮助 Help",
            lines=[
                common_pb2.CardLine(text="first line"),
                common_pb2.CardLine(text="第二行", suggest_command="/help"),
            ],
            buttons=[
                common_pb2.CardButton(action_id="run:0", label="Run", args={"a": "1", "b": "2"}),
                common_pb2.CardButton(action_id="run:1", label="再来"),
            ],
            speech="hello",
        ),
        text="summary ✓",
        silent=True,
    )


def _texts(entries: list[common_pb2.HistoryEntry]) -> list[str]:
    return [e.text for e in entries]


def _list_all(store: ConversationStore, player_id: str) -> list[common_pb2.HistoryEntry]:
    """Every entry of a player, oldest first, walking the pages."""
    pages: list[list[common_pb2.HistoryEntry]] = []
    token = ""
    while True:
        page, token = store.list(player_id, 100, token)
        pages.append(page)
        if not token:
            break
    return [entry for page in reversed(pages) for entry in page]


def _row_count(engine: Engine, player_id: str) -> int:
    with engine.connect() as conn:
        return conn.execute(
            select(func.count()).where(HistoryRow.player_id == player_id)
        ).scalar_one()


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    upgrade(engine)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def sessions(engine: Engine) -> sessionmaker:  # type: ignore[type-arg]
    return sessionmaker(engine, expire_on_commit=False)


@pytest.fixture
def store(sessions: sessionmaker) -> ConversationStore:  # type: ignore[type-arg]
    return ConversationStore(sessions, ROOMY)


# -- ConversationStore ---------------------------------------------------------------------


def test_append_and_list_round_trip(store: ConversationStore) -> None:
    player = _player()
    question = _entry("你好, what can I do?", PLAYER, "req-1")
    answer = _entry("summary ✓", ASSISTANT, "req-1")
    answer.result.CopyFrom(_result())
    before = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)

    assert store.append(player, [question, answer]) == (True, 0)

    after = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    entries, token = store.list(player, 0, "")
    assert token == ""
    assert [(e.role, e.text, e.request_id) for e in entries] == [
        (PLAYER, "你好, what can I do?", "req-1"),
        (ASSISTANT, "summary ✓", "req-1"),
    ]
    assert not entries[0].HasField("result")
    assert entries[1].result == _result()
    assert entries[1].result.SerializeToString(deterministic=True) == _result().SerializeToString(
        deterministic=True
    )
    for entry in entries:
        assert entry.HasField("created_at")
        created = entry.created_at.ToDatetime(tzinfo=dt.UTC)
        assert created.tzinfo is not None
        assert before <= created <= after


def test_created_at_is_aware_in_the_row(sessions: sessionmaker) -> None:  # type: ignore[type-arg]
    store = ConversationStore(sessions, ROOMY)
    player = _player()
    store.append(player, [_entry("hi")])
    with sessions() as session:
        row = session.scalars(select(HistoryRow).where(HistoryRow.player_id == player)).one()
    # SQLite hands back naive datetimes (stored as UTC); the store must treat them as UTC.
    created = store.list(player, 0, "")[0][0].created_at.ToDatetime(tzinfo=dt.UTC)
    expected = row.created_at if row.created_at.tzinfo else row.created_at.replace(tzinfo=dt.UTC)
    assert created == expected


def test_pagination_walks_everything_newest_page_first(store: ConversationStore) -> None:
    player = _player()
    texts = [f"m{i}" for i in range(23)]
    store.append(player, [_entry(t) for t in texts])

    seen_pages: list[list[str]] = []
    token = ""
    while True:
        page, token = store.list(player, 5, token)
        assert 0 < len(page) <= 5
        seen_pages.append(_texts(page))
        if not token:
            break

    assert seen_pages[0] == texts[-5:]  # newest page first, oldest first within it
    assert [len(p) for p in seen_pages] == [5, 5, 5, 5, 3]
    flat = [t for page in reversed(seen_pages) for t in page]
    assert flat == texts  # no gaps, no duplicates, in order


def test_page_size_defaults_and_caps(store: ConversationStore) -> None:
    player = _player()
    store.append(player, [_entry(f"m{i}") for i in range(105)])
    page, token = store.list(player, 0, "")
    assert len(page) == 20 and token
    page, token = store.list(player, 1000, "")
    assert _texts(page) == [f"m{i}" for i in range(5, 105)] and token
    page, token = store.list(player, 1000, token)
    assert _texts(page) == [f"m{i}" for i in range(5)] and token == ""


def test_list_of_unknown_player_is_empty(store: ConversationStore) -> None:
    assert store.list(_player(), 10, "") == ([], "")


@pytest.mark.parametrize(
    "token",
    [
        "not base64!",
        "abc",  # bad padding
        base64.urlsafe_b64encode(b"x12").decode(),  # wrong prefix
        base64.urlsafe_b64encode(b"hxyz").decode(),  # not a number
        base64.urlsafe_b64encode(b"h").decode(),
        base64.urlsafe_b64encode(b"\xff\xfe").decode(),  # not UTF-8
        base64.urlsafe_b64encode(b"h" + b"9" * 40).decode(),  # beyond any row id
        base64.urlsafe_b64encode(b"h-5").decode(),
    ],
)
def test_malformed_page_token_is_invalid_argument(store: ConversationStore, token: str) -> None:
    with pytest.raises(InvalidArgument, match="page_token is malformed"):
        store.list(_player(), 10, token)


def test_negative_page_size_is_invalid_argument(store: ConversationStore) -> None:
    with pytest.raises(InvalidArgument, match="page_size"):
        store.list(_player(), -1, "")


def test_eviction_by_entry_count_keeps_the_newest(sessions: sessionmaker) -> None:  # type: ignore[type-arg]
    store = ConversationStore(sessions, HistoryBounds(3, 1_000_000, 100))
    player = _player()
    assert store.append(player, [_entry("a"), _entry("b")]) == (True, 0)
    assert store.append(player, [_entry("c")]) == (True, 0)
    assert store.append(player, [_entry("d"), _entry("e")]) == (True, 2)
    assert _texts(_list_all(store, player)) == ["c", "d", "e"]
    # A batch larger than the bound keeps only its own newest entries.
    assert store.append(player, [_entry(x) for x in "fghij"]) == (True, 5)
    assert _texts(_list_all(store, player)) == ["h", "i", "j"]


def test_eviction_by_bytes_keeps_the_newest(sessions: sessionmaker) -> None:  # type: ignore[type-arg]
    store = ConversationStore(sessions, HistoryBounds(1000, 100, 100))
    player = _player()
    thirty = [c * 30 for c in "abcde"]
    assert store.append(player, [_entry(thirty[0]), _entry(thirty[1]), _entry(thirty[2])]) == (
        True,
        0,
    )
    assert store.append(player, [_entry(thirty[3])]) == (True, 1)  # 120 bytes > 100
    assert _texts(_list_all(store, player)) == thirty[1:4]
    # Bytes, not characters: 20 three-byte characters are 60 bytes (20 would evict only one).
    wide = "钻" * 20
    assert store.append(player, [_entry(wide)]) == (True, 2)
    assert _texts(_list_all(store, player)) == [thirty[3], wide]
    # Exactly at the bound (30 + 60 + 10 = 100 bytes) nothing goes.
    assert store.append(player, [_entry("x" * 10)]) == (True, 0)
    assert _texts(_list_all(store, player)) == [thirty[3], wide, "x" * 10]


def test_eviction_counts_the_encoded_result(sessions: sessionmaker) -> None:  # type: ignore[type-arg]
    result = _result()
    size = len(result.SerializeToString())
    store = ConversationStore(sessions, HistoryBounds(1000, 2 * size + 10, 100))
    player = _player()
    answers = []
    for i in range(3):
        answer = _entry(f"r{i}", ASSISTANT)
        answer.result.CopyFrom(result)
        answers.append(answer)
    assert store.append(player, answers) == (True, 1)
    assert _texts(_list_all(store, player)) == ["r1", "r2"]


def test_single_entry_over_the_byte_bound_is_rejected(sessions: sessionmaker) -> None:  # type: ignore[type-arg]
    store = ConversationStore(sessions, HistoryBounds(10, 50, 100))
    player = _player()
    store.append(player, [_entry("keep")])
    with pytest.raises(InvalidArgument, match="50 byte bound"):
        store.append(player, [_entry("x" * 51)])
    assert _texts(_list_all(store, player)) == ["keep"]


def test_a_bound_lowered_under_what_is_stored_keeps_what_fits_of_the_newest(
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    player = _player()
    ConversationStore(sessions, HistoryBounds(10, 1000, 100)).append(
        player, [_entry("a" * 40), _entry("b" * 60)]
    )
    # An operator lowered the byte bound under the 60 bytes the newest stored entry holds:
    # beside the next append (20 bytes) neither stored entry fits, so both go.
    lowered = ConversationStore(sessions, HistoryBounds(10, 50, 100))
    assert lowered.append(player, [_entry("c" * 20)]) == (True, 2)
    assert _texts(_list_all(lowered, player)) == ["c" * 20]


def test_racing_appends_keep_the_running_totals_and_the_bound(
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    """Appends of one player from many threads take turns (on PostgreSQL at the player's
    lock): every entry's totals follow the one before it, and the bound holds exactly."""
    store = ConversationStore(sessions, HistoryBounds(5, 1_000_000, 100))
    player = _player()

    def appends(writer: int) -> None:
        for i in range(6):
            store.append(player, [_entry(f"{writer}-{i}"), _entry(f"{writer}-{i}", ASSISTANT)])

    with ThreadPoolExecutor(max_workers=6) as pool:
        list(pool.map(appends, range(6)))
    with sessions() as session:
        rows = session.scalars(
            select(HistoryRow).where(HistoryRow.player_id == player).order_by(HistoryRow.id)
        ).all()
    assert len(rows) == 5
    for before, after in zip(rows, rows[1:], strict=False):
        assert after.seq == before.seq + 1
        assert after.bytes_through == before.bytes_through + after.size_bytes
    assert rows[-1].seq == 6 * 6 * 2  # every entry counted once


def test_eviction_never_touches_other_players(sessions: sessionmaker) -> None:  # type: ignore[type-arg]
    store = ConversationStore(sessions, HistoryBounds(2, 1_000_000, 100))
    alice, bob = _player(), _player()
    store.append(bob, [_entry("bob-1"), _entry("bob-2")])
    store.append(alice, [_entry("alice-1"), _entry("alice-2")])
    assert store.append(alice, [_entry("alice-3"), _entry("alice-4")]) == (True, 2)
    assert _texts(_list_all(store, bob)) == ["bob-1", "bob-2"]
    assert _texts(_list_all(store, alice)) == ["alice-3", "alice-4"]


def test_history_disabled_records_nothing(store: ConversationStore, engine: Engine) -> None:
    player = _player()
    store.update_preferences(player, history_enabled=False, external_enabled=None)
    assert store.append(player, [_entry("secret")]) == (False, 0)
    assert _row_count(engine, player) == 0
    store.update_preferences(player, history_enabled=True, external_enabled=None)
    assert store.append(player, [_entry("open")]) == (True, 0)
    assert _texts(_list_all(store, player)) == ["open"]


def test_preferences_default_and_partial_update(store: ConversationStore) -> None:
    player = _player()
    prefs = store.get_preferences(player)
    assert (prefs.history_enabled, prefs.external_enabled) == (True, True)

    prefs = store.update_preferences(player, history_enabled=None, external_enabled=False)
    assert (prefs.history_enabled, prefs.external_enabled) == (True, False)
    prefs = store.update_preferences(player, history_enabled=False, external_enabled=None)
    assert (prefs.history_enabled, prefs.external_enabled) == (False, False)
    prefs = store.update_preferences(player, history_enabled=None, external_enabled=None)
    assert (prefs.history_enabled, prefs.external_enabled) == (False, False)
    prefs = store.get_preferences(player)
    assert (prefs.history_enabled, prefs.external_enabled) == (False, False)
    # Another player still has the defaults.
    other = store.get_preferences(_player())
    assert (other.history_enabled, other.external_enabled) == (True, True)


def test_first_preference_updates_racing_all_succeed(store: ConversationStore) -> None:
    # Several first-ever updates for one player at once: the row is created once, every call
    # succeeds, and the stored value is one of the values written.
    from concurrent.futures import ThreadPoolExecutor

    for _ in range(5):
        player = _player()
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(
                pool.map(
                    lambda k, p=player: store.update_preferences(p, bool(k % 2), None), range(8)
                )
            )
        assert len(results) == 8
        assert store.get_preferences(player).external_enabled is True


def test_clear_deletes_only_that_player(store: ConversationStore) -> None:
    alice, bob = _player(), _player()
    store.append(alice, [_entry("a1"), _entry("a2"), _entry("a3")])
    store.append(bob, [_entry("b1")])
    assert store.clear(alice) == 3
    assert _list_all(store, alice) == []
    assert _texts(_list_all(store, bob)) == ["b1"]
    assert store.clear(alice) == 0


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            common_pb2.HistoryEntry(text="no role"),
            r"entries\[1\]\.role must be PLAYER or ASSISTANT",
        ),
        (_entry("x" * 101), r"entries\[1\]\.text has 101 characters; the limit is 100"),
    ],
    ids=["unspecified-role", "text-too-long"],
)
def test_invalid_entry_rejects_the_whole_batch(
    sessions: sessionmaker,  # type: ignore[type-arg]
    engine: Engine,
    bad: common_pb2.HistoryEntry,
    message: str,
) -> None:
    store = ConversationStore(sessions, HistoryBounds(2, 1_000_000, 100))
    player = _player()
    store.append(player, [_entry("old-1"), _entry("old-2")])
    with pytest.raises(InvalidArgument, match=message):
        store.append(player, [_entry("new-1"), bad, _entry("new-3")])
    # Nothing written and nothing evicted.
    assert _row_count(engine, player) == 2
    assert _texts(_list_all(store, player)) == ["old-1", "old-2"]


def test_text_limit_counts_characters_not_bytes(sessions: sessionmaker) -> None:  # type: ignore[type-arg]
    store = ConversationStore(sessions, HistoryBounds(10, 1_000_000, 5))
    player = _player()
    assert store.append(player, [_entry("钻石钻石钻")]) == (True, 0)
    with pytest.raises(InvalidArgument, match="6 characters"):
        store.append(player, [_entry("钻石钻石钻石")])


def test_empty_batch_is_invalid_argument(store: ConversationStore) -> None:
    with pytest.raises(InvalidArgument, match="at least one entry"):
        store.append(_player(), [])


@pytest.mark.parametrize(
    ("player_id", "message"),
    [("", "player_id is required"), ("p" * 65, "longer than 64")],
    ids=["missing", "overlong"],
)
def test_bad_player_id_is_invalid_argument(
    store: ConversationStore, player_id: str, message: str
) -> None:
    calls = [
        lambda: store.append(player_id, [_entry("hi")]),
        lambda: store.list(player_id, 10, ""),
        lambda: store.clear(player_id),
        lambda: store.get_preferences(player_id),
        lambda: store.update_preferences(player_id, True, None),
    ]
    for call in calls:
        with pytest.raises(InvalidArgument, match=message):
            call()


def test_nul_characters_are_invalid_argument_on_every_database(
    store: ConversationStore, engine: Engine
) -> None:
    # PostgreSQL text cannot hold NUL; without a check the driver fails and callers get INTERNAL.
    player = _player()
    with pytest.raises(InvalidArgument, match="player_id must not contain NUL"):
        store.get_preferences(player + "\x00")
    with pytest.raises(InvalidArgument, match="player_id must not contain NUL"):
        store.append(player + "\x00", [_entry("hi")])
    with pytest.raises(InvalidArgument, match=r"entries\[1\] text and request_id"):
        store.append(player, [_entry("ok"), _entry("a\x00b")])
    with pytest.raises(InvalidArgument, match=r"entries\[0\] text and request_id"):
        store.append(player, [_entry("ok", request_id="r\x00")])
    assert _row_count(engine, player) == 0


def test_longest_player_id_is_accepted(store: ConversationStore) -> None:
    player = "p" * 63 + uuid.uuid4().hex[0]
    assert store.append(player, [_entry("hi")]) == (True, 0)
    assert _texts(_list_all(store, player)) == ["hi"]
    store.clear(player)


# -- the service, in-process on port 0 -------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
async def service(
    request: pytest.FixtureRequest, tmp_path: pathlib.Path
) -> AsyncIterator[tuple[StorageApp, grpc.aio.Channel]]:
    """The service on port 0 with small bounds, and a channel to it."""
    url = (
        f"sqlite:///{tmp_path / 'storage.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    config = StorageConfig(
        port=0,
        metrics_port=-1,
        drain_seconds=0,
        grace_seconds=1,
        database_url=url,
        history_max_entries=3,
        max_text_chars=100,
    )
    app = await create_app(config)
    try:
        await app.host.start()
        async with grpc.aio.insecure_channel(app.host.target) as channel:
            yield app, channel
    finally:
        await app.host.stop()
        await app.aclose()


@pytest.fixture
def stub(service: tuple[StorageApp, grpc.aio.Channel]) -> storage_pb2_grpc.StorageServiceStub:
    return storage_pb2_grpc.StorageServiceStub(service[1])


async def test_service_round_trip(stub: storage_pb2_grpc.StorageServiceStub) -> None:
    player = _player()
    answer = _entry("summary ✓", ASSISTANT, "req-1")
    answer.result.CopyFrom(_result())
    response = await stub.AppendHistory(
        storage_pb2.AppendHistoryRequest(
            player_id=player, entries=[_entry("hello", PLAYER, "req-1"), answer]
        ),
        timeout=10,
    )
    assert (response.recorded, response.evicted) == (True, 0)

    listed = await stub.ListHistory(storage_pb2.ListHistoryRequest(player_id=player), timeout=10)
    assert _texts(list(listed.entries)) == ["hello", "summary ✓"]
    assert listed.entries[1].result == _result()
    assert all(e.HasField("created_at") for e in listed.entries)
    assert listed.next_page_token == ""

    # Bounds from the config: at most 3 entries.
    response = await stub.AppendHistory(
        storage_pb2.AppendHistoryRequest(player_id=player, entries=[_entry("a"), _entry("b")]),
        timeout=10,
    )
    assert (response.recorded, response.evicted) == (True, 1)

    first = await stub.ListHistory(
        storage_pb2.ListHistoryRequest(player_id=player, page_size=2), timeout=10
    )
    assert _texts(list(first.entries)) == ["a", "b"] and first.next_page_token
    second = await stub.ListHistory(
        storage_pb2.ListHistoryRequest(
            player_id=player, page_size=2, page_token=first.next_page_token
        ),
        timeout=10,
    )
    assert _texts(list(second.entries)) == ["summary ✓"] and second.next_page_token == ""

    cleared = await stub.ClearHistory(storage_pb2.ClearHistoryRequest(player_id=player), timeout=10)
    assert cleared.deleted == 3
    listed = await stub.ListHistory(storage_pb2.ListHistoryRequest(player_id=player), timeout=10)
    assert list(listed.entries) == []


async def test_service_preferences(stub: storage_pb2_grpc.StorageServiceStub) -> None:
    player = _player()
    got = await stub.GetPreferences(storage_pb2.GetPreferencesRequest(player_id=player), timeout=10)
    assert got.preferences == storage_pb2.PlayerPreferences(
        history_enabled=True, external_enabled=True
    )
    updated = await stub.UpdatePreferences(
        storage_pb2.UpdatePreferencesRequest(player_id=player, history_enabled=False), timeout=10
    )
    assert updated.preferences == storage_pb2.PlayerPreferences(
        history_enabled=False, external_enabled=True
    )
    updated = await stub.UpdatePreferences(
        storage_pb2.UpdatePreferencesRequest(player_id=player, external_enabled=False), timeout=10
    )
    assert updated.preferences == storage_pb2.PlayerPreferences(
        history_enabled=False, external_enabled=False
    )
    # An explicit false differs from unset, so turning history back on must work.
    updated = await stub.UpdatePreferences(
        storage_pb2.UpdatePreferencesRequest(player_id=player, history_enabled=True), timeout=10
    )
    assert updated.preferences.history_enabled is True
    assert updated.preferences.external_enabled is False

    await stub.UpdatePreferences(
        storage_pb2.UpdatePreferencesRequest(player_id=player, history_enabled=False), timeout=10
    )
    response = await stub.AppendHistory(
        storage_pb2.AppendHistoryRequest(player_id=player, entries=[_entry("secret")]), timeout=10
    )
    assert (response.recorded, response.evicted) == (False, 0)
    listed = await stub.ListHistory(storage_pb2.ListHistoryRequest(player_id=player), timeout=10)
    assert list(listed.entries) == []


def _bad_calls(player: str) -> list[tuple[str, object, str]]:
    """(method, request, words the error message must contain)."""
    return [
        ("AppendHistory", storage_pb2.AppendHistoryRequest(entries=[_entry("x")]), "player_id"),
        (
            "AppendHistory",
            storage_pb2.AppendHistoryRequest(player_id="p" * 65, entries=[_entry("x")]),
            "longer than 64",
        ),
        ("AppendHistory", storage_pb2.AppendHistoryRequest(player_id=player), "at least one entry"),
        (
            "AppendHistory",
            storage_pb2.AppendHistoryRequest(
                player_id=player, entries=[_entry("ok"), common_pb2.HistoryEntry(text="no role")]
            ),
            "entries[1].role",
        ),
        (
            "AppendHistory",
            storage_pb2.AppendHistoryRequest(player_id=player, entries=[_entry("x" * 101)]),
            "the limit is 100",
        ),
        (
            "AppendHistory",
            storage_pb2.AppendHistoryRequest(player_id=player, entries=[_entry("a\x00b")]),
            "must not contain NUL",
        ),
        ("ListHistory", storage_pb2.ListHistoryRequest(), "player_id"),
        (
            "ListHistory",
            storage_pb2.ListHistoryRequest(player_id=player, page_size=-1),
            "page_size",
        ),
        (
            "ListHistory",
            storage_pb2.ListHistoryRequest(player_id=player, page_token="garbage!"),
            "page_token",
        ),
        (
            "ListHistory",
            storage_pb2.ListHistoryRequest(
                player_id=player, page_token=base64.urlsafe_b64encode(b"h" + b"9" * 30).decode()
            ),
            "page_token is malformed",
        ),
        ("ClearHistory", storage_pb2.ClearHistoryRequest(), "player_id"),
        ("GetPreferences", storage_pb2.GetPreferencesRequest(), "player_id"),
        (
            "UpdatePreferences",
            storage_pb2.UpdatePreferencesRequest(history_enabled=False),
            "player_id",
        ),
    ]


async def test_service_bad_input_is_invalid_argument_and_server_keeps_serving(
    stub: storage_pb2_grpc.StorageServiceStub,
) -> None:
    player = _player()
    for method, request, words in _bad_calls(player):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await getattr(stub, method)(request, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert words in (caught.value.details() or ""), (method, caught.value.details())
        # The server keeps serving: a good call right after succeeds.
        got = await stub.GetPreferences(
            storage_pb2.GetPreferencesRequest(player_id=player), timeout=10
        )
        assert got.preferences.history_enabled is True
    # And none of the rejected appends wrote anything.
    listed = await stub.ListHistory(storage_pb2.ListHistoryRequest(player_id=player), timeout=10)
    assert list(listed.entries) == []


async def test_service_health(service: tuple[StorageApp, grpc.aio.Channel]) -> None:
    app, channel = service
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME, "system.storage.v1.StorageService"):
        response = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert response.status == health_pb2.HealthCheckResponse.SERVING, name
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


# -- property: the bounded history against a model ------------------------------------------


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def model_sessions(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[sessionmaker]:  # type: ignore[type-arg]
    """Sessions on a database shared by the property test's examples (each uses a new
    player): SQLite, and PostgreSQL."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('prop') / 'storage.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    engine = make_engine(url)
    upgrade(engine)
    try:
        yield sessionmaker(engine, expire_on_commit=False)
    finally:
        engine.dispose()


# One entry: text length, its character (1, 2 or 3 bytes in UTF-8), and the length of an
# attached AgentResult's text (None: no result), whose encoded bytes count toward the bound too.
_spec = st.tuples(
    st.integers(min_value=0, max_value=30),
    st.sampled_from(["a", "é", "钻"]),
    st.none() | st.integers(min_value=0, max_value=20),
)


def _make(serial: int, spec: tuple[int, str, int | None]) -> common_pb2.HistoryEntry:
    length, char, result_len = spec
    tag = f"{serial}:"  # unique, so the comparison catches reordering and duplicates
    entry = _entry(tag + char * max(0, length - len(tag)), ASSISTANT)
    if result_len is not None:
        entry.result.CopyFrom(common_pb2.AgentResult(text="r" * result_len))
    return entry


def _size(entry: common_pb2.HistoryEntry) -> int:
    result = entry.result.SerializeToString() if entry.HasField("result") else b""
    return len(entry.text.encode()) + len(result)


@settings(max_examples=75, deadline=None)
@given(
    max_entries=st.integers(min_value=1, max_value=6),
    max_bytes=st.integers(min_value=20, max_value=120),
    max_text_chars=st.integers(min_value=8, max_value=40),
    batches=st.lists(st.none() | st.lists(_spec, min_size=1, max_size=3), min_size=2, max_size=12),
)
def test_bounded_history_matches_model(
    model_sessions: sessionmaker,  # type: ignore[type-arg]
    max_entries: int,
    max_bytes: int,
    max_text_chars: int,
    batches: list[list[tuple[int, str, int | None]] | None],
) -> None:
    """After every append the stored history is the model's: the newest entries that fit both
    bounds, oldest first; a batch with an invalid entry changes nothing; a clear (None) empties
    it, and the running totals eviction reads go on from nothing."""
    store = ConversationStore(model_sessions, HistoryBounds(max_entries, max_bytes, max_text_chars))
    player = _player()
    model: list[common_pb2.HistoryEntry] = []  # oldest first
    serial = 0
    for specs in batches:
        if specs is None:
            store.clear(player)
            model.clear()
            continue
        batch = [_make(serial + i, spec) for i, spec in enumerate(specs)]
        serial += len(batch)
        if any(len(e.text) > max_text_chars or _size(e) > max_bytes for e in batch):
            with pytest.raises(InvalidArgument):
                store.append(player, batch)
        else:
            model.extend(batch)
            evicted = 0
            while len(model) > max_entries or sum(map(_size, model)) > max_bytes:
                model.pop(0)
                evicted += 1
            assert store.append(player, batch) == (True, evicted)
        stored = _list_all(store, player)
        assert [(e.text, e.result) for e in stored] == [(e.text, e.result) for e in model]
