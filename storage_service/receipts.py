"""Step receipts: a step's intent recorded (RUNNING) before a write tool runs, its result
stored once (DONE); their one-statement forms are in storage_service.receipt_statements.

A receipt is the single global receipt of its stable step id. Recording a step again returns
the existing receipt; completing a DONE step again with the same result changes nothing, with
another result is refused. Each write first tries one statement that applies it when nothing
stands in the way (`_RECORD_FAST`, `_COMPLETE_FAST`; a Commit written with its group uses the same rules,
`_receipt_fast`); when that changes nothing, the long way under the player's lock says why,
or makes room in the player's receipt ledger (storage_service.ledgers) and runs the same
statement again: a receipt is written by one statement whichever way it went.

A recording may carry the step's completion (`Completion`: a Commit's RUNNING write followed
by the DONE write of the same step, as the engine sends the steps it never recorded,
decision 0036): the receipt the recording would insert is completed in memory by the rule
`complete_step` applies to a stored one (`_completed`), and `_RECORD_FAST` inserts it DONE,
one row written once. When that statement changes nothing, the recording goes the long way
alone and the completion is applied after it as usual, so every outcome is the one the two
writes have one after the other.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any, NamedTuple

from sqlalchemy import (
    select,
)
from sqlalchemy.engine import Result
from sqlalchemy.orm import Session
from sqlalchemy.sql import Executable
from system.storage.v1 import journal_pb2

from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, ServiceError
from storage_service.db import rowcount
from storage_service.journal_records import (
    _RECEIPT_COLUMNS,
    _RECEIPTS,
    _TASKS,
    MAX_TASK_ID,
    SS,
    STEP_DONE,
    STEP_RUNNING,
    TERMINAL,
    StoredReceipt,
    _check_id,
    _known_task_state,
    _no_task,
    _shown,
    _stored_step_state,
)
from storage_service.ledgers import (
    _STEP_OWNER,
    _STEP_OWNER_LOCKING,
    _TASK_OWNER,
    _TASK_OWNER_LOCKING,
    JournalBounds,
    _check_owner,
    _make_room_for_receipts,
    _owner_locked,
    lock_player,
    not_applied,
    player_ledger,
    receipt_size,
)
from storage_service.receipt_statements import (
    _COMPLETE_FAST,
    _RECORD_FAST,
    _complete_params,
    _record_params,
)

__all__ = ["Completion", "complete_step", "record_step"]


class Completion(NamedTuple):
    """A step's result, given with its recording (see the module docstring)."""

    tool: str
    result: bytes
    codec_id: str


def _check_same_step(
    row: StoredReceipt, task_id: str, position: int, tool: str, player_id: str | None
) -> None:
    _stored_step_state(row)
    _check_owner(row.player_id, player_id, f"step {row.step_id!r}")
    if row.tool != tool:
        raise FailedPrecondition(
            f"step {row.step_id} was recorded for tool {row.tool!r}, not {tool!r}; a step id "
            "names one tool call"
        )
    if row.task_id != task_id or row.position != position:
        raise FailedPrecondition(
            f"step {row.step_id} was recorded for task {row.task_id} at position {row.position}, "
            f"not task {task_id} at position {position}; step ids must be stable and unique"
        )


def _check_record(step_id: str, task_id: str, position: int, tool: str) -> None:
    _check_id(step_id, "step_id")
    _check_id(task_id, "task_id", MAX_TASK_ID)
    _check_id(tool, "tool")
    if not 0 <= position < 2**32:
        raise InvalidArgument(f"position must be between 0 and {2**32 - 1}")


def _check_complete(
    bounds: JournalBounds, step_id: str, tool: str, result: bytes, codec_id: str
) -> None:
    _check_id(step_id, "step_id")
    _check_id(tool, "tool")
    _check_id(codec_id, "codec_id")
    if len(result) > bounds.max_result_bytes:
        raise InvalidArgument(
            f"result is {len(result)} bytes, over the {bounds.max_result_bytes} byte limit"
        )


def _find_receipt(session: Session, step_id: str) -> StoredReceipt | None:
    row = (
        session.connection()
        .execute(select(*_RECEIPT_COLUMNS).where(_RECEIPTS.c.step_id == step_id))
        .one_or_none()
    )
    return None if row is None else StoredReceipt.of(row)


def _running_receipt(
    step_id: str,
    task_id: str,
    player_id: str,
    position: int,
    tool: str,
    size: int,
    now: dt.datetime,
) -> StoredReceipt:
    """The receipt a new recording writes: RUNNING, no result and no codec yet."""
    return StoredReceipt(
        seq=None,
        step_id=step_id,
        task_id=task_id,
        player_id=player_id,
        position=position,
        tool=tool,
        state=STEP_RUNNING,
        result=None,
        codec_id="",
        size_bytes=size,
        created_at=now,
        updated_at=now,
    )


def _completed(
    row: StoredReceipt, tool: str, result: bytes, codec_id: str, now: dt.datetime
) -> StoredReceipt | None:
    """What completing the receipt `row` with `result` makes of it (`complete_step`'s rule,
    the ledger aside): the receipt DONE, or None when it is DONE with this result and codec
    already (nothing changes). FAILED_PRECONDITION for another tool or a different result."""
    state = _stored_step_state(row)
    if row.tool != tool:
        raise FailedPrecondition(
            f"step {row.step_id} was recorded for tool {row.tool!r}, not {tool!r}"
        )
    if state == STEP_DONE:
        if (row.result or b"") == result and row.codec_id == codec_id:
            return None
        raise FailedPrecondition(
            f"step {row.step_id} is already DONE with a different result; a step's result is "
            "stored once and replayed, never replaced"
        )
    size = receipt_size(row.step_id, row.task_id, row.player_id, row.tool, codec_id, result)
    return dataclasses.replace(
        row, state=STEP_DONE, result=result, codec_id=codec_id, size_bytes=size, updated_at=now
    )


def _written(
    bounds: JournalBounds, receipt: StoredReceipt, then: Completion | None, now: dt.datetime
) -> StoredReceipt:
    """The receipt a new recording inserts: `receipt` (RUNNING), completed with `then` when
    given and its completion is one `complete_step` would apply; otherwise it stays RUNNING
    and the completion, applied after the recording, fails as it would alone."""
    if then is None:
        return receipt
    try:
        _check_complete(bounds, receipt.step_id, then.tool, then.result, then.codec_id)
        done = _completed(receipt, then.tool, then.result, then.codec_id, now)
    except ServiceError:
        return receipt
    assert done is not None  # a new receipt is RUNNING
    return done


def record_step(
    session: Session,
    bounds: JournalBounds,
    now: dt.datetime,
    *,
    step_id: str,
    task_id: str,
    position: int,
    tool: str,
    player_id: str | None = None,
    then: Completion | None = None,
) -> tuple[StoredReceipt, bool]:
    """Records a step's intent (RUNNING). Returns (receipt, created); an existing receipt of
    the same task, position and tool comes back with created False.

    `then`: the step's completion, written with the new receipt when the one statement that
    records a step applies (the receipt returned is then DONE); otherwise ignored, for the
    caller to apply with `complete_step` after this (see the module docstring).

    NOT_FOUND for a missing task; FAILED_PRECONDITION for a conflicting receipt or a task
    already final; STORAGE_FULL when the player's receipts are full of unfinished tasks'.
    """
    _check_record(step_id, task_id, position, tool)
    connection = session.connection()
    owner = player_id
    if owner is None:
        owner = _owner_locked(session, (_TASK_OWNER, _TASK_OWNER_LOCKING), task_id)
        if owner is None:
            existing = _find_receipt(session, step_id)
            if existing is not None:
                _check_same_step(existing, task_id, position, tool, player_id)
                return existing, False
            raise _no_task(task_id)
    # Under the player's lock, one statement reads the rest: the receipt if it exists already
    # (an earlier or concurrent recording), the task and the player's receipt ledger.
    lock_player(session, owner)
    size = receipt_size(step_id, task_id, owner, tool, "", None)
    receipt = _running_receipt(step_id, task_id, owner, position, tool, size, now)
    written = _written(bounds, receipt, then, now)
    if written.size_bytes <= bounds.receipt_max_bytes:
        inserted = session.execute(_RECORD_FAST, _record_params(bounds, written))
        if rowcount(inserted) == 1:
            return written, True
    ledger = player_ledger(_RECEIPTS, owner).subquery()
    found = connection.execute(
        select(
            select(_RECEIPTS.c.seq)
            .where(_RECEIPTS.c.step_id == step_id)
            .scalar_subquery()
            .label("existing"),
            _TASKS.c.player_id,
            _TASKS.c.state,
            ledger.c.ledger_count,
            ledger.c.ledger_bytes,
        )
        .select_from(ledger)
        .outerjoin(_TASKS, _TASKS.c.task_id == task_id)
    ).one()
    if found.existing is not None:
        existing = _find_receipt(session, step_id)
        assert existing is not None
        _check_same_step(existing, task_id, position, tool, player_id)
        return existing, False
    if found.state is None:
        raise _no_task(task_id)
    _check_owner(found.player_id, player_id, f"task {task_id!r}")
    state = _known_task_state(task_id, found.state)
    if state in TERMINAL:
        raise FailedPrecondition(
            f"task {task_id} is {_shown(state)}, a final state; its steps can no longer be recorded"
        )
    size = receipt_size(step_id, task_id, found.player_id, tool, "", None)
    if size > bounds.receipt_max_bytes:
        raise InvalidArgument(
            f"the receipt encodes to {size} bytes, over the {bounds.receipt_max_bytes} byte bound"
        )
    _make_room_for_receipts(
        session,
        bounds,
        found.player_id,
        1,
        size,
        ledger=(found.ledger_count, found.ledger_bytes),
    )
    # The room is made: the one statement applies now (the recording alone, RUNNING).
    receipt = _running_receipt(step_id, task_id, found.player_id, position, tool, size, now)
    if rowcount(session.execute(_RECORD_FAST, _record_params(bounds, receipt))) != 1:
        raise not_applied("a receipt write")
    return receipt, True


def complete_step(
    session: Session,
    bounds: JournalBounds,
    now: dt.datetime,
    *,
    step_id: str,
    tool: str,
    result: bytes,
    codec_id: str,
    player_id: str | None = None,
) -> StoredReceipt:
    """Stores a step's result (DONE). Completing a DONE step with the same result and codec
    changes nothing.

    NOT_FOUND without a receipt; FAILED_PRECONDITION for another tool or a different result;
    STORAGE_FULL when the result does not fit the player's bound.
    """
    _check_complete(bounds, step_id, tool, result, codec_id)
    connection = session.connection()
    owner = player_id
    if owner is None:
        owner = _owner_locked(session, (_STEP_OWNER, _STEP_OWNER_LOCKING), step_id)
    found = None
    if owner is not None:
        lock_player(session, owner)
        done = session.execute(
            _COMPLETE_FAST, _complete_params(bounds, now, step_id, owner, tool, result, codec_id)
        ).first()
        if done is not None:
            return StoredReceipt(*done)
        # The receipt, locked, with the bytes of the player's receipt ledger.
        found = connection.execute(
            select(
                *_RECEIPT_COLUMNS,
                player_ledger(_RECEIPTS, owner, bytes_only=True)
                .scalar_subquery()
                .label("ledger_bytes"),
            )
            .where(_RECEIPTS.c.step_id == step_id)
            .with_for_update(of=_RECEIPTS)
        ).one_or_none()
    if found is None:
        raise NotFound(f"no receipt for step {step_id!r}; record the step before completing it")
    row = StoredReceipt.of(found)
    _check_owner(row.player_id, player_id, f"step {step_id!r}")
    completed = _completed(row, tool, result, codec_id, now)
    if completed is None:
        return row
    if completed.size_bytes > row.size_bytes:
        # The count does not matter when nothing is added: only the bytes are checked.
        _make_room_for_receipts(
            session,
            bounds,
            row.player_id,
            0,
            completed.size_bytes - row.size_bytes,
            exclude_seq=row.seq,
            ledger=(0, found.ledger_bytes),
        )
    # The room is made: the one statement applies now.
    done = session.execute(
        _COMPLETE_FAST,
        _complete_params(bounds, now, step_id, row.player_id, tool, result, codec_id),
    ).first()
    if done is None:
        raise not_applied("a receipt write")
    return StoredReceipt(*done)


_SS_RUNNING = int(SS.STEP_STATE_RUNNING)
_SS_DONE = int(SS.STEP_STATE_DONE)


def _receipt_fast(
    bounds: JournalBounds,
    now: dt.datetime,
    player_id: str,
    write: journal_pb2.ReceiptWrite,
    then: Completion | None = None,
) -> tuple[Executable, dict[str, object]] | None:
    """The one statement that applies `write` when nothing stands in the way (_RECORD_FAST,
    _COMPLETE_FAST); None when the write is invalid or too large for it (the long way then
    says why, or makes room). A recording with `then` (its step's completion, the next write)
    inserts the receipt DONE when `record_step` would: see `_receipt_fast_done`."""
    try:
        if write.state == _SS_RUNNING and not (write.result or write.codec_id):
            _check_record(write.step_id, write.task_id, write.position, write.tool)
            size = receipt_size(write.step_id, write.task_id, player_id, write.tool, "", None)
            receipt = _running_receipt(
                write.step_id, write.task_id, player_id, write.position, write.tool, size, now
            )
            written = _written(bounds, receipt, then, now)
            if written.size_bytes > bounds.receipt_max_bytes:
                return None
            return _RECORD_FAST, _record_params(bounds, written)
        if write.state == _SS_DONE:
            _check_complete(bounds, write.step_id, write.tool, write.result, write.codec_id)
            params = _complete_params(
                bounds, now, write.step_id, player_id, write.tool, write.result, write.codec_id
            )
            return _COMPLETE_FAST, params
    except ServiceError:
        pass
    return None


def _receipt_fast_done(params: dict[str, object]) -> bool:
    """Whether `_receipt_fast`'s parameters record the step DONE (its completion with it)."""
    return params.get("p_state") == STEP_DONE  # _RECORD_FAST's parameter


def _receipt_applied(write: journal_pb2.ReceiptWrite, result: Result[Any]) -> bool:
    """Whether _receipt_fast's statement applied the write (else it changed nothing)."""
    if write.state == _SS_RUNNING:
        return rowcount(result) == 1
    return result.first() is not None
