"""Group commits of two storage replicas on one database (issue 19): every grouped transaction
takes its players' locks first, in one global order, so two replicas' groups never deadlock;
and a transaction PostgreSQL rolled back for a deadlock or a serialization failure is run
again, a bounded number of times, instead of failing its callers UNAVAILABLE.

Each replica is a store on an engine (a connection pool) of its own, as two storage processes
are. The interleavings are forced, not hoped for: replica 1's group holds its first write's
locks and waits (a unit that pauses) until replica 2's transaction is blocked on a lock, then
goes on."""

from __future__ import annotations

import asyncio
import datetime as dt
import random
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, event, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, sessionmaker
from system.storage.v1 import journal_pb2

from services.runtime.errors import InvalidArgument, Unavailable
from storage_service import group_commit
from storage_service.db import make_engine
from storage_service.dialect import is_postgresql
from storage_service.group_commit import GroupCommitter, Unit, run_group
from storage_service.journal import JournalBounds, JournalStore
from storage_service.player_data import UsageRow, add_usage
from tests.waiting import wait_until_sync

DAY_1, DAY_2 = "2030-01-01", "2030-01-02"
CONFLICTS = "system_storage_commit_group_conflicts_total"


def _player() -> str:
    return f"p-{uuid.uuid4()}"


def _usage(day: str, calls: int = 1) -> journal_pb2.CommitOperation:
    return journal_pb2.CommitOperation(usage=journal_pb2.UsageIncrement(day=day, model_calls=calls))


def _commit(player: str, *operations: journal_pb2.CommitOperation) -> journal_pb2.CommitRequest:
    return journal_pb2.CommitRequest(
        request_id=f"r-{uuid.uuid4()}", player_id=player, operations=operations
    )


def _conflicts() -> float:
    return REGISTRY.get_sample_value(CONFLICTS) or 0.0


class _Replica:
    """One storage replica's database side: its own engine (pool) and journal store."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        self.store = JournalStore(self.sessions, JournalBounds())
        self.deadlocks: list[BaseException] = []
        # Every deadlock or serialization failure a statement of this replica met, retried or
        # not (statements through SQLAlchemy's execute; the test's writes all are).
        event.listen(engine, "handle_error", self._seen)

    def _seen(self, context: Any) -> None:
        if getattr(context.original_exception, "sqlstate", None) in ("40P01", "40001"):
            self.deadlocks.append(context.original_exception)


@pytest.fixture
def replicas(engine: Engine, database_url: str) -> Iterator[tuple[_Replica, _Replica]]:
    """Two replicas on the test's (emptied) database."""
    second = make_engine(database_url)
    try:
        yield _Replica(engine), _Replica(second)
    finally:
        second.dispose()


def _usage_calls(replica: _Replica, player: str, day: str) -> int:
    with replica.sessions() as session:
        row = session.execute(
            select(UsageRow.model_calls).where(
                UsageRow.player_id == player, UsageRow.day == dt.date.fromisoformat(day)
            )
        ).scalar_one_or_none()
        return int(row or 0)


class _Pause:
    """A unit that, the first time it runs, holds its group (and the locks its group took so
    far) until the other replica's transaction waits for a lock (PostgreSQL), or a moment
    after the other replica's group started (SQLite, whose writers wait at BEGIN, unseen)."""

    def __init__(self, watcher: Engine) -> None:
        self._watcher = watcher
        self.reached = threading.Event()
        self.other_started = threading.Event()
        self._done = False

    def __call__(self, session: Session) -> None:
        if self._done:  # a rerun of the group: nothing to wait for any more
            return
        self._done = True
        self.reached.set()
        assert self.other_started.wait(10)
        if is_postgresql(self._watcher):
            wait_until_sync(self._other_waits, timeout=10, what="the other replica blocked")
        else:
            threading.Event().wait(0.2)  # stands for the other writer reaching its BEGIN

    def _other_waits(self) -> bool:
        with self._watcher.connect() as connection:
            waiting = connection.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"
                )
            ).scalar_one()
        return bool(waiting)


def _run_both(
    first: tuple[_Replica, list[Unit]],
    second: tuple[_Replica, list[Unit]],
    pause: _Pause,
) -> tuple[list[Any], list[Any]]:
    """Runs replica 1's group until it pauses, then replica 2's beside it; both outcomes."""
    results: dict[int, list[Any]] = {}

    def run(index: int, replica: _Replica, units: list[Unit]) -> None:
        try:
            results[index] = run_group(replica.sessions, units)
        except Exception as error:  # noqa: BLE001 - the whole group failed: its callers' answer
            results[index] = [error] * len(units)

    one = threading.Thread(target=run, args=(1, *first))
    one.start()
    assert pause.reached.wait(10)
    two = threading.Thread(target=run, args=(2, *second))
    two.start()
    pause.other_started.set()
    one.join(20)
    two.join(20)
    assert not one.is_alive() and not two.is_alive()
    return results[1], results[2]


def _failures(outcomes: Sequence[Any]) -> list[Any]:
    return [outcome for outcome in outcomes if isinstance(outcome, Exception)]


def test_one_players_writes_on_two_replicas_take_its_rows_in_one_order(
    replicas: tuple[_Replica, _Replica], engine: Engine
) -> None:
    """Replica 1's group writes the player's usage of day 1, then (after another write) day
    2; replica 2's lone Commit writes day 2, then day 1. Without one lock order, each held a
    row the other wanted: PostgreSQL broke the deadlock by failing replica 2's Commit, and its
    caller got UNAVAILABLE."""
    one, two = replicas
    player = _player()
    for day in (DAY_1, DAY_2):  # the rows exist: the writes below lock them
        one.store.commit(_commit(player, _usage(day)))
    pause = _Pause(engine)
    conflicts = _conflicts()
    first, second = _run_both(
        (
            one,
            [
                one.store.commit_unit(_commit(player, _usage(DAY_1))),
                pause,
                one.store.commit_unit(_commit(player, _usage(DAY_2))),
            ],
        ),
        (two, [two.store.commit_unit(_commit(player, _usage(DAY_2), _usage(DAY_1)))]),
        pause,
    )
    assert _failures(first) == [] and _failures(second) == []
    assert one.deadlocks == [] and two.deadlocks == []
    assert _conflicts() == conflicts  # nothing needed a retry: no deadlock happened at all
    assert _usage_calls(one, player, DAY_1) == 3
    assert _usage_calls(one, player, DAY_2) == 3


def test_two_replicas_groups_take_players_in_one_order(
    replicas: tuple[_Replica, _Replica], engine: Engine
) -> None:
    """Replica 1's group writes player A, then B; replica 2's writes B, then A (the order
    their calls arrived in): what bench.scaleout's two replicas did."""
    one, two = replicas
    a, b = _player(), _player()
    for player in (a, b):
        one.store.commit(_commit(player, _usage(DAY_1)))
    pause = _Pause(engine)
    conflicts = _conflicts()
    first, second = _run_both(
        (
            one,
            [
                one.store.commit_unit(_commit(a, _usage(DAY_1))),
                pause,
                one.store.commit_unit(_commit(b, _usage(DAY_1))),
            ],
        ),
        (
            two,
            [
                two.store.commit_unit(_commit(b, _usage(DAY_1))),
                two.store.commit_unit(_commit(a, _usage(DAY_1))),
            ],
        ),
        pause,
    )
    assert _failures(first) == [] and _failures(second) == []
    assert one.deadlocks == [] and two.deadlocks == []
    assert _conflicts() == conflicts
    assert all(not outcome.replayed for outcome in first + second if outcome is not None)
    assert _usage_calls(one, a, DAY_1) == 3
    assert _usage_calls(one, b, DAY_1) == 3


def _raw_usage(player: str, day: str) -> Callable[[Session], None]:
    """A write that declares no locks (the order rule cannot cover it): a usage increment."""

    def unit(session: Session) -> None:
        add_usage(session, player, journal_pb2.UsageIncrement(day=day, model_calls=1))

    return unit


def test_a_deadlocked_group_is_run_again_and_applies_everything_once(
    replicas: tuple[_Replica, _Replica], engine: Engine
) -> None:
    """Writes that declare nothing (so no order protects them) deadlock; PostgreSQL rolls the
    victim's transaction back whole, and its group runs again: its callers get their answers,
    each write applied once (a Commit's batch row was rolled back with the rest, so the rerun
    applies it, not replays it)."""
    one, two = replicas
    a, b, c = _player(), _player(), _player()
    for player in (a, b):
        one.store.commit(_commit(player, _usage(DAY_1)))
    pause = _Pause(engine)
    conflicts = _conflicts()

    def b_then_a(session: Session) -> None:
        _raw_usage(b, DAY_1)(session)
        _raw_usage(a, DAY_1)(session)

    first, second = _run_both(
        (one, [_raw_usage(a, DAY_1), pause, _raw_usage(b, DAY_1)]),
        (two, [two.store.commit_unit(_commit(c, _usage(DAY_1))), b_then_a]),
        pause,
    )
    assert _failures(first) == [] and _failures(second) == []
    assert not second[0].replayed
    if is_postgresql(engine):
        assert len(one.deadlocks + two.deadlocks) == 1  # it did deadlock, once
        assert _conflicts() == conflicts + 1  # and its group ran again
    assert _usage_calls(one, a, DAY_1) == 3
    assert _usage_calls(one, b, DAY_1) == 3
    assert _usage_calls(one, c, DAY_1) == 1


def _deadlock() -> sa_exc.OperationalError:
    return sa_exc.OperationalError("SELECT 1", {}, psycopg.errors.DeadlockDetected("deadlock"))


def test_conflict_retries_are_bounded_then_unavailable(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transaction that keeps failing with a deadlock is tried CONFLICT_ATTEMPTS times in
    all, pausing between tries; then its callers hear UNAVAILABLE (retry with the same
    request id), as with a lost database."""
    monkeypatch.setattr(group_commit, "_conflict_pause", lambda attempt: 0.0)
    sessions = sessionmaker(engine, expire_on_commit=False)
    tries: list[int] = []

    def deadlocking(session: Session) -> None:
        tries.append(1)
        raise _deadlock()

    with pytest.raises(sa_exc.OperationalError):
        run_group(sessions, [deadlocking])
    assert len(tries) == group_commit.CONFLICT_ATTEMPTS

    async def through_the_committer() -> None:
        committer = GroupCommitter(sessions)
        try:
            with pytest.raises(Unavailable):
                await committer.run(deadlocking)
        finally:
            committer.close()

    asyncio.run(through_the_committer())
    assert len(tries) == 2 * group_commit.CONFLICT_ATTEMPTS


def test_a_conflict_pause_is_short_and_jittered() -> None:
    random.seed(7)
    pauses = [group_commit._conflict_pause(attempt) for attempt in (1, 1, 2, 3)]
    assert all(0 < pause <= 0.1 for pause in pauses)
    assert len(set(pauses)) == len(pauses)


def test_two_replicas_under_load_answer_every_write(
    replicas: tuple[_Replica, _Replica],
) -> None:
    """Both replicas' committers at once, each caller's Commits writing a few players' usage
    rows in random orders (one row per op, several ops per Commit): every write is answered,
    none UNAVAILABLE, and every increment is stored once."""
    players = [_player() for _ in range(4)]
    days = [f"2030-02-0{day}" for day in range(1, 5)]
    rounds, callers = 25, 6
    rng = random.Random(19)
    plans = [
        [(player := rng.choice(players), rng.sample(days, k=len(days))) for _ in range(rounds)]
        for _ in range(2 * callers)
    ]

    async def load() -> list[Any]:
        committers = [GroupCommitter(replica.sessions) for replica in replicas]
        try:

            async def caller(index: int) -> list[Any]:
                replica = replicas[index % 2]
                committer = committers[index % 2]
                answers = []
                for player, order in plans[index]:
                    unit = replica.store.commit_unit(
                        _commit(player, *(_usage(day) for day in order))
                    )
                    try:
                        answers.append(await committer.run(unit))
                    except Exception as error:  # noqa: BLE001 - counted below
                        answers.append(error)
                return answers

            results = await asyncio.gather(*(caller(i) for i in range(2 * callers)))
        finally:
            for committer in committers:
                committer.close()
        return [answer for answers in results for answer in answers]

    answers = asyncio.run(load())
    assert _failures(answers) == []
    for player in players:
        commits = sum(1 for plan in plans for who, _ in plan if who == player)
        for day in days:
            assert _usage_calls(replicas[0], player, day) == commits


def test_a_conflict_in_the_savepoint_rerun_runs_the_whole_group_again(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group whose savepoint rerun meets a conflict is rolled back whole and run again from
    the start: each unit ends with its own outcome, and the good write is stored once."""
    monkeypatch.setattr(group_commit, "_conflict_pause", lambda attempt: 0.0)
    sessions = sessionmaker(engine, expire_on_commit=False)
    player = _player()
    calls: list[int] = []

    def refused(session: Session) -> None:
        raise InvalidArgument("refused")

    def conflicted_once(session: Session) -> str:
        calls.append(1)
        if len(calls) == 1:  # its first run: in the savepoint rerun (refused ends the plain one)
            raise _deadlock()
        return "ok"

    conflicts = _conflicts()
    outcomes = run_group(sessions, [refused, conflicted_once, _raw_usage(player, DAY_1)])
    assert isinstance(outcomes[0], InvalidArgument)
    assert outcomes[1:] == ["ok", None]
    assert _conflicts() == conflicts + 1
    assert _usage_calls(_Replica(engine), player, DAY_1) == 1
