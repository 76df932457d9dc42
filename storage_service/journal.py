"""The engine's journal: event tasks, step receipts, leases and atomic batches.

Domain code: no gRPC here. Messages travel as `system.storage.v1.journal_pb2` messages.

Tasks and receipts are stored with their states as stable lower-case names (`queued`,
`running`, `done`, ...), never as enum numbers. A stored name this code does not know is
refused on read (INTERNAL, logged) instead of being guessed at: it is never claimed, never
evicted and never treated as new work.

Bounds: a player's tasks and a player's receipts are each bounded by count and by encoded
bytes. A write that adds an entry, or makes one larger (a task's final result, a step's
result), first evicts the player's terminal entries oldest first (receipts: those whose task
is terminal or gone); QUEUED, RUNNING and WAITING tasks and the receipts of such tasks are
never evicted. When that is not enough the write fails with STORAGE_FULL and writes nothing.
Moving a task to a terminal state without a result never grows the ledger, so a full ledger
can always be drained.

Leases: one row per name. Fencing tokens grow with every acquisition of a name, and are at
least the acquisition time in microseconds, so they keep growing even if a lease row is
deleted (a player reset, or the eviction of a finished task) and made again. An engine
replica's leases are owned by `<name>#<incarnation>`: a restarted replica ends its earlier
incarnations' leases at start (`release_earlier_incarnations`, decision 0014).

Concurrency: on SQLite every write transaction starts with BEGIN IMMEDIATE (see db.py), so
writers are serialized. On PostgreSQL (READ COMMITTED) writes that change a player's ledgers
take a transaction-scoped advisory lock on the player first (so dedupe by event key and the
bounds hold under concurrent writers), the rows they change are locked FOR UPDATE, a fence
locks its lease FOR SHARE until commit (a concurrent acquisition waits, so no write lands
under a token that has already been replaced), and ClaimTasks picks rows FOR UPDATE SKIP
LOCKED and takes each task's lease under a row lock.

Session-level functions (`create_task`, `transition_task`, `record_step`, `complete_step`,
`check_fence`, the lease calls' `*_steps`) run inside a caller's transaction; `JournalStore` opens one
transaction per call, and `JournalStore.commit` applies a whole batch in one. The writes an
engine makes per step also come as units for a transaction the caller owns
(`JournalStore.commit_unit`, `record_step_in`, `complete_step_in`, `transition_task_in`): the
service runs many of them in one transaction (storage_service.group_commit).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as dt
import functools
import hashlib
import json
import logging
import uuid
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

from google.protobuf import struct_pb2
from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    String,
    UniqueConstraint,
    bindparam,
    delete,
    exists,
    func,
    insert,
    literal,
    literal_column,
    null,
    or_,
    select,
    text,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker
from system.common.v1 import common_pb2
from system.storage.v1 import journal_pb2

from services.runtime.errors import (
    STALE_FENCE,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
)
from storage_service.db import Base
from storage_service.fastsql import FastResult, FastStatement, Sent, pipelined
from storage_service.group_commit import NotApplied, run_group
from storage_service.player_data import (
    KEEP_ON_RESET,
    add_usage,
    check_version,
    delete_document,
    put_document,
)
from storage_service.validation import MAX_PLAYER_ID, check_id, check_player_id

__all__ = [
    "BatchRow",
    "JournalBounds",
    "JournalStore",
    "LeaseRow",
    "ReceiptRow",
    "TaskRow",
    "LeaseSteps",
    "acquire_steps",
    "OWNER_SEPARATOR",
    "release_earlier_incarnations",
    "release_steps",
    "renew_steps",
    "run_steps",
    "check_fence",
    "complete_step",
    "create_task",
    "receipt_message",
    "receipt_size",
    "record_step",
    "task_message",
    "task_size",
    "transition_task",
    "utc_now",
]

log = logging.getLogger("system.storage.journal")

T = TypeVar("T")

MAX_TASK_ID = 64
MAX_ID = 128
MAX_TTL_SECONDS = 3600
MAX_CLAIM = 100
MAX_CLAIM_PLAYERS = 1000
MAX_OPERATIONS = 256
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
MAX_TOKEN = 2**63 - 1  # tokens live in a signed BIGINT

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

_TASK_STATES: dict[str, int] = {
    QUEUED: TS.TASK_STATE_QUEUED,
    RUNNING: TS.TASK_STATE_RUNNING,
    WAITING: TS.TASK_STATE_WAITING,
    SUCCEEDED: TS.TASK_STATE_SUCCEEDED,
    FAILED: TS.TASK_STATE_FAILED,
    PARTIALLY_SUCCEEDED: TS.TASK_STATE_PARTIALLY_SUCCEEDED,
}
_TASK_NAMES = {number: name for name, number in _TASK_STATES.items()}
_STEP_STATES: dict[str, int] = {STEP_RUNNING: SS.STEP_STATE_RUNNING, STEP_DONE: SS.STEP_STATE_DONE}
RECOVERABLE = frozenset({QUEUED, RUNNING, WAITING})
TERMINAL = frozenset({SUCCEEDED, FAILED, PARTIALLY_SUCCEEDED})
_MOVES: dict[str, frozenset[str]] = {
    QUEUED: frozenset({RUNNING, WAITING}),
    WAITING: frozenset({QUEUED, RUNNING}),
    RUNNING: frozenset({WAITING, QUEUED, SUCCEEDED, FAILED, PARTIALLY_SUCCEEDED}),
}
_STATE_CHOICES = "QUEUED, RUNNING, WAITING, SUCCEEDED, FAILED or PARTIALLY_SUCCEEDED"

_ID = BigInteger().with_variant(Integer, "sqlite")


# -- tables ------------------------------------------------------------------------------------


class TaskRow(Base):
    """One event task. `seq` orders a player's tasks by insertion (eviction, listing);
    `input` is an encoded google.protobuf.Struct, `result` an encoded
    system.common.v1.AgentResult; `size_bytes` is what the task counts against the bounds."""

    __tablename__ = "journal_tasks"
    __table_args__ = (
        UniqueConstraint("player_id", "event_key", name="uq_journal_tasks_event"),
        Index("ix_journal_tasks_player", "player_id", "seq"),
        Index("ix_journal_tasks_state", "state", "seq"),
    )

    seq: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
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
        Index("ix_journal_receipts_player", "player_id", "seq"),
        Index("ix_journal_receipts_task", "task_id"),
    )

    seq: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
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


class LeaseRow(Base):
    """A named lease. `owner` and `expires_at` are NULL once released; the row (and its
    token) stays so the next acquisition gets a larger token."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(MAX_ID), primary_key=True)
    owner: Mapped[str | None] = mapped_column(String(MAX_ID), nullable=True)
    token: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class BatchRow(Base):
    """A Commit applied once: its request id, a digest of its content (a retry must carry the
    same batch) and the encoded CommitResponse that retries get back. Kept on player reset:
    a retry of a batch from before the reset must not apply it again."""

    __tablename__ = "journal_batches"
    __table_args__ = {"info": {KEEP_ON_RESET: True}}

    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(MAX_ID), primary_key=True)
    digest: Mapped[bytes] = mapped_column(LargeBinary)
    response: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


# -- settings ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JournalBounds:
    """Per-player ledger bounds and size limits (see StorageConfig for each)."""

    task_max_entries: int = 1000
    task_max_bytes: int = 1_048_576
    receipt_max_entries: int = 5000
    receipt_max_bytes: int = 4_194_304
    max_result_bytes: int = 262_144
    max_document_bytes: int = 262_144

    @classmethod
    def from_config(cls, config: object) -> JournalBounds:
        """The bounds of a StorageConfig (any object with the same attribute names)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# -- validation --------------------------------------------------------------------------------


def _check_id(value: str, field: str, limit: int = MAX_ID) -> None:
    check_id(value, field, limit)


def _check_ttl(seconds: int, field: str) -> None:
    if not 1 <= seconds <= MAX_TTL_SECONDS:
        raise InvalidArgument(
            f"{field} must be between 1 and {MAX_TTL_SECONDS} seconds, got {seconds}"
        )


def _check_token(token: int, field: str = "token") -> None:
    if token <= 0:
        raise InvalidArgument(f"{field} is required: the token the lease was acquired with")
    if token > MAX_TOKEN:
        raise InvalidArgument(f"{field} {token} is larger than any token ever issued")


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


def _aware(value: dt.datetime) -> dt.datetime:
    # SQLite returns naive datetimes; they were stored as UTC.
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


def _stored_task_state(row: TaskRow) -> str:
    if row.state not in _TASK_STATES:
        log.error("task %s has unknown stored state %r", row.task_id, row.state)
        raise ServiceError(
            f"task {row.task_id} has an unknown stored state {row.state!r}; it is left as it is "
            "and not run again (was it written by a newer version of the storage service?)"
        )
    return row.state


def _stored_step_state(row: ReceiptRow | StoredReceipt) -> str:
    if row.state not in _STEP_STATES:
        log.error("receipt %s has unknown stored state %r", row.step_id, row.state)
        raise ServiceError(
            f"step {row.step_id} has an unknown stored state {row.state!r}; it is neither "
            "replayed nor run again (was it written by a newer version of the storage service?)"
        )
    return row.state


def task_message(row: TaskRow) -> journal_pb2.EventTask:
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
    task.created_at.FromDatetime(_aware(row.created_at))
    task.updated_at.FromDatetime(_aware(row.updated_at))
    return task


def receipt_message(row: ReceiptRow | StoredReceipt) -> journal_pb2.StepReceipt:
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
    receipt.created_at.FromDatetime(_aware(row.created_at))
    receipt.updated_at.FromDatetime(_aware(row.updated_at))
    return receipt


# -- sizes and bounds --------------------------------------------------------------------------


def _utf8(*values: str) -> int:
    return sum(len(value.encode()) for value in values)


def task_size(
    task_id: str, player_id: str, module_id: str, event_key: str, data: bytes, result: bytes | None
) -> int:
    """Bytes a task counts against its player's bound: encoded input and result plus ids."""
    return _utf8(task_id, player_id, module_id, event_key) + len(data) + len(result or b"")


def receipt_size(
    step_id: str, task_id: str, player_id: str, tool: str, codec_id: str, result: bytes | None
) -> int:
    """Bytes a receipt counts against its player's bound: its result plus ids."""
    return _utf8(step_id, task_id, player_id, tool, codec_id) + len(result or b"")


_PLAYER_LOCK = FastStatement(
    select(func.pg_advisory_xact_lock(func.hashtextextended(bindparam("key", type_=String), 0)))
)
_LOCKED = "system.storage.journal.locked_players"


def _player_lock_key(player_id: str) -> str:
    return f"journal:{player_id}"


def _locks_held(session: Session) -> set[str]:
    """The players whose ledger lock the session's current (innermost) transaction holds.
    Keyed by that transaction: a lock taken in a savepoint that rolls back is released, and a
    new transaction holds none."""
    transaction = session.get_nested_transaction() or session.get_transaction()
    held = session.info.get(_LOCKED)
    if held is None or held[0] is not transaction:
        held = (transaction, set())
        session.info[_LOCKED] = held
    return held[1]


def _lock_player(session: Session, player_id: str) -> None:
    """Serializes writers of one player's ledgers until the transaction ends (PostgreSQL; on
    SQLite BEGIN IMMEDIATE already serializes every writer). Taken once per transaction."""
    if session.get_bind().dialect.name != "postgresql":
        return
    held = _locks_held(session)
    if player_id not in held:
        _PLAYER_LOCK.execute(session, {"key": _player_lock_key(player_id)})
        held.add(player_id)


def _fits(count: int, total: int, add_count: int, add_bytes: int, limits: tuple[int, int]) -> bool:
    max_entries, max_bytes = limits
    return (add_count == 0 or count + add_count <= max_entries) and (
        add_bytes <= 0 or total + add_bytes <= max_bytes
    )


def _choose_evictions(
    count: int,
    total: int,
    add_count: int,
    add_bytes: int,
    limits: tuple[int, int],
    candidates: Sequence[tuple[int, int]],
) -> list[int] | None:
    """Seqs to evict, oldest first, so the addition fits; None when it cannot fit."""
    doomed: list[int] = []
    for seq, size in candidates:
        if _fits(count, total, add_count, add_bytes, limits):
            break
        doomed.append(seq)
        count -= 1
        total -= size
    return doomed if _fits(count, total, add_count, add_bytes, limits) else None


def _make_room_for_tasks(
    session: Session,
    bounds: JournalBounds,
    player_id: str,
    add_count: int,
    add_bytes: int,
    exclude_seq: int | None = None,
    ledger: tuple[int, int] | None = None,
) -> int:
    """Evicts the player's terminal tasks, oldest first, until the addition fits. Returns how
    many; STORAGE_FULL when it cannot fit (nothing deleted). `ledger`: the player's task
    count and bytes, when the caller read them already under the player's lock."""
    limits = (bounds.task_max_entries, bounds.task_max_bytes)
    if ledger is None:
        # Raw cursor, so no autoflush: callers must not hold unflushed task changes here
        # (transition_task changes its row only after this).
        found = _TASK_LEDGER.execute(session, {"player_id": player_id}).first()
        assert found is not None  # an aggregate always returns a row
        ledger = (found[0], found[1])
    count, total = ledger
    if _fits(count, total, add_count, add_bytes, limits):
        return 0
    query = (
        select(TaskRow.seq, TaskRow.size_bytes, TaskRow.task_id)
        .where(TaskRow.player_id == player_id, TaskRow.state.in_(TERMINAL))
        .order_by(TaskRow.seq)
    )
    if exclude_seq is not None:
        query = query.where(TaskRow.seq != exclude_seq)
    candidates = session.execute(query).all()
    doomed = _choose_evictions(
        count, total, add_count, add_bytes, limits, [(c.seq, c.size_bytes) for c in candidates]
    )
    if doomed is None:
        raise ResourceExhausted(
            f"STORAGE_FULL: player {player_id}'s task ledger holds {count} tasks in {total} bytes "
            f"(bounds {bounds.task_max_entries} tasks, {bounds.task_max_bytes} bytes) and not "
            "enough of them are finished to make room; finish or fail tasks before adding more"
        )
    names = [f"task:{c.task_id}" for c in candidates[: len(doomed)]]
    session.execute(delete(TaskRow).where(TaskRow.seq.in_(doomed)))
    # The leases of evicted tasks go too (tokens stay increasing: see _micros).
    session.execute(delete(LeaseRow).where(LeaseRow.name.in_(names)))
    return len(doomed)


def _ledger_query(player_id: str):  # type: ignore[no-untyped-def]
    return select(
        func.count().label("ledger_count"),
        func.coalesce(func.sum(ReceiptRow.size_bytes), 0).label("ledger_bytes"),
    ).where(ReceiptRow.player_id == player_id)


def _make_room_for_receipts(
    session: Session,
    bounds: JournalBounds,
    player_id: str,
    add_count: int,
    add_bytes: int,
    exclude_seq: int | None = None,
    ledger: tuple[int, int] | None = None,
) -> int:
    """Evicts the player's receipts whose task is terminal or gone, oldest first, until the
    addition fits. Returns how many; STORAGE_FULL when it cannot fit (nothing deleted).

    `ledger` is the (count, bytes) of the player's receipts when the caller already read them
    in this transaction, under the player's lock; they are only read again when the addition
    does not fit."""
    limits = (bounds.receipt_max_entries, bounds.receipt_max_bytes)
    if ledger is not None and _fits(*ledger, add_count, add_bytes, limits):
        return 0
    count, total = session.execute(_ledger_query(player_id)).one()
    if _fits(count, total, add_count, add_bytes, limits):
        return 0
    query = (
        select(ReceiptRow.seq, ReceiptRow.size_bytes)
        .outerjoin(TaskRow, TaskRow.task_id == ReceiptRow.task_id)
        .where(
            ReceiptRow.player_id == player_id,
            or_(TaskRow.seq.is_(None), TaskRow.state.in_(TERMINAL)),
        )
        .order_by(ReceiptRow.seq)
    )
    if exclude_seq is not None:
        query = query.where(ReceiptRow.seq != exclude_seq)
    candidates = [(seq, size) for seq, size in session.execute(query)]
    doomed = _choose_evictions(count, total, add_count, add_bytes, limits, candidates)
    if doomed is None:
        raise ResourceExhausted(
            f"STORAGE_FULL: player {player_id}'s step receipts hold {count} receipts in {total} "
            f"bytes (bounds {bounds.receipt_max_entries} receipts, {bounds.receipt_max_bytes} "
            "bytes) and not enough of them belong to finished tasks to make room; finish or "
            "fail tasks before recording more steps"
        )
    session.execute(delete(ReceiptRow).where(ReceiptRow.seq.in_(doomed)))
    return len(doomed)


# -- leases ------------------------------------------------------------------------------------


def _micros(now: dt.datetime) -> int:
    """The time in microseconds: every taking of a lease gets token max(previous token + 1,
    this), so a lease row deleted and made again never hands out a token seen before (the
    rule of _acquire_statement and of _TAKE_LEASE, the claims' form of it)."""
    return int((now - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) / dt.timedelta(microseconds=1))


def _live(row: LeaseRow | _FencedLease, now: dt.datetime) -> bool:
    return row.owner is not None and row.expires_at is not None and _aware(row.expires_at) > now


def _acquire_statement(dialect_insert, greatest) -> FastStatement:  # type: ignore[no-untyped-def]
    """One statement that makes the row or takes it over when it is free, expired or already
    the owner's, returning the new token and the one before it (see _previous_token); no row
    comes back when someone else holds it."""
    inserted = dialect_insert(_LEASES).values(
        name=bindparam("name", type_=String),
        owner=bindparam("owner", type_=String),
        token=bindparam("token", type_=BigInteger),
        expires_at=bindparam("expires_at", type_=_LEASES.c.expires_at.type),
    )
    return FastStatement(
        inserted.on_conflict_do_update(
            index_elements=[_LEASES.c.name],
            set_={
                "owner": inserted.excluded.owner,
                "token": greatest(_LEASES.c.token + 1, inserted.excluded.token),
                "expires_at": inserted.excluded.expires_at,
            },
            where=or_(
                _LEASES.c.owner.is_(None),
                _LEASES.c.expires_at.is_(None),
                _LEASES.c.expires_at <= bindparam("now", type_=_LEASES.c.expires_at.type),
                _LEASES.c.owner == inserted.excluded.owner,
            ),
        ).returning(_LEASES.c.token, _previous_token())
    )


def _previous_token():  # type: ignore[no-untyped-def]
    """The lease's token as it was before the statement, 0 without a row: a subquery in
    RETURNING reads the statement's snapshot, not the row it just wrote (PostgreSQL; SQLite
    evaluates it as the row is written, so there it is read by a statement before, in the
    same transaction). On PostgreSQL, a statement that waited for another's lock on the row
    reads the snapshot from before the wait, so the token it returns can be older than the
    one it replaced: it misses another owner's acquisition only when that owner took the
    lease and gave it back while this one statement ran."""
    before = _LEASES.alias("before")
    return func.coalesce(
        select(before.c.token)
        .where(before.c.name == bindparam("name", type_=String))
        .scalar_subquery(),
        0,
    )


_LEASES = LeaseRow.__table__
# SQLite's two-argument max() is PostgreSQL's greatest().
_ACQUIRE_SQLITE = _acquire_statement(sqlite_insert, func.max)
_ACQUIRE_POSTGRESQL = _acquire_statement(postgresql_insert, func.greatest)


def _held_lease_update(**values):  # type: ignore[no-untyped-def]
    """UPDATE of a lease the caller holds (name, owner and token match); its row count says
    whether it was still theirs."""
    return FastStatement(
        update(_LEASES)
        .where(
            _LEASES.c.name == bindparam("name", type_=String),
            _LEASES.c.owner == bindparam("holder", type_=String),
            _LEASES.c.token == bindparam("held_token", type_=BigInteger),
        )
        .values(**values)
    )


# Every interactive run gives its player's lease back, and held leases (tasks, long runs) are
# renewed every third of their length: one statement each on the driver's cursor.
_RELEASE = _held_lease_update(owner=None, expires_at=None)
_RENEW = _held_lease_update(expires_at=bindparam("expires_at", type_=_LEASES.c.expires_at.type))


ACQUIRE_ATTEMPTS = 3
"""Times AcquireLease asks for a lease that was held, then free again before it could say by
whom (the holder gave it back in between)."""


LeaseSteps = Generator[tuple[FastStatement, dict[str, Any]], FastResult, Any]
"""A lease call as the statements it runs: it yields each statement with its parameters and
is sent that statement's result; what it returns is the call's answer. One driver runs them
in a session or on a connection (`run_steps`), another on the event loop
(storage_service.async_leases), so the rules are written once."""


def run_steps(steps: LeaseSteps, target: Session | Connection) -> Any:
    """Runs a lease call's statements in the session's transaction (or on the connection)."""
    try:
        statement, params = next(steps)
        while True:
            statement, params = steps.send(statement.execute(target, params))
    except StopIteration as done:
        return done.value


def acquire_steps(
    name: str, owner: str, ttl_seconds: int, now: dt.datetime, sqlite: bool
) -> LeaseSteps:
    """Takes `name` for `owner` until now + ttl when it is free, expired or already the
    owner's; every acquisition gets a larger token (see _micros), and the answer
    (AcquireLeaseResponse) carries the token of the acquisition before it (0 for a first
    one). FAILED_PRECONDITION when someone else holds it.

    One statement (an upsert that only updates a row it may take, returning the token): the
    player's lease is taken before every interactive run, so its cost is on every request's
    critical path."""
    _check_id(name, "name")
    _check_id(owner, "owner")
    _check_ttl(ttl_seconds, "ttl_seconds")
    expires_at = now + dt.timedelta(seconds=ttl_seconds)
    params = {
        "name": name,
        "owner": owner,
        "token": _micros(now),
        "expires_at": expires_at,
        "now": now,
    }
    for _ in range(ACQUIRE_ATTEMPTS):
        before = None
        if sqlite:  # one writer at a time: read before writing, in the same transaction
            before = _lease_row((yield _LEASE_STATE, {"name": name}))
        taken = yield (_ACQUIRE_SQLITE if sqlite else _ACQUIRE_POSTGRESQL), params
        if taken.rows:
            token, previous = taken.rows[0]
            if sqlite:  # see _previous_token
                previous = 0 if before is None else before.token
            lease = journal_pb2.Lease(name=name, owner=owner, token=int(token))
            lease.expires_at.FromDatetime(expires_at)
            return journal_pb2.AcquireLeaseResponse(lease=lease, previous_token=int(previous))
        # Someone held it. Read who, to say so; in autocommit (PostgreSQL) the holder may have
        # given it back between the two statements, and then it is asked for again.
        holder = _lease_row((yield _LEASE_STATE, {"name": name}))
        if holder is not None and _live(holder, now):
            assert holder.expires_at is not None
            raise FailedPrecondition(
                f"lease {name!r} is held by {holder.owner!r} until "
                f"{_aware(holder.expires_at).isoformat()}; try again after it expires"
            )
    raise FailedPrecondition(
        f"lease {name!r} changed hands {ACQUIRE_ATTEMPTS} times while being taken; try again"
    )


def renew_steps(
    name: str, owner: str, token: int, ttl_seconds: int, now: dt.datetime
) -> LeaseSteps:
    """Extends a lease the caller holds (also after it expired, if nobody took it since);
    answers the Lease. FAILED_PRECONDITION when it is not the caller's."""
    _check_id(name, "name")
    _check_id(owner, "owner")
    _check_token(token)
    _check_ttl(ttl_seconds, "ttl_seconds")
    expires_at = now + dt.timedelta(seconds=ttl_seconds)
    renewed = yield (
        _RENEW,
        {"name": name, "holder": owner, "held_token": token, "expires_at": expires_at},
    )
    if renewed.rowcount == 1:
        lease = journal_pb2.Lease(name=name, owner=owner, token=token)
        lease.expires_at.FromDatetime(expires_at)
        return lease
    row = _lease_row((yield _LEASE_STATE, {"name": name}))
    if row is None or row.owner is None:
        raise FailedPrecondition(f"lease {name!r} is not held; acquire it again")
    raise FailedPrecondition(
        f"lease {name!r} is held by {row.owner!r} with token {row.token}, not by "
        f"{owner!r} with token {token}; acquire it again"
    )


def release_steps(name: str, owner: str, token: int) -> LeaseSteps:
    """Gives a lease up; answers False when it was no longer the caller's. The token is
    kept."""
    _check_id(name, "name")
    _check_id(owner, "owner")
    _check_token(token)
    released = yield _RELEASE, {"name": name, "holder": owner, "held_token": token}
    return released.rowcount == 1


OWNER_SEPARATOR = "#"
"""Separates an engine replica's stable name from its incarnation in a lease owner
(`<name>#<incarnation>`)."""


def _check_owner_part(value: str, field: str) -> None:
    _check_id(value, field)
    if OWNER_SEPARATOR in value:
        raise InvalidArgument(
            f"{field} must not contain {OWNER_SEPARATOR!r}: it separates a replica's name from "
            f"its incarnation in a lease owner (`<name>{OWNER_SEPARATOR}<incarnation>`), "
            f"got {value[:MAX_ID]!r}"
        )


# Every lease held by an owner `<name>#...` other than the caller's own `<name>#<incarnation>`.
# A prefix comparison (substr) rather than LIKE, so a name's `%` and `_` match only themselves;
# both databases count characters. Runs once per engine start: a scan of the leases table
# rather than an index on `owner`, which every lease call would pay to keep up.
_RELEASE_EARLIER = (
    update(_LEASES)
    .where(
        func.substr(_LEASES.c.owner, 1, bindparam("prefix_length", type_=Integer))
        == bindparam("prefix", type_=String),
        _LEASES.c.owner != bindparam("own", type_=String),
    )
    .values(owner=None, expires_at=None)
)


def release_earlier_incarnations(target: Session | Connection, name: str, incarnation: str) -> int:
    """Ends every lease held by an earlier incarnation of replica `name`: owner
    `<name>#<anything but incarnation>`, live or expired; answers how many. Tokens are kept,
    so the earlier incarnation's fences are stale from now on, and its RUNNING tasks are
    claimable at once (ClaimTasks takes a task no live lease protects). The caller's own
    incarnation and other names are left alone. INVALID_ARGUMENT for an empty part, a part
    containing `#`, or an owner that would be over MAX_ID characters."""
    _check_owner_part(name, "name")
    _check_owner_part(incarnation, "incarnation")
    own = f"{name}{OWNER_SEPARATOR}{incarnation}"
    if len(own) > MAX_ID:
        raise InvalidArgument(
            f"name and incarnation make an owner of {len(own)} characters "
            f"(`<name>{OWNER_SEPARATOR}<incarnation>`); an owner is at most {MAX_ID}"
        )
    prefix = f"{name}{OWNER_SEPARATOR}"
    result = target.execute(
        _RELEASE_EARLIER, {"prefix": prefix, "prefix_length": len(prefix), "own": own}
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


_LEASE_ROW = select(
    _LEASES.c.name,  # type: ignore[attr-defined]
    _LEASES.c.owner,  # type: ignore[attr-defined]
    _LEASES.c.token,  # type: ignore[attr-defined]
    _LEASES.c.expires_at,  # type: ignore[attr-defined]
).where(_LEASES.c.name == bindparam("name", type_=String))  # type: ignore[attr-defined]
# A lease row as it is now (to say who holds it), and share-locked (a fence being checked).
_LEASE_STATE = FastStatement(_LEASE_ROW)
_FENCE_QUERY = FastStatement(_LEASE_ROW.with_for_update(read=True))


class _FencedLease(NamedTuple):
    name: str
    owner: str | None
    token: int
    expires_at: dt.datetime | None


def _lease_row(result: FastResult) -> _FencedLease | None:
    """The lease row a _LEASE_STATE or _FENCE_QUERY read found, if any."""
    found = result.first()
    return None if found is None else _FencedLease(*found)


def check_fence(session: Session, fence: journal_pb2.Fence | None, now: dt.datetime) -> None:
    """FAILED_PRECONDITION ("stale fence") unless the fence's lease is held, unexpired, with
    the fence's token. The lease row stays share-locked until the transaction ends, so it
    cannot be taken again before the fenced write commits."""
    if fence is None:
        return
    _check_id(fence.lease_name, "fence.lease_name")
    _check_token(fence.token, "fence.token")
    row = _lease_row(_FENCE_QUERY.execute(session, {"name": fence.lease_name}))
    where = f"stale fence: lease {fence.lease_name!r} token {fence.token}"
    if row is None or row.owner is None:
        raise FailedPrecondition(
            f"{where} is not held by anyone; acquire the lease again", STALE_FENCE
        )
    if row.token != fence.token:
        raise FailedPrecondition(
            f"{where} was replaced by token {row.token} ({row.owner!r} holds it); stop and let "
            "the current holder write",
            STALE_FENCE,
        )
    if not _live(row, now):
        raise FailedPrecondition(f"{where} has expired; acquire the lease again", STALE_FENCE)


# -- tasks -------------------------------------------------------------------------------------


# CreateTask runs for every event: its statements are rendered once (see fastsql).
_TASKS = TaskRow.__table__
_TASK_COLUMN_NAMES = [
    "seq",
    "task_id",
    "player_id",
    "module_id",
    "event_key",
    "state",
    "input",
    "result",
    "attempts",
    "size_bytes",
    "created_at",
    "updated_at",
]
_TASK_COLUMNS = [_TASKS.c[name] for name in _TASK_COLUMN_NAMES]  # type: ignore[attr-defined]


def _task_row(values: Sequence[object]) -> TaskRow:
    """A detached task row from a statement's columns in _TASK_COLUMN_NAMES order (read it;
    change the table with statements, not through a session)."""
    return TaskRow(**dict(zip(_TASK_COLUMN_NAMES, values, strict=True)))


_TASK_BY_EVENT = FastStatement(
    select(*_TASK_COLUMNS).where(
        _TASKS.c.player_id == bindparam("player_id", type_=String),  # type: ignore[attr-defined]
        _TASKS.c.event_key == bindparam("event_key", type_=String),  # type: ignore[attr-defined]
    )
)
_TASK_LEDGER = FastStatement(
    select(func.count(), func.coalesce(func.sum(_TASKS.c.size_bytes), 0)).where(  # type: ignore[attr-defined]
        _TASKS.c.player_id == bindparam("player_id", type_=String)  # type: ignore[attr-defined]
    )
)
_TASK_INSERT = FastStatement(insert(_TASKS), column_keys=_TASK_COLUMN_NAMES[1:])


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
) -> tuple[TaskRow, bool, int]:
    """Creates a task, or finds the player's task with this event key.

    Returns (row, created, evicted). STORAGE_FULL when the ledger is full of unfinished tasks.
    """
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
    # Every event makes a task: the player's lock and both reads go to PostgreSQL together
    # (one round trip, not three); the server still runs them in turn, so the reads see
    # everything committed before the lock was granted.
    locking = session.get_bind().dialect.name == "postgresql"
    with pipelined(session):
        lock = _PLAYER_LOCK.send(session, {"key": _player_lock_key(player_id)}) if locking else None
        by_event = _TASK_BY_EVENT.send(session, {"player_id": player_id, "event_key": event_key})
        ledger = _TASK_LEDGER.send(session, {"player_id": player_id})
    if lock is not None:
        lock.result()
        _locks_held(session).add(player_id)
    found = by_event.result().first()
    if found is not None:
        existing = _task_row(found)
        _stored_task_state(existing)
        return existing, False, 0
    counted = ledger.result().first()
    assert counted is not None  # an aggregate always returns a row
    evicted = _make_room_for_tasks(
        session, bounds, player_id, 1, size, ledger=(counted[0], counted[1])
    )
    values = {
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
    _TASK_INSERT.execute(session, values)
    # Not added to the session: the caller only reads it (task_message).
    return TaskRow(**values), True, evicted


_TASK_FOR_UPDATE = FastStatement(
    select(*_TASK_COLUMNS)
    .where(_TASKS.c.task_id == bindparam("task_id", type_=String))  # type: ignore[attr-defined]
    .with_for_update()
)
# Every finished event task moves once: one UPDATE on the driver's cursor, no ORM flush.
_TASK_MOVE = FastStatement(
    update(_TASKS)
    .where(_TASKS.c.seq == bindparam("p_seq", type_=_ID))  # type: ignore[attr-defined]
    .values(
        state=bindparam("p_state", type_=String),
        result=bindparam("p_result", type_=LargeBinary),
        size_bytes=bindparam("p_size", type_=Integer),
        updated_at=bindparam("p_now", type_=_TASKS.c.updated_at.type),  # type: ignore[attr-defined]
    )
)


def _locked_task(session: Session, task_id: str, player_id: str | None = None) -> TaskRow:
    """The task (a detached row: change it with statements, not the session), locked FOR
    UPDATE after its player's ledger lock; NOT_FOUND when missing. `player_id`: the player
    the caller expects (a Commit's, whose lock the batch took already: then the owner is not
    looked up first; the caller checks that the task is that player's)."""
    if player_id is None or player_id not in _locks_held(session):
        player_id = _owner_locked(session, (_TASK_OWNER, _TASK_OWNER_LOCKING), task_id)
    if player_id is not None:
        found = _TASK_FOR_UPDATE.execute(session, {"task_id": task_id}).first()
        if found is not None:
            return _task_row(found)
    raise NotFound(f"no task {task_id!r} (it may have finished and been evicted)")


def _check_owner(actual: str, player_id: str | None, what: str) -> None:
    if player_id is not None and actual != player_id:
        raise InvalidArgument(
            f"{what} belongs to another player, not {player_id!r}; a batch concerns one player"
        )


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
) -> TaskRow:
    """Moves a task along a valid edge (see _MOVES); a final result only with a terminal state.

    `player_id`, when given, must own the task (Commit). NOT_FOUND for a missing task;
    FAILED_PRECONDITION for an invalid move or an `expected_state` that does not hold;
    STORAGE_FULL when the result does not fit the player's bound.
    """
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
    row = _locked_task(session, task_id, player_id)
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
    size = task_size(row.task_id, row.player_id, row.module_id, row.event_key, row.input, encoded)
    if size > row.size_bytes:
        _make_room_for_tasks(
            session, bounds, row.player_id, 0, size - row.size_bytes, exclude_seq=row.seq
        )
    _TASK_MOVE.execute(
        session,
        {"p_seq": row.seq, "p_state": target, "p_result": encoded, "p_size": size, "p_now": now},
    )
    row.state = target
    row.result = encoded
    row.size_bytes = size
    row.updated_at = now
    return row


# -- receipts ----------------------------------------------------------------------------------


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


_RECEIPTS = ReceiptRow.__table__
_RECEIPT_COLUMNS = tuple(_RECEIPTS.c)  # type: ignore[attr-defined]


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
    def of(cls, row) -> StoredReceipt:  # type: ignore[no-untyped-def]
        return cls(**{column.name: getattr(row, column.name) for column in _RECEIPT_COLUMNS})


def _param(name: str, type_):  # type: ignore[no-untyped-def]
    return bindparam(name, type_=type_)


def _record_fast() -> FastStatement:
    """INSERT ... SELECT that records a new step in one statement when nothing stands in the
    way: the task is the player's and unfinished, the step is new and the receipt fits the
    ledger without eviction. It inserts nothing otherwise, and `record_step` then works out
    why the long way (same transaction, same lock)."""
    player = _param("p_player", String)
    ledger = (
        select(
            func.count().label("entries"),
            func.coalesce(func.sum(ReceiptRow.size_bytes), 0).label("bytes"),
        )
        .where(ReceiptRow.player_id == player)
        .subquery()
    )
    size = _param("p_size", Integer)
    now = _param("p_now", DateTime(timezone=True))
    rows = (
        select(
            _param("p_step", String),
            TaskRow.task_id,
            TaskRow.player_id,
            _param("p_position", BigInteger),
            _param("p_tool", String),
            literal(STEP_RUNNING, String),
            null(),
            literal("", String),
            size,
            now,
            now,
        )
        .select_from(TaskRow)
        .join(ledger, true())
        .where(
            TaskRow.task_id == _param("p_task", String),
            TaskRow.player_id == player,
            # Constants in the SQL: an IN list of parameters is expanded on every execution.
            TaskRow.state.in_([literal_column(f"'{name}'") for name in sorted(RECOVERABLE)]),
            ~exists().where(ReceiptRow.step_id == _param("p_step", String)),
            ledger.c.entries + 1 <= _param("p_max_entries", Integer),
            ledger.c.bytes + size <= _param("p_max_bytes", BigInteger),
        )
    )
    columns = ["step_id", "task_id", "player_id", "position", "tool", "state", "result"]
    columns += ["codec_id", "size_bytes", "created_at", "updated_at"]
    return FastStatement(insert(_RECEIPTS).from_select(columns, rows))


def _complete_fast() -> FastStatement:
    """UPDATE ... RETURNING that completes a RUNNING step in one statement when its result
    fits the ledger without eviction; it changes nothing otherwise, and `complete_step` then
    works out why the long way. A RUNNING receipt holds no result and no codec (see
    record_step), so its size grows by exactly the codec id's and the result's bytes."""
    player = _param("p_player", String)
    grows = _param("p_grows", Integer)
    ledger_bytes = (
        select(func.coalesce(func.sum(ReceiptRow.size_bytes), 0))
        .where(ReceiptRow.player_id == player)
        .scalar_subquery()
    )
    return FastStatement(
        update(_RECEIPTS)
        .where(
            ReceiptRow.step_id == _param("p_step", String),
            ReceiptRow.player_id == player,
            ReceiptRow.tool == _param("p_tool", String),
            ReceiptRow.state == STEP_RUNNING,
            ReceiptRow.codec_id == "",
            ReceiptRow.result.is_(None),
            ledger_bytes + grows <= _param("p_max_bytes", BigInteger),
        )
        .values(
            state=STEP_DONE,
            result=_param("p_result", LargeBinary),
            codec_id=_param("p_codec", String),
            size_bytes=ReceiptRow.size_bytes + grows,
            updated_at=_param("p_now", DateTime(timezone=True)),
        )
        .returning(*_RECEIPT_COLUMNS)
    )


_RECORD_FAST = _record_fast()
_COMPLETE_FAST = _complete_fast()


def _check_record(step_id: str, task_id: str, position: int, tool: str) -> None:
    _check_id(step_id, "step_id")
    _check_id(task_id, "task_id", MAX_TASK_ID)
    _check_id(tool, "tool")
    if not 0 <= position < 2**32:
        raise InvalidArgument(f"position must be between 0 and {2**32 - 1}")


def _record_params(
    bounds: JournalBounds,
    now: dt.datetime,
    step_id: str,
    task_id: str,
    player_id: str,
    position: int,
    tool: str,
    size: int,
) -> dict[str, object]:
    """The parameters of _RECORD_FAST."""
    return {
        "p_step": step_id,
        "p_task": task_id,
        "p_player": player_id,
        "p_position": position,
        "p_tool": tool,
        "p_size": size,
        "p_now": now,
        "p_max_entries": bounds.receipt_max_entries,
        "p_max_bytes": bounds.receipt_max_bytes,
    }


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


def _complete_params(
    bounds: JournalBounds,
    now: dt.datetime,
    step_id: str,
    player_id: str,
    tool: str,
    result: bytes,
    codec_id: str,
) -> dict[str, object]:
    """The parameters of _COMPLETE_FAST."""
    return {
        "p_step": step_id,
        "p_player": player_id,
        "p_tool": tool,
        "p_grows": len(codec_id.encode()) + len(result),
        "p_max_bytes": bounds.receipt_max_bytes,
        "p_result": result,
        "p_codec": codec_id,
        "p_now": now,
    }


def _owner_queries(column, key):  # type: ignore[no-untyped-def]
    """The owner of the row whose `key` is :p_key: plainly, and (PostgreSQL) with the owner's
    ledger lock taken in the same statement, one round trip instead of two."""
    where = key == _param("p_key", String)
    lock = func.pg_advisory_xact_lock(
        func.hashtextextended(literal(_player_lock_key(""), String) + column, 0)
    ).is_(None)
    return FastStatement(select(column).where(where)), FastStatement(
        select(column, lock).where(where)
    )


_TASK_OWNER, _TASK_OWNER_LOCKING = _owner_queries(TaskRow.player_id, TaskRow.task_id)
_STEP_OWNER, _STEP_OWNER_LOCKING = _owner_queries(ReceiptRow.player_id, ReceiptRow.step_id)


def _owner_locked(
    session: Session, queries: tuple[FastStatement, FastStatement], key: str
) -> str | None:
    """The player owning the task or receipt `key`, with the player's ledger lock held (see
    _lock_player); None when there is no such row (and no lock is taken)."""
    plain, locking = queries
    if session.get_bind().dialect.name != "postgresql":
        row = plain.execute(session, {"p_key": key}).first()
        return None if row is None else row[0]
    row = locking.execute(session, {"p_key": key}).first()
    if row is None:
        return None
    _locks_held(session).add(row[0])
    return row[0]


def _find_receipt(session: Session, step_id: str) -> StoredReceipt | None:
    row = (
        session.connection()
        .execute(select(*_RECEIPT_COLUMNS).where(ReceiptRow.step_id == step_id))
        .one_or_none()
    )
    return None if row is None else StoredReceipt.of(row)


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
) -> tuple[StoredReceipt, bool]:
    """Records a step's intent (RUNNING). Returns (receipt, created); an existing receipt of
    the same task, position and tool comes back with created False.

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
            raise NotFound(f"no task {task_id!r} (it may have finished and been evicted)")
    # Under the player's lock, one statement reads the rest: the receipt if it exists already
    # (an earlier or concurrent recording), the task and the player's receipt ledger.
    _lock_player(session, owner)
    size = receipt_size(step_id, task_id, owner, tool, "", None)
    if size <= bounds.receipt_max_bytes:
        inserted = _RECORD_FAST.execute(
            session, _record_params(bounds, now, step_id, task_id, owner, position, tool, size)
        )
        if inserted.rowcount == 1:
            return StoredReceipt(
                seq=None,
                step_id=step_id,
                task_id=task_id,
                player_id=owner,
                position=position,
                tool=tool,
                state=STEP_RUNNING,
                result=None,
                codec_id="",
                size_bytes=size,
                created_at=now,
                updated_at=now,
            ), True
    ledger = _ledger_query(owner).subquery()
    found = connection.execute(
        select(
            select(ReceiptRow.seq)
            .where(ReceiptRow.step_id == step_id)
            .scalar_subquery()
            .label("existing"),
            TaskRow.player_id,
            TaskRow.state,
            ledger.c.ledger_count,
            ledger.c.ledger_bytes,
        )
        .select_from(ledger)
        .outerjoin(TaskRow, TaskRow.task_id == task_id)
    ).one()
    if found.existing is not None:
        existing = _find_receipt(session, step_id)
        assert existing is not None
        _check_same_step(existing, task_id, position, tool, player_id)
        return existing, False
    if found.state is None:
        raise NotFound(f"no task {task_id!r} (it may have finished and been evicted)")
    _check_owner(found.player_id, player_id, f"task {task_id!r}")
    state = found.state
    if state not in _TASK_STATES:
        log.error("task %s has unknown stored state %r", task_id, state)
        raise ServiceError(
            f"task {task_id} has an unknown stored state {state!r}; it is left as it is "
            "and not run again (was it written by a newer version of the storage service?)"
        )
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
    receipt = StoredReceipt(
        seq=None,
        step_id=step_id,
        task_id=task_id,
        player_id=found.player_id,
        position=position,
        tool=tool,
        state=STEP_RUNNING,
        result=None,
        codec_id="",
        size_bytes=size,
        created_at=now,
        updated_at=now,
    )
    values = dataclasses.asdict(receipt)
    del values["seq"]
    connection.execute(insert(_RECEIPTS), values)
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
        _lock_player(session, owner)
        done = _COMPLETE_FAST.execute(
            session, _complete_params(bounds, now, step_id, owner, tool, result, codec_id)
        ).first()
        if done is not None:
            return StoredReceipt(*done)
        # The receipt, locked, with the bytes of the player's receipt ledger.
        found = connection.execute(
            select(
                *_RECEIPT_COLUMNS,
                _ledger_query(owner)
                .with_only_columns(func.coalesce(func.sum(ReceiptRow.size_bytes), 0))
                .scalar_subquery()
                .label("ledger_bytes"),
            )
            .where(ReceiptRow.step_id == step_id)
            .with_for_update(of=_RECEIPTS)
        ).one_or_none()
    if found is None:
        raise NotFound(f"no receipt for step {step_id!r}; record the step before completing it")
    row = StoredReceipt.of(found)
    _check_owner(row.player_id, player_id, f"step {step_id!r}")
    state = _stored_step_state(row)
    if row.tool != tool:
        raise FailedPrecondition(f"step {step_id} was recorded for tool {row.tool!r}, not {tool!r}")
    if state == STEP_DONE:
        if (row.result or b"") == result and row.codec_id == codec_id:
            return row
        raise FailedPrecondition(
            f"step {step_id} is already DONE with a different result; a step's result is "
            "stored once and replayed, never replaced"
        )
    size = receipt_size(row.step_id, row.task_id, row.player_id, row.tool, codec_id, result)
    if size > row.size_bytes:
        # The count does not matter when nothing is added: only the bytes are checked.
        _make_room_for_receipts(
            session,
            bounds,
            row.player_id,
            0,
            size - row.size_bytes,
            exclude_seq=row.seq,
            ledger=(0, found.ledger_bytes),
        )
    row.state = STEP_DONE
    row.result = result
    row.codec_id = codec_id
    row.size_bytes = size
    row.updated_at = now
    connection.execute(
        update(_RECEIPTS)
        .where(ReceiptRow.seq == row.seq)
        .values(state=STEP_DONE, result=result, codec_id=codec_id, size_bytes=size, updated_at=now)
    )
    return row


# -- page tokens -------------------------------------------------------------------------------


def _encode_token(seq: int) -> str:
    return base64.urlsafe_b64encode(f"t{seq}".encode()).decode()


def _decode_token(token: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(token.encode()).decode()
        digits = raw[1:]
        if not (raw.startswith("t") and digits.isascii() and digits.isdigit()):
            raise ValueError
        seq = int(digits)
        if not 0 < seq < 2**63:
            raise ValueError
        return seq
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument(
            "page_token is malformed; pass the next_page_token of a previous response unchanged"
        ) from None


# -- commit ------------------------------------------------------------------------------------

_OPERATIONS = "check, put, delete, transition, receipt or usage"


def _validate_batch(request: journal_pb2.CommitRequest) -> list[str]:
    """Checks a batch; returns the kind of each of its operations."""
    _check_id(request.request_id, "request_id")
    check_player_id(request.player_id)
    if not request.operations:
        raise InvalidArgument("operations must hold at least one operation")
    if len(request.operations) > MAX_OPERATIONS:
        raise InvalidArgument(
            f"operations holds {len(request.operations)} operations; a batch may hold at most "
            f"{MAX_OPERATIONS}"
        )
    kinds = []
    for index, operation in enumerate(request.operations):
        kind = operation.WhichOneof("op")
        if kind is None:
            raise InvalidArgument(f"operations[{index}] has no operation; set one of {_OPERATIONS}")
        kinds.append(kind)
        if kind in ("check", "put", "delete"):
            key = getattr(operation, kind).key
            if key.player_id != request.player_id:
                raise InvalidArgument(
                    f"operations[{index}].{kind}.key.player_id {key.player_id!r} is not the "
                    f"batch's player_id {request.player_id!r}; a batch concerns one player"
                )
    if request.HasField("fence"):
        _check_id(request.fence.lease_name, "fence.lease_name")
        _check_token(request.fence.token, "fence.token")
    return kinds


def _digest(request: journal_pb2.CommitRequest) -> bytes:
    content = hashlib.sha256(request.player_id.encode())
    for operation in request.operations:
        encoded = operation.SerializeToString(deterministic=True)
        content.update(len(encoded).to_bytes(8, "big"))
        content.update(encoded)
    return content.digest()


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A Commit request that passed validation, with what applying it needs."""

    request: journal_pb2.CommitRequest
    locks_player: bool
    """Whether it holds receipt or transition operations (they take the player's lock)."""
    digest: bytes
    receipts: tuple[journal_pb2.ReceiptWrite, ...] | None
    """Its receipt writes when it holds nothing else (such a batch may be sent ahead)."""

    @classmethod
    def of(cls, request: journal_pb2.CommitRequest) -> _Batch:
        """Validates `request`; INVALID_ARGUMENT when it is not a batch that may be applied."""
        kinds = _validate_batch(request)
        receipts = None
        if all(kind == "receipt" for kind in kinds):
            receipts = tuple(operation.receipt for operation in request.operations)
        locks_player = any(kind in ("receipt", "transition") for kind in kinds)
        return cls(request, locks_player, _digest(request), receipts)


def _batch_values(batch: _Batch, now: dt.datetime) -> dict[str, object]:
    """The batch's row, its response empty until one with versions is known."""
    request = batch.request
    return {
        "player_id": request.player_id,
        "request_id": request.request_id,
        "digest": batch.digest,
        "response": b"",
        "created_at": now,
    }


def _apply_operation(
    session: Session,
    bounds: JournalBounds,
    now: dt.datetime,
    request: journal_pb2.CommitRequest,
    index: int,
    versions: list[int],
) -> None:
    """Applies operations[index], its errors naming it."""
    operation = request.operations[index]
    kind = operation.WhichOneof("op")
    assert kind is not None
    try:
        _apply(session, bounds, now, request.player_id, operation, kind, versions)
    except ServiceError as error:
        raise type(error)(f"operations[{index}] ({kind}): {error.message}") from error


# The enum numbers as plain ints: each lookup on the enum wrapper is a Python __getattr__.
_SS_RUNNING = int(SS.STEP_STATE_RUNNING)
_SS_DONE = int(SS.STEP_STATE_DONE)


def _receipt_fast(
    bounds: JournalBounds, now: dt.datetime, player_id: str, write: journal_pb2.ReceiptWrite
) -> tuple[FastStatement, dict[str, object]] | None:
    """The one statement that applies `write` when nothing stands in the way (_RECORD_FAST,
    _COMPLETE_FAST); None when the write is invalid or too large for it (the long way then
    says why, or makes room)."""
    try:
        if write.state == _SS_RUNNING and not (write.result or write.codec_id):
            _check_record(write.step_id, write.task_id, write.position, write.tool)
            size = receipt_size(write.step_id, write.task_id, player_id, write.tool, "", None)
            if size > bounds.receipt_max_bytes:
                return None
            params = _record_params(
                bounds, now, write.step_id, write.task_id, player_id, write.position, write.tool,
                size,
            )  # fmt: skip
            return _RECORD_FAST, params
        if write.state == _SS_DONE:
            _check_complete(bounds, write.step_id, write.tool, write.result, write.codec_id)
            params = _complete_params(
                bounds, now, write.step_id, player_id, write.tool, write.result, write.codec_id
            )
            return _COMPLETE_FAST, params
    except ServiceError:
        pass
    return None


def _receipt_applied(write: journal_pb2.ReceiptWrite, result: FastResult) -> bool:
    """Whether _receipt_fast's statement applied the write (else it changed nothing)."""
    if write.state == _SS_RUNNING:
        return result.rowcount == 1
    return result.first() is not None


def _fence_holds(
    found: tuple[object, ...] | None, fence: journal_pb2.Fence, now: dt.datetime
) -> bool:
    """Whether _FENCE_QUERY's row says `fence` holds (check_fence says why it does not)."""
    if found is None:
        return False
    row = _FencedLease(*found)  # type: ignore[arg-type]
    return row.owner is not None and row.token == fence.token and _live(row, now)


def _apply(
    session: Session,
    bounds: JournalBounds,
    now: dt.datetime,
    player_id: str,
    operation: journal_pb2.CommitOperation,
    kind: str,
    versions: list[int],
) -> None:
    if kind == "check":
        check_version(session, operation.check.key, operation.check.expected_version)
    elif kind == "put":
        put = operation.put
        versions.append(
            put_document(
                session, put.key, put.expected_version, put.data, put.codec_id,
                bounds.max_document_bytes,
            )
        )  # fmt: skip
    elif kind == "delete":
        delete_document(session, operation.delete.key, operation.delete.expected_version)
        versions.append(0)
    elif kind == "transition":
        move = operation.transition
        transition_task(
            session,
            bounds,
            now,
            task_id=move.task_id,
            state=move.state,
            expected_state=move.expected_state,
            result=move.result if move.HasField("result") else None,
            player_id=player_id,
        )
    elif kind == "receipt":
        write = operation.receipt
        if write.state == SS.STEP_STATE_RUNNING:
            if write.result or write.codec_id:
                raise InvalidArgument("result and codec_id are for DONE; RUNNING records intent")
            record_step(
                session,
                bounds,
                now,
                step_id=write.step_id,
                task_id=write.task_id,
                position=write.position,
                tool=write.tool,
                player_id=player_id,
            )
        elif write.state == SS.STEP_STATE_DONE:
            complete_step(
                session,
                bounds,
                now,
                step_id=write.step_id,
                tool=write.tool,
                result=write.result,
                codec_id=write.codec_id,
                player_id=player_id,
            )
        else:
            raise InvalidArgument(
                f"state must be STEP_STATE_RUNNING (record intent) or STEP_STATE_DONE (store "
                f"the result), got {write.state}"
            )
    else:  # usage
        add_usage(session, player_id, operation.usage)


# -- the store ---------------------------------------------------------------------------------


# INSERT ... ON CONFLICT DO NOTHING of a batch's row, built once; its row count (1: inserted,
# 0: the batch was there) tells whether this attempt applies the batch.
_BATCHES = BatchRow.__table__
_BATCH_COLUMNS = ["player_id", "request_id", "digest", "response", "created_at"]
_BATCH_INSERT_SQLITE = FastStatement(
    sqlite_insert(_BATCHES).on_conflict_do_nothing(), column_keys=_BATCH_COLUMNS
)
_BATCH_INSERT_POSTGRESQL = FastStatement(
    postgresql_insert(_BATCHES).on_conflict_do_nothing(), column_keys=_BATCH_COLUMNS
)
_BATCH_INSERT_LOCKING = FastStatement(
    postgresql_insert(_BATCHES)
    .on_conflict_do_nothing()
    .returning(
        func.pg_advisory_xact_lock(
            func.hashtextextended(bindparam("p_lock_key", type_=String), 0)
        ).is_(None)
    ),
    column_keys=_BATCH_COLUMNS,
)


# The rows of a group's batches in one statement (PostgreSQL): each inserted row returns its
# key, with its player's ledger lock taken (as _BATCH_INSERT_LOCKING does for one row).
_BATCH_ROWS_MANY = FastStatement(
    text(
        f"""
INSERT INTO journal_batches (player_id, request_id, digest, response, created_at)
SELECT v.player_id, v.request_id, v.digest, ''::bytea, :now
FROM unnest(:players, :requests, :digests) AS v(player_id, request_id, digest)
ON CONFLICT DO NOTHING
RETURNING player_id, request_id,
          pg_advisory_xact_lock(hashtextextended('{_player_lock_key("")}' || player_id, 0))
          IS NULL"""
    )
    .bindparams(
        bindparam("players", type_=ARRAY(String)),
        bindparam("requests", type_=ARRAY(String)),
        bindparam("digests", type_=ARRAY(LargeBinary)),
        bindparam("now", type_=DateTime(timezone=True)),
    )
    .columns(
        _BATCHES.c.player_id,  # type: ignore[attr-defined]
        _BATCHES.c.request_id,  # type: ignore[attr-defined]
        literal_column("locked", Boolean),
    )
)


class _BatchRows:
    """The rows of the batches of a group, sent ahead: one statement on PostgreSQL, one each
    on SQLite (where each runs as it is sent, so fewer statements would save little)."""

    def __init__(
        self, session: Session, batches: Sequence[_Batch], now: dt.datetime, postgresql: bool
    ) -> None:
        self._inserted: set[tuple[str, str]] | None = None
        self._each: dict[tuple[str, str], Sent] = {}
        self._all: Sent | None = None
        if postgresql:
            params: dict[str, object] = {
                "players": [batch.request.player_id for batch in batches],
                "requests": [batch.request.request_id for batch in batches],
                "digests": [batch.digest for batch in batches],
                "now": now,
            }
            self._all = _BATCH_ROWS_MANY.send(session, params)
        else:
            for batch in batches:
                key = (batch.request.player_id, batch.request.request_id)
                self._each[key] = _BATCH_INSERT_SQLITE.send(session, _batch_values(batch, now))

    def inserted(self, batch: _Batch) -> bool:
        """Whether the batch's row was inserted now (else it was there: a replay)."""
        key = (batch.request.player_id, batch.request.request_id)
        if self._all is None:
            return self._each[key].result().rowcount == 1
        if self._inserted is None:
            self._inserted = {(player, request) for player, request, _ in self._all.result().rows}
        return key in self._inserted


# -- a group's receipt writes together (PostgreSQL) ----------------------------------------------

# psycopg waits on the socket after every statement it queues in a pipeline, and the writer
# thread gives up the interpreter lock for each wait: with the event loop busy, getting it
# back cost more than the statement (a group of 13 receipt Commits spent 3.5 ms queueing 15
# statements, 1 ms of it CPU). So on PostgreSQL the receipt writes of a group go as one
# statement per chunk, over arrays (unnest), each row checked exactly as _RECORD_FAST or
# _COMPLETE_FAST checks its one row. A chunk holds at most one write per player and per step
# id, so no row sees, or should have seen, another's effect (the ledgers are per player, a
# step id is one receipt), and the statement's two parts, which see one snapshot, need no
# order between them. Both are planned at every
# execution: over an array the generic plan, made once while the tables are small, joins by
# scanning them whole (seen: PostgreSQL's CPU per Commit doubled as a bench's tables grew).
_RECEIPT_STATES = ", ".join(f"'{name}'" for name in sorted(RECOVERABLE))
_RECEIPTS_MANY = FastStatement(
    text(
        f"""
WITH recorded AS (
    INSERT INTO journal_receipts (step_id, task_id, player_id, position, tool, state, result,
                                  codec_id, size_bytes, created_at, updated_at)
    SELECT v.step_id, t.task_id, t.player_id, v.position, v.tool, '{STEP_RUNNING}', NULL, '',
           v.size_bytes, :now, :now
    FROM unnest(:r_steps, :r_tasks, :r_players, :r_positions, :r_tools, :r_sizes)
         AS v(step_id, task_id, player_id, position, tool, size_bytes)
    JOIN journal_tasks AS t ON t.task_id = v.task_id AND t.player_id = v.player_id
    CROSS JOIN LATERAL (
        SELECT count(*) AS entries, coalesce(sum(r.size_bytes), 0) AS bytes
        FROM journal_receipts AS r WHERE r.player_id = v.player_id
    ) AS ledger
    WHERE t.state IN ({_RECEIPT_STATES})
      AND NOT EXISTS (SELECT 1 FROM journal_receipts AS e WHERE e.step_id = v.step_id)
      AND ledger.entries + 1 <= :max_entries
      AND ledger.bytes + v.size_bytes <= :max_bytes
    RETURNING step_id
), completed AS (
    UPDATE journal_receipts AS r
    SET state = '{STEP_DONE}', result = v.result, codec_id = v.codec_id,
        size_bytes = r.size_bytes + v.grows, updated_at = :now
    FROM unnest(:c_steps, :c_players, :c_tools, :c_grows, :c_results, :c_codecs)
         AS v(step_id, player_id, tool, grows, result, codec_id)
    WHERE r.step_id = v.step_id AND r.player_id = v.player_id AND r.tool = v.tool
      AND r.state = '{STEP_RUNNING}' AND r.codec_id = '' AND r.result IS NULL
      AND (SELECT coalesce(sum(x.size_bytes), 0) FROM journal_receipts AS x
           WHERE x.player_id = v.player_id) + v.grows <= :max_bytes
    RETURNING r.step_id
)
SELECT step_id FROM recorded UNION ALL SELECT step_id FROM completed"""
    )
    .bindparams(
        bindparam("r_steps", type_=ARRAY(String)),
        bindparam("r_tasks", type_=ARRAY(String)),
        bindparam("r_players", type_=ARRAY(String)),
        bindparam("r_positions", type_=ARRAY(BigInteger)),
        bindparam("r_tools", type_=ARRAY(String)),
        bindparam("r_sizes", type_=ARRAY(Integer)),
        bindparam("c_steps", type_=ARRAY(String)),
        bindparam("c_players", type_=ARRAY(String)),
        bindparam("c_tools", type_=ARRAY(String)),
        bindparam("c_grows", type_=ARRAY(Integer)),
        bindparam("c_results", type_=ARRAY(LargeBinary)),
        bindparam("c_codecs", type_=ARRAY(String)),
        bindparam("now", type_=DateTime(timezone=True)),
        bindparam("max_entries", type_=Integer),
        bindparam("max_bytes", type_=BigInteger),
    )
    .columns(_RECEIPTS.c.step_id),  # type: ignore[attr-defined]
    planned_each_time=True,
)
_FENCES_QUERY = FastStatement(
    select(_LEASES.c.name, _LEASES.c.owner, _LEASES.c.token, _LEASES.c.expires_at)  # type: ignore[attr-defined]
    .where(_LEASES.c.name == func.any(bindparam("names", type_=ARRAY(String))))  # type: ignore[attr-defined]
    .with_for_update(read=True)
)


class _Applied:
    """The step ids a combined statement changed, read once its result came."""

    __slots__ = ("_sent", "_steps")

    def __init__(self, sent: Sent) -> None:
        self._sent = sent
        self._steps: set[str] | None = None

    def __contains__(self, step_id: str) -> bool:
        if self._steps is None:
            self._steps = {row[0] for row in self._sent.result().rows}
        return step_id in self._steps


class _ReceiptChunks:
    """The receipt writes of a group, sent as one _RECEIPTS_MANY per chunk (see above);
    `applied(i)` is whether the i-th write added applied."""

    def __init__(self, bounds: JournalBounds, now: dt.datetime) -> None:
        self._bounds = bounds
        self._now = now
        self._chunks: list[tuple[list[dict[str, object]], list[dict[str, object]]]] = []
        self._seen: set[str] = set()
        self._where: list[tuple[int, str]] = []  # (chunk, step id) of each write
        self._sent: list[_Applied] = []

    def add(self, statement: FastStatement, params: dict[str, object]) -> int:
        player, step = f"p:{params['p_player']}", f"s:{params['p_step']}"
        if not self._chunks or player in self._seen or step in self._seen:
            self._chunks.append(([], []))
            self._seen = set()
        self._seen.update((player, step))
        self._chunks[-1][0 if statement is _RECORD_FAST else 1].append(params)
        self._where.append((len(self._chunks) - 1, str(params["p_step"])))
        return len(self._where) - 1

    def send(self, session: Session) -> None:
        for records, completes in self._chunks:
            params: dict[str, object] = {
                "r_steps": [row["p_step"] for row in records],
                "r_tasks": [row["p_task"] for row in records],
                "r_players": [row["p_player"] for row in records],
                "r_positions": [row["p_position"] for row in records],
                "r_tools": [row["p_tool"] for row in records],
                "r_sizes": [row["p_size"] for row in records],
                "c_steps": [row["p_step"] for row in completes],
                "c_players": [row["p_player"] for row in completes],
                "c_tools": [row["p_tool"] for row in completes],
                "c_grows": [row["p_grows"] for row in completes],
                "c_results": [row["p_result"] for row in completes],
                "c_codecs": [row["p_codec"] for row in completes],
                "now": self._now,
                "max_entries": self._bounds.receipt_max_entries,
                "max_bytes": self._bounds.receipt_max_bytes,
            }
            self._sent.append(_Applied(_RECEIPTS_MANY.send(session, params)))

    def applied(self, index: int) -> bool:
        chunk, step = self._where[index]
        return step in self._sent[chunk]


# -- claims ------------------------------------------------------------------------------------

# ClaimTasks runs whenever an event replica has a free worker, so it is a few statements on
# the driver's cursor (see fastsql) instead of an ORM load, a lease row per task and a flush
# (about 6 ms of Python per claim on PostgreSQL before, 3.7 ms on SQLite).
#
# Runnable: QUEUED (of the given players, when some are given), or RUNNING with no live
# lease (its replica died), oldest first. A claimed task becomes RUNNING, attempts + 1, and
# its lease `task:<task_id>` is taken for the claimer with a larger token: a leftover lease of
# a QUEUED task is taken over (its holder's fence goes stale), a RUNNING task's lease only
# when it is still free or expired when the upsert reaches it.
_RUNNABLE = """(
    (t.state = 'queued'{players})
    OR (t.state = 'running' AND NOT EXISTS (
        SELECT 1 FROM leases AS dead
        WHERE dead.name = 'task:' || t.task_id
          AND dead.owner IS NOT NULL AND dead.expires_at > :now))
)"""
_TAKE_LEASE = """ON CONFLICT (name) DO UPDATE SET
        owner = excluded.owner,
        token = {greatest}(l.token + 1, excluded.token),
        expires_at = excluded.expires_at"""
_CLAIMED_COLUMNS = ", ".join(f"t.{name}" for name in _TASK_COLUMN_NAMES)


def _claim_binds(*names: str, players=None):  # type: ignore[no-untyped-def]
    """The typed parameters `names` of a claim statement (SQLite stores times as text, so
    their type matters); `players` is the type of the player filter, when there is one."""
    when = _LEASES.c.expires_at.type  # type: ignore[attr-defined]
    types = {"now": when, "expires_at": when, "owner": String, "token": BigInteger}
    types |= {"max_tasks": Integer, "seqs": String}
    binds = [bindparam(name, type_=types[name]) for name in names]
    return binds + ([bindparam("players", type_=players)] if players is not None else [])


def _claim_postgresql(players: bool) -> FastStatement:
    """One statement: lock the oldest runnable tasks (skipping rows another replica is
    claiming), take their leases, mark them RUNNING. The lease upsert sees the newest lease
    row even where the statement's snapshot does not, so a RUNNING task another replica
    claimed just before is left alone (its lease is live again) and not marked here."""
    runnable = _RUNNABLE.format(players=" AND t.player_id = ANY(:players)" if players else "")
    sql = f"""
WITH picked AS (
    SELECT t.seq, t.task_id, t.state FROM journal_tasks AS t
    WHERE {runnable}
    ORDER BY t.seq LIMIT :max_tasks
    FOR UPDATE OF t SKIP LOCKED
), leased AS (
    INSERT INTO leases AS l (name, owner, token, expires_at)
    SELECT 'task:' || picked.task_id, :owner, :token, :expires_at FROM picked
    {_TAKE_LEASE.format(greatest="greatest")}
    WHERE l.owner IS NULL OR l.expires_at IS NULL OR l.expires_at <= :now
       OR l.name IN (SELECT 'task:' || queued.task_id FROM picked AS queued
                     WHERE queued.state = 'queued')
    RETURNING l.name, l.token, l.expires_at
), claimed AS (
    UPDATE journal_tasks AS t
    SET state = 'running', attempts = t.attempts + 1, updated_at = :now
    FROM picked JOIN leased ON leased.name = 'task:' || picked.task_id
    WHERE t.seq = picked.seq
    RETURNING {_CLAIMED_COLUMNS}, leased.token AS lease_token,
              leased.expires_at AS lease_expires_at
)
SELECT * FROM claimed ORDER BY seq"""
    binds = _claim_binds(
        "now",
        "expires_at",
        "owner",
        "token",
        "max_tasks",
        players=ARRAY(String) if players else None,
    )
    return FastStatement(
        text(sql)
        .bindparams(*binds)
        .columns(
            *_TASK_COLUMNS,
            literal_column("lease_token", BigInteger),
            literal_column("lease_expires_at", _LEASES.c.expires_at.type),  # type: ignore[attr-defined]
        )
    )


# SQLite runs one write transaction at a time (storage_service.db), so nothing can claim
# between its three statements: pick, take the leases, mark the tasks.
_PICK_SQLITE = {
    players: FastStatement(
        text(
            "SELECT t.seq FROM journal_tasks AS t WHERE "
            + _RUNNABLE.format(
                players=" AND t.player_id IN (SELECT value FROM json_each(:players))"
                if players
                else ""
            )
            + " ORDER BY t.seq LIMIT :max_tasks"
        )
        .bindparams(*_claim_binds("now", "max_tasks", players=String if players else None))
        .columns(_TASKS.c.seq)  # type: ignore[attr-defined]
    )
    for players in (False, True)
}
_LEASE_SQLITE = FastStatement(
    text(
        "INSERT INTO leases AS l (name, owner, token, expires_at) "
        "SELECT 'task:' || t.task_id, :owner, :token, :expires_at FROM journal_tasks AS t "
        "WHERE t.seq IN (SELECT value FROM json_each(:seqs)) "
        + _TAKE_LEASE.format(greatest="max")
        + " RETURNING name, token, expires_at"
    )
    .bindparams(*_claim_binds("owner", "token", "expires_at", "seqs"))
    .columns(_LEASES.c.name, _LEASES.c.token, _LEASES.c.expires_at)  # type: ignore[attr-defined]
)
_MARK_SQLITE = FastStatement(
    text(
        # SQLite's RETURNING names the table's columns bare, never through an alias.
        "UPDATE journal_tasks SET state = 'running', attempts = attempts + 1, updated_at = :now "
        "WHERE seq IN (SELECT value FROM json_each(:seqs)) "
        f"RETURNING {', '.join(_TASK_COLUMN_NAMES)}"
    )
    .bindparams(*_claim_binds("now", "seqs"))
    .columns(*_TASK_COLUMNS)
)
_CLAIM_POSTGRESQL = {players: _claim_postgresql(players) for players in (False, True)}


def claim_tasks(
    session: Session | Connection,
    now: dt.datetime,
    *,
    owner: str,
    max_tasks: int,
    lease_seconds: int,
    player_ids: Sequence[str],
) -> list[journal_pb2.TaskClaim]:
    """Claims up to `max_tasks` runnable tasks in the session's transaction (see above)."""
    players = sorted(set(player_ids))
    params: dict[str, object] = {
        "now": now,
        "expires_at": now + dt.timedelta(seconds=lease_seconds),
        "owner": owner,
        "token": _micros(now),
        "max_tasks": max_tasks,
    }
    if _dialect(session) == "postgresql":
        if players:
            params["players"] = players
        rows = _CLAIM_POSTGRESQL[bool(players)].execute(session, params).rows
    else:
        if players:
            params["players"] = json.dumps(players)
        picked = _PICK_SQLITE[bool(players)].execute(session, params).rows
        if not picked:
            return []
        params["seqs"] = json.dumps([row[0] for row in picked])
        leases = {
            name: (token, expires_at)
            for name, token, expires_at in _LEASE_SQLITE.execute(session, params).rows
        }
        rows = [
            (*row, *leases[f"task:{row[1]}"])
            for row in sorted(_MARK_SQLITE.execute(session, params).rows)
        ]
    claims = []
    width = len(_TASK_COLUMN_NAMES)
    for row in rows:
        task = _task_row(row[:width])
        lease = journal_pb2.Lease(name=f"task:{task.task_id}", owner=owner, token=row[width])
        lease.expires_at.FromDatetime(_aware(row[width + 1]))
        claims.append(journal_pb2.TaskClaim(task=task_message(task), lease=lease))
    return claims


class _OneStatement:
    """Where work that is a single statement runs (a lease taken, renewed or given back, a
    claim): on PostgreSQL a Core connection in autocommit, so the statement is its own
    transaction and costs one round trip instead of three (BEGIN, the statement, COMMIT;
    measured: acquire + release 3.5 -> 2.4 ms, the database's CPU for them halved), without
    an ORM session around it (measured in process: CPU for an acquire and a release
    0.9-1.5 -> 0.8 ms). SQLite keeps its sessions' transactions: its writers take
    turns at BEGIN (storage_service.db), and its claim takes three statements."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions
        bind = sessions.kw.get("bind")
        self._autocommit = (
            bind.execution_options(isolation_level="AUTOCOMMIT")
            if bind is not None and bind.dialect.name == "postgresql"
            else None
        )

    @contextlib.contextmanager
    def begin(self) -> Iterator[Session | Connection]:
        if self._autocommit is None:
            with self._sessions.begin() as session:
                yield session
            return
        with self._autocommit.connect() as connection:
            yield connection


def _dialect(target: Session | Connection) -> str:
    """The database's dialect name, for a session or a connection."""
    if isinstance(target, Connection):
        return target.dialect.name
    return target.get_bind().dialect.name


class JournalStore:
    """Tasks, receipts, leases and batches. Each method is one transaction, except the `*_in`
    methods and `commit_unit`, which do their work in a transaction the caller owns.

    Args:
        sessions: makes sessions on the storage engine.
        bounds: per-player bounds and size limits.
        clock: the time (UTC); tests pass their own to move it without sleeping.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        bounds: JournalBounds,
        clock: Callable[[], dt.datetime] = utc_now,
    ) -> None:
        self._sessions = sessions
        self._bounds = bounds
        self._clock = clock
        self._sender = _CommitSender(self)
        self._one_statement = _OneStatement(sessions)

    def _now(self) -> dt.datetime:
        now = self._clock()
        # Stored as UTC: SQLite keeps no offset, so every time written must be UTC already.
        return now.replace(tzinfo=dt.UTC) if now.tzinfo is None else now.astimezone(dt.UTC)

    # -- tasks ---------------------------------------------------------------------------------

    def create_task(
        self,
        player_id: str,
        module_id: str,
        input: struct_pb2.Struct | None,
        event_key: str,
        initial_state: int = TS.TASK_STATE_UNSPECIFIED,
    ) -> tuple[journal_pb2.EventTask, bool, int]:
        """(task, created, evicted); see the module function."""
        now = self._now()
        with self._sessions.begin() as session:
            row, created, evicted = create_task(
                session,
                self._bounds,
                now,
                player_id=player_id,
                module_id=module_id,
                input=input,
                event_key=event_key,
                initial_state=initial_state,
            )
            return task_message(row), created, evicted

    def get_task(self, task_id: str) -> journal_pb2.EventTask:
        _check_id(task_id, "task_id", MAX_TASK_ID)
        with self._sessions() as session:
            row = session.execute(
                select(TaskRow).where(TaskRow.task_id == task_id)
            ).scalar_one_or_none()
            if row is None:
                raise NotFound(f"no task {task_id!r} (it may have finished and been evicted)")
            return task_message(row)

    def list_tasks(
        self, player_id: str, states: Sequence[int] = (), page_size: int = 0, page_token: str = ""
    ) -> tuple[list[journal_pb2.EventTask], str]:
        """A page of the player's tasks, oldest first, and the token of the next page."""
        check_player_id(player_id)
        names = {_state_name(state, f"states[{i}]") for i, state in enumerate(states)}
        if page_size < 0:
            raise InvalidArgument("page_size must not be negative")
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        query = select(TaskRow).where(TaskRow.player_id == player_id)
        if names:
            query = query.where(TaskRow.state.in_(sorted(names)))
        if page_token:
            query = query.where(TaskRow.seq > _decode_token(page_token))
        with self._sessions() as session:
            rows = list(session.scalars(query.order_by(TaskRow.seq).limit(size + 1)))
            more = len(rows) > size
            rows = rows[:size]
            return [task_message(row) for row in rows], _encode_token(rows[-1].seq) if more else ""

    def claim_tasks(
        self, owner: str, max_tasks: int, lease_seconds: int, player_ids: Sequence[str] = ()
    ) -> list[journal_pb2.TaskClaim]:
        """Claims up to `max_tasks` runnable tasks, oldest first: QUEUED tasks (of
        `player_ids` when given) and RUNNING tasks no live lease protects (their replica
        died). Each becomes RUNNING, attempts + 1, under lease `task:<task_id>` for `owner`."""
        _check_id(owner, "owner")
        if not 1 <= max_tasks <= MAX_CLAIM:
            raise InvalidArgument(f"max_tasks must be between 1 and {MAX_CLAIM}, got {max_tasks}")
        _check_ttl(lease_seconds, "lease_seconds")
        if len(player_ids) > MAX_CLAIM_PLAYERS:
            raise InvalidArgument(f"player_ids may name at most {MAX_CLAIM_PLAYERS} players")
        for index, player_id in enumerate(player_ids):
            check_player_id(player_id, f"player_ids[{index}]")
        now = self._now()
        # One statement on PostgreSQL (see _OneStatement); three in a transaction on
        # SQLite.
        with self._one_statement.begin() as session:
            return claim_tasks(
                session,
                now,
                owner=owner,
                max_tasks=max_tasks,
                lease_seconds=lease_seconds,
                player_ids=player_ids,
            )

    def transaction(self, unit: Callable[[Session], T]) -> T:
        """Runs `unit` in a transaction of its own (see `storage_service.group_commit` for
        several in one)."""
        with self._sessions.begin() as session:
            return unit(session)

    def transition_task(
        self,
        task_id: str,
        state: int,
        expected_state: int = TS.TASK_STATE_UNSPECIFIED,
        result: common_pb2.AgentResult | None = None,
        fence: journal_pb2.Fence | None = None,
    ) -> journal_pb2.EventTask:
        return self.transaction(
            functools.partial(
                self.transition_task_in,
                task_id=task_id,
                state=state,
                expected_state=expected_state,
                result=result,
                fence=fence,
            )
        )

    def transition_task_in(
        self,
        session: Session,
        *,
        task_id: str,
        state: int,
        expected_state: int = TS.TASK_STATE_UNSPECIFIED,
        result: common_pb2.AgentResult | None = None,
        fence: journal_pb2.Fence | None = None,
    ) -> journal_pb2.EventTask:
        """`transition_task` inside the session's transaction."""
        now = self._now()
        check_fence(session, fence, now)
        row = transition_task(
            session,
            self._bounds,
            now,
            task_id=task_id,
            state=state,
            expected_state=expected_state,
            result=result,
        )
        return task_message(row)

    # -- receipts ------------------------------------------------------------------------------

    def record_step(
        self,
        step_id: str,
        task_id: str,
        position: int,
        tool: str,
        fence: journal_pb2.Fence | None = None,
    ) -> tuple[journal_pb2.StepReceipt, bool]:
        return self.transaction(
            functools.partial(
                self.record_step_in,
                step_id=step_id,
                task_id=task_id,
                position=position,
                tool=tool,
                fence=fence,
            )
        )

    def record_step_in(
        self,
        session: Session,
        *,
        step_id: str,
        task_id: str,
        position: int,
        tool: str,
        fence: journal_pb2.Fence | None = None,
        completed: Sequence[journal_pb2.CompletedStep] = (),
    ) -> tuple[journal_pb2.StepReceipt, bool]:
        """`record_step` inside the session's transaction; `completed` results of earlier
        steps of the task are stored first (DONE, as `complete_step` does)."""
        now = self._now()
        check_fence(session, fence, now)
        owner = None  # the task's player, once known (its ledger lock is held then)
        for index, step in enumerate(completed):
            done = complete_step(
                session,
                self._bounds,
                now,
                step_id=step.step_id,
                tool=step.tool,
                result=step.result,
                codec_id=step.codec_id,
            )
            if done.task_id != task_id:
                raise InvalidArgument(
                    f"completed[{index}]: step {step.step_id!r} belongs to task "
                    f"{done.task_id!r}, not {task_id!r}; a step's result travels only with "
                    "a write of its own task"
                )
            owner = done.player_id
        row, created = record_step(
            session,
            self._bounds,
            now,
            step_id=step_id,
            task_id=task_id,
            position=position,
            tool=tool,
            player_id=owner,
        )
        return receipt_message(row), created

    def complete_step(
        self,
        step_id: str,
        tool: str,
        result: bytes,
        codec_id: str,
        fence: journal_pb2.Fence | None = None,
    ) -> journal_pb2.StepReceipt:
        return self.transaction(
            functools.partial(
                self.complete_step_in,
                step_id=step_id,
                tool=tool,
                result=result,
                codec_id=codec_id,
                fence=fence,
            )
        )

    def complete_step_in(
        self,
        session: Session,
        *,
        step_id: str,
        tool: str,
        result: bytes,
        codec_id: str,
        fence: journal_pb2.Fence | None = None,
    ) -> journal_pb2.StepReceipt:
        """`complete_step` inside the session's transaction."""
        now = self._now()
        check_fence(session, fence, now)
        row = complete_step(
            session,
            self._bounds,
            now,
            step_id=step_id,
            tool=tool,
            result=result,
            codec_id=codec_id,
        )
        return receipt_message(row)

    def get_step(self, step_id: str, tool: str) -> journal_pb2.StepReceipt:
        """The receipt for replay; FAILED_PRECONDITION when it was recorded for another tool."""
        _check_id(step_id, "step_id")
        _check_id(tool, "tool")
        with self._sessions() as session:
            row = session.execute(
                select(ReceiptRow).where(ReceiptRow.step_id == step_id)
            ).scalar_one_or_none()
            if row is None:
                raise NotFound(f"no receipt for step {step_id!r}")
            if row.tool != tool:
                raise FailedPrecondition(
                    f"step {step_id} was recorded for tool {row.tool!r}; refusing to replay it "
                    f"for tool {tool!r}"
                )
            return receipt_message(row)

    # -- leases --------------------------------------------------------------------------------

    def acquire_lease(self, name: str, owner: str, ttl_seconds: int) -> journal_pb2.Lease:
        return self.take_lease(name, owner, ttl_seconds).lease

    def take_lease(
        self, name: str, owner: str, ttl_seconds: int
    ) -> journal_pb2.AcquireLeaseResponse:
        """`acquire_lease` with the token of the acquisition before (AcquireLease's answer)."""
        now = self._now()
        with self._one_statement.begin() as session:
            steps = acquire_steps(name, owner, ttl_seconds, now, _dialect(session) == "sqlite")
            return run_steps(steps, session)  # type: ignore[no-any-return]

    def renew_lease(self, name: str, owner: str, token: int, ttl_seconds: int) -> journal_pb2.Lease:
        """Extends a lease the caller holds (also after it expired, if nobody took it since)."""
        steps = renew_steps(name, owner, token, ttl_seconds, self._now())
        with self._one_statement.begin() as session:
            return run_steps(steps, session)  # type: ignore[no-any-return]

    def release_lease(self, name: str, owner: str, token: int) -> bool:
        """Gives a lease up; False when it was no longer the caller's. The token is kept."""
        steps = release_steps(name, owner, token)
        with self._one_statement.begin() as session:
            return run_steps(steps, session)  # type: ignore[no-any-return]

    def release_earlier_incarnations(self, name: str, incarnation: str) -> int:
        """Ends the leases of replica `name`'s earlier incarnations; answers how many (see the
        module function). One statement, in autocommit on PostgreSQL."""
        with self._one_statement.begin() as session:
            released = release_earlier_incarnations(session, name, incarnation)
        if released:
            log.info("released %d leases of earlier incarnations of replica %r", released, name)
        return released

    def now(self) -> dt.datetime:
        """The store's clock (tests move it)."""
        return self._now()

    # -- batches -------------------------------------------------------------------------------

    def commit(self, request: journal_pb2.CommitRequest) -> journal_pb2.CommitResponse:
        """Applies a batch atomically and once per (player_id, request_id).

        The batch's row is inserted first (INSERT ... ON CONFLICT DO NOTHING): a retry racing
        the first attempt waits for it on PostgreSQL, then finds the row and replays. Any
        failing operation rolls everything back, that row included, so a failed batch may be
        retried with the same request id.
        """
        return self.transaction(self.commit_unit(request))

    def commit_unit(
        self, request: journal_pb2.CommitRequest
    ) -> Callable[[Session], journal_pb2.CommitResponse]:
        """`commit` as work for a caller's transaction (a group: see
        storage_service.group_commit). The request is validated now: INVALID_ARGUMENT here
        costs no transaction."""
        batch = _Batch.of(request)
        if batch.receipts is not None:
            return _SendableCommit(self._sender, batch)
        return functools.partial(self._apply_batch, batch=batch)

    def commit_group(
        self, requests: Sequence[journal_pb2.CommitRequest]
    ) -> list[journal_pb2.CommitResponse | Exception]:
        """Applies several batches in one transaction, each with the outcome `commit` would
        have given it alone (see `storage_service.group_commit.run_group`); an invalid one is
        refused without reaching the database."""
        outcomes: list[journal_pb2.CommitResponse | Exception | None] = [None] * len(requests)
        units: dict[int, Callable[[Session], journal_pb2.CommitResponse]] = {}
        for index, request in enumerate(requests):
            try:
                units[index] = self.commit_unit(request)
            except ServiceError as error:
                outcomes[index] = error
        ran = run_group(self._sessions, list(units.values()))
        for index, outcome in zip(units, ran, strict=True):
            outcomes[index] = outcome
        return outcomes  # type: ignore[return-value]

    def _apply_batch(self, session: Session, *, batch: _Batch) -> journal_pb2.CommitResponse:
        """Applies one validated batch inside the session's current transaction."""
        request = batch.request
        now = self._now()
        values = _batch_values(batch, now)
        postgresql = session.get_bind().dialect.name == "postgresql"
        if postgresql and batch.locks_player:
            # The player's ledger lock, which the batch's receipt and task operations take
            # anyway, rides on the INSERT (one round trip less); it is evaluated only when
            # the row was inserted, after any racing attempt of the same batch committed.
            values["p_lock_key"] = _player_lock_key(request.player_id)
            applies = _BATCH_INSERT_LOCKING.execute(session, values).first() is not None
            if applies:
                _locks_held(session).add(request.player_id)
        else:
            inserted = (_BATCH_INSERT_POSTGRESQL if postgresql else _BATCH_INSERT_SQLITE).execute(
                session, values
            )
            applies = inserted.rowcount == 1
        if not applies:
            return self._replay(session, request, batch.digest)
        check_fence(session, request.fence if request.HasField("fence") else None, now)
        versions: list[int] = []
        for index in range(len(request.operations)):
            _apply_operation(session, self._bounds, now, request, index, versions)
        response = journal_pb2.CommitResponse(versions=versions)
        if not versions:  # the response is empty, as stored with the row already
            return response
        session.connection().execute(
            update(BatchRow)
            .where(
                BatchRow.player_id == request.player_id,
                BatchRow.request_id == request.request_id,
            )
            .values(response=response.SerializeToString())
        )
        return response

    def _send_batches(
        self, session: Session, batches: Sequence[_Batch]
    ) -> list[Callable[[], journal_pb2.CommitResponse] | None]:
        """Sends batches of receipt writes ahead (group_commit.Sender): first their rows,
        with their players' locks on PostgreSQL (_BatchRows), then their fences' reads and
        their writes' one-statement forms, in the order `_apply_batch` runs them: on
        PostgreSQL one fence query for the group and the writes in chunks (_ReceiptChunks),
        on SQLite a statement each. A row touches nothing a write or a fence reads, and a
        fence nothing a write touches, so sending every row first, then every fence, gives
        each batch the result it would have had in turn. None for a batch with a write that
        has no such form, and for a batch already in the group (it replays the first, the
        long way)."""
        now = self._now()
        plans: list[list[tuple[FastStatement, dict[str, object]]] | None] = []
        keys: set[tuple[str, str]] = set()
        for batch in batches:
            assert batch.receipts is not None
            player, key = (
                batch.request.player_id,
                (batch.request.player_id, batch.request.request_id),
            )
            fast = [_receipt_fast(self._bounds, now, player, write) for write in batch.receipts]
            if key in keys or any(plan is None for plan in fast):
                plans.append(None)
                continue
            keys.add(key)
            plans.append(fast)  # type: ignore[arg-type]
        sent = [batch for batch, plan in zip(batches, plans, strict=True) if plan is not None]
        if not sent:
            return [None] * len(batches)
        postgresql = session.get_bind().dialect.name == "postgresql"
        rows = _BatchRows(session, sent, now, postgresql)
        finishers: list[Callable[[], journal_pb2.CommitResponse] | None] = []
        if postgresql:
            # The fences in one statement, then the writes in chunks (_ReceiptChunks).
            names = sorted(
                {b.request.fence.lease_name for b in sent if b.request.HasField("fence")}
            )
            fences = _Fences(_FENCES_QUERY.send(session, {"names": names}) if names else None)
            chunks = _ReceiptChunks(self._bounds, now)
            indexes = [
                [chunks.add(statement, params) for statement, params in plan] if plan else None
                for plan in plans
            ]
            chunks.send(session)
            for batch, written in zip(batches, indexes, strict=True):
                if written is None:
                    finishers.append(None)
                    continue
                request = batch.request
                fence = (
                    functools.partial(fences.row, request.fence.lease_name)
                    if request.HasField("fence")
                    else None
                )
                applied = [functools.partial(chunks.applied, index) for index in written]
                finishers.append(
                    functools.partial(
                        self._finish_batch, session, batch, now, True, rows, fence, applied
                    )
                )
            return finishers
        for batch, plan in zip(batches, plans, strict=True):
            if plan is None:
                finishers.append(None)
                continue
            request = batch.request
            fenced = None
            if request.HasField("fence"):
                fenced = _FENCE_QUERY.send(session, {"name": request.fence.lease_name}).result
            checks = []
            for write, (statement, params) in zip(batch.receipts, plan, strict=True):  # type: ignore[arg-type]
                sent_write = statement.send(session, params)
                checks.append(functools.partial(_applied_alone, write, sent_write))
            finishers.append(
                functools.partial(
                    self._finish_batch,
                    session,
                    batch,
                    now,
                    False,
                    rows,
                    (lambda fenced=fenced: fenced().first()) if fenced is not None else None,
                    checks,
                )
            )
        return finishers

    def _finish_batch(
        self,
        session: Session,
        batch: _Batch,
        now: dt.datetime,
        postgresql: bool,
        rows: _BatchRows,
        fence_row: Callable[[], tuple[object, ...] | None] | None,
        applied: list[Callable[[], bool]],
    ) -> journal_pb2.CommitResponse:
        """The answer of a batch sent ahead, once its results came; NotApplied when what was
        sent may not stand (a retried batch, a stale fence, a write that did not apply with
        another sent after it): `_apply_batch` then runs it the long way. `fence_row` reads the
        fence's lease row, `applied[i]` says whether the i-th write applied."""
        request = batch.request
        assert batch.receipts is not None
        if not rows.inserted(batch):
            raise NotApplied  # the batch was there already: a replay
        if postgresql:
            _locks_held(session).add(request.player_id)
        if fence_row is not None and not _fence_holds(fence_row(), request.fence, now):
            raise NotApplied
        last = len(applied) - 1
        for index, write_applied in enumerate(applied):
            if write_applied():
                continue
            if index != last:
                raise NotApplied  # the writes after it ran already, as if it had applied
            # The last write goes on the long way (eviction, or the reason it is refused),
            # right where it would have run.
            _apply_operation(session, self._bounds, now, request, index, [])
        return journal_pb2.CommitResponse()

    @staticmethod
    def _replay(
        session: Session, request: journal_pb2.CommitRequest, digest: bytes
    ) -> journal_pb2.CommitResponse:
        row = session.get(BatchRow, (request.player_id, request.request_id))
        assert row is not None
        if row.digest != digest:
            raise InvalidArgument(
                f"request_id {request.request_id!r} was already used for a different batch; "
                "a retry must resend the same operations, a new batch needs a new request id"
            )
        response = journal_pb2.CommitResponse.FromString(row.response)
        response.replayed = True
        return response


def _applied_alone(write: journal_pb2.ReceiptWrite, sent: Sent) -> bool:
    return _receipt_applied(write, sent.result())


class _Fences:
    """The lease rows of a group's fences, read by one statement (None: no fences)."""

    __slots__ = ("_rows", "_sent")

    def __init__(self, sent: Sent | None) -> None:
        self._sent = sent
        self._rows: dict[str, tuple[object, ...]] | None = None

    def row(self, name: str) -> tuple[object, ...] | None:
        if self._rows is None:
            rows = self._sent.result().rows if self._sent is not None else []
            self._rows = {str(row[0]): row for row in rows}
        return self._rows.get(name)


class _CommitSender:
    """Sends the receipt batches of a group ahead together (storage_service.group_commit
    .Sender)."""

    __slots__ = ("_store",)

    def __init__(self, store: JournalStore) -> None:
        self._store = store

    def send(
        self, session: Session, units: Sequence[_SendableCommit]
    ) -> list[Callable[[], journal_pb2.CommitResponse] | None]:
        return self._store._send_batches(session, [unit.batch for unit in units])  # noqa: SLF001


class _SendableCommit:
    """`JournalStore.commit_unit` of a batch of receipt writes: a unit that can also be sent
    ahead with the rest of its group (storage_service.group_commit.SendableUnit)."""

    __slots__ = ("batch", "sender")

    def __init__(self, sender: _CommitSender, batch: _Batch) -> None:
        self.sender = sender
        self.batch = batch

    def __call__(self, session: Session) -> journal_pb2.CommitResponse:
        return self.sender._store._apply_batch(session, batch=self.batch)  # noqa: SLF001
