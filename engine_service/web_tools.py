"""`system:web.search` and `system:web.fetch`, and the web gate that guards them.

Both tools reach the web through the model gateway (the only egress, which meters searches and
refuses non-public addresses). They belong to the `system:search` feature, which no player has
by default: an operator grants it explicitly (seed 000's SearchSystemModule). Every call checks,
besides what `ExecutionContext.tool` checks (cancellation, deadline, permission, budgets):

- the run's web gate: closed by default, opened for one run by `WebGate.open` only when the
  knowledge base had nothing, the request allowed the web, the player has the search feature
  and allows external services; a run started by an event never opens it;
- the player's external-services preference, read again at every call (they may turn it off
  while the run goes on);
- for a fetch, that this run's searches returned the URL (the gateway checks it again per
  search session: the run id).

Searches are paid: they are declared non-idempotent and nothing here or below retries them.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import grpc
from system.engine.v1 import engine_pb2
from system.storage.v1 import storage_pb2, storage_pb2_grpc

from engine_service.context import ExecutionContext
from engine_service.models import ModelClient
from engine_service.tools import ToolRegistry, ToolSpec
from services.results import AgentFailure, ModuleFailure
from services.runtime.channels import ChannelSettings, Dependency
from services.texts import pick

__all__ = [
    "SEARCH_FEATURE",
    "WEB_FETCH",
    "WEB_FETCH_SPEC",
    "WEB_SEARCH",
    "WEB_SEARCH_SPEC",
    "ExternalPreference",
    "GateRefusal",
    "StoragePreferences",
    "WebGate",
    "WebTools",
]

WEB_SEARCH = "system:web.search"
WEB_FETCH = "system:web.fetch"
SEARCH_FEATURE = "system:search"
"""The feature exporting the web tools; never enabled unless an operator grants it."""
PREFERENCE_TIMEOUT_SECONDS = 2.0
FETCH_CHARS = 4000
"""Most characters of a page brought back into the run (the model reads them)."""

WEB_SEARCH_SPEC = ToolSpec(
    tool_id=WEB_SEARCH,
    description="Search the web. Returns result titles, URLs and snippets. Paid per call.",
    input_schema={
        "type": "object",
        "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 400}},
        "required": ["query"],
        "additionalProperties": False,
    },
    read_only=True,
    idempotent=False,
    owner_feature=SEARCH_FEATURE,
    needs_context=True,
)

WEB_FETCH_SPEC = ToolSpec(
    tool_id=WEB_FETCH,
    description="Fetch one page that a web search of this run returned, as text.",
    input_schema={
        "type": "object",
        "properties": {"url": {"type": "string", "minLength": 1, "maxLength": 2048}},
        "required": ["url"],
        "additionalProperties": False,
    },
    read_only=True,
    idempotent=True,
    owner_feature=SEARCH_FEATURE,
    needs_context=True,
)


class ExternalPreference(Protocol):
    """Whether a player allows external services (their preference, kept by storage)."""

    async def external_allowed(self, player_id: str, timeout: float) -> bool: ...

    async def read(self, player_id: str, timeout: float) -> storage_pb2.PlayerPreferences:
        """All of the player's preferences (the settings card shows them)."""
        ...


class StoragePreferences:
    """ExternalPreference over the storage service's `StorageService.GetPreferences`."""

    def __init__(self, target: str, settings: ChannelSettings | None = None) -> None:
        self._dep = Dependency(
            target,
            storage_pb2_grpc.StorageServiceStub,
            idempotent_methods=["system.storage.v1.StorageService/GetPreferences"],
            settings=settings,
        )

    async def external_allowed(self, player_id: str, timeout: float) -> bool:
        return (await self.read(player_id, timeout)).external_enabled

    async def read(self, player_id: str, timeout: float) -> storage_pb2.PlayerPreferences:
        """The player's preferences as storage keeps them."""
        response = await self._dep.stub.GetPreferences(
            storage_pb2.GetPreferencesRequest(player_id=player_id), timeout=timeout
        )
        return response.preferences

    async def aclose(self) -> None:
        await self._dep.aclose()


class GateRefusal(enum.StrEnum):
    """Why the web gate stayed closed."""

    EVENT = "event"
    """The run was started by an event: never the web."""
    FOUND_LOCALLY = "found_locally"
    """The knowledge base answered; the web is only a fallback."""
    NOT_REQUESTED = "not_requested"
    """The request did not allow the web (`/question`, a plain question)."""
    FEATURE_OFF = "feature_off"
    """The player does not have the search feature."""
    EXTERNAL_OFF = "external_off"
    """The player turned external services off."""


class WebGate:
    """Decides, once per run, whether its web gate opens; and re-reads the preference that
    every web call checks.

    Args:
        preferences: where the external-services preference is read; None when the engine has
            no storage service configured (then external services count as not allowed).
    """

    def __init__(self, preferences: ExternalPreference | None) -> None:
        self._preferences = preferences

    async def external_allowed(self, ctx: ExecutionContext) -> bool:
        """The player's preference as stored now.

        Raises:
            ModuleFailure: STORAGE_UNAVAILABLE when it cannot be read (never taken as yes).
        """
        if self._preferences is None:
            return False
        timeout = min(PREFERENCE_TIMEOUT_SECONDS, ctx.remaining())
        try:
            return await self._preferences.external_allowed(ctx.player.player_id, timeout)
        except grpc.aio.AioRpcError as exc:
            raise ModuleFailure(
                AgentFailure.STORAGE_UNAVAILABLE,
                f"the player's preferences could not be read: {exc.details() or exc.code().name}",
            ) from None

    async def open(
        self, ctx: ExecutionContext, *, requested: bool, found_locally: int
    ) -> GateRefusal | None:
        """Opens `ctx`'s web gate when every condition holds; otherwise says which failed
        (checked in this order, so the cheapest reasons come first and storage is read last).

        Args:
            requested: the request allowed the web (`/search`, or the model route sure the
                player asked for an outside lookup). Text never sets it.
            found_locally: hits the knowledge base returned for the question.
        """
        if ctx.source == engine_pb2.ROUTE_SOURCE_EVENT:
            return GateRefusal.EVENT
        if found_locally:
            return GateRefusal.FOUND_LOCALLY
        if not requested:
            return GateRefusal.NOT_REQUESTED
        if SEARCH_FEATURE not in ctx.live_player().features:
            return GateRefusal.FEATURE_OFF
        if not await self.external_allowed(ctx):
            return GateRefusal.EXTERNAL_OFF
        return None if ctx.open_web() else GateRefusal.EVENT


_NOT_OPEN = {
    "zh": "这次请求不能上网查找；要搜索网页请用 /search。",
    "en": "This request may not look things up on the web; use /search for that.",
}
_EXTERNAL_OFF = {
    "zh": "你已关闭外部服务，所以不会上网查找（可在 /settings 中打开）。",
    "en": "You turned external services off, so nothing is looked up on the web (see /settings).",
}
_NOT_FOUND_HERE = {
    "zh": "只能打开这次搜索找到的网页。",
    "en": "Only pages this request's web searches found may be opened.",
}


class WebTools:
    """The handlers of `system:web.search` and `system:web.fetch`.

    Args:
        gate: the web gate (for the external-services preference read at every call).
    """

    def __init__(self, gate: WebGate) -> None:
        self._gate = gate

    def register(self, tools: ToolRegistry) -> None:
        tools.server(WEB_SEARCH_SPEC, self.search)
        tools.server(WEB_FETCH_SPEC, self.fetch)

    async def _check(self, ctx: ExecutionContext) -> ModelClient:
        language = ctx.player.language
        if not ctx.web_open:
            raise ModuleFailure(AgentFailure.PERMISSION_DENIED, pick(_NOT_OPEN, language))
        if not await self._gate.external_allowed(ctx):
            raise ModuleFailure(AgentFailure.PERMISSION_DENIED, pick(_EXTERNAL_OFF, language))
        if ctx.models is None:
            raise ModuleFailure(AgentFailure.TOOL_UNAVAILABLE, "this engine has no model gateway")
        return ctx.models

    def _timeout(self, ctx: ExecutionContext) -> float:
        return min(ctx.policy.model_call_seconds, ctx.remaining())

    async def search(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        """Results of one web search; their URLs become fetchable in this run."""
        models = await self._check(ctx)
        results = await models.web_search(
            ctx.player.player_id,
            ctx.web_session,
            payload["query"],
            ctx.player.language,
            self._timeout(ctx),
        )
        ctx.web_urls.update(r["url"] for r in results)
        return {"query": payload["query"], "results": results}

    async def fetch(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        """The text of one page a search of this run returned."""
        url = payload["url"]
        if url not in ctx.web_urls:
            # Checked before anything leaves the engine; the gateway checks it again.
            raise ModuleFailure(
                AgentFailure.PERMISSION_DENIED, pick(_NOT_FOUND_HERE, ctx.player.language)
            )
        models = await self._check(ctx)
        page = await models.web_fetch(
            ctx.player.player_id, ctx.web_session, url, FETCH_CHARS, self._timeout(ctx)
        )
        return page
