"""New tasks in one group (storage_service.create_groups): on PostgreSQL two or more creations
are written together as one statement; on both databases each gets the answer `create_task` gives
it alone: a new task, the event's existing task, room made by eviction, or its error. And what
a creation alone costs in statements: the one statement both forms build
(`tasks.create_insert`)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from google.protobuf import struct_pb2
from sqlalchemy import Engine, select
from sqlalchemy.orm import sessionmaker
from system.storage.v1 import journal_pb2

from services.runtime.errors import InvalidArgument
from storage_service.group_commit import run_group
from storage_service.journal import JournalBounds, JournalStore
from storage_service.journal_records import TaskRow
from tests.transactions import transaction_ends

TS = journal_pb2.TaskState
NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)
MODULE = "mod:reward"


def _player() -> str:
    return f"p-{uuid.uuid4()}"


def _store(sessions: sessionmaker, **bounds: int) -> JournalStore:  # type: ignore[type-arg]
    return JournalStore(sessions, JournalBounds(**bounds), lambda: NOW)


def _input(text: str = "x") -> struct_pb2.Struct:
    data = struct_pb2.Struct()
    data.update({"advancement": text})
    return data


def _create(
    store: JournalStore,
    creations: list[tuple[str, str]],
    initial_state: int = TS.TASK_STATE_UNSPECIFIED,
) -> list[Any]:
    """(player, event key) creations as one group of the storage service's writer: each one's
    (task, created, evicted) or error."""
    units = [
        store.create_task_unit(player, MODULE, _input(key), key, initial_state)
        for player, key in creations
    ]
    return run_group(store._sessions, units)  # noqa: SLF001


def _row(sessions: sessionmaker, task_id: str) -> tuple[Any, ...]:  # type: ignore[type-arg]
    with sessions() as session:
        row = session.execute(
            select(
                TaskRow.player_id,
                TaskRow.module_id,
                TaskRow.event_key,
                TaskRow.state,
                TaskRow.input,
                TaskRow.result,
                TaskRow.attempts,
                TaskRow.size_bytes,
                TaskRow.created_at,
                TaskRow.updated_at,
            ).where(TaskRow.task_id == task_id)
        ).one()
        return tuple(row)


def test_creations_in_a_group_store_what_each_stores_alone(
    engine: Engine,
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    store = _store(sessions)
    players = [_player() for _ in range(4)]
    alone = [store.create_task(p, MODULE, _input("k"), "k") for p in players[:2]]
    ends = transaction_ends(engine)
    together = _create(store, [(p, "k") for p in players[2:]])
    assert ends == ["commit"]
    for (one, one_created, _), (other, other_created, other_evicted) in zip(
        alone, together, strict=True
    ):
        assert one_created and other_created and other_evicted == 0
        assert other.state == TS.TASK_STATE_QUEUED and other.input == _input("k")
        # The rows differ only in whose they are (player ids of one length).
        assert _row(sessions, other.task_id)[1:] == _row(sessions, one.task_id)[1:]
        assert store.get_task(other.task_id) == other


@pytest.mark.parametrize("creations", [2, 6])
def test_a_group_of_creations_costs_two_statements(
    engine: Engine,
    sessions: sessionmaker,  # type: ignore[type-arg]
    statements: list[str],
    creations: int,
) -> None:
    store = _store(sessions)
    _create(store, [(_player(), "warm-up") for _ in range(2)])
    statements.clear()
    outcomes = _create(store, [(_player(), "k") for _ in range(creations)])
    assert all(created for _, created, _ in outcomes)
    # The group's lock statement (the players' locks) and the one INSERT.
    assert len(statements) == 2, "\n".join(statements)


def test_a_lone_creation_is_its_lock_and_one_insert(
    engine: Engine,
    sessions: sessionmaker,  # type: ignore[type-arg]
    statements: list[str],
) -> None:
    store = _store(sessions)
    store.create_task(_player(), MODULE, _input("warm-up"), "warm-up")
    player = _player()
    statements.clear()
    task, created, evicted = store.create_task(player, MODULE, _input("k"), "k")
    assert created and evicted == 0
    # The player's lock and the INSERT that applies where nothing stands in the way.
    assert len(statements) == 2, "\n".join(statements)
    assert statements[1].startswith("INSERT INTO journal_tasks")
    statements.clear()
    found, created, evicted = store.create_task(player, MODULE, _input("k"), "k")
    assert (found.task_id, created, evicted) == (task.task_id, False, 0)
    # The INSERT inserts nothing for an event that has its task: the read that finds it
    # follows (the long way).
    assert len(statements) == 3, "\n".join(statements)
    assert _row(sessions, task.task_id)[2] == "k"


def test_an_events_existing_task_is_found_in_a_group(
    engine: Engine,
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    store = _store(sessions)
    player, other = _player(), _player()
    existing, _, _ = store.create_task(player, MODULE, _input("k"), "k")
    ends = transaction_ends(engine)
    (found, created, evicted), (new, new_created, _) = _create(store, [(player, "k"), (other, "k")])
    assert ends == ["commit"]
    assert (found, created, evicted) == (existing, False, 0)
    assert new_created and new.player_id == other


def test_one_players_creations_in_a_group_are_applied_in_turn(
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    """The second of a player's creations goes the ordinary way after the sent one: a new
    event key makes a second task, the same one finds the first."""
    store = _store(sessions)
    player = _player()
    first, second, same = _create(store, [(player, "a"), (player, "b"), (player, "a")])
    assert first[1] and second[1] and not same[1]
    assert same[0] == first[0]
    tasks, _ = store.list_tasks(player, page_size=10)
    assert sorted(task.event_key for task in tasks) == ["a", "b"]


def test_a_full_ledger_evicts_in_a_group_as_alone(
    engine: Engine,
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    store = _store(sessions, task_max_entries=1)
    player, other = _player(), _player()
    old, _, _ = store.create_task(player, MODULE, _input("k"), "old")
    store.transition_task(old.task_id, TS.TASK_STATE_RUNNING)
    store.transition_task(old.task_id, TS.TASK_STATE_SUCCEEDED)
    ends = transaction_ends(engine)
    (new, created, evicted), (_, other_created, _) = _create(
        store, [(player, "new"), (other, "new")]
    )
    assert ends == ["commit"]
    assert created and evicted == 1 and other_created
    tasks, _ = store.list_tasks(player, page_size=10)
    assert [task.task_id for task in tasks] == [new.task_id]


def test_a_refused_creation_in_a_group_fails_alone(
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    store = _store(sessions)
    player, other = _player(), _player()
    units = [
        store.create_task_unit(player, MODULE, _input(), "k", TS.TASK_STATE_RUNNING),
        store.create_task_unit(other, MODULE, _input(), "k"),
    ]
    refused, (task, created, _) = run_group(store._sessions, units)  # noqa: SLF001
    assert isinstance(refused, InvalidArgument) and "initial_state" in str(refused)
    assert created and store.get_task(task.task_id).player_id == other
    assert store.list_tasks(player, page_size=10)[0] == []
