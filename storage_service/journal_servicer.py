"""gRPC face of the journal: unpacks requests and runs the store off the event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from sqlalchemy.orm import Session
from system.storage.v1 import journal_pb2, journal_pb2_grpc

from services.runtime.multiplex import MultiplexServer
from storage_service.dbcall import run_db
from storage_service.group_commit import GroupCommitter, declared, fenced
from storage_service.journal import JournalStore
from storage_service.ledgers import Writes
from storage_service.runs import RunStore

__all__ = ["JournalServicer"]

T = TypeVar("T")

_SERVICE = journal_pb2.DESCRIPTOR.services_by_name["JournalService"]


def _fence(
    request: journal_pb2.TransitionTaskRequest
    | journal_pb2.RecordStepRequest
    | journal_pb2.CompleteStepRequest,
) -> journal_pb2.Fence | None:
    return request.fence if request.HasField("fence") else None


class JournalServicer(journal_pb2_grpc.JournalServiceServicer):
    """Thin: every method delegates to JournalStore in a worker thread. Typed errors the store
    raises become status codes in the server interceptor; an unreachable database becomes
    UNAVAILABLE (see storage_service.dbcall).

    Args:
        store: the journal.
        committer: runs the writes an engine makes for every task and step (CreateTask,
            Commit, RecordStep, CompleteStep, TransitionTask) in shared transactions (see
            storage_service.group_commit); without one each is a transaction of its own on
            a worker thread.
        runs: begins and finishes interactive runs (storage_service.runs).
    """

    def __init__(
        self,
        store: JournalStore,
        runs: RunStore,
        committer: GroupCommitter | None = None,
    ) -> None:
        self._store = store
        self._runs = runs
        self._committer = committer
        self._multiplex = MultiplexServer(
            _SERVICE,
            {
                "Commit": self.Commit,
                "RecordStep": self.RecordStep,
                "CompleteStep": self.CompleteStep,
                "CreateTask": self.CreateTask,
                "AcquireLease": self.AcquireLease,
                "RenewLease": self.RenewLease,
                "ReleaseLease": self.ReleaseLease,
                "BeginRun": self.BeginRun,
                "FinishRun": self.FinishRun,
            },
        )

    async def _write(self, unit: Callable[[Session], T]) -> T:
        if self._committer is not None:
            return await self._committer.run(unit)
        return await run_db(self._store.transaction, unit)

    async def CreateTask(
        self, request: journal_pb2.CreateTaskRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.CreateTaskResponse:
        # Events come in bursts: their tasks share the group committer's transactions.
        task, created, evicted = await self._write(
            self._store.create_task_unit(
                request.player_id,
                request.module_id,
                request.input,
                request.event_key,
                request.initial_state,
            )
        )
        return journal_pb2.CreateTaskResponse(task=task, created=created, evicted=evicted)

    async def GetTask(
        self, request: journal_pb2.GetTaskRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.GetTaskResponse:
        task = await run_db(self._store.get_task, request.task_id)
        return journal_pb2.GetTaskResponse(task=task)

    async def ListTasks(
        self, request: journal_pb2.ListTasksRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.ListTasksResponse:
        tasks, token = await run_db(
            self._store.list_tasks,
            request.player_id,
            list(request.states),
            request.page_size,
            request.page_token,
        )
        return journal_pb2.ListTasksResponse(tasks=tasks, next_page_token=token)

    async def ClaimTasks(
        self, request: journal_pb2.ClaimTasksRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.ClaimTasksResponse:
        claims = await run_db(
            self._store.claim_tasks,
            request.owner,
            request.max_tasks,
            request.lease_seconds,
            list(request.player_ids),
        )
        return journal_pb2.ClaimTasksResponse(claims=claims)

    async def TransitionTask(
        self,
        request: journal_pb2.TransitionTaskRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> journal_pb2.TransitionTaskResponse:
        task = await self._write(
            declared(
                self._store.transition_task_in,
                Writes(tasks=(request.task_id,), fences=fenced(request)),
                task_id=request.task_id,
                state=request.state,
                expected_state=request.expected_state,
                result=request.result if request.HasField("result") else None,
                fence=_fence(request),
            )
        )
        return journal_pb2.TransitionTaskResponse(task=task)

    async def QueueWaitingTasks(
        self,
        request: journal_pb2.QueueWaitingTasksRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> journal_pb2.QueueWaitingTasksResponse:
        task_ids = await self._write(
            declared(
                self._store.queue_waiting_in,
                Writes(players=(request.player_id,)),
                player_id=request.player_id,
            )
        )
        return journal_pb2.QueueWaitingTasksResponse(task_ids=task_ids)

    async def RecordStep(
        self, request: journal_pb2.RecordStepRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.RecordStepResponse:
        receipt, created = await self._write(
            declared(
                self._store.record_step_in,
                Writes(
                    tasks=(request.task_id,),
                    steps=tuple(s.step_id for s in request.completed),
                    fences=fenced(request),
                ),
                step_id=request.step_id,
                task_id=request.task_id,
                position=request.position,
                tool=request.tool,
                fence=_fence(request),
                completed=list(request.completed),
            )
        )
        return journal_pb2.RecordStepResponse(receipt=receipt, created=created)

    async def CompleteStep(
        self, request: journal_pb2.CompleteStepRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.CompleteStepResponse:
        receipt = await self._write(
            declared(
                self._store.complete_step_in,
                Writes(steps=(request.step_id,), fences=fenced(request)),
                step_id=request.step_id,
                tool=request.tool,
                result=request.result,
                codec_id=request.codec_id,
                fence=_fence(request),
            )
        )
        return journal_pb2.CompleteStepResponse(receipt=receipt)

    async def GetStep(
        self, request: journal_pb2.GetStepRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.GetStepResponse:
        receipt = await run_db(self._store.get_step, request.step_id, request.tool)
        return journal_pb2.GetStepResponse(receipt=receipt)

    async def AcquireLease(
        self, request: journal_pb2.AcquireLeaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.AcquireLeaseResponse:
        lease = await run_db(
            self._store.acquire_lease, request.name, request.owner, request.ttl_seconds
        )
        return journal_pb2.AcquireLeaseResponse(lease=lease)

    async def RenewLease(
        self, request: journal_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.RenewLeaseResponse:
        lease = await run_db(
            self._store.renew_lease, request.name, request.owner, request.token, request.ttl_seconds
        )
        return journal_pb2.RenewLeaseResponse(lease=lease)

    async def ReleaseLease(
        self, request: journal_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.ReleaseLeaseResponse:
        released = await run_db(
            self._store.release_lease, request.name, request.owner, request.token
        )
        return journal_pb2.ReleaseLeaseResponse(released=released)

    async def ReleaseEarlierIncarnations(
        self,
        request: journal_pb2.ReleaseEarlierIncarnationsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> journal_pb2.ReleaseEarlierIncarnationsResponse:
        # Once per engine start, not on any hot path: a worker thread on every database.
        released = await run_db(
            self._store.release_earlier_incarnations, request.name, request.incarnation
        )
        return journal_pb2.ReleaseEarlierIncarnationsResponse(released=released)

    async def BeginRun(
        self, request: journal_pb2.BeginRunRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.BeginRunResponse:
        return await self._write(self._runs.begin_unit(request))

    async def FinishRun(
        self, request: journal_pb2.FinishRunRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.FinishRunResponse:
        return await self._write(self._runs.finish_unit(request))

    async def Commit(
        self, request: journal_pb2.CommitRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> journal_pb2.CommitResponse:
        # Validated here: a malformed batch is refused without waiting for a transaction.
        return await self._write(self._store.commit_unit(request))

    async def MultiplexCalls(
        self,
        request_iterator: AsyncIterator[journal_pb2.MultiplexCallsRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[journal_pb2.MultiplexCallsResponse]:
        # The calls above, many on one stream (services.runtime.multiplex); each handler
        # ignores its context, so a call on the stream runs exactly as the unary one.
        async for response in self._multiplex.serve(request_iterator, context):
            yield response
