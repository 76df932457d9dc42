"""The routing pipeline, in seed 004's order:

    structured button / current list number → exact command → the player's exact intent
    cache → local lexical match → one model call → LOCAL_FALLBACK selection candidates

The player's conversation mode (system.common.v1.ConversationMode) shapes it: OFFLINE never
asks the model; STANDARD answers text the model finds no module for in conversation
(`system:chat`); EXTENDED does too, and routes locally only at the stricter `freeChat` score;
FREE goes from the exact command straight to conversation. Without a model the modes fall
back to the selection card, as offline does.

Every decision is counted in the diagnostics; local matching reports what it saw (scores,
candidates, the gate that stopped it) so operators can tell why a text did or did not route.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Any

from google.protobuf import json_format, struct_pb2
from system.common.v1 import catalog_pb2, common_pb2
from system.router.v1 import router_pb2

from router_service import diagnostics as diag
from router_service.buttons import ButtonMatcher, Phrasings
from router_service.cache import (
    ClearReason,
    IntentCache,
    PlayerScope,
    WriteOutcome,
    refusal,
    text_digest,
)
from router_service.catalog import Catalog, CatalogCache
from router_service.clients import SharedIntentCache, SharedLookup
from router_service.commands import CommandMatch, UnknownCommand
from router_service.model_routing import CLARIFY, ModelRouter
from router_service.semantic import (
    FallbackCandidate,
    LocalDecision,
    Mode,
    SemanticConfig,
    detect_language,
    normalize,
    reload_changes,
)
from router_service.semantic.extractors import extract, list_pick
from router_service.semantic.guards import check_guards, write_words
from services.commands import usage
from services.runtime.errors import InvalidArgument, PermissionDenied
from services.runtime.permissions import module_available
from services.texts import pick

__all__ = ["ADMIN_LEVEL", "Router"]

log = logging.getLogger("system.router")

ADMIN_LEVEL = 3
"""Permission level needed for diagnostics and reloads until the engine's catalogue (which
declares the configured level) has been read."""
CHAT_MODULE = "system:chat"
"""The engine's conversation module: what DECISION_SOURCE_CHAT runs."""

_CLEAR_REASONS: dict[int, ClearReason] = {
    router_pb2.CLEAR_REASON_MEMORY_CLEARED: ClearReason.MEMORY_CLEARED,
    router_pb2.CLEAR_REASON_PREFERENCES_CHANGED: ClearReason.PREFERENCES_CHANGED,
    router_pb2.CLEAR_REASON_REVOKED: ClearReason.REVOKED,
    router_pb2.CLEAR_REASON_DISCONNECTED: ClearReason.DISCONNECTED,
    router_pb2.CLEAR_REASON_PERMISSIONS_CHANGED: ClearReason.PERMISSIONS_CHANGED,
}
_MEMORY_GENERATION = 0  # clearing memory bumps the player's scope, which is what matters
_SHARED_TOKEN = "shared"
"""First element of a cache token issued over the shared cache in storage."""
_ALLOWED_SETS = 256  # distinct (permission level, features) pairs remembered per catalogue


def _language(player: common_pb2.PlayerContext) -> str:
    return "zh" if player.language == "zh" else "en"


def _text_language(text: str, player_language: str) -> str:
    """The language a text is matched in: Chinese where it holds a Chinese character, English
    where it holds Latin letters only (`open the shop` from a Chinese client is matched
    against the English examples), else the player's (`42`, `？？`)."""
    if detect_language(text) == "zh":
        return "zh"
    return "en" if any("a" <= ch <= "z" for ch in text.casefold()) else player_language


def _scope_id(player: common_pb2.PlayerContext) -> str:
    # Players of two game servers may share an id; the cache must never mix them.
    return f"{player.server_id}\x1f{player.player_id}"


def _action(module_id: str, data: dict[str, Any] | None) -> common_pb2.ModuleAction:
    struct = struct_pb2.Struct()
    if data:
        struct.update(data)
    return common_pb2.ModuleAction(module_id=module_id, input=struct)


_BARE_ACTIONS: dict[str, common_pb2.ModuleAction] = {}
_BARE_ACTIONS_MAX = 1024


def _bare_action(module_id: str) -> common_pb2.ModuleAction:
    """`_action(module_id, None)`, built once per module: selection cards offer the same
    argument-less shortcuts again and again. Never mutated (a response copies it)."""
    action = _BARE_ACTIONS.get(module_id)
    if action is None:
        if len(_BARE_ACTIONS) >= _BARE_ACTIONS_MAX:
            _BARE_ACTIONS.clear()
        action = _BARE_ACTIONS[module_id] = _action(module_id, None)
    return action


def _direct_allowed(module: catalog_pb2.ModuleDescriptor) -> bool:
    return module.routing_mode == catalog_pb2.ROUTING_MODE_READ and module.HasField("semantic")


def _read_only(module: catalog_pb2.ModuleDescriptor) -> bool:
    return (
        module.interactive
        and module.write_steps == 0
        and module.HasField("semantic")
        and module.semantic.read_only_tools
    )


_PICK_COMMANDS = frozenset({"view", "查看", "open", "打开", "show", "pick", "选"})
"""Slash words no module declares that pick from the current list (`/view 2`, `/查看 2`)."""
_PRESS_ONLY = {
    "zh": "第 {number} 个按钮需要点击才能生效，输入编号不会按下它。",
    "en": "Button {number} works only when pressed; typing its number does not press it.",
}
"""What a player reads who typed the number of a button only a press may use (a confirm)."""
_NO_BUTTON = {
    "zh": "现在看着的卡片上没有“{text}”按钮：打开它所在的卡片（邮件、任务、报价），再点击按钮或输入"
    "这句话；输入 /help 查看全部功能。",
    "en": "No card you are looking at has a button for “{text}”: open the card it belongs to (a "
    "mail, a quest, a quote), then press it or type this again; /help lists everything.",
}
"""What a player reads who typed only a button's words with no such button in view."""
_SUGGESTING_KEYS = frozenset({"buy"})
"""Button words that still get a selection card without such a button in view: `buy` alone
suggests the purchase's command."""

_LABEL_END = re.compile(r"[:：,，。.;；(（]")
_LABEL_CHARS = 48


def choice_label(module: catalog_pb2.ModuleDescriptor | None, language: str) -> str:
    """A selection button's words for a module: its description in the player's language (else
    English) up to the first colon, comma or full stop (`逛商城`, `The server shop`)."""
    if module is None:
        return ""
    texts = module.description.text
    text = texts.get(language) or texts.get("en") or ""
    label = _LABEL_END.split(text, maxsplit=1)[0].strip()
    if len(label) > _LABEL_CHARS:  # cut at a word where there are words, and say so
        cut = label[:_LABEL_CHARS]
        label = (cut.rsplit(" ", 1)[0] if " " in cut else cut) + "…"
    return label


_FILLABLE = ("write", "change")
"""Guards that may fire on a command's argument that the selection card still writes out."""
_WITH_ARGUMENT = {"zh": "{label}：{argument}", "en": "{label}: {argument}"}
_LIST_NUMBER = {"zh": "第 {number} 个", "en": "#{number}"}
_ARGUMENT_CHARS = 24


def with_argument(label: str, arguments: dict[str, Any], language: str) -> str:
    """A choice's label followed by the one argument read from the text, so the button says
    what pressing it looks up (`逛商城：铁锭`, `One quest's details: #2`); the label alone for
    a choice without one (or with several)."""
    values = [v for v in arguments.values() if isinstance(v, str | int) and not isinstance(v, bool)]
    if not label or len(values) != 1:
        return label
    (value,) = values
    if isinstance(value, int):
        argument = pick(_LIST_NUMBER, language, number=value)
    else:
        argument = value if len(value) <= _ARGUMENT_CHARS else value[:_ARGUMENT_CHARS] + "…"
    return pick(_WITH_ARGUMENT, language, label=label, argument=argument)


_QUESTION_START = re.compile(
    r"^(?:what|why|how|who|where|which|when|whose|whom|is|are|was|were|do|does|did|can|could"
    r"|should|will|would|may)\b"
)
_QUESTION_HAN = re.compile(
    "吗|呢|什么|怎么|怎样|如何|为什么|为何|哪|几|多少|是否|能否|能不能|可不可以|有没有"
)


def asks(text: str) -> bool:
    """Whether `text` asks something: a question mark, an English question word first, or a
    Chinese question word or particle (`吗`, `怎么`, `哪`)."""
    normalized = normalize(text).rstrip()
    return (
        normalized.endswith(("?", "？"))
        or _QUESTION_START.match(normalized) is not None
        or _QUESTION_HAN.search(normalized) is not None
    )


def _question_choice(
    catalog: Catalog, text: str, allowed: frozenset[str], candidates: list[FallbackCandidate]
) -> FallbackCandidate | None:
    """For a text that asks something, the first module the player may use that answers a
    question in their own words (`ModuleDescriptor.question_field`: the knowledge base's), the
    whole text as that question: where no model could be asked, the knowledge search is one
    press away. None for other texts, or where the card already offers it."""
    if not asks(text):
        return None
    offered = {c.module_id for c in candidates}
    for module_id, module in catalog.modules.items():
        if (
            module.question_field
            and module_id in allowed
            and module_id not in offered
            and module.interactive
            and module.write_steps == 0
        ):
            question = {module.question_field: text.strip()}
            return FallbackCandidate(module_id, "", question, 0.0, "", "question")
    return None


def _command_hint(
    catalog: Catalog,
    text: str,
    text_language: str,
    language: str,
    allowed: frozenset[str],
    local: LocalDecision,
) -> router_pb2.CommandHint | None:
    """The command of the change the text asks for, which no card button may run, for the
    selection card to suggest (`/buy <item [count]>`), filled in where the text was that
    command typed without its slash (`/buy 2 bread`); None where no change is clear. Matched
    in the text's language, written in the player's (`language`)."""
    # The commands the text names, else those whose Chinese name holds its write verb
    # (`我想买面包`: `买` of `购买`, where the purchase leads the sign-in by too little).
    verbs = write_words(text)
    named = catalog.commands.named_in(text) or catalog.commands.holding(verbs)
    # A change typed as its command without the slash (`buy 2 bread`, `转账 alex 50`) is
    # suggested with the argument filled in; in English only where the text also resembles
    # it (`pay attention to me` is no payment).
    lead = catalog.commands.leading(text, verbs)
    if lead is not None and (
        lead.module_id not in allowed or not catalog.semantic.changes(lead.module_id)
    ):
        lead = None
    change = catalog.semantic.resembled_change(
        text, text_language, allowed, local, named, lead.module_id if lead else None
    )
    if lead is not None and lead.module_id != change and not lead.chinese:
        lead = None
    descriptor = catalog.modules.get(lead.module_id if lead else change or "")
    if descriptor is None or not descriptor.commands:
        return None
    command = lead.command if lead is not None else descriptor.commands[0]
    # An argument that refers, negates or joins (`buy it`, `buy bread and eggs`) is no argument
    # to write out: the usage instead.
    filled = lead is not None and check_guards(lead.argument) in (None, *_FILLABLE)
    return router_pb2.CommandHint(
        usage=usage(command.aliases[0], command, language),
        label=choice_label(descriptor, language),
        command=lead.typed() if lead is not None and filled else "",
    )


def _stricter(local: LocalDecision, free_chat_score: float) -> LocalDecision:
    """Extended mode: a direct route also needs the best score to reach `modeScores.freeChat`
    (text below it is answered in conversation instead)."""
    if local.outcome not in ("direct", "shadow_direct") or local.s1 >= free_chat_score:
        return local
    return dataclasses.replace(
        local, outcome="no_direct", module_id=None, input=None, gate_failed="mode:free_chat"
    )


class Router:
    """Turns a player's text into a routing decision."""

    def __init__(
        self,
        catalog: CatalogCache,
        cache: IntentCache,
        buttons: ButtonMatcher,
        diagnostics: diag.RouterDiagnostics,
        model: ModelRouter | None,
        shared: SharedIntentCache | None = None,
    ) -> None:
        self._catalog = catalog
        self.cache = cache
        """The in-process cache; used alone when `shared` is None."""
        self.shared = shared
        """The intent cache in storage, shared by every router replica (decision 0024); looked
        up only after local matching found no direct route, in front of the model call."""
        self._buttons = buttons
        self.diagnostics = diagnostics
        self._model = model
        # The modules a player may use depend only on the catalogue, their permission level
        # and their server's features: worked out once per such combination, not per call.
        self._allowed_catalog: Catalog | None = None
        self._allowed_sets: dict[tuple[int, tuple[str, ...], tuple[str, ...]], frozenset[str]] = {}

    @property
    def config(self) -> SemanticConfig:
        current = self._catalog.current
        return current.semantic.config if current else self._catalog.semantic_config

    # -- Route -------------------------------------------------------------------------------

    async def route(self, request: router_pb2.RouteRequest) -> router_pb2.RouteResponse:
        player, text = request.player, request.text
        if not player.player_id:
            raise InvalidArgument("player.player_id is required")
        if not text.strip():
            raise InvalidArgument("text is empty; send what the player typed")
        limit = self.config.max_characters
        if len(text) > limit:
            raise InvalidArgument(
                f"text has {len(text)} characters; the router accepts at most {limit}"
            )
        catalog = await self._catalog.get()
        language = _language(player)
        decided = self._structured(request, language, catalog)
        if decided is None:
            decided = self._command(catalog, text, player)
        if decided is not None:
            return decided
        allowed = self._allowed(catalog, player)
        conversation = player.conversation_mode or common_pb2.CONVERSATION_MODE_STANDARD
        # The model is asked (to route, or to converse) only where the player's mode and
        # preference allow it; offline never.
        model_allowed = (
            self._model is not None
            and request.external_enabled
            and conversation != common_pb2.CONVERSATION_MODE_OFFLINE
        )
        chat_allowed = model_allowed and CHAT_MODULE in allowed
        if conversation == common_pb2.CONVERSATION_MODE_FREE and chat_allowed:
            return self._chat(text)  # free mode skips routing
        scope = self.cache.scope(_scope_id(player))
        cache_on = catalog.semantic.config.mode is Mode.ENFORCE and not request.history_disabled
        if cache_on and self.shared is None:
            hit = self._cached(catalog, scope, language, text, allowed)
            if hit is not None:
                return hit
        local = catalog.semantic.decide(text, _text_language(text, language), allowed)
        if conversation == common_pb2.CONVERSATION_MODE_EXTENDED:
            local = _stricter(local, catalog.semantic.config.free_chat_score)
        # Every answer from here on reports the match: it is written into the response in
        # place (building a LocalMatch and copying it in costs twice as much).
        response = router_pb2.RouteResponse()
        self._report(local, response.local)
        if local.outcome == "direct" and local.module_id:
            self.diagnostics.record_decision(diag.DecisionSource.LOCAL)
            response.source = router_pb2.DECISION_SOURCE_LOCAL
            response.action.CopyFrom(_action(local.module_id, dict(local.input or {})))
            return response
        if local.outcome == "shadow_direct":
            self.diagnostics.record_decision(diag.DecisionSource.SHADOW_DIRECT)
        shared: SharedLookup | None = None
        if cache_on and self.shared is not None:
            # Only here, where a model call (or a selection card) would come next: a text that
            # routes locally never pays the round trip to storage.
            digest = text_digest(text)
            if digest is not None:
                shared = await self.shared.lookup(
                    player.player_id, digest, language, catalog.generation
                )
            if shared is not None and shared.module_id is not None:
                hit = self._hit(catalog, shared.module_id, text, allowed)
                if hit is not None:
                    response.source = hit.source
                    response.action.CopyFrom(hit.action)
                    return response
        asked = (
            await self._ask_model(request, catalog, allowed, scope, response, shared)
            if model_allowed
            else None
        )
        if asked is True:
            return response
        if chat_allowed and asked is False:
            # The model saw the catalogue and found no module: the text is conversation.
            chat = self._chat(text)
            chat.local.CopyFrom(response.local)
            return chat
        return self._fallback(catalog, text, language, allowed, response, local)

    def _chat(self, text: str) -> router_pb2.RouteResponse:
        """A conversation answer: `system:chat` with the text (the engine answers by mode)."""
        self.diagnostics.record_decision(diag.DecisionSource.CHAT)
        return router_pb2.RouteResponse(
            source=router_pb2.DECISION_SOURCE_CHAT, action=_action(CHAT_MODULE, {"text": text})
        )

    def _allowed(self, catalog: Catalog, player: common_pb2.PlayerContext) -> frozenset[str]:
        """Ids of the modules `player` may use (`module_available`, less the player's
        `unavailable_modules`)."""
        if self._allowed_catalog is not catalog:
            self._allowed_catalog = catalog
            self._allowed_sets = {}
        key = (player.permission_level, tuple(player.features), tuple(player.unavailable_modules))
        allowed = self._allowed_sets.get(key)
        if allowed is None:
            # Modules the player's game server lacks the game tools for are absent too.
            allowed = frozenset(
                m.module_id for m in catalog.modules.values() if module_available(m, player)
            )
            if len(self._allowed_sets) >= _ALLOWED_SETS:
                self._allowed_sets.clear()
            self._allowed_sets[key] = allowed
        return allowed

    def _structured(
        self, request: router_pb2.RouteRequest, language: str, catalog: Catalog
    ) -> router_pb2.RouteResponse | None:
        """A visible notification button, or a number from the player's current list (unless
        the text is one of the catalogue's commands: `/buy minecraft:torch 1` buys one torch,
        it does not press the first button of the last card; of slash commands no module
        declares only `/view 2` and its like pick: `/quest 1` without quests is unknown)."""
        if request.notification_buttons:
            buttons = [
                (str(i), b.label_key, b.label) for i, b in enumerate(request.notification_buttons)
            ]
            pressed = self._buttons.match(request.text, language, buttons)
            if pressed.action_id is not None:
                self.diagnostics.record_decision(diag.DecisionSource.BUTTON)
                index = int(pressed.action_id)
                return router_pb2.RouteResponse(
                    source=router_pb2.DECISION_SOURCE_BUTTON,
                    action=request.notification_buttons[index].action,
                    notification_button=index + 1,
                )
        if not request.current_list:
            return None
        command = catalog.commands.match(request.text, request.player)
        if command is None or (
            isinstance(command, UnknownCommand) and command.name.casefold() in _PICK_COMMANDS
        ):
            index = list_pick(request.text) or 0
            if 1 <= index <= len(request.current_list):
                action = request.current_list[index - 1]
                if not action.module_id:  # a button only a press may use: say so, run nothing
                    self.diagnostics.record_decision(diag.DecisionSource.NONE)
                    return router_pb2.RouteResponse(
                        source=router_pb2.DECISION_SOURCE_NONE,
                        no_route_reason=router_pb2.NO_ROUTE_REASON_PRESS_ONLY,
                        detail=pick(_PRESS_ONLY, request.player.language, number=index),
                    )
                self.diagnostics.record_decision(diag.DecisionSource.BUTTON)
                return router_pb2.RouteResponse(
                    source=router_pb2.DECISION_SOURCE_BUTTON, action=action
                )
        return None

    def _command(
        self, catalog: Catalog, text: str, player: common_pb2.PlayerContext
    ) -> router_pb2.RouteResponse | None:
        match = catalog.commands.match(text, player)
        if isinstance(match, CommandMatch):
            self.diagnostics.record_decision(diag.DecisionSource.COMMAND)
            return router_pb2.RouteResponse(
                source=router_pb2.DECISION_SOURCE_COMMAND, action=match.action
            )
        if isinstance(match, UnknownCommand):
            self.diagnostics.record_decision(diag.DecisionSource.NONE)
            return router_pb2.RouteResponse(
                source=router_pb2.DECISION_SOURCE_NONE,
                no_route_reason=router_pb2.NO_ROUTE_REASON_UNKNOWN_COMMAND,
                detail=match.message(player.language),
            )
        return None

    def _cached(
        self,
        catalog: Catalog,
        scope: PlayerScope,
        language: str,
        text: str,
        allowed: frozenset[str],
    ) -> router_pb2.RouteResponse | None:
        hit = self.cache.get(scope, catalog.generation, _MEMORY_GENERATION, language, text)
        return None if hit is None else self._hit(catalog, hit.module_id, text, allowed)

    def _hit(
        self, catalog: Catalog, module_id: str, text: str, allowed: frozenset[str]
    ) -> router_pb2.RouteResponse | None:
        """A CACHE answer for a cached module, if the player may still use it and it is still
        read-only and direct; its arguments re-parse from this text."""
        if module_id not in allowed:
            return None
        module = catalog.modules.get(module_id)
        if module is None or not (_read_only(module) and _direct_allowed(module)):
            return None
        # Arguments always come from this text again, never from the cache.
        arguments = extract(module.semantic.extractor or None, text)
        if arguments is None:
            return None
        self.diagnostics.record_decision(diag.DecisionSource.CACHE)
        return router_pb2.RouteResponse(
            source=router_pb2.DECISION_SOURCE_CACHE, action=_action(module_id, arguments)
        )

    def _report(self, local: LocalDecision, match: router_pb2.LocalMatch) -> None:
        """Writes what local matching saw into `match` and counts it."""
        match.SetInParent()  # present even when every field keeps its default
        match.language = local.language
        match.top_score = local.s1
        match.second_score = local.s2
        match.margin = local.margin
        match.coverage = local.coverage
        match.topic_coverage = local.topic_coverage
        match.gate_failed = local.gate_failed
        add = match.candidates.add
        for c in local.candidates:
            add(module_id=c.module_id, score=c.score, example_id=c.example_id)
        if local.candidates and local.language:
            top = local.candidates[0]
            self.diagnostics.record_match(
                top.module_id,
                local.language,
                min(max(local.s1, 0.0), 1.0),
                min(max(local.margin, 0.0), 1.0),
                min(max(local.coverage, 0.0), 1.0),
                [(c.module_id, min(max(c.score, 0.0), 1.0)) for c in local.candidates[:3]],
                local.gate_failed,
            )
        if local.gate_failed:
            self.diagnostics.record_gate(local.gate_failed)

    async def _ask_model(
        self,
        request: router_pb2.RouteRequest,
        catalog: Catalog,
        allowed: frozenset[str],
        scope: PlayerScope,
        response: router_pb2.RouteResponse,
        shared: SharedLookup | None = None,
    ) -> bool | None:
        """Asks the model: True when it chose a module (written into `response`), False when
        it found none fits (clarify), None when no model could be asked. The cache token
        names the scope the answer may be cached under: the in-process scope, or, with the
        shared cache, the generation storage answered (null when it could not)."""
        if self._model is None:
            return None
        modules = [catalog.modules[m] for m in catalog.modules if m in allowed]
        choice = await self._model.choose(request.player, request.text, modules)
        if choice is None:
            return None  # no model configured or reachable: fall back locally
        if choice.module_id == CLARIFY:
            return False
        self.diagnostics.record_decision(diag.DecisionSource.MODEL)
        response.source = router_pb2.DECISION_SOURCE_MODEL
        response.action.CopyFrom(_action(choice.module_id, choice.arguments))
        if self.shared is None:
            response.cache_token = json.dumps([scope.generation, catalog.generation])
        else:
            generation = None if shared is None else shared.generation
            response.cache_token = json.dumps([_SHARED_TOKEN, generation, catalog.generation])
        return True

    def _fallback(
        self,
        catalog: Catalog,
        text: str,
        language: str,
        allowed: frozenset[str],
        response: router_pb2.RouteResponse,
        local: LocalDecision,
    ) -> router_pb2.RouteResponse:
        """A selection card of read-only candidates, or no route; `response` holds the match."""
        matched = local.language or language  # the text's language; labels are the player's
        key = self._buttons.phrasing_key(text, language) or self._buttons.phrasing_key(
            text, matched
        )
        if key is not None and key not in _SUGGESTING_KEYS:
            # `确认` with no card in view that has a Confirm button: choices of unrelated
            # modules would only mislead.
            self.diagnostics.record_decision(diag.DecisionSource.NONE)
            response.source = router_pb2.DECISION_SOURCE_NONE
            response.no_route_reason = router_pb2.NO_ROUTE_REASON_NO_BUTTON
            response.detail = pick(_NO_BUTTON, language, text=text.strip())
            return response
        candidates = catalog.semantic.fallback_candidates(text, matched, allowed, local)
        if candidates:
            answering = _question_choice(catalog, text, allowed, candidates)
            if answering is not None:  # last: what the text matched comes first
                candidates.append(answering)
            self.diagnostics.record_decision(diag.DecisionSource.LOCAL_FALLBACK)
            response.source = router_pb2.DECISION_SOURCE_LOCAL_FALLBACK
            response.candidates.extend(
                [
                    _action(c.module_id, dict(c.input)) if c.input else _bare_action(c.module_id)
                    for c in candidates
                ]
            )
            response.candidate_labels.extend(
                with_argument(
                    choice_label(catalog.modules.get(c.module_id), language),
                    dict(c.input),
                    language,
                )
                for c in candidates
            )
            hint = _command_hint(catalog, text, matched, language, allowed, local)
            if hint is not None:
                response.command_hints.append(hint)
            response.detail = "not sure what you meant; pick one, or type /help"
            return response
        self.diagnostics.record_decision(diag.DecisionSource.NONE)
        response.source = router_pb2.DECISION_SOURCE_NONE
        response.no_route_reason = router_pb2.NO_ROUTE_REASON_NO_MATCH
        response.detail = "no command matched; /help lists the commands"
        return response

    # -- the other RPCs ----------------------------------------------------------------------

    async def record_outcome(self, request: router_pb2.RecordOutcomeRequest) -> tuple[bool, str]:
        player, text, action = request.player, request.text, request.action
        if not player.player_id or not text or not action.module_id or not request.cache_token:
            raise InvalidArgument(
                "player.player_id, text, action.module_id and cache_token are required"
            )
        try:
            token = json.loads(request.cache_token)
            shared_token = isinstance(token, list) and token[:1] == [_SHARED_TOKEN]
            if shared_token:
                _, shared_generation, runtime_generation = token
                if shared_generation is not None:
                    shared_generation = int(shared_generation)
            else:
                scope_generation, runtime_generation = token
                scope = PlayerScope(_scope_id(player), int(scope_generation))
        except (ValueError, TypeError):
            raise InvalidArgument(
                "cache_token is malformed; pass the RouteResponse's token unchanged"
            ) from None
        catalog = await self._catalog.get()
        module = catalog.modules.get(action.module_id)
        if module is None or self.config.mode is not Mode.ENFORCE:
            return False, "not_cacheable"
        if shared_token or self.shared is not None:
            return await self._record_shared(
                request, module, shared_generation if shared_token else None, runtime_generation
            )
        outcome = self.cache.record_success(
            scope,
            runtime_generation,
            _MEMORY_GENERATION,
            _language(player),
            text,
            action.module_id,
            json_format.MessageToDict(action.input),
            extract(module.semantic.extractor or None, text)
            if module.HasField("semantic")
            else None,
            read_only=_read_only(module),
            direct_allowed=_direct_allowed(module),
        )
        return (
            outcome is WriteOutcome.WRITTEN,
            "" if outcome is WriteOutcome.WRITTEN else outcome.value,
        )

    async def _record_shared(
        self,
        request: router_pb2.RecordOutcomeRequest,
        module: catalog_pb2.ModuleDescriptor,
        generation: int | None,
        runtime_generation: object,
    ) -> tuple[bool, str]:
        """RecordOutcome over the shared cache in storage: the same rules as the in-process
        cache, the write fenced by the player's generation in storage."""
        player, text, action = request.player, request.text, request.action
        refused = refusal(
            json_format.MessageToDict(action.input),
            extract(module.semantic.extractor or None, text)
            if module.HasField("semantic")
            else None,
            read_only=_read_only(module),
            direct_allowed=_direct_allowed(module),
        )
        if refused is not None:
            return False, refused.value
        if self.shared is None or generation is None or not isinstance(runtime_generation, str):
            return False, "storage_unavailable"
        digest = text_digest(text)
        if digest is None:
            return False, WriteOutcome.EMPTY_TEXT.value
        recorded = await self.shared.record(
            player.player_id,
            digest,
            _language(player),
            runtime_generation,
            action.module_id,
            generation,
        )
        if recorded is None:
            return False, "storage_unavailable"
        return (True, "") if recorded else (False, WriteOutcome.STALE_SCOPE.value)

    async def clear_scope(self, player_id: str, reason: int, server_id: str = "") -> int:
        """ClearPlayerScope: this process's cache, and with the shared cache, storage's, which
        every replica reads. Returns the entries dropped."""
        removed = self.clear_player(player_id, reason, server_id)
        if self.shared is not None:
            removed += await self.shared.clear(player_id, _CLEAR_REASONS[reason])
        return removed

    def clear_player(self, player_id: str, reason: int, server_id: str = "") -> int:
        if not player_id:
            raise InvalidArgument("player_id is required")
        if reason not in _CLEAR_REASONS:
            raise InvalidArgument(
                "reason must be MEMORY_CLEARED, PREFERENCES_CHANGED, REVOKED or DISCONNECTED"
            )
        return self.cache.clear_player(f"{server_id}\x1f{player_id}", _CLEAR_REASONS[reason])

    def check_admin(self, player: common_pb2.PlayerContext, module_id: str) -> None:
        """PermissionDenied unless `player` may use the admin module `module_id` that asks
        (`system:routing`, `system:reload`): its level is the one the engine's catalogue
        declares (the engine's `admin_permission_level`), ADMIN_LEVEL until the catalogue is
        read."""
        current = self._catalog.current
        module = current.modules.get(module_id) if current is not None else None
        level = module.min_permission_level if module is not None else ADMIN_LEVEL
        if player.permission_level < level:
            raise PermissionDenied(
                f"routing diagnostics and reloads are for administrators (permission level "
                f"{level}+)"
            )

    def diagnostics_snapshot(self) -> dict[str, Any]:
        current = self._catalog.current
        return self.diagnostics.snapshot(
            mode=self.config.mode.value,
            status="ready" if current else "catalogue not read yet",
            example_count=current.semantic.example_count if current else 0,
            cache_entries=len(self.cache),
        )

    def reload(self, new: SemanticConfig | None, phrasings: Phrasings | None = None) -> list[str]:
        """Applies a reloaded config and notification phrasings (None: that file is not
        configured); returns the change lines (live or needs a restart)."""
        changes: list[str] = []
        if new is not None:
            current = self._catalog.current
            changes = (
                current.semantic.apply_config(new)
                if current
                else reload_changes(self._catalog.semantic_config, new)
            )
            self._catalog.semantic_config = new
            self.cache.resize(new.cache_entries, new.cache_seconds, new.entries_per_player)
        if phrasings is not None:
            keys = self._buttons.replace_phrasings(phrasings)
            if keys:
                changes.append(f"button phrasings ({', '.join(keys)}): applies live")
        return changes
