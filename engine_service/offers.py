"""Offers a player accepts with one button press, and the orders they become.

An *offer* is what a confirmation card shows (a shop quote: item, count, unit price, total):
one document per player and *book* (the module family that makes it, `system:shop`), so a new
offer replaces the last one and its document's version goes up. The card carries the offer's
id and that version; only a press naming the book's current offer at its current version, not
expired, can take it. Taking is one storage transaction (`JournalService.Commit`, its request
id derived from the offer): the offer is deleted at that version and the *order* document is
created (it must not exist yet), together or not at all. The order is the idempotent receipt:
a second press, a retry or a press racing the first finds the order and never places another.
The module then applies the order where its effect lives (the game server, keyed by the order
id) and settles it: a second transaction moves the order from `placed` to its outcome.

An order left `placed` (the engine or the storage stopped between placing and settling) is
picked up again by the next press of the same card: the game server answers a known order id
with its first outcome, so the effect happens once.

Three server tools, the only door to these documents (they go through the execution context's
checks like every tool, and all three are writes): `system:offer.make`, `system:offer.take` and
`system:order.settle`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import grpc
from system.storage.v1 import journal_pb2, journal_pb2_grpc, player_data_pb2, player_data_pb2_grpc

from engine_service.context import ExecutionContext
from engine_service.tools import ToolRegistry, ToolSpec
from services.results import AgentFailure, ModuleFailure
from services.runtime.channels import ChannelSettings, Dependency

__all__ = [
    "OFFER_MAKE",
    "OFFER_SECONDS",
    "OFFER_TAKE",
    "ORDER_SETTLE",
    "DocumentStore",
    "OfferTools",
    "StorageDocuments",
]

OFFER_MAKE = "system:offer.make"
OFFER_TAKE = "system:offer.take"
ORDER_SETTLE = "system:order.settle"
OFFER_SECONDS = 300
"""How long an offer may be taken after it was made, unless configured otherwise
(EngineConfig.offer_seconds)."""
STORAGE_TIMEOUT_SECONDS = 5.0
CODEC = "application/json"
OFFER_TYPE = "system:offer"
ORDER_TYPE = "system:order/"
"""Storage type prefix of an order document; the order id follows."""

_BOOK = {
    "type": "string",
    "pattern": "^[a-z0-9_.-]+:[a-z0-9_./-]+$",
    "maxLength": 64,
    "description": "The module family the offer belongs to (system:shop).",
}
_OFFER_ID = {
    "type": "string",
    "pattern": "^[0-9a-f]{32}$",
    "description": "The offer's id; the order it becomes has the same id.",
}
_TERMS = {
    "type": "object",
    "description": "What the player is offered, as the module shows and applies it.",
}
_ORDER = {
    "type": "object",
    "properties": {
        "order_id": _OFFER_ID,
        "state": {"type": "string", "enum": ["placed", "completed", "rejected"]},
        "terms": _TERMS,
        "placed_at": {"type": "number"},
        "outcome": {"type": "object", "description": "The settled outcome, once settled."},
    },
    "required": ["order_id", "placed_at", "state", "terms"],
}

OFFER_MAKE_SPEC = ToolSpec(
    tool_id=OFFER_MAKE,
    description="Make the player's current offer of a book (replacing the last one); returns "
    "its id, the version a confirmation card must name, and when it expires.",
    input_schema={
        "type": "object",
        "properties": {"book": _BOOK, "terms": _TERMS},
        "required": ["book", "terms"],
        "additionalProperties": False,
    },
    output_schema={
        "type": "object",
        "properties": {
            "offer_id": _OFFER_ID,
            "version": {"type": "integer", "minimum": 1},
            "expires_at": {"type": "number", "description": "Seconds since the epoch."},
            "valid_seconds": {"type": "integer", "minimum": 1},
        },
        "required": ["expires_at", "offer_id", "valid_seconds", "version"],
    },
    needs_context=True,
)
OFFER_TAKE_SPEC = ToolSpec(
    tool_id=OFFER_TAKE,
    description="Take the player's offer named by a confirmation press (its id and version): "
    "deletes the offer and places its order in one transaction. Answers taken (the order, "
    "placed now), ordered (the order placed before: nothing done), expired, or stale (not the "
    "book's current offer at that version).",
    input_schema={
        "type": "object",
        "properties": {
            "book": _BOOK,
            "offer_id": _OFFER_ID,
            "version": {"type": "integer", "minimum": 1},
        },
        "required": ["book", "offer_id", "version"],
        "additionalProperties": False,
    },
    output_schema={
        "type": "object",
        "properties": {
            "outcome": {"type": "string", "enum": ["taken", "ordered", "expired", "stale"]},
            "order": _ORDER,
            "order_version": {"type": "integer", "minimum": 0},
        },
        "required": ["outcome"],
    },
    idempotent=True,
    needs_context=True,
)
ORDER_SETTLE_SPEC = ToolSpec(
    tool_id=ORDER_SETTLE,
    description="Settle a placed order (as offer.take answered it, with its document version) "
    "with its outcome (completed or rejected), once: an order settled before keeps its first "
    "outcome, which is answered back.",
    input_schema={
        "type": "object",
        "properties": {
            "book": _BOOK,
            "order": _ORDER,
            "order_version": {"type": "integer", "minimum": 1},
            "state": {"type": "string", "enum": ["completed", "rejected"]},
            "outcome": {"type": "object"},
        },
        "required": ["book", "order", "order_version", "outcome", "state"],
        "additionalProperties": False,
    },
    output_schema={
        "type": "object",
        "properties": {"order": _ORDER},
        "required": ["order"],
    },
    idempotent=True,
    needs_context=True,
)


class DocumentStore(Protocol):
    """Player documents and atomic batches (the storage service in production)."""

    async def get(
        self, key: journal_pb2.DocumentKey, timeout: float
    ) -> journal_pb2.Document | None: ...

    async def commit(
        self,
        request_id: str,
        player_id: str,
        operations: list[journal_pb2.CommitOperation],
        timeout: float,
    ) -> journal_pb2.CommitResponse: ...


class StorageDocuments:
    """DocumentStore over `PlayerDataService.GetDocument` and `JournalService.Commit`; both are
    retried on UNAVAILABLE (a read, and a batch whose request id makes a retry replay)."""

    def __init__(self, target: str, settings: ChannelSettings | None = None) -> None:
        self._data = Dependency(
            target,
            player_data_pb2_grpc.PlayerDataServiceStub,
            idempotent_methods=["system.storage.v1.PlayerDataService/GetDocument"],
            settings=settings,
        )
        self._journal = Dependency(
            target,
            journal_pb2_grpc.JournalServiceStub,
            idempotent_methods=["system.storage.v1.JournalService/Commit"],
            settings=settings,
        )

    async def get(
        self, key: journal_pb2.DocumentKey, timeout: float
    ) -> journal_pb2.Document | None:
        try:
            response = await self._data.stub.GetDocument(
                player_data_pb2.GetDocumentRequest(key=key), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return response.document

    async def commit(
        self,
        request_id: str,
        player_id: str,
        operations: list[journal_pb2.CommitOperation],
        timeout: float,
    ) -> journal_pb2.CommitResponse:
        return await self._journal.stub.Commit(
            journal_pb2.CommitRequest(
                request_id=request_id, player_id=player_id, operations=operations
            ),
            timeout=timeout,
        )

    async def aclose(self) -> None:
        await self._data.aclose()
        await self._journal.aclose()


def _unavailable(exc: grpc.aio.AioRpcError, what: str) -> ModuleFailure:
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return ModuleFailure(AgentFailure.INVALID_INPUT, exc.details() or what)
    return ModuleFailure(
        AgentFailure.STORAGE_UNAVAILABLE, f"{what}: {exc.details() or exc.code().name}"
    )


def _decode(document: journal_pb2.Document) -> dict[str, Any]:
    decoded: dict[str, Any] = json.loads(document.data.decode("utf-8"))
    return decoded


def _encode(data: dict[str, Any]) -> bytes:
    return json.dumps(data, ensure_ascii=False, sort_keys=True).encode("utf-8")


class OfferTools:
    """The handlers of the three offer and order tools.

    Args:
        store: where offers and orders live; None when the engine has no storage configured
            (every call then fails as STORAGE_UNAVAILABLE).
        offer_seconds: how long an offer may be taken after it was made.
        clock: seconds since the epoch.
    """

    def __init__(
        self,
        store: DocumentStore | None,
        offer_seconds: int = OFFER_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._offer_seconds = offer_seconds
        self._clock = clock

    def register(self, tools: ToolRegistry) -> None:
        tools.server(OFFER_MAKE_SPEC, self.make)
        tools.server(OFFER_TAKE_SPEC, self.take)
        tools.server(ORDER_SETTLE_SPEC, self.settle)

    def _ready(self, ctx: ExecutionContext) -> tuple[DocumentStore, float]:
        if self._store is None:
            raise ModuleFailure(
                AgentFailure.STORAGE_UNAVAILABLE, "this engine has no storage configured"
            )
        return self._store, min(STORAGE_TIMEOUT_SECONDS, ctx.remaining())

    @staticmethod
    def _key(ctx: ExecutionContext, book: str, storage_type: str) -> journal_pb2.DocumentKey:
        return journal_pb2.DocumentKey(
            player_id=ctx.player.player_id, owner_module=book, storage_type=storage_type
        )

    async def _get(
        self, ctx: ExecutionContext, key: journal_pb2.DocumentKey
    ) -> journal_pb2.Document | None:
        store, timeout = self._ready(ctx)
        try:
            return await store.get(key, timeout)
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(exc, "the offer could not be read") from None

    async def make(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        """Writes a new current offer over the book's last one (whatever its version)."""
        store, timeout = self._ready(ctx)
        key = self._key(ctx, payload["book"], OFFER_TYPE)
        offer_id = uuid.uuid4().hex
        expires_at = self._clock() + self._offer_seconds
        data = {"offer_id": offer_id, "terms": payload["terms"], "expires_at": expires_at}
        for _ in range(3):  # a concurrent quote may write between the read and the put
            current = await self._get(ctx, key)
            put = journal_pb2.DocumentPut(
                key=key,
                expected_version=current.version if current else 0,
                data=_encode(data),
                codec_id=CODEC,
            )
            try:
                response = await store.commit(
                    f"offer:{offer_id}:{put.expected_version}",
                    ctx.player.player_id,
                    [journal_pb2.CommitOperation(put=put)],
                    timeout,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:
                    continue
                raise _unavailable(exc, "the offer could not be stored") from None
            return {
                "offer_id": offer_id,
                "version": response.versions[0],
                "expires_at": expires_at,
                "valid_seconds": self._offer_seconds,
            }
        raise ModuleFailure(AgentFailure.BUSY, "offers were being made too fast; try again")

    async def _order(
        self, ctx: ExecutionContext, book: str, order_id: str
    ) -> tuple[dict[str, Any], int] | None:
        document = await self._get(ctx, self._key(ctx, book, ORDER_TYPE + order_id))
        return (_decode(document), document.version) if document is not None else None

    async def take(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        """Deletes the offer at the pressed version and places its order, together."""
        store, timeout = self._ready(ctx)
        book, offer_id, version = payload["book"], payload["offer_id"], payload["version"]
        key = self._key(ctx, book, OFFER_TYPE)
        current = await self._get(ctx, key)
        offer = _decode(current) if current is not None else None
        if (
            current is None
            or offer is None
            or offer["offer_id"] != offer_id
            or current.version != version
        ):
            # Taken before (a second press, a retry), or replaced by a newer offer.
            ordered = await self._order(ctx, book, offer_id)
            if ordered is not None:
                return {"outcome": "ordered", "order": ordered[0], "order_version": ordered[1]}
            return {"outcome": "stale"}
        if offer["expires_at"] <= self._clock():
            return {"outcome": "expired"}
        order = {
            "order_id": offer_id,
            "state": "placed",
            "terms": offer["terms"],
            "placed_at": self._clock(),
        }
        operations = [
            journal_pb2.CommitOperation(
                delete=journal_pb2.DocumentDelete(key=key, expected_version=version)
            ),
            journal_pb2.CommitOperation(
                put=journal_pb2.DocumentPut(
                    key=self._key(ctx, book, ORDER_TYPE + offer_id),
                    expected_version=0,
                    data=_encode(order),
                    codec_id=CODEC,
                )
            ),
        ]
        try:
            response = await store.commit(
                f"take:{offer_id}", ctx.player.player_id, operations, timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED:
                raise _unavailable(exc, "the order could not be placed") from None
            # Another press took it between the read and the commit.
            ordered = await self._order(ctx, book, offer_id)
            if ordered is None:
                return {"outcome": "stale"}
            return {"outcome": "ordered", "order": ordered[0], "order_version": ordered[1]}
        if response.replayed:  # this very take was applied before and its answer lost
            ordered = await self._order(ctx, book, offer_id)
            if ordered is not None:
                return {"outcome": "ordered", "order": ordered[0], "order_version": ordered[1]}
        return {"outcome": "taken", "order": order, "order_version": response.versions[1]}

    async def settle(self, payload: dict[str, Any], ctx: ExecutionContext) -> dict[str, Any]:
        """Moves a placed order to its outcome, written over the version `take` answered (no
        second read); if the order moved since, the first outcome stays."""
        store, timeout = self._ready(ctx)
        book, order, version = payload["book"], payload["order"], payload["order_version"]
        order_id = order["order_id"]
        settled = {**order, "state": payload["state"], "outcome": payload["outcome"]}
        put = journal_pb2.DocumentPut(
            key=self._key(ctx, book, ORDER_TYPE + order_id),
            expected_version=version,
            data=_encode(settled),
            codec_id=CODEC,
        )
        try:
            await store.commit(
                f"settle:{order_id}",
                ctx.player.player_id,
                [journal_pb2.CommitOperation(put=put)],
                timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED:
                raise _unavailable(exc, "the order could not be settled") from None
            again = await self._order(ctx, book, order_id)  # settled meanwhile: keep the first
            return {"order": again[0] if again else settled}
        return {"order": settled}
