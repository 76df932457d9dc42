"""How callers turn the model gateway's status codes into the failure catalogue
(services/results.py), as documented at the top of model.proto. One table, so the engine's
question, search and reasoning modules and the router map the same code the same way."""

from __future__ import annotations

import grpc

from services.model_gateway.provider_config import ALL_PROVIDERS_UNAVAILABLE
from services.results import AgentFailure
from services.runtime.errors import error_reason

__all__ = ["ALL_PROVIDERS_UNAVAILABLE", "failure_for", "providers_busy"]

_COMMON = {
    grpc.StatusCode.INVALID_ARGUMENT: AgentFailure.INVALID_INPUT,
    grpc.StatusCode.FAILED_PRECONDITION: AgentFailure.PERMISSION_DENIED,
    grpc.StatusCode.PERMISSION_DENIED: AgentFailure.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: AgentFailure.BUDGET_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED: AgentFailure.TIMEOUT,
    grpc.StatusCode.CANCELLED: AgentFailure.CANCELLED,
}


def failure_for(code: grpc.StatusCode, *, web: bool) -> AgentFailure:
    """The catalogue entry for a status code of Complete (`web=False`) or of WebSearch /
    WebFetch (`web=True`). UNAVAILABLE, and anything not listed, is MODEL_UNAVAILABLE for a
    completion and TOOL_UNAVAILABLE for the web: the caller's local fallback."""
    if code in _COMMON:
        return _COMMON[code]
    return AgentFailure.TOOL_UNAVAILABLE if web else AgentFailure.MODEL_UNAVAILABLE


def providers_busy(error: object) -> bool:
    """True when a failed Complete (a grpc.aio.AioRpcError) is UNAVAILABLE because every
    provider of the module's list failed or was paused: the player should see "the assistant
    is busy, try again shortly" rather than "no model is configured"."""
    return error_reason(error) == ALL_PROVIDERS_UNAVAILABLE
