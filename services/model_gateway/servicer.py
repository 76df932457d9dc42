"""gRPC face of the model gateway: converts messages and delegates to ChatProvider. Typed
errors raised by the provider become status codes in the shared server interceptor."""

from __future__ import annotations

from system.model.v1 import model_pb2, model_pb2_grpc

from services.model_gateway.provider import ChatMessage, ChatProvider

__all__ = ["ModelGatewayServicer"]

_ROLES = {
    model_pb2.MESSAGE_ROLE_SYSTEM: "system",
    model_pb2.MESSAGE_ROLE_USER: "user",
    model_pb2.MESSAGE_ROLE_ASSISTANT: "assistant",
}


def _role(value: int) -> str:
    # Unknown values pass through under their enum name (or number) so the provider's
    # validation names what the caller actually sent.
    if value in _ROLES:
        return _ROLES[value]
    try:
        return model_pb2.MessageRole.Name(value)
    except ValueError:
        return str(value)


class ModelGatewayServicer(model_pb2_grpc.ModelGatewayServiceServicer):
    """Thin: every method delegates to ChatProvider."""

    def __init__(self, provider: ChatProvider) -> None:
        self._provider = provider

    async def Complete(self, request, context):  # type: ignore[no-untyped-def]
        result = await self._provider.complete(
            [ChatMessage(_role(m.role), m.content) for m in request.messages],
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            player_id=request.player_id,
        )
        return model_pb2.CompleteResponse(
            content=result.content,
            finish_reason=result.finish_reason,
            usage=model_pb2.Usage(
                prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens
            ),
            model=result.model,
        )

    async def GetModelStatus(self, request, context):  # type: ignore[no-untyped-def]
        status = self._provider.status()
        return model_pb2.GetModelStatusResponse(configured=status.configured, model=status.model)
