"""Engine service settings."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid

from services.runtime.config import ConfigError, ServerConfig

ENV_PREFIX = "SYSTEM_ENGINE_"


@dataclasses.dataclass(frozen=True)
class EngineConfig(ServerConfig):
    """Settings of the engine service (env prefix `SYSTEM_ENGINE_`)."""

    port: int = 50053
    metrics_port: int = 9103
    storage_target: str = "127.0.0.1:50055"
    """`host:port` of the storage service."""
    gateway_target: str = "127.0.0.1:50051"
    """`host:port` of the gateway's ToolRelayService, through which game tools are called."""
    execute_timeout_seconds: float = 30.0
    """Longest a module may run when the caller's deadline is later (or absent)."""
    history_timeout_seconds: float = 2.0
    """Longest the history write after a run may take; it never blocks the result."""
    interactive_workers: int = 4
    """Interactive modules running at once."""
    interactive_queue: int = 32
    """Interactive requests waiting beyond the workers; more are refused as BUSY."""
    disabled_entry_points: tuple[str, ...] = ()
    """Names of `system.modules` entry points not to load."""
    replica_id: str = dataclasses.field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    """Owner name of this replica's storage leases; unique per process by default."""
    player_lease_seconds: int = 5
    """Length of the `player:<id>` lease an interactive run holds (renewed every third)."""

    def validate(self) -> None:
        super().validate()
        if not self.storage_target:
            raise ConfigError("storage_target is required (host:port of the storage service)")
        if not self.gateway_target:
            raise ConfigError(
                "gateway_target is required (host:port of the gateway's ToolRelayService)"
            )
        if self.execute_timeout_seconds <= 0 or self.history_timeout_seconds <= 0:
            raise ConfigError(
                "execute_timeout_seconds and history_timeout_seconds must be positive"
            )
        if not self.replica_id:
            raise ConfigError("replica_id must not be empty")
        if not 1 <= self.player_lease_seconds <= 3600:
            raise ConfigError("player_lease_seconds must be between 1 and 3600")
        if self.interactive_workers < 1 or self.interactive_queue < 0:
            raise ConfigError(
                "interactive_workers must be at least 1 and interactive_queue at least 0"
            )
