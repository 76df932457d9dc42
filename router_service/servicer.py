"""gRPC face of the router."""

from __future__ import annotations

from system.router.v1 import router_pb2_grpc

from router_service.router import Router

__all__ = ["RouterServicer"]


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, router: Router) -> None:
        self._router = router

    async def Route(self, request, context):  # type: ignore[no-untyped-def]
        return await self._router.route(request.player, request.text)
