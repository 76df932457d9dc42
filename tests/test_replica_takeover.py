"""A restarted engine replica takes back its own leases at once (decision 0014).

Storage (`ReleaseEarlierIncarnations`, on SQLite and PostgreSQL): only leases of earlier
incarnations of the caller's name end, never its own incarnation's or another name's; their
fences go stale and their RUNNING tasks are claimable at once; bad input is INVALID_ARGUMENT.
End to end: a replica killed with -9 mid-task and restarted under its name finishes the task
from its receipts with task leases of an hour, which only the takeover can explain; a replica
of another name leaves those leases alone, and a live replica is not harmed by another's
start."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import socket
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker
from system.engine.v1 import engine_pb2, engine_pb2_grpc
from system.gateway.v1 import gateway_pb2
from system.storage.v1 import journal_pb2, journal_pb2_grpc

from engine_service.config import EngineConfig
from engine_service.engine import BoundedExecutor
from engine_service.events import EventRunner
from engine_service.replica import JournalIncarnations, ReplicaIdentity, replica_identity
from services.runtime.config import ConfigError
from services.runtime.errors import (
    STALE_FENCE,
    FailedPrecondition,
    InvalidArgument,
    ServiceError,
    Unavailable,
)
from services.runtime.server import ServiceHost
from storage_service.app import ACCESS
from storage_service.app import create_app as create_storage
from storage_service.config import StorageConfig
from storage_service.history import ConversationStore, HistoryBounds
from storage_service.journal import JournalBounds, JournalStore
from storage_service.journal_servicer import JournalServicer
from storage_service.leases import LeaseRow
from storage_service.runs import RunStore
from tests.service_process import ServiceProcess, free_port
from tests.test_engine_events import (
    ADVANCEMENT,
    DIAMOND,
    REWARD,
    Stack,
    _data,
    _engine,
    _player,
    _stack,
    _stop,
)
from tests.waiting import wait_until

RUNNING = journal_pb2.TASK_STATE_RUNNING
HOUR = 3600


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(sessions: sessionmaker, clock: Clock) -> JournalStore:  # type: ignore[type-arg]
    return JournalStore(sessions, JournalBounds(), clock)


def _owners(sessions: sessionmaker) -> dict[str, str | None]:  # type: ignore[type-arg]
    with sessions() as session:
        return {
            name: owner for name, owner in session.execute(select(LeaseRow.name, LeaseRow.owner))
        }


def _task(store: JournalStore) -> journal_pb2.EventTask:
    task, _, _ = store.create_task(f"p-{uuid.uuid4()}", "system:sign_in", None, f"e-{uuid.uuid4()}")
    return task


def _fence(claim: journal_pb2.TaskClaim) -> journal_pb2.Fence:
    return journal_pb2.Fence(lease_name=claim.lease.name, token=claim.lease.token)


# -- storage -------------------------------------------------------------------------------------


def test_only_earlier_incarnations_of_the_name_lose_their_leases(
    store: JournalStore,
    sessions: sessionmaker,  # type: ignore[type-arg]
    clock: Clock,
) -> None:
    held = {
        "task:old": "eng:1#old",  # earlier incarnation, live
        "player:p": "eng:1#old",  # a player's lease of it too
        "task:older": "eng:1#older",  # an even earlier one, expired since
        "task:mine": "eng:1#new",  # the caller's own incarnation
        "task:longer": "eng:12#x",  # another name that starts with the caller's
        "task:other": "other#old",  # another name
        "task:bare": "eng:1",  # an owner without an incarnation is another name
        "task:like": "eXg%1#z",  # would match `e_g%1#%` read as a LIKE pattern
    }
    tokens = {}
    for name, owner in held.items():
        ttl = 1 if name == "task:older" else HOUR
        tokens[name] = store.acquire_lease(name, owner, ttl).token
    clock.now += dt.timedelta(seconds=2)  # task:older has expired, never released

    assert store.release_earlier_incarnations("eng:1", "new") == 3
    owners = _owners(sessions)
    for name in ("task:old", "player:p", "task:older"):
        assert owners[name] is None, name
    for name in ("task:mine", "task:longer", "task:other", "task:bare", "task:like"):
        assert owners[name] == held[name], name
    # A name holding LIKE wildcards matches only itself.
    assert store.release_earlier_incarnations("e_g%1", "new") == 0
    assert _owners(sessions)["task:like"] == "eXg%1#z"

    # The earlier incarnation can no longer renew; the others still can.
    with pytest.raises(FailedPrecondition, match="not held"):
        store.renew_lease("task:old", "eng:1#old", tokens["task:old"], HOUR)
    store.renew_lease("task:mine", "eng:1#new", tokens["task:mine"], HOUR)
    store.renew_lease("task:other", "other#old", tokens["task:other"], HOUR)
    # Tokens are kept: the next acquisition's is larger.
    again = store.acquire_lease("player:p", "eng:1#new", HOUR)
    assert again.token > tokens["player:p"]
    # Asking again changes nothing (the own incarnation's new lease included).
    assert store.release_earlier_incarnations("eng:1", "new") == 0
    assert _owners(sessions)["player:p"] == "eng:1#new"


def test_an_earlier_incarnations_running_task_is_claimable_at_once_and_its_fence_stale(
    store: JournalStore,
) -> None:
    task = _task(store)
    (dead,) = store.claim_tasks("eng:1#old", 1, HOUR)
    store.record_step(f"{task.task_id}/0", task.task_id, 0, "t.t", fence=_fence(dead))
    # Another name's start, or the dead incarnation's name with another name's prefix,
    # leaves it alone: nobody can claim it before the hour is up.
    assert store.release_earlier_incarnations("other", "x") == 0
    assert store.release_earlier_incarnations("eng:", "x") == 0
    assert store.claim_tasks("other#x", 10, HOUR) == []

    assert store.release_earlier_incarnations("eng:1", "new") == 1
    (taken,) = store.claim_tasks("eng:1#new", 10, HOUR)
    assert taken.task.task_id == task.task_id
    assert taken.task.state == RUNNING and taken.task.attempts == 2
    assert taken.lease.owner == "eng:1#new" and taken.lease.token > dead.lease.token
    # The receipt the dead incarnation recorded is there to recover from.
    assert store.get_step(f"{task.task_id}/0", "t.t").state == journal_pb2.STEP_STATE_RUNNING
    # Every write of the dead incarnation is refused as stale.
    with pytest.raises(FailedPrecondition, match="stale fence") as refused:
        store.transition_task(task.task_id, journal_pb2.TASK_STATE_SUCCEEDED, fence=_fence(dead))
    assert refused.value.reason == STALE_FENCE
    with pytest.raises(FailedPrecondition, match="stale fence"):
        store.record_step(f"{task.task_id}/1", task.task_id, 1, "t.t", fence=_fence(dead))
    # The new incarnation's start does not touch what it claimed since.
    assert store.release_earlier_incarnations("eng:1", "new") == 0
    store.renew_lease(taken.lease.name, "eng:1#new", taken.lease.token, HOUR)


@pytest.mark.parametrize(
    ("name", "incarnation", "message"),
    [
        ("", "i", "name is required"),
        ("a#b", "i", "name must not contain '#'"),
        ("n", "", "incarnation is required"),
        ("n", "i#2", "incarnation must not contain '#'"),
        ("n\x00", "i", "NUL"),
        ("n\n", "i", "printable"),
        ("n" * 129, "i", "name is longer than 128"),
        ("n" * 100, "i" * 40, "an owner is at most 128"),
    ],
)
def test_bad_input_is_invalid_argument(
    store: JournalStore, name: str, incarnation: str, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        store.release_earlier_incarnations(name, incarnation)


@pytest.fixture
async def stub(
    database_url: str,
    store: JournalStore,
    sessions: sessionmaker,  # type: ignore[type-arg]
) -> AsyncIterator[journal_pb2_grpc.JournalServiceStub]:
    history = ConversationStore(sessions, HistoryBounds(200, 262144, 4000))
    servicer = JournalServicer(store, RunStore(history, store.now))
    config = StorageConfig(port=0, metrics_port=-1, drain_seconds=0, database_url=database_url)
    host = ServiceHost(
        "storage",
        config,
        [lambda server: journal_pb2_grpc.add_JournalServiceServicer_to_server(servicer, server)],
        ["system.storage.v1.JournalService"],
    )
    await host.start()
    try:
        async with grpc.aio.insecure_channel(host.target) as channel:
            yield journal_pb2_grpc.JournalServiceStub(channel)
    finally:
        await host.stop()


async def test_the_rpc_releases_and_refuses_bad_input(
    stub: journal_pb2_grpc.JournalServiceStub,
    store: JournalStore,
) -> None:
    store.acquire_lease("task:t", "eng:1#old", HOUR)
    mine = store.acquire_lease("task:u", "eng:1#new", HOUR)
    request = journal_pb2.ReleaseEarlierIncarnationsRequest
    done = await stub.ReleaseEarlierIncarnations(
        request(name="eng:1", incarnation="new"), timeout=10
    )
    assert done.released == 1
    again = await stub.ReleaseEarlierIncarnations(
        request(name="eng:1", incarnation="new"), timeout=10
    )
    assert again.released == 0
    for bad, words in [
        (request(incarnation="new"), "name is required"),
        (request(name="eng:1"), "incarnation is required"),
        (request(name="eng#1", incarnation="new"), "name must not contain '#'"),
        (request(name="eng:1", incarnation="n#w"), "incarnation must not contain '#'"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ReleaseEarlierIncarnations(bad, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in (refused.value.details() or "")
    # The caller's own incarnation kept its lease throughout.
    store.renew_lease("task:u", "eng:1#new", mine.token, HOUR)


async def test_only_engines_may_release_incarnations(tmp_path: Path) -> None:
    method = "system.storage.v1.JournalService/ReleaseEarlierIncarnations"
    assert ACCESS.callers(method) == frozenset({"engine"})
    tokens = {"engine": "engine-token-0123456789", "router": "router-token-0123456789"}
    storage = await create_storage(
        StorageConfig(
            port=0,
            metrics_port=-1,
            drain_seconds=0,
            database_url=f"sqlite:///{tmp_path / 'storage.db'}",
            caller_tokens=tuple(f"{caller}={token}" for caller, token in tokens.items()),
        )
    )
    await storage.host.start()
    try:
        storage.journal.acquire_lease("task:t", "slot#old", HOUR)
        for caller, token in tokens.items():
            settings = EngineConfig(service_token=token).channel_settings()
            client = JournalIncarnations(
                storage.host.target, ReplicaIdentity("slot", "new"), settings=settings
            )
            try:
                if caller == "engine":
                    assert await client.release_earlier() == 1
                else:
                    with pytest.raises(ServiceError, match="PERMISSION_DENIED"):
                        await client.release_earlier()
            finally:
                await client.aclose()
    finally:
        await storage.host.stop()
        await storage.aclose()


# -- the replica's identity -------------------------------------------------------------------


def test_a_replica_is_named_by_host_and_pid_and_each_start_is_a_new_incarnation() -> None:
    first, second = replica_identity(), replica_identity()
    # Two engine apps of one process never share a name; each start is a new incarnation.
    assert first.name != second.name
    assert first.incarnation != second.incarnation
    assert first.owner == f"{first.name}#{first.incarnation}"
    assert "#" not in first.name and "#" not in first.incarnation
    assert first.name.startswith(f"{socket.gethostname()}:{os.getpid()}")
    # A configured replica_id is the name as given (the same at every start) ...
    one, two = replica_identity("pod-7"), replica_identity("pod-7")
    assert one.name == two.name == "pod-7" and one.incarnation != two.incarnation
    # ... and with forked workers each worker adds its pid, so they never share one.
    assert replica_identity("pod-7", workers=4).name == f"pod-7:{os.getpid()}"
    assert ReplicaIdentity("n", "i").owner == "n#i"


@pytest.mark.parametrize(
    ("replica_id", "message"),
    [("a#b", "must not contain '#'"), ("x" * 81, "at most 80"), ("a\nb", "printable")],
)
def test_a_bad_replica_id_is_refused_at_start(replica_id: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(replica_id=replica_id).validate()


# -- the event runner ------------------------------------------------------------------------------


class _Journal:
    """What the runner is seen asking storage, in order: take-backs, then claims."""

    def __init__(self, answers: list[BaseException | int]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def release_earlier(self) -> int:
        self.asked.append("release")
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def claim(self, owner: str, max_tasks: int, lease_seconds: int) -> list[Any]:
        self.asked.append(f"claim:{owner}")
        return []


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        ([2], ["release"]),
        # Storage not reachable yet: asked again at the next poll, nothing claimed meanwhile.
        ([Unavailable("down"), Unavailable("down"), 0], ["release"] * 3),
        # Refused (an older storage): given up on, the runner claims as before.
        ([ServiceError("UNIMPLEMENTED: no such method")], ["release"]),
    ],
)
async def test_the_runner_takes_back_before_its_first_claim(
    answers: list[BaseException | int], expected: list[str]
) -> None:
    journal = _Journal(answers)
    runner = EventRunner(
        None,  # type: ignore[arg-type]  # nothing is claimed, so nothing runs
        journal,  # type: ignore[arg-type]
        BoundedExecutor("event", 2, 64),
        "slot#new",
        poll_seconds=0.01,
        earlier=journal,
    )
    runner.start()
    try:
        await wait_until(lambda: len(journal.asked) > len(expected) + 1, timeout=20)
    finally:
        await runner.stop()
    assert journal.asked[: len(expected)] == expected
    assert set(journal.asked[len(expected) :]) == {"claim:slot#new"}


# -- end to end ------------------------------------------------------------------------------------


def _replica(stack: Stack, tmp_path: Path, name: str) -> ServiceProcess:
    """An engine process named `name` whose task leases last an hour."""
    return ServiceProcess(
        "engine_service",
        "SYSTEM_ENGINE_",
        {
            "STORAGE_TARGET": stack.storage.host.target,
            "GATEWAY_TARGET": f"127.0.0.1:{stack.gateway_port}",
            "REPLICA_ID": name,
            "TASK_LEASE_SECONDS": str(HOUR),
            "EVENT_POLL_SECONDS": "0.1",
            "LOG_LEVEL": "INFO",
        },
        tmp_path / f"{name}.log",
    )


def _lease_owner(stack: Stack, task_id: str) -> str | None:
    with stack.storage.engine.connect() as conn:
        return conn.execute(
            select(LeaseRow.owner).where(LeaseRow.name == f"task:{task_id}")
        ).scalar_one()


def _hold_second_give(stack: Stack, player: str) -> None:
    """The player's first give is answered; their second runs (the item is given) but is
    not answered, as if the replica died between the effect and the answer. Later calls
    (the second give sent again with its call id) are answered."""
    game = stack.game
    original: Callable[[gateway_pb2.ToolCall], Any] = game._run_tool

    def run(call: gateway_pb2.ToolCall) -> Any:
        frame = original(call)
        mine = [c for c in game.calls if c[0] == player]
        return None if call.player_id == player and len(mine) == 2 else frame

    game._run_tool = run  # type: ignore[method-assign]


@pytest.mark.e2e
async def test_a_restarted_replica_takes_its_task_back_without_waiting_out_the_lease(
    fresh_database_url: str, tmp_path: Path
) -> None:
    """Replica `slot-a` (a process) is killed with -9 between a give and its answer, its
    task's lease an hour long. Replica `slot-b` (in process) starts and works, and leaves
    that lease alone. `slot-a` restarts under its name: the task is taken back and ends with
    its gives sent again under their call ids, which item.give honours, so nothing is given
    twice, while `slot-b`'s own task in progress keeps its lease."""
    gateway_port = free_port()
    b_port = free_port()
    async with _stack(fresh_database_url, f"127.0.0.1:{b_port}", gateway_port) as stack:
        game = stack.game
        for player in ("stuck", "other", "busy"):
            await game.join(player, player)
        a = _replica(stack, tmp_path, "slot-a")
        await a.start()
        b = None
        try:
            _hold_second_give(stack, "stuck")
            async with grpc.aio.insecure_channel(a.target) as channel:
                await engine_pb2_grpc.EngineServiceStub(channel).SubmitEvent(
                    engine_pb2.SubmitEventRequest(
                        player=_player("stuck"),
                        event_type=ADVANCEMENT,
                        event_key="adv",
                        data=_data(advancement=DIAMOND),
                        player_online=True,
                    ),
                    timeout=10,
                )
            await wait_until(lambda: sum(c[0] == "stuck" for c in game.calls) == 2, timeout=20)
            a.kill()
            (stuck,) = await stack.tasks("stuck")
            assert stuck.state == RUNNING and stuck.attempts == 1
            dead_owner = _lease_owner(stack, stuck.task_id)
            assert dead_owner is not None and dead_owner.startswith("slot-a#")

            # Another name starts and works: it does not touch slot-a's leases.
            b = await _engine(
                stack.storage.host.target,
                gateway_port,
                port=b_port,
                replica_id="slot-b",
                task_lease_seconds=HOUR,
            )
            await asyncio.wait_for(stack.gateway.players.engine.channel.channel_ready(), 10)
            await game.event("other", ADVANCEMENT, "adv", {"advancement": DIAMOND})
            other = (await stack.settled(["other"]))["other"]
            assert other.state == journal_pb2.TASK_STATE_SUCCEEDED
            (still,) = await stack.tasks("stuck")
            assert still.state == RUNNING and still.attempts == 1
            assert _lease_owner(stack, stuck.task_id) == dead_owner

            # slot-b holds a task of its own (its give is never answered) ...
            game.hold.add("busy")
            await game.event("busy", ADVANCEMENT, "adv", {"advancement": DIAMOND})
            await wait_until(lambda: any(c[0] == "busy" for c in game.calls), timeout=20)
            (busy,) = await stack.tasks("busy")
            assert _lease_owner(stack, busy.task_id) == b.identity.owner

            # ... while slot-a restarts and takes its task back, an hour early.
            await a.start()
            done = (await stack.settled(["stuck"], timeout=60))["stuck"]
        finally:
            a.stop()
            busy_after = await stack.tasks("busy")
            busy_owner = _lease_owner(stack, busy_after[0].task_id) if busy_after else None
            if b is not None:
                await _stop(b)

    assert done.task_id == stuck.task_id
    # Both gives sent again with their call ids (a first claim stores nothing for them until
    # the task ends: decision 0036) and answered from the world's memory (issue 19: not
    # EFFECT_UNKNOWN any more).
    assert done.state == journal_pb2.TASK_STATE_SUCCEEDED, done.result
    assert done.attempts == 2
    # Both gives ran once.
    assert game.gained("stuck") == REWARD
    stuck_calls = [call_id for player, _, call_id in game.calls if player == "stuck"]
    first, second = f"{stuck.task_id}/0", f"{stuck.task_id}/1"
    assert stuck_calls == [first, second, first, second]
    # slot-b's task was never taken from it by slot-a's start.
    assert busy_after[0].attempts == 1
    assert busy_owner == b.identity.owner
    assert "leases of earlier incarnations taken back: 1" in (tmp_path / "slot-a.log").read_text()
    sent = Counter(call_id for _, _, call_id in game.calls)
    assert [call_id for call_id, n in sent.items() if n > 1] == [first, second]
