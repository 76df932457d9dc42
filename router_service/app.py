"""Assembles the router: engine client, catalogue cache, pipeline, servicer, host."""

from __future__ import annotations

from system.engine.v1 import engine_pb2_grpc
from system.router.v1 import router_pb2, router_pb2_grpc

from router_service.catalog import CatalogCache
from router_service.config import RouterConfig
from router_service.router import Router
from router_service.servicer import RouterServicer
from services.runtime.channels import Dependency
from services.runtime.server import ServiceHost

__all__ = ["RouterApp", "create_app"]

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


class RouterApp:
    """The running router and what it owns."""

    def __init__(self, config: RouterConfig) -> None:
        self.engine = Dependency(
            config.engine_target,
            engine_pb2_grpc.EngineServiceStub,
            idempotent_methods=["system.engine.v1.EngineService/GetCatalog"],
        )
        self.router = Router(
            CatalogCache(self.engine.stub, config.catalog_refresh_seconds), config.max_text_chars
        )
        servicer = RouterServicer(self.router)
        self.host = ServiceHost(
            "router",
            config,
            [lambda server: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)],
            [SERVICE_NAME],
        )

    async def aclose(self) -> None:
        await self.engine.aclose()


async def create_app(config: RouterConfig) -> RouterApp:
    return RouterApp(config)
