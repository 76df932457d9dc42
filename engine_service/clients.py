"""What the engine calls: the storage service."""

from __future__ import annotations

from system.common.v1 import common_pb2
from system.storage.v1 import storage_pb2, storage_pb2_grpc

from services.runtime.channels import Dependency

__all__ = ["StorageHistory"]


class StorageHistory:
    """HistoryStore over the storage service's RPCs."""

    def __init__(self, target: str) -> None:
        self._dep = Dependency(
            target,
            storage_pb2_grpc.StorageServiceStub,
            idempotent_methods=["system.storage.v1.StorageService/ListHistory"],
        )

    async def append_history(self, player_id: str, entries: list[common_pb2.HistoryEntry]) -> None:
        await self._dep.stub.AppendHistory(
            storage_pb2.AppendHistoryRequest(player_id=player_id, entries=entries)
        )

    async def list_history(self, player_id: str, page_size: int) -> list[common_pb2.HistoryEntry]:
        response = await self._dep.stub.ListHistory(
            storage_pb2.ListHistoryRequest(player_id=player_id, page_size=page_size)
        )
        return list(response.entries)

    async def aclose(self) -> None:
        await self._dep.aclose()
