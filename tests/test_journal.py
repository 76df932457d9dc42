"""Journal tests: tasks, receipts, bounds, leases, claims and atomic batches on SQLite and
PostgreSQL; a property test of the bounded task ledger; JournalService in-process on port 0."""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import sessionmaker
from system.common.v1 import common_pb2
from system.storage.v1 import journal_pb2, journal_pb2_grpc

from services.presence import players_digest
from services.runtime.errors import (
    STALE_FENCE,
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    error_reason,
)
from services.runtime.server import ServiceHost
from storage_service import leases as leases_module
from storage_service import ledgers as ledgers_module
from storage_service.config import StorageConfig
from storage_service.db import Base, make_engine
from storage_service.group_commit import GroupCommitter
from storage_service.history import ConversationStore, HistoryBounds
from storage_service.journal import JournalBounds, JournalStore
from storage_service.journal_records import TaskRow
from storage_service.journal_servicer import JournalServicer
from storage_service.leases import LeaseRow
from storage_service.ledgers import HEADROOM_SHARE
from storage_service.player_data import PlayerDataStore
from storage_service.presence import PresenceStore
from storage_service.runs import RunStore

TS = journal_pb2.TaskState
SS = journal_pb2.StepState
QUEUED, RUNNING, WAITING = TS.TASK_STATE_QUEUED, TS.TASK_STATE_RUNNING, TS.TASK_STATE_WAITING
SUCCEEDED, FAILED = TS.TASK_STATE_SUCCEEDED, TS.TASK_STATE_FAILED
PARTIAL = TS.TASK_STATE_PARTIALLY_SUCCEEDED
STATES = [QUEUED, RUNNING, WAITING, SUCCEEDED, FAILED, PARTIAL]
TERMINAL = {SUCCEEDED, FAILED, PARTIAL}
VALID_MOVES = {
    (QUEUED, RUNNING),
    (QUEUED, WAITING),
    (WAITING, QUEUED),
    (WAITING, RUNNING),
    (RUNNING, WAITING),
    (RUNNING, QUEUED),
    (RUNNING, SUCCEEDED),
    (RUNNING, FAILED),
    (RUNNING, PARTIAL),
}
ROOMY = JournalBounds()
MODULE = "system:sign_in"
DAY = "2030-01-01"


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


def _player() -> str:
    return f"p-{uuid.uuid4()}"


def _input(**values: Any) -> struct_pb2.Struct:
    data = struct_pb2.Struct()
    data.update(values)
    return data


def _result(text: str = "done") -> common_pb2.AgentResult:
    return common_pb2.AgentResult(status=common_pb2.RESULT_STATUS_SUCCEEDED, text=text)


def _size(task: journal_pb2.EventTask) -> int:
    """What a task should count against the byte bound: encoded input and result plus ids."""
    ids = (task.task_id, task.player_id, task.module_id, task.event_key)
    result = task.result.SerializeToString(deterministic=True) if task.HasField("result") else b""
    return (
        sum(len(i.encode()) for i in ids)
        + len(task.input.SerializeToString(deterministic=True))
        + len(result)
    )


HISTORY_BOUNDS = HistoryBounds(max_entries=200, max_bytes=262144, max_text_chars=4000)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make_store(sessions: sessionmaker, clock: Clock) -> Callable[..., JournalStore]:  # type: ignore[type-arg]
    def make(**bounds: int) -> JournalStore:
        return JournalStore(sessions, JournalBounds(**bounds), clock)

    return make


@pytest.fixture
def store(make_store: Callable[..., JournalStore]) -> JournalStore:
    return make_store()


def _task(
    store: JournalStore, player: str, state: int = QUEUED, key: str | None = None, **values: Any
) -> journal_pb2.EventTask:
    """A new task brought to `state` along valid moves."""
    initial = WAITING if state == WAITING else QUEUED
    task, created, _ = store.create_task(
        player, MODULE, _input(**values), key or f"e-{uuid.uuid4().hex[:8]}", initial
    )
    assert created
    if state in (QUEUED, WAITING):
        return task
    task = store.transition_task(task.task_id, RUNNING)
    if state == RUNNING:
        return task
    return store.transition_task(task.task_id, state)


def _ids(tasks: list[journal_pb2.EventTask]) -> list[str]:
    return [t.task_id for t in tasks]


def _listed(store: JournalStore, player: str) -> list[tuple[str, int]]:
    tasks, token = store.list_tasks(player, page_size=500)
    assert token == ""
    return [(t.task_id, t.state) for t in tasks]


# -- tasks ---------------------------------------------------------------------------------------


def test_bounds_come_from_the_storage_config() -> None:
    config = StorageConfig(task_max_entries=7, receipt_max_bytes=99, max_document_bytes=5)
    bounds = JournalBounds.from_config(config)
    assert (bounds.task_max_entries, bounds.receipt_max_bytes, bounds.max_document_bytes) == (
        7,
        99,
        5,
    )
    assert bounds.max_result_bytes == config.max_result_bytes


def test_create_get_round_trip(store: JournalStore, clock: Clock) -> None:
    player = _player()
    task, created, evicted = store.create_task(
        player, MODULE, _input(reward="钻石", n=3, nested={"a": [1, "b"]}), "daily:2030-01-01"
    )
    assert (created, evicted) == (True, 0)
    assert task.task_id and task.player_id == player and task.module_id == MODULE
    assert task.state == QUEUED and task.attempts == 0 and not task.HasField("result")
    assert task.input == _input(reward="钻石", n=3, nested={"a": [1, "b"]})
    assert task.created_at.ToDatetime(tzinfo=dt.UTC) == clock.now
    assert store.get_task(task.task_id) == task

    clock.advance(5)
    running = store.transition_task(task.task_id, RUNNING, expected_state=QUEUED)
    done = store.transition_task(task.task_id, SUCCEEDED, result=_result("签到 ✓"))
    assert running.state == RUNNING
    assert done.state == SUCCEEDED and done.result == _result("签到 ✓")
    assert done.updated_at.ToDatetime(tzinfo=dt.UTC) == clock.now
    assert done.created_at == task.created_at
    assert store.get_task(task.task_id) == done


def test_states_are_stored_as_lower_case_names(store: JournalStore, sessions: sessionmaker) -> None:  # type: ignore[type-arg]
    player = _player()
    names = {}
    for state in STATES:
        task = _task(store, player, state)
        with sessions() as session:
            names[state] = session.scalar(
                select(TaskRow.state).where(TaskRow.task_id == task.task_id)
            )
    assert names == {
        QUEUED: "queued",
        RUNNING: "running",
        WAITING: "waiting",
        SUCCEEDED: "succeeded",
        FAILED: "failed",
        PARTIAL: "partially_succeeded",
    }


def test_create_dedupes_by_player_and_event_key(store: JournalStore) -> None:
    alice, bob = _player(), _player()
    first, created, _ = store.create_task(alice, MODULE, _input(a=1), "quest:7", WAITING)
    assert created and first.state == WAITING
    again, created, evicted = store.create_task(alice, "system:other", _input(a=2), "quest:7")
    assert (created, evicted) == (False, 0)
    assert again == first
    # Another player's event with the same key is another task.
    other, created, _ = store.create_task(bob, MODULE, _input(a=1), "quest:7")
    assert created and other.task_id != first.task_id
    assert len(store.list_tasks(alice)[0]) == 1


@pytest.mark.parametrize("state", [RUNNING, SUCCEEDED, FAILED, PARTIAL, 99])
def test_create_refuses_other_initial_states(store: JournalStore, state: int) -> None:
    with pytest.raises(InvalidArgument, match="initial_state must be QUEUED or WAITING"):
        store.create_task(_player(), MODULE, _input(), "k", state)


def test_every_transition_is_valid_or_refused(store: JournalStore) -> None:
    player = _player()
    for source in STATES:
        for target in STATES:
            task = _task(store, player, source)
            if (source, target) in VALID_MOVES:
                moved = store.transition_task(task.task_id, target, expected_state=source)
                assert moved.state == target, (source, target)
            else:
                with pytest.raises(FailedPrecondition) as caught:
                    store.transition_task(task.task_id, target)
                message = caught.value.message
                assert "final state" in message or "cannot move" in message, (source, target)
                assert store.get_task(task.task_id).state == source


def test_expected_state_mismatch_is_failed_precondition(store: JournalStore) -> None:
    task = _task(store, _player(), QUEUED)
    with pytest.raises(FailedPrecondition, match="is QUEUED, not the expected WAITING"):
        store.transition_task(task.task_id, RUNNING, expected_state=WAITING)
    assert store.get_task(task.task_id).state == QUEUED


@pytest.mark.parametrize("state", [0, 7, 99, -1])
def test_unknown_requested_states_are_invalid_argument(store: JournalStore, state: int) -> None:
    task = _task(store, _player(), QUEUED)
    with pytest.raises(InvalidArgument, match="state"):
        store.transition_task(task.task_id, state)
    if state:
        with pytest.raises(InvalidArgument, match="expected_state"):
            store.transition_task(task.task_id, RUNNING, expected_state=state)
    with pytest.raises(InvalidArgument, match=r"states\[1\]"):
        store.list_tasks(task.player_id, [QUEUED, state])
    assert store.get_task(task.task_id).state == QUEUED


def test_unknown_stored_state_is_refused_never_run(
    store: JournalStore,
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    player = _player()
    odd = _task(store, player, QUEUED)
    with sessions.begin() as session:
        session.execute(
            update(TaskRow).where(TaskRow.task_id == odd.task_id).values(state="paused")
        )
    with pytest.raises(ServiceError, match="unknown stored state 'paused'") as caught:
        store.get_task(odd.task_id)
    assert caught.value.code == "INTERNAL"
    with pytest.raises(ServiceError, match="unknown stored state"):
        store.transition_task(odd.task_id, RUNNING)
    with pytest.raises(ServiceError, match="unknown stored state"):
        store.create_task(player, MODULE, _input(), odd.event_key)
    assert store.claim_tasks("engine-1", 10, 60) == []
    with sessions() as session:
        assert (
            session.scalar(select(TaskRow.state).where(TaskRow.task_id == odd.task_id)) == "paused"
        )


def test_result_only_with_terminal_states_and_bounded(
    make_store: Callable[..., JournalStore],
) -> None:
    store = make_store(max_result_bytes=50)
    task = _task(store, _player(), RUNNING)
    with pytest.raises(InvalidArgument, match="result is only for terminal states"):
        store.transition_task(task.task_id, WAITING, result=_result())
    with pytest.raises(InvalidArgument, match="over the 50 byte limit"):
        store.transition_task(task.task_id, FAILED, result=_result("x" * 60))
    assert store.get_task(task.task_id).state == RUNNING
    assert store.transition_task(task.task_id, FAILED).state == FAILED


def test_missing_task_is_not_found(store: JournalStore) -> None:
    with pytest.raises(NotFound, match="no task"):
        store.get_task("nope")
    with pytest.raises(NotFound, match="no task"):
        store.transition_task("nope", RUNNING)


def test_list_tasks_pages_oldest_first_and_filters_states(store: JournalStore) -> None:
    player = _player()
    tasks = [_task(store, player, state) for state in [QUEUED, RUNNING, WAITING, SUCCEEDED] * 3]
    seen: list[str] = []
    token = ""
    while True:
        page, token = store.list_tasks(player, page_size=5, page_token=token)
        seen += _ids(page)
        if not token:
            break
    assert seen == _ids(tasks)
    queued_or_waiting, _ = store.list_tasks(player, [WAITING, QUEUED])
    assert _ids(queued_or_waiting) == [t.task_id for t in tasks if t.state in (QUEUED, WAITING)]
    assert store.list_tasks(_player()) == ([], "")
    with pytest.raises(InvalidArgument, match="page_token is malformed"):
        store.list_tasks(player, page_token="garbage!")
    with pytest.raises(InvalidArgument, match="page_size"):
        store.list_tasks(player, page_size=-1)


def test_queue_waiting_moves_only_the_players_waiting_tasks(
    store: JournalStore, clock: Clock
) -> None:
    player, other = _player(), _player()
    tasks = [_task(store, player, state) for state in [WAITING, QUEUED, RUNNING, WAITING, FAILED]]
    theirs = _task(store, other, WAITING)
    clock.now += dt.timedelta(seconds=5)
    waiting = [t.task_id for t in tasks if t.state == WAITING]
    assert store.queue_waiting(player) == waiting  # oldest first
    listed, _ = store.list_tasks(player)
    assert [t.state for t in listed] == [QUEUED, QUEUED, RUNNING, QUEUED, FAILED]
    for task in listed:
        if task.task_id in waiting:  # moved as TransitionTask moves them: state and time
            assert task.updated_at.ToDatetime(tzinfo=dt.UTC) == clock.now
    assert store.queue_waiting(player) == []  # safe to repeat
    assert store.get_task(theirs.task_id).state == WAITING
    assert store.queue_waiting(_player()) == []
    with pytest.raises(InvalidArgument, match="player_id is required"):
        store.queue_waiting("")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("player_id", "", "player_id is required"),
        ("player_id", "p" * 65, "longer than 64"),
        ("player_id", "p\x00", "NUL"),
        ("module_id", "", "module_id is required"),
        ("module_id", "m\n", "printable"),
        ("event_key", "", "event_key is required"),
        ("event_key", "k" * 129, "longer than 128"),
    ],
)
def test_create_validates_ids(store: JournalStore, field: str, value: str, message: str) -> None:
    args = {"player_id": _player(), "module_id": MODULE, "event_key": "k", "input": _input()}
    args[field] = value
    with pytest.raises(InvalidArgument, match=message):
        store.create_task(**args)


# -- receipts ------------------------------------------------------------------------------------


def test_receipts_record_complete_replay(store: JournalStore, clock: Clock) -> None:
    task = _task(store, _player(), RUNNING)
    step = f"{task.task_id}/0"
    receipt, created = store.record_step(step, task.task_id, 0, "economy.credit")
    assert created and receipt.state == SS.STEP_STATE_RUNNING and receipt.result == b""
    assert receipt.player_id == task.player_id and receipt.position == 0

    again, created = store.record_step(step, task.task_id, 0, "economy.credit")
    assert not created and again == receipt

    clock.advance(1)
    done = store.complete_step(step, "economy.credit", b"\x08\x01receipt", "system:credit_receipt")
    assert done.state == SS.STEP_STATE_DONE
    assert (done.result, done.codec_id) == (b"\x08\x01receipt", "system:credit_receipt")
    # The same completion again changes nothing; recording again hands back the result.
    assert (
        store.complete_step(step, "economy.credit", b"\x08\x01receipt", "system:credit_receipt")
        == done
    )
    replay, created = store.record_step(step, task.task_id, 0, "economy.credit")
    assert not created and replay == done
    assert store.get_step(step, "economy.credit") == done

    with pytest.raises(FailedPrecondition, match="different result"):
        store.complete_step(step, "economy.credit", b"other", "system:credit_receipt")
    with pytest.raises(FailedPrecondition, match="different result"):
        store.complete_step(step, "economy.credit", b"\x08\x01receipt", "system:other_codec")
    assert store.get_step(step, "economy.credit") == done


def _completed(step: str, result: bytes = b"ok") -> journal_pb2.CompletedStep:
    return journal_pb2.CompletedStep(
        step_id=step, tool="economy.credit", result=result, codec_id="system:json/v1"
    )


def test_a_result_travels_with_the_next_intent(store: JournalStore, sessions: sessionmaker) -> None:  # type: ignore[type-arg]
    """RecordStep's `completed`: the earlier step's result is stored in the same transaction,
    before the intent; all or nothing."""
    task = _task(store, _player(), RUNNING)
    first, second = f"{task.task_id}/0", f"{task.task_id}/1"
    store.record_step(first, task.task_id, 0, "economy.credit")

    def record(step: str, position: int, *done: journal_pb2.CompletedStep) -> Any:
        with sessions.begin() as session:
            return store.record_step_in(
                session,
                step_id=step,
                task_id=task.task_id,
                position=position,
                tool="economy.credit",
                completed=list(done),
            )

    receipt, created = record(second, 1, _completed(first))
    assert created and receipt.state == SS.STEP_STATE_RUNNING
    stored = store.get_step(first, "economy.credit")
    assert (stored.state, stored.result) == (SS.STEP_STATE_DONE, b"ok")
    # Again (a retry whose answer was lost): the same result is accepted, nothing changes.
    again, created = record(second, 1, _completed(first))
    assert not created and again == receipt
    # A conflicting result fails the whole write: the intent of a third step is not stored.
    third = f"{task.task_id}/2"
    with pytest.raises(FailedPrecondition, match="different result"):
        record(third, 2, _completed(first, b"other"))
    with pytest.raises(NotFound):
        store.get_step(third, "economy.credit")
    # A step of another task never travels with this one.
    other = _task(store, task.player_id, RUNNING)
    foreign = f"{other.task_id}/0"
    store.record_step(foreign, other.task_id, 0, "economy.credit")
    with pytest.raises(InvalidArgument, match="belongs to task"):
        record(third, 2, _completed(foreign))
    assert store.get_step(foreign, "economy.credit").state == SS.STEP_STATE_RUNNING
    with pytest.raises(NotFound):
        store.get_step(third, "economy.credit")


def test_receipt_conflicts_are_failed_precondition(store: JournalStore) -> None:
    player = _player()
    task, other = _task(store, player, RUNNING), _task(store, player, RUNNING)
    step = f"{task.task_id}/0"
    store.record_step(step, task.task_id, 0, "economy.credit")
    with pytest.raises(
        FailedPrecondition, match="recorded for tool 'economy.credit', not 'economy.debit'"
    ):
        store.record_step(step, task.task_id, 0, "economy.debit")
    with pytest.raises(FailedPrecondition, match="was recorded for task"):
        store.record_step(step, other.task_id, 0, "economy.credit")
    with pytest.raises(FailedPrecondition, match="was recorded for task"):
        store.record_step(step, task.task_id, 1, "economy.credit")
    with pytest.raises(FailedPrecondition, match="not 'economy.debit'"):
        store.complete_step(step, "economy.debit", b"x", "c:c")
    # Replay refuses a receipt recorded for another tool, never hands it over.
    with pytest.raises(FailedPrecondition, match="refusing to replay it for tool 'economy.debit'"):
        store.get_step(step, "economy.debit")
    assert store.get_step(step, "economy.credit").state == SS.STEP_STATE_RUNNING


def test_receipt_errors(make_store: Callable[..., JournalStore]) -> None:
    store = make_store(max_result_bytes=10)
    player = _player()
    with pytest.raises(NotFound, match="no task"):
        store.record_step("s", "missing-task", 0, "t.t")
    with pytest.raises(NotFound, match="record the step before completing"):
        store.complete_step("s", "t.t", b"", "c:c")
    with pytest.raises(NotFound, match="no receipt"):
        store.get_step("s", "t.t")
    task = _task(store, player, RUNNING)
    store.record_step("s", task.task_id, 0, "t.t")
    with pytest.raises(InvalidArgument, match="over the 10 byte limit"):
        store.complete_step("s", "t.t", b"x" * 11, "c:c")
    with pytest.raises(InvalidArgument, match="codec_id is required"):
        store.complete_step("s", "t.t", b"x", "")
    with pytest.raises(InvalidArgument, match="tool is required"):
        store.record_step("s2", task.task_id, 0, "")
    with pytest.raises(InvalidArgument, match="step_id must not contain NUL"):
        store.record_step("s\x00", task.task_id, 0, "t.t")
    finished = _task(store, player, SUCCEEDED)
    with pytest.raises(FailedPrecondition, match="SUCCEEDED, a final state"):
        store.record_step("s3", finished.task_id, 0, "t.t")


# -- bounds --------------------------------------------------------------------------------------


def test_task_bound_by_count_evicts_terminal_oldest_first(
    make_store: Callable[..., JournalStore], engine: Engine
) -> None:
    store = make_store(task_max_entries=3)
    player = _player()
    a, b, c = (_task(store, player, RUNNING) for _ in range(3))
    before = _listed(store, player)
    # Full of unfinished tasks: STORAGE_FULL and nothing written.
    with pytest.raises(ResourceExhausted, match="^STORAGE_FULL: "):
        store.create_task(player, MODULE, _input(), "e-new")
    assert _listed(store, player) == before
    # b and c finish; the oldest finished one (b) goes, a (running, older) stays.
    store.transition_task(c.task_id, SUCCEEDED)
    store.transition_task(b.task_id, FAILED)
    d, created, evicted = store.create_task(player, MODULE, _input(), "e-d")
    assert (created, evicted) == (True, 1)
    assert [tid for tid, _ in _listed(store, player)] == [a.task_id, c.task_id, d.task_id]
    with pytest.raises(NotFound):
        store.get_task(b.task_id)
    # Other players are untouched by this player's bound.
    other = _player()
    for _ in range(3):
        _task(store, other, QUEUED)
    assert len(_listed(store, player)) == 3


def test_task_bound_by_bytes(make_store: Callable[..., JournalStore]) -> None:
    player = _player()
    probe = make_store()
    first = _task(probe, player, SUCCEEDED, key="e-0000", pad="x" * 100)
    size = _size(first)
    store = make_store(task_max_bytes=2 * size + size // 2)
    second = _task(store, player, RUNNING, key="e-0001", pad="y" * 100)
    assert _size(second) == size
    # A third same-sized task needs room: the finished first one goes.
    third, created, evicted = store.create_task(player, MODULE, _input(pad="z" * 100), "e-0002")
    assert (created, evicted) == (True, 1)
    assert [tid for tid, _ in _listed(store, player)] == [second.task_id, third.task_id]
    # Now both are unfinished: a fourth does not fit and nothing is written.
    with pytest.raises(ResourceExhausted, match="STORAGE_FULL"):
        store.create_task(player, MODULE, _input(pad="w" * 100), "e-0003")
    # A small one still fits in what is left.
    small, created, evicted = store.create_task(player, MODULE, _input(), "e-4")
    assert (created, evicted) == (True, 0)
    # One task alone over the bound can never fit: that is the caller's mistake.
    with pytest.raises(InvalidArgument, match="byte bound"):
        store.create_task(player, MODULE, _input(pad="q" * 3 * size), "e-big")
    assert len(_listed(store, player)) == 3


def test_room_made_by_bytes_reads_the_oldest_tasks_page_after_page(
    make_store: Callable[..., JournalStore],
) -> None:
    """Evictions are read oldest first in growing pages (9 rows, then 36): a task that needs
    about twenty small ones gone evicts exactly as many of the oldest finished ones as it
    needs to fit under the bound less its headroom (a 64th of it), no more."""
    player = _player()
    probe = make_store()
    small = [_task(probe, player, SUCCEEDED, key=f"e-{i:04}") for i in range(30)]
    running = _task(probe, player, RUNNING, key="e-run")  # unfinished: never evicted
    size = _size(small[0])
    assert {_size(task) for task in small} == {size}
    max_bytes = 31 * size + size // 2
    store = make_store(task_max_entries=1000, task_max_bytes=max_bytes)
    big, created, evicted = store.create_task(
        player, MODULE, _input(pad="z" * (19 * size)), "e-big"
    )
    stored = 30 * size + _size(running)
    roomy = max_bytes - max_bytes // HEADROOM_SHARE
    needed = next(n for n in range(31) if stored - n * size + _size(big) <= roomy)
    assert needed > 9  # more than the first page holds
    assert stored - (needed - 1) * size + _size(big) <= max_bytes  # one fewer would fit
    assert created and evicted == needed
    kept = [tid for tid, _ in _listed(store, player)]
    assert kept == [t.task_id for t in small[needed:]] + [running.task_id, big.task_id]


def test_task_result_growth_respects_the_byte_bound(
    make_store: Callable[..., JournalStore],
) -> None:
    player = _player()
    probe = make_store()
    task = _task(probe, player, RUNNING, key="e-0000")
    size = _size(task)
    store = make_store(task_max_bytes=2 * size + 40)
    other = _task(store, player, RUNNING, key="e-0001")
    # A 100-byte result does not fit beside another unfinished task: refused, nothing changes.
    with pytest.raises(ResourceExhausted, match="STORAGE_FULL"):
        store.transition_task(task.task_id, SUCCEEDED, result=_result("r" * 100))
    assert store.get_task(task.task_id).state == RUNNING
    # Without a result the ledger does not grow: a full ledger can always be drained.
    assert store.transition_task(task.task_id, FAILED).state == FAILED
    # Now the first is terminal and is evicted to make room for the other's result.
    done = store.transition_task(other.task_id, SUCCEEDED, result=_result("r" * 60))
    assert done.result.text == "r" * 60
    assert [tid for tid, _ in _listed(store, player)] == [other.task_id]


def test_receipt_bounds_evict_only_receipts_of_finished_tasks(
    make_store: Callable[..., JournalStore],
) -> None:
    store = make_store(receipt_max_entries=3)
    player = _player()
    a, b = _task(store, player, RUNNING), _task(store, player, RUNNING)
    store.record_step("a/0", a.task_id, 0, "t.t")
    store.record_step("a/1", a.task_id, 1, "t.t")
    store.record_step("b/0", b.task_id, 0, "t.t")
    with pytest.raises(ResourceExhausted, match="STORAGE_FULL"):
        store.record_step("b/1", b.task_id, 1, "t.t")
    with pytest.raises(NotFound):
        store.get_step("b/1", "t.t")
    store.transition_task(a.task_id, SUCCEEDED)
    _, created = store.record_step("b/1", b.task_id, 1, "t.t")
    assert created
    with pytest.raises(NotFound):
        store.get_step("a/0", "t.t")  # the oldest receipt of the finished task went
    assert store.get_step("a/1", "t.t").step_id == "a/1"
    assert store.get_step("b/0", "t.t").step_id == "b/0"


def test_a_receipt_that_must_evict_leaves_headroom_for_the_next_ones(
    make_store: Callable[..., JournalStore],
) -> None:
    """A player at the receipt bound does not evict on every write: the write that must evict
    frees a 64th of the bound more (here two receipts), and the next two writes fit as they
    are."""
    bound = 2 * HEADROOM_SHARE
    store = make_store(receipt_max_entries=bound)
    player = _player()
    old, new = _task(store, player, RUNNING), _task(store, player, RUNNING)
    for position in range(bound):
        store.record_step(f"old/{position}", old.task_id, position, "t.t")
    store.transition_task(old.task_id, SUCCEEDED)

    def kept() -> list[int]:
        present = []
        for position in range(bound):
            with contextlib.suppress(NotFound):
                store.get_step(f"old/{position}", "t.t")
                present.append(position)
        return present

    store.record_step("new/0", new.task_id, 0, "t.t")
    assert kept() == list(range(3, bound))  # one for the write, two of headroom
    store.record_step("new/1", new.task_id, 1, "t.t")
    store.record_step("new/2", new.task_id, 2, "t.t")
    assert kept() == list(range(3, bound))  # the headroom taken, nothing evicted
    store.record_step("new/3", new.task_id, 3, "t.t")
    assert kept() == list(range(6, bound))


def test_receipt_result_growth_respects_the_byte_bound(
    make_store: Callable[..., JournalStore],
) -> None:
    player = _player()
    store = make_store(receipt_max_bytes=400)
    running = _task(store, player, RUNNING)
    store.record_step("r/0", running.task_id, 0, "t.t")
    store.record_step("r/1", running.task_id, 1, "t.t")
    with pytest.raises(ResourceExhausted, match="STORAGE_FULL"):
        store.complete_step("r/0", "t.t", b"x" * 300, "c:c")
    assert store.get_step("r/0", "t.t").state == SS.STEP_STATE_RUNNING
    # A receipt whose task was evicted (gone) counts as finished.
    finished = _task(store, player, RUNNING)
    store.record_step("f/0", finished.task_id, 0, "t.t")
    store.transition_task(finished.task_id, SUCCEEDED)
    done = store.complete_step("r/0", "t.t", b"x" * 200, "c:c")
    assert done.result == b"x" * 200
    with pytest.raises(NotFound):
        store.get_step("f/0", "t.t")


# -- leases --------------------------------------------------------------------------------------


def test_lease_acquire_renew_release_expiry(store: JournalStore, clock: Clock) -> None:
    first = store.acquire_lease("player:p1", "engine-a", 30)
    assert (first.owner, first.name) == ("engine-a", "player:p1")
    assert first.expires_at.ToDatetime(tzinfo=dt.UTC) == clock.now + dt.timedelta(seconds=30)
    with pytest.raises(FailedPrecondition, match="held by 'engine-a'"):
        store.acquire_lease("player:p1", "engine-b", 30)
    # The same owner acquiring again gets a new, larger token; the old one is stale.
    second = store.acquire_lease("player:p1", "engine-a", 30)
    assert second.token > first.token
    with pytest.raises(FailedPrecondition, match="not by 'engine-a' with token"):
        store.renew_lease("player:p1", "engine-a", first.token, 30)
    clock.advance(20)
    renewed = store.renew_lease("player:p1", "engine-a", second.token, 30)
    assert renewed.token == second.token
    assert renewed.expires_at.ToDatetime(tzinfo=dt.UTC) == clock.now + dt.timedelta(seconds=30)
    clock.advance(29)
    with pytest.raises(FailedPrecondition):
        store.acquire_lease("player:p1", "engine-b", 30)
    clock.advance(2)  # expired
    taken = store.acquire_lease("player:p1", "engine-b", 30)
    assert taken.owner == "engine-b" and taken.token > second.token
    with pytest.raises(FailedPrecondition):
        store.renew_lease("player:p1", "engine-a", second.token, 30)
    assert store.release_lease("player:p1", "engine-a", second.token) is False
    assert store.release_lease("player:p1", "engine-b", taken.token) is True
    assert store.release_lease("player:p1", "engine-b", taken.token) is False
    with pytest.raises(FailedPrecondition, match="not held"):
        store.renew_lease("player:p1", "engine-b", taken.token, 30)
    # After a release the counter is kept: the next token is larger still.
    again = store.acquire_lease("player:p1", "engine-a", 30)
    assert again.token > taken.token


def test_acquire_asks_again_when_the_holder_lets_go_meanwhile(
    store: JournalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease is held when the upsert runs and given back before AcquireLease reads who
    holds it (in autocommit on PostgreSQL, a release can commit in between): it is asked for
    again and taken, not refused or failed."""
    first = store.acquire_lease("player:race", "engine-a", 30)
    released: list[bool] = []
    real = Connection.execute  # what a session's execute runs too
    acquires = (leases_module._ACQUIRE_SQLITE, leases_module._ACQUIRE_POSTGRESQL)

    def execute(connection: Connection, statement: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(connection, statement, *args, **kwargs)
        if any(statement is acquire for acquire in acquires) and not released:
            released.append(True)
            real(
                connection,
                leases_module._RELEASE,
                {"lease_name": "player:race", "holder": "engine-a", "held_token": first.token},
            )
        return result

    monkeypatch.setattr(Connection, "execute", execute)
    second = store.acquire_lease("player:race", "engine-b", 30)
    assert released == [True]
    assert second.owner == "engine-b" and second.token > first.token


def test_lease_token_grows_even_if_the_row_is_deleted(
    store: JournalStore,
    sessions: sessionmaker,
    clock: Clock,  # type: ignore[type-arg]
) -> None:
    tokens = [store.acquire_lease("player:p2", "engine-a", 30).token for _ in range(3)]
    with sessions.begin() as session:
        session.execute(LeaseRow.__table__.delete().where(LeaseRow.name == "player:p2"))
    clock.advance(1)
    tokens.append(store.acquire_lease("player:p2", "engine-b", 30).token)
    assert tokens == sorted(set(tokens))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.acquire_lease("", "o", 30), "name is required"),
        (lambda s: s.acquire_lease("n", "", 30), "owner is required"),
        (lambda s: s.acquire_lease("n", "o", 0), "ttl_seconds must be between 1 and 3600"),
        (lambda s: s.acquire_lease("n", "o", 3601), "ttl_seconds"),
        (lambda s: s.acquire_lease("n\x00", "o", 30), "NUL"),
        (lambda s: s.renew_lease("n", "o", 0, 30), "token is required"),
        (lambda s: s.renew_lease("n", "o", 1, 0), "ttl_seconds"),
        (lambda s: s.release_lease("n", "", 1), "owner is required"),
        (lambda s: s.release_lease("n", "o", 2**63), "larger than any token"),
    ],
)
def test_lease_validation(
    store: JournalStore, call: Callable[[JournalStore], object], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        call(store)


def _commit(
    player: str,
    *operations: journal_pb2.CommitOperation,
    request_id: str | None = None,
    **extra: Any,
) -> journal_pb2.CommitRequest:
    return journal_pb2.CommitRequest(
        request_id=f"r-{uuid.uuid4()}" if request_id is None else request_id,
        player_id=player,
        operations=list(operations),
        **extra,
    )


def _key(player: str, storage_type: str = "system:orders") -> journal_pb2.DocumentKey:
    return journal_pb2.DocumentKey(
        player_id=player, owner_module="system:shop", storage_type=storage_type
    )


def _put(
    player: str, version: int, data: bytes = b"d", storage_type: str = "system:orders"
) -> journal_pb2.CommitOperation:
    return journal_pb2.CommitOperation(
        put=journal_pb2.DocumentPut(
            key=_key(player, storage_type),
            expected_version=version,
            data=data,
            codec_id="system:orders",
        )
    )


def _move(task_id: str, state: int, **extra: Any) -> journal_pb2.CommitOperation:
    return journal_pb2.CommitOperation(
        transition=journal_pb2.TaskTransition(task_id=task_id, state=state, **extra)
    )


def _receipt(
    step_id: str, task_id: str, state: int = SS.STEP_STATE_RUNNING, tool: str = "t.t", **extra: Any
) -> journal_pb2.CommitOperation:
    return journal_pb2.CommitOperation(
        receipt=journal_pb2.ReceiptWrite(
            step_id=step_id, task_id=task_id, tool=tool, state=state, **extra
        )
    )


def _usage(calls: int = 1) -> journal_pb2.CommitOperation:
    return journal_pb2.CommitOperation(usage=journal_pb2.UsageIncrement(day=DAY, model_calls=calls))


def test_stale_fence_is_refused_on_every_fenced_write(store: JournalStore, clock: Clock) -> None:
    player = _player()
    task = _task(store, player, RUNNING)
    store.record_step("s/0", task.task_id, 0, "t.t")
    old = store.acquire_lease("task:x", "engine-a", 30)
    current = store.acquire_lease("task:x", "engine-a", 30)
    stale = journal_pb2.Fence(lease_name="task:x", token=old.token)
    good = journal_pb2.Fence(lease_name="task:x", token=current.token)
    missing = journal_pb2.Fence(lease_name="task:none", token=5)

    def writes(fence: journal_pb2.Fence) -> list[Callable[[], object]]:
        return [
            lambda: store.transition_task(task.task_id, WAITING, fence=fence),
            lambda: store.record_step("s/1", task.task_id, 1, "t.t", fence=fence),
            lambda: store.complete_step("s/0", "t.t", b"r", "c:c", fence=fence),
            lambda: store.commit(_commit(player, _put(player, 0), fence=fence)),
        ]

    for fence, words in [(stale, "was replaced by token"), (missing, "not held by anyone")]:
        for write in writes(fence):
            with pytest.raises(FailedPrecondition, match=f"stale fence: .*{words}") as refused:
                write()
            assert refused.value.reason == STALE_FENCE
    clock.advance(31)  # the current token expired
    for write in writes(good):
        with pytest.raises(FailedPrecondition, match="stale fence: .*has expired"):
            write()
    store.renew_lease("task:x", "engine-a", current.token, 30)
    store.release_lease("task:x", "engine-a", current.token)
    for write in writes(good):
        with pytest.raises(FailedPrecondition, match="stale fence: .*not held"):
            write()
    # None of them wrote anything.
    assert store.get_task(task.task_id).state == RUNNING
    assert store.get_step("s/0", "t.t").state == SS.STEP_STATE_RUNNING
    with pytest.raises(NotFound):
        store.get_step("s/1", "t.t")
    with pytest.raises(NotFound):
        PlayerDataStore(store._sessions).get_document(_key(player))
    # With the live token every write goes through.
    fresh = store.acquire_lease("task:x", "engine-a", 30)
    fence = journal_pb2.Fence(lease_name="task:x", token=fresh.token)
    for write in writes(fence):
        write()
    assert store.get_task(task.task_id).state == WAITING


# -- claims --------------------------------------------------------------------------------------


def test_claim_tasks_leases_and_reclaims_expired(store: JournalStore, clock: Clock) -> None:
    online, offline = _player(), _player()
    waiting = _task(store, online, WAITING)
    mine = [_task(store, online, QUEUED) for _ in range(3)]
    _task(store, offline, QUEUED)
    claims = store.claim_tasks("engine-a", 2, 60, [online])
    assert [c.task.task_id for c in claims] == _ids(mine[:2])
    for claim in claims:
        assert claim.task.state == RUNNING and claim.task.attempts == 1
        assert claim.lease.name == f"task:{claim.task.task_id}" and claim.lease.owner == "engine-a"
        assert claim.lease.expires_at.ToDatetime(tzinfo=dt.UTC) == clock.now + dt.timedelta(
            seconds=60
        )
        assert store.get_task(claim.task.task_id).state == RUNNING
    rest = store.claim_tasks("engine-b", 10, 60, [online])
    assert [c.task.task_id for c in rest] == [mine[2].task_id]
    assert store.claim_tasks("engine-b", 10, 60, [online]) == []
    assert store.get_task(waiting.task_id).state == WAITING

    # engine-a dies: after its leases expire, its RUNNING tasks are claimed again.
    clock.advance(30)
    store.renew_lease(rest[0].lease.name, "engine-b", rest[0].lease.token, 60)
    clock.advance(31)
    again = store.claim_tasks("engine-b", 10, 60, [online])
    assert sorted(c.task.task_id for c in again) == sorted(_ids(mine[:2]))
    for claim, old in zip(
        sorted(again, key=lambda c: c.task.task_id),
        sorted(claims, key=lambda c: c.task.task_id),
        strict=True,
    ):
        assert claim.task.attempts == 2 and claim.lease.token > old.lease.token
        assert claim.lease.owner == "engine-b"
    # The dead replica's fence is stale now.
    with pytest.raises(FailedPrecondition, match="stale fence"):
        store.transition_task(
            claims[0].task.task_id,
            SUCCEEDED,
            fence=journal_pb2.Fence(lease_name=claims[0].lease.name, token=claims[0].lease.token),
        )
    # Without a player filter, any player's queued task is claimed.
    assert len(store.claim_tasks("engine-c", 10, 60)) == 1


def test_a_claim_says_which_gateway_replica_holds_each_tasks_player(
    store: JournalStore,
    sessions: sessionmaker,
    clock: Clock,  # type: ignore[type-arg]
) -> None:
    """What PresenceService.LocatePlayer would answer at the claim travels with each claimed
    task, so the engine sends the task's game-tool calls without asking."""
    presence = PresenceStore(sessions)
    replica = f"gw-{uuid.uuid4()}"
    presence.renew_replica(replica, "10.0.0.7:9100", 10, players_digest([]), clock.now)
    here, nowhere = _player(), _player()
    presence.attach(replica, [here], clock.now)
    tasks = {_task(store, here).task_id: here, _task(store, nowhere).task_id: nowhere}
    claims = store.claim_tasks("engine-a", 10, 60, [here, nowhere])
    assert {c.task.task_id: c.gateway_address for c in claims} == {
        task_id: "10.0.0.7:9100" if player == here else "" for task_id, player in tasks.items()
    }
    # Once the replica's lease has ended it holds nobody: the claim names no address.
    clock.advance(11)
    late = _task(store, here)
    (claim,) = store.claim_tasks("engine-a", 10, 60, [here])
    assert claim.task.task_id == late.task_id and claim.gateway_address == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", 1, 60), "owner is required"),
        (("o", 0, 60), "max_tasks must be between 1 and 100"),
        (("o", 101, 60), "max_tasks"),
        (("o", 1, 0), "lease_seconds must be between 1 and 3600"),
        (("o", 1, 3601), "lease_seconds"),
        (("o", 1, 60, ["ok", ""]), r"player_ids\[1\] is required"),
    ],
)
def test_claim_validation(store: JournalStore, args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        store.claim_tasks(*args)


def test_concurrent_claimers_never_share_a_task(store: JournalStore) -> None:
    players = [_player() for _ in range(5)]
    tasks = {_task(store, players[i % 5], QUEUED).task_id for i in range(50)}
    barrier = threading.Barrier(4)

    def claimer(owner: str) -> list[str]:
        barrier.wait()
        got: list[str] = []
        while claims := store.claim_tasks(owner, 3, 60, players):
            got += [c.task.task_id for c in claims]
        return got

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(claimer, [f"engine-{i}" for i in range(4)]))
    claimed = [task_id for result in results for task_id in result]
    assert len(claimed) == len(set(claimed)) == 50
    assert set(claimed) == tasks


def test_concurrent_claimers_share_no_orphaned_task(store: JournalStore, clock: Clock) -> None:
    """A dead replica's RUNNING tasks, claimed again by four replicas at once: each goes to
    exactly one of them, with a token above the dead replica's."""
    players = [_player() for _ in range(5)]
    for i in range(40):
        _task(store, players[i % 5], QUEUED)
    dead = {c.task.task_id: c.lease.token for c in store.claim_tasks("engine-dead", 40, 60)}
    assert len(dead) == 40
    clock.advance(61)
    barrier = threading.Barrier(4)

    def claimer(owner: str) -> list[journal_pb2.TaskClaim]:
        barrier.wait()
        got: list[journal_pb2.TaskClaim] = []
        while claims := store.claim_tasks(owner, 3, 60):
            got += claims
        return got

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(claimer, [f"engine-{i}" for i in range(4)]))
    claimed = [claim for result in results for claim in result]
    assert sorted(c.task.task_id for c in claimed) == sorted(dead)
    for claim in claimed:
        assert claim.task.attempts == 2 and claim.lease.token > dead[claim.task.task_id]
        assert store.get_task(claim.task.task_id).state == RUNNING


def test_claim_takes_over_a_queued_tasks_leftover_lease(store: JournalStore) -> None:
    """A task moved back to QUEUED while its lease was still held is claimable at once; the
    earlier holder's fence goes stale."""
    task = _task(store, _player(), QUEUED)
    (first,) = store.claim_tasks("engine-a", 1, 60)
    store.transition_task(task.task_id, QUEUED, expected_state=RUNNING)
    (second,) = store.claim_tasks("engine-b", 1, 60)
    assert second.task.task_id == task.task_id and second.task.attempts == 2
    assert second.lease.owner == "engine-b" and second.lease.token > first.lease.token
    with pytest.raises(FailedPrecondition, match="stale fence"):
        store.transition_task(
            task.task_id,
            SUCCEEDED,
            fence=journal_pb2.Fence(lease_name=first.lease.name, token=first.lease.token),
        )


# -- commit --------------------------------------------------------------------------------------


def test_commit_applies_everything_in_order(store: JournalStore) -> None:
    player = _player()
    data = PlayerDataStore(store._sessions)
    task = _task(store, player, RUNNING)
    response = store.commit(
        _commit(
            player,
            _receipt("c/0", task.task_id),
            _put(player, 0, b"order-1"),
            _receipt("c/0", task.task_id, SS.STEP_STATE_DONE, result=b"ok", codec_id="c:c"),
            journal_pb2.CommitOperation(
                check=journal_pb2.VersionCheck(key=_key(player), expected_version=1)
            ),
            _put(player, 1, b"order-2"),
            _usage(2),
            _move(task.task_id, SUCCEEDED, expected_state=RUNNING, result=_result()),
        )
    )
    assert list(response.versions) == [1, 2] and not response.replayed
    assert data.get_document(_key(player)).data == b"order-2"
    assert store.get_step("c/0", "t.t").result == b"ok"
    assert store.get_task(task.task_id).state == SUCCEEDED
    assert data.get_usage(player, DAY)[0].model_calls == 2
    deleted = store.commit(
        _commit(
            player,
            journal_pb2.CommitOperation(
                delete=journal_pb2.DocumentDelete(key=_key(player), expected_version=2)
            ),
        )
    )
    assert list(deleted.versions) == [0]


@pytest.mark.parametrize(
    ("last", "error", "words"),
    [
        (lambda p, t: _put(p, 5, storage_type="system:wallet"), Aborted, "version conflict"),
        (
            lambda p, t: _move(t, QUEUED, expected_state=WAITING),
            FailedPrecondition,
            "not the expected",
        ),
        (lambda p, t: _move("missing", SUCCEEDED), NotFound, "no task"),
        (lambda p, t: _receipt("c/0", t, tool="x"), FailedPrecondition, "not 'x'"),
        (
            lambda p, t: _put(p, 0, b"x" * 300_000, storage_type="system:wallet"),
            InvalidArgument,
            "byte limit",
        ),
    ],
    ids=["version", "move", "missing-task", "receipt", "oversize"],
)
def test_commit_is_all_or_nothing(
    store: JournalStore,
    last: Callable[[str, str], journal_pb2.CommitOperation],
    error: type,
    words: str,
) -> None:
    player = _player()
    data = PlayerDataStore(store._sessions)
    task = _task(store, player, RUNNING)
    request = _commit(
        player,
        _put(player, 0, b"order-1"),
        _usage(1),
        _receipt("c/0", task.task_id),
        _move(task.task_id, SUCCEEDED),
        last(player, task.task_id),
    )
    with pytest.raises(error, match=rf"operations\[4\] \(\w+\): .*{words}"):
        store.commit(request)
    with pytest.raises(NotFound):
        data.get_document(_key(player))
    assert data.get_usage(player, DAY) == []
    with pytest.raises(NotFound):
        store.get_step("c/0", "t.t")
    assert store.get_task(task.task_id).state == RUNNING
    # The failed batch left no idempotency record: fixed, the same request id applies.
    request.operations.pop()
    assert list(store.commit(request).versions) == [1]


def test_commit_replays_by_request_id(store: JournalStore) -> None:
    player = _player()
    data = PlayerDataStore(store._sessions)
    request = _commit(player, _put(player, 0, b"v1"), _usage(1), request_id="batch-1")
    first = store.commit(request)
    again = store.commit(request)
    assert list(first.versions) == list(again.versions) == [1]
    assert (first.replayed, again.replayed) == (False, True)
    assert data.get_document(_key(player)).version == 1
    assert data.get_usage(player, DAY)[0].model_calls == 1
    with pytest.raises(InvalidArgument, match="already used for a different batch"):
        store.commit(_commit(player, _put(player, 1, b"v2"), request_id="batch-1"))
    # The same request id of another player is another batch.
    other = _player()
    assert not store.commit(_commit(other, _put(other, 0), request_id="batch-1")).replayed


def test_commit_version_conflict_is_aborted(store: JournalStore) -> None:
    player = _player()
    store.commit(_commit(player, _put(player, 0)))
    with pytest.raises(Aborted, match="expected version 0 \\(absent\\), actual version 1"):
        store.commit(_commit(player, _put(player, 0)))
    check = journal_pb2.CommitOperation(
        check=journal_pb2.VersionCheck(key=_key(player), expected_version=3)
    )
    with pytest.raises(Aborted):
        store.commit(_commit(player, check))


def test_racing_commits_on_one_version_have_one_winner(store: JournalStore) -> None:
    player = _player()
    data = PlayerDataStore(store._sessions)
    for round_ in range(4):
        barrier = threading.Barrier(2)

        def attempt(name: str, version: int = round_, barrier: threading.Barrier = barrier) -> str:
            barrier.wait()
            try:
                store.commit(_commit(player, _put(player, version, name.encode()), _usage(1)))
            except Aborted:
                return "lost"
            return name

        with ThreadPoolExecutor(max_workers=2) as pool:
            outcomes = list(pool.map(attempt, ["a", "b"]))
        winners = [o for o in outcomes if o != "lost"]
        assert len(winners) == 1, outcomes
        document = data.get_document(_key(player))
        assert (document.version, document.data) == (round_ + 1, winners[0].encode())
    assert data.get_usage(player, DAY)[0].model_calls == 4


def test_racing_retries_of_one_batch_apply_it_once(store: JournalStore) -> None:
    player = _player()
    request = _commit(player, _put(player, 0), _usage(1))
    barrier = threading.Barrier(3)

    def attempt(_: int) -> bool:
        barrier.wait()
        return store.commit(request).replayed

    with ThreadPoolExecutor(max_workers=3) as pool:
        replayed = sorted(pool.map(attempt, range(3)))
    assert replayed == [False, True, True]
    assert PlayerDataStore(store._sessions).get_usage(player, DAY)[0].model_calls == 1


@pytest.mark.parametrize(
    ("request_of", "message"),
    [
        (lambda p: _commit(p, _usage(), request_id=""), "request_id is required"),
        (lambda p: _commit("", _usage()), "player_id is required"),
        (lambda p: _commit(p), "at least one operation"),
        (
            lambda p: _commit(p, _usage(), journal_pb2.CommitOperation()),
            r"operations\[1\] has no operation",
        ),
        (lambda p: _commit(p, _put("someone-else", 0)), r"operations\[0\]\.put\.key\.player_id"),
        (lambda p: _commit(p, _receipt("s", "t", state=0)), "STEP_STATE_RUNNING"),
        (lambda p: _commit(p, _move("t", 42)), "not a known task state"),
        (
            lambda p: _commit(p, _usage(), fence=journal_pb2.Fence(token=3)),
            "fence.lease_name is required",
        ),
    ],
)
def test_commit_validation(
    store: JournalStore, request_of: Callable[[str], journal_pb2.CommitRequest], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        store.commit(request_of(_player()))


def test_commit_refuses_another_players_task_or_step(store: JournalStore) -> None:
    player, other = _player(), _player()
    theirs = _task(store, other, RUNNING)
    store.record_step("theirs/0", theirs.task_id, 0, "t.t")
    with pytest.raises(InvalidArgument, match="belongs to another player"):
        store.commit(_commit(player, _move(theirs.task_id, SUCCEEDED)))
    with pytest.raises(InvalidArgument, match="belongs to another player"):
        store.commit(_commit(player, _receipt("new/0", theirs.task_id)))
    with pytest.raises(InvalidArgument, match="belongs to another player"):
        store.commit(
            _commit(
                player,
                _receipt(
                    "theirs/0", theirs.task_id, SS.STEP_STATE_DONE, result=b"x", codec_id="c:c"
                ),
            )
        )
    assert store.get_task(theirs.task_id).state == RUNNING


# -- a property: the bounded task ledger against a model ------------------------------------------

MAX_ENTRIES, MAX_BYTES = 4, 520
MODEL_HEADROOM_SHARE = 4
"""The headroom share the model's store runs with (a quarter: one entry, 130 bytes), so that
bounds this small still leave headroom to evict."""

_operation = st.one_of(
    st.tuples(st.just("create"), st.integers(0, 120)),
    st.tuples(st.just("advance"), st.integers(0, 20), st.integers(0, 150)),
)


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JournalStore]:
    engine = make_engine(f"sqlite:///{tmp_path_factory.mktemp('journal') / 'storage.db'}")
    Base.metadata.create_all(engine)
    try:
        yield JournalStore(
            sessionmaker(engine, expire_on_commit=False),
            JournalBounds(task_max_entries=MAX_ENTRIES, task_max_bytes=MAX_BYTES),
        )
    finally:
        engine.dispose()


def _model_fit(
    ledger: list[dict[str, Any]], add_count: int, add_bytes: int, skip: str = ""
) -> list[str] | None:
    """The model: ids of terminal tasks to evict, oldest first, or None when it cannot fit.
    An addition that does not fit evicts until it fits under the bounds less their headroom,
    or, when too few are finished for that, under the bounds."""

    def fits(count: int, total: int, entries: int = MAX_ENTRIES, size: int = MAX_BYTES) -> bool:
        return (add_count == 0 or count + add_count <= entries) and (
            add_bytes <= 0 or total + add_bytes <= size
        )

    count, total = len(ledger), sum(t["size"] for t in ledger)
    if fits(count, total):
        return []
    roomy = (
        MAX_ENTRIES - MAX_ENTRIES // MODEL_HEADROOM_SHARE,
        MAX_BYTES - MAX_BYTES // MODEL_HEADROOM_SHARE,
    )
    doomed: list[str] = []
    for entry in ledger:
        if fits(count, total, *roomy):
            break
        if entry["state"] in TERMINAL and entry["id"] != skip:
            doomed.append(entry["id"])
            count -= 1
            total -= entry["size"]
    return doomed if fits(count, total) else None


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(operations=st.lists(_operation, min_size=1, max_size=18))
def test_bounded_task_ledger_matches_the_model(
    sqlite_store: JournalStore, operations: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledgers_module, "HEADROOM_SHARE", MODEL_HEADROOM_SHARE)
    store = sqlite_store
    player = _player()
    ledger: list[dict[str, Any]] = []
    for number, operation in enumerate(operations):
        if operation[0] == "create":
            data = _input(pad="x" * operation[1])
            key = f"e{number}"
            size = (
                36
                + len(player)
                + len(MODULE)
                + len(key)
                + len(data.SerializeToString(deterministic=True))
            )
            doomed = _model_fit(ledger, 1, size)
            if doomed is None:
                with pytest.raises(ResourceExhausted, match="STORAGE_FULL"):
                    store.create_task(player, MODULE, data, key)
            else:
                task, created, evicted = store.create_task(player, MODULE, data, key)
                assert created and evicted == len(doomed) and _size(task) == size
                ledger = [t for t in ledger if t["id"] not in doomed]
                ledger.append({"id": task.task_id, "state": QUEUED, "size": size})
        elif ledger:
            entry = ledger[operation[1] % len(ledger)]
            if entry["state"] == QUEUED:
                store.transition_task(entry["id"], RUNNING)
                entry["state"] = RUNNING
            elif entry["state"] == RUNNING:
                result = _result("r" * operation[2]) if operation[2] else None
                grow = len(result.SerializeToString(deterministic=True)) if result else 0
                doomed = _model_fit(ledger, 0, grow, skip=entry["id"])
                if doomed is None:
                    with pytest.raises(ResourceExhausted, match="STORAGE_FULL"):
                        store.transition_task(entry["id"], FAILED, result=result)
                else:
                    store.transition_task(entry["id"], FAILED, result=result)
                    ledger = [t for t in ledger if t["id"] not in doomed]
                    entry["state"], entry["size"] = FAILED, entry["size"] + grow
            else:
                with pytest.raises(FailedPrecondition):
                    store.transition_task(entry["id"], SUCCEEDED)
        assert _listed(store, player) == [(t["id"], t["state"]) for t in ledger]
        assert len(ledger) <= MAX_ENTRIES and sum(t["size"] for t in ledger) <= MAX_BYTES


# -- the service in-process on port 0 -------------------------------------------------------------


@pytest.fixture(params=["group-commit", "own-transactions"])
async def stub(
    request: pytest.FixtureRequest,
    database_url: str,
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> AsyncIterator[journal_pb2_grpc.JournalServiceStub]:
    """The service as the app runs it (writes through the group committer) and with each
    write in a transaction of its own."""
    committer = GroupCommitter(sessions) if request.param == "group-commit" else None
    journal = JournalStore(sessions, JournalBounds(task_max_entries=2))
    runs = RunStore(ConversationStore(sessions, HISTORY_BOUNDS), journal.now)
    servicer = JournalServicer(journal, runs, committer)
    config = StorageConfig(port=0, metrics_port=-1, drain_seconds=0, database_url=database_url)
    host = ServiceHost(
        "storage",
        config,
        [lambda server: journal_pb2_grpc.add_JournalServiceServicer_to_server(servicer, server)],
        ["system.storage.v1.JournalService"],
    )
    await host.start()
    try:
        async with grpc.aio.insecure_channel(host.target) as channel:
            yield journal_pb2_grpc.JournalServiceStub(channel)
    finally:
        await host.stop()
        if committer is not None:
            committer.close()


async def test_a_stale_fence_says_so_in_trailing_metadata(
    stub: journal_pb2_grpc.JournalServiceStub,
) -> None:
    """Callers tell a stale fence from other FAILED_PRECONDITIONs by `x-error-reason`."""
    player = _player()
    created = await stub.CreateTask(
        journal_pb2.CreateTaskRequest(
            player_id=player, module_id=MODULE, input=_input(n=1), event_key="e1"
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as stale:
        await stub.TransitionTask(
            journal_pb2.TransitionTaskRequest(
                task_id=created.task.task_id,
                state=RUNNING,
                fence=journal_pb2.Fence(lease_name="task:nobody", token=1),
            )
        )
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_reason(stale.value) == STALE_FENCE
    with pytest.raises(grpc.aio.AioRpcError) as invalid_move:
        await stub.TransitionTask(
            journal_pb2.TransitionTaskRequest(task_id=created.task.task_id, state=SUCCEEDED)
        )
    assert invalid_move.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_reason(invalid_move.value) == ""


async def test_service_round_trip(stub: journal_pb2_grpc.JournalServiceStub) -> None:
    player = _player()
    created = await stub.CreateTask(
        journal_pb2.CreateTaskRequest(
            player_id=player, module_id=MODULE, input=_input(n=1), event_key="e1"
        ),
        timeout=10,
    )
    assert created.created and created.task.state == QUEUED
    again = await stub.CreateTask(
        journal_pb2.CreateTaskRequest(player_id=player, module_id=MODULE, event_key="e1"),
        timeout=10,
    )
    assert not again.created and again.task == created.task
    claims = await stub.ClaimTasks(
        journal_pb2.ClaimTasksRequest(
            owner="engine-a", max_tasks=5, lease_seconds=30, player_ids=[player]
        ),
        timeout=10,
    )
    (claim,) = claims.claims
    fence = journal_pb2.Fence(lease_name=claim.lease.name, token=claim.lease.token)
    recorded = await stub.RecordStep(
        journal_pb2.RecordStepRequest(
            step_id="s/0", task_id=claim.task.task_id, tool="t.t", fence=fence
        ),
        timeout=10,
    )
    assert recorded.created
    done = await stub.CompleteStep(
        journal_pb2.CompleteStepRequest(
            step_id="s/0", tool="t.t", result=b"r", codec_id="c:c", fence=fence
        ),
        timeout=10,
    )
    assert done.receipt.state == SS.STEP_STATE_DONE
    got = await stub.GetStep(journal_pb2.GetStepRequest(step_id="s/0", tool="t.t"), timeout=10)
    assert got.receipt == done.receipt
    committed = await stub.Commit(
        _commit(
            player,
            _put(player, 0),
            _move(claim.task.task_id, SUCCEEDED, result=_result()),
            fence=fence,
            request_id="b1",
        ),
        timeout=10,
    )
    assert list(committed.versions) == [1] and not committed.replayed
    replayed = await stub.Commit(
        _commit(
            player,
            _put(player, 0),
            _move(claim.task.task_id, SUCCEEDED, result=_result()),
            request_id="b1",
        ),
        timeout=10,
    )
    assert replayed.replayed and list(replayed.versions) == [1]
    task = await stub.GetTask(journal_pb2.GetTaskRequest(task_id=claim.task.task_id), timeout=10)
    assert task.task.state == SUCCEEDED and task.task.result == _result()
    listed = await stub.ListTasks(
        journal_pb2.ListTasksRequest(player_id=player, states=[SUCCEEDED]), timeout=10
    )
    assert [t.task_id for t in listed.tasks] == [claim.task.task_id]
    released = await stub.ReleaseLease(
        journal_pb2.ReleaseLeaseRequest(
            name=claim.lease.name, owner="engine-a", token=claim.lease.token
        ),
        timeout=10,
    )
    assert released.released
    lease = await stub.AcquireLease(
        journal_pb2.AcquireLeaseRequest(name="player:x", owner="o", ttl_seconds=5), timeout=10
    )
    renewed = await stub.RenewLease(
        journal_pb2.RenewLeaseRequest(
            name="player:x", owner="o", token=lease.lease.token, ttl_seconds=9
        ),
        timeout=10,
    )
    assert renewed.lease.token == lease.lease.token


def _bad_calls(player: str) -> list[tuple[str, Any, grpc.StatusCode, str]]:
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    return [
        (
            "QueueWaitingTasks",
            journal_pb2.QueueWaitingTasksRequest(),
            invalid,
            "player_id is required",
        ),
        (
            "QueueWaitingTasks",
            journal_pb2.QueueWaitingTasksRequest(player_id="p" * 65),
            invalid,
            "longer than 64",
        ),
        # An id PostgreSQL's text cannot hold, named in a write's declared locks: refused by
        # the write itself, never an error of its group's lock statement.
        (
            "QueueWaitingTasks",
            journal_pb2.QueueWaitingTasksRequest(player_id="p\x00"),
            invalid,
            "NUL",
        ),
        (
            "TransitionTask",
            journal_pb2.TransitionTaskRequest(task_id="t\x00", state=QUEUED),
            invalid,
            "NUL",
        ),
        (
            "RecordStep",
            journal_pb2.RecordStepRequest(step_id="s\x00", task_id="t", tool="x"),
            invalid,
            "NUL",
        ),
        (
            "CreateTask",
            journal_pb2.CreateTaskRequest(module_id=MODULE, event_key="e"),
            invalid,
            "player_id is required",
        ),
        (
            "CreateTask",
            journal_pb2.CreateTaskRequest(
                player_id=player + "\x00", module_id=MODULE, event_key="e"
            ),
            invalid,
            "NUL",
        ),
        (
            "CreateTask",
            journal_pb2.CreateTaskRequest(player_id=player, module_id=MODULE),
            invalid,
            "event_key is required",
        ),
        (
            "CreateTask",
            journal_pb2.CreateTaskRequest(
                player_id=player, module_id=MODULE, event_key="e", initial_state=SUCCEEDED
            ),
            invalid,
            "initial_state",
        ),
        ("GetTask", journal_pb2.GetTaskRequest(), invalid, "task_id is required"),
        (
            "GetTask",
            journal_pb2.GetTaskRequest(task_id="missing"),
            grpc.StatusCode.NOT_FOUND,
            "no task",
        ),
        (
            "ListTasks",
            journal_pb2.ListTasksRequest(player_id=player, states=[9]),
            invalid,
            "not a known task state",
        ),
        (
            "ListTasks",
            journal_pb2.ListTasksRequest(player_id=player, page_token="x"),
            invalid,
            "page_token is malformed",
        ),
        (
            "ClaimTasks",
            journal_pb2.ClaimTasksRequest(owner="o", max_tasks=0, lease_seconds=5),
            invalid,
            "max_tasks",
        ),
        (
            "TransitionTask",
            journal_pb2.TransitionTaskRequest(task_id="t"),
            invalid,
            "state is required",
        ),
        (
            "TransitionTask",
            journal_pb2.TransitionTaskRequest(
                task_id="t", state=RUNNING, fence=journal_pb2.Fence(lease_name="l", token=1)
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "stale fence",
        ),
        (
            "RecordStep",
            journal_pb2.RecordStepRequest(step_id="s", task_id="t"),
            invalid,
            "tool is required",
        ),
        (
            "RecordStep",
            journal_pb2.RecordStepRequest(step_id="s", task_id="t", tool="x"),
            grpc.StatusCode.NOT_FOUND,
            "no task",
        ),
        (
            "CompleteStep",
            journal_pb2.CompleteStepRequest(step_id="s", tool="t"),
            invalid,
            "codec_id is required",
        ),
        (
            "CompleteStep",
            journal_pb2.CompleteStepRequest(
                step_id="s", tool="t", codec_id="c", result=b"x" * 300_000
            ),
            invalid,
            "byte limit",
        ),
        ("GetStep", journal_pb2.GetStepRequest(step_id="s"), invalid, "tool is required"),
        (
            "AcquireLease",
            journal_pb2.AcquireLeaseRequest(name="n", owner="o"),
            invalid,
            "ttl_seconds",
        ),
        (
            "RenewLease",
            journal_pb2.RenewLeaseRequest(name="n", owner="o", ttl_seconds=5),
            invalid,
            "token is required",
        ),
        (
            "RenewLease",
            journal_pb2.RenewLeaseRequest(name="n", owner="o", token=3, ttl_seconds=5),
            grpc.StatusCode.FAILED_PRECONDITION,
            "not held",
        ),
        (
            "ReleaseLease",
            journal_pb2.ReleaseLeaseRequest(owner="o", token=1),
            invalid,
            "name is required",
        ),
        ("Commit", journal_pb2.CommitRequest(player_id=player), invalid, "request_id is required"),
        ("Commit", _commit(player, _put(player, 3)), grpc.StatusCode.ABORTED, "version conflict"),
    ]


async def test_service_errors_have_their_codes_and_the_server_keeps_serving(
    stub: journal_pb2_grpc.JournalServiceStub,
) -> None:
    player = _player()
    for method, request, code, words in _bad_calls(player):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await getattr(stub, method)(request, timeout=10)
        assert caught.value.code() == code, (method, caught.value.details())
        assert words in (caught.value.details() or ""), (method, caught.value.details())
        listed = await stub.ListTasks(journal_pb2.ListTasksRequest(player_id=player), timeout=10)
        assert list(listed.tasks) == []
    # STORAGE_FULL is RESOURCE_EXHAUSTED (the service's bound is 2 tasks).
    for key in ("a", "b"):
        await stub.CreateTask(
            journal_pb2.CreateTaskRequest(player_id=player, module_id=MODULE, event_key=key),
            timeout=10,
        )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.CreateTask(
            journal_pb2.CreateTaskRequest(player_id=player, module_id=MODULE, event_key="c"),
            timeout=10,
        )
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (caught.value.details() or "").startswith("STORAGE_FULL: ")
    listed = await stub.ListTasks(journal_pb2.ListTasksRequest(player_id=player), timeout=10)
    assert [t.event_key for t in listed.tasks] == ["a", "b"]


def _absent(player: str, storage_type: str) -> journal_pb2.CommitOperation:
    return journal_pb2.CommitOperation(
        check=journal_pb2.VersionCheck(key=_key(player, storage_type), expected_version=0)
    )


def test_absence_checks_never_allow_write_skew(store: JournalStore) -> None:
    # Each batch writes one document only if the other does not exist. Run one after the
    # other, the second always sees the first's document; run at once, at most one may win.
    # (On PostgreSQL the checks of absent rows take advisory locks; the loser may also be
    # rolled back as a deadlock, which clients see as UNAVAILABLE and retry.)
    from sqlalchemy.exc import OperationalError

    for _ in range(8):
        player = _player()
        barrier = threading.Barrier(2)

        def attempt(mine: str, other: str, p: str = player, b: threading.Barrier = barrier) -> bool:
            b.wait()
            try:
                store.commit(
                    _commit(
                        p, _absent(p, f"system:{other}"), _put(p, 0, storage_type=f"system:{mine}")
                    )
                )
            except (Aborted, OperationalError):
                return False
            return True

        with ThreadPoolExecutor(max_workers=2) as pool:
            won = list(pool.map(attempt, ["a", "b"], ["b", "a"]))
        assert won.count(True) <= 1, "both batches saw the other's document as absent"


# --- Interactive runs: BeginRun and FinishRun ---------------------------------------------------


def _exchange(text: str, request_id: str) -> list[common_pb2.HistoryEntry]:
    return [
        common_pb2.HistoryEntry(
            role=common_pb2.HISTORY_ROLE_PLAYER, text=text, request_id=request_id
        ),
        common_pb2.HistoryEntry(
            role=common_pb2.HISTORY_ROLE_ASSISTANT, text=f"re: {text}", request_id=request_id
        ),
    ]


async def _begin(
    stub: journal_pb2_grpc.JournalServiceStub, player: str, owner: str, history: int = 0
) -> journal_pb2.BeginRunResponse:
    return await stub.BeginRun(  # type: ignore[no-any-return]
        journal_pb2.BeginRunRequest(
            player_id=player, owner=owner, lease_seconds=30, history_entries=history
        )
    )


async def test_a_run_begins_with_the_players_lease_and_what_it_reads_first(
    stub: journal_pb2_grpc.JournalServiceStub,
) -> None:
    player = _player()
    begun = await _begin(stub, player, "engine-a#1", history=10)
    assert begun.lease.name == f"player:{player}" and begun.lease.owner == "engine-a#1"
    assert begun.lease.token > 0
    assert begun.preferences.history_enabled and begun.preferences.external_enabled
    assert list(begun.history) == []
    # One run per player: another replica is refused while the lease is held...
    with pytest.raises(grpc.aio.AioRpcError) as held:
        await _begin(stub, player, "engine-b#1")
    assert held.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "engine-a#1" in (held.value.details() or "")
    # ...and the holder itself may begin again (a larger token).
    again = await _begin(stub, player, "engine-a#1")
    assert again.lease.token > begun.lease.token


async def test_finishing_stores_the_exchange_before_the_lease_is_free(
    stub: journal_pb2_grpc.JournalServiceStub,
) -> None:
    """What a run on another replica reads when it begins holds the exchange just finished."""
    player = _player()
    first = await _begin(stub, player, "engine-a#1")
    finished = await stub.FinishRun(
        journal_pb2.FinishRunRequest(
            player_id=player,
            owner="engine-a#1",
            token=first.lease.token,
            entries=_exchange("hello", "r1"),
        )
    )
    assert finished.recorded and finished.released and not finished.history_error
    second = await _begin(stub, player, "engine-b#1", history=1)
    assert [e.text for e in second.history] == ["re: hello"]  # the newest one
    everything = await _begin(stub, player, "engine-b#1", history=100)
    assert [e.text for e in everything.history] == ["hello", "re: hello"]  # oldest first


async def test_a_retried_finish_writes_the_exchange_once(
    stub: journal_pb2_grpc.JournalServiceStub,
) -> None:
    player = _player()
    begun = await _begin(stub, player, "engine-a#1")
    request = journal_pb2.FinishRunRequest(
        player_id=player, owner="engine-a#1", token=begun.lease.token, entries=_exchange("x", "r1")
    )
    assert (await stub.FinishRun(request)).recorded
    retried = await stub.FinishRun(request)
    assert not retried.recorded and not retried.released  # written and given back already
    after = await _begin(stub, player, "engine-b#1", history=100)
    assert [e.text for e in after.history] == ["x", "re: x"]


async def test_a_late_finish_records_history_but_frees_nothing_it_lost(
    stub: journal_pb2_grpc.JournalServiceStub,
) -> None:
    """A finish with the token of a lease another replica holds now writes its exchange (a
    history write never waits on a lease) and leaves the other replica's lease alone."""
    player = _player()
    old = await _begin(stub, player, "engine-a#1")
    await stub.FinishRun(
        journal_pb2.FinishRunRequest(player_id=player, owner="engine-a#1", token=old.lease.token)
    )
    await _begin(stub, player, "engine-b#1")
    late = await stub.FinishRun(
        journal_pb2.FinishRunRequest(
            player_id=player,
            owner="engine-a#1",
            token=old.lease.token,
            entries=_exchange("late", "r2"),
        )
    )
    assert late.recorded and not late.released
    with pytest.raises(grpc.aio.AioRpcError) as held:
        await _begin(stub, player, "engine-c#1")
    assert "engine-b#1" in (held.value.details() or "")


async def test_a_run_without_a_lease_finishes_with_its_exchange_alone(
    stub: journal_pb2_grpc.JournalServiceStub,
) -> None:
    """Token 0: a run that took no lease (it neither writes nor reads history) stores its
    exchange and leaves the player's lease, held by a run elsewhere, alone."""
    player = _player()
    await _begin(stub, player, "engine-b#1")
    finished = await stub.FinishRun(
        journal_pb2.FinishRunRequest(
            player_id=player, owner="engine-a#1", entries=_exchange("h", "r")
        )
    )
    assert finished.recorded and not finished.released
    with pytest.raises(grpc.aio.AioRpcError) as held:
        await _begin(stub, player, "engine-c#1")
    assert "engine-b#1" in (held.value.details() or "")


async def test_an_exchange_over_the_history_bounds_still_frees_the_lease(
    stub: journal_pb2_grpc.JournalServiceStub,
) -> None:
    player = _player()
    begun = await _begin(stub, player, "engine-a#1")
    finished = await stub.FinishRun(
        journal_pb2.FinishRunRequest(
            player_id=player,
            owner="engine-a#1",
            token=begun.lease.token,
            entries=_exchange("y" * 5000, "r1"),
        )
    )
    assert not finished.recorded and finished.released
    assert "4000" in finished.history_error
    after = await _begin(stub, player, "engine-b#1", history=10)
    assert list(after.history) == []


async def test_a_run_of_a_player_with_history_off_records_nothing(
    stub: journal_pb2_grpc.JournalServiceStub,
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    player = _player()
    ConversationStore(sessions, HISTORY_BOUNDS).update_preferences(player, False, None)
    begun = await _begin(stub, player, "engine-a#1", history=5)
    assert not begun.preferences.history_enabled and begun.preferences.external_enabled
    finished = await stub.FinishRun(
        journal_pb2.FinishRunRequest(
            player_id=player,
            owner="engine-a#1",
            token=begun.lease.token,
            entries=_exchange("z", "r"),
        )
    )
    assert not finished.recorded and finished.released


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (journal_pb2.BeginRunRequest(owner="e#1", lease_seconds=30), "player_id is required"),
        (journal_pb2.BeginRunRequest(player_id="p", lease_seconds=30), "owner"),
        (journal_pb2.BeginRunRequest(player_id="p", owner="e#1"), "ttl"),
        (
            journal_pb2.BeginRunRequest(
                player_id="p", owner="e#1", lease_seconds=30, history_entries=101
            ),
            "at most 100",
        ),
        (journal_pb2.FinishRunRequest(player_id="p", token=1), "owner"),
        (journal_pb2.FinishRunRequest(owner="e#1", token=1), "player_id is required"),
    ],
)
async def test_bad_run_calls_are_invalid_argument(
    stub: journal_pb2_grpc.JournalServiceStub, request_: Any, message: str
) -> None:
    call = stub.BeginRun if isinstance(request_, journal_pb2.BeginRunRequest) else stub.FinishRun
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call(request_)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (refused.value.details() or "")
