"""A local OpenAI-compatible server with scripted replies, for tests and offline runs.

Standard library only; see `server` for the HTTP surface and `FakeOpenAIServer` for the API.
"""

from services.model_testserver.server import (
    FakeOpenAIServer,
    RecordedRequest,
    Responder,
    ScriptedReply,
    router_demo_reply,
)
from services.model_testserver.web import Page, ScriptedSearch

__all__ = [
    "FakeOpenAIServer",
    "Page",
    "RecordedRequest",
    "Responder",
    "ScriptedReply",
    "ScriptedSearch",
    "router_demo_reply",
]
