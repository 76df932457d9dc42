"""Step receipts of an event task's write steps: intent before the tool runs, result after, so
that a task run again (after a crash, on another replica, or when its player is back) replays
what is done and never repeats what may have happened.

A step is identified by its task and its position among the task's write steps, which is
stable because a module's control flow depends only on its input and on tool outputs, and done
outputs replay unchanged. On a second run, at each position:

- a DONE receipt replays its stored output; the tool does not run;
- a RUNNING receipt (intent recorded, outcome unknown) re-runs an idempotent tool, and for
  any other tool ends the run with EFFECT_UNKNOWN: it may or may not have happened, and the
  seed's rule is never to guess;
- a call refused before it reached the game server (`NotDelivered`, player offline) is closed
  with a "not delivered" receipt, and the next run tries the position again under the next
  attempt id (`<task>/<position>.<attempt>`), since nothing can have happened.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from system.storage.v1 import journal_pb2

from engine_service.task_store import Claim, TaskStore
from engine_service.tools import ToolSpec
from services.results import AgentFailure, ModuleFailure, NotDelivered

__all__ = ["JSON_CODEC", "NOT_DELIVERED_CODEC", "TaskSteps"]

JSON_CODEC = "system:json/v1"
"""Codec of a done step's output: UTF-8 JSON of the tool's output object."""
NOT_DELIVERED_CODEC = "system:not-delivered/v1"
"""Codec of a step closed because its call never left (empty result)."""
MAX_ATTEMPTS = 64
"""Most "not delivered" attempts of one position before the task gives up."""


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
    """The write-step journal of one run of one claimed task."""

    def __init__(self, store: TaskStore, claim: Claim) -> None:
        self._store = store
        self._claim = claim
        self._position = 0
        self.replayed = 0
        """Steps answered from receipts in this run."""

    async def run(
        self, spec: ToolSpec, call: Callable[[str], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """Runs (or replays) the next write step; `call(step_id)` runs the tool once.

        Raises:
            ModuleFailure: EFFECT_UNKNOWN for an unfinished non-idempotent step; storage
                failures; whatever the tool raised.
            LeaseLost: another replica holds the task now.
        """
        position = self._position
        self._position += 1
        task_id = self._claim.task.task_id
        for attempt in range(MAX_ATTEMPTS):
            step_id = f"{task_id}/{position}" + (f".{attempt}" if attempt else "")
            receipt, created = await self._store.record_step(
                self._claim, step_id, position, spec.tool_id
            )
            if not created:
                if receipt.state == journal_pb2.STEP_STATE_DONE:
                    if receipt.codec_id == NOT_DELIVERED_CODEC:
                        continue
                    self.replayed += 1
                    return _decode(receipt)
                if not spec.idempotent:
                    raise ModuleFailure(
                        AgentFailure.EFFECT_UNKNOWN,
                        f"{spec.tool_id} was started before an interruption and may or may not "
                        "have happened; it is not repeated",
                    )
            try:
                output = await call(step_id)
            except NotDelivered:
                await self._store.complete_step(
                    self._claim, step_id, spec.tool_id, b"", NOT_DELIVERED_CODEC
                )
                raise
            await self._store.complete_step(
                self._claim, step_id, spec.tool_id, _encode(output), JSON_CODEC
            )
            return output
        raise ModuleFailure(
            AgentFailure.MODULE_FAILED,
            f"{spec.tool_id} could not be delivered in {MAX_ATTEMPTS} attempts",
        )
