"""The engine's side of the storage journal: event tasks and their step receipts, over the
storage service's JournalService. The engine keeps no task state of its own; a replica that
dies loses nothing but the leases it held, which expire and let another replica go on."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import struct_pb2
from system.common.v1 import common_pb2
from system.storage.v1 import journal_pb2, journal_pb2_grpc

from engine_service.clients import JournalStream
from services.results import AgentFailure, ModuleFailure
from services.runtime.channels import ChannelSettings, Dependency
from services.runtime.errors import (
    STALE_FENCE,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    error_reason,
)

__all__ = ["Claim", "DoneStep", "LeaseLost", "TaskStore", "task_lease"]

_JOURNAL = "system.storage.v1.JournalService"


class LeaseLost(Exception):
    """The task's lease was taken over (or expired): another replica owns the task now, and
    this one must stop writing for it at once."""


@dataclasses.dataclass(frozen=True)
class DoneStep:
    """A step's result not stored yet (engine_service.steps holds them until a write)."""

    step_id: str
    position: int
    tool: str
    result: bytes
    codec_id: str
    recorded: bool
    """Whether its intent is stored (a RUNNING receipt); else the write records it first."""


def task_lease(task_id: str) -> str:
    """Name of the lease a claimed task runs under (storage's naming)."""
    return f"task:{task_id}"


@dataclasses.dataclass(frozen=True)
class Claim:
    """A task this replica claimed, with the fence every write for it presents."""

    task: journal_pb2.EventTask
    fence: journal_pb2.Fence
    gateway_address: str = ""
    """The internal address of the gateway replica the task's player was attached to at the
    claim, as storage said; empty when it knew none."""


def _storage_error(exc: grpc.aio.AioRpcError, what: str) -> Exception:
    """A journal RPC's failure as the engine sees it."""
    code = exc.code()
    detail = exc.details() or code.name
    if error_reason(exc) == STALE_FENCE:
        return LeaseLost(detail)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ModuleFailure(AgentFailure.STORAGE_FULL, f"{what}: {detail}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ModuleFailure(AgentFailure.MODULE_FAILED, f"{what}: {detail}")
    return ModuleFailure(AgentFailure.STORAGE_UNAVAILABLE, f"{what}: {detail}")


class TaskStore:
    """Event tasks and receipts through the storage service.

    Only calls that are safe to repeat are retried on transport errors: creating a task (the
    event key deduplicates), completing a step (the same result again changes nothing) and
    reads. Recording a step is retried only for a tool that is idempotent or honours call ids
    (`record_step(retry=True)`): a retry of an intent that did land finds it RUNNING, which
    such a tool's step sends again (under the same call id); for any other tool it would look
    like a crash's leftover and report EFFECT_UNKNOWN for nothing.
    """

    def __init__(
        self,
        target: str,
        timeout: float = 5.0,
        private: bool = False,
        settings: ChannelSettings | None = None,
    ) -> None:
        self._timeout = timeout
        self._dep = Dependency(
            target,
            journal_pb2_grpc.JournalServiceStub,
            idempotent_methods=[
                f"{_JOURNAL}/CreateTask",
                f"{_JOURNAL}/CompleteStep",
                f"{_JOURNAL}/QueueWaitingTasks",
                f"{_JOURNAL}/GetTask",
                f"{_JOURNAL}/Commit",  # only ever sent with a request id: retries replay
            ],
            # The event runner polls from start-up on, before storage may be up: it gets
            # connections of its own, so its failed attempts never put the request path's
            # connection into reconnect backoff.
            private=private,
            settings=settings,
        )
        # Receipts, finishing commits and the task lease's upkeep: on one stream.
        self._calls = JournalStream(self._dep)

    # -- tasks -----------------------------------------------------------------------------

    async def create(
        self,
        player_id: str,
        module_id: str,
        event_key: str,
        data: dict[str, Any],
        waiting: bool,
    ) -> tuple[journal_pb2.EventTask, bool]:
        """Persists a task (QUEUED, or WAITING for an offline player); returns it and whether
        it is new. Raises InvalidArgument, ResourceExhausted (STORAGE_FULL) or Unavailable."""
        payload = struct_pb2.Struct()
        payload.update(data)
        request = journal_pb2.CreateTaskRequest(
            player_id=player_id,
            module_id=module_id,
            input=payload,
            event_key=event_key,
            initial_state=journal_pb2.TASK_STATE_WAITING
            if waiting
            else journal_pb2.TASK_STATE_QUEUED,
        )
        try:
            response = await self._calls.call("CreateTask", request, self._timeout)
        except grpc.aio.AioRpcError as exc:
            detail = exc.details() or exc.code().name
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(detail) from None
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise ResourceExhausted(detail) from None
            raise Unavailable(f"the event task could not be stored: {detail}") from None
        return response.task, response.created

    async def resume(self, player_id: str) -> int:
        """Moves the player's WAITING tasks to QUEUED (one storage call); returns how many
        moved. A task another call moved first is not counted."""
        try:
            response = await self._dep.stub.QueueWaitingTasks(
                journal_pb2.QueueWaitingTasksRequest(player_id=player_id), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"waiting tasks could not be resumed: {exc.details()}") from None
        return len(response.task_ids)

    async def claim(self, owner: str, max_tasks: int, lease_seconds: int) -> list[Claim]:
        """Claims runnable tasks (QUEUED, or RUNNING whose lease expired), each with where its
        player is."""
        response = await self._dep.stub.ClaimTasks(
            journal_pb2.ClaimTasksRequest(
                owner=owner, max_tasks=max_tasks, lease_seconds=lease_seconds
            ),
            timeout=self._timeout,
        )
        return [
            Claim(
                claim.task,
                journal_pb2.Fence(lease_name=claim.lease.name, token=claim.lease.token),
                claim.gateway_address,
            )
            for claim in response.claims
        ]

    async def renew(self, claim: Claim, owner: str, lease_seconds: int) -> None:
        """Extends the task's lease. Raises LeaseLost when it is no longer ours."""
        try:
            await self._calls.call(
                "RenewLease",
                journal_pb2.RenewLeaseRequest(
                    name=claim.fence.lease_name,
                    owner=owner,
                    token=claim.fence.token,
                    ttl_seconds=lease_seconds,
                ),
                self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise LeaseLost(exc.details()) from None
            raise

    async def release(self, claim: Claim, owner: str) -> None:
        await self._calls.call(
            "ReleaseLease",
            journal_pb2.ReleaseLeaseRequest(
                name=claim.fence.lease_name, owner=owner, token=claim.fence.token
            ),
            self._timeout,
        )

    async def store_steps(
        self,
        claim: Claim,
        steps: Sequence[DoneStep],
        move: tuple[journal_pb2.TaskState, common_pb2.AgentResult | None] | None = None,
    ) -> None:
        """Stores done steps' results, recording first those whose intent was never stored,
        and, with `move`, moves the claimed (RUNNING) task to that state with its result under
        its fence: one transaction, one round trip. Safe to retry: the batch's request id makes a second apply a replay.

        Raises:
            LeaseLost: another replica holds the task now.
            ModuleFailure: storage refused or could not be reached.
        """
        task = claim.task

        def receipt(step: DoneStep, **write: Any) -> journal_pb2.CommitOperation:
            return journal_pb2.CommitOperation(
                receipt=journal_pb2.ReceiptWrite(
                    step_id=step.step_id, task_id=task.task_id, tool=step.tool, **write
                )
            )

        operations: list[journal_pb2.CommitOperation] = []
        for step in steps:
            if not step.recorded:
                operations.append(
                    receipt(step, position=step.position, state=journal_pb2.STEP_STATE_RUNNING)
                )
            operations.append(
                receipt(
                    step,
                    state=journal_pb2.STEP_STATE_DONE,
                    result=step.result,
                    codec_id=step.codec_id,
                )
            )
        if move is not None:
            state, result = move
            operations.append(
                journal_pb2.CommitOperation(
                    transition=journal_pb2.TaskTransition(
                        task_id=task.task_id,
                        state=state,
                        expected_state=journal_pb2.TASK_STATE_RUNNING,
                        result=result,
                    )
                )
            )
            request_id = f"finish:{task.task_id}:{task.attempts}"
            what = f"task {task.task_id} could not be finished"
        else:
            request_id = f"steps:{steps[0].step_id}:{task.attempts}"
            what = f"the results of task {task.task_id}'s steps could not be stored"
        request = journal_pb2.CommitRequest(
            request_id=request_id,
            player_id=task.player_id,
            operations=operations,
            fence=claim.fence,
        )
        try:
            await self._calls.call("Commit", request, self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _storage_error(exc, what) from None

    # -- receipts --------------------------------------------------------------------------

    async def record_step(
        self,
        claim: Claim,
        step_id: str,
        position: int,
        tool: str,
        completed: Sequence[DoneStep] = (),
        retry: bool = False,
    ) -> tuple[journal_pb2.StepReceipt, bool]:
        """Records a step's intent (with `completed`, earlier steps' results whose intents are
        stored, stored first in the same transaction); returns the receipt and whether it is
        new. `retry`: the step's tool may run again, so a transport failure (a storage
        replica gone mid-call) is retried, on another replica where there is one."""
        try:
            response = await self._calls.call(
                "RecordStep",
                journal_pb2.RecordStepRequest(
                    step_id=step_id,
                    task_id=claim.task.task_id,
                    position=position,
                    tool=tool,
                    fence=claim.fence,
                    completed=[
                        journal_pb2.CompletedStep(
                            step_id=step.step_id,
                            tool=step.tool,
                            result=step.result,
                            codec_id=step.codec_id,
                        )
                        for step in completed
                    ],
                ),
                self._timeout,
                idempotent=retry,
            )
        except grpc.aio.AioRpcError as exc:
            raise _storage_error(exc, f"step {step_id} could not be recorded") from None
        return response.receipt, response.created

    async def complete_step(
        self, claim: Claim, step_id: str, tool: str, result: bytes, codec_id: str
    ) -> None:
        try:
            await self._calls.call(
                "CompleteStep",
                journal_pb2.CompleteStepRequest(
                    step_id=step_id,
                    tool=tool,
                    result=result,
                    codec_id=codec_id,
                    fence=claim.fence,
                ),
                self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            raise _storage_error(exc, f"the result of step {step_id} could not be stored") from None

    async def aclose(self) -> None:
        await self._calls.aclose()
        await self._dep.aclose()
