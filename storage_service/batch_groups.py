"""A group commit's receipt batches written together.

When a group (storage_service.group_commit) holds two or more Commits made only of receipt
writes, or of receipt writes and a last task move (an event task's final Commit: decision
0036), their statements run before any answer is read: first the batches' rows (with their
players' ledger locks on PostgreSQL), then each write's one-statement form
(storage_service.receipts, storage_service.tasks.transition_fast). On PostgreSQL the rows go
as one statement, the receipt writes as one statement per chunk over arrays and the moves as
one more, and a fence is checked against the lease row the group's lock statement read
(ledgers.lock_in_order); on SQLite a statement each, and a batch with a move goes the
ordinary way. When a batch's one-statement form does not hold (a retry of a stored batch, a
stale fence, a receipt that must evict older ones) `finish_batch` raises NotApplied and the
group runs again write by write (storage_service.batches), so answers never differ.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    DateTime,
    LargeBinary,
    String,
    bindparam,
    literal,
    select,
)
from sqlalchemy.engine import Result
from sqlalchemy.orm import Session
from sqlalchemy.sql import Executable
from system.storage.v1 import journal_pb2

from storage_service.batches import (
    _BATCH_INSERT_SQLITE,
    _BATCHES,
    _apply_operation,
    _Batch,
    _batch_values,
    _completion,
)
from storage_service.db import rowcount
from storage_service.dialect import INSERT, POSTGRESQL, advisory_lock, is_postgresql, unnested
from storage_service.group_commit import NotApplied, fenced
from storage_service.journal_records import _TASKS
from storage_service.leases import _FENCE_QUERY, _fence_holds
from storage_service.ledgers import (
    JournalBounds,
    Writes,
    _locks_held,
    _player_lock_key,
    noted_lease,
)
from storage_service.receipt_statements import _RECORD_FAST, RECEIPT_WRITES_MANY, array_params
from storage_service.receipts import (
    _receipt_applied,
    _receipt_fast,
    _receipt_fast_done,
)
from storage_service.tasks import _MOVED_TYPES, move_update, transition_fast

if TYPE_CHECKING:
    from storage_service.journal import JournalStore

__all__ = ["finish_batch", "write_batches"]

# The rows of a group's batches in one statement (PostgreSQL): each inserted row returns its
# key, with its player's ledger lock taken (as _BATCH_INSERT_LOCKING does for one row).
_BATCH_ROWS = unnested(
    "v", "b_", [("player_id", String()), ("request_id", String()), ("digest", LargeBinary())]
)
_BATCH_ROWS_MANY = (
    INSERT[POSTGRESQL](_BATCHES)
    .from_select(
        ["player_id", "request_id", "digest", "response", "created_at"],
        select(
            _BATCH_ROWS.c.player_id,
            _BATCH_ROWS.c.request_id,
            _BATCH_ROWS.c.digest,
            literal(b"", LargeBinary),
            bindparam("now", type_=DateTime(timezone=True)),
        ),
    )
    .on_conflict_do_nothing()
    .returning(
        _BATCHES.c.player_id,
        _BATCHES.c.request_id,
        advisory_lock(literal(_player_lock_key(""), String) + _BATCHES.c.player_id).is_(None),
    )
)


def _inserted_rows(
    session: Session, batches: Sequence[_Batch], now: dt.datetime, postgresql: bool
) -> frozenset[tuple[str, str]]:
    """Inserts the rows of the batches of a group; returns the keys (player, request id) of
    those inserted now (the others were there: replays). One statement on PostgreSQL, one
    each on SQLite (where a statement costs no round trip, so fewer would save little)."""
    if postgresql:
        params: dict[str, object] = {
            "b_player_id": [batch.request.player_id for batch in batches],
            "b_request_id": [batch.request.request_id for batch in batches],
            "b_digest": [batch.digest for batch in batches],
            "now": now,
        }
        inserted = session.execute(_BATCH_ROWS_MANY, params)
        return frozenset((player, request) for player, request, _ in inserted)
    return frozenset(
        (batch.request.player_id, batch.request.request_id)
        for batch in batches
        if rowcount(session.execute(_BATCH_INSERT_SQLITE, _batch_values(batch, now))) == 1
    )


# -- a group's receipt writes together (PostgreSQL) ----------------------------------------------

# On PostgreSQL the receipt writes of a group go as one statement per chunk, over arrays
# (receipt_statements.RECEIPT_WRITES_MANY: the rules of _RECORD_FAST and _COMPLETE_FAST over
# unnested arrays, written once for both), not one statement a write. A chunk holds at most
# one write per player and per step id, so no row sees, or should have seen, another's effect
# (the ledgers are per player, a step id is one receipt), and the statement's two parts,
# which see one snapshot, need no order between them.


def _changed(result: Result[Any]) -> frozenset[str]:
    """The ids (of steps, of tasks) a combined statement changed: its rows' first column."""
    return frozenset(row[0] for row in result)


class _ReceiptChunks:
    """The receipt writes of a group, written as one RECEIPT_WRITES_MANY per chunk (see
    above); `applied(i)` is whether the i-th write added applied."""

    def __init__(self, bounds: JournalBounds, now: dt.datetime) -> None:
        self._bounds = bounds
        self._now = now
        self._chunks: list[tuple[list[dict[str, object]], list[dict[str, object]]]] = []
        # The first chunk each player's and each step's next write may go in: right after
        # their previous write's, so that writes of one player or one step keep their order
        # and a group of batches of several writes each costs as many chunks as its longest
        # batch, not one per write.
        self._next: dict[str, int] = {}
        self._where: list[tuple[int, str]] = []  # (chunk, step id) of each write
        self._written: list[frozenset[str]] = []

    def add(self, statement: Executable, params: dict[str, object]) -> int:
        player, step = f"p:{params['p_player_id']}", f"s:{params['p_step_id']}"
        chunk = max(self._next.get(player, 0), self._next.get(step, 0))
        self._next[player] = self._next[step] = chunk + 1
        if chunk == len(self._chunks):
            self._chunks.append(([], []))
        self._chunks[chunk][0 if statement is _RECORD_FAST else 1].append(params)
        self._where.append((chunk, str(params["p_step_id"])))
        return len(self._where) - 1

    def write(self, session: Session) -> None:
        for records, completes in self._chunks:
            params = array_params(records, completes)
            params.update(
                now=self._now,
                max_entries=self._bounds.receipt_max_entries,
                max_bytes=self._bounds.receipt_max_bytes,
            )
            self._written.append(_changed(session.execute(RECEIPT_WRITES_MANY, params)))

    def applied(self, index: int) -> bool:
        chunk, step = self._where[index]
        return step in self._written[chunk]


# A group's final task moves in one statement (PostgreSQL): tasks.move_update, the statement
# that moves one task, over arrays (else the move is not applied and goes the long way, which
# evicts or says why). It runs after every receipt chunk: a batch's move is its last
# operation. A group holds at most one move per player, so the ledger each row reads is not
# one another row changes.
_MOVES = unnested("v", "t_", list(_MOVED_TYPES.items()))
_TRANSITIONS_MANY = move_update(
    {name: _MOVES.c[name] for name in _MOVED_TYPES},
    bindparam("now", type_=DateTime(timezone=True)),
    bindparam("max_bytes", type_=BigInteger),
).returning(_TASKS.c.task_id)


class _Transitions:
    """The final task moves of a group, written as one _TRANSITIONS_MANY (see above)."""

    def __init__(self, bounds: JournalBounds, now: dt.datetime) -> None:
        self._bounds = bounds
        self._now = now
        self._rows: list[dict[str, object]] = []
        self._written: frozenset[str] = frozenset()

    def add(self, row: dict[str, object]) -> None:
        """Adds a move (tasks.transition_fast's row)."""
        self._rows.append(row)

    def write(self, session: Session) -> None:
        if not self._rows:
            return
        params: dict[str, object] = {
            f"t_{key}": [row[key] for row in self._rows] for key in _MOVED_TYPES
        }
        params.update(now=self._now, max_bytes=self._bounds.task_max_bytes)
        self._written = _changed(session.execute(_TRANSITIONS_MANY, params))

    def applied(self, task_id: str) -> bool:
        """Whether the move of the task added applied (once written)."""
        return task_id in self._written


class _Plan(NamedTuple):
    """A batch's one-statement forms: its receipt writes' (each with the index of its first
    operation: a recording that carries its completion stands for both) and its last
    move's."""

    writes: list[tuple[int, Executable, dict[str, object]]]
    move: dict[str, object] | None


def _receipt_writes(
    bounds: JournalBounds, now: dt.datetime, batch: _Batch
) -> list[tuple[int, Executable, dict[str, object]]] | None:
    """The batch's receipt writes in their one-statement forms, a step's recording followed
    by its completion as one DONE insert where `record_step` would make it one
    (batches._completion); None when a write has no such form."""
    assert batch.receipts is not None
    operations = batch.request.operations
    player = batch.request.player_id
    writes = []
    index = 0
    while index < len(batch.receipts):
        write = batch.receipts[index]
        following = operations[index + 1] if index + 1 < len(operations) else None
        fast = _receipt_fast(bounds, now, player, write, _completion(following, write.step_id))
        if fast is None:
            return None
        writes.append((index, *fast))
        index += 2 if _receipt_fast_done(fast[1]) else 1
    return writes


def _plans(
    bounds: JournalBounds, now: dt.datetime, batches: Sequence[_Batch], postgresql: bool
) -> list[_Plan | None]:
    """Each batch's plan, or None where it runs the ordinary way: a write or move without a
    one-statement form, a move on SQLite, a batch already in the group (it replays the
    first, the long way) and a player's batch after one of theirs with a move (whose
    statement runs after every receipt write)."""
    plans: list[_Plan | None] = []
    keys: set[tuple[str, str]] = set()
    moved: set[str] = set()
    for batch in batches:
        player = batch.request.player_id
        key = (player, batch.request.request_id)
        writes = _receipt_writes(bounds, now, batch)
        move = None
        if batch.transition is not None and postgresql:
            move = transition_fast(bounds, player, batch.transition)
        if (
            key in keys
            or player in moved
            or writes is None
            or (batch.transition is not None and move is None)
        ):
            plans.append(None)
            continue
        keys.add(key)
        if move is not None:
            moved.add(player)
        plans.append(_Plan(writes, move))
    return plans


def write_batches(
    session: Session, bounds: JournalBounds, now: dt.datetime, batches: Sequence[_Batch]
) -> list[Callable[[], journal_pb2.CommitResponse] | None]:
    """Writes batches of receipt writes (and a last move) together (group_commit.GroupWriter):
    first their rows, with their players' locks on PostgreSQL (_inserted_rows), then their
    writes' one-statement forms, in the order `batches.apply_batch` runs them: on PostgreSQL
    the writes in chunks (_ReceiptChunks) and the moves in one statement (_Transitions), their
    fences checked against the lease rows the group's locks read; on SQLite a fence read and
    a statement each. A row touches nothing a write or a fence reads, and a fence nothing a
    write touches, so writing every row first gives each batch the result it would have had
    in turn. None for a batch that runs the ordinary way (_plans)."""
    postgresql = is_postgresql(session)
    plans = _plans(bounds, now, batches, postgresql)
    planned = [batch for batch, plan in zip(batches, plans, strict=True) if plan is not None]
    if not planned:
        return [None] * len(batches)
    inserted = _inserted_rows(session, planned, now, postgresql)
    applied: list[list[tuple[int, bool]] | None] = []
    if postgresql:
        # The writes in chunks (_ReceiptChunks), then the moves (_Transitions); the fences'
        # lease rows came with the group's locks (each unit's `writes` names its fence).
        chunks = _ReceiptChunks(bounds, now)
        transitions = _Transitions(bounds, now)
        added: list[tuple[_Plan, list[tuple[int, int]]] | None] = []
        for plan in plans:
            if plan is None:
                added.append(None)
                continue
            writes = [
                (index, chunks.add(statement, params)) for index, statement, params in plan.writes
            ]
            if plan.move is not None:
                transitions.add(plan.move)
            added.append((plan, writes))
        chunks.write(session)
        transitions.write(session)
        for batch, entry in zip(batches, added, strict=True):
            if entry is None:
                applied.append(None)
                continue
            plan, writes = entry
            done = [(index, chunks.applied(write)) for index, write in writes]
            if plan.move is not None:
                last = len(batch.request.operations) - 1
                done.append((last, transitions.applied(str(plan.move["task_id"]))))
            applied.append(done)
    else:
        for batch, plan in zip(batches, plans, strict=True):
            if plan is None:
                applied.append(None)
                continue
            assert batch.receipts is not None
            applied.append(
                [
                    (
                        index,
                        _receipt_applied(batch.receipts[index], session.execute(statement, params)),
                    )
                    for index, statement, params in plan.writes
                ]
            )
    return [
        None
        if written is None
        else functools.partial(
            finish_batch,
            session,
            bounds,
            batch,
            now,
            postgresql,
            (batch.request.player_id, batch.request.request_id) in inserted,
            written,
        )
        for batch, written in zip(batches, applied, strict=True)
    ]


def finish_batch(
    session: Session,
    bounds: JournalBounds,
    batch: _Batch,
    now: dt.datetime,
    postgresql: bool,
    inserted: bool,
    applied: Sequence[tuple[int, bool]],
) -> journal_pb2.CommitResponse:
    """The answer of a batch written with its group's; NotApplied when what was written may
    not stand (a retried batch, a stale fence, a write that did not apply with another
    written after it): `batches.apply_batch` then runs it the long way. `inserted`: whether
    its row was inserted now; `applied` holds, per write (the batch's move last), the index of
    its first operation and whether it applied."""
    request = batch.request
    if not inserted:
        raise NotApplied  # the batch was there already: a replay
    if postgresql:
        _locks_held(session).add(request.player_id)
    if request.HasField("fence"):
        name = request.fence.lease_name
        # PostgreSQL: the lease row the group's lock statement read and share-locked; SQLite:
        # read now (nothing else writes while its transaction runs).
        lease = (
            noted_lease(session, name)
            if postgresql
            else session.execute(_FENCE_QUERY, {"name": name}).first()
        )
        if not _fence_holds(lease, request.fence, now):
            raise NotApplied
    last = len(applied) - 1
    for position, (first, write_applied) in enumerate(applied):
        if write_applied:
            continue
        if position != last:
            raise NotApplied  # the writes after it ran already, as if it had applied
        # The last write goes on the long way (eviction, or the reason it is refused),
        # right where it would have run.
        index = first
        while index < len(request.operations):
            index += _apply_operation(session, bounds, now, request, index, [])
    return journal_pb2.CommitResponse()


class _CommitWriter:
    """Writes the receipt batches of a group together (storage_service.group_commit
    .GroupWriter)."""

    __slots__ = ("_store",)

    def __init__(self, store: JournalStore) -> None:
        self._store = store

    def write(
        self, session: Session, units: Sequence[_GroupableCommit]
    ) -> list[Callable[[], journal_pb2.CommitResponse] | None]:
        return self._store._write_batches(session, [unit.batch for unit in units])  # noqa: SLF001


class _GroupableCommit:
    """`JournalStore.commit_unit` of a batch of receipt writes: a unit that can also be
    written together with the rest of its group (storage_service.group_commit.GroupableUnit);
    it writes its player's rows (`writes`, the group's lock order)."""

    __slots__ = ("batch", "group_writer", "writes")

    def __init__(self, group_writer: _CommitWriter, batch: _Batch) -> None:
        self.group_writer = group_writer
        self.batch = batch
        self.writes = Writes(players=(batch.request.player_id,), fences=fenced(batch.request))

    def __call__(self, session: Session) -> journal_pb2.CommitResponse:
        return self.group_writer._store._apply_batch(session, batch=self.batch)  # noqa: SLF001
