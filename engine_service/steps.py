"""Step receipts of an event task's write steps: intent before the tool runs, result after, so
that a task run again (after a crash, on another replica, or when its player is back) replays
what is done and never repeats what may have happened.

A step is identified by its task and its position among the task's write steps, which is
stable because a module's control flow depends only on its input and on tool outputs, and done
outputs replay unchanged. On a second run, at each position:

- a DONE receipt replays its stored output; the tool does not run;
- a RUNNING receipt (intent recorded, outcome unknown) re-runs an idempotent tool, and a
  game tool that honours call ids (`ToolSpec.honours_call_id`: the game server answers a
  repeated call id as the first call without running again) with the same step id as call
  id; for any other tool it ends the run with EFFECT_UNKNOWN: it may or may not have
  happened, and the seed's rule is never to guess;
- a call refused before it reached the game server (`NotDelivered`, player offline) is closed
  with a "not delivered" receipt, and the next run tries the position again under the next
  attempt id (`<task>/<position>.<attempt>`), since nothing can have happened; for a tool
  that honours call ids the receipt stays RUNNING and the next run resends under the same id
  (the same call id can do no harm, and an earlier run may have sent it);
- a call of a game tool that honours call ids whose outcome was lost on the way (EFFECT_UNKNOWN:
  the gateway replica died or the stream broke while it ran, the relay answered that its effect
  is unknown, no answer in time) keeps its RUNNING receipt and raises `ResendLater`: the task
  waits for its player like one offline (WAITING, queued again when they join on any gateway
  replica, or when the runner's recheck finds them connected) and the next run resends under
  the same step id, which the game server answers as the first call. Bounded: once the task
  has been claimed RESEND_ATTEMPTS times the lost outcome is EFFECT_UNKNOWN as for any tool.
  A resend (a RUNNING receipt) that cannot be delivered keeps its receipt RUNNING, so the
  position keeps its call id: a new attempt id would let the game server run it twice.

Only the intent must be stored before the tool runs; a result may travel with a later write.
So a step's result is held for at most `linger` seconds: the next step's intent carries it
(`RecordStep.completed`: stored first, in the same transaction), the task's final transition
takes it in the same transaction, and otherwise the timer sends it alone. A crash inside the
linger window only turns a done step into EFFECT_UNKNOWN: never into a repeat.

A game tool that honours call ids needs no intent on the task's first claim (decision 0036):
nothing is stored for the task yet, and a run that dies before the step's result is stored
leaves a position without a receipt, which the next claim records and resends under the same
call id (`<task>/<position>`, the game server answering it as the first call). Such results
are held, without a timer, until the task's final transition, a step that needs an intent, or
an abandoned run stores them (`TaskStore.store_steps` records and completes them in one
transaction). A task whose steps all honour call ids, as an advancement's rewards, so makes
one write when it ends, not one per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from system.common.v1 import common_pb2
from system.storage.v1 import journal_pb2

from engine_service.task_store import Claim, DoneStep, TaskStore
from engine_service.tools import ToolKind, ToolSpec
from services.results import AgentFailure, ModuleFailure, NotDelivered

__all__ = ["JSON_CODEC", "NOT_DELIVERED_CODEC", "RESEND_ATTEMPTS", "ResendLater", "TaskSteps"]

log = logging.getLogger("system.engine.steps")

JSON_CODEC = "system:json/v1"
"""Codec of a done step's output: UTF-8 JSON of the tool's output object."""
NOT_DELIVERED_CODEC = "system:not-delivered/v1"
"""Codec of a step closed because its call never left (empty result)."""
MAX_ATTEMPTS = 64
"""Most "not delivered" attempts of one position before the task gives up."""
RESEND_ATTEMPTS = 16
"""Claims of a task after which a lost outcome of a tool that honours call ids is reported
EFFECT_UNKNOWN instead of waited out and resent (a game server that never answers it)."""


class ResendLater(NotDelivered):
    """A call of a game tool that honours call ids was interrupted (its outcome was lost): it
    may have run, but a resend under the same call id cannot run it again, so the task waits
    for its player (the engine takes it as a player offline: the run returns no result) and
    its next run resends. Its step receipt stays RUNNING, never closed as not delivered.
    Never raised for a tool that does not honour call ids."""

    def __init__(self, message: str) -> None:
        super().__init__(AgentFailure.TOOL_UNAVAILABLE, message, player_offline=True)


def _honoured(spec: ToolSpec) -> bool:
    """Whether a write step's call may be sent again under its call id: the game server
    answers a repeated call id as the first call."""
    return spec.honours_call_id and spec.kind == ToolKind.GAME and not spec.read_only


def _resendable(spec: ToolSpec, failure: ModuleFailure) -> bool:
    """Whether a failed call's outcome was lost on the way and a resend under the same call id
    is safe."""
    return (
        _honoured(spec)
        and failure.failure == AgentFailure.EFFECT_UNKNOWN
        and not isinstance(failure, NotDelivered)
    )


def _encode(output: dict[str, Any]) -> bytes:
    return json.dumps(output, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()


def _decode(receipt: journal_pb2.StepReceipt) -> dict[str, Any]:
    if receipt.codec_id != JSON_CODEC:
        raise ModuleFailure(
            AgentFailure.MODULE_FAILED,
            f"step {receipt.step_id} was stored with codec {receipt.codec_id!r}, "
            f"which this engine cannot replay",
        )
    value = json.loads(receipt.result or b"{}")
    return value if isinstance(value, dict) else {"value": value}


class TaskSteps:
    """The write-step journal of one run of one claimed task.

    Args:
        store: the journal.
        claim: the task and its fence.
        linger: longest a step's result waits for a write to travel with (seconds).
    """

    def __init__(self, store: TaskStore, claim: Claim, linger: float = 0.02) -> None:
        self._store = store
        self._claim = claim
        self._linger = linger
        self._position = 0
        self._held: list[DoneStep] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: list[asyncio.Task[None]] = []

    def unjournaled(self, spec: ToolSpec) -> bool:
        """Whether the step runs without an intent stored first (decision 0036): a game tool
        that honours call ids, on the task's first claim. Nothing can be stored for the task
        yet, so its position has no receipt, and a run that dies before the result is stored
        leaves a position that the next claim records and resends under the same call id,
        which the game server answers as the first call."""
        return self._claim.task.attempts <= 1 and _honoured(spec)

    async def run(
        self, spec: ToolSpec, call: Callable[[str], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """Runs (or replays) the next write step; `call(step_id)` runs the tool once.

        Raises:
            ModuleFailure: EFFECT_UNKNOWN for an unfinished non-idempotent step; storage
                failures; whatever the tool raised.
            ResendLater: a tool that honours call ids lost its outcome; the task waits.
            LeaseLost: another replica holds the task now.
        """
        position = self._position
        self._position += 1
        task_id = self._claim.task.task_id
        if self.unjournaled(spec):
            step_id = f"{task_id}/{position}"
            output = await self._resending(spec, step_id, call)
            encoded = _encode(output)
            self._held.append(
                DoneStep(step_id, position, spec.tool_id, encoded, JSON_CODEC, recorded=False)
            )
            return output
        held = self._take()
        if any(not step.recorded for step in held):
            # RecordStep carries results of recorded steps only: the others go first.
            await self._store_held(held)
            held = []
        previous = held  # the earlier results travel with this intent
        for attempt in range(MAX_ATTEMPTS):
            step_id = f"{task_id}/{position}" + (f".{attempt}" if attempt else "")
            try:
                receipt, created = await self._store.record_step(
                    self._claim,
                    step_id,
                    position,
                    spec.tool_id,
                    previous,
                    # A retry that finds its own intent RUNNING sends the call once.
                    retry=spec.idempotent or spec.honours_call_id,
                )
            except BaseException:
                if previous:  # not stored: `finish` or `abandon` sends them
                    self._held = previous + self._held
                raise
            previous = []
            if not created:
                if receipt.state == journal_pb2.STEP_STATE_DONE:
                    if receipt.codec_id == NOT_DELIVERED_CODEC:
                        continue
                    return _decode(receipt)
                if not (spec.idempotent or spec.honours_call_id):
                    raise ModuleFailure(
                        AgentFailure.EFFECT_UNKNOWN,
                        f"{spec.tool_id} was started before an interruption and may or may not "
                        "have happened; it is not repeated",
                    )
            try:
                output = await self._resending(spec, step_id, call)
            except NotDelivered:
                # Closed only when this run recorded the intent, for a tool that does not
                # honour call ids: a resend of an earlier run's call (a RUNNING receipt) may
                # have run the first time, as may a call of a first claim that stored no
                # intent, so a tool that honours call ids keeps this step id, and its call
                # id, for the next run (a lost outcome waiting for its resend too).
                if created and not spec.honours_call_id:
                    await self._store.complete_step(
                        self._claim, step_id, spec.tool_id, b"", NOT_DELIVERED_CODEC
                    )
                raise
            encoded = _encode(output)
            self._hold(
                DoneStep(step_id, position, spec.tool_id, encoded, JSON_CODEC, recorded=True)
            )
            return output
        raise ModuleFailure(
            AgentFailure.MODULE_FAILED,
            f"{spec.tool_id} could not be delivered in {MAX_ATTEMPTS} attempts",
        )

    async def _resending(
        self, spec: ToolSpec, step_id: str, call: Callable[[str], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """Runs the call; a lost outcome of a tool that honours call ids becomes ResendLater
        (until the task has been claimed RESEND_ATTEMPTS times)."""
        try:
            return await call(step_id)
        except ModuleFailure as exc:
            attempts = self._claim.task.attempts
            if not _resendable(spec, exc) or attempts >= RESEND_ATTEMPTS:
                raise
            log.info(
                "task %s: %s was interrupted (claim %d); it waits for its player and "
                "is resent under call id %s: %s",
                self._claim.task.task_id,
                spec.tool_id,
                attempts,
                step_id,
                exc.message,
            )
            raise ResendLater(
                f"{spec.tool_id} was interrupted; it is resent under the same call id "
                f"once the player is reachable: {exc.message}"
            ) from exc

    def _hold(self, step: DoneStep) -> None:
        """Holds a recorded step's result for at most `linger` for a write to carry it."""
        self._held.append(step)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._linger, self._send_held)

    def _take(self) -> list[DoneStep]:
        """The held results, no longer held (the timer stopped), for a write to carry."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self._held = self._held, []
        return held

    def _send_held(self) -> None:
        held = self._take()
        if held:
            self._sending.append(asyncio.ensure_future(self._store.store_steps(self._claim, held)))

    async def _store_held(self, held: list[DoneStep]) -> None:
        try:
            await self._store.store_steps(self._claim, held)
        except BaseException:
            self._held = held + self._held  # `finish` or `abandon` tries again
            raise

    async def _sent(self) -> None:
        """Waits for every result already sent; raises the first failure."""
        sending, self._sending = self._sending, []
        results = await asyncio.gather(*sending, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def finish(
        self, state: journal_pb2.TaskState, result: common_pb2.AgentResult | None
    ) -> None:
        """Stores every held result and moves the task to `state` (in one transaction).

        Raises:
            LeaseLost: another replica holds the task now.
            ModuleFailure: storage refused or could not be reached.
        """
        held = self._take()
        await self._sent()
        try:
            await self._store.store_steps(self._claim, held, (state, result))
        except ModuleFailure as exc:
            kept = [step for step in held if step.recorded]
            if exc.failure != AgentFailure.STORAGE_FULL or len(kept) == len(held):
                raise
            # The player's receipts are full: the receipts of steps that honour call ids only
            # spare a resend, and the move must not wait for room (decision 0036).
            log.warning(
                "task %s: its steps' receipts were not stored (%s); the task moves on",
                self._claim.task.task_id,
                exc.message,
            )
            await self._store.store_steps(self._claim, kept, (state, result))

    async def abandon(self, timeout: float = 2.0) -> None:
        """The run was stopped: sends what is held and waits a little for what was sent,
        so done steps replay on the next claim instead of being run or resent again."""
        self._send_held()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._sent()), timeout)
