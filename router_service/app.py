"""Assembles the router: engine, model and storage clients, catalogue, intent cache (in this
process, or shared in storage), button matcher, diagnostics, pipeline, servicer, host."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from system.engine.v1 import engine_pb2_grpc
from system.model.v1 import model_pb2_grpc
from system.router.v1 import router_pb2, router_pb2_grpc

from router_service.buttons import ButtonMatcher, Phrasings, ensure_phrasings, load_phrasings
from router_service.cache import IntentCache
from router_service.catalog import CatalogCache, standalone_catalog
from router_service.clients import SharedIntentCache
from router_service.config import RouterConfig
from router_service.diagnostics import RouterDiagnostics
from router_service.model_routing import ModelRouter
from router_service.router import Router
from router_service.semantic import SemanticConfig, ensure_semantic_config
from router_service.servicer import RouterServicer
from services.runtime.channels import Dependency
from services.runtime.config import ConfigError
from services.runtime.security import AccessPolicy
from services.runtime.server import ServiceHost

__all__ = ["RouterApp", "create_app"]

log = logging.getLogger("system.router")
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name

ACCESS = AccessPolicy(
    {
        SERVICE_NAME: ["gateway"],
        # Diagnostics and config reloads: operators' tooling, and the engine for the admins'
        # in-game commands (the router checks the player's permission level itself).
        f"{SERVICE_NAME}/GetDiagnostics": ["engine"],
        f"{SERVICE_NAME}/ReloadConfig": ["engine"],
    }
)
"""Who may call what (services.runtime.security); operators may call everything."""


class RouterApp:
    """The running router and what it owns."""

    def __init__(
        self, config: RouterConfig, semantic: SemanticConfig, phrasings: Phrasings | None = None
    ) -> None:
        self.engine = (
            Dependency(
                config.engine_target,
                engine_pb2_grpc.EngineServiceStub,
                idempotent_methods=["system.engine.v1.EngineService/GetCatalog"],
                settings=config.channel_settings(),
            )
            if config.engine_target
            else None
        )
        self.model = (
            Dependency(
                config.model_target,
                model_pb2_grpc.ModelGatewayServiceStub,
                settings=config.channel_settings(),
            )
            if config.model_target
            else None
        )
        self.shared_cache = (
            SharedIntentCache(config.storage_target, config.channel_settings())
            if config.storage_target
            else None
        )
        static = (
            standalone_catalog(config.profiles_file, semantic) if config.profiles_file else None
        )
        self.catalog = CatalogCache(
            self.engine.stub if self.engine else None,
            config.catalog_refresh_seconds,
            semantic,
            static=static,
        )
        self.router = Router(
            self.catalog,
            IntentCache(
                semantic.cache_entries, semantic.cache_seconds, semantic.entries_per_player
            ),
            ButtonMatcher(load_phrasings() if phrasings is None else phrasings),
            RouterDiagnostics(),
            ModelRouter(self.model.stub) if self.model else None,
            shared=self.shared_cache,
        )
        servicer = RouterServicer(
            self.router,
            config.semantic_config,
            config.button_phrasings,
            # Told to /system reload, which reloads the event rules of every engine replica.
            engine_target=config.engine_target,
        )
        self.host = ServiceHost(
            "router",
            config,
            [lambda server: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)],
            [SERVICE_NAME],
            access=ACCESS,
        )
        self._warm: asyncio.Task[None] | None = None

    def warm_up(self) -> None:
        """Reads the catalogue and builds the index in the background, so the first player
        does not wait for it (it retries on first use if the engine is not up yet)."""

        async def warm() -> None:
            with contextlib.suppress(Exception):
                await self.catalog.get()

        self._warm = asyncio.get_running_loop().create_task(warm())

    async def aclose(self) -> None:
        if self._warm is not None:
            self._warm.cancel()
        if self.engine is not None:
            await self.engine.aclose()
        if self.model is not None:
            await self.model.aclose()
        if self.shared_cache is not None:
            await self.shared_cache.aclose()


async def create_app(config: RouterConfig) -> RouterApp:
    semantic = SemanticConfig()
    if config.semantic_config:
        semantic, written = ensure_semantic_config(config.semantic_config)
        if written:
            log.info(
                "wrote the default semantic config to %s (mode ENFORCE)", config.semantic_config
            )
    phrasings: Phrasings | None = None
    if config.button_phrasings:
        try:
            phrasings, written = ensure_phrasings(config.button_phrasings)
        except ValueError as exc:
            raise ConfigError(f"{exc} (setting button_phrasings)") from None
        if written:
            log.info("wrote the bundled button phrasings to %s", config.button_phrasings)
    logging.getLogger("jieba").setLevel(logging.WARNING)
    app = RouterApp(config, semantic, phrasings)
    app.warm_up()
    return app
