"""JournalService.MultiplexCalls: the journal's hot calls as messages on one stream
(services.runtime.multiplex, the envelope of system/common/v1/stream.proto), against the real
servicer on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker
from system.common.v1 import common_pb2, stream_pb2
from system.relay.v1 import relay_pb2
from system.storage.v1 import journal_pb2, journal_pb2_grpc

from services.runtime.channels import Dependency
from services.runtime.errors import NOT_SENT, STALE_FENCE, error_reason, never_sent
from services.runtime.metrics import RPC_HANDLED
from services.runtime.multiplex import MAX_ITEM_BYTES, PACK_BYTES, MultiplexClient, MultiplexServer
from services.runtime.server import ServiceHost
from storage_service.config import StorageConfig
from storage_service.group_commit import GroupCommitter
from storage_service.history import ConversationStore, HistoryBounds
from storage_service.journal import JournalBounds, JournalStore
from storage_service.journal_servicer import JournalServicer
from storage_service.runs import RunStore
from tests.waiting import wait_until

JOURNAL = "system.storage.v1.JournalService"
SERVICE = journal_pb2.DESCRIPTOR.services_by_name["JournalService"]
RELAY = relay_pb2.DESCRIPTOR.services_by_name["ToolRelayService"]
RUNNING = journal_pb2.STEP_STATE_RUNNING
DONE = journal_pb2.STEP_STATE_DONE


class _Service:
    """The journal servicer behind a real gRPC server on loopback, with its group committer."""

    def __init__(self, engine: Engine, servicer_type: type[JournalServicer] = JournalServicer):
        sessions = sessionmaker(engine, expire_on_commit=False)
        self.committer = GroupCommitter(sessions)
        journal = JournalStore(sessions, JournalBounds())
        history = ConversationStore(
            sessions, HistoryBounds(max_entries=200, max_bytes=262144, max_text_chars=4000)
        )
        self.servicer = servicer_type(journal, RunStore(history, journal.now), self.committer)
        self.host: ServiceHost | None = None

    async def start(self, port: int = 0) -> str:
        config = StorageConfig(port=port, metrics_port=-1, drain_seconds=0)
        servicer = self.servicer
        self.host = ServiceHost(
            "storage",
            config,
            [
                lambda server: journal_pb2_grpc.add_JournalServiceServicer_to_server(
                    servicer, server
                )
            ],
            [JOURNAL],
        )
        await self.host.start()
        return self.host.target

    async def stop(self) -> None:
        if self.host is not None:
            await self.host.stop()
            self.host = None


@pytest.fixture
async def service(engine: Engine) -> AsyncIterator[_Service]:
    service = _Service(engine)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()
        service.committer.close()


@pytest.fixture
async def channel(service: _Service) -> AsyncIterator[grpc.aio.Channel]:
    assert service.host is not None
    async with grpc.aio.insecure_channel(service.host.target) as channel:
        yield channel


def _client(channel: grpc.aio.Channel) -> MultiplexClient:
    return MultiplexClient(journal_pb2_grpc.JournalServiceStub(channel).MultiplexCalls, SERVICE)


async def _task(channel: grpc.aio.Channel, player: str) -> journal_pb2.EventTask:
    created = await journal_pb2_grpc.JournalServiceStub(channel).CreateTask(
        journal_pb2.CreateTaskRequest(player_id=player, module_id="system:test", event_key="e1")
    )
    return created.task


def _receipt_commit(
    player: str, task_id: str, step: str, state: int, fence: journal_pb2.Fence | None = None
) -> journal_pb2.CommitRequest:
    write = journal_pb2.ReceiptWrite(step_id=step, task_id=task_id, tool="test:write", state=state)
    if state == DONE:
        write.result = b"result"
        write.codec_id = "test"
    return journal_pb2.CommitRequest(
        request_id=f"{step}-{state}",
        player_id=player,
        operations=[journal_pb2.CommitOperation(receipt=write)],
        fence=fence,
    )


async def test_each_call_answers_as_its_unary_rpc(channel: grpc.aio.Channel) -> None:
    stub = journal_pb2_grpc.JournalServiceStub(channel)
    client = _client(channel)
    player = f"p-{uuid.uuid4()}"
    task = await _task(channel, player)
    try:
        lease = await client.call(
            "AcquireLease",
            journal_pb2.AcquireLeaseRequest(
                name=f"task:{task.task_id}", owner="r1", ttl_seconds=30
            ),
            timeout=10,
        )
        fence = journal_pb2.Fence(lease_name=lease.lease.name, token=lease.lease.token)
        recorded = await client.call(
            "RecordStep",
            journal_pb2.RecordStepRequest(
                step_id="s1", task_id=task.task_id, position=0, tool="test:write", fence=fence
            ),
            timeout=10,
        )
        assert recorded.created and recorded.receipt.state == RUNNING
        completed = await client.call(
            "CompleteStep",
            journal_pb2.CompleteStepRequest(
                step_id="s1", tool="test:write", result=b"r", codec_id="c", fence=fence
            ),
            timeout=10,
        )
        assert completed.receipt.state == DONE and completed.receipt.result == b"r"
        committed = await client.call(
            "Commit", _receipt_commit(player, task.task_id, "s2", RUNNING, fence), timeout=10
        )
        assert not committed.replayed
        again = await client.call(
            "Commit", _receipt_commit(player, task.task_id, "s2", RUNNING, fence), timeout=10
        )
        assert again.replayed  # the same request id applies once, as on the unary RPC
        renewed = await client.call(
            "RenewLease",
            journal_pb2.RenewLeaseRequest(
                name=fence.lease_name, owner="r1", token=fence.token, ttl_seconds=60
            ),
            timeout=10,
        )
        assert renewed.lease.token == fence.token
        released = await client.call(
            "ReleaseLease",
            journal_pb2.ReleaseLeaseRequest(name=fence.lease_name, owner="r1", token=fence.token),
            timeout=10,
        )
        assert released.released
        # A task made on the stream; made again (the same event key), the same task.
        request = journal_pb2.CreateTaskRequest(
            player_id=player, module_id="system:test", event_key="e2"
        )
        made = await client.call("CreateTask", request, timeout=10)
        assert made.created and made.task.state == journal_pb2.TASK_STATE_QUEUED
        again_made = await client.call("CreateTask", request, timeout=10)
        assert (again_made.created, again_made.task.task_id) == (False, made.task.task_id)
    finally:
        await client.aclose()
    # What the stream wrote is what the unary reads see.
    step = await stub.GetStep(journal_pb2.GetStepRequest(step_id="s2", tool="test:write"))
    assert step.receipt.state == RUNNING and step.receipt.task_id == task.task_id
    listed = await stub.ListTasks(journal_pb2.ListTasksRequest(player_id=player))
    assert {t.task_id for t in listed.tasks} == {task.task_id, made.task.task_id}


async def test_a_run_begins_and_finishes_on_the_stream(channel: grpc.aio.Channel) -> None:
    """BeginRun and FinishRun, the two storage calls of an interactive run (decision 0020)."""
    client = _client(channel)
    player = f"p-{uuid.uuid4()}"
    try:
        begun = await client.call(
            "BeginRun",
            journal_pb2.BeginRunRequest(
                player_id=player, owner="r1", lease_seconds=30, history_entries=5
            ),
            timeout=10,
        )
        assert begun.lease.token > 0 and list(begun.history) == []
        entries = [
            common_pb2.HistoryEntry(role=common_pb2.HISTORY_ROLE_PLAYER, text="hi", request_id="q1")
        ]
        finished = await client.call(
            "FinishRun",
            journal_pb2.FinishRunRequest(
                player_id=player, owner="r1", token=begun.lease.token, entries=entries
            ),
            timeout=10,
        )
        assert finished.recorded and finished.released
        again = await client.call(
            "BeginRun",
            journal_pb2.BeginRunRequest(
                player_id=player, owner="r2", lease_seconds=30, history_entries=5
            ),
            timeout=10,
        )
        assert [e.text for e in again.history] == ["hi"]
        assert again.lease.token > begun.lease.token
    finally:
        await client.aclose()


async def test_a_failing_call_answers_its_status_and_the_stream_goes_on(
    channel: grpc.aio.Channel,
) -> None:
    client = _client(channel)
    player = f"p-{uuid.uuid4()}"
    task = await _task(channel, player)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await client.call(
                "Commit", journal_pb2.CommitRequest(request_id="r", player_id=player), timeout=10
            )
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "operation" in (invalid.value.details() or "")
        stale = journal_pb2.Fence(lease_name=f"task:{task.task_id}", token=1)
        with pytest.raises(grpc.aio.AioRpcError) as fenced:
            await client.call(
                "Commit", _receipt_commit(player, task.task_id, "s1", RUNNING, stale), timeout=10
            )
        assert fenced.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_reason(fenced.value) == STALE_FENCE
        with pytest.raises(grpc.aio.AioRpcError) as held:
            await client.call(
                "AcquireLease",
                journal_pb2.AcquireLeaseRequest(name="player:x", owner="a", ttl_seconds=30),
                timeout=10,
            )
            await client.call(
                "AcquireLease",
                journal_pb2.AcquireLeaseRequest(name="player:x", owner="b", ttl_seconds=30),
                timeout=10,
            )
        assert held.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        stream = client._stream  # noqa: SLF001 - the same stream carried every call
        answer = await client.call(
            "Commit", _receipt_commit(player, task.task_id, "s1", RUNNING), timeout=10
        )
        assert not answer.replayed
        assert client._stream is stream  # noqa: SLF001
    finally:
        await client.aclose()


async def test_concurrent_calls_share_the_stream_and_group_commits(
    service: _Service, channel: grpc.aio.Channel
) -> None:
    client = _client(channel)
    handled = RPC_HANDLED.labels(JOURNAL, "Multiplex/Commit", "OK")
    before_calls = handled._value.get()  # noqa: SLF001 - the counter's current value
    player = f"p-{uuid.uuid4()}"
    task = await _task(channel, player)
    groups_before = service.committer.groups
    try:
        answers = await asyncio.gather(
            *(
                client.call(
                    "Commit", _receipt_commit(player, task.task_id, f"s{i}", RUNNING), timeout=30
                )
                for i in range(40)
            )
        )
    finally:
        await client.aclose()
    assert all(not answer.replayed for answer in answers)
    assert handled._value.get() - before_calls == 40  # noqa: SLF001
    # Calls in flight together reached the writer together: fewer transactions than calls.
    assert service.committer.groups - groups_before < 40
    listed = await journal_pb2_grpc.JournalServiceStub(channel).GetStep(
        journal_pb2.GetStepRequest(step_id="s39", tool="test:write")
    )
    assert listed.receipt.state == RUNNING


class _GatedServicer(JournalServicer):
    """Commits wait for `gate` (tests of calls still in flight); `arrived` counts them."""

    gate: asyncio.Event
    arrived = 0

    async def Commit(self, request, context):  # type: ignore[no-untyped-def]
        self.arrived += 1
        await self.gate.wait()
        return await super().Commit(request, context)


async def test_a_call_past_its_timeout_fails_alone(engine: Engine) -> None:
    service = _Service(engine, _GatedServicer)
    service.servicer.gate = asyncio.Event()  # type: ignore[attr-defined]
    target = await service.start()
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            client = _client(channel)
            player = f"p-{uuid.uuid4()}"
            task = await _task(channel, player)
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await client.call(
                    "Commit", _receipt_commit(player, task.task_id, "s1", RUNNING), timeout=0.2
                )
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            service.servicer.gate.set()  # type: ignore[attr-defined]
            # The late call's answer comes and is dropped; the stream serves the next call.
            lease = await client.call(
                "AcquireLease",
                journal_pb2.AcquireLeaseRequest(name="player:t", owner="a", ttl_seconds=30),
                timeout=10,
            )
            assert lease.lease.owner == "a"
            await client.aclose()
    finally:
        await service.stop()
        service.committer.close()


async def test_a_broken_stream_fails_its_calls_and_the_next_call_reopens_it(
    engine: Engine,
) -> None:
    service = _Service(engine, _GatedServicer)
    service.servicer.gate = asyncio.Event()  # type: ignore[attr-defined]
    target = await service.start()
    port = int(target.rsplit(":", 1)[1])
    async with grpc.aio.insecure_channel(target) as channel:
        client = _client(channel)
        player = f"p-{uuid.uuid4()}"
        task = await _task(channel, player)
        stuck = asyncio.ensure_future(
            client.call("Commit", _receipt_commit(player, task.task_id, "s1", RUNNING), timeout=30)
        )
        await wait_until(lambda: service.servicer.arrived, what="the commit at the service")  # type: ignore[attr-defined]
        await service.stop()  # the service goes away with the call in flight
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await stuck
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        service.servicer.gate.set()  # type: ignore[attr-defined]
        await service.start(port)
        try:
            # Idempotent calls are retried while the channel reconnects.
            lease = await client.call(
                "AcquireLease",
                journal_pb2.AcquireLeaseRequest(name="player:r", owner="a", ttl_seconds=30),
                timeout=10,
                idempotent=True,
            )
            assert lease.lease.owner == "a"
            # The cut call may or may not have applied; retried with its request id, once.
            retried = await client.call(
                "Commit", _receipt_commit(player, task.task_id, "s1", RUNNING), timeout=10
            )
            assert retried.versions == []
        finally:
            await client.aclose()
            await service.stop()
            service.committer.close()


# -- the server loop alone ---------------------------------------------------------------------


async def _requests(*requests: journal_pb2.MultiplexCallsRequest) -> AsyncIterator[Any]:
    for request in requests:
        yield request
        await asyncio.sleep(0)


def _call(call_id: int, method: str, request: Any = None, **fields: Any) -> stream_pb2.StreamedCall:
    payload = request.SerializeToString() if request is not None else b""
    return stream_pb2.StreamedCall(call_id=call_id, method=method, request=payload, **fields)


def _lease_answer(answer: stream_pb2.StreamedAnswer) -> journal_pb2.AcquireLeaseResponse:
    assert answer.WhichOneof("outcome") == "response"
    return journal_pb2.AcquireLeaseResponse.FromString(answer.response)


async def test_bad_calls_are_refused_one_by_one() -> None:
    gate = asyncio.Event()

    async def acquire(request: Any, context: Any) -> journal_pb2.AcquireLeaseResponse:
        await gate.wait()
        return journal_pb2.AcquireLeaseResponse(lease=journal_pb2.Lease(name=request.name))

    server = MultiplexServer(SERVICE, {"AcquireLease": acquire}, max_in_flight=2)

    def lease(call_id: int, name: str) -> stream_pb2.StreamedCall:
        return _call(call_id, "AcquireLease", journal_pb2.AcquireLeaseRequest(name=name))

    requests = _requests(
        # Several calls in one message, and one alone.
        journal_pb2.MultiplexCallsRequest(
            calls=[
                stream_pb2.StreamedCall(call_id=1),  # no method
                # a request that is not an AcquireLeaseRequest: a field cut short
                stream_pb2.StreamedCall(call_id=6, method="AcquireLease", request=b"\x0a\x05ab"),
                lease(2, "a"),
                lease(2, "again"),  # id in flight
                lease(3, "b"),
            ]
        ),
        journal_pb2.MultiplexCallsRequest(
            calls=[
                lease(4, "c"),  # a third in flight
                _call(5, "Commit", journal_pb2.CommitRequest()),  # not served on this stream
            ]
        ),
    )
    answers: dict[int, list[stream_pb2.StreamedAnswer]] = {}
    stream = server.serve(requests)
    while sum(len(a) for a in answers.values()) < 5:  # the refusals come at once
        for answer in (await anext(stream)).answers:
            answers.setdefault(answer.call_id, []).append(answer)
    assert not any(a.WhichOneof("outcome") == "response" for v in answers.values() for a in v)
    gate.set()
    async for response in stream:
        for answer in response.answers:
            answers.setdefault(answer.call_id, []).append(answer)
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    unimplemented = grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert answers[1][0].error.code == invalid and "no method" in answers[1][0].error.message
    assert answers[6][0].error.code == invalid
    assert answers[6][0].error.message.startswith(
        "the request of AcquireLease could not be decoded"
    )
    assert [a.WhichOneof("outcome") for a in answers[2]] == ["error", "response"]
    assert answers[2][0].error.code == invalid and "in flight" in answers[2][0].error.message
    assert _lease_answer(answers[2][1]).lease.name == "a"
    assert _lease_answer(answers[3][0]).lease.name == "b"
    assert answers[4][0].error.code == exhausted
    # What a unary call of a method the service lacks answers, naming what the stream serves.
    assert answers[5][0].error.code == unimplemented
    assert answers[5][0].error.message == (
        "JournalService serves no 'Commit' on this stream; it serves AcquireLease"
    )


def test_a_server_refuses_handlers_of_rpcs_its_service_lacks() -> None:
    async def handler(request: Any, context: Any) -> Any:
        return None

    with pytest.raises(ValueError, match="no unary RPC Nope"):
        MultiplexServer(SERVICE, {"Nope": handler})
    with pytest.raises(ValueError, match="no unary RPC MultiplexCalls"):
        MultiplexServer(SERVICE, {"MultiplexCalls": handler})


async def test_a_client_refuses_a_method_or_request_its_service_lacks() -> None:
    client = MultiplexClient(lambda: None, SERVICE)
    with pytest.raises(ValueError, match="no unary RPC 'Nope'"):
        await client.call("Nope", journal_pb2.CommitRequest(), timeout=1)
    with pytest.raises(TypeError, match="Commit takes system.storage.v1.CommitRequest"):
        await client.call("Commit", journal_pb2.RecordStepRequest(), timeout=1)
    assert client.streams_opened == 0


async def test_an_unexpected_error_is_internal_with_the_request_id() -> None:
    async def broken(request: Any, context: Any) -> Any:
        raise RuntimeError("a bug")

    server = MultiplexServer(SERVICE, {"ReleaseLease": broken})
    request = journal_pb2.MultiplexCallsRequest(
        calls=[_call(7, "ReleaseLease", journal_pb2.ReleaseLeaseRequest(), request_id="rid-123")]
    )
    answers = [
        a
        for response in [r async for r in server.serve(_requests(request))]
        for a in response.answers
    ]
    assert len(answers) == 1 and answers[0].call_id == 7
    assert answers[0].error.code == grpc.StatusCode.INTERNAL.value[0]
    assert "rid-123" in answers[0].error.message and "a bug" not in answers[0].error.message


async def test_the_engine_falls_back_to_unary_calls_on_a_service_without_the_stream() -> None:
    """A storage service of an older version during a rolling upgrade: its stream is the old
    `Multiplex` (another envelope), never called; MultiplexCalls answers UNIMPLEMENTED."""
    from engine_service.clients import JournalStream

    asked: list[str] = []
    old_streams: list[object] = []

    async def acquire(request: Any, context: Any) -> journal_pb2.AcquireLeaseResponse:
        asked.append(request.name)
        return journal_pb2.AcquireLeaseResponse(lease=journal_pb2.Lease(name=request.name, token=9))

    async def old_multiplex(requests: Any, context: Any) -> AsyncIterator[bytes]:
        old_streams.append(context)
        async for _ in requests:
            yield b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                JOURNAL,
                {
                    "AcquireLease": grpc.unary_unary_rpc_method_handler(
                        acquire,
                        request_deserializer=journal_pb2.AcquireLeaseRequest.FromString,
                        response_serializer=journal_pb2.AcquireLeaseResponse.SerializeToString,
                    ),
                    "Multiplex": grpc.stream_stream_rpc_method_handler(old_multiplex),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    journal = Dependency(f"127.0.0.1:{port}", journal_pb2_grpc.JournalServiceStub)
    calls = JournalStream(journal)
    try:
        for name in ("player:a", "player:b"):
            answer = await calls.call(
                "AcquireLease",
                journal_pb2.AcquireLeaseRequest(name=name, owner="o", ttl_seconds=5),
                timeout=5,
            )
            assert answer.lease.token == 9
        assert calls.streams_opened == 1  # tried once, then unary
    finally:
        await calls.aclose()
        await journal.aclose()
        await server.stop(0)
    assert asked == ["player:a", "player:b"]
    assert old_streams == []


async def test_an_older_client_hears_unimplemented_and_makes_unary_calls(
    channel: grpc.aio.Channel,
) -> None:
    """An engine of the version before decision 0021 opens `Multiplex`, which this service no
    longer has: UNIMPLEMENTED, on which that engine makes its calls as unary RPCs."""
    old = channel.stream_stream(
        f"/{JOURNAL}/Multiplex", request_serializer=bytes, response_deserializer=bytes
    )
    call = old(timeout=10)
    # The service may end the stream before the write: then the write hears it.
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        # MultiplexRequest{calls: [MultiplexCall{call_id: 1, acquire_lease (13): {}}]}
        await call.write(b"\x0a\x04\x08\x01\x6a\x00")
        await call.read()
    assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_method_not_on_the_stream_goes_unary_alone(service: _Service) -> None:
    """A service whose stream lacks a method (one added to the stream by a newer client, say)
    answers UNIMPLEMENTED for it; that method goes unary from then on, the others stay."""
    from engine_service.clients import JournalStream

    assert service.host is not None
    journal = Dependency(service.host.target, journal_pb2_grpc.JournalServiceStub)
    calls = JournalStream(journal)
    player = f"p-{uuid.uuid4()}"
    try:
        made = await calls.call(
            "CreateTask",
            journal_pb2.CreateTaskRequest(player_id=player, module_id="system:test", event_key="e"),
            timeout=10,
        )
        for _ in range(2):
            got = await calls.call(
                "GetTask", journal_pb2.GetTaskRequest(task_id=made.task.task_id), timeout=10
            )
            assert got.task.task_id == made.task.task_id
        lease = await calls.call(
            "AcquireLease",
            journal_pb2.AcquireLeaseRequest(name="player:u", owner="a", ttl_seconds=30),
            timeout=10,
        )
        assert lease.lease.owner == "a"
        assert calls.streams_opened == 1
        assert calls._unary_only == {"GetTask"}  # noqa: SLF001
    finally:
        await calls.aclose()
        await journal.aclose()


class _SlowStream:
    """A stream call whose writes take a while (as on a busy connection), answering every
    call it is sent with an empty lease."""

    def __init__(self) -> None:
        self.written: list[journal_pb2.MultiplexCallsRequest] = []
        self._answers: asyncio.Queue[Any] = asyncio.Queue()

    async def write(self, message: journal_pb2.MultiplexCallsRequest) -> None:
        self.written.append(message)
        await asyncio.sleep(0.02)
        self._answers.put_nowait(
            journal_pb2.MultiplexCallsResponse(
                answers=[
                    stream_pb2.StreamedAnswer(
                        call_id=call.call_id,
                        response=journal_pb2.AcquireLeaseResponse(
                            lease=journal_pb2.Lease(
                                name=journal_pb2.AcquireLeaseRequest.FromString(call.request).name
                            )
                        ).SerializeToString(),
                    )
                    for call in message.calls
                ]
            )
        )

    async def read(self) -> Any:
        return await self._answers.get()

    def cancel(self) -> None:
        self._answers.put_nowait(grpc.aio.EOF)


async def test_calls_made_while_a_message_is_written_go_together_in_the_next() -> None:
    stream = _SlowStream()
    client = MultiplexClient(lambda: stream, SERVICE)

    def call(i: int) -> Any:
        return client.call("AcquireLease", journal_pb2.AcquireLeaseRequest(name=f"n{i}"), timeout=5)

    try:
        first = asyncio.ensure_future(call(0))
        await wait_until(lambda: stream.written, what="the first call's message being written")
        answers = [*await asyncio.gather(first, *(call(i) for i in range(1, 20)))]
    finally:
        await client.aclose()
    assert [a.lease.name for a in answers] == [f"n{i}" for i in range(20)]
    assert [len(message.calls) for message in stream.written] == [1, 19]
    assert {call.method for message in stream.written for call in message.calls} == {"AcquireLease"}


async def test_calls_made_in_the_same_turn_of_the_loop_go_in_one_message() -> None:
    """The writer lets the loop turn once before it writes: a call made a turn after the one
    that woke it joins the same message."""
    stream = _SlowStream()
    client = MultiplexClient(lambda: stream, SERVICE)

    async def call(i: int, turns: int) -> Any:
        for _ in range(turns):
            await asyncio.sleep(0)
        return await client.call(
            "AcquireLease", journal_pb2.AcquireLeaseRequest(name=f"n{i}"), timeout=5
        )

    try:
        await call(0, 0)  # the stream is open
        stream.written.clear()
        answers = await asyncio.gather(call(1, 0), call(2, 1))
    finally:
        await client.aclose()
    assert [a.lease.name for a in answers] == ["n1", "n2"]
    assert [len(message.calls) for message in stream.written] == [2]


async def test_answers_finishing_in_the_same_turn_of_the_loop_go_in_one_message() -> None:
    """The server lets the loop turn once after an answer is ready: one that finishes a turn
    later goes in the same message."""

    async def lease(request: Any, context: Any) -> journal_pb2.AcquireLeaseResponse:
        if request.name == "later":
            await asyncio.sleep(0)
        return journal_pb2.AcquireLeaseResponse(lease=journal_pb2.Lease(name=request.name))

    server = MultiplexServer(SERVICE, {"AcquireLease": lease})

    async def requests() -> AsyncIterator[journal_pb2.MultiplexCallsRequest]:
        yield journal_pb2.MultiplexCallsRequest(
            calls=[
                _call(n, "AcquireLease", journal_pb2.AcquireLeaseRequest(name=name))
                for n, name in enumerate(["now", "later"])
            ]
        )
        await asyncio.sleep(0.05)

    messages = [response async for response in server.serve(requests())]
    assert [len(message.answers) for message in messages] == [2]


async def test_calls_are_packed_into_messages_of_bounded_size() -> None:
    stream = _SlowStream()
    client = MultiplexClient(lambda: stream, SERVICE)
    big = "x" * (PACK_BYTES // 4)

    def call(i: int) -> Any:
        return client.call(
            "AcquireLease", journal_pb2.AcquireLeaseRequest(name=f"{i}{big}"), timeout=5
        )

    try:
        answers = await asyncio.gather(*(call(i) for i in range(10)))
        with pytest.raises(grpc.aio.AioRpcError) as huge:
            await client.call(
                "AcquireLease",
                journal_pb2.AcquireLeaseRequest(name="y" * (MAX_ITEM_BYTES + 1)),
                timeout=5,
            )
        assert huge.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        after = await call(10)  # the stream goes on
    finally:
        await client.aclose()
    assert [a.lease.name[:1] for a in answers] == [str(i) for i in range(10)]
    assert after.lease.name.startswith("10")
    sizes = [message.ByteSize() for message in stream.written]
    assert len(sizes) >= 3 and max(sizes) <= PACK_BYTES + 1024
    assert sum(len(message.calls) for message in stream.written) == 11  # the huge one not sent


async def test_an_answer_too_large_for_a_message_is_refused_alone() -> None:
    async def record(request: Any, context: Any) -> journal_pb2.RecordStepResponse:
        size = MAX_ITEM_BYTES + 1 if request.step_id == "huge" else 10
        return journal_pb2.RecordStepResponse(
            receipt=journal_pb2.StepReceipt(step_id=request.step_id, result=b"r" * size)
        )

    server = MultiplexServer(SERVICE, {"RecordStep": record})
    request = journal_pb2.MultiplexCallsRequest(
        calls=[
            _call(n, "RecordStep", journal_pb2.RecordStepRequest(step_id=step))
            for n, step in enumerate(["small", "huge", "also-small"])
        ]
    )
    answers = {
        answer.call_id: answer
        async for response in server.serve(_requests(request))
        for answer in response.answers
    }

    def step(answer: stream_pb2.StreamedAnswer) -> str:
        return journal_pb2.RecordStepResponse.FromString(answer.response).receipt.step_id

    assert step(answers[0]) == "small"
    assert answers[1].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert step(answers[2]) == "also-small"


async def test_a_calls_timeout_is_its_deadline_on_the_server() -> None:
    """The client sends each call's timeout (`timeout_ms`) and the handler sees it as its
    request's deadline, as on a unary call (the gateway's relay waits on the game server that
    long)."""

    from services.runtime.context import remaining_seconds

    seen: list[float | None] = []

    async def call_tool(request: Any, context: Any) -> relay_pb2.CallGameToolResponse:
        seen.append(remaining_seconds())
        return relay_pb2.CallGameToolResponse()

    server = MultiplexServer(RELAY, {"CallGameTool": call_tool})
    written: list[relay_pb2.MultiplexCallsRequest] = []

    class Loopback:
        """A stream call served by `server` in this process."""

        def __init__(self) -> None:
            self._in: asyncio.Queue[Any] = asyncio.Queue()
            self._out = server.serve(self._requests())

        async def _requests(self) -> AsyncIterator[Any]:
            while (request := await self._in.get()) is not None:
                yield request

        async def write(self, message: relay_pb2.MultiplexCallsRequest) -> None:
            written.append(message)
            self._in.put_nowait(message)

        async def read(self) -> Any:
            return await anext(self._out)

        def cancel(self) -> None:
            self._in.put_nowait(None)

    client = MultiplexClient(Loopback, RELAY)
    try:
        request = relay_pb2.CallGameToolRequest(call_id="c", player_id="p", tool="t")
        await client.call("CallGameTool", request, timeout=0.5)
        await client.call("CallGameTool", request, timeout=None)
    finally:
        await client.aclose()
    sent = [call.timeout_ms for m in written for call in m.calls]
    assert 400 < sent[0] <= 500 and sent[1] == 0
    assert seen[0] is not None and 0.3 < seen[0] <= 0.5
    assert seen[1] is None


def test_only_a_call_that_found_no_connection_counts_as_never_sent() -> None:
    def error(code: grpc.StatusCode, details: str, reason: str = "") -> grpc.aio.AioRpcError:
        trailing = grpc.aio.Metadata(("x-error-reason", reason)) if reason else grpc.aio.Metadata()
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)

    unavailable = grpc.StatusCode.UNAVAILABLE
    refused = "failed to connect to all addresses; last error: UNKNOWN: Connection refused"
    assert never_sent(error(unavailable, refused))
    assert never_sent(error(unavailable, "the stream ended", NOT_SENT))
    # A connection that broke may have carried the call; so may a deadline.
    assert not never_sent(error(unavailable, "Socket closed"))
    assert not never_sent(error(unavailable, "Stream removed"))
    assert not never_sent(error(grpc.StatusCode.DEADLINE_EXCEEDED, refused))
    assert not never_sent(ValueError(refused))
