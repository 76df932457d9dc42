"""Storage service settings."""

from __future__ import annotations

import dataclasses

from services.runtime.config import ConfigError, ServerConfig

ENV_PREFIX = "SYSTEM_STORAGE_"


@dataclasses.dataclass(frozen=True)
class StorageConfig(ServerConfig):
    """Settings of the storage service (env prefix `SYSTEM_STORAGE_`)."""

    port: int = 50055
    metrics_port: int = 9105
    database_url: str = "sqlite:///data/storage.db"
    """SQLAlchemy URL: `sqlite:///path.db` embedded, `postgresql://host/db` in production."""
    history_max_entries: int = 200
    """Most history entries kept per player; the oldest go first."""
    history_max_bytes: int = 262_144
    """Most encoded history bytes kept per player; the oldest go first."""
    max_text_chars: int = 4000
    """Longest text one history entry may carry."""
    task_max_entries: int = 1000
    """Most event tasks kept per player; terminal ones are evicted oldest first."""
    task_max_bytes: int = 1_048_576
    """Most encoded task bytes kept per player; terminal ones are evicted oldest first."""
    receipt_max_entries: int = 5000
    """Most step receipts kept per player; those of terminal tasks are evicted oldest first."""
    receipt_max_bytes: int = 4_194_304
    """Most encoded receipt bytes kept per player."""
    max_document_bytes: int = 262_144
    """Largest encoded player module document."""
    max_result_bytes: int = 262_144
    """Largest encoded step result or task result."""
    max_knowledge_chars: int = 20_000
    """Longest knowledge entry body."""
    starter_knowledge: bool = True
    """Write the starter set about the assistant (storage_service/starter_knowledge) into the
    shared knowledge table at start when that table is empty, so /question answers out of the
    box."""
    commit_group_max: int = 48
    """Most Commit calls applied together in one database transaction (group commit: a
    writer thread takes every Commit waiting when it is free). 1 gives each its own."""
    intent_cache_max_entries: int = 65536
    """Most entries of the routers' shared intent cache in all (IntentCacheService); the least
    recently used go first."""
    intent_cache_per_player: int = 32
    """Most intent cache entries of one player (seed 004's `entriesPerPlayer`)."""
    intent_cache_ttl_seconds: float = 300.0
    """Lifetime of an intent cache entry (seed 004's `cacheSeconds`)."""
    run_migrations: bool = True
    """Bring the database schema up to date at start (`python -m storage_service.migrate` does
    it alone). Off (the Kubernetes PostgreSQL components, where a Job migrates): the service
    changes no schema; it starts with its services NOT_SERVING and serves once the database
    is at this build's head or at a later release's revision with every table and column this
    build declares (decision 0028), checking every `schema_poll_seconds`."""
    schema_poll_seconds: float = 5.0
    """How often a service started with `run_migrations` off checks the database's revision
    while it waits for the schema it needs."""

    def validate(self) -> None:
        super().validate()
        if not self.database_url.startswith(("sqlite:", "postgresql")):
            raise ConfigError(
                f"database_url must start with sqlite: or postgresql, got {self.database_url!r}"
            )
        for name in (
            "history_max_entries",
            "history_max_bytes",
            "max_text_chars",
            "task_max_entries",
            "task_max_bytes",
            "receipt_max_entries",
            "receipt_max_bytes",
            "max_document_bytes",
            "max_result_bytes",
            "max_knowledge_chars",
            "commit_group_max",
            "intent_cache_max_entries",
            "intent_cache_per_player",
            "intent_cache_ttl_seconds",
            "schema_poll_seconds",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.commit_group_max > 64:
            # PostgreSQL slows down past 64 subtransactions (savepoints) in one transaction.
            raise ConfigError(f"commit_group_max must be at most 64, got {self.commit_group_max}")
