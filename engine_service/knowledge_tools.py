"""`system:database.query`: the player's private knowledge and the shared `system:knowledge`
table, searched through the storage service's KnowledgeService, entries in the player's
language first (the starter set, and many operators' documents, exist in both); where some are
in it, the shared ones in another language are left out.

A storage error is a failure (`system.error.storage_unavailable`), never "nothing found": a
question module that took an outage for an empty result would send the player to the web, or
tell them nothing is known when it is.
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc
from system.storage.v1 import knowledge_pb2, knowledge_pb2_grpc

from engine_service.context import ExecutionContext
from engine_service.tools import ToolRegistry, ToolSpec
from services.results import AgentFailure, ModuleFailure
from services.runtime.channels import ChannelSettings, Dependency

__all__ = [
    "DATABASE_QUERY",
    "DATABASE_QUERY_SPEC",
    "KnowledgeSearch",
    "KnowledgeTools",
    "StorageKnowledge",
    "hit_key",
    "knowledge_language",
]

DATABASE_QUERY = "system:database.query"
STORAGE_TIMEOUT_SECONDS = 5.0
"""Longest one knowledge search may take (the run's own deadline wins when earlier)."""
MAX_BODY_CHARS = 2000
"""Longest body a hit carries back into the run: enough to answer from, small enough for a
model prompt holding several hits."""

DATABASE_QUERY_SPEC = ToolSpec(
    tool_id=DATABASE_QUERY,
    description=(
        "Search the player's private knowledge entries and the shared knowledge table "
        "(Chinese or English). Returns hits, best first."
    ),
    input_schema={
        "type": "object",
        "properties": {
            "query": {"type": "string", "minLength": 1, "maxLength": 500},
            "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        },
        "required": ["query"],
        "additionalProperties": False,
    },
    read_only=True,
    idempotent=True,
    event_allowed=True,
    needs_context=True,
)


class KnowledgeSearch(Protocol):
    """Where knowledge is searched (the storage service in production)."""

    async def search(
        self, player_id: str, query: str, limit: int, timeout: float, language: str = ""
    ) -> list[knowledge_pb2.KnowledgeHit]:
        """Hits best first, those in `language` (zh or en; empty: no preference) first."""
        ...


class StorageKnowledge:
    """KnowledgeSearch over the storage service's `KnowledgeService.SearchKnowledge` (a read,
    so it is retried on UNAVAILABLE)."""

    def __init__(self, target: str, settings: ChannelSettings | None = None) -> None:
        self._dep = Dependency(
            target,
            knowledge_pb2_grpc.KnowledgeServiceStub,
            idempotent_methods=["system.storage.v1.KnowledgeService/SearchKnowledge"],
            settings=settings,
        )

    async def search(
        self, player_id: str, query: str, limit: int, timeout: float, language: str = ""
    ) -> list[knowledge_pb2.KnowledgeHit]:
        response = await self._dep.stub.SearchKnowledge(
            knowledge_pb2.SearchKnowledgeRequest(
                player_id=player_id, query=query, limit=limit, language=language
            ),
            timeout=timeout,
        )
        return list(response.hits)

    async def aclose(self) -> None:
        await self._dep.aclose()


def knowledge_language(language: str) -> str:
    """The knowledge language (`zh`, `en`) of a player's language code (`zh`, `zh-CN`,
    `en_us`), empty for another language: then no entry is preferred."""
    base = language.strip().casefold().replace("_", "-").partition("-")[0]
    return base if base in ("zh", "en") else ""


def hit_key(hit: dict[str, Any]) -> str:
    """Identifies an entry across searches: its scope and id."""
    return f"{hit['scope']}:{hit['entry_id']}"


def _hit(hit: knowledge_pb2.KnowledgeHit) -> dict[str, Any]:
    entry = hit.entry
    body = entry.body
    return {
        "scope": "private" if entry.player_id else "shared",
        "entry_id": entry.entry_id,
        "title": entry.title,
        "body": body if len(body) <= MAX_BODY_CHARS else body[:MAX_BODY_CHARS] + "…",
        "language": entry.language,
        "source": entry.source,
        "updated_at": entry.updated_at.ToJsonString() if entry.HasField("updated_at") else "",
        "score": round(hit.score, 6),
    }


def _in_language(
    hits: list[knowledge_pb2.KnowledgeHit], language: str
) -> list[knowledge_pb2.KnowledgeHit]:
    """`hits` less the shared entries in another language when one in the player's language
    is among them: the starter set and many operators' documents exist in both, and the other
    language's copy only repeats what the player can read. Private entries are all kept."""
    preferred = knowledge_language(language)
    if not preferred or not any(hit.entry.language == preferred for hit in hits):
        return hits
    return [hit for hit in hits if hit.entry.player_id or hit.entry.language in (preferred, "")]


class KnowledgeTools:
    """The handler of `system:database.query`.

    Args:
        store: where to search; None when the engine has no storage service configured (then
            every query fails as STORAGE_UNAVAILABLE, never as empty).
    """

    def __init__(self, store: KnowledgeSearch | None) -> None:
        self._store = store

    def register(self, tools: ToolRegistry) -> None:
        tools.server(DATABASE_QUERY_SPEC, self.query)

    async def query(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        """Hits for `query` in the player's private entries and the shared table."""
        if self._store is None:
            raise ModuleFailure(
                AgentFailure.STORAGE_UNAVAILABLE, "this engine has no knowledge store configured"
            )
        timeout = min(STORAGE_TIMEOUT_SECONDS, ctx.remaining())
        try:
            hits = await self._store.search(
                ctx.player.player_id,
                payload["query"],
                int(payload.get("limit", 5)),
                timeout,
                knowledge_language(ctx.player.language),
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ModuleFailure(AgentFailure.INVALID_INPUT, exc.details() or "") from None
            raise ModuleFailure(
                AgentFailure.STORAGE_UNAVAILABLE,
                f"the knowledge base could not be searched: {exc.details() or exc.code().name}",
            ) from None
        return {"hits": [_hit(hit) for hit in _in_language(hits, ctx.player.language)]}
