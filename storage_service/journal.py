"""The engine's journal as one store: `JournalStore`, the calls of JournalService.

Domain code: no gRPC here. Messages travel as `system.storage.v1.journal_pb2` messages.

The rules live by area, each in its own module, and this store opens the transactions they
run in:

- storage_service.journal_records: the task and receipt tables, state names, messages;
- storage_service.ledgers: per-player bounds, eviction and the player's ledger lock;
- storage_service.tasks: tasks created once per event key and moved along valid edges;
- storage_service.receipts: step receipts, intent (RUNNING) then result (DONE);
- storage_service.leases: leases with fencing tokens, and the fence a write checks;
- storage_service.claims: ClaimTasks;
- storage_service.batches: Commit, one atomic, idempotent batch;
- storage_service.batch_groups: a group's receipt batches written together;
- storage_service.dialect: where SQLite and PostgreSQL differ.

Session-level functions (`create_task`, `transition_task`, `record_step`, `complete_step`,
`check_fence`, the lease calls' `*_steps`) run inside a caller's transaction; `JournalStore`
opens one transaction per call, and `JournalStore.commit` applies a whole batch in one. The
writes an engine makes per step also come as units for a transaction the caller owns
(`JournalStore.commit_unit`, `record_step_in`, `complete_step_in`, `transition_task_in`): the
service runs many of them in one transaction (storage_service.group_commit). The names this
module exports stay importable from here.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

from google.protobuf import struct_pb2
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from system.common.v1 import common_pb2
from system.storage.v1 import journal_pb2

from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound
from storage_service.batch_groups import _CommitWriter, _GroupableCommit, write_batches
from storage_service.batches import _Batch, apply_batch
from storage_service.claims import MAX_CLAIM, MAX_CLAIM_PLAYERS, claim_tasks
from storage_service.create_groups import CreateWriter, GroupableCreate
from storage_service.dialect import OneStatement, utc_now
from storage_service.group_commit import Declared, fenced
from storage_service.journal_records import (
    _RECEIPTS,
    _TASKS,
    MAX_TASK_ID,
    TS,
    StoredReceipt,
    StoredTask,
    _check_id,
    _no_task,
    _state_name,
    receipt_message,
    task_message,
)
from storage_service.leases import (
    _check_ttl,
    acquire,
    check_fence,
    release,
    release_earlier_incarnations,
    renew,
)
from storage_service.ledgers import (
    JournalBounds,
    Writes,
    check_noted_fence,
)
from storage_service.pages import PageTokens
from storage_service.presence import locate_players
from storage_service.receipts import complete_step, record_step
from storage_service.tasks import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    create_task,
    queue_waiting,
    transition_task,
)
from storage_service.validation import check_player_id

__all__ = [
    "JournalBounds",
    "JournalStore",
    "release_earlier_incarnations",
    "check_fence",
    "complete_step",
    "create_task",
    "receipt_message",
    "record_step",
    "task_message",
    "transition_task",
    "utc_now",
]

log = logging.getLogger("system.storage.journal")

_TASK_PAGES = PageTokens("t")
"""ListTasks' page tokens: a task's sequence number."""

T = TypeVar("T")
P = ParamSpec("P")


def _own_transaction(
    method: Callable[Concatenate[JournalStore, Session, P], T],
) -> Callable[Concatenate[JournalStore, P], T]:
    """The store method that runs `method` (a `*_in` method, which works inside a caller's
    transaction) in a transaction of its own, with the same arguments but the session."""
    name = method.__name__

    def run(self: JournalStore, /, *args: P.args, **kwargs: P.kwargs) -> T:
        def unit(session: Session) -> T:
            # Looked up on each call, as a bound method, so it is the store's method of now.
            bound: Callable[Concatenate[Session, P], T] = getattr(self, name)
            return bound(session, *args, **kwargs)

        return self.transaction(unit)

    run.__name__ = name.removesuffix("_in")
    run.__qualname__ = f"JournalStore.{run.__name__}"
    run.__doc__ = f"`{name}` in a transaction of its own."
    return run


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
        self._commit_writer = _CommitWriter(self)
        self._creates = CreateWriter(self._bounds, self._now)
        self._one_statement = OneStatement(sessions)

    def _now(self) -> dt.datetime:
        now = self._clock()
        # Stored as UTC: SQLite keeps no offset, so every time written must be UTC already.
        return now.replace(tzinfo=dt.UTC) if now.tzinfo is None else now.astimezone(dt.UTC)

    def _fenced_now(self, session: Session, fence: journal_pb2.Fence | None) -> dt.datetime:
        """The time of a fenced write (a `*_in` method), once its fence (if any) holds at that
        time: FAILED_PRECONDITION otherwise, before the write touches anything."""
        now = self._now()
        check_noted_fence(session, fence, now)
        return now

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
        return self.transaction(
            functools.partial(
                self.create_task_in,
                player_id=player_id,
                module_id=module_id,
                input=input,
                event_key=event_key,
                initial_state=initial_state,
            )
        )

    def create_task_unit(
        self,
        player_id: str,
        module_id: str,
        input: struct_pb2.Struct | None,
        event_key: str,
        initial_state: int = TS.TASK_STATE_UNSPECIFIED,
    ) -> GroupableCreate:
        """`create_task_in` as a unit of a group (storage_service.group_commit), which writes
        the player's rows, and may be written together with the group's other creations
        (storage_service.create_groups). The player id is checked now: the group takes the
        player's lock with it before the unit runs, and a malformed one is refused
        INVALID_ARGUMENT without reaching the database."""
        check_player_id(player_id)
        request: dict[str, Any] = {
            "player_id": player_id,
            "module_id": module_id,
            "input": input,
            "event_key": event_key,
            "initial_state": initial_state,
        }
        return GroupableCreate(
            self._creates, functools.partial(self.create_task_in, **request), request
        )

    def create_task_in(
        self,
        session: Session,
        player_id: str,
        module_id: str,
        input: struct_pb2.Struct | None,
        event_key: str,
        initial_state: int = TS.TASK_STATE_UNSPECIFIED,
    ) -> tuple[journal_pb2.EventTask, bool, int]:
        """`create_task` inside the session's transaction."""
        row, created, evicted = create_task(
            session,
            self._bounds,
            self._now(),
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
            row = session.execute(select(_TASKS).where(_TASKS.c.task_id == task_id)).one_or_none()
            if row is None:
                raise _no_task(task_id)
            return task_message(StoredTask.from_row(row))

    def list_tasks(
        self, player_id: str, states: Sequence[int] = (), page_size: int = 0, page_token: str = ""
    ) -> tuple[list[journal_pb2.EventTask], str]:
        """A page of the player's tasks, oldest first, and the token of the next page."""
        check_player_id(player_id)
        names = {_state_name(state, f"states[{i}]") for i, state in enumerate(states)}
        if page_size < 0:
            raise InvalidArgument("page_size must not be negative")
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        query = select(_TASKS).where(_TASKS.c.player_id == player_id)
        if names:
            query = query.where(_TASKS.c.state.in_(sorted(names)))
        if page_token:
            query = query.where(_TASKS.c.seq > _TASK_PAGES.decode_number(page_token))
        with self._sessions() as session:
            rows, token = _TASK_PAGES.read(
                session, query.order_by(_TASKS.c.seq), size, lambda row: row.seq
            )
            return [task_message(StoredTask.from_row(row)) for row in rows], token

    def claim_tasks(
        self, owner: str, max_tasks: int, lease_seconds: int, player_ids: Sequence[str] = ()
    ) -> list[journal_pb2.TaskClaim]:
        """Claims up to `max_tasks` runnable tasks, oldest first: QUEUED tasks (of
        `player_ids` when given) and RUNNING tasks no live lease protects (their replica
        died). Each becomes RUNNING, attempts + 1, under lease `task:<task_id>` for `owner`,
        and carries the address of the gateway replica its player is attached to, if any
        (read after the claim, in the same connection: one query for the whole claim)."""
        _check_id(owner, "owner")
        if not 1 <= max_tasks <= MAX_CLAIM:
            raise InvalidArgument(f"max_tasks must be between 1 and {MAX_CLAIM}, got {max_tasks}")
        _check_ttl(lease_seconds, "lease_seconds")
        if len(player_ids) > MAX_CLAIM_PLAYERS:
            raise InvalidArgument(f"player_ids may name at most {MAX_CLAIM_PLAYERS} players")
        for index, player_id in enumerate(player_ids):
            check_player_id(player_id, f"player_ids[{index}]")
        now = self._now()
        # One statement on PostgreSQL (see dialect.OneStatement); three in a transaction on
        # SQLite. The players' locations are a read after it.
        with self._one_statement.begin() as session:
            claims = claim_tasks(
                session,
                now,
                owner=owner,
                max_tasks=max_tasks,
                lease_seconds=lease_seconds,
                player_ids=player_ids,
            )
            # Where each task's player is, read with the claim: the engine then sends the
            # task's game-tool calls without a LocatePlayer call per task.
            located = locate_players(session, {claim.task.player_id for claim in claims}, now)
        for claim in claims:
            location = located.get(claim.task.player_id)
            if location is not None:
                claim.gateway_address = location.address
        return claims

    def transaction(self, unit: Callable[[Session], T]) -> T:
        """Runs `unit` in a transaction of its own (see `storage_service.group_commit` for
        several in one)."""
        with self._sessions.begin() as session:
            return unit(session)

    def transition_task_in(
        self,
        session: Session,
        task_id: str,
        state: int,
        expected_state: int = TS.TASK_STATE_UNSPECIFIED,
        result: common_pb2.AgentResult | None = None,
        fence: journal_pb2.Fence | None = None,
    ) -> journal_pb2.EventTask:
        """`transition_task` inside the session's transaction."""
        now = self._fenced_now(session, fence)
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

    transition_task = _own_transaction(transition_task_in)

    def queue_waiting_in(self, session: Session, player_id: str) -> list[str]:
        """`queue_waiting` inside the session's transaction: the player's WAITING tasks move
        to QUEUED; returns their ids, oldest first."""
        return queue_waiting(session, self._now(), player_id)

    queue_waiting = _own_transaction(queue_waiting_in)

    # -- receipts ------------------------------------------------------------------------------

    def record_step_in(
        self,
        session: Session,
        step_id: str,
        task_id: str,
        position: int,
        tool: str,
        fence: journal_pb2.Fence | None = None,
        completed: Sequence[journal_pb2.CompletedStep] = (),
    ) -> tuple[journal_pb2.StepReceipt, bool]:
        """`record_step` inside the session's transaction; `completed` results of earlier
        steps of the task are stored first (DONE, as `complete_step` does)."""
        now = self._fenced_now(session, fence)
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

    record_step = _own_transaction(record_step_in)

    def complete_step_in(
        self,
        session: Session,
        step_id: str,
        tool: str,
        result: bytes,
        codec_id: str,
        fence: journal_pb2.Fence | None = None,
    ) -> journal_pb2.StepReceipt:
        """`complete_step` inside the session's transaction."""
        now = self._fenced_now(session, fence)
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

    complete_step = _own_transaction(complete_step_in)

    def get_step(self, step_id: str, tool: str) -> journal_pb2.StepReceipt:
        """The receipt for replay; FAILED_PRECONDITION when it was recorded for another tool."""
        _check_id(step_id, "step_id")
        _check_id(tool, "tool")
        with self._sessions() as session:
            found = session.execute(
                select(_RECEIPTS).where(_RECEIPTS.c.step_id == step_id)
            ).one_or_none()
            if found is None:
                raise NotFound(f"no receipt for step {step_id!r}")
            row = StoredReceipt(*found)
            if row.tool != tool:
                raise FailedPrecondition(
                    f"step {step_id} was recorded for tool {row.tool!r}; refusing to replay it "
                    f"for tool {tool!r}"
                )
            return receipt_message(row)

    # -- leases --------------------------------------------------------------------------------

    def acquire_lease(self, name: str, owner: str, ttl_seconds: int) -> journal_pb2.Lease:
        """Takes a lease (see storage_service.leases.acquire). One statement, in autocommit on
        PostgreSQL."""
        now = self._now()
        with self._one_statement.begin() as session:
            return acquire(session, name, owner, ttl_seconds, now)

    def renew_lease(self, name: str, owner: str, token: int, ttl_seconds: int) -> journal_pb2.Lease:
        """Extends a lease the caller holds (also after it expired, if nobody took it since)."""
        now = self._now()
        with self._one_statement.begin() as session:
            return renew(session, name, owner, token, ttl_seconds, now)

    def release_lease(self, name: str, owner: str, token: int) -> bool:
        """Gives a lease up; False when it was no longer the caller's. The token is kept."""
        with self._one_statement.begin() as session:
            return release(session, name, owner, token)

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
            return _GroupableCommit(self._commit_writer, batch)
        return Declared(
            functools.partial(self._apply_batch, batch=batch),
            Writes(players=(request.player_id,), fences=fenced(request)),
        )

    def _apply_batch(self, session: Session, *, batch: _Batch) -> journal_pb2.CommitResponse:
        """Applies one validated batch inside the session's current transaction."""
        return apply_batch(session, self._bounds, self._now(), batch)

    def _write_batches(
        self, session: Session, batches: Sequence[_Batch]
    ) -> list[Callable[[], journal_pb2.CommitResponse] | None]:
        """Writes batches of receipt writes together (see batch_groups.write_batches)."""
        return write_batches(session, self._bounds, self._now(), batches)
