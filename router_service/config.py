"""Router service settings."""

from __future__ import annotations

import dataclasses

from services.runtime.config import ConfigError, ServerConfig

ENV_PREFIX = "SYSTEM_ROUTER_"


@dataclasses.dataclass(frozen=True)
class RouterConfig(ServerConfig):
    """Settings of the router service (env prefix `SYSTEM_ROUTER_`)."""

    port: int = 50052
    metrics_port: int = 9102
    engine_target: str = "127.0.0.1:50053"
    """`host:port` of the engine, whose catalogue declares the commands."""
    model_target: str = "127.0.0.1:50054"
    """`host:port` of the model gateway, for the one routing call; empty for none."""
    storage_target: str = ""
    """`host:port` of storage, whose IntentCacheService holds the exact intent cache that every
    router replica shares (decision 0024). Empty: a cache in this process alone, as for
    standalone use (`profiles_file`), tests and a single replica; with two or more replicas
    behind round robin set it, or a player's repeat misses on the other replica and a clear
    reaches one replica only."""
    semantic_config: str = ""
    """Path of `system-semantic.json` (seed 004's fields); empty for the built-in defaults. A
    path with no file yet gets one with the defaults at the first start (mode ENFORCE), for the
    operator to edit; reloaded by the ReloadConfig RPC."""
    button_phrasings: str = ""
    """Path of the notification buttons' phrasings (`notification-buttons.json`: per label key
    and language, the extra ways to say a button, such as 领取 or "go ahead"); empty for the
    ones bundled with the router. A path with no file yet gets a copy of the bundled file at
    the first start, for the operator to edit; reloaded with `semantic_config` by the
    ReloadConfig RPC (`/system reload`)."""
    profiles_file: str = ""
    """Standalone use: a profile-set JSON file (see router_service/corpus/profiles.json) routed
    without the engine. Empty: profiles and commands come from the engine's catalogue."""
    catalog_refresh_seconds: float = 30.0
    """How often the catalogue is re-read from the engine."""

    def validate(self) -> None:
        super().validate()
        if not self.engine_target and not self.profiles_file:
            raise ConfigError(
                "engine_target is required (host:port of the engine), unless profiles_file is set"
            )
        if self.catalog_refresh_seconds <= 0:
            raise ConfigError("catalog_refresh_seconds must be positive")
