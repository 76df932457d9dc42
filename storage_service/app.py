"""Assembles the storage service: database engine, store, servicer, host."""

from __future__ import annotations

import asyncio

from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker
from system.storage.v1 import storage_pb2, storage_pb2_grpc

from services.runtime.server import ServiceHost
from storage_service.config import StorageConfig
from storage_service.db import make_engine
from storage_service.history import ConversationStore, HistoryBounds
from storage_service.migrate import upgrade
from storage_service.servicer import StorageServicer

__all__ = ["StorageApp", "create_app"]

SERVICE_NAME = storage_pb2.DESCRIPTOR.services_by_name["StorageService"].full_name


class StorageApp:
    """The running storage service and what it owns."""

    def __init__(self, config: StorageConfig, engine: Engine) -> None:
        self.engine = engine
        self.store = ConversationStore(
            sessionmaker(engine, expire_on_commit=False),
            HistoryBounds(
                config.history_max_entries, config.history_max_bytes, config.max_text_chars
            ),
        )
        servicer = StorageServicer(self.store)
        self.host = ServiceHost(
            "storage",
            config,
            [
                lambda server: storage_pb2_grpc.add_StorageServiceServicer_to_server(
                    servicer, server
                )
            ],
            [SERVICE_NAME],
        )

    async def aclose(self) -> None:
        self.engine.dispose()


async def create_app(config: StorageConfig) -> StorageApp:
    engine = make_engine(config.database_url)
    if config.run_migrations:
        await asyncio.to_thread(upgrade, engine)
    return StorageApp(config, engine)
