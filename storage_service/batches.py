"""Commit: one atomic, idempotent batch of document checks, puts and deletes, task moves,
receipt writes and usage increments.

A batch concerns one player and is applied all or nothing, once per (player, request id):
its row (`BatchRow`) is inserted first, INSERT ... ON CONFLICT DO NOTHING, so a retry racing
the first attempt waits for it on PostgreSQL, then finds the row and replays the stored
answer (a retry must carry the same operations: their digest is stored too). Any failing
operation rolls everything back, that row included, so a failed batch may be retried with the
same request id. Each operation is the same rule its own call applies (storage_service.tasks,
storage_service.receipts, storage_service.player_data); a group of receipt batches may also
be written together (storage_service.batch_groups).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib

from sqlalchemy import DateTime, LargeBinary, String, bindparam, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column
from system.storage.v1 import journal_pb2

from services.runtime.errors import InvalidArgument, ServiceError
from storage_service.db import Base, rowcount, table_of
from storage_service.dialect import INSERT, POSTGRESQL, SQLITE, advisory_lock, is_postgresql
from storage_service.journal_records import MAX_ID, SS, STEP_DONE, _check_id
from storage_service.leases import _check_token
from storage_service.ledgers import (
    JournalBounds,
    _locks_held,
    _player_lock_key,
    check_noted_fence,
)
from storage_service.player_data import (
    KEEP_ON_RESET,
    add_usage,
    check_version,
    delete_document,
    put_document,
)
from storage_service.receipts import Completion, complete_step, record_step
from storage_service.tasks import transition_task
from storage_service.validation import MAX_PLAYER_ID, check_player_id

__all__ = ["MAX_OPERATIONS", "BatchRow", "apply_batch"]

MAX_OPERATIONS = 256


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


# -- validation ------------------------------------------------------------------------------------

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
    """Its receipt writes when it holds nothing else but, maybe, a last `transition` (such a
    batch may be written together with others: storage_service.batch_groups)."""
    transition: journal_pb2.TaskTransition | None = None
    """Its last operation when that is a task's move and every other one a receipt write (an
    event task's final Commit: decision 0036)."""

    @classmethod
    def of(cls, request: journal_pb2.CommitRequest) -> _Batch:
        """Validates `request`; INVALID_ARGUMENT when it is not a batch that may be applied."""
        kinds = _validate_batch(request)
        receipts, transition = None, None
        writes = kinds[:-1] if kinds[-1] == "transition" else kinds
        if all(kind == "receipt" for kind in writes):
            receipts = tuple(operation.receipt for operation in request.operations[: len(writes)])
            if len(writes) < len(kinds):
                transition = request.operations[-1].transition
        locks_player = any(kind in ("receipt", "transition") for kind in kinds)
        return cls(request, locks_player, _digest(request), receipts, transition)


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
) -> int:
    """Applies operations[index], its errors naming it; returns how many operations it
    applied: 2 when a step's recording took the next operation, its completion, with it."""
    operation = request.operations[index]
    kind = operation.WhichOneof("op")
    assert kind is not None
    following = request.operations[index + 1] if index + 1 < len(request.operations) else None
    try:
        return _apply(session, bounds, now, request.player_id, operation, kind, versions, following)
    except ServiceError as error:
        raise type(error)(f"operations[{index}] ({kind}): {error.message}") from error


def _completion(following: journal_pb2.CommitOperation | None, step_id: str) -> Completion | None:
    """The completion of step `step_id` when it is the next operation: what the engine sends
    after the recording of a step it never recorded (decision 0036), written with it."""
    if following is None or following.WhichOneof("op") != "receipt":
        return None
    write = following.receipt
    if write.state != SS.STEP_STATE_DONE or write.step_id != step_id:
        return None
    return Completion(write.tool, write.result, write.codec_id)


def _apply(
    session: Session,
    bounds: JournalBounds,
    now: dt.datetime,
    player_id: str,
    operation: journal_pb2.CommitOperation,
    kind: str,
    versions: list[int],
    following: journal_pb2.CommitOperation | None,
) -> int:
    """Applies one operation (and, with a step's recording, its completion when that comes
    next: see _completion); returns how many it applied."""
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
            receipt, created = record_step(
                session,
                bounds,
                now,
                step_id=write.step_id,
                task_id=write.task_id,
                position=write.position,
                tool=write.tool,
                player_id=player_id,
                then=_completion(following, write.step_id),
            )
            if created and receipt.state == STEP_DONE:
                return 2
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
    return 1


# INSERT ... ON CONFLICT DO NOTHING of a batch's row, built once; its row count (1: inserted,
# 0: the batch was there) tells whether this attempt applies the batch.
_BATCHES = table_of(BatchRow)
_BATCH_INSERT_SQLITE = (
    INSERT[SQLITE](_BATCHES).on_conflict_do_nothing().execution_options(preserve_rowcount=True)
)
_BATCH_INSERT_POSTGRESQL = (
    INSERT[POSTGRESQL](_BATCHES).on_conflict_do_nothing().execution_options(preserve_rowcount=True)
)
_BATCH_INSERT_LOCKING = (
    INSERT[POSTGRESQL](_BATCHES)
    .on_conflict_do_nothing()
    .returning(advisory_lock(bindparam("p_lock_key", type_=String)).is_(None))
)


def apply_batch(
    session: Session, bounds: JournalBounds, now: dt.datetime, batch: _Batch
) -> journal_pb2.CommitResponse:
    """Applies one validated batch inside the session's current transaction."""
    request = batch.request
    values = _batch_values(batch, now)
    postgresql = is_postgresql(session)
    if postgresql and batch.locks_player:
        # The player's ledger lock, which the batch's receipt and task operations take
        # anyway, rides on the INSERT (one round trip less); it is evaluated only when
        # the row was inserted, after any racing attempt of the same batch committed.
        values["p_lock_key"] = _player_lock_key(request.player_id)
        applies = session.execute(_BATCH_INSERT_LOCKING, values).first() is not None
        if applies:
            _locks_held(session).add(request.player_id)
    else:
        inserted = session.execute(
            _BATCH_INSERT_POSTGRESQL if postgresql else _BATCH_INSERT_SQLITE, values
        )
        applies = rowcount(inserted) == 1
    if not applies:
        return _replay(session, request, batch.digest)
    check_noted_fence(session, request.fence if request.HasField("fence") else None, now)
    versions: list[int] = []
    index = 0
    while index < len(request.operations):
        index += _apply_operation(session, bounds, now, request, index, versions)
    response = journal_pb2.CommitResponse(versions=versions)
    if not versions:  # the response is empty, as stored with the row already
        return response
    session.connection().execute(
        update(_BATCHES)
        .where(
            _BATCHES.c.player_id == request.player_id,
            _BATCHES.c.request_id == request.request_id,
        )
        .values(response=response.SerializeToString())
    )
    return response


def _replay(
    session: Session, request: journal_pb2.CommitRequest, digest: bytes
) -> journal_pb2.CommitResponse:
    row = session.execute(
        select(_BATCHES.c.digest, _BATCHES.c.response).where(
            _BATCHES.c.player_id == request.player_id,
            _BATCHES.c.request_id == request.request_id,
        )
    ).one()
    if row.digest != digest:
        raise InvalidArgument(
            f"request_id {request.request_id!r} was already used for a different batch; "
            "a retry must resend the same operations, a new batch needs a new request id"
        )
    response = journal_pb2.CommitResponse.FromString(row.response)
    response.replayed = True
    return response
