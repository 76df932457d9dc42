"""One interactive run per player across engine replicas: two in-process engines on one storage
service (SQLite, and PostgreSQL when a server is available) hold the `player:<id>` lease;
duplicates share one run; CancelRun stops a run and gives the lease back; storage down fails
closed; a player's CANCEL control through the whole chain stops a slow run."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import pathlib
import time
import tracemalloc
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from system.common.v1 import catalog_pb2, common_pb2
from system.engine.v1 import engine_pb2, engine_pb2_grpc
from system.gateway.v1 import gateway_pb2
from system.storage.v1 import journal_pb2, journal_pb2_grpc, storage_pb2, storage_pb2_grpc

from engine_service.app import create_app as create_engine
from engine_service.config import EngineConfig
from engine_service.engine import BoundedExecutor
from engine_service.modules import BUILTIN_MODULES
from engine_service.registry import ExecutionPolicy, ModuleRegistry, ModuleSpec
from services.results import AgentFailure, card, succeeded
from services.runtime.errors import ResourceExhausted, Unavailable
from storage_service.app import create_app as create_storage
from storage_service.config import StorageConfig
from tests.inprocess import running_chain
from tests.waiting import holds_for, wait_until

HOST = {"port": 0, "metrics_port": -1, "drain_seconds": 0, "grace_seconds": 1}
SLOW = "test:slow"
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED


class SlowModule:
    """Waits until released (or cancelled); counts starts, finishes and cancellations."""

    def __init__(self) -> None:
        self.spec = ModuleSpec(
            module_id=SLOW,
            description={"en": "Waits.", "zh": "等待。"},
            input_schema={
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "additionalProperties": False,
            },
            # A run that may write holds the player's lease (a read-only one needs none).
            policy=ExecutionPolicy(write_steps=1),
        )
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.runs = 0
        self.active = 0
        self.per_player: dict[str, int] = {}
        self.peak = 0  # most runs of one player at once
        self.cancelled = 0

    async def run(self, data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
        self.runs += 1
        self.active += 1
        player = ctx.player.player_id
        self.per_player[player] = self.per_player.get(player, 0) + 1
        self.peak = max(self.peak, self.per_player[player])
        self.started.set()
        try:
            await self.gate.wait()
            return succeeded(card("test:card", f"done {data.get('n', 0)}", []))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1
            self.per_player[player] -= 1


class TickModule:
    """Handles `test:tick` events; every run waits until released and counts itself."""

    def __init__(self) -> None:
        self.spec = ModuleSpec(
            module_id="test:tick",
            description={"en": "Ticks.", "zh": "计时。"},
            input_schema={"type": "object", "additionalProperties": True},
            routing_mode=catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY,
            interactive=False,
            event_allowed=True,
            events=("test:tick",),
        )
        self.gate = asyncio.Event()
        self.runs = 0
        self.by_player: Counter[str] = Counter()

    async def run(self, data: dict[str, Any], ctx: Any) -> common_pb2.AgentResult:
        await self.gate.wait()
        self.runs += 1
        self.by_player[ctx.player.player_id] += 1
        return succeeded(card("test:card", "tick", []))


def _registry(module: SlowModule, *more: Any) -> ModuleRegistry:
    registry = ModuleRegistry()
    for module_class in BUILTIN_MODULES:
        registry.register(module_class())
    registry.register(module)
    for extra in more:
        registry.register(extra)
    registry.freeze()
    return registry


def _player(player_id: str = "p-1") -> common_pb2.PlayerContext:
    return common_pb2.PlayerContext(server_id="s", player_id=player_id, language="en")


def _request(
    player_id: str = "p-1", n: int = 0, text: str = "", request_id: str = ""
) -> engine_pb2.ExecuteRequest:
    data = struct_pb2.Struct()
    data.update({"n": n})
    return engine_pb2.ExecuteRequest(
        player=_player(player_id),
        action=common_pb2.ModuleAction(module_id=SLOW, input=data),
        source=engine_pb2.ROUTE_SOURCE_INVOKE,
        request_text=text,
        request_id=request_id,
    )


@dataclasses.dataclass
class Replicas:
    module: SlowModule
    stubs: list[engine_pb2_grpc.EngineServiceStub]
    journal: journal_pb2_grpc.JournalServiceStub
    storage_target: str
    apps: list[Any] = dataclasses.field(default_factory=list)
    storage: Any = None


@contextlib.asynccontextmanager
async def _replicas(
    database_url: str, count: int = 2, more: tuple[Any, ...] = (), **settings: Any
) -> AsyncIterator[Replicas]:
    storage = await create_storage(StorageConfig(**HOST, database_url=database_url))
    await storage.host.start()
    module = SlowModule()
    engines = []
    channels = []
    try:
        for i in range(count):
            engine = await create_engine(
                EngineConfig(
                    **HOST,
                    storage_target=storage.host.target,
                    gateway_target="127.0.0.1:1",
                    replica_id=f"replica-{i}",
                    player_lease_seconds=2,
                    **settings,
                )
            )
            engine.engine.registry = _registry(module, *more)
            await engine.host.start()
            engines.append(engine)
            channels.append(grpc.aio.insecure_channel(engine.host.target))
        channels.append(grpc.aio.insecure_channel(storage.host.target))
        running = Replicas(
            module,
            [engine_pb2_grpc.EngineServiceStub(channel) for channel in channels[:-1]],
            journal_pb2_grpc.JournalServiceStub(channels[-1]),
            storage.host.target,
            engines,
            storage,
        )
        yield running
        storage = running.storage  # a test may have restarted it
    finally:
        module.gate.set()
        for channel in channels:
            await channel.close()
        for engine in reversed(engines):
            await engine.host.stop()
            await engine.aclose()
        await storage.host.stop()
        await storage.aclose()


@pytest.fixture(params=["sqlite", "postgres"])
async def replicas(
    request: pytest.FixtureRequest, tmp_path: pathlib.Path
) -> AsyncIterator[Replicas]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'storage.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    async with _replicas(url) as running:
        yield running


async def _started(module: SlowModule) -> None:
    await asyncio.wait_for(module.started.wait(), 5)
    module.started.clear()


async def _lease_freed(journal: journal_pb2_grpc.JournalServiceStub, player_id: str) -> None:
    """Returns once the player's lease is free: it is released in the background right after
    a run, so it may take a moment."""

    async def free() -> bool:
        return await _lease_holder(journal, player_id) == ""

    await wait_until(free, timeout=2, interval=0.02, what=f"{player_id}'s lease released")


async def _lease_holder(journal: journal_pb2_grpc.JournalServiceStub, player_id: str) -> str:
    """Who holds the player's lease now, or "" (taken and released at once by a probe)."""
    try:
        reply = await journal.AcquireLease(
            journal_pb2.AcquireLeaseRequest(
                name=f"player:{player_id}", owner="probe", ttl_seconds=1
            )
        )
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
        return exc.details() or "held"
    await journal.ReleaseLease(
        journal_pb2.ReleaseLeaseRequest(
            name=f"player:{player_id}", owner="probe", token=reply.lease.token
        )
    )
    return ""


async def test_second_replica_is_busy_while_the_player_runs_then_succeeds(
    replicas: Replicas,
) -> None:
    first, second = replicas.stubs
    running = asyncio.ensure_future(first.Execute(_request(n=1), timeout=10))
    await _started(replicas.module)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await second.Execute(_request(n=2), timeout=5)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The same replica refuses a different request of the player too.
    with pytest.raises(grpc.aio.AioRpcError) as local:
        await first.Execute(_request(n=3), timeout=5)
    assert local.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    replicas.module.gate.set()
    assert (await running).result.status == SUCCEEDED
    after = await second.Execute(_request(n=2), timeout=5)
    assert after.result.status == SUCCEEDED
    assert replicas.module.runs == 2
    assert replicas.module.peak == 1  # never two runs of the player at once
    await _lease_freed(replicas.journal, "p-1")


async def test_different_players_run_concurrently(replicas: Replicas) -> None:
    first, second = replicas.stubs
    calls = [
        asyncio.ensure_future(first.Execute(_request("p-1"), timeout=10)),
        asyncio.ensure_future(second.Execute(_request("p-2"), timeout=10)),
        asyncio.ensure_future(first.Execute(_request("p-3"), timeout=10)),
    ]
    await wait_until(lambda: replicas.module.active == 3, what="three players' runs at once")
    replicas.module.gate.set()
    for call in calls:
        assert (await call).result.status == SUCCEEDED


async def test_duplicates_share_one_run(replicas: Replicas) -> None:
    stub = replicas.stubs[0]
    first = asyncio.ensure_future(stub.Execute(_request("p-dup", n=7, text="again"), timeout=10))
    await _started(replicas.module)
    duplicates = [
        asyncio.ensure_future(stub.Execute(_request("p-dup", n=7, text="again"), timeout=10))
        for _ in range(3)
    ]
    # The duplicates must reach the run before it ends (a fixed pause is too short on a busy
    # machine): the engine counts each one it joins to the run.
    run = replicas.apps[0].engine.runs.running("p-dup")
    await wait_until(lambda: run.duplicates == 3, what="three duplicates joined to the run")
    replicas.module.gate.set()
    results = [(await call).result for call in [first, *duplicates]]
    assert replicas.module.runs == 1
    assert all(result == results[0] for result in results)
    assert results[0].status == SUCCEEDED
    # One exchange in history, not four (written before the lease is released).
    await _lease_freed(replicas.journal, "p-dup")
    async with grpc.aio.insecure_channel(replicas.storage_target) as channel:
        page = await storage_pb2_grpc.StorageServiceStub(channel).ListHistory(
            storage_pb2.ListHistoryRequest(player_id="p-dup")
        )
    assert len(page.entries) == 2


async def test_cancel_run_stops_the_run_and_releases_the_lease(replicas: Replicas) -> None:
    first, second = replicas.stubs
    running = asyncio.ensure_future(
        first.Execute(_request("p-cancel", request_id="req-1"), timeout=10)
    )
    await _started(replicas.module)
    assert await _lease_holder(replicas.journal, "p-cancel") != ""
    wrong = await first.CancelRun(
        engine_pb2.CancelRunRequest(player=_player("p-cancel"), request_id="other"), timeout=5
    )
    assert not wrong.cancelled
    other_replica = await second.CancelRun(engine_pb2.CancelRunRequest(player=_player("p-cancel")))
    assert not other_replica.cancelled  # runs are cancelled on the replica that runs them
    reply = await first.CancelRun(
        engine_pb2.CancelRunRequest(player=_player("p-cancel"), request_id="req-1"), timeout=5
    )
    assert reply.cancelled
    result = (await running).result
    assert result.status == common_pb2.RESULT_STATUS_FAILED
    assert result.failure.key == AgentFailure.CANCELLED.value
    assert replicas.module.cancelled == 1
    await _lease_freed(replicas.journal, "p-cancel")
    # A new request of the player runs at once, on either replica.
    replicas.module.gate.set()
    started = time.monotonic()
    assert (await second.Execute(_request("p-cancel", n=1), timeout=5)).result.status == SUCCEEDED
    assert time.monotonic() - started < 1.5
    # No history entry for the cancelled run: only the second exchange.
    await _lease_freed(replicas.journal, "p-cancel")
    async with grpc.aio.insecure_channel(replicas.storage_target) as channel:
        page = await storage_pb2_grpc.StorageServiceStub(channel).ListHistory(
            storage_pb2.ListHistoryRequest(player_id="p-cancel")
        )
    assert len(page.entries) == 2


async def test_a_run_whose_player_lease_is_taken_over_stops(replicas: Replicas) -> None:
    """The lease is acquired again (a newer token) behind the running replica's back, as a
    takeover after an expiry would do: its next renewal is refused and the run stops rather
    than go on without exclusivity."""
    first, _ = replicas.stubs
    running = asyncio.ensure_future(first.Execute(_request("p-lost"), timeout=15))
    await _started(replicas.module)
    await replicas.journal.AcquireLease(
        journal_pb2.AcquireLeaseRequest(
            # The replica's own lease owner (`<replica_id>#<incarnation>`, decision 0014).
            name="player:p-lost",
            owner=replicas.apps[0].identity.owner,
            ttl_seconds=30,
        ),
        timeout=5,
    )
    result = (await running).result
    assert result.status == common_pb2.RESULT_STATUS_FAILED
    assert result.failure.key == AgentFailure.STORAGE_UNAVAILABLE.value
    assert result.failure.message.startswith("Your data could not be saved just now")
    assert replicas.module.cancelled == 1


async def test_cancel_run_without_player_is_invalid(replicas: Replicas) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await replicas.stubs[0].CancelRun(engine_pb2.CancelRunRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_storage_down_is_unavailable_and_nothing_runs(tmp_path: pathlib.Path) -> None:
    async with _replicas(f"sqlite:///{tmp_path / 'storage.db'}", count=1) as running:
        # A third engine pointed at a storage address where nothing listens.
        engine = await create_engine(
            EngineConfig(
                **HOST,
                storage_target="127.0.0.1:1",
                gateway_target="127.0.0.1:1",
                player_lease_seconds=2,
            )
        )
        engine.engine.registry = _registry(running.module)
        await engine.host.start()
        engine_target = engine.host.target
        try:
            async with grpc.aio.insecure_channel(engine_target) as channel:
                stub = engine_pb2_grpc.EngineServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Execute(_request(), timeout=10)
        finally:
            await engine.host.stop()
            await engine.aclose()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert running.module.runs == 0


async def test_a_restarted_storage_serves_the_next_run(tmp_path: pathlib.Path) -> None:
    """The engine's journal calls travel on one stream (decision 0008): when storage restarts,
    the stream ends, and the next run's begin goes out on a new one."""
    url = f"sqlite:///{tmp_path / 'storage.db'}"
    async with _replicas(url, count=1) as running:
        running.module.gate.set()
        (stub,) = running.stubs
        assert (await stub.Execute(_request(n=1), timeout=10)).result.status == SUCCEEDED
        await _lease_freed(running.journal, "p-1")
        port = int(running.storage_target.rsplit(":", 1)[1])
        old = running.storage
        await old.host.stop()
        await old.aclose()
        again = await create_storage(StorageConfig(**{**HOST, "port": port}, database_url=url))
        await again.host.start()
        running.storage = again
        after = await stub.Execute(_request(n=2), timeout=10)
        assert after.result.status == SUCCEEDED
        assert running.module.runs == 2  # each run once: it begins only once its lease is held


async def test_players_cancel_control_stops_a_slow_run(tmp_path: pathlib.Path) -> None:
    async with running_chain(tmp_path) as chain:
        module = SlowModule()
        chain.apps["engine"].engine.registry = _registry(module)
        client = await chain.client()
        await client.join("steve", "Steve", "en")
        invoke = gateway_pb2.Invoke(call=common_pb2.ModuleAction(module_id=SLOW))
        pending = asyncio.ensure_future(client.request("steve", 10, invoke=invoke))
        await _started(module)
        await client.control("steve", gateway_pb2.CONTROL_ACTION_CANCEL)
        response = await asyncio.wait_for(pending, 5)
        assert response.reply.result.failure.key == AgentFailure.CANCELLED.value
        await wait_until(lambda: module.active == 0, what="the slow run to stop")
        assert module.cancelled == 1
        # The player's lease is free again: the next run starts at once.
        module.gate.set()
        started = time.monotonic()
        again = await client.request("steve", 10, invoke=invoke)
        assert again.reply.result.status == SUCCEEDED
        assert time.monotonic() - started < 2


# -- a burst ten times the queue --------------------------------------------------------------


async def _burst(running: Replicas, size: int, tag: str) -> tuple[int, int]:
    """Sends `size` requests of different players at once while the module holds every run.
    Returns (busy, succeeded); asserts every BUSY answer came back while the accepted runs
    were still held, i.e. refusals never waited for the queue."""
    module = running.module
    module.gate.clear()
    stub = running.stubs[0]
    calls = [
        asyncio.ensure_future(stub.Execute(_request(f"{tag}-{i}", n=i), timeout=60))
        for i in range(size)
    ]
    capacity = WORKERS + QUEUE
    busy = 0
    pending = set(calls)
    while busy < size - capacity:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for call in done:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                call.result()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            busy += 1
    # Every refusal came back while all accepted runs were still held.
    assert len(pending) == capacity and not any(call.done() for call in pending)
    # The accepted ones reach the workers once their leases are taken.
    await wait_until(lambda: module.active == WORKERS, what="every worker busy")
    module.gate.set()
    results = await asyncio.gather(*pending)
    return busy, sum(r.result.status == SUCCEEDED for r in results)


WORKERS, QUEUE = 2, 8  # the seed's 4/32 scaled down: the burst's lease writes stay light


async def test_a_burst_ten_times_the_queue_gets_busy_at_once_and_leaves_nothing(
    tmp_path: pathlib.Path,
) -> None:
    async with _replicas(
        f"sqlite:///{tmp_path / 'storage.db'}",
        count=1,
        interactive_workers=WORKERS,
        interactive_queue=QUEUE,
    ) as running:
        engine = running.apps[0].engine
        size = 10 * (WORKERS + QUEUE)
        expected = (size - WORKERS - QUEUE, WORKERS + QUEUE)
        assert await _burst(running, size, "warm") == expected  # warms caches and pools
        gc.collect()
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            assert await _burst(running, size, "burst") == expected
            await _until_idle(engine)
            gc.collect()
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # Nothing of the burst stays behind: no runs, snapshots or queue places, and memory
        # back near where it was (allocator slack and logging buffers aside).
        assert engine.interactive._admitted == 0
        assert not engine.runs._runs
        assert not engine.players._players
        assert after - before < 2 * 1024 * 1024, f"{(after - before) / 1024:.0f} KiB kept"


async def _until_idle(engine: Any) -> None:
    await wait_until(
        lambda: engine.interactive._admitted == 0 and not engine.runs._runs,
        timeout=10,
        interval=0.05,
        what="the engine idle: no queue places or runs left",
    )


async def test_shutdown_cancels_queued_work_and_refuses_more() -> None:
    executor = BoundedExecutor("test", workers=1, queue=2)
    gate = asyncio.Event()

    async def job() -> str:
        await gate.wait()
        return "done"

    running = asyncio.ensure_future(executor.run(job))
    queued = [asyncio.ensure_future(executor.run(job)) for _ in range(2)]
    await wait_until(lambda: executor._admitted == 3, what="one job running, two queued")
    with pytest.raises(ResourceExhausted):
        await executor.run(job)
    assert executor.shutdown() == 2
    for call in queued:
        with pytest.raises(asyncio.CancelledError):
            await call
    with pytest.raises(Unavailable):
        await executor.run(job)
    gate.set()
    assert await running == "done"  # running work finishes
    assert executor._admitted == 0


async def _submit_ticks(running: Replicas, player_id: str, count: int) -> None:
    """`count` test:tick events of an online player, one task each."""
    for i in range(count):
        await running.stubs[0].SubmitEvent(
            engine_pb2.SubmitEventRequest(
                player=_player(player_id),
                event_type="test:tick",
                event_key=f"{player_id}-{i}",
                player_online=True,
            ),
            timeout=5,
        )


class _HeldEnds:
    """Holds back every task end (the final `store_steps`) of an engine replica until
    `release`; counts the ends that arrived."""

    def __init__(self, app: Any) -> None:
        self.arrived = 0
        self._released = asyncio.Event()
        store = app.runner_tasks
        real_store_steps = store.store_steps

        async def held(*args: Any, **kwargs: Any) -> Any:
            self.arrived += 1
            await self._released.wait()
            return await real_store_steps(*args, **kwargs)

        store.store_steps = held

    def release(self) -> None:
        self._released.set()


async def _states(running: Replicas, player_id: str) -> list[int]:
    listed = await running.journal.ListTasks(
        journal_pb2.ListTasksRequest(player_id=player_id), timeout=5
    )
    return [task.state for task in listed.tasks]


async def test_an_event_backlog_is_claimed_in_batches(database_url: str) -> None:
    """Claimed tasks wait their turn in the event executor's queue, so the runner claims again
    only once they run low (decision 0007): a backlog takes a few claims, not one per finished
    task."""
    ticks = TickModule()
    async with _replicas(database_url, count=1, more=(ticks,)) as running:
        store = running.apps[0].runner_tasks
        claims: list[int] = []  # tasks each claim got
        real_claim = store.claim

        async def counted_claim(*args: Any, **kwargs: Any) -> Any:
            got = await real_claim(*args, **kwargs)
            claims.append(len(got))
            return got

        store.claim = counted_claim  # type: ignore[method-assign]
        tasks = 40
        await _submit_ticks(running, "p-ticks", tasks)
        # Nothing finishes yet: the runner holds what it claimed while it had room, the rest
        # stays in storage, where another replica could take it.
        await wait_until(lambda: sum(claims) > 0, what="a first claim")
        await holds_for(
            lambda: sum(claims) < tasks,
            0.3,
            what=lambda: f"the runner holds only part of the backlog, claims: {claims}",
        )
        ticks.gate.set()
        await wait_until(lambda: ticks.runs == tasks, timeout=10, interval=0.02, what="every tick")
        assert sum(claims) == tasks
        # One claim per finished task would make 40 and more; claiming only once four or
        # fewer are left makes a handful (the last ones find nothing, a poll may add one).
        assert len(claims) <= 12, claims


async def test_workers_do_not_wait_for_the_ends_of_earlier_tasks(database_url: str) -> None:
    """Storing how a task ended is not a worker's job (decision 0032): while the ends of the
    tasks claimed first are still being stored, the runner claims more and the workers run
    them, instead of idling until those writes come back. The ends in flight stay bounded."""
    ticks = TickModule()
    ticks.gate.set()
    workers, queue = 2, 4  # capacity 6: the backlog takes several claims
    async with _replicas(
        database_url, count=1, more=(ticks,), event_workers=workers, event_queue=queue
    ) as running:
        ends = _HeldEnds(running.apps[0])
        tasks = 16
        await _submit_ticks(running, "p-ends", tasks)
        # Twice as many modules run as the executor holds, every end still waiting: the
        # first claim's ends did not keep the workers from the next claim's tasks. No more:
        # the ends in flight are bounded at one executor's worth beyond it.
        bound = 2 * (workers + queue)
        await wait_until(
            lambda: ticks.by_player["p-ends"] == bound,
            timeout=10,
            interval=0.02,
            what=f"{bound} modules run",
        )
        await holds_for(
            lambda: ticks.by_player["p-ends"] == bound,
            0.3,
            what=lambda: f"{ticks.by_player['p-ends']} run",
        )
        assert ends.arrived == bound
        ends.release()
        await wait_until(
            lambda: ticks.by_player["p-ends"] == tasks and not running.apps[0].runner._runs,
            timeout=10,
            what=lambda: (
                f"every task run and its end stored: {ticks.by_player['p-ends']} run, "
                f"{len(running.apps[0].runner._runs)} held"
            ),
        )
        assert await _states(running, "p-ends") == [journal_pb2.TASK_STATE_SUCCEEDED] * tasks


async def test_a_stopping_runner_lets_the_ends_being_stored_finish(database_url: str) -> None:
    """A task whose module has run is only storing how it ended when the replica stops: the
    runner waits for that write instead of cancelling it, so the task is not run again by the
    next replica to claim it."""
    ticks = TickModule()
    ticks.gate.set()
    async with _replicas(database_url, count=1, more=(ticks,)) as running:
        app = running.apps[0]
        ends = _HeldEnds(app)
        await _submit_ticks(running, "p-stop", 3)
        await wait_until(lambda: ticks.by_player["p-stop"] == 3, what="every module run")
        stopping = asyncio.ensure_future(app.runner.stop())
        await holds_for(lambda: not stopping.done(), 0.3, what="the stop waits for the ends")
        ends.release()
        await asyncio.wait_for(stopping, 10)
        assert await _states(running, "p-stop") == [journal_pb2.TASK_STATE_SUCCEEDED] * 3
        assert ticks.by_player["p-stop"] == 3
