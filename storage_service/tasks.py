"""Event tasks: created once per (player, event key), moved only along the edges listed in
journal.proto, and the page sizes of a player's task list (storage_service.pages).

QUEUED, RUNNING and WAITING are recoverable, SUCCEEDED, FAILED and PARTIALLY_SUCCEEDED
terminal: a terminal task never changes again. A move that adds a result makes room in the
player's task ledger first (storage_service.ledgers). Claims are storage_service.claims.

A creation and a move are each written by one statement (`create_insert`, `move_update`),
built once for one write's parameters and for a group's arrays (storage_service.create_groups,
storage_service.batch_groups): it applies where nothing stands in the way, and when it changes
nothing the long way reads the row, says why or makes room, and runs it again.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf import struct_pb2
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    FromClause,
    Insert,
    Integer,
    LargeBinary,
    String,
    Update,
    and_,
    bindparam,
    exists,
    insert,
    literal_column,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.engine import Row
from sqlalchemy.orm import Session
from sqlalchemy.types import TypeEngine
from system.common.v1 import common_pb2
from system.storage.v1 import journal_pb2

from services.runtime.errors import FailedPrecondition, InvalidArgument, ServiceError
from storage_service.db import rowcount
from storage_service.journal_records import (
    _MOVES,
    _TASK_NAMES,
    _TASKS,
    MAX_TASK_ID,
    QUEUED,
    RECOVERABLE,
    TERMINAL,
    TS,
    WAITING,
    StoredTask,
    _check_id,
    _no_task,
    _shown,
    _state_name,
    _stored_task_state,
)
from storage_service.ledgers import (
    _TASK_OWNER,
    _TASK_OWNER_LOCKING,
    JournalBounds,
    _check_owner,
    _ledgers_held,
    _make_room_for_tasks,
    _owner_locked,
    lock_player,
    not_applied,
    player_ledger,
    task_size,
)
from storage_service.validation import check_player_id

__all__ = [
    "create_insert",
    "create_task",
    "new_task",
    "queue_waiting",
    "transition_fast",
    "transition_task",
]

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500


_TASK_COLUMN_NAMES = [field.name for field in dataclasses.fields(StoredTask)]  # the table's order
_TASK_COLUMNS = [_TASKS.c[name] for name in _TASK_COLUMN_NAMES]


# The player's task with this event key, if any, and the player's task ledger (count,
# bytes), in one statement: always one row, the task's columns NULL when there is none. What
# create_task's long way reads when its one statement inserted nothing.
_LEDGER = player_ledger(_TASKS, bindparam("player_id", type_=String)).subquery("ledger")
_BY_EVENT = _TASKS.alias("by_event")
_TASK_BY_EVENT = select(
    *[_BY_EVENT.c[name] for name in _TASK_COLUMN_NAMES],
    _LEDGER.c.ledger_count,
    _LEDGER.c.ledger_bytes,
).select_from(
    _LEDGER.outerjoin(
        _BY_EVENT,
        and_(
            _BY_EVENT.c.player_id == bindparam("player_id", type_=String),
            _BY_EVENT.c.event_key == bindparam("event_key", type_=String),
        ),
    )
)

_CREATED_TYPES: dict[str, TypeEngine[Any]] = {
    "task_id": String(),
    "player_id": String(),
    "module_id": String(),
    "event_key": String(),
    "state": String(),
    "input": LargeBinary(),
    "size_bytes": Integer(),
}
"""A new task's columns a creation gives, and their types (the rest: no result, no attempts,
made now)."""
_CREATED_COLUMNS = tuple(_CREATED_TYPES)


_Insert = TypeVar("_Insert", bound=Insert)


def create_insert(
    into: _Insert,
    values: Mapping[str, ColumnElement[Any]],
    source: FromClause | None,
    now: ColumnElement[Any],
    max_entries: ColumnElement[Any],
    max_bytes: ColumnElement[Any],
) -> _Insert:
    """`into` (an INSERT into the tasks table) as INSERT ... SELECT that creates the tasks
    `values` names (an expression for each of `_CREATED_COLUMNS`) when nothing stands in the
    way: the player has no task with that event key and the task fits the player's ledger
    without eviction; it inserts nothing for a task otherwise. `source` is the FROM item the
    values' columns come from, each row's ledger read beside it (LATERAL); None for bind
    parameters (one creation). One creation (`_CREATE_ONE`) and a group's
    (storage_service.create_groups) apply this one rule."""
    ledger_query = player_ledger(_TASKS, values["player_id"])
    ledger: FromClause
    tables: FromClause
    if source is None:
        ledger = ledger_query.subquery("ledger")
        tables = ledger
    else:
        ledger = ledger_query.lateral("ledger")
        tables = source.join(ledger, true())
    existing = _TASKS.alias("e")
    rows = (
        select(
            *(values[name] for name in _CREATED_COLUMNS),
            null(),
            literal_column("0"),
            now,
            now,
        )
        .select_from(tables)
        .where(
            ~exists().where(
                existing.c.player_id == values["player_id"],
                existing.c.event_key == values["event_key"],
            ),
            ledger.c.ledger_count + literal_column("1") <= max_entries,
            ledger.c.ledger_bytes + values["size_bytes"] <= max_bytes,
        )
    )
    return into.from_select(
        [*_CREATED_COLUMNS, "result", "attempts", "created_at", "updated_at"], rows
    )


# One creation: each value a parameter named as its column with `c_` before it (new_task's
# row: SQLAlchemy keeps a column's own name for the VALUES it makes), the player's ledger read
# once.
_CREATE_ONE = create_insert(
    insert(_TASKS),
    {name: bindparam(f"c_{name}", type_=_CREATED_TYPES[name]) for name in _CREATED_COLUMNS},
    None,
    bindparam("c_created_at", type_=_TASKS.c.created_at.type),
    bindparam("max_entries", type_=Integer),
    bindparam("max_bytes", type_=BigInteger),
).execution_options(preserve_rowcount=True)


def new_task(
    bounds: JournalBounds,
    now: dt.datetime,
    *,
    player_id: str,
    module_id: str,
    input: struct_pb2.Struct | None,
    event_key: str,
    initial_state: int = TS.TASK_STATE_UNSPECIFIED,
) -> dict[str, Any]:
    """The row a new task would be (a fresh task id), checked as far as no stored row is
    needed: INVALID_ARGUMENT for a malformed id, an initial state other than QUEUED or
    WAITING, or an input too large for any ledger."""
    check_player_id(player_id)
    _check_id(module_id, "module_id")
    _check_id(event_key, "event_key")
    if initial_state == TS.TASK_STATE_UNSPECIFIED:
        state = QUEUED
    elif initial_state in (TS.TASK_STATE_QUEUED, TS.TASK_STATE_WAITING):
        state = _TASK_NAMES[initial_state]
    else:
        raise InvalidArgument(
            f"initial_state must be QUEUED or WAITING (or unset for QUEUED), got {initial_state}"
        )
    data = input.SerializeToString(deterministic=True) if input is not None else b""
    task_id = str(uuid.uuid4())
    size = task_size(task_id, player_id, module_id, event_key, data, None)
    if size > bounds.task_max_bytes:
        raise InvalidArgument(
            f"the task encodes to {size} bytes, over the {bounds.task_max_bytes} byte bound of a "
            "player's task ledger; pass a smaller input"
        )
    return {
        "task_id": task_id,
        "player_id": player_id,
        "module_id": module_id,
        "event_key": event_key,
        "state": state,
        "input": data,
        "result": None,
        "attempts": 0,
        "size_bytes": size,
        "created_at": now,
        "updated_at": now,
    }


def create_task(
    session: Session,
    bounds: JournalBounds,
    now: dt.datetime,
    *,
    player_id: str,
    module_id: str,
    input: struct_pb2.Struct | None,
    event_key: str,
    initial_state: int = TS.TASK_STATE_UNSPECIFIED,
) -> tuple[StoredTask, bool, int]:
    """Creates a task, or finds the player's task with this event key.

    Returns (row, created, evicted). STORAGE_FULL when the ledger is full of unfinished tasks.
    """
    values = new_task(
        bounds,
        now,
        player_id=player_id,
        module_id=module_id,
        input=input,
        event_key=event_key,
        initial_state=initial_state,
    )
    # Every event makes a task: one statement inserts it where nothing stands in the way,
    # under the player's lock (which a group's lock_in_order took already), so the insert
    # sees everything committed before the lock was granted.
    params = {
        **{f"c_{name}": value for name, value in values.items()},
        "max_entries": bounds.task_max_entries,
        "max_bytes": bounds.task_max_bytes,
    }
    lock_player(session, player_id)
    if rowcount(session.execute(_CREATE_ONE, params)) == 1:
        return StoredTask.of(values), True, 0
    # The long way: the event's task exists, or the ledger must make room first; then the
    # same statement applies (a task is written by one statement whichever way it went).
    found = session.execute(_TASK_BY_EVENT, {"player_id": player_id, "event_key": event_key})
    row = found.first()
    assert row is not None  # an aggregate always returns a row
    *columns, count, total = row
    if columns[0] is not None:  # the task's seq: it exists
        existing = StoredTask.from_row(columns)
        _stored_task_state(existing)
        return existing, False, 0
    evicted = _make_room_for_tasks(
        session, bounds, player_id, 1, values["size_bytes"], ledger=(count, total)
    )
    if rowcount(session.execute(_CREATE_ONE, params)) != 1:
        raise not_applied("a task creation")
    return StoredTask.of(values), True, evicted


_TASK_FOR_UPDATE = (
    select(*_TASK_COLUMNS)
    .where(_TASKS.c.task_id == bindparam("task_id", type_=String))
    .with_for_update()
)
# The same, with the task ledger of :player_id (count, bytes): what a move that adds a
# result makes room in, read with the task (one statement less). Only the task's row is
# locked (FOR UPDATE OF; PostgreSQL locks no aggregate); SQLite has no row locks and
# SQLAlchemy leaves the clause out there.
_TASK_AND_LEDGER_FOR_UPDATE = (
    select(*_TASK_COLUMNS, _LEDGER.c.ledger_count, _LEDGER.c.ledger_bytes)
    .select_from(_TASKS.join(_LEDGER, true()))
    .where(_TASKS.c.task_id == bindparam("task_id", type_=String))
    .with_for_update(of=_TASKS)
)

_FROMS = len(RECOVERABLE)
"""How many states a move may start from at most (a target's sources are recoverable)."""
_MOVED_TYPES: dict[str, TypeEngine[Any]] = {
    "task_id": String(),
    "player_id": String(),
    "state": String(),
    **{f"from{n}": String() for n in range(_FROMS)},
    "result": LargeBinary(),
    "grows": Integer(),
}
"""What a move gives (`_move_params`), and each value's type."""


def move_update(
    values: Mapping[str, ColumnElement[Any]],
    now: ColumnElement[Any],
    max_bytes: ColumnElement[Any],
) -> Update:
    """UPDATE that moves the tasks `values` names (an expression for each of `_MOVED_TYPES`)
    when nothing stands in the way: the task is the player's and in one of the states
    `from0`.. (those with an edge to the target, narrowed to the expected one; NULL where
    fewer), and a result fits the player's task ledger without eviction; it changes nothing
    for a task otherwise. A task a move starts from holds no result (results come only with
    a final state, which never moves), so its size grows by exactly the result's bytes
    (`grows`). Bind parameters for one move (`_MOVE_ONE`), unnested arrays for a group's
    (storage_service.batch_groups)."""
    ledger_bytes = player_ledger(_TASKS, values["player_id"], bytes_only=True).scalar_subquery()
    return (
        update(_TASKS)
        .where(
            _TASKS.c.task_id == values["task_id"],
            _TASKS.c.player_id == values["player_id"],
            _TASKS.c.state.in_([values[f"from{n}"] for n in range(_FROMS)]),
            or_(values["grows"] == 0, ledger_bytes + values["grows"] <= max_bytes),
        )
        .values(
            state=values["state"],
            result=values["result"],
            size_bytes=_TASKS.c.size_bytes + values["grows"],
            updated_at=now,
        )
    )


_MOVE_ONE = move_update(
    {name: bindparam(f"m_{name}", type_=type_) for name, type_ in _MOVED_TYPES.items()},
    bindparam("now", type_=_TASKS.c.updated_at.type),
    bindparam("max_bytes", type_=BigInteger),
).returning(*_TASK_COLUMNS)


def _move_one(
    session: Session, params: Mapping[str, object], limits: Mapping[str, object]
) -> Row[Any] | None:
    """The task `_MOVE_ONE` moved with `params` (`_move_params`), None when it moved none."""
    values = {f"m_{name}": value for name, value in params.items()}
    return session.execute(_MOVE_ONE, {**values, **limits}).first()


def _locked_task(
    session: Session, task_id: str, owner: str, with_ledger: bool
) -> tuple[StoredTask, tuple[int, int] | None]:
    """The task (a `StoredTask`: change the row with statements), locked FOR UPDATE;
    NOT_FOUND when missing. `owner`: the player whose ledger lock the caller holds (the task's
    or, for a Commit, the one it names: the caller checks that the task is theirs). With
    `with_ledger`, also that player's task ledger (count, bytes), read in the same statement;
    None otherwise."""
    statement = _TASK_AND_LEDGER_FOR_UPDATE if with_ledger else _TASK_FOR_UPDATE
    found = session.execute(statement, {"task_id": task_id, "player_id": owner}).first()
    if found is None:
        raise _no_task(task_id)
    if not with_ledger:
        return StoredTask.from_row(found), None
    *columns, count, total = found
    return StoredTask.from_row(columns), (count, total)


def _checked_move(
    bounds: JournalBounds,
    task_id: str,
    state: int,
    expected_state: int,
    result: common_pb2.AgentResult | None,
) -> tuple[str, str | None, bytes | None]:
    """A move's target and expected state names and its encoded result, as requested; what
    needs no row. INVALID_ARGUMENT for a bad id or state, or a result that may not come."""
    _check_id(task_id, "task_id", MAX_TASK_ID)
    target = _state_name(state, "state")
    expected = (
        None
        if expected_state == TS.TASK_STATE_UNSPECIFIED
        else _state_name(expected_state, "expected_state")
    )
    encoded = result.SerializeToString(deterministic=True) if result is not None else None
    if encoded is not None:
        if target not in TERMINAL:
            raise InvalidArgument(
                f"result is only for terminal states (SUCCEEDED, FAILED, PARTIALLY_SUCCEEDED), "
                f"not {_shown(target)}"
            )
        if len(encoded) > bounds.max_result_bytes:
            raise InvalidArgument(
                f"result encodes to {len(encoded)} bytes, over the {bounds.max_result_bytes} "
                "byte limit"
            )
    return target, expected, encoded


def _move_params(
    task_id: str, player_id: str, target: str, expected: str | None, encoded: bytes | None
) -> dict[str, object] | None:
    """`move_update`'s values for one move: the states it may start from (those with an edge
    to the target, narrowed to the expected one); None when there are none (the long way,
    transition_task, says why)."""
    froms = sorted(
        current
        for current, targets in _MOVES.items()
        if target in targets and expected in (None, current)
    )
    if not froms:
        return None
    params: dict[str, object] = {
        "task_id": task_id,
        "player_id": player_id,
        "state": target,
        "result": encoded,
        "grows": len(encoded or b""),
    }
    params.update((f"from{n}", froms[n] if n < len(froms) else None) for n in range(_FROMS))
    return params


def transition_fast(
    bounds: JournalBounds, player_id: str, move: journal_pb2.TaskTransition
) -> dict[str, object] | None:
    """A Commit's transition as `move_update`'s values, to be applied in one statement with
    other batches' (batch_groups._Transitions). None when the move is refused before any row
    is read (the long way, transition_task, then says why)."""
    try:
        target, expected, encoded = _checked_move(
            bounds,
            move.task_id,
            move.state,
            move.expected_state,
            move.result if move.HasField("result") else None,
        )
    except ServiceError:
        return None
    return _move_params(move.task_id, player_id, target, expected, encoded)


def transition_task(
    session: Session,
    bounds: JournalBounds,
    now: dt.datetime,
    *,
    task_id: str,
    state: int,
    expected_state: int = TS.TASK_STATE_UNSPECIFIED,
    result: common_pb2.AgentResult | None = None,
    player_id: str | None = None,
) -> StoredTask:
    """Moves a task along a valid edge (see journal_records._MOVES); a final result only with a terminal state.

    `player_id`, when given, must own the task (Commit). NOT_FOUND for a missing task;
    FAILED_PRECONDITION for an invalid move or an `expected_state` that does not hold;
    STORAGE_FULL when the result does not fit the player's bound.
    """
    target, expected, encoded = _checked_move(bounds, task_id, state, expected_state, result)
    # Under the player's lock, one statement moves the task where nothing stands in the way.
    owner = player_id  # a Commit's: the batch took the player's lock
    if owner is None or not _ledgers_held(session, owner):
        owner = _owner_locked(session, (_TASK_OWNER, _TASK_OWNER_LOCKING), task_id)
        if owner is None:
            raise _no_task(task_id)
    params = _move_params(task_id, owner, target, expected, encoded)
    limits = {"now": now, "max_bytes": bounds.task_max_bytes}
    if params is not None and player_id in (None, owner):
        moved = _move_one(session, params, limits)
        if moved is not None:
            return StoredTask.from_row(moved)
    # The long way says why, or makes room in the ledger; then the same statement applies (a
    # move is written by one statement whichever way it went). Only a move with a result can
    # make the row larger: only then is the ledger wanted.
    row, ledger = _locked_task(session, task_id, owner, with_ledger=encoded is not None)
    _check_owner(row.player_id, player_id, f"task {task_id!r}")
    current = _stored_task_state(row)
    if expected is not None and current != expected:
        raise FailedPrecondition(
            f"task {task_id} is {_shown(current)}, not the expected {_shown(expected)}"
        )
    if current in TERMINAL:
        raise FailedPrecondition(
            f"task {task_id} is {_shown(current)}, a final state; it never changes"
        )
    if target not in _MOVES[current]:
        allowed = ", ".join(sorted(_shown(name) for name in _MOVES[current]))
        raise FailedPrecondition(
            f"task {task_id} cannot move from {_shown(current)} to {_shown(target)}; "
            f"from {_shown(current)} it may move to {allowed}"
        )
    if encoded:
        _make_room_for_tasks(
            session, bounds, row.player_id, 0, len(encoded), exclude_seq=row.seq, ledger=ledger
        )
    # The checks passed, so the move has states to start from (params) and is the owner's.
    moved = None if params is None else _move_one(session, params, limits)
    if moved is None:
        raise not_applied("a task move")
    return StoredTask.from_row(moved)


# Every WAITING task of a player to QUEUED (their player joined): the move
# WAITING -> QUEUED of transition_task for each, which changes nothing but the state and the
# time (a task that waits holds no result).
_QUEUE_WAITING = (
    update(_TASKS)
    .where(_TASKS.c.player_id == bindparam("q_player_id"), _TASKS.c.state == WAITING)
    .values(state=QUEUED, updated_at=bindparam("q_now", type_=_TASKS.c.updated_at.type))
    .returning(_TASKS.c.seq, _TASKS.c.task_id)
)


def queue_waiting(session: Session, now: dt.datetime, player_id: str) -> list[str]:
    """Moves the player's WAITING tasks to QUEUED in one statement, under the player's lock
    (the order every writer of their ledgers keeps: decision 0027); returns the ids moved,
    oldest first."""
    check_player_id(player_id)
    lock_player(session, player_id)
    moved = session.execute(_QUEUE_WAITING, {"q_player_id": player_id, "q_now": now})
    return [task_id for _, task_id in sorted(moved)]
