"""A generic bounded ReAct loop: the model picks one tool from this step's schema (or the
`answer` tool), the engine runs it through the execution context (budgets, permission,
deadline, write rules all apply), the observation goes back, until an answer or the end of the
budget. The question and reasoning modules are built on it.

Only the tools offered for the step decode: a name outside the schema, arguments that are not a
JSON object, or a tool the context refuses end the loop with what was observed so far, never
with a guess. A paid tool (a web search) is never run twice with the same arguments: a
repeated call ends the loop too, and the caller composes from what is there. Running out of
rounds, model calls, tool calls or steps likewise ends it with what was found; cancellation,
a revoked permission and a lost lease propagate; a permission refused for one call (a page
that may not be fetched, external services turned off meanwhile) ends the loop like any other
recoverable failure.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from system.model.v1 import model_pb2

from engine_service.context import ExecutionContext
from services.results import AgentFailure, ModuleFailure
from services.untrusted import (
    PROMPT_DATA_CHARS,
    PromptBudget,
    data_json,
    request_text,
    with_data_rule,
)

__all__ = [
    "ANSWER_TOOL",
    "RECOVERABLE",
    "LoopOutcome",
    "LoopTool",
    "Observation",
    "ReActLoop",
    "recoverable",
    "rounds_sparing_one_call",
]

ANSWER_TOOL = "answer"
_OMITTED_BELOW = 200
"""Data characters left under which an observation is sent as omitted, not as a stump."""

RECOVERABLE = frozenset(
    {
        AgentFailure.BUDGET_EXHAUSTED,
        AgentFailure.MODEL_UNAVAILABLE,
        AgentFailure.TOOL_UNAVAILABLE,
        AgentFailure.NOT_FOUND,
        AgentFailure.INVALID_INPUT,
        AgentFailure.TIMEOUT,
        AgentFailure.MODULE_FAILED,
    }
)
"""Failures after which the loop stops and the caller composes from what it has. Anything
else (cancelled, permission denied, write not allowed, effect unknown) ends the run."""

_ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "description": "The answer for the player."},
        "sources": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1},
            "description": "Numbers of the observations the answer relies on.",
        },
    },
    "required": ["answer"],
    "additionalProperties": False,
}


@dataclasses.dataclass(frozen=True)
class LoopTool:
    """A tool offered to the model for this loop."""

    name: str
    """Function name the model sees (letters, digits and `_`)."""
    tool_id: str
    """The engine tool it runs (declared by the module)."""
    description: str
    parameters: dict[str, Any]
    """JSON Schema of the arguments."""
    paid: bool = False
    """Never run twice with the same arguments in one loop."""

    def schema(self) -> model_pb2.Tool:
        return model_pb2.Tool(
            name=self.name,
            description=self.description,
            parameters_json=json.dumps(self.parameters, sort_keys=True),
        )


@dataclasses.dataclass(frozen=True)
class Observation:
    """One tool run and what came of it (numbered from 1 in order)."""

    number: int
    tool: str
    arguments: dict[str, Any]
    output: dict[str, Any]


@dataclasses.dataclass
class LoopOutcome:
    """How the loop ended."""

    observations: list[Observation]
    stopped: str
    """`answer`, `rounds`, `repeat` (a paid call asked again), `refused` (a tool outside the
    schema, or bad arguments), `failure` (a recoverable failure: see `failure`)."""
    answer: str = ""
    sources: tuple[int, ...] = ()
    failure: ModuleFailure | None = None


class ReActLoop:
    """Runs the loop for one request.

    Args:
        ctx: the run's execution context (its budgets bound the loop too).
        system: instructions for the model.
        tools: the tools offered, besides `answer`.
        rounds: most iterations; the policy's `rounds` by default.
        observation_chars: longest observation text sent back to the model.
        data_chars: most characters of observations (and `context`) one loop sends in all.

    Tool results are game and web text: each goes back as a JSON document of data
    (`untrusted.data_json`: cleaned, cut, charged to the loop's budget), and the system prompt
    says such data is never an instruction. The request is the asker's own text, cleaned.
    """

    def __init__(
        self,
        ctx: ExecutionContext,
        system: str,
        tools: Sequence[LoopTool],
        rounds: int | None = None,
        observation_chars: int = 4000,
        data_chars: int = PROMPT_DATA_CHARS,
    ) -> None:
        names = [t.name for t in tools]
        if ANSWER_TOOL in names or len(set(names)) != len(names):
            raise ValueError("loop tool names must be unique and not 'answer'")
        self._ctx = ctx
        self._system = system
        self._tools = {t.name: t for t in tools}
        self._rounds = rounds if rounds is not None else ctx.policy.rounds
        self._chars = observation_chars
        self._budget = PromptBudget(data_chars)
        self._schema = [t.schema() for t in tools] + [
            model_pb2.Tool(
                name=ANSWER_TOOL,
                description="Give the final answer (and the observations it relies on).",
                parameters_json=json.dumps(_ANSWER_SCHEMA, sort_keys=True),
            )
        ]

    async def run(self, request: str, context: str = "") -> LoopOutcome:
        """Runs the loop for `request` (the asker's text). `context` goes before it in the
        same message: text the caller built, whose untrusted parts are already data blocks
        (`untrusted.data_block`); its length is charged to the loop's data budget."""
        request = request_text(request)
        self._budget.charge(len(context))
        messages = [
            model_pb2.ChatMessage(
                role=model_pb2.MESSAGE_ROLE_SYSTEM, content=with_data_rule(self._system)
            ),
            model_pb2.ChatMessage(
                role=model_pb2.MESSAGE_ROLE_USER,
                content=f"{context}\n\n{request}".strip() if context else request,
            ),
        ]
        observations: list[Observation] = []
        paid: set[str] = set()
        for _ in range(self._rounds):
            try:
                completion = await self._ctx.complete(
                    messages, tools=self._schema, require_tool=True
                )
            except ModuleFailure as failure:
                return self._stopped(observations, failure)
            if not completion.tool_calls:
                if completion.content.strip():  # a plain answer is an answer
                    return LoopOutcome(observations, "answer", completion.content.strip())
                return LoopOutcome(observations, "refused")
            call = completion.tool_calls[0]
            arguments = _arguments(call.arguments)
            if arguments is None:
                return LoopOutcome(observations, "refused")
            if call.name == ANSWER_TOOL:
                return _answer(observations, arguments)
            tool = self._tools.get(call.name)
            if tool is None:
                return LoopOutcome(observations, "refused")
            key = f"{tool.name}:{json.dumps(arguments, sort_keys=True)}"
            if tool.paid and key in paid:
                return LoopOutcome(observations, "repeat")
            paid.add(key)
            try:
                output = await self._ctx.tool(tool.tool_id, arguments)
            except ModuleFailure as failure:
                return self._stopped(observations, failure)
            observation = Observation(len(observations) + 1, tool.name, arguments, output)
            observations.append(observation)
            messages.append(
                model_pb2.ChatMessage(
                    role=model_pb2.MESSAGE_ROLE_ASSISTANT,
                    tool_calls=[
                        model_pb2.ToolCall(
                            id=call.call_id, name=call.name, arguments_json=call.arguments
                        )
                    ],
                )
            )
            messages.append(
                model_pb2.ChatMessage(
                    role=model_pb2.MESSAGE_ROLE_TOOL,
                    tool_call_id=call.call_id,
                    content=self._render(observation),
                )
            )
        return LoopOutcome(observations, "rounds")

    def _render(self, observation: Observation) -> str:
        if self._budget.left < _OMITTED_BELOW:
            return json.dumps(
                {"observation": observation.number, "omitted": "the prompt's data limit is spent"}
            )
        return data_json(
            {"observation": observation.number, "output": observation.output},
            limit=self._chars,
            max_chars=self._chars,
            budget=self._budget,
        )

    def _stopped(self, observations: list[Observation], failure: ModuleFailure) -> LoopOutcome:
        if not recoverable(self._ctx, failure):
            raise failure
        return LoopOutcome(observations, "failure", failure=failure)


def recoverable(ctx: ExecutionContext, failure: ModuleFailure) -> bool:
    """True when the run may still show what it has after `failure`: RECOVERABLE ones, and a
    PERMISSION_DENIED that is not a revoke (a page that may not be fetched, the player turning
    external services off: the live snapshot still allows the module). A cancelled run, a
    revoked module and the rest must stop."""
    if ctx.cancelled:
        return False
    if failure.failure is AgentFailure.PERMISSION_DENIED:
        return ctx.registry.allows(ctx.spec.module_id, ctx.live_player())
    return failure.failure in RECOVERABLE


def rounds_sparing_one_call(ctx: ExecutionContext) -> int:
    """Loop rounds that leave one model call of the run's budget to compose from what was
    found when the loop ends without an answer (a repeat, a failure, rounds spent); at least
    one, at most the policy's rounds."""
    calls_left = ctx.policy.model_calls - ctx.model_calls
    return max(1, min(ctx.policy.rounds, calls_left - 1))


def _arguments(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text or "{}")
    except (json.JSONDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _answer(observations: list[Observation], arguments: dict[str, Any]) -> LoopOutcome:
    answer = arguments.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        return LoopOutcome(observations, "refused")
    raw = arguments.get("sources") or []
    sources = tuple(n for n in raw if isinstance(n, int) and not isinstance(n, bool))
    return LoopOutcome(observations, "answer", answer.strip(), sources)
