"""The journal's records: the task and receipt tables, their state names, and the messages
their rows become.

Tasks and receipts are stored with their states as stable lower-case names (`queued`,
`running`, `done`, ...), never as enum numbers. A stored name this code does not know is
refused on read (INTERNAL, logged) instead of being guessed at: it is never claimed, never
evicted and never treated as new work.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import BigInteger, DateTime, Index, Integer, LargeBinary, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column
from system.storage.v1 import journal_pb2

from services.runtime.errors import InvalidArgument, NotFound, ServiceError
from storage_service.db import Base, table_of
from storage_service.dialect import ID, aware
from storage_service.validation import MAX_PLAYER_ID, check_id

__all__ = [
    "FAILED",
    "MAX_ID",
    "MAX_TASK_ID",
    "PARTIALLY_SUCCEEDED",
    "QUEUED",
    "RECOVERABLE",
    "RUNNING",
    "STEP_DONE",
    "STEP_RUNNING",
    "SUCCEEDED",
    "TERMINAL",
    "WAITING",
    "ReceiptRow",
    "StoredReceipt",
    "StoredTask",
    "TaskRow",
    "receipt_message",
    "task_message",
]

log = logging.getLogger("system.storage.journal")

MAX_TASK_ID = 64
MAX_ID = 128

TS = journal_pb2.TaskState
SS = journal_pb2.StepState

QUEUED = "queued"
RUNNING = "running"
WAITING = "waiting"
SUCCEEDED = "succeeded"
FAILED = "failed"
PARTIALLY_SUCCEEDED = "partially_succeeded"
STEP_RUNNING = "running"
STEP_DONE = "done"

_TASK_STATES: dict[str, journal_pb2.TaskState] = {
    QUEUED: TS.TASK_STATE_QUEUED,
    RUNNING: TS.TASK_STATE_RUNNING,
    WAITING: TS.TASK_STATE_WAITING,
    SUCCEEDED: TS.TASK_STATE_SUCCEEDED,
    FAILED: TS.TASK_STATE_FAILED,
    PARTIALLY_SUCCEEDED: TS.TASK_STATE_PARTIALLY_SUCCEEDED,
}
_TASK_NAMES: dict[int, str] = {number: name for name, number in _TASK_STATES.items()}
_STEP_STATES: dict[str, journal_pb2.StepState] = {
    STEP_RUNNING: SS.STEP_STATE_RUNNING,
    STEP_DONE: SS.STEP_STATE_DONE,
}
RECOVERABLE = frozenset({QUEUED, RUNNING, WAITING})
TERMINAL = frozenset({SUCCEEDED, FAILED, PARTIALLY_SUCCEEDED})
_MOVES: dict[str, frozenset[str]] = {
    QUEUED: frozenset({RUNNING, WAITING}),
    WAITING: frozenset({QUEUED, RUNNING}),
    RUNNING: frozenset({WAITING, QUEUED, SUCCEEDED, FAILED, PARTIALLY_SUCCEEDED}),
}
_STATE_CHOICES = "QUEUED, RUNNING, WAITING, SUCCEEDED, FAILED or PARTIALLY_SUCCEEDED"


# -- tables ------------------------------------------------------------------------------------


class TaskRow(Base):
    """One event task. `seq` orders a player's tasks by insertion (eviction, listing);
    `input` is an encoded google.protobuf.Struct, `result` an encoded
    system.common.v1.AgentResult; `size_bytes` is what the task counts against the bounds."""

    __tablename__ = "journal_tasks"
    __table_args__ = (
        UniqueConstraint("player_id", "event_key", name="uq_journal_tasks_event"),
        # Covering on PostgreSQL (migration 0014): an eviction reads a player's oldest sizes
        # from the index alone (the ledger's totals are one row since decision 0050).
        Index("ix_journal_tasks_player", "player_id", "seq", postgresql_include=["size_bytes"]),
        Index("ix_journal_tasks_state", "state", "seq"),
    )

    seq: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(String(MAX_TASK_ID), unique=True)
    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID))
    module_id: Mapped[str] = mapped_column(String(MAX_ID))
    event_key: Mapped[str] = mapped_column(String(MAX_ID))
    state: Mapped[str] = mapped_column(String(32))
    input: Mapped[bytes] = mapped_column(LargeBinary)
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class ReceiptRow(Base):
    """One step receipt, the single global receipt of a stable step id. No foreign key to its
    task: a finished task may be evicted before its receipts are."""

    __tablename__ = "journal_receipts"
    __table_args__ = (
        # Covering on PostgreSQL, as the tasks' (migration 0014): an eviction's candidates.
        Index("ix_journal_receipts_player", "player_id", "seq", postgresql_include=["size_bytes"]),
        Index("ix_journal_receipts_task", "task_id"),
    )

    seq: Mapped[int] = mapped_column(ID, primary_key=True, autoincrement=True)
    step_id: Mapped[str] = mapped_column(String(MAX_ID), unique=True)
    task_id: Mapped[str] = mapped_column(String(MAX_TASK_ID))
    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID))
    position: Mapped[int] = mapped_column(BigInteger)
    tool: Mapped[str] = mapped_column(String(MAX_ID))
    state: Mapped[str] = mapped_column(String(16))
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    codec_id: Mapped[str] = mapped_column(String(MAX_ID))
    size_bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


_TASKS = table_of(TaskRow)
_RECEIPTS = table_of(ReceiptRow)
_RECEIPT_COLUMNS = tuple(_RECEIPTS.c)


@dataclasses.dataclass(slots=True)
class StoredTask:
    """A task's columns as a statement read or wrote them, in the table's order (its fields
    are `journal_tasks`' columns: `StoredTask(*row)` takes a row of every column). The storage
    package reads and writes tables with statements; a mapped class only declares one."""

    seq: int | None
    task_id: str
    player_id: str
    module_id: str
    event_key: str
    state: str
    input: bytes
    result: bytes | None
    attempts: int
    size_bytes: int
    created_at: dt.datetime
    updated_at: dt.datetime

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> StoredTask:
        """The task a new row's values hold (`seq` None until the database numbers it)."""
        fields: dict[str, Any] = {column.name: values.get(column.name) for column in _TASKS.c}
        return cls(**fields)

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> StoredTask:
        """The task a row of every column, in the table's order, holds."""
        return cls(*row)


@dataclasses.dataclass
class StoredReceipt:
    """A receipt's columns as read or written by `record_step` and `complete_step` (they work
    on the table, not on ORM objects: fewer statements and far less Python per write)."""

    seq: int | None
    step_id: str
    task_id: str
    player_id: str
    position: int
    tool: str
    state: str
    result: bytes | None
    codec_id: str
    size_bytes: int
    created_at: dt.datetime
    updated_at: dt.datetime

    @classmethod
    def of(cls, row: object) -> StoredReceipt:
        return cls(**{column.name: getattr(row, column.name) for column in _RECEIPT_COLUMNS})


# -- validation --------------------------------------------------------------------------------


def _check_id(value: str, field: str, limit: int = MAX_ID) -> None:
    check_id(value, field, limit)


def _state_name(value: int, field: str) -> str:
    """The stored name of a task state given in a request; UNSPECIFIED and unknown refused."""
    if value == TS.TASK_STATE_UNSPECIFIED:
        raise InvalidArgument(f"{field} is required: one of {_STATE_CHOICES}")
    name = _TASK_NAMES.get(value)
    if name is None:
        raise InvalidArgument(f"{field} {value} is not a known task state; use {_STATE_CHOICES}")
    return name


def _shown(name: str) -> str:
    return name.upper()


# -- reading rows ------------------------------------------------------------------------------


def _known_task_state(task_id: str, state: str) -> str:
    """A task's stored state name; INTERNAL (ServiceError, logged) when this code does not
    know it."""
    if state not in _TASK_STATES:
        log.error("task %s has unknown stored state %r", task_id, state)
        raise ServiceError(
            f"task {task_id} has an unknown stored state {state!r}; it is left as it is "
            "and not run again (was it written by a newer version of the storage service?)"
        )
    return state


def _no_task(task_id: str) -> NotFound:
    """The NOT_FOUND of a task that is not there."""
    return NotFound(f"no task {task_id!r} (it may have finished and been evicted)")


def _stored_task_state(row: StoredTask) -> str:
    return _known_task_state(row.task_id, row.state)


def _stored_step_state(row: StoredReceipt) -> str:
    if row.state not in _STEP_STATES:
        log.error("receipt %s has unknown stored state %r", row.step_id, row.state)
        raise ServiceError(
            f"step {row.step_id} has an unknown stored state {row.state!r}; it is neither "
            "replayed nor run again (was it written by a newer version of the storage service?)"
        )
    return row.state


def task_message(row: StoredTask) -> journal_pb2.EventTask:
    """The EventTask a row holds; INTERNAL (ServiceError) for an unknown stored state."""
    task = journal_pb2.EventTask(
        task_id=row.task_id,
        player_id=row.player_id,
        module_id=row.module_id,
        event_key=row.event_key,
        state=_TASK_STATES[_stored_task_state(row)],
        attempts=row.attempts,
    )
    task.input.ParseFromString(row.input)
    if row.result is not None:
        task.result.ParseFromString(row.result)
    task.created_at.FromDatetime(aware(row.created_at))
    task.updated_at.FromDatetime(aware(row.updated_at))
    return task


def receipt_message(row: StoredReceipt) -> journal_pb2.StepReceipt:
    """The StepReceipt a row holds; INTERNAL (ServiceError) for an unknown stored state."""
    receipt = journal_pb2.StepReceipt(
        step_id=row.step_id,
        task_id=row.task_id,
        player_id=row.player_id,
        position=row.position,
        tool=row.tool,
        state=_STEP_STATES[_stored_step_state(row)],
        result=row.result or b"",
        codec_id=row.codec_id,
    )
    receipt.created_at.FromDatetime(aware(row.created_at))
    receipt.updated_at.FromDatetime(aware(row.updated_at))
    return receipt
