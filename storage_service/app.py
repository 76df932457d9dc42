"""Assembles the storage service: database engine, the stores, their servicers, host.

With `run_migrations` on (the default, and SQLite's only sensible choice) the schema is
upgraded before the service starts. With it off (a migration Job upgrades it) the service
starts with every storage service NOT_SERVING, polls the database's revision, and serves once
`migrate.schema_state` says this build may (decision 0028). The process's own health (service
"") is SERVING throughout, so liveness and startup probes do not restart a replica that only
waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

from grpc_health.v1 import health_pb2
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker
from system.storage.v1 import (
    card_book_pb2,
    card_book_pb2_grpc,
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
from storage_service.budget_alerts import BudgetAlertClaims
from storage_service.card_book import CardBookStore
from storage_service.card_book_servicer import CardBookServicer
from storage_service.config import StorageConfig
from storage_service.db import make_engine, pool_capacity
from storage_service.dbcall import use_executor
from storage_service.group_commit import GroupCommitter
from storage_service.history import ConversationStore, HistoryBounds
from storage_service.intent_cache import IntentCacheBounds, IntentCacheStore
from storage_service.intent_cache_servicer import IntentCacheServicer
from storage_service.journal import JournalBounds, JournalStore
from storage_service.journal_servicer import JournalServicer
from storage_service.knowledge import KnowledgeStore
from storage_service.knowledge_files import seed_starter
from storage_service.knowledge_servicer import KnowledgeServicer
from storage_service.knowledge_words import warm_up
from storage_service.migrate import SchemaState, SchemaVerdict, schema_state, upgrade
from storage_service.player_data import PlayerDataStore
from storage_service.player_data_servicer import PlayerDataServicer
from storage_service.presence import PresenceStore
from storage_service.presence_servicer import PresenceServicer
from storage_service.runs import RunStore
from storage_service.servicer import StorageServicer
from storage_service.task_metrics import TaskMetrics
from storage_service.usage import UsageLedger
from storage_service.usage_spend import SpendView

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
        # A budget alert sent once across the model-gateway replicas, to every gateway replica.
        _S + "PlayerDataService/ClaimBudgetAlert": ["model"],
        _S + "KnowledgeService/SearchKnowledge": ["engine"],
        # Administrators' /system knowledge commands in game (the engine checks their
        # permission level; the gateway vouches for it).
        _S + "KnowledgeService/PutKnowledge": ["engine"],
        _S + "KnowledgeService/DeleteKnowledge": ["engine"],
        _S + "KnowledgeService/ListKnowledge": ["engine"],
        # Which gateway replica holds each player: written by gateway replicas, read by the
        # engine's relay client (decision 0023).
        _S + "PresenceService": ["gateway"],
        _S + "PresenceService/LocatePlayer": ["engine"],
        # The cards each player was shown: gateway replicas alone (decision 0030).
        _S + "CardBookService": ["gateway"],
        # The routers' shared exact intent cache (decision 0024): router replicas alone.
        _S + "IntentCacheService": ["router"],
    }
)
"""Who may call what (services.runtime.security); operators may call everything."""

# Connections the group committer's writer thread holds (one at a time).
COMMIT_CONNECTIONS = 1

log = logging.getLogger("system.storage.schema")


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
    _name(card_book_pb2, "CardBookService"),
]


class _GatedHost(ServiceHost):
    """A ServiceHost whose services stay NOT_SERVING after `start` until `until_ready`, run
    then as a task, returns. The process's own health (service "") serves from the start."""

    def __init__(
        self, *args: Any, until_ready: Callable[[], Awaitable[None]] | None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._until_ready = until_ready
        self._waiting: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()
        """Set once the services serve (at once without `until_ready`)."""

    async def start(self) -> int:
        port = await super().start()
        # No await suspends between the SERVING super().start() set and this (no Check can
        # slip in): the health servicer's set only waits on a lock nobody else holds.
        if self._until_ready is None:
            self.ready.set()
            return port
        for service in self.service_names:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._waiting = asyncio.create_task(self._open_when_ready(self._until_ready))
        return port

    async def _open_when_ready(self, until_ready: Callable[[], Awaitable[None]]) -> None:
        await until_ready()
        # After a SIGTERM the health servicer ignores this: a stopping replica stays out.
        for service in self.service_names:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.ready.set()

    async def stop(self) -> None:
        if self._waiting is not None and not self._waiting.done():
            self._waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._waiting
        await super().stop()


class StorageApp:
    """The running storage service and what it owns.

    Args:
        config: the settings.
        engine: the database engine.
        wait_for_schema: serve only once the database's schema is one this build may serve
            on (polled every `schema_poll_seconds`), then seed the starter knowledge; for
            `run_migrations` off, where the schema is someone else's to upgrade.
    """

    def __init__(
        self, config: StorageConfig, engine: Engine, *, wait_for_schema: bool = False
    ) -> None:
        self.config = config
        self.engine = engine
        self.schema: SchemaState | None = None
        """The schema state found when the services opened (with `wait_for_schema`)."""
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
        player_data = PlayerDataServicer(
            self.player_data,
            UsageLedger(sessions),
            SpendView(sessions),
            BudgetAlertClaims(sessions),
        )
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
        self.card_book = CardBookStore(sessions)
        # The event backlog for autoscalers (system_storage_event_tasks_claimable), counted from
        # when the services serve.
        self.task_metrics = TaskMetrics(sessions)
        cards = CardBookServicer(self.card_book)
        gated = _GatedHost(
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
                lambda s: card_book_pb2_grpc.add_CardBookServiceServicer_to_server(cards, s),
            ],
            SERVICE_NAMES,
            access=ACCESS,
            until_ready=self._schema_ready if wait_for_schema else None,
        )
        self.host: ServiceHost = gated
        self.ready = gated.ready
        """Set once the storage services serve: at `host.start()`, or with `wait_for_schema`
        once the schema is one this build may serve on."""

    async def _schema_ready(self) -> None:
        """Returns once the schema serves and the starter knowledge is in; retries whatever
        fails (the database away, a schema still old) every `schema_poll_seconds`."""
        said = ""
        while True:
            try:
                state = await asyncio.to_thread(schema_state, self.engine)
                if state.verdict.serves:
                    if self.config.starter_knowledge:
                        await asyncio.to_thread(seed_starter, self.knowledge)
                    break
                news = state.describe()
                bad = state.verdict is SchemaVerdict.INCOMPATIBLE
                level = logging.ERROR if bad else logging.INFO
            except Exception as exc:  # noqa: BLE001 - the database away: try again
                news = f"cannot read the schema yet: {type(exc).__name__}: {exc}"
                level = logging.WARNING
            if news != said:  # once per change, not once per poll
                log.log(level, "storage not serving until the schema is migrated: %s", news)
                said = news
            await asyncio.sleep(self.config.schema_poll_seconds)
        self.schema = state
        newer = state.verdict is SchemaVerdict.NEWER
        log.log(logging.WARNING if newer else logging.INFO, "storage serving: %s", state.describe())

    async def aclose(self) -> None:
        await self.task_metrics.stop()
        use_executor(None, replacing=self.executor)
        self.executor.shutdown(wait=False)
        await asyncio.to_thread(self.committer.close)
        self.engine.dispose()


async def create_app(config: StorageConfig) -> StorageApp:
    engine = make_engine(config.database_url, extra_connections=COMMIT_CONNECTIONS)
    if config.run_migrations:
        await asyncio.to_thread(upgrade, engine)
    await asyncio.to_thread(warm_up)  # load jieba's dictionary now, not on the first search
    app = StorageApp(config, engine, wait_for_schema=not config.run_migrations)
    if config.starter_knowledge and config.run_migrations:
        await asyncio.to_thread(seed_starter, app.knowledge)
    app.task_metrics.start(after=app.ready)
    return app
