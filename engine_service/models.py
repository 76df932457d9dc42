"""The engine's client of the model gateway: chat completions (with tool calling), web search
and web fetch, their errors turned into the failure catalogue (model.proto says which)."""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc
from system.model.v1 import model_pb2, model_pb2_grpc

from services.model_gateway.failures import failure_for, providers_busy
from services.results import AgentFailure, ModuleFailure
from services.runtime.channels import ChannelSettings, Dependency

__all__ = ["Completion", "ModelClient", "ToolCall", "model_failure"]


def model_failure(exc: grpc.aio.AioRpcError, what: str, web: bool = False) -> ModuleFailure:
    """A model-gateway error as a catalogued failure (the table model.proto documents, shared
    with the router); every provider failing or paused is the assistant being busy."""
    if not web and providers_busy(exc):
        return ModuleFailure(
            AgentFailure.BUSY, "every model provider is busy or failing; try again shortly"
        )
    return ModuleFailure(
        failure_for(exc.code(), web=web), f"{what}: {exc.details() or exc.code().name}"
    )


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A tool the model asked for."""

    call_id: str
    name: str
    arguments: str
    """The arguments as the model wrote them (JSON text, not yet checked)."""


@dataclasses.dataclass(frozen=True)
class Completion:
    content: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str


class ModelClient:
    """ModelGatewayService over gRPC. Nothing is retried here: the gateway retries what is
    safe before any output, and web searches are paid."""

    def __init__(self, target: str, settings: ChannelSettings | None = None) -> None:
        self._dep = Dependency(
            target,
            model_pb2_grpc.ModelGatewayServiceStub,
            idempotent_methods=["system.model.v1.ModelGatewayService/GetModelStatus"],
            settings=settings,
        )

    async def complete(
        self,
        player_id: str,
        messages: list[model_pb2.ChatMessage],
        timeout: float,
        tools: list[model_pb2.Tool] | None = None,
        require_tool: bool = False,
        max_tokens: int = 0,
        json_output: bool = False,
        module_id: str = "",
        permission_level: int = 0,
    ) -> Completion:
        """`module_id`: the module asking, whose provider list the model gateway uses;
        `permission_level`: the player's, which picks their rank's budgets."""
        request = model_pb2.CompleteRequest(
            player_id=player_id,
            module_id=module_id,
            permission_level=permission_level,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.2,
            tools=tools or [],
        )
        if tools:
            request.tool_choice.mode = (
                model_pb2.TOOL_CHOICE_MODE_REQUIRED
                if require_tool
                else model_pb2.TOOL_CHOICE_MODE_AUTO
            )
        if json_output:
            request.response_format = model_pb2.RESPONSE_FORMAT_JSON_OBJECT
        try:
            response = await self._dep.stub.Complete(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise model_failure(exc, "the model call failed") from None
        return Completion(
            response.content,
            tuple(ToolCall(c.id, c.name, c.arguments_json) for c in response.tool_calls),
            response.finish_reason,
        )

    async def web_search(
        self, player_id: str, session: str, query: str, language: str, timeout: float
    ) -> list[dict[str, Any]]:
        try:
            response = await self._dep.stub.WebSearch(
                model_pb2.WebSearchRequest(
                    player_id=player_id,
                    search_session=session,
                    query=query,
                    max_results=5,
                    language=language,
                ),
                timeout=timeout,
            )
        except grpc.aio.AioRpcError as exc:
            raise model_failure(exc, "the web search failed", web=True) from None
        return [{"url": r.url, "title": r.title, "snippet": r.snippet} for r in response.results]

    async def web_fetch(
        self, player_id: str, session: str, url: str, max_chars: int, timeout: float
    ) -> dict[str, Any]:
        try:
            response = await self._dep.stub.WebFetch(
                model_pb2.WebFetchRequest(
                    player_id=player_id, search_session=session, url=url, max_chars=max_chars
                ),
                timeout=timeout,
            )
        except grpc.aio.AioRpcError as exc:
            raise model_failure(exc, f"fetching {url} failed", web=True) from None
        return {
            "url": response.url,
            "title": response.title,
            "text": response.text,
            "truncated": response.truncated,
        }

    async def aclose(self) -> None:
        await self._dep.aclose()
