"""The server tools behind the administrators' in-game knowledge commands (issue 18), beside the
operator's `storage_service.knowledge_cli`: `system:knowledge.add` reads a Markdown or
plain-text document from the engine's knowledge folder (setting `knowledge_dir`) and puts it
into the shared table or one player's private table, `system:knowledge.list` lists a table's
entries, `system:knowledge.remove` removes one; all through storage's KnowledgeService.

A document is named by its file name alone: no folder, no `..`, no hidden file, one of the
suffixes `services.knowledge_documents` reads, so a command can never read a file outside the
folder. A player is named as the game server knows them and is looked up in the asking
administrator's scope (`usage_tools.scoped_player`): an administrator of one server never
reaches another server's players. The shared table is the whole deployment's, as the CLI's is.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol

import grpc
from system.storage.v1 import knowledge_pb2, knowledge_pb2_grpc

from engine_service.context import ExecutionContext
from engine_service.tools import ToolRegistry, ToolSpec
from engine_service.usage_tools import scoped_player
from services.knowledge_documents import SUFFIXES, FileEntry, put_request, read_entry
from services.results import AgentFailure, ModuleFailure
from services.runtime.channels import ChannelSettings, Dependency
from services.runtime.errors import InvalidArgument

__all__ = [
    "KNOWLEDGE_ADD",
    "KNOWLEDGE_LIST",
    "KNOWLEDGE_REMOVE",
    "KnowledgeAdmin",
    "KnowledgeAdminTools",
    "StorageKnowledgeAdmin",
]

KNOWLEDGE_ADD = "system:knowledge.add"
KNOWLEDGE_LIST = "system:knowledge.list"
KNOWLEDGE_REMOVE = "system:knowledge.remove"
STORAGE_TIMEOUT_SECONDS = 10.0
LIST_LIMIT = 50
"""Most entries one listing shows (a card, not a dump); `more` says when there are others."""
FOLDER_LISTING = 10
"""Most file names a refusal of an unknown file names, so the admin can pick the right one."""

_PLAYER = {"type": "string", "minLength": 1, "maxLength": 63}
_ENTRY = {
    "type": "object",
    "properties": {
        "entry_id": {"type": "string"},
        "title": {"type": "string"},
        "language": {"type": "string"},
        "source": {"type": "string"},
    },
    "required": ["entry_id", "title", "language"],
}

ADD_SPEC = ToolSpec(
    tool_id=KNOWLEDGE_ADD,
    description=(
        "Add or replace a knowledge entry from a Markdown or plain-text file in the engine's "
        "knowledge folder, in the shared table or (with `player`) that player's private one. "
        "Administrators only."
    ),
    input_schema={
        "type": "object",
        "properties": {
            "file": {"type": "string", "minLength": 1, "maxLength": 63},
            "player": _PLAYER,
        },
        "required": ["file"],
        "additionalProperties": False,
    },
    output_schema={
        "type": "object",
        "properties": {
            "entry": _ENTRY,
            "created": {"type": "boolean"},
            "player": {"type": "string"},
        },
        "required": ["entry", "created", "player"],
    },
    read_only=False,
    idempotent=True,  # the same file put twice leaves what once does
    needs_context=True,
)
LIST_SPEC = ToolSpec(
    tool_id=KNOWLEDGE_LIST,
    description=(
        "List the entries of the shared knowledge table or (with `player`) that player's "
        "private one: id, title, language and source, in id order. Administrators only."
    ),
    input_schema={
        "type": "object",
        "properties": {"player": _PLAYER},
        "additionalProperties": False,
    },
    output_schema={
        "type": "object",
        "properties": {
            "entries": {"type": "array", "items": _ENTRY},
            "more": {"type": "boolean"},
            "player": {"type": "string"},
        },
        "required": ["entries", "more", "player"],
    },
    read_only=True,
    idempotent=True,
    needs_context=True,
)
REMOVE_SPEC = ToolSpec(
    tool_id=KNOWLEDGE_REMOVE,
    description=(
        "Remove one entry from the shared knowledge table or (with `player`) that player's "
        "private one. Administrators only."
    ),
    input_schema={
        "type": "object",
        "properties": {
            "entry_id": {"type": "string", "minLength": 1, "maxLength": 128},
            "player": _PLAYER,
        },
        "required": ["entry_id"],
        "additionalProperties": False,
    },
    output_schema={
        "type": "object",
        "properties": {"entry_id": {"type": "string"}, "player": {"type": "string"}},
        "required": ["entry_id", "player"],
    },
    read_only=False,
    idempotent=False,  # a second remove finds nothing and says so
    needs_context=True,
)


class KnowledgeAdmin(Protocol):
    """Where knowledge entries are written and listed (storage's KnowledgeService)."""

    async def put(
        self, player_id: str, entry: FileEntry, timeout: float
    ) -> knowledge_pb2.PutKnowledgeResponse: ...

    async def list_entries(
        self, player_id: str, page_size: int, timeout: float
    ) -> knowledge_pb2.ListKnowledgeResponse: ...

    async def delete(self, player_id: str, entry_id: str, timeout: float) -> None: ...


class StorageKnowledgeAdmin:
    """KnowledgeAdmin over storage's `PutKnowledge`, `ListKnowledge` and `DeleteKnowledge` (a
    put replaces, so it is retried on UNAVAILABLE like the listing; a delete is not)."""

    def __init__(self, target: str, settings: ChannelSettings | None = None) -> None:
        self._dep = Dependency(
            target,
            knowledge_pb2_grpc.KnowledgeServiceStub,
            idempotent_methods=[
                "system.storage.v1.KnowledgeService/PutKnowledge",
                "system.storage.v1.KnowledgeService/ListKnowledge",
            ],
            settings=settings,
        )

    async def put(
        self, player_id: str, entry: FileEntry, timeout: float
    ) -> knowledge_pb2.PutKnowledgeResponse:
        return await self._dep.stub.PutKnowledge(put_request(entry, player_id), timeout=timeout)

    async def list_entries(
        self, player_id: str, page_size: int, timeout: float
    ) -> knowledge_pb2.ListKnowledgeResponse:
        return await self._dep.stub.ListKnowledge(
            knowledge_pb2.ListKnowledgeRequest(player_id=player_id, page_size=page_size),
            timeout=timeout,
        )

    async def delete(self, player_id: str, entry_id: str, timeout: float) -> None:
        await self._dep.stub.DeleteKnowledge(
            knowledge_pb2.DeleteKnowledgeRequest(player_id=player_id, entry_id=entry_id),
            timeout=timeout,
        )

    async def aclose(self) -> None:
        await self._dep.aclose()


def _storage_failure(exc: grpc.aio.AioRpcError, what: str) -> ModuleFailure:
    code = exc.code()
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
        return ModuleFailure(AgentFailure.INVALID_INPUT, exc.details() or what)
    return ModuleFailure(
        AgentFailure.STORAGE_UNAVAILABLE, f"{what}: {exc.details() or code.name} ({code.name})"
    )


def _entry(entry: knowledge_pb2.KnowledgeEntry) -> dict[str, Any]:
    return {
        "entry_id": entry.entry_id,
        "title": entry.title,
        "language": entry.language,
        "source": entry.source,
    }


class KnowledgeAdminTools:
    """The handlers of the knowledge admin tools.

    Args:
        store: storage's knowledge calls; None when the engine has none configured.
        folder: the knowledge folder documents are added from (`knowledge_dir`); empty for
            none, and then adding answers that it is not configured.
    """

    def __init__(self, store: KnowledgeAdmin | None, folder: str = "") -> None:
        self._store = store
        self._folder = Path(folder) if folder else None

    def register(self, tools: ToolRegistry) -> None:
        tools.server(ADD_SPEC, self.add)
        tools.server(LIST_SPEC, self.list)
        tools.server(REMOVE_SPEC, self.remove)

    def _need_store(self) -> KnowledgeAdmin:
        if self._store is None:
            raise ModuleFailure(
                AgentFailure.STORAGE_UNAVAILABLE, "this engine has no knowledge store configured"
            )
        return self._store

    @staticmethod
    def _scope(payload: dict[str, Any], ctx: ExecutionContext) -> tuple[str, str]:
        """(the name shown, the table's owner id): the shared table without a player."""
        if not payload.get("player"):
            return "", ""
        return scoped_player(ctx, payload["player"])

    def _document(self, name: str) -> FileEntry:
        """The entry the file `name` in the knowledge folder holds (blocking: file I/O)."""
        folder = self._folder
        if folder is None:
            raise ModuleFailure(
                AgentFailure.TOOL_UNAVAILABLE,
                "no knowledge folder is configured (engine setting knowledge_dir)",
            )
        plain = Path(name).name == name and name not in (".", "..") and not name.startswith(".")
        if not plain or "\\" in name or Path(name).suffix.lower() not in SUFFIXES:
            raise ModuleFailure(
                AgentFailure.INVALID_INPUT,
                f"{name!r}: name a Markdown or plain-text file ({', '.join(SUFFIXES)}) in the "
                "knowledge folder by its file name alone",
            )
        path = folder / name
        if not path.is_file():
            present = sorted(
                p.name for p in folder.glob("*") if p.suffix.lower() in SUFFIXES and p.is_file()
            )
            shown = ", ".join(present[:FOLDER_LISTING]) or "none"
            raise ModuleFailure(
                AgentFailure.INVALID_INPUT,
                f"no file {name!r} in the knowledge folder; files there: {shown}",
            )
        try:
            return read_entry(path, source=name)
        except InvalidArgument as exc:
            message = exc.message.replace(str(path), name)  # the folder is the server's business
            raise ModuleFailure(AgentFailure.INVALID_INPUT, message) from None

    async def add(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        store = self._need_store()
        shown, owner = self._scope(payload, ctx)
        entry = await asyncio.to_thread(self._document, payload["file"])
        try:
            answer = await store.put(owner, entry, min(STORAGE_TIMEOUT_SECONDS, ctx.remaining()))
        except grpc.aio.AioRpcError as exc:
            raise _storage_failure(exc, "the entry could not be stored") from None
        return {"entry": _entry(answer.entry), "created": answer.created, "player": shown}

    async def list(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        store = self._need_store()
        shown, owner = self._scope(payload, ctx)
        try:
            page = await store.list_entries(
                owner, LIST_LIMIT, min(STORAGE_TIMEOUT_SECONDS, ctx.remaining())
            )
        except grpc.aio.AioRpcError as exc:
            raise _storage_failure(exc, "the entries could not be listed") from None
        return {
            "entries": [_entry(e) for e in page.entries],
            "more": bool(page.next_page_token),
            "player": shown,
        }

    async def remove(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        store = self._need_store()
        shown, owner = self._scope(payload, ctx)
        try:
            await store.delete(
                owner, payload["entry_id"], min(STORAGE_TIMEOUT_SECONDS, ctx.remaining())
            )
        except grpc.aio.AioRpcError as exc:
            raise _storage_failure(exc, "the entry could not be removed") from None
        return {"entry_id": payload["entry_id"], "player": shown}
