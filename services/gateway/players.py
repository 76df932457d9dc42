"""Serves player requests: chat is routed then executed; invoke and card actions execute
directly; controls and preferences go to storage. Every answer is a PlayerResponse with the
request's id. Failures a player can act on come back as FAILED results with a card."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from google.protobuf import struct_pb2
from prometheus_client import Counter
from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2, engine_pb2_grpc
from system.gateway.v1 import gateway_pb2
from system.router.v1 import router_pb2, router_pb2_grpc
from system.storage.v1 import player_data_pb2, player_data_pb2_grpc, storage_pb2, storage_pb2_grpc

from services.gateway.cards import CardBook
from services.modes import MODES, mode_by_name
from services.results import AgentFailure, card, failed, failure_text
from services.runtime.channels import DEFAULT_CALL_SECONDS, ChannelSettings, Dependency
from services.runtime.logging import RepeatedLines
from services.runtime.multiplex import StreamedCalls
from services.texts import pick

__all__ = ["PlayerRequests", "PlayerState"]

log = logging.getLogger("system.gateway.players")
# A dependency's refusals come in bursts under load (BUSY): one line per code per 10 s.
_repeated = RepeatedLines(log)

_SOURCES = {
    router_pb2.DECISION_SOURCE_BUTTON: engine_pb2.ROUTE_SOURCE_BUTTON,
    router_pb2.DECISION_SOURCE_COMMAND: engine_pb2.ROUTE_SOURCE_COMMAND,
    router_pb2.DECISION_SOURCE_CACHE: engine_pb2.ROUTE_SOURCE_CACHE,
    router_pb2.DECISION_SOURCE_LOCAL: engine_pb2.ROUTE_SOURCE_LOCAL,
    router_pb2.DECISION_SOURCE_MODEL: engine_pb2.ROUTE_SOURCE_MODEL,
    router_pb2.DECISION_SOURCE_CHAT: engine_pb2.ROUTE_SOURCE_CHAT,
}
_FALLBACK_TITLE = {"zh": "想做哪一项？", "en": "Which of these did you mean?"}
_FALLBACK_HELP = {
    "zh": "都不是？输入 /help 查看全部功能。",
    "en": "None of these? Type /help to see everything I can do.",
}
_TYPE_COMMAND = {"zh": "{label}：请输入 {usage}", "en": "{label}: type {usage}"}
_TYPE_IT = {"zh": "请输入指令：{usage}", "en": "Type the command: {usage}"}
"""A suggested command's line: what it does (its module's label), then how to type it."""
SELECTION_TEMPLATE = "system:selection"
SETTINGS_MODULE = "system:settings"
SETTINGS_ACTIONS = frozenset({"preferences", "clear_history"})
"""Card actions the gateway carries out itself (the settings card's buttons), then shows the
settings card again."""
_REVOKED = "an administrator revoked your access to the assistant"
"""Said to the game server (a protocol refusal); the player reads `_REVOKED_TEXT`."""
_REVOKED_TEXT = {
    "zh": "管理员已停用你使用助手的权限。",
    "en": "An administrator revoked your access to the assistant.",
}
_UNAVAILABLE = {
    "zh": "助手暂时无法使用，请稍后再试。",
    "en": "The assistant is unavailable right now; try again later.",
}

_CLEARED = {
    "zh": "对话记录已清空（{n} 条）。",
    "en": "Conversation history cleared ({n:~entry|entries}).",
}

# Status codes from a dependency, as the failure a player sees.
_RPC_FAILURES = {
    grpc.StatusCode.INVALID_ARGUMENT: AgentFailure.INVALID_INPUT,
    grpc.StatusCode.NOT_FOUND: AgentFailure.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED: AgentFailure.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: AgentFailure.BUSY,
    grpc.StatusCode.DEADLINE_EXCEEDED: AgentFailure.TIMEOUT,
}


MAX_INPUT_DEPTH = 16
"""Deepest nesting of a button's JSON input (the gateway's Struct limit: deeper inputs could
not be decoded downstream)."""
FIRST_PAUSE_SECONDS = 0.25
MOST_PAUSE_SECONDS = 15.0
"""An engine call the gateway asks again (`_ask_engine`) waits a pause that starts here and
doubles up to the most, each drawn between half and all of it, so a restarted engine is not
met by every waiting call at once."""
EVENT_AGAIN_SECONDS = 30.0
"""How long a game event the engine could not be reached for is sent again (an engine rolled
out) before the game server is told (it may resend with the same key later)."""
_RESUME_AGAIN = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
"""Codes after which a join's resume is asked again: the engine was away, too slow or busy
(nothing else queues the player's waiting tasks before their next join)."""
_EVENT_AGAIN = frozenset({grpc.StatusCode.UNAVAILABLE})
"""Codes after which an event is sent again: no engine could be reached. A busy or slow engine
is said to the game server at once, which resends later (the plugin guide)."""
ENGINE_CALLS_ASKED_AGAIN = Counter(
    "gateway_engine_calls_asked_again_total",
    "Calls to the engine asked again because no engine could take them: a join's "
    "ResumePlayerTasks (unavailable, too slow or busy) or a game event's SubmitEvent "
    "(unavailable).",
    ["call"],
)
CATALOG_SECONDS = 5.0
"""Longest a hello waits for the engine's game-tool catalogue before going on unchecked."""
CATALOG_TTL_SECONDS = 300.0
"""How long the catalogue is kept: an engine rolled out with other modules is seen within it."""
# Longest a history control waits for the engine to settle the player's history (the engine
# itself waits at most half a second for a run finishing elsewhere).
SETTLE_SECONDS = 2.0


def _depth(value: object) -> int:
    """Nesting depth of a JSON value (a scalar is 0)."""
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def rpc_failure(exc: grpc.aio.AioRpcError, language: str) -> common_pb2.AgentResult:
    """A dependency's error as a result the player sees, in their language; details only for
    their own input."""
    failure = _RPC_FAILURES.get(exc.code(), AgentFailure.MODULE_FAILED)
    if failure in (
        AgentFailure.INVALID_INPUT,
        AgentFailure.NOT_FOUND,
        AgentFailure.PERMISSION_DENIED,
    ):
        return failed(failure, exc.details() or failure.value)
    if failure in (AgentFailure.BUSY, AgentFailure.TIMEOUT):
        return failed(failure, failure_text(failure, language))
    return failed(failure, pick(_UNAVAILABLE, language))


@dataclasses.dataclass
class PlayerState:
    """What the gateway remembers of a joined player between requests."""

    current_list: list[common_pb2.ModuleAction] = dataclasses.field(default_factory=list)
    """Actions of the numbered buttons on the last card shown that had any (`查看 1` picks the
    first)."""
    revoked: bool | None = None
    """True once an administrator revoked the player (their binding, in storage): every
    request is refused. None until first read from storage; a relayed binding change sets it
    at once."""
    cards: CardBook = dataclasses.field(default_factory=CardBook)
    """The cards sent to the player, for checking their button presses: kept in storage too,
    so those sent on an earlier connection or another replica count (decision 0030)."""
    preferences: storage_pb2.PlayerPreferences | None = None
    """The player's preferences; None until first read from storage. This gateway is the only
    writer of preferences (their frames and the settings card's buttons come through it), so
    the copy stays true while the player is connected here."""
    granted_features: tuple[str, ...] | None = None
    """Features granted to the player alone (PlayerDataService.SetPlayerFeature), added to
    those their game server offers; None until read from storage with the binding. A relayed
    change (NotifyPlayer `features_changed`) replaces them at once."""


def _typed_buttons(
    buttons: Sequence[common_pb2.CardButton],
) -> list[tuple[common_pb2.CardButton, router_pb2.NotificationButton]]:
    """The buttons of the card a player is looking at that typed words may press, each with
    what the router's notification matching reads of it: a typed `领取` may press one of
    these, and nothing else. `invoke` buttons, and a settings card's preference toggles (they
    run no module: an empty action; the gateway carries them out as a press). Clearing the
    conversation memory, which cannot be undone, only a press of its button does."""
    found = []
    for button in buttons:
        action = _button_action(button)
        if action is None and button.action_id == "preferences":
            action = common_pb2.ModuleAction()
        if action is not None:
            found.append(
                (
                    button,
                    router_pb2.NotificationButton(
                        action=action, label_key=button.label_key, label=button.label
                    ),
                )
            )
    return found


def _button_action(button: common_pb2.CardButton) -> common_pb2.ModuleAction | None:
    """The module action of an `invoke` button; None for another button or unreadable input."""
    if button.action_id != "invoke" or not button.args.get("module_id"):
        return None
    data = struct_pb2.Struct()
    try:
        parsed = json.loads(button.args.get("input") or "{}")
        if not isinstance(parsed, dict):
            return None
        data.update(parsed)
    except (ValueError, OverflowError, RecursionError):
        return None
    return common_pb2.ModuleAction(module_id=button.args["module_id"], input=data)


def _listed_actions(result: common_pb2.AgentResult) -> list[common_pb2.ModuleAction]:
    """The actions of a card's buttons, in order, so that a typed number picks the button the
    card shows with it; a button no typed number may press (one marked `press_only`, a write's
    such as a quote's confirm, or one that runs no module) is an empty action, keeping the
    numbers (`2` is still Back to the shop when `1` is Confirm purchase)."""
    actions = []
    for button in result.card.buttons:
        action = None if button.args.get("press_only") == "true" else _button_action(button)
        actions.append(action if action is not None else common_pb2.ModuleAction())
    return actions


class PlayerRequests:
    """Handles one PlayerRequest at a time; owns the channels to router, engine and storage."""

    def __init__(
        self,
        router_target: str,
        engine_target: str,
        storage_target: str,
        settings: ChannelSettings | None = None,
        default_mode: common_pb2.ConversationMode = common_pb2.CONVERSATION_MODE_STANDARD,
    ) -> None:
        self.default_mode = default_mode
        """The server's conversation mode for players who chose none."""
        self.router = Dependency(
            router_target,
            router_pb2_grpc.RouterServiceStub,
            idempotent_methods=["system.router.v1.RouterService/Route"],
            settings=settings,
        )
        self.engine = Dependency(
            engine_target, engine_pb2_grpc.EngineServiceStub, settings=settings
        )
        # Events and resumes, which every game server sends all the time, on the engine's
        # MultiplexCalls stream (unary calls to an engine without it: decision 0021).
        self._engine_calls = StreamedCalls(
            self.engine, engine_pb2.DESCRIPTOR.services_by_name["EngineService"]
        )
        # The catalogue is asked for at hello time, maybe before the engine is up: on
        # connections of its own, so a refused attempt never puts the request path's
        # connection to the engine into reconnect backoff.
        self._catalogue = Dependency(
            engine_target,
            engine_pb2_grpc.EngineServiceStub,
            idempotent_methods=["system.engine.v1.EngineService/GetGameToolCatalog"],
            private=True,
            settings=settings,
        )
        self._tool_catalog: tuple[float, list[engine_pb2.GameToolEntry]] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.bindings = Dependency(
            storage_target,
            player_data_pb2_grpc.PlayerDataServiceStub,
            idempotent_methods=["system.storage.v1.PlayerDataService/GetBinding"],
            settings=settings,
        )
        self.storage = Dependency(
            storage_target,
            storage_pb2_grpc.StorageServiceStub,
            idempotent_methods=[
                "system.storage.v1.StorageService/ListHistory",
                "system.storage.v1.StorageService/GetPreferences",
                "system.storage.v1.StorageService/UpdatePreferences",
                "system.storage.v1.StorageService/ClearHistory",
            ],
            settings=settings,
        )

    async def game_tool_catalog(self) -> list[engine_pb2.GameToolEntry] | None:
        """The engine's game-tool catalogue (what each hello is checked against), asked once and
        kept for CATALOG_TTL_SECONDS; None when the engine could not be asked (the next hello
        asks again)."""
        now = time.monotonic()
        if self._tool_catalog is None or now - self._tool_catalog[0] > CATALOG_TTL_SECONDS:
            try:
                response = await self._catalogue.stub.GetGameToolCatalog(
                    engine_pb2.GetGameToolCatalogRequest(), timeout=CATALOG_SECONDS
                )
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "the game-tool catalogue could not be read from the engine (%s: %s); "
                    "this hello's tools are not checked",
                    exc.code().name,
                    exc.details(),
                )
                return None
            self._tool_catalog = (now, list(response.tools))
        return self._tool_catalog[1]

    async def aclose(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self._engine_calls.aclose()
        for dep in (self.router, self.engine, self._catalogue, self.storage, self.bindings):
            await dep.aclose()

    def _in_background(self, call: Awaitable[Any], what: str) -> None:
        """Runs a call whose answer nobody waits for; failures are logged, never raised."""

        async def run() -> None:
            try:
                await call
            except Exception as exc:  # noqa: BLE001 - best effort by design
                log.info("%s failed: %s", what, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def forget(self, player: common_pb2.PlayerContext, reason: router_pb2.ClearReason) -> None:
        """Tells the router to drop the player's intent-cache scope."""
        self._in_background(
            self.router.stub.ClearPlayerScope(
                router_pb2.ClearPlayerScopeRequest(
                    player_id=player.player_id, server_id=player.server_id, reason=reason
                )
            ),
            "clearing the player's routing scope",
        )

    async def _settle_history(self, player: common_pb2.PlayerContext) -> None:
        """Waits for the player's answered exchanges to be in history (the engine writes each
        just after its reply), so that reading or clearing it now misses none. Best effort:
        without the engine the control still works on what storage holds."""
        try:
            await self.engine.stub.SettleHistory(
                engine_pb2.SettleHistoryRequest(player=player), timeout=SETTLE_SECONDS
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("history not settled before a history control: %s", exc.details())

    def cancel_runs(self, player: common_pb2.PlayerContext) -> None:
        """Asks the engine to cancel the player's runs (a CANCEL control); the gateway's own
        tasks for the player are cancelled by the caller."""
        self._in_background(
            self.engine.stub.CancelRun(engine_pb2.CancelRunRequest(player=player)),
            "cancelling the player's engine runs",
        )

    async def _ask_engine(
        self,
        method: str,
        request: Any,
        again: frozenset[grpc.StatusCode],
        staying: Callable[[], bool],
        seconds: float | None = None,
    ) -> Any:
        """The engine's answer to `request` on its stream, asked again after a growing pause
        (FIRST_PAUSE_SECONDS to MOST_PAUSE_SECONDS) while it fails with a code in `again`,
        `staying()` holds and, when given, `seconds` have not passed; the last failure is
        raised then. Only for calls that are safe to repeat."""
        loop = asyncio.get_running_loop()
        until = None if seconds is None else loop.time() + seconds
        pause = FIRST_PAUSE_SECONDS
        while True:
            try:
                return await self._engine_calls.call(method, request, DEFAULT_CALL_SECONDS)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in again or (until is not None and loop.time() >= until):
                    raise
                _repeated.log(
                    logging.WARNING,
                    f"{method}:{exc.code().name}",
                    "%s could not be taken by an engine (%s: %s); asked again",
                    method,
                    exc.code().name,
                    exc.details(),
                )
                await asyncio.sleep(random.uniform(pause / 2, pause))  # noqa: S311 - jitter
                pause = min(pause * 2, MOST_PAUSE_SECONDS)
                if not staying():
                    raise
            ENGINE_CALLS_ASKED_AGAIN.labels(method).inc()

    def resume_tasks(
        self,
        player: common_pb2.PlayerContext,
        arrived: Awaitable[object] | None = None,
        staying: Callable[[], bool] = lambda: True,
    ) -> None:
        """A player joined: the engine queues their waiting event tasks, once `arrived` is
        done (storage names this replica for them: the tasks' game-tool calls find them).
        Asked again while `staying()` (the player is still attached here) if no engine could
        take it: without it their waiting tasks would wait for their next join (nothing else
        queues them; a resume twice queues nothing more)."""

        async def resume() -> None:
            if arrived is not None:
                await arrived
            await self._ask_engine(
                "ResumePlayerTasks",
                engine_pb2.ResumePlayerTasksRequest(player=player),
                _RESUME_AGAIN,
                staying,
            )

        self._in_background(resume(), "resuming the player's event tasks")

    def submit_event(
        self,
        player: common_pb2.PlayerContext,
        event: gateway_pb2.GameEvent,
        online: bool,
        refused: Callable[[grpc.StatusCode, str], None],
        arrived: Awaitable[object] | None = None,
        state: PlayerState | None = None,
        staying: Callable[[], bool] = lambda: True,
    ) -> None:
        """Hands a game event to the engine, once `arrived` is done (as for `resume_tasks`),
        unless an administrator revoked the player (`state`: what the gateway knows of them);
        `refused(code, message)` is called then, or if the engine refuses it or cannot be
        reached for EVENT_AGAIN_SECONDS while `staying()` (the game server's connection is
        open: the game server may resend with the same key)."""

        async def submit() -> None:
            if arrived is not None:
                await arrived
            if await self._revoked(player, state if state is not None else PlayerState()):
                refused(grpc.StatusCode.PERMISSION_DENIED, _REVOKED)
                return
            try:
                await self._ask_engine(
                    "SubmitEvent",
                    engine_pb2.SubmitEventRequest(
                        player=player,
                        event_type=event.event_type,
                        event_key=event.event_key,
                        data=event.data,
                        player_online=online,
                    ),
                    _EVENT_AGAIN,
                    staying,
                    EVENT_AGAIN_SECONDS,
                )
            except grpc.aio.AioRpcError as exc:
                refused(exc.code(), exc.details() or exc.code().name)

        self._in_background(submit(), "submitting a game event")

    async def handle(
        self,
        player: common_pb2.PlayerContext,
        request: gateway_pb2.PlayerRequest,
        busy_request_id: str,
        state: PlayerState | None = None,
    ) -> gateway_pb2.PlayerResponse:
        """The response to `request`. `busy_request_id` is another request of this player in
        progress, if any (for State answers); `state` is what the gateway remembers of them."""
        state = state if state is not None else PlayerState()
        response = gateway_pb2.PlayerResponse(
            request_id=request.request_id, player_id=player.player_id
        )
        kind = request.WhichOneof("body")
        try:
            if await self._revoked(player, state):
                response.reply.CopyFrom(
                    gateway_pb2.Reply(
                        result=failed(
                            AgentFailure.PERMISSION_DENIED, pick(_REVOKED_TEXT, player.language)
                        )
                    )
                )
                return response
            if kind in ("chat", "invoke", "card_action"):
                await state.cards.load()  # the cards sent on an earlier connection (0030)
                player = self._in_force(player, await self._preferences_of(player, state), state)
            if kind == "chat":
                response.reply.CopyFrom(
                    await self._chat(player, request.chat.text, state, request.chat.viewing)
                )
            elif kind == "invoke":
                result = await self._execute(
                    player, request.invoke.call, engine_pb2.ROUTE_SOURCE_INVOKE, ""
                )
                response.reply.CopyFrom(
                    gateway_pb2.Reply(result=result, module_id=request.invoke.call.module_id)
                )
            elif kind == "card_action":
                response.reply.CopyFrom(await self._pressed(player, request.card_action, state))
            elif kind == "control":
                await self._control(player, request.control.action, response, busy_request_id)
            elif kind == "preferences":
                state.preferences = await self._preferences(
                    player, request.preferences, response, busy_request_id
                )
            if response.HasField("reply") and response.reply.result.HasField("card"):
                # A card without numbered buttons (a profile, a "no such mail") leaves the
                # last list in place: `查看 2` still picks from what the player last saw listed.
                state.current_list = _listed_actions(response.reply.result) or state.current_list
        except grpc.aio.AioRpcError as exc:
            _repeated.log(
                logging.WARNING,
                exc.code().name,
                "dependency answered %s: %s",
                exc.code().name,
                (exc.details() or "")[:256],
            )
            response.reply.CopyFrom(gateway_pb2.Reply(result=rpc_failure(exc, player.language)))
        return response

    async def _revoked(self, player: common_pb2.PlayerContext, state: PlayerState) -> bool:
        """Whether an administrator revoked the player: read from storage once per connection,
        with the features granted to them alone (then kept: a revoke, grant, reset or feature
        change is relayed to the connection at once). When storage cannot say, the player is
        served with their server's features and it is asked again next time."""
        if state.revoked is None or state.granted_features is None:
            try:
                binding = await self.bindings.stub.GetBinding(
                    player_data_pb2.GetBindingRequest(player_id=player.player_id)
                )
            except grpc.aio.AioRpcError as exc:
                log.info("binding unavailable (%s); serving the player", exc.code().name)
                return False
            state.revoked = binding.state == player_data_pb2.BINDING_STATE_REVOKED
            state.granted_features = tuple(binding.features)
        return state.revoked

    async def _preferences_of(
        self, player: common_pb2.PlayerContext, state: PlayerState
    ) -> storage_pb2.PlayerPreferences | None:
        """The player's preferences, read from storage once per connection; None when storage
        cannot say (then no model call, no intent cache, the server's mode: ask again next
        time)."""
        if state.preferences is None:
            try:
                prefs = await self.storage.stub.GetPreferences(
                    storage_pb2.GetPreferencesRequest(player_id=player.player_id)
                )
            except grpc.aio.AioRpcError as exc:
                log.info("preferences unavailable (%s); routing without the model", exc.code().name)
                return None
            state.preferences = prefs.preferences
        return state.preferences

    def mode_of(self, prefs: storage_pb2.PlayerPreferences | None) -> common_pb2.ConversationMode:
        """The mode in force: the player's choice, else the server's default."""
        if prefs is not None and prefs.conversation_mode:
            return prefs.conversation_mode
        return self.default_mode

    def _in_force(
        self,
        player: common_pb2.PlayerContext,
        prefs: storage_pb2.PlayerPreferences | None,
        state: PlayerState,
    ) -> common_pb2.PlayerContext:
        """The player as this request sees them (a copy: the connection's own stays): the mode
        in force, and their server's features with those granted to them alone."""
        moded = common_pb2.PlayerContext()
        moded.CopyFrom(player)
        moded.conversation_mode = self.mode_of(prefs)
        if state.granted_features:
            moded.features[:] = sorted({*player.features, *state.granted_features})
        return moded

    async def _chat(
        self,
        player: common_pb2.PlayerContext,
        text: str,
        state: PlayerState,
        viewing: common_pb2.CardRef | None = None,
    ) -> gateway_pb2.Reply:
        prefs = state.preferences  # read by `handle` just before
        viewed = state.cards.current(viewing) if viewing is not None else None
        typed = _typed_buttons(viewed.shown) if viewed else []
        decision: router_pb2.RouteResponse = await self.router.stub.Route(
            router_pb2.RouteRequest(
                player=player,
                text=text,
                current_list=state.current_list,
                notification_buttons=[readable for _, readable in typed],
                external_enabled=prefs is not None and prefs.external_enabled,
                history_disabled=prefs is None or not prefs.history_enabled,
            )
        )
        if (
            viewing is not None
            and decision.source == router_pb2.DECISION_SOURCE_BUTTON
            and 0 < decision.notification_button <= len(typed)
            and not decision.action.module_id
        ):
            # A settings toggle typed at its card (`turn history off`): pressed, as a click is.
            button = typed[decision.notification_button - 1][0]
            return await self._pressed(
                player,
                gateway_pb2.CardAction(
                    source=viewing, action_id=button.action_id, args=dict(button.args)
                ),
                state,
            )
        source = _SOURCES.get(decision.source)
        if source is not None:
            result = await self._execute(player, decision.action, source, text)
            if (
                decision.source == router_pb2.DECISION_SOURCE_MODEL
                and result.status == common_pb2.RESULT_STATUS_SUCCEEDED
                and prefs is not None
                and prefs.history_enabled
            ):
                self._in_background(
                    self.router.stub.RecordOutcome(
                        router_pb2.RecordOutcomeRequest(
                            player=player,
                            text=text,
                            action=decision.action,
                            cache_token=decision.cache_token,
                        )
                    ),
                    "recording the routing outcome",
                )
            return gateway_pb2.Reply(result=result, module_id=decision.action.module_id)
        if decision.source == router_pb2.DECISION_SOURCE_LOCAL_FALLBACK and decision.candidates:
            selection = self._selection(
                player, decision.candidates, decision.candidate_labels, decision.command_hints
            )
            return gateway_pb2.Reply(result=selection)
        failure = (
            AgentFailure.UNKNOWN_COMMAND
            if decision.no_route_reason == router_pb2.NO_ROUTE_REASON_UNKNOWN_COMMAND
            else AgentFailure.NO_MATCH
        )
        return gateway_pb2.Reply(result=failed(failure, decision.detail or failure.value))

    async def _execute(
        self,
        player: common_pb2.PlayerContext,
        action: common_pb2.ModuleAction,
        source: engine_pb2.RouteSource,
        text: str,
    ) -> common_pb2.AgentResult:
        response = await self.engine.stub.Execute(
            engine_pb2.ExecuteRequest(
                player=player, action=action, source=source, request_text=text
            )
        )
        return response.result

    def _selection(
        self,
        player: common_pb2.PlayerContext,
        candidates: Sequence[common_pb2.ModuleAction],
        labels: Sequence[str] = (),
        command_hints: Sequence[router_pb2.CommandHint] = (),
    ) -> common_pb2.AgentResult:
        """A selection card: one button per read-only candidate, labelled in the player's
        language where the router gave a label (else the module id), and the command of a
        change the text resembles (`/buy <item [count]>`), which no button may run. Nothing
        runs until pressed."""
        buttons = [
            common_pb2.CardButton(
                action_id="invoke",
                label=(labels[i] if i < len(labels) and labels[i] else candidate.module_id),
                args={
                    "module_id": candidate.module_id,
                    "input": json.dumps(dict(candidate.input.items()), ensure_ascii=False),
                },
            )
            for i, candidate in enumerate(candidates)
        ]
        # Each line suggests its command when clicked, where the game client can: as the text
        # already gave it (`/buy 2 bread`), else its name.
        lines = [
            (
                pick(
                    _TYPE_COMMAND if hint.label else _TYPE_IT,
                    player.language,
                    usage=hint.command or hint.usage,
                    label=hint.label,
                ),
                hint.command or hint.usage.split(" ", 1)[0] + " ",
            )
            for hint in command_hints
        ]
        lines.append((pick(_FALLBACK_HELP, player.language), "/help"))
        selection = card(SELECTION_TEMPLATE, pick(_FALLBACK_TITLE, player.language), lines, buttons)
        return common_pb2.AgentResult(
            status=common_pb2.RESULT_STATUS_SUCCEEDED, card=selection, text=selection.title
        )

    async def _pressed(
        self,
        player: common_pb2.PlayerContext,
        action: gateway_pb2.CardAction,
        state: PlayerState,
    ) -> gateway_pb2.Reply:
        """A button press, checked against the card it names (cards.py): a stale or unknown
        card, or a button it did not carry, runs nothing. An answer that is a new card of the
        pressed card's template updates the pressed card (same id, next version); a selection
        card is closed once a choice was made."""
        refusal = await state.cards.check(action, player.language)
        pressed = state.cards.shown(action.source.card_id)
        if refusal is not None or pressed is None:
            result = failed(AgentFailure.STALE_CARD, refusal or "that card is no longer active")
            result.failure.args.update(
                {"card_id": action.source.card_id, "version": str(action.source.version)}
            )
            return gateway_pb2.Reply(result=result)
        # History records the press as the button's words, in brackets (`[Claim reward]`).
        button = pressed.button(action)
        said = f"[{button.label}]" if button is not None and button.label else ""
        if action.action_id in SETTINGS_ACTIONS:
            result, module_id = await self._settings_press(player, action, state, said)
        else:
            result, module_id = await self._card_action(player, action, said)
        reply = gateway_pb2.Reply(result=result, module_id=module_id)
        answer = reply.result.card
        if (
            result.HasField("card")
            and answer.template == pressed.template
            and state.cards.shown(answer.ref.card_id) is None
        ):
            answer.ref.CopyFrom(
                common_pb2.CardRef(card_id=action.source.card_id, version=pressed.version + 1)
            )
        elif pressed.template == SELECTION_TEMPLATE:
            state.cards.close(action.source.card_id)
            reply.closes.append(action.source)
        return reply

    async def _settings_press(
        self,
        player: common_pb2.PlayerContext,
        action: gateway_pb2.CardAction,
        state: PlayerState,
        said: str,
    ) -> tuple[common_pb2.AgentResult, str]:
        """A settings card's button (`system:settings`): a preference change or clearing the
        conversation memory, carried out here (the gateway owns preferences), then the card
        shown again with what changed."""
        shown: dict[str, Any] = {}
        if action.action_id == "preferences":
            change = _preference_change(dict(action.args))
            if change is None:
                return failed(
                    AgentFailure.INVALID_INPUT,
                    "a preferences button sets history or external to on or off, or mode to "
                    "offline, standard, extended, free or default",
                ), ""
            state.preferences = await self._apply_preferences(player, change)
        else:
            await self._settle_history(player)
            cleared = await self.storage.stub.ClearHistory(
                storage_pb2.ClearHistoryRequest(player_id=player.player_id)
            )
            self.forget(player, router_pb2.CLEAR_REASON_MEMORY_CLEARED)
            shown["cleared"] = cleared.deleted
        data = struct_pb2.Struct()
        data.update(shown)
        call = common_pb2.ModuleAction(module_id=SETTINGS_MODULE, input=data)
        player = self._in_force(player, state.preferences, state)
        return await self._execute(
            player, call, engine_pb2.ROUTE_SOURCE_BUTTON, said
        ), SETTINGS_MODULE

    async def _card_action(
        self, player: common_pb2.PlayerContext, action: gateway_pb2.CardAction, said: str
    ) -> tuple[common_pb2.AgentResult, str]:
        if action.action_id != "invoke" or not action.args.get("module_id"):
            return failed(
                AgentFailure.INVALID_INPUT,
                f"card action {action.action_id!r} is not one this gateway knows",
            ), ""
        data = struct_pb2.Struct()
        raw = action.args.get("input", "")
        if raw:
            try:
                parsed = json.loads(raw)
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                parsed = None
            if not isinstance(parsed, dict):
                return failed(
                    AgentFailure.INVALID_INPUT, "the button's input is not a JSON object"
                ), ""
            try:
                if _depth(parsed) > MAX_INPUT_DEPTH:
                    raise ValueError
                data.update(parsed)
            except (
                ValueError,
                OverflowError,
                RecursionError,
            ):  # e.g. a number too big for a double
                return failed(
                    AgentFailure.INVALID_INPUT,
                    f"the button's input cannot be sent on: numbers must fit a double and "
                    f"nesting must stay within {MAX_INPUT_DEPTH} levels",
                ), ""
        module_id = action.args["module_id"]
        call = common_pb2.ModuleAction(module_id=module_id, input=data)
        return await self._execute(player, call, engine_pb2.ROUTE_SOURCE_BUTTON, said), module_id

    async def _control(
        self,
        player: common_pb2.PlayerContext,
        action: int,
        response: gateway_pb2.PlayerResponse,
        busy_request_id: str,
    ) -> None:
        stub = self.storage.stub
        if action in (gateway_pb2.CONTROL_ACTION_STATE, gateway_pb2.CONTROL_ACTION_CANCEL):
            prefs = await stub.GetPreferences(
                storage_pb2.GetPreferencesRequest(player_id=player.player_id)
            )
            response.state.CopyFrom(self._state(prefs.preferences, busy_request_id))
        elif action == gateway_pb2.CONTROL_ACTION_HISTORY:
            await self._settle_history(player)
            page = await stub.ListHistory(
                storage_pb2.ListHistoryRequest(player_id=player.player_id)
            )
            response.history.CopyFrom(gateway_pb2.History(entries=page.entries))
        elif action == gateway_pb2.CONTROL_ACTION_CLEAR_HISTORY:
            await self._settle_history(player)
            cleared = await stub.ClearHistory(
                storage_pb2.ClearHistoryRequest(player_id=player.player_id)
            )
            self.forget(player, router_pb2.CLEAR_REASON_MEMORY_CLEARED)
            text = pick(_CLEARED, player.language, n=cleared.deleted)
            response.notice.CopyFrom(
                gateway_pb2.Notice(
                    result=common_pb2.AgentResult(
                        status=common_pb2.RESULT_STATUS_SUCCEEDED, text=text
                    )
                )
            )

    async def _preferences(
        self,
        player: common_pb2.PlayerContext,
        prefs: gateway_pb2.Preferences,
        response: gateway_pb2.PlayerResponse,
        busy_request_id: str,
    ) -> storage_pb2.PlayerPreferences:
        """Applies a preference change; `response.state` tells the player the outcome."""
        updated = await self._apply_preferences(player, prefs)
        response.state.CopyFrom(self._state(updated, busy_request_id))
        return updated

    async def _apply_preferences(
        self, player: common_pb2.PlayerContext, prefs: gateway_pb2.Preferences
    ) -> storage_pb2.PlayerPreferences:
        """Stores a preference change (unset fields stay) and forgets the player's routing
        scope; returns the preferences after it."""
        update = storage_pb2.UpdatePreferencesRequest(player_id=player.player_id)
        if prefs.HasField("history"):
            update.history_enabled = prefs.history
        if prefs.HasField("external"):
            update.external_enabled = prefs.external
        if prefs.HasField("mode"):
            update.conversation_mode = prefs.mode
        updated = await self.storage.stub.UpdatePreferences(update)
        self.forget(player, router_pb2.CLEAR_REASON_PREFERENCES_CHANGED)
        return updated.preferences

    def _state(
        self, prefs: storage_pb2.PlayerPreferences, busy_request_id: str
    ) -> gateway_pb2.State:
        return gateway_pb2.State(
            busy=bool(busy_request_id),
            running_request_id=busy_request_id,
            history_enabled=prefs.history_enabled,
            external_enabled=prefs.external_enabled,
            mode=self.mode_of(prefs),
            mode_is_default=not prefs.conversation_mode,
        )


def _preference_change(args: dict[str, str]) -> gateway_pb2.Preferences | None:
    """A settings button's arguments as a preference change; None when they are not one
    (`history`/`external`: `on` or `off`; `mode`: a mode's name or `default`)."""
    change = gateway_pb2.Preferences()
    if not args:
        return None
    for key, value in args.items():
        if key in ("history", "external") and value in ("on", "off"):
            setattr(change, key, value == "on")
        elif key == "mode" and value == "default":
            change.mode = common_pb2.CONVERSATION_MODE_UNSPECIFIED
        elif key == "mode" and mode_by_name(value) is not None:
            change.mode = MODES[value]
        else:
            return None
    return change
