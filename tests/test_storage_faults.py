"""Faults of the storage service: what survives a kill -9 and a PostgreSQL restart.

- `run_db` unit tests: which database failures become UNAVAILABLE and which stay bugs.
- kill -9 (SQLite and PostgreSQL): four clients stream atomic batches; the storage process is
  SIGKILLed mid-stream and started again on the same database. Every acknowledged batch is
  there in full, no other batch is there in part, and re-sending every request id applies
  none twice.
- PostgreSQL restart: the same clients write while a private PostgreSQL cluster restarts;
  they see UNAVAILABLE, retry with the same request id, and in the end each batch is applied
  exactly once and nothing acknowledged is lost.

Each batch of client `c` is batch number `n` (1, 2, ...) and puts two documents of the
client's player, `a` and `b`, both from version n-1 to n with payload `n`, plus a usage
increment of one model call and n prompt tokens. So after the batches 1..v applied exactly
once: both documents are at version v with payload v, model_calls = v and
prompt_tokens = v(v+1)/2. Any partial batch makes a and b differ or the usage disagree; any
batch applied twice makes the usage too large.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import signal
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psycopg
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import create_engine, text
from sqlalchemy import exc as sa_exc
from system.storage.v1 import journal_pb2, journal_pb2_grpc, player_data_pb2, player_data_pb2_grpc

from services.runtime.errors import InvalidArgument, Unavailable
from services.stack.launcher import free_port
from storage_service.dbcall import UNAVAILABLE_MESSAGE, is_unavailable, run_db
from tests.pgcluster import PgCluster
from tests.service_process import ServiceProcess

JOURNAL = "system.storage.v1.JournalService"
PLAYER_DATA = "system.storage.v1.PlayerDataService"
OWNER = "faults:probe"
DOC_A = "faults:a"
DOC_B = "faults:b"
CODEC = "faults:text"
CLIENTS = 4
KILL_AFTER_ACKS = 60
RESTART_AFTER_ACKS = 40
ACKS_AFTER_RESTART = 40
# Loopback only: never send test traffic through a proxy set in the environment.
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


# -- run_db -----------------------------------------------------------------------------------


def _operational(orig: Exception) -> sa_exc.OperationalError:
    return sa_exc.OperationalError("SELECT 1", {}, orig)


async def test_run_db_runs_in_a_worker_thread_and_passes_arguments() -> None:
    def work(a: int, /, b: int, *, c: int) -> tuple[int, int]:
        return a + b + c, threading.get_ident()

    total, thread = await run_db(work, 1, 2, c=3)
    assert total == 6
    assert thread != threading.get_ident()


@pytest.mark.parametrize(
    "error",
    [
        _operational(psycopg.OperationalError("connection refused")),
        _operational(psycopg.errors.AdminShutdown("terminating connection")),
        sa_exc.InterfaceError("SELECT 1", {}, psycopg.InterfaceError("the connection is closed")),
        sa_exc.DBAPIError("SELECT 1", {}, Exception("gone"), connection_invalidated=True),
        sa_exc.TimeoutError("QueuePool limit of size 5 overflow 5 reached"),
        psycopg.OperationalError("server closed the connection unexpectedly"),
        _operational(sqlite3.OperationalError("database is locked")),
        sqlite3.OperationalError("database is locked"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_run_db_maps_unavailability(error: Exception) -> None:
    def fail() -> None:
        raise error

    with pytest.raises(Unavailable) as caught:
        await run_db(fail)
    assert caught.value.code == "UNAVAILABLE"
    assert caught.value.message == UNAVAILABLE_MESSAGE
    assert "retry with the same request id" in caught.value.message
    assert caught.value.__cause__ is error


@pytest.mark.parametrize(
    "error",
    [
        InvalidArgument("player_id is required"),
        ValueError("a bug"),
        _operational(sqlite3.OperationalError("no such table: player_documents")),
        sa_exc.IntegrityError("INSERT", {}, Exception("duplicate key")),
        sa_exc.ProgrammingError("SELECT", {}, Exception("syntax error")),
    ],
    ids=lambda e: f"{type(e).__name__}-{e}"[:40],
)
async def test_run_db_leaves_other_errors_alone(error: Exception) -> None:
    def fail() -> None:
        raise error

    with pytest.raises(type(error)) as caught:
        await run_db(fail)
    assert caught.value is error
    assert not is_unavailable(error)


async def test_run_db_real_sqlite_lock_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x INTEGER)")
    holder.execute("BEGIN IMMEDIATE")  # holds the write lock until rollback
    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": 0.05})
    try:

        def write() -> None:
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO t VALUES (1)"))

        with pytest.raises(Unavailable):
            await run_db(write)
    finally:
        holder.rollback()
        holder.close()
        engine.dispose()


async def test_run_db_real_refused_postgres_connection_is_unavailable() -> None:
    engine = create_engine(
        f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none",
        connect_args={"connect_timeout": 2},
    )
    try:

        def read() -> None:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))

        with pytest.raises(Unavailable):
            await run_db(read)
    finally:
        engine.dispose()


# -- the storage process ----------------------------------------------------------------------


class StorageProcess(ServiceProcess):
    """`python -m storage_service` as a child process on a fixed port, so a restarted process
    answers on the address the clients' channels already dial."""

    def __init__(self, database_url: str, workdir: Path) -> None:
        super().__init__(
            "storage_service",
            "SYSTEM_STORAGE_",
            {"DATABASE_URL": database_url, "LOG_LEVEL": "WARNING"},
            workdir / "storage.log",
        )
        self.database_url = database_url


@dataclasses.dataclass
class Stubs:
    journal: journal_pb2_grpc.JournalServiceStub
    data: player_data_pb2_grpc.PlayerDataServiceStub


@pytest.fixture
async def storage_factory(tmp_path: Path) -> AsyncIterator[list[StorageProcess]]:
    """Processes started by a test; each is stopped at the end, whatever happened."""
    started: list[StorageProcess] = []
    yield started
    for process in started:
        process.stop()


async def _stubs(channel: grpc.aio.Channel) -> Stubs:
    """Stubs for the journal and player data, failing clearly if the service lacks them."""
    health = health_pb2_grpc.HealthStub(channel)
    for name in (JOURNAL, PLAYER_DATA):
        try:
            await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                pytest.fail(f"storage_service does not serve {name} (not registered in app.py)")
            raise
    return Stubs(
        journal_pb2_grpc.JournalServiceStub(channel),
        player_data_pb2_grpc.PlayerDataServiceStub(channel),
    )


# -- the batches ------------------------------------------------------------------------------


@dataclasses.dataclass
class Ledger:
    """What one client sent and what it was told."""

    player: str
    acked: dict[int, journal_pb2.CommitResponse] = dataclasses.field(default_factory=dict)
    sent: int = 0
    """Highest batch number sent (acknowledged or not)."""
    unavailable: int = 0
    """UNAVAILABLE answers seen (each one retried)."""
    replayed_acks: int = 0
    """Acknowledgements that came back `replayed`: a retry of a batch that had landed."""

    def request_id(self, n: int) -> str:
        return f"{self.player}/{n}"


def _key(player: str, storage_type: str) -> journal_pb2.DocumentKey:
    return journal_pb2.DocumentKey(player_id=player, owner_module=OWNER, storage_type=storage_type)


def _batch(ledger: Ledger, n: int, day: str) -> journal_pb2.CommitRequest:
    payload = str(n).encode()
    return journal_pb2.CommitRequest(
        request_id=ledger.request_id(n),
        player_id=ledger.player,
        operations=[
            journal_pb2.CommitOperation(
                put=journal_pb2.DocumentPut(
                    key=_key(ledger.player, doc),
                    expected_version=n - 1,
                    data=payload,
                    codec_id=CODEC,
                )
            )
            for doc in (DOC_A, DOC_B)
        ]
        + [
            journal_pb2.CommitOperation(
                usage=journal_pb2.UsageIncrement(day=day, model_calls=1, prompt_tokens=n)
            )
        ],
    )


def _day() -> str:
    return dt.datetime.now(dt.UTC).date().isoformat()


@dataclasses.dataclass(frozen=True)
class Observed:
    version_a: int
    version_b: int
    payload_a: bytes
    payload_b: bytes
    model_calls: int
    prompt_tokens: int


async def _observe(stubs: Stubs, player: str, day: str) -> Observed:
    docs = {}
    for doc in (DOC_A, DOC_B):
        try:
            response = await stubs.data.GetDocument(
                player_data_pb2.GetDocumentRequest(key=_key(player, doc)), timeout=10
            )
            docs[doc] = (response.document.version, response.document.data)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
            docs[doc] = (0, b"")
    usage = await stubs.data.GetUsage(
        player_data_pb2.GetUsageRequest(player_id=player, from_day=day, to_day=day), timeout=10
    )
    calls = sum(d.model_calls for d in usage.days)
    tokens = sum(d.prompt_tokens for d in usage.days)
    return Observed(docs[DOC_A][0], docs[DOC_B][0], docs[DOC_A][1], docs[DOC_B][1], calls, tokens)


def _assert_batches_applied_once(seen: Observed, version: int, who: str) -> None:
    """Batches 1..version are applied, each exactly once, and nothing else is."""
    expected_payload = str(version).encode() if version else b""
    assert (seen.version_a, seen.version_b) == (version, version), f"{who}: {seen}"
    assert seen.payload_a == seen.payload_b == expected_payload, f"{who}: {seen}"
    assert seen.model_calls == version, f"{who}: usage counted {seen.model_calls} batches"
    assert seen.prompt_tokens == version * (version + 1) // 2, f"{who}: {seen}"


def _assert_ack(ledger: Ledger, n: int, response: journal_pb2.CommitResponse) -> None:
    assert list(response.versions)[:2] == [n, n], (
        f"{ledger.player} batch {n}: versions {list(response.versions)}"
    )


async def _resend_all(stubs: Stubs, ledger: Ledger, day: str, applied: int) -> None:
    """Sends every batch 1..ledger.sent again. Those already applied (1..applied) must come
    back replayed with their first outcome; a batch never applied is applied now."""
    for n in range(1, ledger.sent + 1):
        response = await stubs.journal.Commit(_batch(ledger, n, day), timeout=10)
        _assert_ack(ledger, n, response)
        assert response.replayed == (n <= applied), (
            f"{ledger.player} batch {n}: replayed={response.replayed}, applied up to {applied}"
        )
        if n in ledger.acked:
            assert list(response.versions) == list(ledger.acked[n].versions)


# -- kill -9 ----------------------------------------------------------------------------------


@pytest.mark.e2e
async def test_kill_9_mid_stream_loses_no_acknowledged_batch_and_leaves_no_partial_one(
    database_url: str, tmp_path: Path, storage_factory: list[StorageProcess]
) -> None:
    backend = database_url.split(":", 1)[0]
    storage = StorageProcess(database_url, tmp_path)
    storage_factory.append(storage)
    await storage.start()
    day = _day()
    run = uuid.uuid4().hex[:8]
    ledgers = [Ledger(f"kill-{backend}-{run}-{c}") for c in range(CLIENTS)]
    killed = asyncio.Event()
    enough = asyncio.Event()
    acks = 0

    async with grpc.aio.insecure_channel(storage.target, options=CHANNEL_OPTIONS) as channel:
        stubs = await _stubs(channel)

        async def client(ledger: Ledger) -> None:
            nonlocal acks
            n = 0
            while True:
                n += 1
                ledger.sent = n
                try:
                    response = await stubs.journal.Commit(_batch(ledger, n, day), timeout=10)
                except grpc.aio.AioRpcError as exc:
                    if not killed.is_set():
                        raise AssertionError(
                            f"{ledger.player} batch {n} failed before the kill: "
                            f"{exc.code().name} {exc.details()}\n{storage.log_tail()}"
                        ) from None
                    return  # in doubt: sent, never acknowledged
                assert not response.replayed
                _assert_ack(ledger, n, response)
                ledger.acked[n] = response
                acks += 1
                if acks >= KILL_AFTER_ACKS:
                    enough.set()

        async def killer() -> None:
            await asyncio.wait_for(enough.wait(), 30)
            killed.set()  # before the signal: every failure from here on is the kill's
            storage.kill()

        await asyncio.gather(killer(), *(client(ledger) for ledger in ledgers))

    assert storage.process is not None and storage.process.returncode == -signal.SIGKILL
    restarted = StorageProcess(database_url, tmp_path)
    restarted.port = storage.port
    storage_factory.append(restarted)
    await restarted.start()

    landed = 0
    async with grpc.aio.insecure_channel(restarted.target, options=CHANNEL_OPTIONS) as channel:
        stubs = await _stubs(channel)
        for ledger in ledgers:
            acked = sorted(ledger.acked)
            last_acked = acked[-1] if acked else 0
            # Each client waits for an answer before its next batch: acks are 1..last_acked,
            # and at most the one batch after them is in doubt.
            assert acked == list(range(1, last_acked + 1))
            assert ledger.sent == last_acked + 1
            seen = await _observe(stubs, ledger.player, day)
            # The batch in flight at the kill landed completely or not at all.
            assert seen.version_a in (last_acked, last_acked + 1), (ledger.player, seen)
            _assert_batches_applied_once(seen, seen.version_a, ledger.player)
            landed += seen.version_a - last_acked

            await _resend_all(stubs, ledger, day, applied=seen.version_a)
            after = await _observe(stubs, ledger.player, day)
            _assert_batches_applied_once(after, ledger.sent, ledger.player)
    acked_total = sum(len(ledger.acked) for ledger in ledgers)
    assert acked_total >= KILL_AFTER_ACKS
    # Shown with `pytest -s`: how the kill fell this time.
    print(
        f"\n{backend}: {acked_total} batches acknowledged before the kill; of the "
        f"{len(ledgers)} in flight, {landed} had landed"
    )


# -- PostgreSQL restart -----------------------------------------------------------------------


@pytest.mark.e2e
async def test_postgres_restart_clients_retry_and_each_batch_applies_once(
    tmp_path: Path, storage_factory: list[StorageProcess]
) -> None:
    cluster = PgCluster.create()
    try:
        url = cluster.create_database("storage")
        storage = StorageProcess(url, tmp_path)
        storage_factory.append(storage)
        await storage.start()
        day = _day()
        run = uuid.uuid4().hex[:8]
        ledgers = [Ledger(f"pgrestart-{run}-{c}") for c in range(CLIENTS)]
        stop = asyncio.Event()
        acks = 0
        progress = asyncio.Condition()

        async with grpc.aio.insecure_channel(storage.target, options=CHANNEL_OPTIONS) as channel:
            stubs = await _stubs(channel)

            async def commit_until_acked(ledger: Ledger, n: int) -> journal_pb2.CommitResponse:
                """Retries UNAVAILABLE with the same request id and backoff; nothing else."""
                delay = 0.05
                deadline = time.monotonic() + 30
                while True:
                    try:
                        return await stubs.journal.Commit(_batch(ledger, n, day), timeout=10)
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() != grpc.StatusCode.UNAVAILABLE:
                            raise AssertionError(
                                f"{ledger.player} batch {n}: {exc.code().name} {exc.details()}"
                                f"\n{storage.log_tail()}\n{cluster.log_tail()}"
                            ) from None
                        ledger.unavailable += 1
                        if time.monotonic() > deadline:
                            raise AssertionError(
                                f"{ledger.player} batch {n}: still UNAVAILABLE after 30 s: "
                                f"{exc.details()}\n{storage.log_tail()}"
                            ) from None
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 0.5)

            async def client(ledger: Ledger) -> None:
                nonlocal acks
                n = 0
                while not stop.is_set():
                    n += 1
                    ledger.sent = n
                    response = await commit_until_acked(ledger, n)
                    _assert_ack(ledger, n, response)
                    ledger.acked[n] = response
                    ledger.replayed_acks += response.replayed
                    async with progress:
                        acks += 1
                        progress.notify_all()

            async def wait_for_acks(count: int, timeout: float) -> None:
                async with progress:
                    await asyncio.wait_for(progress.wait_for(lambda: acks >= count), timeout)

            async def restarter() -> None:
                try:
                    await wait_for_acks(RESTART_AFTER_ACKS, 30)
                    # Down for a second: clients meet both killed sessions and refused connects.
                    await asyncio.to_thread(cluster.restart, 1.0)
                    await wait_for_acks(acks + ACKS_AFTER_RESTART, 30)
                finally:
                    stop.set()

            await asyncio.gather(restarter(), *(client(ledger) for ledger in ledgers))

            unavailable = sum(ledger.unavailable for ledger in ledgers)
            assert unavailable >= 1, "no client saw UNAVAILABLE while PostgreSQL restarted"
            print(
                f"\n{sum(ledger.sent for ledger in ledgers)} batches acknowledged, "
                f"{unavailable} UNAVAILABLE answers retried, "
                f"{sum(ledger.replayed_acks for ledger in ledgers)} retries answered as replayed"
            )
            for ledger in ledgers:
                # Every batch a client sent was eventually acknowledged (it retried until it was).
                assert sorted(ledger.acked) == list(range(1, ledger.sent + 1))
                seen = await _observe(stubs, ledger.player, day)
                _assert_batches_applied_once(seen, ledger.sent, ledger.player)
                await _resend_all(stubs, ledger, day, applied=ledger.sent)
                _assert_batches_applied_once(
                    await _observe(stubs, ledger.player, day), ledger.sent, ledger.player
                )
    finally:
        for process in storage_factory:
            process.stop()
        cluster.cleanup()
