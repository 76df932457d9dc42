"""Event tasks: a game event becomes persisted tasks (one per handling module); the event
runner of every replica claims runnable tasks by lease, runs them through `Engine.run_event`
with a step journal, and stores how they ended.

A task is QUEUED when its player is online and WAITING otherwise; `resume` (a player joined)
queues the waiting ones. A running task whose player turns out to be offline before a step
could be delivered goes back to WAITING, and so does one whose call of a tool that honours
call ids lost its answer (`steps.ResendLater`: resent under the same call id when the player
is reachable again). The lease is renewed while the task is held; when a
renewal fails the run is stopped, since another replica may own the task from then on.

Before its first claim the runner ends the leases earlier incarnations of this replica still
hold (decision 0014): their RUNNING tasks are then claimable at once, by this replica or any
other, and recover from their receipts as after any crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol

from google.protobuf import json_format
from system.common.v1 import common_pb2
from system.storage.v1 import journal_pb2

from engine_service.advancements import ADVANCEMENT_EVENT, AdvancementConfig
from engine_service.engine import BoundedExecutor, Engine
from engine_service.registry import struct_to_dict
from engine_service.schema import check_input
from engine_service.steps import TaskSteps
from engine_service.task_store import Claim, LeaseLost, TaskStore
from services.runtime.errors import InvalidArgument, NotFound, Unavailable

__all__ = [
    "EarlierIncarnations",
    "EventRunner",
    "EventTasks",
    "PlayerNotices",
    "decode_task_input",
    "encode_task_input",
]

log = logging.getLogger("system.engine.events")

CLAIM_GATHER_SECONDS = 0.02
"""How long a woken runner waits before claiming, to claim work that arrives together at once."""
ENDS_GRACE_SECONDS = 5.0
"""How long a stopping runner waits for the ends being stored of tasks whose module has run."""
REFILL_WORKERS = 2
"""The runner claims more once no more than this many workers' worth of claimed tasks is left
(running or waiting): enough that new claims arrive before the workers run dry."""
MAX_EVENT_KEY = 128
"""Longest event key a game server may send (the module id is added to make the task key)."""
NOTICE_SECONDS = 5.0
"""How long telling a player how their task ended may take before it is given up."""
WAITING_RECHECK_SECONDS = 3.0
"""How long after a task started waiting for its player storage is asked whether they are
connected after all (see EventRunner._recheck_later)."""
RECHECK_ATTEMPTS = 5
"""How many times a recheck asks storage to queue the player's waiting tasks when it could
not (each WAITING_RECHECK_SECONDS after the last) before it leaves them to the player's next
join."""


class PlayerNotices(Protocol):
    """How a task's outcome reaches its player (the gateway's NotifyPlayer in production)."""

    async def notify(
        self,
        player_id: str,
        result: common_pb2.AgentResult,
        timeout: float,
        server_id: str = "",
    ) -> None: ...


class EarlierIncarnations(Protocol):
    """Ends the leases this replica's earlier incarnations hold
    (`JournalService.ReleaseEarlierIncarnations` in production). Raises Unavailable when
    storage cannot be reached, another error when it refused."""

    async def release_earlier(self) -> int: ...


_TERMINAL: dict[int, journal_pb2.TaskState] = {
    common_pb2.RESULT_STATUS_SUCCEEDED: journal_pb2.TASK_STATE_SUCCEEDED,
    common_pb2.RESULT_STATUS_PARTIALLY_SUCCEEDED: journal_pb2.TASK_STATE_PARTIALLY_SUCCEEDED,
}


def encode_task_input(player: common_pb2.PlayerContext, data: dict[str, Any]) -> dict[str, Any]:
    """What a task stores as its input: the module's input and the player's permission
    snapshot at the event, which the run is checked against (a fresher snapshot of the player
    on the running replica wins)."""
    return {"data": data, "player": json_format.MessageToDict(player)}


def decode_task_input(
    task: journal_pb2.EventTask,
) -> tuple[common_pb2.PlayerContext, dict[str, Any]]:
    stored = struct_to_dict(task.input)
    player = common_pb2.PlayerContext()
    json_format.ParseDict(stored.get("player") or {}, player, ignore_unknown_fields=True)
    player.player_id = task.player_id  # storage's owner of the task is authoritative
    data = stored.get("data")
    return player, data if isinstance(data, dict) else {}


class _Ended(NamedTuple):
    """A task whose module has run: its step journal, its player's game server and the
    result to store (None: the task waits for its player)."""

    steps: TaskSteps
    server_id: str
    result: common_pb2.AgentResult | None


class EventTasks:
    """SubmitEvent and ResumePlayerTasks: turn events into tasks and wake waiting ones.

    Args:
        advancements: the advancement rules; `minecraft:advancement` events run what they say
            (one task: the rule's module with the rule's input) instead of every handling
            module with the event's data. None: those events go to their handlers too.
    """

    def __init__(
        self,
        engine: Engine,
        store: TaskStore,
        runner: EventRunner | None,
        advancements: AdvancementConfig | None = None,
    ) -> None:
        self._engine = engine
        self._store = store
        self._runner = runner
        self._advancements = advancements

    async def submit(
        self,
        player: common_pb2.PlayerContext,
        event_type: str,
        event_key: str,
        data: dict[str, Any],
        online: bool,
    ) -> list[tuple[journal_pb2.EventTask, bool]]:
        """Persists one task per handling module the player may use (for an advancement: the
        one its rule names, with the rule's input; none when no rule and no default apply);
        returns each task and whether it is new.

        Raises:
            InvalidArgument: missing ids, an oversize key, input a handler's schema refuses
                (for an advancement: data that is not `{"advancement": "<namespace:path>"}`).
            NotFound: no (usable) module handles the event type (or runs the advancement's
                rule).
            ResourceExhausted, Unavailable: storage refused or could not be reached.
        """
        if not player.player_id:
            raise InvalidArgument("player.player_id is required")
        if not event_type:
            raise InvalidArgument("event_type is required (for example minecraft:advancement)")
        if not event_key or len(event_key) > MAX_EVENT_KEY:
            raise InvalidArgument(f"event_key is required, at most {MAX_EVENT_KEY} characters")
        registry = self._engine.registry
        if self._advancements is not None and event_type == ADVANCEMENT_EVENT:
            rule = self._advancements.get().rule_for_event(data)
            if rule is None:
                return []  # no rule for it and no default: nothing to run
            if not registry.allows(rule.module_id, player):
                raise NotFound(
                    f"the rule for {data['advancement']} runs {rule.module_id}, which this "
                    "player may not use"
                )
            # Checked against the module's schema when the rules were read. Keyed by the event,
            # not the module: an event resent after a reload that moved its advancement to
            # another module finds the task already made instead of rewarding twice.
            work = [(rule.module_id, rule.data(), f"{ADVANCEMENT_EVENT}|{event_key}")]
        else:
            handlers = [
                m
                for m in registry.handlers(event_type)
                if registry.allows(m.spec.module_id, player)
            ]
            if not handlers:
                raise NotFound(f"no module this player may use handles {event_type!r} events")
            # Check every input first: a bad event makes no task at all.
            work = [
                (
                    m.spec.module_id,
                    check_input(m.spec.module_id, m.spec.input_schema, data),
                    f"{m.spec.module_id}|{event_key}",
                )
                for m in handlers
            ]
        made = []
        for module_id, checked, task_key in work:
            made.append(
                await self._store.create(
                    player.player_id,
                    module_id,
                    task_key,
                    encode_task_input(player, checked),
                    waiting=not online,
                )
            )
        if online and self._runner is not None:
            self._runner.wake()
        return made

    async def resume(self, player: common_pb2.PlayerContext) -> int:
        """Queues the player's WAITING tasks; returns how many."""
        if not player.player_id:
            raise InvalidArgument("player.player_id is required")
        self._engine.update_player(player)
        moved = await self._store.resume(player.player_id)
        if moved and self._runner is not None:
            self._runner.wake()
        return moved


class EventRunner:
    """Claims runnable tasks for this replica and runs them on the event executor.

    Args:
        engine: runs each task's module.
        store: the journal.
        executor: the event executor (seed: 2 workers, 64 queued); claimed tasks wait in its
            queue, their leases renewed, until a worker is free.
        owner: this replica's lease owner name.
        lease_seconds: task lease length; renewed every third of it.
        poll_seconds: how often to look for work when nothing woke the runner (tasks other
            replicas queued, or leases of dead replicas that expired).
        notices: where a task that ended (succeeded, partly or failed) is shown to its
            player, once its end is stored; best effort, off the event worker. None: nowhere.
        earlier: asked once, before the first claim, to end the leases of this replica's
            earlier incarnations (asked again at each poll while storage cannot be reached;
            given up on, with a warning, when storage refuses). None: their leases expire.
        located: whether storage names a gateway replica for a player now (a waiting task's
            recheck). None: no recheck.
        remember: told, for each claimed task whose claim says where its player is, the
            player and that gateway replica's address, so the task's game-tool calls go
            there without a lookup of their own (RelayRoutes.remember). None: not told.
    """

    def __init__(
        self,
        engine: Engine,
        store: TaskStore,
        executor: BoundedExecutor,
        owner: str,
        lease_seconds: int = 30,
        poll_seconds: float = 1.0,
        notices: PlayerNotices | None = None,
        earlier: EarlierIncarnations | None = None,
        located: Callable[[str], Awaitable[bool]] | None = None,
        remember: Callable[[str, str], None] | None = None,
    ) -> None:
        self._engine = engine
        self._located = located
        self._remember = remember
        self._rechecks: set[asyncio.Task[None]] = set()
        self._earlier = earlier
        self._notices = notices
        self._telling: set[asyncio.Task[None]] = set()
        self._store = store
        self._executor = executor
        self._owner = owner
        self._lease_seconds = lease_seconds
        self._poll_seconds = poll_seconds
        self._wake = asyncio.Event()
        self._arrived = False
        """Whether new work woke the runner (then it gathers more before claiming)."""
        self._working: set[asyncio.Task[None]] = set()
        """Runs of claimed tasks whose module has not run yet: waiting for a worker or on one."""
        self._loop_task: asyncio.Task[None] | None = None
        self._runs: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._loop(), name="event-runner")

    def wake(self) -> None:
        """New work may be runnable: claim now instead of at the next poll (after gathering
        CLAIM_GATHER_SECONDS of arrivals)."""
        self._arrived = True
        self._wake.set()

    def _left(self, run: asyncio.Task[None]) -> None:
        """A claimed task left its worker (its module ran, or it never reached one), or its
        run ended: claim again at once if what is held ran low. No gathering: nothing new
        arrived, and the workers may be waiting."""
        self._working.discard(run)
        self._wake.set()

    async def stop(self) -> None:
        """Stops claiming and cancels held tasks whose module has not run; their leases are
        given back so another replica can take them at once. Steps already journaled replay
        there. A task whose module has run is only storing how it ended: that write is let
        finish (ENDS_GRACE_SECONDS at most), so the task is not run again elsewhere."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        ending = [run for run in self._runs if run not in self._working]
        for run in [*self._working, *self._rechecks]:
            run.cancel()
        if ending:
            _, late = await asyncio.wait(ending, timeout=ENDS_GRACE_SECONDS)
            for run in late:
                run.cancel()
        if self._runs or self._rechecks:
            await asyncio.gather(*self._runs, *self._rechecks, return_exceptions=True)
        if self._telling:  # players still hear how their finished tasks ended
            await asyncio.wait(list(self._telling))

    async def _take_back(self) -> None:
        """Ends the leases of this replica's earlier incarnations, before anything is claimed,
        so the first claim already finds their tasks runnable. While storage cannot be reached
        it asks again at each poll (a claim could not be made either); a refusal (an older
        storage without the call, a credential not allowed it) is logged and the runner goes
        on: those leases then expire as before."""
        if self._earlier is None:
            return
        while True:
            try:
                released = await self._earlier.release_earlier()
            except Unavailable as exc:
                log.warning("earlier incarnations' leases not released yet: %s", exc)
                await self._wait()
                continue
            except Exception as exc:  # noqa: BLE001 - refused: the leases expire as before
                log.warning("earlier incarnations' leases were not released; they expire: %s", exc)
                return
            if released:
                log.info("leases of earlier incarnations taken back: %d", released)
            return

    async def _loop(self) -> None:
        await self._take_back()
        while True:
            # Claimed tasks count from the moment they are claimed, before they reach the
            # executor, so the runner never holds more than the executor admits. A task whose
            # module has run no longer counts: storing how it ended is not a worker's job
            # (decision 0032), and counting it would leave the workers idle while the ends of
            # the tasks before were in flight. Those ends are bounded at one executor's worth
            # beyond it (a storage that stores them slowly slows the claims, not the memory).
            working = len(self._working)
            capacity = self._executor.capacity
            free = min(capacity - working, 2 * capacity - len(self._runs), 100)
            # While more than REFILL_WORKERS workers' worth of claimed tasks wait for or hold
            # a worker, a task claimed now would only wait behind them (the queue is first in,
            # first out): claim again once they run low, many at once, instead of one claim (a
            # locking query in storage) per finished task; meanwhile other replicas may take
            # what is queued.
            if free <= 0 or working > REFILL_WORKERS * self._executor.workers:
                await self._wait()
                continue
            try:
                claims = await self._store.claim(self._owner, free, self._lease_seconds)
            except Exception as exc:  # noqa: BLE001 - storage down: try again at the next poll
                log.warning("claiming event tasks failed: %s", exc)
                claims = []
            for claim in claims:
                if self._remember is not None and claim.gateway_address:
                    self._remember(claim.task.player_id, claim.gateway_address)
                run = asyncio.create_task(self._hold(claim))
                self._runs.add(run)
                self._working.add(run)  # until its module has run (`_hold`)
                run.add_done_callback(self._runs.discard)
                run.add_done_callback(self._left)
            if len(claims) < free:
                await self._wait()  # nothing more runnable now

    async def _wait(self) -> None:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that arrives
        # as the wait ends (new work at shutdown), and the runner would outlive its stop.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._poll_seconds):
                await self._wake.wait()
            # Woken by new work: let a little more arrive, so one claim (a locking query in
            # storage) takes a batch instead of one task per submission.
            if self._arrived:
                await asyncio.sleep(CLAIM_GATHER_SECONDS)
        self._arrived = False
        self._wake.clear()

    async def _hold(self, claim: Claim) -> None:
        """Runs one claimed task with its lease renewed; stops it if the lease is lost."""
        run = asyncio.current_task()
        assert run is not None
        renewer = asyncio.create_task(self._renew(claim, run))
        # Given back unless the task reached its next state (then the lease no longer
        # matters) or another replica already holds it (then our token is stale anyway).
        give_back = True
        try:
            # A worker runs the module; storing how the task ended (its last write) is not a
            # worker's job: the next claimed task starts meanwhile, and the write shares its
            # transaction with the other tasks' writes in flight (decision 0032).
            try:
                ended = await self._executor.run(lambda: self._run(claim))
            finally:
                self._left(run)
            await self._end(claim, ended)
            give_back = False
        except LeaseLost as exc:
            give_back = False
            log.warning("task %s: lease lost, left to its new owner: %s", claim.task.task_id, exc)
        except asyncio.CancelledError:
            if renewer.done() and not renewer.cancelled():
                log.warning("task %s: lease could not be renewed; stopped", claim.task.task_id)
            else:
                raise
        except Exception as exc:  # noqa: BLE001 - the lease expires and a replica retries
            log.warning("task %s stopped: %s", claim.task.task_id, exc)
        finally:
            renewer.cancel()
            if give_back:
                with contextlib.suppress(Exception):
                    await self._store.release(claim, self._owner)

    async def _run(self, claim: Claim) -> _Ended:
        """Runs the task's module (on an event worker); `_end` stores how it ended."""
        player, data = decode_task_input(claim.task)
        steps = TaskSteps(self._store, claim)
        try:
            result = await self._engine.run_event(player, claim.task.module_id, data, steps)
        except asyncio.CancelledError:
            await asyncio.shield(steps.abandon())
            raise
        return _Ended(steps, player.server_id, result)

    async def _end(self, claim: Claim, ended: _Ended) -> None:
        """Stores how the task ended (its held results and its next state, one write), then
        tells the player. The lease is still renewed meanwhile (see `_hold`)."""
        steps, result = ended.steps, ended.result
        if result is None:
            await steps.finish(journal_pb2.TASK_STATE_WAITING, None)
            self._recheck_later(claim.task.player_id)
            return
        await steps.finish(_TERMINAL.get(result.status, journal_pb2.TASK_STATE_FAILED), result)
        if self._notices is not None:
            # Off the worker: a slow or offline game server never holds an event worker.
            telling = asyncio.create_task(self._tell(claim.task.player_id, ended.server_id, result))
            self._telling.add(telling)
            telling.add_done_callback(self._telling.discard)

    def _recheck_later(self, player_id: str) -> None:
        """The task waits for its player, but their join may have queued the player's waiting
        tasks just before this one started waiting (a game server that reconnected to
        another gateway replica while this run could not reach them): if storage names a
        replica for them a moment later, their waiting tasks are queued again."""
        if self._located is None:
            return
        located = self._located

        async def recheck() -> None:
            for _ in range(RECHECK_ATTEMPTS):
                await asyncio.sleep(WAITING_RECHECK_SECONDS)
                if not await located(player_id):
                    return
                try:
                    if await self._store.resume(player_id):
                        self.wake()
                    return
                except Unavailable as exc:  # storage away a moment: asked again
                    log.warning("a waiting task's recheck could not queue it: %s", exc)

        task = asyncio.get_running_loop().create_task(recheck(), context=contextvars.Context())
        self._rechecks.add(task)
        task.add_done_callback(self._rechecks.discard)

    async def _tell(self, player_id: str, server_id: str, result: common_pb2.AgentResult) -> None:
        assert self._notices is not None
        try:
            await self._notices.notify(player_id, result, NOTICE_SECONDS, server_id=server_id)
        except Exception as exc:  # noqa: BLE001 - the task's outcome is stored all the same
            log.info("player %s was not told how their task ended: %s", player_id, exc)

    async def _renew(self, claim: Claim, run: asyncio.Task[None]) -> None:
        """Renews the lease every third of its length; cancels the run once it fails."""
        try:
            while True:
                await asyncio.sleep(self._lease_seconds / 3)
                await self._store.renew(claim, self._owner, self._lease_seconds)
        except Exception as exc:  # noqa: BLE001 - lost or unreachable: we may no longer write
            log.warning("task %s: lease renewal failed: %s", claim.task.task_id, exc)
            run.cancel()
