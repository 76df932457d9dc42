"""One `execute` for every source: look up, authorise, check input, run under the policy's
budgets, the deadline and the interactive queue bound, one run per player at a time
(`runs.py`: player lease, duplicates, cancel), record the exchange in history. The run gets an
ExecutionContext (`context.py`), its only door to tools. No gRPC here."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import prometheus_client
from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2

from engine_service.context import ExecutionContext, GameTools, partial_result
from engine_service.models import ModelClient
from engine_service.modules.text import pick
from engine_service.registry import ModuleRegistry, ModuleSpec, struct_to_dict
from engine_service.runs import HistoryStore, LocalRuns, PlayerRuns, Run, RunStart, fingerprint
from engine_service.schema import check_input
from engine_service.steps import TaskSteps
from engine_service.task_store import LeaseLost
from services.results import AgentFailure, ModuleFailure, NotDelivered, failed, failure_text
from services.runtime.context import current_request_id, remaining_seconds
from services.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from services.runtime.permissions import CORE_FEATURE
from services.untrusted import plain_result

__all__ = [
    "Admission",
    "BoundedExecutor",
    "Engine",
    "HistoryStore",
    "PlayerSnapshots",
    "RunContext",
]

log = logging.getLogger("system.engine")

T = TypeVar("T")

_MAY_NOT_USE = {"zh": "你没有权限使用 {module_id}。", "en": "You may not use {module_id}."}
"""A module the player's level, binding or features do not allow (Failure.args: module_id)."""
_LEASE_LOST = {
    "zh": "数据暂时无法保存，这次请求已停止，请稍后再试。",
    "en": "Your data could not be saved just now, so this request stopped; try again shortly.",
}
"""What a player reads when a run lost its player's lease (a run that timed out, crashed or
was cancelled reads its failure key's text, services/results.py; the log names the module)."""


EXECUTOR_BUSY = prometheus_client.Counter(
    "engine_executor_busy_seconds",
    "Seconds the executor's workers spent running jobs, summed over its workers and counted "
    "as each job ends: its rate over engine_executor_workers is the share of workers busy.",
    ["executor"],
)
EXECUTOR_WORKERS = prometheus_client.Gauge(
    "engine_executor_workers", "Workers of the executor.", ["executor"]
)


class BoundedExecutor:
    """Runs at most `workers` jobs at once with at most `queue` more waiting; beyond that a
    submission is refused at once with RESOURCE_EXHAUSTED (the seed's BUSY)."""

    def __init__(self, name: str, workers: int, queue: int) -> None:
        self.name = name
        self.workers = workers
        self._slots = asyncio.Semaphore(workers)
        self._limit = workers + queue
        self._admitted = 0
        self._queued: set[asyncio.Task[object]] = set()
        self._closed = False
        self._busy = EXECUTOR_BUSY.labels(executor=name)
        EXECUTOR_WORKERS.labels(executor=name).set(workers)

    @property
    def capacity(self) -> int:
        """Workers plus queue places."""
        return self._limit

    def admit(self) -> Admission:
        """Takes a place now (BUSY at once when none is left), for a job run later with
        `run(job, admission)`: callers with slow preparation (a storage lease) reserve first,
        so a burst is refused before it reaches storage."""
        if self._closed:
            raise Unavailable(f"the {self.name} executor is shutting down")
        if self._admitted >= self._limit:
            raise ResourceExhausted(f"the {self.name} queue is full; try again shortly")
        self._admitted += 1
        return Admission(self)

    async def run(self, job: Callable[[], Awaitable[T]], admission: Admission | None = None) -> T:
        """Runs `job` when a worker is free, in a place taken now or by `admit` earlier."""
        if admission is None:
            admission = self.admit()
        task = asyncio.current_task()
        try:
            if task is not None:
                self._queued.add(task)
            try:
                await self._slots.acquire()
            finally:
                self._queued.discard(task)
            started = time.monotonic()
            try:
                return await job()
            finally:
                self._busy.inc(time.monotonic() - started)
                self._slots.release()
        finally:
            admission.release()

    def shutdown(self) -> int:
        """Refuses new jobs and cancels those still queued (not yet running); returns how many
        were cancelled. Running jobs finish or are stopped by their owners."""
        self._closed = True
        queued = list(self._queued)
        for task in queued:
            task.cancel()
        return len(queued)


class Admission:
    """A place in a BoundedExecutor, given back exactly once."""

    def __init__(self, executor: BoundedExecutor) -> None:
        self._executor: BoundedExecutor | None = executor

    def release(self) -> None:
        if self._executor is not None:
            self._executor._admitted -= 1
            self._executor = None


RunContext = ExecutionContext
"""The ModuleContext one run gets (older name)."""


class PlayerSnapshots:
    """The latest permission snapshot of every player with a run in progress.

    Each Execute brings the player's context as the game server sees it now; a later request
    (or `update`, from a revoke or permission change) replaces the snapshot, and runs already
    in progress re-check against it at their next tool or model call. Entries leave with the
    player's last run, so the map is bounded by the runs in flight.
    """

    def __init__(self) -> None:
        self._players: dict[str, common_pb2.PlayerContext] = {}
        self._runs: Counter[str] = Counter()

    def enter(self, player: common_pb2.PlayerContext) -> None:
        self._runs[player.player_id] += 1
        self._players[player.player_id] = player

    def leave(self, player_id: str) -> None:
        self._runs[player_id] -= 1
        if self._runs[player_id] <= 0:
            del self._runs[player_id]
            self._players.pop(player_id, None)

    def update(self, player: common_pb2.PlayerContext) -> None:
        """Replaces the snapshot of a player with runs in progress; others are ignored."""
        if player.player_id in self._players:
            self._players[player.player_id] = player

    def current(self, player: common_pb2.PlayerContext) -> common_pb2.PlayerContext:
        return self._players.get(player.player_id, player)


class Engine:
    """Executes modules from the registry for players."""

    def __init__(
        self,
        registry: ModuleRegistry,
        history: HistoryStore,
        interactive: BoundedExecutor,
        execute_timeout: float,
        history_timeout: float,
        game_tools: GameTools | None = None,
        runs: PlayerRuns | None = None,
        models: ModelClient | None = None,
    ) -> None:
        self.registry = registry
        self.models = models
        self.history = history
        self.interactive = interactive
        self.execute_timeout = execute_timeout
        self.history_timeout = history_timeout
        self.game_tools = game_tools
        self.players = PlayerSnapshots()
        self.runs = (
            runs
            if runs is not None
            else PlayerRuns(LocalRuns(history), "local", 5, finish_timeout=history_timeout)
        )

    def update_player(self, player: common_pb2.PlayerContext) -> None:
        """A player's permissions changed (revoke, level, features): runs in progress see the
        new snapshot at their next tool or model call."""
        self.players.update(player)

    async def execute(
        self,
        player: common_pb2.PlayerContext,
        action: common_pb2.ModuleAction,
        request_text: str,
        source: int = engine_pb2.ROUTE_SOURCE_UNSPECIFIED,
        request_id: str = "",
    ) -> common_pb2.AgentResult:
        """Runs `action` for `player`, chosen by `source` (a `RouteSource`; write tools are
        refused from LOCAL, CACHE and UNSPECIFIED). Module failures come back as FAILED (or
        PARTIALLY_SUCCEEDED) results; bad calls raise InvalidArgument, NotFound,
        PermissionDenied, ResourceExhausted (BUSY: queue full, or another request of the
        player in progress) or Unavailable (no player lease); cancellation propagates. A
        request identical to the player's run in progress gets that run's result. A module
        the player may not use (below its level, say) is a FAILED PERMISSION_DENIED result in
        the player's language with `Failure.args["module_id"]`."""
        if not player.player_id:
            raise InvalidArgument("player.player_id is required")
        if not action.module_id:
            raise InvalidArgument("action.module_id is required")
        module = self.registry.get(action.module_id)
        if module is None:
            raise NotFound(f"no module {action.module_id!r} is registered; see /help")
        self.players.update(player)
        if action.module_id in player.unavailable_modules:
            raise PermissionDenied(
                f"{action.module_id} is unavailable on game server {player.server_id}: it does "
                "not offer the game tools the module needs (see the Welcome's tool_problems)"
            )
        if not self.registry.allows(action.module_id, player):
            feature = module.spec.owner_feature
            if feature not in ("", CORE_FEATURE) and feature not in player.features:
                # Say why: an old button of a mod's module, pressed on a server without it.
                raise PermissionDenied(
                    f"{action.module_id} belongs to the {feature} feature, which game server "
                    f"{player.server_id} does not offer"
                )
            # A refusal the player sees (a button of a card shown before they lost the
            # permission, say): a FAILED result in their language, its module in args.
            refused = failed(
                AgentFailure.PERMISSION_DENIED,
                pick(_MAY_NOT_USE, player.language, module_id=action.module_id),
            )
            refused.failure.args["module_id"] = action.module_id
            return refused
        if not module.spec.interactive:
            raise FailedPrecondition(f"{action.module_id} runs only from events")
        try:
            raw = struct_to_dict(action.input)
        except ValueError as exc:  # NaN or infinity, which JSON cannot carry
            raise InvalidArgument(f"{action.module_id}: input is not valid JSON: {exc}") from None
        data = check_input(action.module_id, module.spec.input_schema, raw)
        print_ = fingerprint(player.player_id, action.module_id, data, request_text)
        running = self.runs.join_or_start(player.player_id, print_)
        if running is not None:
            # The same request again while it runs: share its result, never run it twice.
            running.duplicates += 1
            return await asyncio.shield(running.result)
        # The queue place first: a full engine answers BUSY before asking storage for a lease.
        admission = self.interactive.admit()
        run = self.runs.start(player.player_id, request_id or current_request_id(), print_)

        async def attempt(start: RunStart) -> common_pb2.AgentResult:
            return await self._run(
                run,
                player,
                module.spec,
                module.run,
                data,
                request_text,
                action,
                source,
                admission,
                start,
            )

        try:
            result = await self.runs.hold(
                run, module.spec.history_entries, attempt, module.spec.needs_player_lease
            )
        except BaseException as exc:
            if not run.result.done():
                if isinstance(exc, asyncio.CancelledError):
                    run.result.set_result(failed(AgentFailure.CANCELLED, "cancelled"))
                else:
                    run.result.set_exception(exc)
                    run.result.exception()  # retrieved: duplicates, if any, raise it too
            raise
        finally:
            admission.release()
            self.runs.finish(run)
        run.result.set_result(result)
        return result

    async def _run(
        self,
        run: Run,
        player: common_pb2.PlayerContext,
        spec: ModuleSpec,
        body: Callable[[dict[str, Any], ExecutionContext], Awaitable[common_pb2.AgentResult]],
        data: dict[str, Any],
        request_text: str,
        action: common_pb2.ModuleAction,
        source: int,
        admission: Admission,
        start: RunStart,
    ) -> common_pb2.AgentResult:
        """One run under the player's lease, begun with `start`: the module, then the
        exchange its finish stores in history (none for a cancelled run, nor for a player
        who keeps no history)."""
        timeout = min(remaining_seconds(self.execute_timeout) or 0.0, float(spec.policy.seconds))
        context = ExecutionContext(
            player=player,
            spec=spec,
            registry=self.registry,
            history=self.history,
            source=source,
            game_tools=self.game_tools,
            deadline=time.monotonic() + timeout,
            current_player=lambda: self.players.current(player),
            models=self.models,
            history_tail=start.history,
        )
        self.players.enter(player)
        try:
            if run.cancelled:
                raise asyncio.CancelledError

            async def job() -> common_pb2.AgentResult:
                # The executor's coroutine is made only once the job runs, so a run cancelled
                # before it began leaves none unawaited.
                return await asyncio.wait_for(
                    self.interactive.run(lambda: body(data, context), admission), timeout
                )

            run.job = asyncio.ensure_future(job())
            result: common_pb2.AgentResult = await run.job
        except ModuleFailure as failure:
            result = _failure(context, failure.failure, failure.message)
        except TimeoutError:
            log.warning("module %s did not finish in time", action.module_id)
            result = _failure(context, AgentFailure.TIMEOUT)
        except ResourceExhausted:
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if (task is not None and task.cancelling()) or not (run.cancelled or run.lost_lease):
                raise  # the caller went away
            context.cancel()
            if run.cancelled:
                result = _failure(context, AgentFailure.CANCELLED)
            else:
                log.warning(
                    "module %s stopped: the player's lease could not be renewed", action.module_id
                )
                result = _failure(
                    context, AgentFailure.STORAGE_UNAVAILABLE, pick(_LEASE_LOST, player.language)
                )
        except Exception:
            log.exception("module %s failed", action.module_id)
            result = _failure(context, AgentFailure.MODULE_FAILED)
        finally:
            self.players.leave(player.player_id)
            admission.release()
        # Whatever a module put on its card (an item's name, a mail's text, the model's
        # answer), no formatting code or invisible character reaches the player (decision 0026).
        plain_result(result)
        log.info(
            "executed %s",
            action.module_id,
            extra={
                "module_id": action.module_id,
                "status": common_pb2.ResultStatus.Name(result.status),
            },
        )
        if not run.cancelled and start.history_enabled:
            run.entries = _exchange(request_text or _describe(action), result)
        return result

    async def run_event(
        self,
        player: common_pb2.PlayerContext,
        module_id: str,
        raw: dict[str, Any],
        steps: TaskSteps,
    ) -> common_pb2.AgentResult | None:
        """Runs one event task's module (the same checks and budgets as `execute`, source
        EVENT, write steps through `steps`). Returns the result to store, or None when the
        task must wait because its player went offline before a step could be delivered.

        Raises:
            LeaseLost: another replica owns the task now; nothing more may be written.
        """
        module = self.registry.get(module_id)
        if module is None:
            return failed(AgentFailure.NOT_FOUND, f"no module {module_id!r} is registered now")
        live = self.players.current(player)
        if not module.spec.event_allowed or not self.registry.allows(module_id, live):
            return failed(AgentFailure.PERMISSION_DENIED, f"{module_id} may not run for this event")
        try:
            data = check_input(module_id, module.spec.input_schema, raw)
        except InvalidArgument as exc:
            return failed(AgentFailure.INVALID_INPUT, exc.message)
        timeout = float(module.spec.policy.seconds)
        context = ExecutionContext(
            player=player,
            spec=module.spec,
            registry=self.registry,
            history=self.history,
            source=engine_pb2.ROUTE_SOURCE_EVENT,
            game_tools=self.game_tools,
            deadline=time.monotonic() + timeout,
            current_player=lambda: self.players.current(player),
            models=self.models,
            steps=steps,
        )
        self.players.enter(player)
        try:
            result = await asyncio.wait_for(module.run(data, context), timeout)
        except NotDelivered as exc:
            if exc.player_offline:
                return None
            result = _failure(context, exc.failure, exc.message)
        except ModuleFailure as exc:
            result = _failure(context, exc.failure, exc.message)
        except TimeoutError:
            log.warning("event module %s did not finish in time", module_id)
            result = _failure(context, AgentFailure.TIMEOUT)
        except LeaseLost:
            raise
        except Exception:
            log.exception("event module %s failed", module_id)
            result = _failure(context, AgentFailure.MODULE_FAILED)
        finally:
            self.players.leave(player.player_id)
        plain_result(result)
        log.info(
            "event task ran %s",
            module_id,
            extra={"module_id": module_id, "status": common_pb2.ResultStatus.Name(result.status)},
        )
        return result

    def cancel(self, player_id: str, request_id: str = "") -> bool:
        """Cancels the player's run on this replica (only `request_id`'s when given)."""
        return self.runs.cancel(player_id, request_id)

    async def settle_history(self, player_id: str) -> bool:
        """Returns once every exchange of the player already answered is in history, on any
        replica; False when a run of the player is still in progress (see
        PlayerRuns.settle)."""
        return await self.runs.settle(player_id)

    async def flush_history(self) -> None:
        """Waits for every run's finish in flight (at shutdown, and in tests)."""
        await self.runs.flush()


def _exchange(text: str, result: common_pb2.AgentResult) -> list[common_pb2.HistoryEntry]:
    """A run's exchange as history entries: the player's request and the answer."""
    request_id = current_request_id()
    return [
        common_pb2.HistoryEntry(
            role=common_pb2.HISTORY_ROLE_PLAYER, text=text, request_id=request_id
        ),
        common_pb2.HistoryEntry(
            role=common_pb2.HISTORY_ROLE_ASSISTANT,
            text=result.text,
            result=result,
            request_id=request_id,
        ),
    ]


def _failure(
    context: ExecutionContext, failure: AgentFailure, message: str | None = None
) -> common_pb2.AgentResult:
    """FAILED, or PARTIALLY_SUCCEEDED when a write step had already completed: the player must
    learn that part of the work did happen. Without a message, the failure's own text in the
    player's language."""
    if message is None:
        message = failure_text(failure, context.player.language)
    if context.wrote:
        return partial_result(failure, message, context.steps)
    return failed(failure, message)


def _describe(action: common_pb2.ModuleAction) -> str:
    data = struct_to_dict(action.input)
    return (
        f"{action.module_id} {json.dumps(data, ensure_ascii=False)}" if data else action.module_id
    )
