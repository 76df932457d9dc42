"""gRPC face of the model gateway: converts messages and delegates to the domain. Typed
errors raised there become status codes in the shared server interceptor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper
from system.model.v1 import model_pb2, model_pb2_grpc

from services.model_gateway.chat import ChatMessage, ChatRequest, ToolCall, ToolChoice, ToolSpec
from services.model_gateway.provider import ChatProvider
from services.model_gateway.web import WebTools
from services.runtime.errors import InvalidArgument

__all__ = ["ModelGatewayServicer"]

_ROLES: dict[int, str] = {
    model_pb2.MESSAGE_ROLE_SYSTEM: "system",
    model_pb2.MESSAGE_ROLE_USER: "user",
    model_pb2.MESSAGE_ROLE_ASSISTANT: "assistant",
    model_pb2.MESSAGE_ROLE_TOOL: "tool",
}
_TOOL_MODES: dict[int, str] = {
    model_pb2.TOOL_CHOICE_MODE_UNSPECIFIED: "",
    model_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    model_pb2.TOOL_CHOICE_MODE_NONE: "none",
    model_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
    model_pb2.TOOL_CHOICE_MODE_TOOL: "tool",
}
_FORMATS: dict[int, str] = {
    model_pb2.RESPONSE_FORMAT_UNSPECIFIED: "",
    model_pb2.RESPONSE_FORMAT_TEXT: "text",
    model_pb2.RESPONSE_FORMAT_JSON_OBJECT: "json_object",
}


def _name(enum: EnumTypeWrapper, value: int, known: dict[int, str]) -> str:
    # Unknown values pass through under their enum name (or number) so validation names what
    # the caller actually sent.
    if value in known:
        return known[value]
    try:
        return enum.Name(value)
    except ValueError:
        return str(value)


def _calls(calls: Iterable[model_pb2.ToolCall]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.id, c.name, c.arguments_json) for c in calls)


def chat_request(request: model_pb2.CompleteRequest) -> ChatRequest:
    """The domain request for a CompleteRequest."""
    response_format = _name(model_pb2.ResponseFormat, request.response_format, _FORMATS)
    if response_format not in ("", "text", "json_object"):
        raise InvalidArgument(f"response_format {response_format} is not a format")
    return ChatRequest(
        messages=[
            ChatMessage(
                _name(model_pb2.MessageRole, m.role, _ROLES),
                m.content,
                _calls(m.tool_calls),
                m.tool_call_id,
            )
            for m in request.messages
        ],
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        player_id=request.player_id,
        tools=[ToolSpec(t.name, t.description, t.parameters_json) for t in request.tools],
        tool_choice=ToolChoice(
            _name(model_pb2.ToolChoiceMode, request.tool_choice.mode, _TOOL_MODES),
            request.tool_choice.tool_name,
        ),
        response_format=response_format,  # type: ignore[arg-type]
        module_id=request.module_id,
        permission_level=request.permission_level,
    )


class ModelGatewayServicer(model_pb2_grpc.ModelGatewayServiceServicer):
    """Thin: Complete delegates to ChatProvider, WebSearch and WebFetch to WebTools."""

    def __init__(self, provider: ChatProvider, web: WebTools) -> None:
        self._provider = provider
        self._web = web

    async def Complete(
        self, request: model_pb2.CompleteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> model_pb2.CompleteResponse:
        result = await self._provider.complete(chat_request(request))
        return model_pb2.CompleteResponse(
            content=result.content,
            finish_reason=result.finish_reason,
            usage=model_pb2.Usage(
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                prompt_cache_hit_tokens=result.prompt_cache_hit_tokens,
                prompt_cache_miss_tokens=result.prompt_cache_miss_tokens,
            ),
            model=result.model,
            tool_calls=[
                model_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json)
                for c in result.tool_calls
            ],
            attempts=result.attempts,
            provider=result.provider,
        )

    async def GetModelStatus(
        self, request: model_pb2.GetModelStatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> model_pb2.GetModelStatusResponse:
        status = self._provider.status()
        return model_pb2.GetModelStatusResponse(
            configured=status.configured,
            model=status.model,
            search_configured=self._web.search_configured,
        )

    async def WebSearch(
        self, request: model_pb2.WebSearchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> model_pb2.WebSearchResponse:
        hits = await self._web.search(
            request.player_id,
            request.search_session,
            request.query,
            request.max_results,
            request.language,
        )
        return model_pb2.WebSearchResponse(
            results=[
                model_pb2.WebSearchResult(url=h.url, title=h.title, snippet=h.snippet) for h in hits
            ]
        )

    async def WebFetch(
        self, request: model_pb2.WebFetchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> model_pb2.WebFetchResponse:
        page = await self._web.fetch(
            request.player_id, request.search_session, request.url, request.max_chars
        )
        return model_pb2.WebFetchResponse(
            url=page.url,
            title=page.title,
            text=page.text,
            truncated=page.truncated,
            content_type=page.content_type,
        )
