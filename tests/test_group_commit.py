"""Group commit: several writes in one transaction, each with the outcome it would have had
alone (JournalStore.commit_group and run_group, on SQLite and PostgreSQL), and the writer
thread that gathers concurrent calls into groups (GroupCommitter)."""

from __future__ import annotations

import asyncio
import functools
import threading
import uuid
from collections.abc import Iterator, Sequence
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
    Unavailable,
)
from storage_service.db import Base, make_engine
from storage_service.dbcall import is_unavailable
from storage_service.group_commit import DEFAULT_MAX_GROUP, GroupCommitter, Unit, run_group
from storage_service.journal import JournalBounds, JournalStore
from storage_service.player_data import PlayerDataStore

DAY = "2030-01-01"


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    Base.metadata.create_all(engine)
    try:
        yield engine
    finally:
        engine.dispose()


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


def _count_commits(engine: Engine) -> list[str]:
    """Records each transaction's end ("commit" or "rollback") on the engine."""
    ends: list[str] = []
    event.listen(engine, "commit", lambda _conn: ends.append("commit"))
    event.listen(engine, "rollback", lambda _conn: ends.append("rollback"))
    return ends


# -- JournalStore.commit_group ----------------------------------------------------------------


def test_a_group_of_good_batches_is_one_transaction(store: JournalStore, engine: Engine) -> None:
    players = [_player() for _ in range(5)]
    ends = _count_commits(engine)
    outcomes = store.commit_group([_commit(p, _put(p, 0), _usage()) for p in players])
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
    ends = _count_commits(engine)
    outcomes = store.commit_group(requests)
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


def test_a_single_batch_fails_alone_without_a_second_run(
    store: JournalStore, engine: Engine
) -> None:
    player = _player()
    store.commit(_commit(player, _put(player, 0)))
    ends = _count_commits(engine)
    (outcome,) = store.commit_group([_commit(player, _put(player, 0))])
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


async def test_calls_waiting_while_the_writer_is_busy_share_one_transaction(
    store: JournalStore,
) -> None:
    committer = _Gated(store, max_group=8)
    try:
        players = [_player() for _ in range(12)]
        first = _submit(committer, store, _commit(players[0], _put(players[0], 0)))
        await asyncio.to_thread(committer.started.wait, 10)
        rest = [_submit(committer, store, _commit(p, _put(p, 0))) for p in players[1:]]
        await asyncio.sleep(0.05)  # all eleven are queued behind the first group
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
        record = asyncio.ensure_future(
            committer.run(
                functools.partial(
                    store.record_step_in,
                    step_id=step,
                    task_id=task.task_id,
                    position=0,
                    tool="t.t",
                    fence=fence,
                )
            )
        )
        complete = asyncio.ensure_future(
            committer.run(
                functools.partial(
                    store.complete_step_in,
                    step_id=step,
                    tool="t.t",
                    result=b"r",
                    codec_id="c:c",
                    fence=fence,
                )
            )
        )
        stale = asyncio.ensure_future(
            committer.run(
                functools.partial(
                    store.record_step_in,
                    step_id=other,
                    task_id=task.task_id,
                    position=1,
                    tool="t.t",
                    fence=journal_pb2.Fence(lease_name=claim.lease.name, token=1),
                )
            )
        )
        finish = asyncio.ensure_future(
            committer.run(
                functools.partial(
                    store.transition_task_in,
                    task_id=task.task_id,
                    state=journal_pb2.TASK_STATE_SUCCEEDED,
                    fence=fence,
                )
            )
        )
        await asyncio.sleep(0.05)
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
    await asyncio.sleep(0.01)
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
