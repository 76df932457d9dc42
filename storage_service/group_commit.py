"""Group commit: concurrent writes share one database transaction.

Each write costs a transaction of its own otherwise: BEGIN, COMMIT (a WAL flush on
PostgreSQL, a WAL append on SQLite) and two thread hand-offs (event loop -> worker -> event
loop). Under load those dominate. Here one writer thread takes every write waiting when it is
free (at most `max_group`), runs them in one transaction (`run_group`), and wakes the event
loop once for the whole group.

A write is a *unit*: a function of a session that does its work inside the session's current
transaction and returns its answer (`JournalStore.commit_unit`, `JournalStore.record_step_in`,
...). What each caller sees is what it would see with a transaction of its own: its unit is
all or nothing, it never sees another's failure, and its answer comes only after the
transaction committed. A lost connection or a failed COMMIT fails every unit of the group
with UNAVAILABLE: none of them is known to be stored, and the journal's writes may be retried
(Commit by request id, the others because they are idempotent or checked). Nothing waits to
fill a group: a lone write runs at once, so latency at low load is that of a transaction per
call.

A unit may also be *groupable* (`GroupableUnit`): its `group_writer` writes the units of its
kind in a group together, in as few statements as their kind allows however many they are
(the rows they all insert into one table in one statement over arrays), where each would
otherwise run its own; it then reads from the results each unit's answer. When a unit's
one-statement form did not hold (a retried batch, a stale fence...), the group is rolled back
and runs again unit by unit, where the unit takes its long way. The answers are the same
either way. Units written together run before the group's other units: they are all
concurrent calls, so any order is one they could have had.

A write whose caller gave up (deadline, cancellation) is still applied if its group has
started, as with any database call already sent; its answer is dropped.

Lock order (decision 0028). A group holds the locks of all its writes until it commits, and
several storage replicas run groups on one database at once, so groups that take the same
rows in different orders would deadlock. A unit therefore declares whose rows it writes (its
`writes`, storage_service.ledgers.Writes), and every transaction of a group first takes those
players' locks in one statement, in one global order (`ledgers.lock_in_order`); a group's
other locks all belong to those players. Units that declare nothing are not ordered.

Conflicts. A transaction PostgreSQL rolled back for a deadlock (SQLSTATE 40P01, say with a
transaction outside any group) or a serialization failure (40001) left nothing behind, so the
group runs again from the start, up to CONFLICT_ATTEMPTS times in all with a short jittered
pause between tries, instead of answering UNAVAILABLE; nothing is applied twice, since the
whole transaction was rolled back (a Commit's batch row with it: the rerun applies the batch,
it does not replay it). Past the last try every unit gets UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from prometheus_client import Counter, Histogram
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, sessionmaker

from storage_service.dbcall import is_conflict, map_unavailable
from storage_service.ledgers import Writes, lock_in_order

__all__ = [
    "declared",
    "fenced",
    "CONFLICT_ATTEMPTS",
    "DEFAULT_MAX_GROUP",
    "Declared",
    "GroupCommitter",
    "GroupWriter",
    "GroupableUnit",
    "NotApplied",
    "Unit",
    "run_group",
]

log = logging.getLogger("system.storage.group_commit")

T = TypeVar("T")
Unit = Callable[[Session], Any]

# PostgreSQL keeps the ids of at most 64 subtransactions per transaction in shared memory and
# slows every snapshot down past that; a group that falls back to a savepoint per unit must
# stay under it.
DEFAULT_MAX_GROUP = 48
MAX_GROUP = 64

# Fewest groupable units written together: a lone one runs its own one-statement forms.
MIN_TOGETHER = 2

# Tries of a transaction rolled back by a deadlock or a serialization failure, in all; the
# pause before try n+1 is CONFLICT_PAUSE * 2**(n-1), jittered to 50-100 % of it, so two
# victims do not meet again at once (at most about 70 ms in all, on the writer thread).
CONFLICT_ATTEMPTS = 4
CONFLICT_PAUSE = 0.01

CONFLICTS = Counter(
    "system_storage_commit_group_conflicts",
    "Group transactions rolled back by a deadlock or serialization failure and run again.",
)

GROUP_SIZE = Histogram(
    "system_storage_commit_group_size",
    "Journal writes applied together in one transaction by the group committer.",
    buckets=(1, 2, 4, 8, 16, 32, 48, 64),
)


class NotApplied(Exception):  # noqa: N818 - not an error: the fast form did not hold
    """Raised by a unit's `finish` when its one-statement form did not apply (what it wrote
    changed nothing it may keep): the group runs again, each unit on its own."""


class GroupWriter(Protocol):
    """Writes several units of one kind together (so that, say, the rows they all insert into
    one table go in one statement)."""

    def write(self, session: Session, units: Sequence[Any]) -> list[Callable[[], Any] | None]:
        """Runs the units' statements and returns each unit's `finish`, which reads its
        answer from their results; raises NotApplied when the unit must run its long way
        instead, or the unit's error. None: nothing was written for that unit, it runs the
        ordinary way (after the others). A unit's statements go after those of the units
        before it, or its result must be the same as if they had."""
        ...


class GroupableUnit(Protocol):
    """A unit that its `group_writer` can also write together with others of its kind (see
    the module docstring). Found by that attribute (an isinstance check on a Protocol costs
    microseconds per unit)."""

    group_writer: GroupWriter

    def __call__(self, session: Session) -> Any: ...


class Declared:
    """A unit with whose rows it writes declared (`writes`, see the module docstring)."""

    __slots__ = ("_unit", "writes")

    def __init__(self, unit: Unit, writes: Writes) -> None:
        self._unit = unit
        self.writes = writes

    def __call__(self, session: Session) -> Any:
        return self._unit(session)


def declared(work: Callable[..., Any], writes: Writes, **arguments: Any) -> Declared:
    """`work(session, **arguments)` as a unit of a group, which writes `writes`' rows."""
    return Declared(functools.partial(work, **arguments), writes)


def fenced(request: Any) -> tuple[str, ...]:
    """The lease a write request's fence names, for its `Writes` (empty without a fence)."""
    return (request.fence.lease_name,) if request.HasField("fence") else ()


def run_group(sessions: sessionmaker[Session], units: Sequence[Unit]) -> list[Any]:
    """Runs `units` in one transaction; returns each one's answer or the exception it raised,
    once the transaction committed. A transaction rolled back by a deadlock or serialization
    failure runs again (up to CONFLICT_ATTEMPTS tries in all, see the module docstring).

    Raises:
        Exception: the transaction itself failed (COMMIT failed, the connection was lost
            while rolling back, or it met a conflict on every try): no outcome is known, so
            none is given.
    """
    attempt = 1
    while True:
        try:
            return _run_group_once(sessions, units)
        except Exception as error:
            if not is_conflict(error) or attempt >= CONFLICT_ATTEMPTS:
                raise
            CONFLICTS.inc()
            log.info(
                "group of %d writes rolled back by a conflict (%s), try %d of %d: running it again",
                len(units),
                type(getattr(error, "orig", error)).__name__,
                attempt,
                CONFLICT_ATTEMPTS,
            )
            time.sleep(_conflict_pause(attempt))
            attempt += 1


def _conflict_pause(attempt: int) -> float:
    """Seconds to wait before the try after `attempt` (see CONFLICT_PAUSE)."""
    return CONFLICT_PAUSE * 2.0 ** (attempt - 1) * random.uniform(0.5, 1.0)  # noqa: S311


def _run_group_once(sessions: sessionmaker[Session], units: Sequence[Unit]) -> list[Any]:
    """One try of `run_group`: a conflict propagates (nothing was kept), so the group can run
    again from the start.

    The group first runs without savepoints (two statements per unit fewer: the common case,
    where nothing fails), its groupable units written together, then the others in order.
    When such a unit's one-statement form did not hold, everything is rolled back and the group runs
    again, each unit the ordinary way. When a unit raises, everything is rolled back and the
    group runs again with a SAVEPOINT around each unit, so a failing one is undone alone and
    the others are applied. Running a unit twice is safe because the first run was rolled
    back.
    """
    together = sum(hasattr(unit, "group_writer") for unit in units) >= MIN_TOGETHER
    writes = [write for unit in units if (write := getattr(unit, "writes", None)) is not None]
    with sessions() as session:
        while True:
            session.begin()
            try:
                outcomes = _run_plain(session, units, writes, together)
            except NotApplied:
                session.rollback()
                together = False
                continue
            except Exception as error:  # noqa: BLE001 - a unit's failure, not the group's
                session.rollback()
                if is_conflict(error):
                    raise  # the whole transaction was the victim: run_group runs it again
                if len(units) == 1:
                    return [error]
                break
            session.commit()
            return outcomes
    return _run_isolated(sessions, units, writes)


def _run_plain(
    session: Session, units: Sequence[Unit], writes: Sequence[Writes], together: bool
) -> list[Any]:
    """Runs every unit in the session's transaction, no savepoints, after taking the locks
    `writes` declare, in order; with `together`, the units that can be written together
    first, each kind's by its group writer. A unit's error propagates."""
    outcomes: list[Any] = [None] * len(units)
    finishers: dict[int, Callable[[], Any]] = {}
    lock_in_order(session, writes)
    if together:
        kinds: dict[int, tuple[GroupWriter, list[int]]] = {}
        for index, unit in enumerate(units):
            writer = getattr(unit, "group_writer", None)
            if writer is not None:
                kinds.setdefault(id(writer), (writer, []))[1].append(index)
        for writer, indexes in kinds.values():
            written = writer.write(session, [units[index] for index in indexes])
            for index, finish in zip(indexes, written, strict=True):
                if finish is not None:
                    finishers[index] = finish
        for index, finish in finishers.items():
            outcomes[index] = finish()
    for index, unit in enumerate(units):
        if index not in finishers:
            outcomes[index] = unit(session)
    return outcomes


def _run_isolated(
    sessions: sessionmaker[Session], units: Sequence[Unit], writes: Sequence[Writes]
) -> list[Any]:
    """One transaction, the locks `writes` declare taken first, in order, then a SAVEPOINT per
    unit. A failure to roll back to the savepoint, or to commit, propagates: the connection
    is gone and nothing of the group is known; so does a conflict (the transaction is rolled
    back whole, to run again)."""
    outcomes: list[Any] = []
    with sessions.begin() as session:
        lock_in_order(session, writes)
        for unit in units:
            savepoint = session.begin_nested()
            try:
                answer = unit(session)
            except Exception as error:  # noqa: BLE001 - it is this unit's outcome
                if _is_connection_error(error) or is_conflict(error):
                    raise  # the transaction is gone (or rolled back whole): nothing is stored
                savepoint.rollback()
                outcomes.append(error)
            else:
                savepoint.commit()
                outcomes.append(answer)
    return outcomes


def _is_connection_error(error: BaseException) -> bool:
    """Whether `error` took the transaction's connection with it."""
    return isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated


class _Pending(NamedTuple):
    unit: Unit
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class GroupCommitter:
    """Runs write units in groups on one writer thread.

    Args:
        sessions: makes sessions on the storage engine.
        max_group: most units in one transaction.
    """

    def __init__(self, sessions: sessionmaker[Session], max_group: int = DEFAULT_MAX_GROUP) -> None:
        if not 1 <= max_group <= MAX_GROUP:
            raise ValueError(f"max_group must be between 1 and {MAX_GROUP}, got {max_group}")
        self._sessions = sessions
        self._max_group = max_group
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._closed = False
        self.groups = 0
        """Transactions run so far (for tests and diagnostics)."""
        self._thread = threading.Thread(target=self._run, name="storage-commit", daemon=True)
        self._thread.start()

    async def run(self, unit: Callable[[Session], T]) -> T:
        """The unit's answer once its group committed; its error otherwise (UNAVAILABLE when
        the database could not be used)."""
        if self._closed:
            raise RuntimeError("the group committer is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put(_Pending(unit, future, loop))
        return await future

    def close(self, timeout: float = 10.0) -> None:
        """Lets the writer finish what is queued, then stops it."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    # -- the writer thread ----------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                return
            group = [first]
            while len(group) < self._max_group:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                group.append(item)
            self._apply(group)

    def _apply(self, group: list[_Pending]) -> None:
        outcomes: Sequence[Any]
        where = "the group commit"
        try:
            outcomes = self.run_units([pending.unit for pending in group])
        except Exception as error:  # noqa: BLE001 - the whole group failed; each caller hears
            mapped = map_unavailable(error, where)
            if mapped is error:
                log.error("group of %d writes failed", len(group), exc_info=error)
            outcomes = [_copy(mapped) for _ in group]
        else:
            outcomes = [
                map_unavailable(o, where) if isinstance(o, Exception) else o for o in outcomes
            ]
        self.groups += 1
        GROUP_SIZE.observe(len(group))
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Pending, Any]]] = {}
        for pending, outcome in zip(group, outcomes, strict=True):
            by_loop.setdefault(pending.loop, []).append((pending, outcome))
        # One wake-up of each event loop for the whole group, not one per write.
        for loop, answers in by_loop.items():
            # RuntimeError: that loop is closed, so nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, answers)

    def run_units(self, units: Sequence[Unit]) -> list[Any]:
        """Runs one group (on the writer thread); tests replace it to watch or break groups."""
        return run_group(self._sessions, units)


def _copy(error: Exception) -> Exception:
    """The same error for another caller: one exception object raised in several coroutines
    would collect all their tracebacks."""
    try:
        copy = type(error)(*error.args)
    except Exception:  # noqa: BLE001 - an exception type with another signature
        return error
    copy.__dict__.update(error.__dict__)  # attributes beyond args (a ServiceError's reason)
    copy.__cause__ = error.__cause__ or error
    return copy


def _resolve(answers: list[tuple[_Pending, Any]]) -> None:
    for pending, outcome in answers:
        if pending.future.done():  # the caller gave up
            continue
        if isinstance(outcome, Exception):
            pending.future.set_exception(outcome)
        else:
            pending.future.set_result(outcome)
