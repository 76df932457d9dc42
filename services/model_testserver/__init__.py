"""A local OpenAI-compatible server with scripted replies, for tests and offline runs.

Standard library only; see `server` for the HTTP surface and `FakeOpenAIServer` for the API.
"""

from services.model_testserver.server import FakeOpenAIServer, RecordedRequest, ScriptedReply

__all__ = ["FakeOpenAIServer", "RecordedRequest", "ScriptedReply"]
