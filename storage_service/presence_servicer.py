"""gRPC face of gateway presence: converts messages and runs the store off the event loop."""

from __future__ import annotations

from typing import Any

import grpc
from system.storage.v1 import presence_pb2, presence_pb2_grpc

from storage_service.dbcall import run_db
from storage_service.dialect import utc_now
from storage_service.presence import PresenceStore

__all__ = ["PresenceServicer"]


class PresenceServicer(presence_pb2_grpc.PresenceServiceServicer):
    """Thin: every method delegates to PresenceStore in a worker thread, at the storage
    service's time. Typed errors the store raises become status codes in the server
    interceptor."""

    def __init__(self, store: PresenceStore) -> None:
        self._store = store

    async def RenewReplica(
        self,
        request: presence_pb2.RenewReplicaRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> presence_pb2.RenewReplicaResponse:
        renewal = await run_db(
            self._store.renew_replica,
            request.replica_id,
            request.address,
            request.lease_seconds,
            request.players_digest,
            utc_now(),
        )
        response = presence_pb2.RenewReplicaResponse(
            players_in_sync=renewal.players_in_sync,
            expired_rows_deleted=renewal.expired_rows_deleted,
        )
        response.expires_at.FromDatetime(renewal.expires_at)
        return response

    async def AttachPlayers(
        self,
        request: presence_pb2.AttachPlayersRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> presence_pb2.AttachPlayersResponse:
        taken_over = await run_db(
            self._store.attach, request.replica_id, list(request.player_ids), utc_now()
        )
        return presence_pb2.AttachPlayersResponse(taken_over=taken_over)

    async def DetachPlayers(
        self,
        request: presence_pb2.DetachPlayersRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> presence_pb2.DetachPlayersResponse:
        detached = await run_db(self._store.detach, request.replica_id, list(request.player_ids))
        return presence_pb2.DetachPlayersResponse(detached=detached)

    async def SyncPlayers(
        self,
        request: presence_pb2.SyncPlayersRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> presence_pb2.SyncPlayersResponse:
        sync = await run_db(
            self._store.sync, request.replica_id, list(request.player_ids), utc_now()
        )
        return presence_pb2.SyncPlayersResponse(
            added=sync.added, removed=sync.removed, held_elsewhere=sync.held_elsewhere
        )

    async def LocatePlayer(
        self,
        request: presence_pb2.LocatePlayerRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> presence_pb2.LocatePlayerResponse:
        found = await run_db(self._store.locate, request.player_id, utc_now())
        if found is None:
            return presence_pb2.LocatePlayerResponse(connected=False)
        return presence_pb2.LocatePlayerResponse(
            connected=True, replica_id=found.replica_id, address=found.address
        )

    async def RetireReplica(
        self,
        request: presence_pb2.RetireReplicaRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> presence_pb2.RetireReplicaResponse:
        removed = await run_db(self._store.retire, request.replica_id)
        return presence_pb2.RetireReplicaResponse(players_removed=removed)
