"""Assembles the engine: registry (built-ins plus entry points), executor, servicer, host."""

from __future__ import annotations

import dataclasses

from system.engine.v1 import engine_pb2, engine_pb2_grpc

from engine_service.admin_tools import AdminTools, EnginePeers, RouterDiagnostics
from engine_service.advancements import AdvancementConfig
from engine_service.binding_tools import StorageBindings
from engine_service.clients import GatewayGameTools, JournalRuns, StorageHistory
from engine_service.config import EngineConfig
from engine_service.engine import BoundedExecutor, Engine
from engine_service.events import EventRunner, EventTasks
from engine_service.knowledge_admin_tools import StorageKnowledgeAdmin
from engine_service.knowledge_tools import StorageKnowledge
from engine_service.models import ModelClient
from engine_service.modules import SMALL_TALK, BuiltinServices, register_builtins
from engine_service.modules.admin import ADMIN_MODULES
from engine_service.modules.knowledge_admin import KnowledgeModule
from engine_service.offers import StorageDocuments
from engine_service.registry import ModuleRegistry, load_entry_point_modules
from engine_service.replica import JournalIncarnations, replica_identity
from engine_service.runs import PlayerRuns
from engine_service.servicer import EngineServicer
from engine_service.signin_rewards import load_signin_rewards
from engine_service.task_store import TaskStore
from engine_service.usage_tools import StorageUsage
from engine_service.web_tools import StoragePreferences
from services.runtime.config import ConfigError
from services.runtime.security import AccessPolicy
from services.runtime.server import ServiceHost

__all__ = ["EngineApp", "build_registry", "create_app"]

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name

ACCESS = AccessPolicy(
    {
        # Runs, events and history settle for players: their identity comes from the gateway.
        SERVICE_NAME: ["gateway"],
        # The module catalogue: the router (routing candidates) and the gateway.
        f"{SERVICE_NAME}/GetCatalog": ["router", "gateway"],
        # Re-reading the advancement rules: operators' tooling, and the engine replica that
        # runs an admin's /system reload, which reloads every replica (decision 0033).
        f"{SERVICE_NAME}/ReloadAdvancements": ["engine"],
    }
)
"""Who may call what (services.runtime.security); operators may call everything."""


def build_registry(config: EngineConfig, services: BuiltinServices | None = None) -> ModuleRegistry:
    """Registers the built-in tools and modules and those installed through entry points, then
    freezes. Without `services` the knowledge and web tools have nothing to reach (they fail
    as unavailable): enough for catalogue and routing checks."""
    registry = ModuleRegistry()
    # The sign-in reward catalogue is checked here, at start: a bad file stops the engine.
    services = dataclasses.replace(
        services or BuiltinServices(),
        signin_rewards=load_signin_rewards(config.signin_rewards_file),
        offer_seconds=config.offer_seconds,
    )
    register_builtins(
        registry, services, extra=load_entry_point_modules(config.disabled_entry_points)
    )
    registry.reject("system:small_talk", SMALL_TALK)
    for module_id, budgets in config.module_policy_overrides().items():
        module = registry.get(module_id)
        if module is None:
            raise ConfigError(
                f"module_policies names {module_id}, which is not registered; "
                f"modules: {', '.join(m.spec.module_id for m in registry.modules())}"
            )
        policy = dataclasses.replace(module.spec.policy, **budgets)  # type: ignore[arg-type]
        registry.amend(module_id, policy=policy)
    for module in registry.modules():
        if isinstance(module, (*ADMIN_MODULES, KnowledgeModule)):
            registry.amend(
                module.spec.module_id, min_permission_level=config.admin_permission_level
            )
    registry.freeze()
    return registry


class EngineApp:
    """The running engine and what it owns."""

    def __init__(self, config: EngineConfig) -> None:
        channels = config.channel_settings()
        # Made here, in the serving process (after any fork): the pid is this worker's own.
        self.identity = replica_identity(config.replica_id, config.workers)
        self.storage = StorageHistory(config.storage_target, channels)
        # To the gateway replica each player is connected to, as storage's presence says.
        self.game_tools = GatewayGameTools(config.gateway_target, channels, config.storage_target)
        self.runs = JournalRuns(config.storage_target, settings=channels)
        self.models = ModelClient(config.model_target, channels)
        self.knowledge = StorageKnowledge(config.storage_target, channels)
        self.preferences = StoragePreferences(config.storage_target, channels)
        self.documents = StorageDocuments(config.storage_target, channels)
        self.usage = StorageUsage(config.storage_target, channels)
        self.bindings = StorageBindings(config.storage_target, channels)
        self.knowledge_admin = StorageKnowledgeAdmin(config.storage_target, channels)
        self.router_admin = (
            RouterDiagnostics(config.router_target, channels) if config.router_target else None
        )
        self.admin = AdminTools(
            self.router_admin, engines=EnginePeers(channels), replica=self.identity.owner
        )
        registry = build_registry(
            config,
            BuiltinServices(
                self.knowledge,
                self.preferences,
                documents=self.documents,
                admin=self.admin,
                usage=self.usage,
                bindings=self.bindings,
                notifier=self.game_tools,
                knowledge_admin=self.knowledge_admin,
                knowledge_dir=config.knowledge_dir,
            ),
        )
        # Checked against the frozen registry; a bad file stops the start (ConfigError).
        self.advancements = AdvancementConfig(config.advancements_file, registry)
        self.admin.advancements = self.advancements  # reloaded with the router's config
        self.engine = Engine(
            registry,
            self.storage,
            BoundedExecutor("interactive", config.interactive_workers, config.interactive_queue),
            config.execute_timeout_seconds,
            config.history_timeout_seconds,
            self.game_tools,
            PlayerRuns(
                self.runs,
                self.identity.owner,
                config.player_lease_seconds,
                finish_timeout=config.history_timeout_seconds,
            ),
            self.models,
        )
        self.tasks = TaskStore(config.storage_target, settings=channels)
        self.runner_tasks = TaskStore(config.storage_target, private=True, settings=channels)
        self.incarnations = JournalIncarnations(
            config.storage_target, self.identity, settings=channels
        )
        self.runner = EventRunner(
            self.engine,
            self.runner_tasks,
            BoundedExecutor("event", config.event_workers, config.event_queue),
            self.identity.owner,
            config.task_lease_seconds,
            config.event_poll_seconds,
            notices=self.game_tools,
            earlier=self.incarnations,  # taken back before the first claim (decision 0014)
            located=self.game_tools.routes.located,
            remember=self.game_tools.routes.remember,  # claims say where players are
        )
        self.maintenance = BoundedExecutor(
            "maintenance", config.maintenance_workers, config.maintenance_queue
        )
        self.events = EventTasks(self.engine, self.tasks, self.runner, self.advancements)
        servicer = EngineServicer(
            self.engine,
            self.events,
            self.maintenance,
            advancements=self.advancements,
            replica=self.identity.owner,
        )
        self.host = ServiceHost(
            "engine",
            config,
            [lambda server: engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)],
            [SERVICE_NAME],
            access=ACCESS,
        )

    async def aclose(self) -> None:
        await self.runner.stop()
        self.maintenance.shutdown()
        self.engine.interactive.shutdown()
        # Exchanges already answered still reach history, and the players' leases go back.
        await self.engine.flush_history()
        await self.tasks.aclose()
        await self.runner_tasks.aclose()
        await self.incarnations.aclose()
        await self.models.aclose()
        await self.preferences.aclose()
        await self.knowledge.aclose()
        await self.documents.aclose()
        await self.usage.aclose()
        await self.bindings.aclose()
        await self.knowledge_admin.aclose()
        if self.router_admin is not None:
            await self.router_admin.aclose()
        await self.game_tools.aclose()
        await self.runs.aclose()
        await self.storage.aclose()


async def create_app(config: EngineConfig) -> EngineApp:
    app = EngineApp(config)
    app.runner.start()
    return app
