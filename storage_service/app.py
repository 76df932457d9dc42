"""Assembles the storage service: database engine, the stores, their servicers, host."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker
from system.storage.v1 import (
    intent_cache_pb2,
    intent_cache_pb2_grpc,
    journal_pb2,
    journal_pb2_grpc,
    knowledge_pb2,
    knowledge_pb2_grpc,
    player_data_pb2,
    player_data_pb2_grpc,
    presence_pb2,
    presence_pb2_grpc,
    storage_pb2,
    storage_pb2_grpc,
)

from services.runtime.security import AccessPolicy
from services.runtime.server import ServiceHost
from storage_service.config import StorageConfig
from storage_service.db import make_engine, pool_capacity
from storage_service.dbcall import use_executor
from storage_service.group_commit import GroupCommitter
from storage_service.history import ConversationStore, HistoryBounds
from storage_service.intent_cache import IntentCacheBounds, IntentCacheStore
from storage_service.intent_cache_servicer import IntentCacheServicer
from storage_service.journal import JournalBounds, JournalStore
from storage_service.journal_servicer import JournalServicer
from storage_service.knowledge import KnowledgeStore, warm_up
from storage_service.knowledge_files import seed_starter
from storage_service.knowledge_servicer import KnowledgeServicer
from storage_service.migrate import upgrade
from storage_service.player_data import PlayerDataStore
from storage_service.player_data_servicer import PlayerDataServicer
from storage_service.presence import PresenceStore
from storage_service.presence_servicer import PresenceServicer
from storage_service.runs import RunStore
from storage_service.servicer import StorageServicer
from storage_service.usage import UsageLedger

__all__ = ["SERVICE_NAME", "SERVICE_NAMES", "StorageApp", "create_app"]

_S = "system.storage.v1."
ACCESS = AccessPolicy(
    {
        # History and preferences: the gateway's player controls and the engine's runs.
        _S + "StorageService": ["gateway", "engine"],
        # Tasks, receipts, leases and atomic batches: engine replicas alone.
        _S + "JournalService": ["engine"],
        _S + "PlayerDataService/GetDocument": ["engine"],
        _S + "PlayerDataService/ListDocuments": ["engine"],
        _S + "PlayerDataService/GetBinding": ["gateway", "engine"],
        _S + "PlayerDataService/GetUsage": ["engine", "model"],
        # Administrators' /system grant, revoke and reset in game (the engine checks their
        # permission level; the gateway vouches for it).
        _S + "PlayerDataService/GrantBinding": ["engine"],
        _S + "PlayerDataService/SetPlayerFeature": ["engine"],
        _S + "PlayerDataService/ResetPlayer": ["engine"],
        # Metering: the model gateway alone.
        _S + "PlayerDataService/ReserveUsage": ["model"],
        _S + "PlayerDataService/SettleUsage": ["model"],
        _S + "PlayerDataService/SettleUsageBatch": ["model"],
        _S + "KnowledgeService/SearchKnowledge": ["engine"],
        # Which gateway replica holds each player: written by gateway replicas, read by the
        # engine's relay client (decision 0023).
        _S + "PresenceService": ["gateway"],
        _S + "PresenceService/LocatePlayer": ["engine"],
        # The routers' shared exact intent cache (decision 0024): router replicas alone.
        _S + "IntentCacheService": ["router"],
        # Not listed, so operators' tooling alone: PutKnowledge, DeleteKnowledge.
    }
)
"""Who may call what (services.runtime.security); operators may call everything."""

# Connections the group committer's writer thread holds (one at a time).
COMMIT_CONNECTIONS = 1


def _name(module: ModuleType, service: str) -> str:
    full_name: str = module.DESCRIPTOR.services_by_name[service].full_name
    return full_name


SERVICE_NAME = _name(storage_pb2, "StorageService")
SERVICE_NAMES = [
    SERVICE_NAME,
    _name(journal_pb2, "JournalService"),
    _name(player_data_pb2, "PlayerDataService"),
    _name(knowledge_pb2, "KnowledgeService"),
    _name(presence_pb2, "PresenceService"),
    _name(intent_cache_pb2, "IntentCacheService"),
]


class StorageApp:
    """The running storage service and what it owns."""

    def __init__(self, config: StorageConfig, engine: Engine) -> None:
        self.engine = engine
        # One worker thread per pooled connection but the group committer's: database calls
        # never wait for a thread while a connection is free, nor hold a thread while they
        # wait for a connection.
        self.executor = ThreadPoolExecutor(
            max(1, pool_capacity(engine) - COMMIT_CONNECTIONS), thread_name_prefix="storage-db"
        )
        use_executor(self.executor)
        sessions = sessionmaker(engine, expire_on_commit=False)
        self.store = ConversationStore(
            sessions,
            HistoryBounds(
                config.history_max_entries, config.history_max_bytes, config.max_text_chars
            ),
        )
        self.journal = JournalStore(sessions, JournalBounds.from_config(config))
        self.committer = GroupCommitter(sessions, config.commit_group_max)
        self.player_data = PlayerDataStore(sessions)
        self.knowledge = KnowledgeStore(sessions, config.max_knowledge_chars)
        history = StorageServicer(self.store)
        runs = RunStore(self.store, self.journal.now)
        journal = JournalServicer(self.journal, runs, self.committer)
        player_data = PlayerDataServicer(self.player_data, UsageLedger(sessions))
        knowledge = KnowledgeServicer(self.knowledge)
        self.presence = PresenceStore(sessions)
        presence = PresenceServicer(self.presence)
        self.intent_cache = IntentCacheStore(
            sessions,
            IntentCacheBounds(
                config.intent_cache_max_entries,
                config.intent_cache_per_player,
                config.intent_cache_ttl_seconds,
            ),
        )
        intents = IntentCacheServicer(self.intent_cache)
        self.host = ServiceHost(
            "storage",
            config,
            [
                lambda s: storage_pb2_grpc.add_StorageServiceServicer_to_server(history, s),
                lambda s: journal_pb2_grpc.add_JournalServiceServicer_to_server(journal, s),
                lambda s: player_data_pb2_grpc.add_PlayerDataServiceServicer_to_server(
                    player_data, s
                ),
                lambda s: knowledge_pb2_grpc.add_KnowledgeServiceServicer_to_server(knowledge, s),
                lambda s: presence_pb2_grpc.add_PresenceServiceServicer_to_server(presence, s),
                lambda s: intent_cache_pb2_grpc.add_IntentCacheServiceServicer_to_server(
                    intents, s
                ),
            ],
            SERVICE_NAMES,
            access=ACCESS,
        )

    async def aclose(self) -> None:
        use_executor(None, replacing=self.executor)
        self.executor.shutdown(wait=False)
        await asyncio.to_thread(self.committer.close)
        self.engine.dispose()


async def create_app(config: StorageConfig) -> StorageApp:
    engine = make_engine(config.database_url, extra_connections=COMMIT_CONNECTIONS)
    if config.run_migrations:
        await asyncio.to_thread(upgrade, engine)
    await asyncio.to_thread(warm_up)  # load jieba's dictionary now, not on the first search
    app = StorageApp(config, engine)
    if config.starter_knowledge:
        await asyncio.to_thread(seed_starter, app.knowledge)
    return app
