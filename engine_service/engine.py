"""One `execute` for every source: look up, authorise, check input, run under the deadline and
the interactive queue bound, record the exchange in history. No gRPC here."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from system.common.v1 import common_pb2

from engine_service.registry import ModuleRegistry, struct_to_dict
from engine_service.schema import check_input
from services.results import AgentFailure, ModuleFailure, failed
from services.runtime.context import current_request_id, remaining_seconds
from services.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from services.runtime.permissions import module_available

__all__ = ["BoundedExecutor", "Engine", "HistoryStore", "RunContext"]

log = logging.getLogger("system.engine")

T = TypeVar("T")


class HistoryStore(Protocol):
    """What the engine needs of storage: the player's history."""

    async def append_history(
        self, player_id: str, entries: list[common_pb2.HistoryEntry]
    ) -> None: ...

    async def list_history(
        self, player_id: str, page_size: int
    ) -> list[common_pb2.HistoryEntry]: ...


class BoundedExecutor:
    """Runs at most `workers` jobs at once with at most `queue` more waiting; beyond that a
    submission is refused at once with RESOURCE_EXHAUSTED (the seed's BUSY)."""

    def __init__(self, name: str, workers: int, queue: int) -> None:
        self.name = name
        self._slots = asyncio.Semaphore(workers)
        self._limit = workers + queue
        self._admitted = 0

    @property
    def admitted(self) -> int:
        """Jobs running or waiting now."""
        return self._admitted

    async def run(self, job: Callable[[], Awaitable[T]]) -> T:
        if self._admitted >= self._limit:
            raise ResourceExhausted(f"the {self.name} queue is full; try again shortly")
        self._admitted += 1
        try:
            async with self._slots:
                return await job()
        finally:
            self._admitted -= 1


@dataclasses.dataclass
class RunContext:
    """The ModuleContext one run gets."""

    player: common_pb2.PlayerContext
    registry: ModuleRegistry
    history: HistoryStore

    async def list_history(self, page_size: int) -> list[common_pb2.HistoryEntry]:
        try:
            return await self.history.list_history(self.player.player_id, page_size)
        except Exception as exc:  # noqa: BLE001 - any storage failure is the same to a module
            raise ModuleFailure(
                AgentFailure.STORAGE_UNAVAILABLE, "the history could not be read; try again later"
            ) from exc


class Engine:
    """Executes modules from the registry for players."""

    def __init__(
        self,
        registry: ModuleRegistry,
        history: HistoryStore,
        interactive: BoundedExecutor,
        execute_timeout: float,
        history_timeout: float,
    ) -> None:
        self.registry = registry
        self.history = history
        self.interactive = interactive
        self.execute_timeout = execute_timeout
        self.history_timeout = history_timeout

    async def execute(
        self,
        player: common_pb2.PlayerContext,
        action: common_pb2.ModuleAction,
        request_text: str,
    ) -> common_pb2.AgentResult:
        """Runs `action` for `player`. Module failures come back as FAILED results; bad calls
        raise InvalidArgument, NotFound, PermissionDenied or ResourceExhausted."""
        if not player.player_id:
            raise InvalidArgument("player.player_id is required")
        if not action.module_id:
            raise InvalidArgument("action.module_id is required")
        module = self.registry.get(action.module_id)
        if module is None:
            raise NotFound(f"no module {action.module_id!r} is registered; see /help")
        if not module_available(module.spec.descriptor(), player):
            raise PermissionDenied(f"player may not use {action.module_id}")
        if not module.spec.interactive:
            raise FailedPrecondition(f"{action.module_id} runs only from events")
        try:
            raw = struct_to_dict(action.input)
        except ValueError as exc:  # NaN or infinity, which JSON cannot carry
            raise InvalidArgument(f"{action.module_id}: input is not valid JSON: {exc}") from None
        data = check_input(action.module_id, module.spec.input_schema, raw)
        context = RunContext(player, self.registry, self.history)
        timeout = remaining_seconds(self.execute_timeout)
        try:
            result = await asyncio.wait_for(
                self.interactive.run(lambda: module.run(data, context)), timeout
            )
        except ModuleFailure as failure:
            result = failed(failure.failure, failure.message)
        except TimeoutError:
            result = failed(AgentFailure.TIMEOUT, f"{action.module_id} did not finish in time")
        except ResourceExhausted:
            raise
        except Exception:
            log.exception("module %s failed", action.module_id)
            result = failed(AgentFailure.MODULE_FAILED, f"{action.module_id} failed")
        log.info(
            "executed %s",
            action.module_id,
            extra={
                "module_id": action.module_id,
                "status": common_pb2.ResultStatus.Name(result.status),
            },
        )
        await self._record(player, request_text or _describe(action), result)
        return result

    async def _record(
        self, player: common_pb2.PlayerContext, text: str, result: common_pb2.AgentResult
    ) -> None:
        """Writes the exchange to history; a failure is logged and never reaches the player."""
        request_id = current_request_id()
        entries = [
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
        try:
            await asyncio.wait_for(
                self.history.append_history(player.player_id, entries), self.history_timeout
            )
        except Exception as exc:  # noqa: BLE001 - history must never block a result
            log.warning("history write failed: %s", exc)


def _describe(action: common_pb2.ModuleAction) -> str:
    data = struct_to_dict(action.input)
    return (
        f"{action.module_id} {json.dumps(data, ensure_ascii=False)}" if data else action.module_id
    )
