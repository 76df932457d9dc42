"""A player's ledger totals (`journal_ledgers`, storage_service.ledger_totals) are exactly the
count and bytes of their stored tasks and receipts after every kind of write: creations, moves
with results, intents, results, evictions at the bounds, grouped writes, deletes; on SQLite
and PostgreSQL, on a schema made by create_all and by the migrations (decision 0050)."""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import pytest
from google.protobuf import struct_pb2
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from system.common.v1 import common_pb2
from system.storage.v1 import journal_pb2

from services.runtime.errors import ResourceExhausted
from storage_service.db import make_engine
from storage_service.group_commit import GroupCommitter
from storage_service.journal import JournalStore
from storage_service.ledgers import JournalBounds, receipt_size, task_size
from storage_service.migrate import upgrade

TS = journal_pb2.TaskState
MODULE = "test:ledger"
TOOL = "minecraft:item.give"

_SUMS = """
SELECT player_id, sum(task_count), sum(task_bytes), sum(receipt_count), sum(receipt_bytes)
FROM (
    SELECT player_id, 1 AS task_count, size_bytes AS task_bytes,
           0 AS receipt_count, 0 AS receipt_bytes FROM journal_tasks
    UNION ALL
    SELECT player_id, 0, 0, 1, size_bytes FROM journal_receipts
) AS entries GROUP BY player_id"""
_TOTALS = """SELECT player_id, task_count, task_bytes, receipt_count, receipt_bytes
FROM journal_ledgers"""


def _ledgers(engine: Engine) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(the totals' rows that are not all zero, the sums of the stored entries) by player."""
    with engine.connect() as connection:
        totals = {
            row[0]: tuple(int(v) for v in row[1:]) for row in connection.execute(text(_TOTALS))
        }
        sums = {row[0]: tuple(int(v) for v in row[1:]) for row in connection.execute(text(_SUMS))}
    return {p: t for p, t in totals.items() if any(t)}, sums


def _assert_exact(engine: Engine, *, measured: bool = True) -> None:
    """The totals are the sums, and (`measured`: entries the store wrote, not a test's own
    rows) each entry's size is what its columns measure (`task_size`, `receipt_size`: a
    write's statement keeps it, a move growing it by its result's bytes)."""
    totals, sums = _ledgers(engine)
    assert totals == sums
    assert all(value >= 0 for row in totals.values() for value in row)
    if not measured:
        return
    with engine.connect() as connection:
        for task in connection.execute(text(_TASK_SIZES)):
            *columns, data, result, size = task
            assert size == task_size(*columns, bytes(data), _bytes(result)), task
        for receipt in connection.execute(text(_RECEIPT_SIZES)):
            *columns, result, size = receipt
            assert size == receipt_size(*columns, _bytes(result)), receipt


_TASK_SIZES = """SELECT task_id, player_id, module_id, event_key, input, result, size_bytes
FROM journal_tasks"""
_RECEIPT_SIZES = """SELECT step_id, task_id, player_id, tool, codec_id, result, size_bytes
FROM journal_receipts"""


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


def _input(size: int) -> struct_pb2.Struct:
    data = struct_pb2.Struct()
    data.update({"pad": "x" * size})
    return data


def _result(size: int) -> common_pb2.AgentResult:
    return common_pb2.AgentResult(status=common_pb2.RESULT_STATUS_SUCCEEDED, text="y" * size)


def test_the_totals_are_the_sums_after_every_kind_of_write(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """Random creations, intents, results and final moves by three players against small
    bounds (so that creations and intents evict), the totals checked after each write."""
    store = JournalStore(
        sessions,
        JournalBounds(
            task_max_entries=6, task_max_bytes=6000, receipt_max_entries=9, receipt_max_bytes=4000
        ),
    )
    rng = random.Random(7)
    players = [f"p-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    running: list[tuple[str, int]] = []  # (task id, next step position)
    open_steps: list[str] = []
    full = 0
    for _ in range(160):
        kind = rng.choice(["create", "create", "step", "step", "result", "finish"])
        try:
            if kind == "create" or not running:
                task, _, _ = store.create_task(
                    rng.choice(players), MODULE, _input(rng.randint(1, 300)), uuid.uuid4().hex
                )
                store.transition_task(task.task_id, TS.TASK_STATE_RUNNING)
                running.append((task.task_id, 0))
            elif kind == "step":
                index = rng.randrange(len(running))
                task_id, position = running[index]
                step_id = f"{task_id}/{position}"
                store.record_step(step_id, task_id, position, TOOL)
                running[index] = (task_id, position + 1)
                open_steps.append(step_id)
            elif kind == "result" and open_steps:
                step_id = open_steps.pop(rng.randrange(len(open_steps)))
                store.complete_step(step_id, TOOL, b"r" * rng.randint(1, 200), "test:raw")
            else:
                task_id, _ = running.pop(rng.randrange(len(running)))
                # Its open steps are no longer completed (their receipts may be evicted).
                open_steps = [s for s in open_steps if not s.startswith(f"{task_id}/")]
                store.transition_task(
                    task_id, TS.TASK_STATE_SUCCEEDED, result=_result(rng.randint(0, 400))
                )
        except ResourceExhausted:
            full += 1  # STORAGE_FULL: nothing written, which the totals must show too
        _assert_exact(engine)
    totals, _ = _ledgers(engine)
    assert set(totals) == set(players)
    assert full < 160


def test_grouped_writes_and_deletes_keep_the_totals(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """The group committer's statements (on PostgreSQL one statement a kind for the whole
    group), then deleting a player's entries as a reset does."""
    store = JournalStore(sessions, JournalBounds())
    committer = GroupCommitter(sessions)
    players = [f"g-{uuid.uuid4().hex[:8]}" for _ in range(4)]

    async def one_task(player: str) -> None:
        created = await committer.run(
            store.create_task_unit(player, MODULE, _input(50), uuid.uuid4().hex)
        )
        task_id = created[0].task_id
        await asyncio.to_thread(store.transition_task, task_id, TS.TASK_STATE_RUNNING)
        # Each step's intent with its result (the engine's first claim: decision 0036).
        receipts = [
            journal_pb2.CommitOperation(
                receipt=journal_pb2.ReceiptWrite(
                    step_id=f"{task_id}/{position}",
                    task_id=task_id,
                    position=position,
                    tool=TOOL,
                    state=state,
                    result=b"z" * 40 if state == journal_pb2.STEP_STATE_DONE else b"",
                    codec_id="test:raw" if state == journal_pb2.STEP_STATE_DONE else "",
                )
            )
            for position in range(2)
            for state in (journal_pb2.STEP_STATE_RUNNING, journal_pb2.STEP_STATE_DONE)
        ]
        final = journal_pb2.CommitOperation(
            transition=journal_pb2.TaskTransition(
                task_id=task_id,
                state=TS.TASK_STATE_SUCCEEDED,
                expected_state=TS.TASK_STATE_RUNNING,
                result=_result(30),
            )
        )
        await committer.run(
            store.commit_unit(
                journal_pb2.CommitRequest(
                    request_id=uuid.uuid4().hex, player_id=player, operations=[*receipts, final]
                )
            )
        )

    async def all_tasks() -> None:
        await asyncio.gather(*(one_task(p) for p in players for _ in range(3)))

    try:
        asyncio.run(all_tasks())
    finally:
        committer.close()
    _assert_exact(engine)
    totals, _ = _ledgers(engine)
    assert {p: (t[0], t[2]) for p, t in totals.items()} == {p: (3, 6) for p in players}

    with engine.begin() as connection:
        for table in ("journal_receipts", "journal_tasks"):
            connection.execute(text(f"DELETE FROM {table} WHERE player_id = :p"), {"p": players[0]})
    _assert_exact(engine)
    with engine.connect() as connection:
        zero = connection.execute(text(_TOTALS + " WHERE player_id = :p"), {"p": players[0]}).one()
    assert tuple(zero[1:]) == (0, 0, 0, 0)


def test_an_entry_keeps_its_player(engine: Engine, sessions: sessionmaker[Session]) -> None:
    """Totals are kept per owner, and an owner never changes: such an update is refused and
    changes nothing."""
    store = JournalStore(sessions, JournalBounds())
    task, _, _ = store.create_task("steve", MODULE, _input(10), uuid.uuid4().hex)
    before = _ledgers(engine)
    with pytest.raises(DBAPIError, match="never changes"), engine.begin() as connection:
        connection.execute(
            text("UPDATE journal_tasks SET player_id = 'alex' WHERE task_id = :t"),
            {"t": task.task_id},
        )
    assert _ledgers(engine) == before


def test_the_migration_counts_what_is_stored(fresh_database_url: str) -> None:
    """Revision 0016 makes the totals of the entries already stored, and its triggers keep
    them from the next write on."""
    engine = make_engine(fresh_database_url)
    try:
        upgrade(engine, "0015")
        rows: list[dict[str, Any]] = [
            {"t": f"t{i}", "p": player, "s": size}
            for i, (player, size) in enumerate([("steve", 100), ("steve", 250), ("alex", 70)])
        ]
        with engine.begin() as connection:
            for row in rows:
                connection.execute(
                    text(
                        "INSERT INTO journal_tasks (task_id, player_id, module_id, event_key, "
                        "state, input, attempts, size_bytes, created_at, updated_at) VALUES "
                        "(:t, :p, 'm', :t, 'succeeded', :i, 1, :s, :c, :c)"
                    ),
                    {**row, "i": b"", "c": "2026-12-01 00:00:00"},
                )
            connection.execute(
                text(
                    "INSERT INTO journal_receipts (step_id, task_id, player_id, position, tool, "
                    "state, codec_id, size_bytes, created_at, updated_at) VALUES "
                    "('t0/0', 't0', 'steve', 0, 'tool', 'running', '', 33, :c, :c)"
                ),
                {"c": "2026-12-01 00:00:00"},
            )
        upgrade(engine)
        totals, sums = _ledgers(engine)
        assert totals == sums == {"steve": (2, 350, 1, 33), "alex": (1, 70, 0, 0)}
        store = JournalStore(sessionmaker(engine, expire_on_commit=False), JournalBounds())
        store.create_task("alex", MODULE, _input(5), uuid.uuid4().hex)
        _assert_exact(engine, measured=False)
    finally:
        engine.dispose()


def test_concurrent_writers_keep_the_totals(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """Eight threads creating tasks and recording steps for the same three players at once,
    each write its own transaction (on PostgreSQL they meet at the players' locks and rows)."""
    from concurrent.futures import ThreadPoolExecutor

    store = JournalStore(sessions, JournalBounds(task_max_entries=40, receipt_max_entries=60))
    players = [f"c-{uuid.uuid4().hex[:8]}" for _ in range(3)]

    def writer(index: int) -> int:
        rng = random.Random(index)
        full = 0
        for _ in range(12):
            player = rng.choice(players)
            try:
                task, _, _ = store.create_task(
                    player, MODULE, _input(rng.randint(1, 80)), uuid.uuid4().hex
                )
                store.transition_task(task.task_id, TS.TASK_STATE_RUNNING)
                store.record_step(f"{task.task_id}/0", task.task_id, 0, TOOL)
                store.complete_step(
                    f"{task.task_id}/0", TOOL, b"r" * rng.randint(1, 50), "test:raw"
                )
                store.transition_task(
                    task.task_id, TS.TASK_STATE_SUCCEEDED, result=_result(rng.randint(0, 60))
                )
            except ResourceExhausted:
                full += 1
        return full

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(writer, range(8)))
    _assert_exact(engine)
    totals, _ = _ledgers(engine)
    assert set(totals) == set(players)
    # 96 tasks were made for three players whose ledgers hold 40: the bounds evicted some.
    assert sum(t[0] for t in totals.values()) <= 3 * 40


def test_the_migration_goes_down_and_up_again(fresh_database_url: str) -> None:
    """Downgrading revision 0016 removes every trigger (and PostgreSQL function) it made, and
    upgrading again makes them again."""
    from alembic import command

    from storage_service.migrate import _config, current_revision

    engine = make_engine(fresh_database_url)
    postgresql = engine.dialect.name == "postgresql"
    made = (
        "SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'journal_%ledger%'"
        if postgresql
        else "SELECT count(*) FROM sqlite_master WHERE type = 'trigger' AND name LIKE '%ledger%'"
    )

    def triggers() -> int:
        with engine.connect() as connection:
            return int(connection.execute(text(made)).scalar_one())

    try:
        upgrade(engine)
        assert triggers() == 8  # four a table
        with engine.begin() as connection:
            command.downgrade(_config(connection), "0015")
        assert current_revision(engine) == "0015"
        assert triggers() == 0
        if postgresql:
            with engine.connect() as connection:
                functions = connection.execute(
                    text("SELECT count(*) FROM pg_proc WHERE proname LIKE 'journal_%ledger%'")
                ).scalar_one()
            assert functions == 0
        upgrade(engine)
        assert triggers() == 8
        _assert_exact(engine)
    finally:
        engine.dispose()
