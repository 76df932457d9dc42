"""Group commit: several writes in one transaction, each with the outcome it would have had
alone (commit units run by run_group, on SQLite and PostgreSQL), and the writer
thread that gathers concurrent calls into groups (GroupCommitter)."""

from __future__ import annotations

import asyncio
import functools
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from sqlalchemy import Engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, sessionmaker
from system.storage.v1 import journal_pb2

from services.runtime.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from storage_service.db import Base, make_engine
from storage_service.dbcall import is_unavailable
from storage_service.group_commit import (
    DEFAULT_MAX_GROUP,
    GroupCommitter,
    Unit,
    declared,
    run_group,
)
from storage_service.journal import JournalBounds, JournalStore
from storage_service.ledgers import Writes
from storage_service.player_data import PlayerDataStore
from tests.transactions import transaction_ends
from tests.waiting import wait_until

DAY = "2030-01-01"


@pytest.fixture
def store(engine: Engine) -> JournalStore:
    return JournalStore(sessionmaker(engine, expire_on_commit=False), JournalBounds())


def _player() -> str:
    return f"p-{uuid.uuid4()}"


def _key(player: str) -> journal_pb2.DocumentKey:
    return journal_pb2.DocumentKey(
        player_id=player, owner_module="system:shop", storage_type="system:orders"
    )


def _put(player: str, version: int, data: bytes = b"d") -> journal_pb2.CommitOperation:
    return journal_pb2.CommitOperation(
        put=journal_pb2.DocumentPut(
            key=_key(player), expected_version=version, data=data, codec_id="system:orders"
        )
    )


def _usage(calls: int = 1) -> journal_pb2.CommitOperation:
    return journal_pb2.CommitOperation(usage=journal_pb2.UsageIncrement(day=DAY, model_calls=calls))


def _commit(
    player: str, *operations: journal_pb2.CommitOperation, request_id: str | None = None
) -> journal_pb2.CommitRequest:
    return journal_pb2.CommitRequest(
        request_id=request_id or f"r-{uuid.uuid4()}", player_id=player, operations=operations
    )


def _receipt(
    step_id: str, task_id: str, state: int, **extra: object
) -> journal_pb2.CommitOperation:
    return journal_pb2.CommitOperation(
        receipt=journal_pb2.ReceiptWrite(
            step_id=step_id, task_id=task_id, tool="t.t", state=state, **extra
        )
    )


def _commit_group(
    store: JournalStore, requests: Sequence[journal_pb2.CommitRequest]
) -> list[journal_pb2.CommitResponse | Exception]:
    """Applies several batches in one transaction (run_group), each with the outcome `commit`
    would have given it alone; an invalid one is refused without reaching the database."""
    outcomes: list[journal_pb2.CommitResponse | Exception | None] = [None] * len(requests)
    units: dict[int, Callable[[Session], journal_pb2.CommitResponse]] = {}
    for index, request in enumerate(requests):
        try:
            units[index] = store.commit_unit(request)
        except ServiceError as error:
            outcomes[index] = error
    ran = run_group(store._sessions, list(units.values()))
    for index, outcome in zip(units, ran, strict=True):
        outcomes[index] = outcome
    return [outcome for outcome in outcomes if outcome is not None]


# -- commit units run in one group (run_group) --------------------------------------------


def test_a_group_of_good_batches_is_one_transaction(store: JournalStore, engine: Engine) -> None:
    players = [_player() for _ in range(5)]
    ends = transaction_ends(engine)
    outcomes = _commit_group(store, [_commit(p, _put(p, 0), _usage()) for p in players])
    assert ends == ["commit"]
    assert [list(o.versions) for o in outcomes] == [[1]] * 5  # type: ignore[union-attr]
    data = PlayerDataStore(store._sessions)
    assert all(data.get_document(_key(p)).version == 1 for p in players)


def test_each_batch_of_a_group_has_the_outcome_it_would_have_alone(
    store: JournalStore, engine: Engine
) -> None:
    a, b, c = _player(), _player(), _player()
    step, missing = f"{c}/0", f"{c}/1"
    data = PlayerDataStore(store._sessions)
    task, _, _ = store.create_task(c, "system:event", None, "e-1")
    first_a = _commit(a, _put(a, 0, b"a1"), _usage(1), request_id="same")
    requests = [
        first_a,
        _commit(b, _put(b, 0, b"b1")),
        _commit(b, _put(b, 0, b"b2"), _usage(5)),  # loses: b1 took version 0 just before
        _commit(a),  # invalid: no operations
        first_a,  # the same batch again: replayed, not applied twice
        _commit(c, _receipt(step, task.task_id, journal_pb2.STEP_STATE_RUNNING)),
        _commit(c, _receipt(missing, "no-such-task", journal_pb2.STEP_STATE_RUNNING)),
        _commit(
            c,
            _receipt(step, task.task_id, journal_pb2.STEP_STATE_DONE, result=b"r", codec_id="c:c"),
        ),
    ]
    ends = transaction_ends(engine)
    outcomes = _commit_group(store, requests)
    # The first run failed on the version conflict and was rolled back; the second isolated
    # each batch with a savepoint (the invalid one never reached the database).
    assert ends == ["rollback", "commit"]
    assert isinstance(outcomes[0], journal_pb2.CommitResponse) and not outcomes[0].replayed
    assert isinstance(outcomes[1], journal_pb2.CommitResponse)
    assert isinstance(outcomes[2], Aborted)
    assert isinstance(outcomes[3], InvalidArgument)
    assert isinstance(outcomes[4], journal_pb2.CommitResponse) and outcomes[4].replayed
    assert isinstance(outcomes[5], journal_pb2.CommitResponse)
    assert isinstance(outcomes[6], NotFound)
    assert isinstance(outcomes[7], journal_pb2.CommitResponse)
    assert data.get_document(_key(a)).data == b"a1"
    assert data.get_usage(a, DAY)[0].model_calls == 1
    assert data.get_document(_key(b)).data == b"b1"
    assert data.get_usage(b, DAY) == []  # the losing batch left nothing behind
    assert store.get_step(step, "t.t").result == b"r"
    with pytest.raises(NotFound):
        store.get_step(missing, "t.t")
    # The losing batch left no idempotency record either: its request id may be used again.
    again = store.commit(_commit(b, _put(b, 1, b"b2"), request_id=requests[2].request_id))
    assert list(again.versions) == [2] and not again.replayed


def test_an_id_the_database_cannot_hold_fails_only_its_unit(store: JournalStore) -> None:
    """A unit whose declared locks name an id with a NUL (no row can have it) is refused by
    itself; the group's lock statement and its other units go on."""
    player = _player()
    waiting, _, _ = store.create_task(
        player, "system:event", None, "e-1", journal_pb2.TASK_STATE_WAITING
    )
    units = [
        declared(
            store.transition_task_in,
            Writes(tasks=("t\x00",)),
            task_id="t\x00",
            state=journal_pb2.TASK_STATE_QUEUED,
        ),
        declared(store.queue_waiting_in, Writes(players=(player,)), player_id=player),
    ]
    refused, queued = run_group(store._sessions, units)
    assert isinstance(refused, InvalidArgument) and "NUL" in str(refused)
    assert queued == [waiting.task_id]


def test_a_single_batch_fails_alone_without_a_second_run(
    store: JournalStore, engine: Engine
) -> None:
    player = _player()
    store.commit(_commit(player, _put(player, 0)))
    ends = transaction_ends(engine)
    (outcome,) = _commit_group(store, [_commit(player, _put(player, 0))])
    assert isinstance(outcome, Aborted)
    assert ends == ["rollback"]


# -- GroupCommitter ---------------------------------------------------------------------------


class _Gated(GroupCommitter):
    """A committer whose first group waits for `gate`, and that records group sizes."""

    def __init__(self, store: JournalStore, max_group: int = DEFAULT_MAX_GROUP) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.sizes: list[int] = []
        super().__init__(store._sessions, max_group)

    def run_units(self, units: Sequence[Unit]) -> list[Any]:
        self.started.set()
        self.gate.wait(10)
        self.sizes.append(len(units))
        return super().run_units(units)


def _submit(
    committer: GroupCommitter, store: JournalStore, request: journal_pb2.CommitRequest
) -> asyncio.Future[journal_pb2.CommitResponse]:
    return asyncio.ensure_future(committer.run(store.commit_unit(request)))


async def _queued(committer: GroupCommitter, count: int) -> None:
    """Returns once `count` calls wait in the writer's queue (behind the group it runs)."""
    await wait_until(
        lambda: committer._queue.qsize() == count,
        what=lambda: f"{count} calls queued, {committer._queue.qsize()} are",
    )


def _queue(
    committer: GroupCommitter, unit: Callable[..., Any], **arguments: Any
) -> asyncio.Future[Any]:
    """Queues `unit` (a JournalStore `*_in` method) with its keyword arguments."""
    return asyncio.ensure_future(committer.run(functools.partial(unit, **arguments)))


async def test_calls_waiting_while_the_writer_is_busy_share_one_transaction(
    store: JournalStore,
) -> None:
    committer = _Gated(store, max_group=8)
    try:
        players = [_player() for _ in range(12)]
        first = _submit(committer, store, _commit(players[0], _put(players[0], 0)))
        await asyncio.to_thread(committer.started.wait, 10)
        rest = [_submit(committer, store, _commit(p, _put(p, 0))) for p in players[1:]]
        await _queued(committer, 11)  # all eleven are queued behind the first group
        committer.gate.set()
        responses = await asyncio.gather(first, *rest)
    finally:
        committer.close()
    assert [list(r.versions) for r in responses] == [[1]] * 12
    assert committer.sizes == [1, 8, 3]  # never more than max_group in one transaction
    assert committer.groups == 3


async def test_every_journal_write_of_a_step_can_share_a_group(store: JournalStore) -> None:
    """RecordStep, CompleteStep and TransitionTask under a fence, and a Commit, in one group."""
    committer = _Gated(store)
    player = _player()
    step, other = f"{player}/0", f"{player}/1"
    task, _, _ = store.create_task(player, "system:event", None, "e-1")
    (claim,) = store.claim_tasks("engine-a", 1, 30, [player])
    fence = journal_pb2.Fence(lease_name=claim.lease.name, token=claim.lease.token)
    try:
        blocker = _submit(committer, store, _commit(player, _usage()))
        await asyncio.to_thread(committer.started.wait, 10)
        record = _queue(
            committer,
            store.record_step_in,
            step_id=step,
            task_id=task.task_id,
            position=0,
            tool="t.t",
            fence=fence,
        )
        complete = _queue(
            committer,
            store.complete_step_in,
            step_id=step,
            tool="t.t",
            result=b"r",
            codec_id="c:c",
            fence=fence,
        )
        stale = _queue(
            committer,
            store.record_step_in,
            step_id=other,
            task_id=task.task_id,
            position=1,
            tool="t.t",
            fence=journal_pb2.Fence(lease_name=claim.lease.name, token=1),
        )
        finish = _queue(
            committer,
            store.transition_task_in,
            task_id=task.task_id,
            state=journal_pb2.TASK_STATE_SUCCEEDED,
            fence=fence,
        )
        await _queued(committer, 4)
        committer.gate.set()
        await blocker
        (receipt, created), done, moved = await asyncio.gather(record, complete, finish)
        with pytest.raises(FailedPrecondition, match="stale fence"):
            await stale
    finally:
        committer.close()
    assert committer.sizes == [1, 4]
    assert created and receipt.state == journal_pb2.STEP_STATE_RUNNING
    assert done.state == journal_pb2.STEP_STATE_DONE and done.result == b"r"
    assert moved.state == journal_pb2.TASK_STATE_SUCCEEDED
    with pytest.raises(NotFound):
        store.get_step(other, "t.t")


async def test_a_failing_batch_fails_only_its_caller(store: JournalStore) -> None:
    committer = _Gated(store)
    committer.gate.set()
    player = _player()
    try:
        await _submit(committer, store, _commit(player, _put(player, 0)))
        results = await asyncio.gather(
            _submit(committer, store, _commit(player, _put(player, 0))),
            _submit(committer, store, _commit(player, _put(player, 1), _usage())),
            return_exceptions=True,
        )
    finally:
        committer.close()
    assert isinstance(results[0], Aborted)
    assert isinstance(results[1], journal_pb2.CommitResponse) and list(results[1].versions) == [2]


class _Broken(GroupCommitter):
    def __init__(self, store: JournalStore, outcome: Exception, whole_group: bool) -> None:
        self.outcome = outcome
        self.whole_group = whole_group
        super().__init__(store._sessions)

    def run_units(self, units: Sequence[Unit]) -> list[Any]:
        if self.whole_group:
            raise self.outcome
        return [self.outcome for _ in units]


_LOST = sa_exc.OperationalError("COMMIT", {}, Exception("server closed the connection"))


@pytest.mark.parametrize("whole_group", [True, False], ids=["commit-failed", "unit-failed"])
async def test_a_lost_database_is_unavailable_to_every_caller(
    store: JournalStore, whole_group: bool
) -> None:
    committer = _Broken(store, _LOST, whole_group)
    try:
        results = await asyncio.gather(
            *(_submit(committer, store, _commit(_player(), _usage())) for _ in range(3)),
            return_exceptions=True,
        )
    finally:
        committer.close()
    assert all(isinstance(r, Unavailable) for r in results)
    assert all(r.__cause__ is _LOST for r in results)  # type: ignore[union-attr]
    if whole_group:  # one exception object per caller, not one shared
        assert len({id(r) for r in results}) == 3


def test_a_failed_commit_gives_no_outcome(store: JournalStore, engine: Engine) -> None:
    """COMMIT failing leaves every unit's fate unknown: run_group raises rather than report
    answers for writes that may not be stored."""

    def refuse(_conn: object) -> None:
        raise _LOST

    player = _player()
    event.listen(engine, "commit", refuse)
    try:
        with pytest.raises(sa_exc.OperationalError):
            run_group(store._sessions, [store.commit_unit(_commit(player, _usage()))] * 2)
    finally:
        event.remove(engine, "commit", refuse)


async def test_close_applies_what_is_queued_and_refuses_more(store: JournalStore) -> None:
    committer = _Gated(store)
    player = _player()
    first = _submit(committer, store, _commit(player, _put(player, 0)))
    await asyncio.to_thread(committer.started.wait, 10)
    second = _submit(committer, store, _commit(player, _put(player, 1)))
    await _queued(committer, 1)
    closing = asyncio.ensure_future(asyncio.to_thread(committer.close))
    committer.gate.set()
    await closing
    assert list((await first).versions) == [1]
    assert list((await second).versions) == [2]
    with pytest.raises(RuntimeError, match="closed"):
        await committer.run(store.commit_unit(_commit(player, _put(player, 2))))


async def test_a_caller_that_gave_up_leaves_the_others_answered(store: JournalStore) -> None:
    committer = _Gated(store)
    a, b = _player(), _player()
    try:
        gone = _submit(committer, store, _commit(a, _put(a, 0)))
        kept = _submit(committer, store, _commit(b, _put(b, 0)))
        await asyncio.to_thread(committer.started.wait, 10)
        gone.cancel()
        committer.gate.set()
        assert list((await kept).versions) == [1]
    finally:
        committer.close()
    # Its group had started: the batch is stored, as a database call already sent would be.
    assert PlayerDataStore(store._sessions).get_document(_key(a)).version == 1


@pytest.mark.parametrize("kills", [1, 2], ids=["once", "again-on-the-rerun"])
def test_a_connection_killed_mid_group_is_rerun_or_unavailable(
    postgres_url: str, kills: int
) -> None:
    """PostgreSQL ends the group's connection (a restart, an administrator) between two of its
    writes: the group is rolled back and runs again on a fresh connection; if that one is
    ended too, the group fails as a whole with an error that means UNAVAILABLE. Nothing is
    reported INTERNAL, applied twice or applied in part."""
    engine = make_engine(postgres_url)
    Base.metadata.create_all(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    store = JournalStore(sessions, JournalBounds())
    data = PlayerDataStore(sessions)
    players = [_player() for _ in range(3)]
    units = [store.commit_unit(_commit(p, _usage())) for p in players]
    done = []

    def kill_mine(session: Session) -> None:
        if len(done) == kills:
            return
        done.append(True)
        mine = session.connection().exec_driver_sql("SELECT pg_backend_pid()").scalar()
        with engine.connect() as connection:
            connection.exec_driver_sql(f"SELECT pg_terminate_backend({int(mine)})")

    try:
        if kills == 1:
            outcomes = run_group(sessions, [units[0], kill_mine, units[1], units[2]])
            assert [type(o).__name__ for o in outcomes] == [
                "CommitResponse",
                "NoneType",
                "CommitResponse",
                "CommitResponse",
            ]
        else:
            with pytest.raises(sa_exc.DBAPIError) as raised:
                run_group(sessions, [units[0], kill_mine, units[1], units[2]])
            assert is_unavailable(raised.value)
        calls = [sum(u.model_calls for u in data.get_usage(p, DAY)) for p in players]
    finally:
        engine.dispose()
    assert calls == ([1, 1, 1] if kills == 1 else [0, 0, 0])


# -- batches of receipt writes, written together ----------------------------------------------


def _running(
    player: str,
    task_id: str,
    step: str,
    request_id: str | None = None,
    fence: journal_pb2.Fence | None = None,
) -> journal_pb2.CommitRequest:
    write = _receipt(step, task_id, journal_pb2.STEP_STATE_RUNNING)
    request = _commit(player, write, request_id=request_id)
    if fence is not None:
        request.fence.CopyFrom(fence)
    return request


def _done(player: str, step: str, result: bytes = b"r") -> journal_pb2.CommitRequest:
    write = _receipt(step, "", journal_pb2.STEP_STATE_DONE, result=result, codec_id="c:c")
    return _commit(player, write)


def _tasks(store: JournalStore, count: int) -> list[tuple[str, str]]:
    """(player, task id) of `count` new players with a task each."""
    made = []
    for _ in range(count):
        player = _player()
        task, _, _ = store.create_task(player, "system:event", None, "e-1")
        made.append((player, task.task_id))
    return made


def test_receipt_batches_are_written_together_and_share_the_transaction(
    store: JournalStore, engine: Engine
) -> None:
    tasks = _tasks(store, 4)
    other = _player()
    ends = transaction_ends(engine)
    requests = [_running(p, t, f"{t}/0") for p, t in tasks] + [_commit(other, _put(other, 0))]
    outcomes = _commit_group(store, requests)
    assert ends == ["commit"]
    assert all(isinstance(o, journal_pb2.CommitResponse) for o in outcomes)
    assert list(outcomes[-1].versions) == [1]  # type: ignore[union-attr]
    outcomes = _commit_group(store, [_done(p, f"{t}/0", result=p.encode()) for p, t in tasks])
    assert ends == ["commit", "commit"]
    assert all(isinstance(o, journal_pb2.CommitResponse) and not o.replayed for o in outcomes)
    for player, task_id in tasks:
        receipt = store.get_step(f"{task_id}/0", "t.t")
        assert receipt.state == journal_pb2.STEP_STATE_DONE and receipt.result == player.encode()


def test_a_retried_batch_in_a_group_written_together_is_replayed_and_the_others_applied(
    store: JournalStore, engine: Engine
) -> None:
    (a, task_a), (b, task_b) = _tasks(store, 2)
    first = _running(a, task_a, f"{task_a}/0")
    store.commit(first)
    reused = _running(a, task_a, f"{task_a}/1", request_id=first.request_id)
    ends = transaction_ends(engine)
    outcomes = _commit_group(store, [first, _running(b, task_b, f"{task_b}/0"), reused])
    # The fast form did not hold for the retries: rolled back and run the ordinary way, where
    # the reused request id fails, so once more with a savepoint per batch.
    assert ends == ["rollback", "rollback", "commit"]
    assert isinstance(outcomes[0], journal_pb2.CommitResponse) and outcomes[0].replayed
    assert isinstance(outcomes[1], journal_pb2.CommitResponse) and not outcomes[1].replayed
    assert isinstance(outcomes[2], InvalidArgument)  # the same request id, another batch
    assert store.get_step(f"{task_b}/0", "t.t").state == journal_pb2.STEP_STATE_RUNNING
    with pytest.raises(NotFound):
        store.get_step(f"{task_a}/1", "t.t")


def test_a_stale_fence_in_a_group_written_together_fails_only_its_batch(
    store: JournalStore, engine: Engine
) -> None:
    (a, task_a), (b, task_b) = _tasks(store, 2)
    (claim,) = store.claim_tasks("engine-a", 1, 30, [a])
    good = journal_pb2.Fence(lease_name=claim.lease.name, token=claim.lease.token)
    stale = journal_pb2.Fence(lease_name=claim.lease.name, token=claim.lease.token - 1)
    fenced = _running(a, task_a, f"{task_a}/0", fence=good)
    refused = _running(a, task_a, f"{task_a}/1", fence=stale)
    ends = transaction_ends(engine)
    outcomes = _commit_group(store, [fenced, refused, _running(b, task_b, f"{task_b}/0")])
    assert ends == ["rollback", "rollback", "commit"]  # sent, plain, then isolated
    assert isinstance(outcomes[0], journal_pb2.CommitResponse)
    assert isinstance(outcomes[1], FailedPrecondition) and "stale fence" in str(outcomes[1])
    assert isinstance(outcomes[2], journal_pb2.CommitResponse)
    with pytest.raises(NotFound):
        store.get_step(f"{task_a}/1", "t.t")
    # Sent alone, under its valid fence, a fenced batch applies at the first try.
    ends.clear()
    (outcome,) = _commit_group(store, [_running(a, task_a, f"{task_a}/2", fence=good)])
    assert isinstance(outcome, journal_pb2.CommitResponse) and ends == ["commit"]


def test_a_batch_written_together_refused_the_long_way_fails_alone(
    store: JournalStore, engine: Engine
) -> None:
    (a, task_a), (b, task_b) = _tasks(store, 2)
    ends = transaction_ends(engine)
    outcomes = _commit_group(store, [_done(a, f"{task_a}/9"), _running(b, task_b, f"{task_b}/0")])
    assert isinstance(outcomes[0], NotFound)
    assert str(outcomes[0]).startswith("operations[0] (receipt): ")  # as `commit` words it
    assert isinstance(outcomes[1], journal_pb2.CommitResponse)
    assert ends == ["rollback", "commit"]  # a refusal, not a fast form that did not hold


def test_a_lone_receipt_batch_is_not_written_together(
    store: JournalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone batch runs its own one-statement forms: nothing to write together."""
    sent: list[int] = []

    def send(_store: JournalStore, _session: Session, batches: Sequence[Any]) -> list[None]:
        sent.append(len(batches))
        return [None] * len(batches)  # nothing sent: they run the ordinary way

    monkeypatch.setattr(JournalStore, "_write_batches", send)
    tasks = _tasks(store, 2)
    (outcome,) = _commit_group(store, [_running(p, t, f"{t}/0") for p, t in tasks[:1]])
    assert isinstance(outcome, journal_pb2.CommitResponse) and sent == []
    outcomes = _commit_group(store, [_running(p, t, f"{t}/1") for p, t in tasks])
    assert all(isinstance(o, journal_pb2.CommitResponse) for o in outcomes)
    assert sent == [2]  # both offered to be written together


def test_the_same_batch_twice_in_a_group_written_together_is_applied_once(
    store: JournalStore, engine: Engine
) -> None:
    (a, task_a), (b, task_b) = _tasks(store, 2)
    request = _running(a, task_a, f"{task_a}/0")
    ends = transaction_ends(engine)
    outcomes = _commit_group(store, [request, _running(b, task_b, f"{task_b}/0"), request])
    assert ends == ["commit"]  # the second copy was not sent: it replays the first
    assert isinstance(outcomes[0], journal_pb2.CommitResponse) and not outcomes[0].replayed
    assert isinstance(outcomes[1], journal_pb2.CommitResponse)
    assert isinstance(outcomes[2], journal_pb2.CommitResponse) and outcomes[2].replayed


def test_a_group_recording_one_step_twice_stores_it_once(
    store: JournalStore, engine: Engine
) -> None:
    ((player, task_id),) = _tasks(store, 1)
    step = f"{task_id}/0"
    ends = transaction_ends(engine)
    outcomes = _commit_group(store, [_running(player, task_id, step) for _ in range(2)])
    assert ends == ["commit"]
    assert all(isinstance(o, journal_pb2.CommitResponse) for o in outcomes)
    assert store.get_step(step, "t.t").state == journal_pb2.STEP_STATE_RUNNING


def test_a_batch_of_several_writes_written_together_keeps_their_order(
    store: JournalStore, engine: Engine
) -> None:
    ((player, task_id),) = _tasks(store, 1)
    step, missing, other = f"{task_id}/0", f"{task_id}/1", f"{task_id}/2"
    both = _commit(
        player,
        _receipt(step, task_id, journal_pb2.STEP_STATE_RUNNING),
        _receipt(step, task_id, journal_pb2.STEP_STATE_DONE, result=b"r", codec_id="c:c"),
    )
    # DONE before RUNNING: refused as `commit` alone refuses it, though the RUNNING written
    # after it applied with its group.
    backwards = _commit(
        player,
        _receipt(missing, task_id, journal_pb2.STEP_STATE_DONE, result=b"r", codec_id="c:c"),
        _receipt(other, task_id, journal_pb2.STEP_STATE_RUNNING),
    )
    outcomes = _commit_group(store, [both, backwards])
    assert isinstance(outcomes[0], journal_pb2.CommitResponse)
    assert isinstance(outcomes[1], NotFound) and str(outcomes[1]).startswith("operations[0]")
    assert store.get_step(step, "t.t").result == b"r"
    with pytest.raises(NotFound):
        store.get_step(other, "t.t")


def test_a_grouped_write_that_needs_room_evicts_where_it_would_have(engine: Engine) -> None:
    store = JournalStore(
        sessionmaker(engine, expire_on_commit=False), JournalBounds(receipt_max_entries=2)
    )
    ((player, task_id),) = _tasks(store, 1)
    store.commit(_running(player, task_id, f"{task_id}/0"))
    store.commit(_running(player, task_id, f"{task_id}/1"))
    store.transition_task(task_id, journal_pb2.TASK_STATE_RUNNING)
    store.transition_task(task_id, journal_pb2.TASK_STATE_SUCCEEDED)
    second, _, _ = store.create_task(player, "system:event", None, "e-2")
    ((other, other_task),) = _tasks(store, 1)
    ends = transaction_ends(engine)
    outcomes = _commit_group(
        store,
        [
            _running(player, second.task_id, f"{second.task_id}/0"),
            _running(other, other_task, f"{other_task}/0"),
        ],
    )
    assert all(isinstance(o, journal_pb2.CommitResponse) for o in outcomes)
    assert ends == ["commit"]  # the fast form did not fit; the long way evicted, same run
    with pytest.raises(NotFound):
        store.get_step(f"{task_id}/0", "t.t")  # the oldest finished receipt made room
    assert store.get_step(f"{second.task_id}/0", "t.t").state == journal_pb2.STEP_STATE_RUNNING


def test_one_players_writes_in_a_group_written_together_each_see_the_ledger_the_last_left(
    engine: Engine,
) -> None:
    """On PostgreSQL a group's receipt writes go as one statement per chunk; a player's second
    write must still see the first's receipt in the ledger (its own chunk), so the third of
    three new steps over a bound of two is refused as it would be alone."""
    store = JournalStore(
        sessionmaker(engine, expire_on_commit=False), JournalBounds(receipt_max_entries=2)
    )
    ((player, task_id),) = _tasks(store, 1)
    others = _tasks(store, 2)
    requests = [_running(player, task_id, f"{task_id}/{n}") for n in range(3)]
    requests += [_running(other, other_task, f"{other_task}/0") for other, other_task in others]
    outcomes = _commit_group(store, requests)
    assert isinstance(outcomes[0], journal_pb2.CommitResponse)
    assert isinstance(outcomes[1], journal_pb2.CommitResponse)
    assert isinstance(outcomes[2], ResourceExhausted)  # STORAGE_FULL: nothing terminal to evict
    assert all(isinstance(o, journal_pb2.CommitResponse) for o in outcomes[3:])
    with pytest.raises(NotFound):
        store.get_step(f"{task_id}/2", "t.t")
    for _other, other_task in others:
        assert store.get_step(f"{other_task}/0", "t.t").state == journal_pb2.STEP_STATE_RUNNING


def test_fenced_batches_in_a_group_written_together_each_check_their_own_lease(
    store: JournalStore, engine: Engine
) -> None:
    """The fences of a group are read in one statement on PostgreSQL: each batch is checked
    against its own lease, a stale one fails alone."""
    tasks = _tasks(store, 3)
    fences = []
    for _, task_id in tasks:
        lease = store.acquire_lease(f"task:{task_id}", "replica-a", 30)
        fences.append(journal_pb2.Fence(lease_name=lease.name, token=lease.token))
    stale = journal_pb2.Fence(lease_name=fences[1].lease_name, token=fences[1].token - 1)
    outcomes = _commit_group(
        store,
        [
            _running(tasks[0][0], tasks[0][1], f"{tasks[0][1]}/0", fence=fences[0]),
            _running(tasks[1][0], tasks[1][1], f"{tasks[1][1]}/0", fence=stale),
            _running(tasks[2][0], tasks[2][1], f"{tasks[2][1]}/0", fence=fences[2]),
        ],
    )
    assert isinstance(outcomes[0], journal_pb2.CommitResponse)
    assert isinstance(outcomes[1], FailedPrecondition)
    assert isinstance(outcomes[2], journal_pb2.CommitResponse)
    with pytest.raises(NotFound):
        store.get_step(f"{tasks[1][1]}/0", "t.t")


def test_a_connection_lost_after_the_groups_statements_stores_nothing(postgres_url: str) -> None:
    """The group's statements ran; then its connection ends before COMMIT: the group
    fails as a whole as UNAVAILABLE, with nothing stored."""
    engine = make_engine(postgres_url)
    Base.metadata.create_all(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    store = JournalStore(sessions, JournalBounds())
    tasks = _tasks(store, 2)

    def kill_mine(session: Session) -> None:
        mine = session.connection().exec_driver_sql("SELECT pg_backend_pid()").scalar()
        with engine.connect() as connection:
            connection.exec_driver_sql(f"SELECT pg_terminate_backend({int(mine)})")

    units = [store.commit_unit(_running(p, t, f"{t}/0")) for p, t in tasks]
    try:
        with pytest.raises(sa_exc.DBAPIError) as raised:
            run_group(sessions, [units[0], kill_mine, units[1]])
        assert is_unavailable(raised.value)
        for _, task_id in tasks:
            with pytest.raises(NotFound):
                store.get_step(f"{task_id}/0", "t.t")
    finally:
        engine.dispose()


def test_a_connection_lost_before_the_group_is_rerun_on_a_fresh_one(postgres_url: str) -> None:
    """The pooled connection the group gets died while idle (a server restart): its first statement fails,
    the pool is emptied of the dead connections, and the group runs again on a new one."""
    engine = make_engine(postgres_url)
    Base.metadata.create_all(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    store = JournalStore(sessions, JournalBounds())
    tasks = _tasks(store, 3)
    with engine.connect() as connection:  # the pool's one idle connection, used again next
        mine = connection.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    killer = make_engine(postgres_url)
    try:
        with killer.connect() as connection:
            connection.exec_driver_sql(f"SELECT pg_terminate_backend({int(mine)})")
        outcomes = run_group(
            sessions, [store.commit_unit(_running(p, t, f"{t}/0")) for p, t in tasks]
        )
        assert all(isinstance(o, journal_pb2.CommitResponse) for o in outcomes)
        for _, task_id in tasks:
            assert store.get_step(f"{task_id}/0", "t.t").state == journal_pb2.STEP_STATE_RUNNING
    finally:
        killer.dispose()
        engine.dispose()


def test_a_large_group_written_together_applies_every_batch_once(
    store: JournalStore, engine: Engine
) -> None:
    """A group of many batches, one of them a retry (on PostgreSQL their rows go in one
    statement, and their writes in one too)."""
    tasks = _tasks(store, 23)
    retried = _running(*tasks[17], f"{tasks[17][1]}/0")
    store.commit(retried)
    requests = [_running(p, t, f"{t}/0") for p, t in tasks]
    requests[17] = retried
    ends = transaction_ends(engine)
    outcomes = _commit_group(store, requests)
    assert ends == ["rollback", "commit"]  # the retry's row was there: once more, plainly
    assert [o.replayed for o in outcomes] == [i == 17 for i in range(23)]  # type: ignore[union-attr]
    ends.clear()
    outcomes = _commit_group(store, [_done(p, f"{t}/0", result=p.encode()) for p, t in tasks])
    assert ends == ["commit"] and not any(o.replayed for o in outcomes)  # type: ignore[union-attr]
    for player, task_id in tasks:
        assert store.get_step(f"{task_id}/0", "t.t").result == player.encode()
