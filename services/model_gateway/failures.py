"""How callers turn the model gateway's status codes into the failure catalogue
(services/results.py), as documented at the top of model.proto. One table, so the engine's
question, search and reasoning modules and the router map the same code the same way."""

from __future__ import annotations

import grpc

from services.results import AgentFailure

__all__ = ["failure_for"]

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
