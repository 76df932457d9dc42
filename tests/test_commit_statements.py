"""An event task's final Commit (issue 16): what it costs in statements, and what it must still
do. The engine's last write of a task records each never-recorded step (RUNNING then DONE, in
one batch: decision 0036) and moves the task to its end with its result; storage runs it in
its group-commit writer. Every statement there costs the storage process Python CPU, so their
number is counted here on PostgreSQL and must not grow back. The rules it counts on (the
ledger eviction a result makes room with, the answers of a replay) are checked on both
databases."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import sessionmaker
from system.common.v1 import common_pb2
from system.storage.v1 import journal_pb2

from services.runtime.errors import FailedPrecondition, ResourceExhausted
from storage_service.dialect import is_postgresql
from storage_service.group_commit import run_group
from storage_service.journal import JournalBounds, JournalStore
from storage_service.journal_records import ReceiptRow, TaskRow
from tests.transactions import transaction_ends

TS = journal_pb2.TaskState
SS = journal_pb2.StepState
MODULE = "mod:reward"
TOOL = "minecraft:item.give"
NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)

# The final Commit of a task with two gives, in its group: the group's lock statement (the
# player's lock and the fence's lease row), the batch row, per step one row (its recording
# and its completion written together, DONE), the task's one UPDATE (tasks.move_update).
# Before issue 16's changes: 9 (a RUNNING insert and a DONE update per step, the ledger read
# on its own); until 2026-12-07 06:50 UTC 6 (the task read under lock with the player's task
# ledger, then its UPDATE).
FINAL_COMMIT_STATEMENTS = 5


def _player() -> str:
    return f"p-{uuid.uuid4()}"


def _store(sessions: sessionmaker, **bounds: int) -> JournalStore:  # type: ignore[type-arg]
    return JournalStore(sessions, JournalBounds(**bounds), lambda: NOW)


def _step(step_id: str, task_id: str, state: int, **write: Any) -> journal_pb2.CommitOperation:
    return journal_pb2.CommitOperation(
        receipt=journal_pb2.ReceiptWrite(
            step_id=step_id, task_id=task_id, tool=TOOL, state=state, **write
        )
    )


def _final_commit(
    claim: journal_pb2.TaskClaim, gives: int = 2, text: str = "given", state: int = 0
) -> journal_pb2.CommitRequest:
    """What the engine's TaskStore.store_steps sends at a first claim's end (decision 0036):
    per give a RUNNING record and its DONE result, then the transition with the result."""
    task = claim.task
    operations = []
    for position in range(gives):
        step_id = f"{task.task_id}/{position}"
        operations.append(_step(step_id, task.task_id, SS.STEP_STATE_RUNNING, position=position))
        operations.append(
            _step(
                step_id,
                task.task_id,
                SS.STEP_STATE_DONE,
                result=f'{{"given": {position + 1}}}'.encode(),
                codec_id="json",
            )
        )
    operations.append(
        journal_pb2.CommitOperation(
            transition=journal_pb2.TaskTransition(
                task_id=task.task_id,
                state=state or TS.TASK_STATE_SUCCEEDED,
                expected_state=TS.TASK_STATE_RUNNING,
                result=common_pb2.AgentResult(status=common_pb2.RESULT_STATUS_SUCCEEDED, text=text),
            )
        )
    )
    return journal_pb2.CommitRequest(
        request_id=f"finish:{task.task_id}:{task.attempts}",
        player_id=task.player_id,
        operations=operations,
        fence=journal_pb2.Fence(lease_name=claim.lease.name, token=claim.lease.token),
    )


def _claimed(store: JournalStore, player: str, key: str = "advancement") -> journal_pb2.TaskClaim:
    store.create_task(player, MODULE, None, key)
    (claim,) = store.claim_tasks("engine-a", 1, 30, [player])
    return claim


def _group(store: JournalStore, requests: list[journal_pb2.CommitRequest]) -> list[Any]:
    """The Commits as one group of the storage service's writer: each one's answer or error."""
    return run_group(store._sessions, [store.commit_unit(r) for r in requests])  # noqa: SLF001


def _answer(outcome: Any) -> Any:
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _in_group(store: JournalStore, request: journal_pb2.CommitRequest) -> Any:
    """The Commit as the storage service runs it: a unit of a group (group_commit)."""
    (outcome,) = _group(store, [request])
    return _answer(outcome)


def _in_company(store: JournalStore, request: journal_pb2.CommitRequest) -> Any:
    """The Commit in a group with another player's final Commit: written together on
    PostgreSQL (storage_service.batch_groups); the other one must apply whatever this one
    does."""
    other = _final_commit(_claimed(store, _player(), "company"), gives=1)
    outcome, company = _group(store, [request, other])
    assert company == journal_pb2.CommitResponse()
    return _answer(outcome)


@pytest.fixture(params=["alone", "sent"])
def apply(request: pytest.FixtureRequest) -> Any:
    """Runs a final Commit as the storage service's writer does: alone in its group, or in a
    group with another one (written together on PostgreSQL); the outcomes must match."""
    return _in_group if request.param == "alone" else _in_company


def _receipts(sessions: sessionmaker, task_id: str) -> list[tuple[Any, ...]]:  # type: ignore[type-arg]
    with sessions() as session:
        rows = session.execute(
            select(
                ReceiptRow.seq,
                ReceiptRow.step_id,
                ReceiptRow.task_id,
                ReceiptRow.player_id,
                ReceiptRow.position,
                ReceiptRow.tool,
                ReceiptRow.state,
                ReceiptRow.result,
                ReceiptRow.codec_id,
                ReceiptRow.size_bytes,
                ReceiptRow.created_at,
                ReceiptRow.updated_at,
            )
            .where(ReceiptRow.task_id == task_id)
            .order_by(ReceiptRow.seq)
        ).all()
        return [tuple(row) for row in rows]


def test_a_final_commit_costs_its_statements_and_no_more(
    engine: Engine,
    sessions: sessionmaker,  # type: ignore[type-arg]
    statements: list[str],
) -> None:
    store = _store(sessions)
    player = _player()
    warm = _claimed(store, player, "warm-up")  # every statement rendered, connection pooled
    _in_group(store, _final_commit(warm))
    claim = _claimed(store, player)
    statements.clear()
    assert _in_group(store, _final_commit(claim)) == journal_pb2.CommitResponse()
    assert len(statements) == FINAL_COMMIT_STATEMENTS, "\n".join(statements)
    # A replay answers from the batch's row.
    statements.clear()
    assert _in_group(store, _final_commit(claim)).replayed


def test_a_final_commit_stores_what_it_stored_one_write_at_a_time(
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    """Each step's receipt as a RUNNING record then its completion store it, and a replay of
    the batch gives the same answer and changes nothing."""
    store = _store(sessions)
    player = _player()
    one_at_a_time = _claimed(store, player, "one")
    request = _final_commit(one_at_a_time)
    for operation in request.operations[:-1]:  # each write alone, in its own batch
        alone = journal_pb2.CommitRequest(
            request_id=f"r-{uuid.uuid4()}", player_id=player, operations=[operation]
        )
        store.commit(alone)
    together = _claimed(store, player, "two")
    assert _in_group(store, _final_commit(together)) == journal_pb2.CommitResponse()

    def shown(task_id: str) -> list[tuple[Any, ...]]:
        # Without seq and the ids that name the task.
        return [(row[1].split("/")[1], *row[4:]) for row in _receipts(sessions, task_id)]

    assert shown(together.task.task_id) == shown(one_at_a_time.task.task_id)
    assert [row[6] for row in _receipts(sessions, together.task.task_id)] == ["done", "done"]
    stored = _receipts(sessions, together.task.task_id)
    replayed = _in_group(store, _final_commit(together))
    assert replayed == journal_pb2.CommitResponse(replayed=True)
    assert _receipts(sessions, together.task.task_id) == stored
    assert store.get_task(together.task.task_id).state == TS.TASK_STATE_SUCCEEDED


def test_a_step_completed_with_another_tool_fails_at_the_completion(
    sessions: sessionmaker,  # type: ignore[type-arg]
    apply: Any,
) -> None:
    """The DONE write's own error, naming its operation; nothing of the batch stays."""
    store = _store(sessions)
    claim = _claimed(store, _player())
    request = _final_commit(claim)
    request.operations[1].receipt.tool = "minecraft:other"
    with pytest.raises(FailedPrecondition, match=r"^operations\[1\] \(receipt\): .*not "):
        apply(store, request)
    assert _receipts(sessions, claim.task.task_id) == []
    assert store.get_task(claim.task.task_id).state == TS.TASK_STATE_RUNNING


def test_a_result_too_large_for_the_receipts_fails_at_the_completion(
    sessions: sessionmaker,  # type: ignore[type-arg]
    apply: Any,
) -> None:
    """A RUNNING record that fits and a result that does not: STORAGE_FULL from the DONE
    write, as when they were applied one after the other."""
    store = _store(sessions, receipt_max_bytes=400)
    claim = _claimed(store, _player())
    request = _final_commit(claim, gives=1)
    request.operations[1].receipt.result = b"x" * 300
    with pytest.raises(ResourceExhausted, match=r"^operations\[1\] \(receipt\): STORAGE_FULL"):
        apply(store, request)
    assert _receipts(sessions, claim.task.task_id) == []


def test_a_final_commit_evicts_finished_tasks_to_make_room_for_its_result(
    sessions: sessionmaker,  # type: ignore[type-arg]
    apply: Any,
) -> None:
    store = _store(sessions, task_max_entries=2)
    player = _player()
    finished = _claimed(store, player, "finished")
    apply(store, _final_commit(finished))
    running = _claimed(store, player, "running")
    # A store whose byte bound leaves 5 bytes free: the result must evict the finished task.
    with sessions() as session:
        total = sum(session.scalars(select(TaskRow.size_bytes).where(TaskRow.player_id == player)))
    tight = _store(sessions, task_max_entries=2, task_max_bytes=total + 5)
    apply(tight, _final_commit(running, text="a result longer than five bytes"))
    tasks, _ = tight.list_tasks(player, page_size=10)
    assert [task.task_id for task in tasks] == [running.task.task_id]
    assert tasks[0].state == TS.TASK_STATE_SUCCEEDED
    assert tasks[0].result.text == "a result longer than five bytes"


def test_a_final_commit_without_room_for_its_result_is_storage_full(
    sessions: sessionmaker,  # type: ignore[type-arg]
    apply: Any,
) -> None:
    store = _store(sessions)
    player = _player()
    first = _claimed(store, player, "first")
    second = _claimed(store, player, "second")
    with sessions() as session:
        total = sum(session.scalars(select(TaskRow.size_bytes).where(TaskRow.player_id == player)))
    tight = _store(sessions, task_max_bytes=total + 5)
    with pytest.raises(ResourceExhausted, match=r"^operations\[4\] \(transition\): STORAGE_FULL"):
        apply(tight, _final_commit(first, text="a result longer than five bytes"))
    # Nothing of the batch stays: no receipts, the task still RUNNING, the batch not stored.
    assert _receipts(sessions, first.task.task_id) == []
    assert tight.get_task(first.task.task_id).state == TS.TASK_STATE_RUNNING
    assert tight.get_task(second.task.task_id).state == TS.TASK_STATE_RUNNING


def test_steps_recorded_before_are_completed_as_before(
    sessions: sessionmaker,  # type: ignore[type-arg]
    apply: Any,
) -> None:
    """A later claim's final Commit may repeat the RUNNING write of a step an earlier run
    recorded: the recording finds it, and the completion completes it."""
    store = _store(sessions)
    claim = _claimed(store, _player())
    request = _final_commit(claim)
    first = journal_pb2.CommitRequest(
        request_id="earlier", player_id=claim.task.player_id, operations=[request.operations[0]]
    )
    store.commit(first)
    assert [row[6] for row in _receipts(sessions, claim.task.task_id)] == ["running"]
    apply(store, request)
    rows = _receipts(sessions, claim.task.task_id)
    assert [(row[1], row[6], row[7]) for row in rows] == [
        (f"{claim.task.task_id}/0", "done", b'{"given": 1}'),
        (f"{claim.task.task_id}/1", "done", b'{"given": 2}'),
    ]


def test_a_result_that_needs_room_evicts_finished_tasks_receipts(
    sessions: sessionmaker,  # type: ignore[type-arg]
    apply: Any,
) -> None:
    """Room for a result is made as when the completion came alone: the receipts of a
    finished task go, oldest first."""
    store = _store(sessions)
    player = _player()
    finished = _claimed(store, player, "finished")
    apply(store, _final_commit(finished, gives=1))
    (old,) = _receipts(sessions, finished.task.task_id)
    claim = _claimed(store, player)
    request = _final_commit(claim, gives=1)
    running_size = old[9] - len(b'{"given": 1}') - len(b"json")
    # Room for the old receipt and the new one RUNNING, not for its result too.
    tight = _store(sessions, receipt_max_bytes=old[9] + running_size + 4)
    apply(tight, request)
    assert _receipts(sessions, finished.task.task_id) == []
    assert [row[6] for row in _receipts(sessions, claim.task.task_id)] == ["done"]


# -- final Commits written together (storage_service.batch_groups) -------------------------

# A group of final Commits of different players, whatever their number: the group's lock
# statement (the players' locks and the fences' lease rows), the batches' rows, one statement
# per step (its recording and its completion as one DONE insert, as record_step writes them:
# two for two gives, each holding that step of every batch) and one for all the tasks' moves.
FINAL_GROUP_STATEMENTS = 5


def _task_row(sessions: sessionmaker, task_id: str) -> tuple[Any, ...]:  # type: ignore[type-arg]
    with sessions() as session:
        row = session.execute(
            select(
                TaskRow.state,
                TaskRow.result,
                TaskRow.attempts,
                TaskRow.size_bytes,
                TaskRow.updated_at,
            ).where(TaskRow.task_id == task_id)
        ).one()
        return tuple(row)


@pytest.mark.parametrize("commits", [2, 5])
def test_a_group_of_final_commits_costs_the_statements_of_one(
    engine: Engine,
    sessions: sessionmaker,  # type: ignore[type-arg]
    statements: list[str],
    commits: int,
) -> None:
    store = _store(sessions)
    warm = [_claimed(store, _player(), "warm-up") for _ in range(2)]
    _group(store, [_final_commit(claim) for claim in warm])
    claims = [_claimed(store, _player()) for _ in range(commits)]
    statements.clear()
    outcomes = _group(store, [_final_commit(claim) for claim in claims])
    assert outcomes == [journal_pb2.CommitResponse()] * commits
    assert len(statements) == FINAL_GROUP_STATEMENTS, "\n".join(statements)
    for claim in claims:
        assert store.get_task(claim.task.task_id).state == TS.TASK_STATE_SUCCEEDED


def test_final_commits_written_together_store_what_each_stores_alone(
    engine: Engine,
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    """The same tasks' final Commits, once each alone (the long way) and once as one group
    (written together on PostgreSQL): the same receipts and the same task rows, sizes included."""
    store = _store(sessions)
    alone = [_claimed(store, _player(), "alone") for _ in range(3)]
    together = [_claimed(store, _player(), "together") for _ in range(3)]
    for index, claim in enumerate(alone):
        assert _in_group(store, _final_commit(claim, gives=index + 1, text="é" * index)) == (
            journal_pb2.CommitResponse()
        )
    requests = [
        _final_commit(claim, gives=index + 1, text="é" * index)
        for index, claim in enumerate(together)
    ]
    ends = transaction_ends(engine)
    assert _group(store, requests) == [journal_pb2.CommitResponse()] * 3
    assert ends == ["commit"]  # at the first try: nothing fell back to the long way

    def receipts(task_id: str) -> list[tuple[Any, ...]]:
        return [(row[1].split("/")[1], *row[4:]) for row in _receipts(sessions, task_id)]

    for one, other in zip(alone, together, strict=True):
        assert receipts(other.task.task_id) == receipts(one.task.task_id)
        expected = _task_row(sessions, one.task.task_id)
        # The ids differ by their length only where the event keys do ("alone", "together").
        grown = len("together") - len("alone")
        assert _task_row(sessions, other.task.task_id) == (*expected[:3], expected[3] + grown,
                                                           expected[4])  # fmt: skip
    # Replays answer from the batches' rows and change nothing.
    stored = [_task_row(sessions, claim.task.task_id) for claim in together]
    assert all(outcome.replayed for outcome in _group(store, requests))
    assert [_task_row(sessions, claim.task.task_id) for claim in together] == stored


def test_a_move_that_does_not_hold_in_a_group_written_together_fails_alone(
    engine: Engine,
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    """A final Commit whose task is not in the expected state (here: finished already) fails
    with the long way's error, naming its operation; the group's other Commits apply."""
    store = _store(sessions)
    finished, first, second = (_claimed(store, _player(), "k") for _ in range(3))
    _in_group(store, _final_commit(finished))
    again = _final_commit(finished)
    again.request_id = "another attempt"
    ends = transaction_ends(engine)
    outcomes = _group(store, [_final_commit(first), again, _final_commit(second)])
    # Sent (its recordings find their steps: not applied; SQLite sends no move), plain (the
    # refusal), then a savepoint per Commit.
    sent = ["rollback"] if is_postgresql(engine) else []
    assert ends == [*sent, "rollback", "commit"]
    assert outcomes[0] == outcomes[2] == journal_pb2.CommitResponse()
    assert isinstance(outcomes[1], FailedPrecondition)
    assert str(outcomes[1]).startswith("operations[4] (transition): ")
    assert "SUCCEEDED" in str(outcomes[1])
    assert _receipts(sessions, finished.task.task_id)[0][6] == "done"  # as the first stored it
    for claim in (first, second):
        assert store.get_task(claim.task.task_id).state == TS.TASK_STATE_SUCCEEDED


def test_a_move_onto_another_players_task_in_a_group_written_together_is_refused(
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    store = _store(sessions)
    mine, theirs, other = (_claimed(store, _player()) for _ in range(3))
    stolen = _final_commit(mine, gives=0)
    stolen.player_id = theirs.task.player_id  # the batch's player is not the task's
    stolen.ClearField("fence")
    outcomes = _group(store, [stolen, _final_commit(other)])
    assert not isinstance(outcomes[0], journal_pb2.CommitResponse)
    assert str(outcomes[0]).startswith("operations[0] (transition): ")
    assert outcomes[1] == journal_pb2.CommitResponse()
    assert store.get_task(mine.task.task_id).state == TS.TASK_STATE_RUNNING


def test_a_grouped_move_that_needs_room_evicts_where_it_would_have(
    engine: Engine,
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    store = _store(sessions, task_max_entries=2)
    player = _player()
    finished = _claimed(store, player, "finished")
    _in_group(store, _final_commit(finished))
    running = _claimed(store, player, "running")
    other = _claimed(store, _player())
    with sessions() as session:
        total = sum(session.scalars(select(TaskRow.size_bytes).where(TaskRow.player_id == player)))
    tight = _store(sessions, task_max_entries=2, task_max_bytes=total + 5)
    ends = transaction_ends(engine)
    outcomes = _group(
        tight,
        [_final_commit(running, text="a result longer than five bytes"), _final_commit(other)],
    )
    assert outcomes == [journal_pb2.CommitResponse()] * 2
    assert ends == ["commit"]  # the move that did not fit went the long way, in place
    tasks, _ = tight.list_tasks(player, page_size=10)
    assert [task.task_id for task in tasks] == [running.task.task_id]
    assert tasks[0].result.text == "a result longer than five bytes"


def test_one_players_two_final_commits_in_a_group_both_apply(
    engine: Engine,
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> None:
    """The second goes the ordinary way, after the sent ones: a player's ledger is read by
    one move of the group's statement at most."""
    store = _store(sessions)
    player = _player()
    first, second = _claimed(store, player, "one"), _claimed(store, player, "two")
    other = _claimed(store, _player())
    ends = transaction_ends(engine)
    outcomes = _group(store, [_final_commit(c) for c in (first, second, other)])
    assert outcomes == [journal_pb2.CommitResponse()] * 3
    assert ends == ["commit"]
    for claim in (first, second, other):
        assert store.get_task(claim.task.task_id).state == TS.TASK_STATE_SUCCEEDED
        assert [row[6] for row in _receipts(sessions, claim.task.task_id)] == ["done", "done"]
