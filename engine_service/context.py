"""The execution context: what one run of a module may do, and the only door to tools.

Every tool call goes through `ExecutionContext.tool`, which checks, in order:

1. the run was not cancelled and its deadline has not passed (`system.error.cancelled`,
   `system.error.timeout`);
2. the module still may be used by the player: permission is re-read from the live snapshot
   on every call, so a revoke or a lower permission level stops the run at its next call
   (`system.error.permission_denied`);
3. the tool is declared by the module, and an optional tool's exporting feature is enabled for
   the player (`system.error.tool_unavailable`);
4. a write (not read-only) tool was not reached from a local or cached route, and an event run
   calls only event-allowed tools (`system.error.write_not_allowed`);
5. the policy's budgets: tool calls, steps, write steps (`system.error.budget_exhausted`);
6. the input against the tool's input schema (`system.error.invalid_input`).

A game tool's answer is checked against the tool's output schema before anything reads it: an
answer that breaks it fails the step with `system.error.tool_output_invalid`, naming the tool
and the first error's path.

Then it calls the server tool's handler (with the context itself when the tool declares
`needs_context`) or relays the game tool through the gateway, with the time left as its
timeout, and records the completed step. The run's web gate (`open_web`, closed by default,
never opened for an event run) is what the web tools check; `web_tools.WebGate` decides.

In an event task's run, write steps go through the task's step journal (`steps.py`): intent
before, result after, replay on rerun. A module that fails after a write step completed is
reported PARTIALLY_SUCCEEDED (which still counts as failure), by the engine or by the module
itself through `partial()`. No gRPC here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2
from system.model.v1 import model_pb2

from engine_service.clients import NOT_OFFERED
from engine_service.models import Completion, ModelClient
from engine_service.registry import ExecutionPolicy, ModuleRegistry, ModuleSpec
from engine_service.schema import check_input, normalise, violation
from engine_service.steps import TaskSteps
from engine_service.tools import ToolKind, ToolSpec
from services.results import FAILURE_TEXTS, AgentFailure, ModuleFailure, card
from services.runtime.errors import InvalidArgument
from services.runtime.logging import RepeatedLines
from services.runtime.permissions import CORE_FEATURE
from services.texts import pick
from services.untrusted import DATA_RULE, with_data_rule

__all__ = [
    "WRITE_SOURCES",
    "ExecutionContext",
    "GameTools",
    "HistoryReader",
    "Step",
    "partial_result",
]

log = logging.getLogger("system.engine")
_repeated = RepeatedLines(log)

_MODEL_UNAVAILABLE = {
    "zh": "AI 模型暂时不可用；指令和按钮仍然可以使用。",
    "en": "The AI model is unavailable right now; commands and buttons still work.",
}
_MODEL_FAILURES = {
    AgentFailure.BUSY: {
        "zh": "AI 模型正忙，请稍后再试。",
        "en": "The AI model is busy; try again shortly.",
    },
    AgentFailure.BUDGET_EXHAUSTED: {
        "zh": "AI 额度暂时用完了，请稍后再试；指令和按钮仍然可以使用。",
        "en": "The AI budget is used up for now; try again later. Commands and buttons still work.",
    },
    AgentFailure.TIMEOUT: {
        "zh": "AI 模型响应超时，请再试一次。",
        "en": "The AI model took too long; try again.",
    },
}
"""What a player reads when a model call fails; the model gateway's own words (a provider's
error, a configuration hint for the operator) go to the engine's log instead."""
_OFFLINE = {
    "zh": "离线模式不调用 AI 模型：可以使用指令和按钮，或在 /settings 中换一种模式。",
    "en": "Offline mode makes no AI model calls: use commands and buttons, or change the mode "
    "in /settings.",
}

_NO_LONGER_ALLOWED = {
    "zh": "你现在不能再使用这项功能了。",
    "en": "You may no longer use this.",
}
_TOO_MANY_STEPS = {
    "zh": "这个请求需要的步骤超出了这项功能的上限，后面的步骤没有执行。",
    "en": "That needs more steps than this feature may take; the rest was not done.",
}
_NEEDS_COMMAND = {
    "zh": "这会改变游戏内容，请使用它的指令或按钮。",
    "en": "That changes the game: use its command or a button.",
}
_NOT_AVAILABLE = {
    "zh": "这项功能暂时无法使用，请稍后再试。",
    "en": "That is not available right now; try again later.",
}
_UNREADABLE = {
    "zh": "游戏服务器返回了无法读取的数据（{detail}），这一步没有完成；请告诉管理员。",
    "en": "Your game server answered with data the assistant cannot read ({detail}); that step "
    "was not completed. Tell an admin.",
}
"""A plugin's malformed answer: the detail (the tool and the first error) stays in the text,
since the plugin's author learns of it from the player or the plugin's own log."""
_HISTORY_UNAVAILABLE = {
    "zh": "暂时读不到对话记录，请稍后再试。",
    "en": "The conversation history cannot be read right now; try again later.",
}

_OPERATOR_DETAIL = frozenset(
    {
        AgentFailure.STORAGE_UNAVAILABLE,
        AgentFailure.STORAGE_FULL,
        AgentFailure.MODEL_UNAVAILABLE,
        AgentFailure.TOOL_UNAVAILABLE,
        AgentFailure.MODULE_FAILED,
        AgentFailure.BUSY,
    }
)
"""Failures whose message from a server tool describes the deployment (a store that did not
answer, a setting missing), in English: the player reads the catalogue's text instead."""

WRITE_SOURCES = frozenset(
    {
        engine_pb2.ROUTE_SOURCE_BUTTON,
        engine_pb2.ROUTE_SOURCE_COMMAND,
        engine_pb2.ROUTE_SOURCE_MODEL,
        engine_pb2.ROUTE_SOURCE_INVOKE,
        engine_pb2.ROUTE_SOURCE_EVENT,
    }
)
"""Route sources from which write tools may run. Local matches and the intent cache (and an
unspecified source) are not among them: a write must be asked for explicitly."""


class GameTools(Protocol):
    """How the engine reaches game tools (the gateway's relay in production)."""

    async def call(
        self,
        player_id: str,
        call_id: str,
        tool_id: str,
        data: dict[str, Any],
        timeout: float,
        idempotent: bool,
        server_id: str = "",
        language: str = "en",
    ) -> dict[str, Any]:
        """Runs `tool_id` on the game server `server_id` (the player's
        `PlayerContext.server_id`; empty: the one the player is on) and returns its output;
        a call that got no answer fails with a text in the player's `language`."""
        ...


class HistoryReader(Protocol):
    async def list_history(
        self, player_id: str, page_size: int
    ) -> list[common_pb2.HistoryEntry]: ...


@dataclasses.dataclass(frozen=True)
class Step:
    """A tool call that completed."""

    call_id: str
    tool_id: str
    read_only: bool
    output: dict[str, Any]


def partial_result(
    failure: AgentFailure, message: str, steps: list[Step], title: str = ""
) -> common_pb2.AgentResult:
    """A PARTIALLY_SUCCEEDED result: what failed, and the steps that did complete."""
    done = [f"✓ {step.tool_id}" for step in steps if not step.read_only]
    result_card = card("system:error", title or message, ([message] if title else []) + done)
    return common_pb2.AgentResult(
        status=common_pb2.RESULT_STATUS_PARTIALLY_SUCCEEDED,
        failure=common_pb2.Failure(key=failure.value, message=message),
        card=result_card,
        text=message,
    )


class ExecutionContext:
    """The ModuleContext of one run.

    Args:
        player: the player as the request described them.
        spec: the running module's declaration (tools and policy).
        registry: the frozen module registry (and its tool registry).
        history: where `list_history` reads.
        source: how the module was chosen (`RouteSource`).
        game_tools: the relay to game servers; None when the engine has none configured.
        deadline: absolute `time.monotonic()` deadline of the run.
        current_player: returns the player's live permission snapshot; re-read at every tool
            and model call. Defaults to the request's snapshot.
        run_id: identifies the run in call ids (a fresh one by default).
        steps: the step journal of an event task's run; write steps go through it.
        models: the model gateway; None when the engine has none configured.
        history_tail: the player's newest history entries, read when the run began
            (JournalService.BeginRun, as many as the module declares it reads first:
            `ModuleSpec.history_entries`); `list_history` answers from them when they cover
            the page. None: nothing was read.
    """

    def __init__(
        self,
        *,
        player: common_pb2.PlayerContext,
        spec: ModuleSpec,
        registry: ModuleRegistry,
        history: HistoryReader,
        source: int,
        game_tools: GameTools | None,
        deadline: float,
        current_player: Callable[[], common_pb2.PlayerContext] | None = None,
        run_id: str = "",
        steps: TaskSteps | None = None,
        models: ModelClient | None = None,
        history_tail: Sequence[common_pb2.HistoryEntry] | None = None,
    ) -> None:
        self.player = player
        self.registry = registry
        self.source = source
        self.spec = spec
        self.policy: ExecutionPolicy = spec.policy
        self.deadline = deadline
        self.run_id = run_id or uuid.uuid4().hex
        self.steps: list[Step] = []
        self.tool_calls = 0
        self.model_calls = 0
        self.step_count = 0
        self.write_steps = 0
        self._history = history
        self._game_tools = game_tools
        self._current_player = current_player or (lambda: self.player)
        self._call_ids = itertools.count(1)
        self._cancelled = False
        self._steps = steps
        self._models = models
        self._history_tail = history_tail
        self._web_open = False
        self.web_urls: set[str] = set()
        """URLs this run's web searches returned: the only ones its web fetches may ask for."""

    # -- state -----------------------------------------------------------------------------

    def remaining(self) -> float:
        """Seconds left before the run's deadline (never negative)."""
        return max(self.deadline - time.monotonic(), 0.0)

    def cancel(self) -> None:
        """Stops the run cooperatively: its next tool or model call fails with CANCELLED."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def narrow(self, policy: ExecutionPolicy) -> None:
        """Tightens this run's budgets to `policy` where it is stricter (a module spending less
        in some runs: the conversation module in standard mode, say); never loosens them."""
        self.policy = dataclasses.replace(
            self.policy,
            **{
                field.name: min(getattr(self.policy, field.name), getattr(policy, field.name))
                for field in dataclasses.fields(ExecutionPolicy)
            },
        )
        self.deadline = min(self.deadline, time.monotonic() + self.policy.seconds)

    def live_player(self) -> common_pb2.PlayerContext:
        """The player's live permission snapshot (features and level as they are now)."""
        return self._current_player()

    # -- web gate --------------------------------------------------------------------------

    @property
    def web_open(self) -> bool:
        """True once this run's web gate was opened; web tools refuse to run otherwise."""
        return self._web_open

    @property
    def web_session(self) -> str:
        """The model gateway's search session of this run: fetches are allowed only of URLs
        its searches returned."""
        return self.run_id

    def open_web(self) -> bool:
        """Opens the web gate for this run only. The caller (`web_tools.WebGate`) has checked
        the request, the player's search feature and external-services preference; this
        refuses what no check may override: a run started by an event never reaches the web.
        Returns whether the gate is open."""
        if self.source == engine_pb2.ROUTE_SOURCE_EVENT:
            return False
        self._web_open = True
        return True

    @property
    def wrote(self) -> bool:
        """True when at least one write step completed (so a failure now is partial)."""
        return any(not step.read_only for step in self.steps)

    def partial(self, failure: AgentFailure, message: str) -> common_pb2.AgentResult:
        """A PARTIALLY_SUCCEEDED result listing the write steps that completed."""
        return partial_result(failure, message, self.steps)

    # -- checks ----------------------------------------------------------------------------

    def _check_running(self) -> common_pb2.PlayerContext:
        """Cancellation, deadline and permission, checked before every tool and model call."""
        module_id = self.spec.module_id
        if self._cancelled:
            raise self._refusal(AgentFailure.CANCELLED, f"{module_id} was cancelled")
        if self.remaining() <= 0:
            raise self._refusal(
                AgentFailure.TIMEOUT, f"{module_id} ran out of time (policy or deadline)"
            )
        live = self._current_player()
        if not self.registry.allows(module_id, live):
            raise self._refusal(
                AgentFailure.PERMISSION_DENIED,
                f"{module_id} is no longer available to {live.player_name or live.player_id}",
                _NO_LONGER_ALLOWED,
            )
        return live

    def _refusal(
        self, failure: AgentFailure, detail: str, texts: dict[str, str] | None = None
    ) -> ModuleFailure:
        """The failure as the player reads it, in their language (`texts`, else the failure
        catalogue's own); `detail`, which names modules and tools, goes to the engine's log:
        a module's or the catalogue's mistake is the operator's to fix, not the player's."""
        level = logging.INFO if failure is AgentFailure.CANCELLED else logging.WARNING
        log.log(level, "a run was refused: %s", detail)
        return ModuleFailure(failure, pick(texts or FAILURE_TEXTS[failure], self.player.language))

    def _check_budgets(self, calls: int, writes: int) -> None:
        """BUDGET_EXHAUSTED unless the policy leaves room for `calls` more tool calls (each a
        step), `writes` of them write steps."""
        self._spend("tool calls", self.tool_calls + calls - 1, self.policy.tool_calls)
        self._spend("steps", self.step_count + calls - 1, self.policy.steps)
        if writes:
            self._spend("write steps", self.write_steps + writes - 1, self.policy.write_steps)

    def _spend(self, what: str, used: int, limit: int) -> None:
        if used >= limit:
            raise self._refusal(
                AgentFailure.BUDGET_EXHAUSTED,
                f"{self.spec.module_id} used all {limit} {what} its policy allows",
                _TOO_MANY_STEPS,
            )

    def _check_tool(self, tool_id: str, live: common_pb2.PlayerContext) -> ToolSpec:
        spec = self.registry.tools.get(tool_id)
        declared = tool_id in self.spec.tools or tool_id in self.spec.optional_tools
        if spec is None or not declared:
            raise self._refusal(
                AgentFailure.TOOL_UNAVAILABLE,
                f"{self.spec.module_id} did not declare tool {tool_id}",
                FAILURE_TEXTS[AgentFailure.MODULE_FAILED],
            )
        if tool_id in self.spec.optional_tools:
            owner = spec.owner_feature
            if owner and owner != CORE_FEATURE and owner not in live.features:
                raise self._refusal(
                    AgentFailure.TOOL_UNAVAILABLE,
                    f"optional tool {tool_id} needs feature {owner}, which is not enabled",
                    NOT_OFFERED,
                )
        if self.source == engine_pb2.ROUTE_SOURCE_EVENT and not spec.event_allowed:
            raise self._refusal(
                AgentFailure.TOOL_UNAVAILABLE,
                f"events may not call {tool_id}",
                FAILURE_TEXTS[AgentFailure.MODULE_FAILED],
            )
        if not spec.read_only and self.source not in WRITE_SOURCES:
            raise self._refusal(
                AgentFailure.WRITE_NOT_ALLOWED,
                f"{tool_id} changes the game and cannot run from a "
                f"{_source_name(self.source)} route",
                _NEEDS_COMMAND,
            )
        return spec

    # -- calls -----------------------------------------------------------------------------

    async def tool(self, tool_id: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
        """Calls one tool and returns its output.

        Raises:
            ModuleFailure: any check above failed, or the tool failed (catalogued key).
            asyncio.CancelledError: the run was cancelled while the tool ran.
        """
        live = self._check_running()
        spec = self._check_tool(tool_id, live)
        self._check_budgets(1, 0 if spec.read_only else 1)
        payload = dict(data or {})
        try:
            payload = check_input(tool_id, spec.input_schema, payload)
        except InvalidArgument as exc:
            raise ModuleFailure(AgentFailure.INVALID_INPUT, exc.message) from None
        # Charged before the call: a call that fails or times out still used its budget.
        self.tool_calls += 1
        self.step_count += 1
        if not spec.read_only:
            self.write_steps += 1
        call_id = f"{self.run_id}.{next(self._call_ids)}"
        if self._steps is not None and not spec.read_only:
            # The step id doubles as the call id, so a game server may deduplicate on it too.
            output = await self._steps.run(
                spec, lambda step_id: self._call(live, step_id, spec, payload)
            )
        else:
            output = await self._call(live, call_id, spec, payload)
        self.steps.append(Step(call_id, tool_id, spec.read_only, output))
        return output

    async def tools(
        self, calls: Sequence[tuple[str, dict[str, Any] | None]]
    ) -> list[dict[str, Any]]:
        """Calls tools that do not depend on one another (a reward's gives) and returns their
        outputs in the order given; each is a call and a step of its own, as with `tool`.

        They are sent together, so calls to one service travel in one message
        (services.runtime.multiplex), unless one of them is a write step that stores its
        intent first (a task claimed again, or a tool that does not honour call ids): then
        they run one after another in the order given, as `tool` calls would, and stop at the
        first failure. Sent together, the budgets are checked for all of them before any is
        sent; when some fail, the others still finish (their steps count as done) and the
        first failure in the order given is raised.
        """
        live = self._check_running()
        specs = [self._check_tool(tool_id, live) for tool_id, _ in calls]
        steps = self._steps
        journaled = steps is not None and any(
            not spec.read_only and not steps.unjournaled(spec) for spec in specs
        )
        if len(calls) <= 1 or journaled:
            return [await self.tool(tool_id, data) for tool_id, data in calls]
        self._check_budgets(len(calls), sum(not spec.read_only for spec in specs))
        outcomes = await asyncio.gather(
            *(self.tool(tool_id, data) for tool_id, data in calls), return_exceptions=True
        )
        outputs: list[dict[str, Any]] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
            outputs.append(outcome)
        return outputs

    async def _call(
        self,
        live: common_pb2.PlayerContext,
        call_id: str,
        spec: ToolSpec,
        payload: dict[str, Any],
    ) -> dict[str, Any]:
        if spec.kind == ToolKind.GAME:
            return await self._call_game(live, call_id, spec, payload)
        return await self._call_server(spec, payload)

    async def _call_server(self, spec: ToolSpec, payload: dict[str, Any]) -> dict[str, Any]:
        handler = self.registry.tools.handler(spec.tool_id)
        if handler is None:  # registration guarantees one; guard all the same
            raise self._refusal(
                AgentFailure.TOOL_UNAVAILABLE,
                f"{spec.tool_id} has no handler",
                FAILURE_TEXTS[AgentFailure.MODULE_FAILED],
            )
        call = handler(payload, self) if spec.needs_context else handler(payload)
        try:
            return await asyncio.wait_for(call, self.remaining())
        except ModuleFailure as exc:
            if exc.failure not in _OPERATOR_DETAIL or self.spec.min_permission_level > 0:
                # About the input, or for staff (an admin command, who run the deployment):
                # the words as the tool wrote them.
                raise
            texts = _NOT_AVAILABLE if exc.failure is AgentFailure.TOOL_UNAVAILABLE else None
            raise self._refusal(exc.failure, f"{spec.tool_id}: {exc.message}", texts) from None
        except TimeoutError:
            # A read-only tool has no effect that could be unknown (a paid web search is
            # read-only too: it is never repeated, but its timeout is an ordinary one).
            safe = spec.idempotent or spec.read_only
            raise self._refusal(
                AgentFailure.TIMEOUT if safe else AgentFailure.EFFECT_UNKNOWN,
                f"{spec.tool_id} did not finish in time",
            ) from None

    async def _call_game(
        self,
        live: common_pb2.PlayerContext,
        call_id: str,
        spec: ToolSpec,
        payload: dict[str, Any],
    ) -> dict[str, Any]:
        if self._game_tools is None:
            raise self._refusal(
                AgentFailure.TOOL_UNAVAILABLE,
                f"{spec.tool_id} runs on the game server, and this engine has no gateway",
            )
        output = await self._game_tools.call(
            live.player_id,
            call_id,
            spec.tool_id,
            payload,
            self.remaining(),
            spec.idempotent,
            server_id=live.server_id,
            language=live.language,
        )
        # Checked before anything reads it (a step receipt included): a malformed answer is an
        # error, never an empty one.
        found = violation(spec.output_schema, output)
        if found is not None:
            detail = f"{spec.tool_id}: {found.text('the output')}"
            _repeated.log(
                logging.WARNING,
                AgentFailure.TOOL_OUTPUT_INVALID.value,
                "a game tool answered with output that breaks its schema (docs/game-tools.md): %s",
                detail,
            )
            raise ModuleFailure(
                AgentFailure.TOOL_OUTPUT_INVALID,
                pick(_UNREADABLE, live.language, detail=detail),
            )
        normalised: dict[str, Any] = normalise(spec.output_schema, output)
        return normalised

    def charge_model_call(self) -> None:
        """Counts one model call against the budget (and as a step), after the same permission,
        cancellation and deadline checks as a tool call. Call it before every model request.

        Raises:
            ModuleFailure: BUDGET_EXHAUSTED, CANCELLED, TIMEOUT or PERMISSION_DENIED.
        """
        self._check_running()
        self._spend("model calls", self.model_calls, self.policy.model_calls)
        self._spend("steps", self.step_count, self.policy.steps)
        self.model_calls += 1
        self.step_count += 1

    async def complete(
        self,
        messages: list[model_pb2.ChatMessage],
        tools: list[model_pb2.Tool] | None = None,
        require_tool: bool = False,
        max_tokens: int = 0,
        json_output: bool = False,
    ) -> Completion:
        """One model call through the model gateway, charged to the budget first and given at
        most the policy's per-call time (and never more than the run has left).

        Raises:
            ModuleFailure: the checks of `charge_model_call`; MODEL_UNAVAILABLE with no model
                (or none configured) and in the player's offline mode, PERMISSION_DENIED when the player turned external
                services off, BUDGET_EXHAUSTED for a spent daily budget, TIMEOUT.
        """
        self.charge_model_call()
        language = self.player.language
        if self._models is None:
            _repeated.log(logging.WARNING, "no model gateway", "this engine has no model gateway")
            raise ModuleFailure(AgentFailure.MODEL_UNAVAILABLE, pick(_MODEL_UNAVAILABLE, language))
        if self.live_player().conversation_mode == common_pb2.CONVERSATION_MODE_OFFLINE:
            raise ModuleFailure(AgentFailure.MODEL_UNAVAILABLE, pick(_OFFLINE, language))
        timeout = min(self.policy.model_call_seconds, self.remaining())
        try:
            return await self._models.complete(
                self.player.player_id,
                _with_data_rule(messages),
                timeout,
                tools=tools,
                require_tool=require_tool,
                max_tokens=max_tokens,
                json_output=json_output,
                module_id=self.spec.module_id,
                permission_level=self.live_player().permission_level,
            )
        except ModuleFailure as exc:
            _repeated.log(
                logging.WARNING, exc.failure.value, "a model call failed: %s", exc.message
            )
            texts = _MODEL_FAILURES.get(exc.failure, _MODEL_UNAVAILABLE)
            raise ModuleFailure(exc.failure, pick(texts, language)) from None

    @property
    def models(self) -> ModelClient | None:
        """The model gateway client, for server tools that reach the web through it."""
        return self._models

    async def list_history(self, page_size: int) -> list[common_pb2.HistoryEntry]:
        tail = self._history_tail
        if (
            tail is not None
            and page_size > 0
            and (page_size <= len(tail) or len(tail) < self.spec.history_entries)
        ):
            # Read when the run began, under the player's lease: every exchange already
            # answered is in it (a tail shorter than asked for is the whole history).
            return list(tail[-page_size:])
        try:
            return await self._history.list_history(self.player.player_id, page_size)
        except Exception as exc:  # noqa: BLE001 - any storage failure is the same to a module
            raise ModuleFailure(
                AgentFailure.STORAGE_UNAVAILABLE, pick(_HISTORY_UNAVAILABLE, self.player.language)
            ) from exc


def _source_name(source: int) -> str:
    try:
        return engine_pb2.RouteSource.Name(source).removeprefix("ROUTE_SOURCE_").lower()
    except ValueError:
        return "unknown"


def _with_data_rule(messages: list[model_pb2.ChatMessage]) -> list[model_pb2.ChatMessage]:
    """`messages` whose system message ends with `untrusted.DATA_RULE` (one is put first
    when there is none): every prompt says that data in it is never an instruction, whichever
    module wrote the prompt (decision 0026)."""
    sent = list(messages)
    if sent and sent[0].role == model_pb2.MESSAGE_ROLE_SYSTEM:
        if DATA_RULE not in sent[0].content:
            first = model_pb2.ChatMessage()
            first.CopyFrom(sent[0])
            first.content = with_data_rule(first.content)
            sent[0] = first
        return sent
    return [model_pb2.ChatMessage(role=model_pb2.MESSAGE_ROLE_SYSTEM, content=DATA_RULE), *sent]
