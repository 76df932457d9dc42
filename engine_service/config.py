"""Engine service settings."""

from __future__ import annotations

import dataclasses

from engine_service.replica import MAX_REPLICA_ID, OWNER_SEPARATOR
from services.runtime.config import ConfigError, ServerConfig

ENV_PREFIX = "SYSTEM_ENGINE_"


OVERRIDABLE_BUDGETS = (
    "rounds",
    "model_calls",
    "tool_calls",
    "steps",
    "seconds",
    "model_call_seconds",
)
"""ExecutionPolicy fields an operator may override per module (not write_steps: how many
writes a module makes is part of what it is)."""


@dataclasses.dataclass(frozen=True)
class EngineConfig(ServerConfig):
    """Settings of the engine service (env prefix `SYSTEM_ENGINE_`)."""

    port: int = 50053
    metrics_port: int = 9103
    storage_target: str = "127.0.0.1:50055"
    """`host:port` of the storage service."""
    model_target: str = "127.0.0.1:50054"
    """`host:port` of the model gateway (model calls, web search and fetch)."""
    router_target: str = "127.0.0.1:50052"
    """`host:port` of the router, for the admins' `/system routing` and `/system reload`;
    empty: those commands answer that no router is configured."""
    gateway_target: str = "127.0.0.1:50051"
    """`host:port` of the gateway's ToolRelayService, through which game tools are called:
    where a player goes whose gateway replica storage does not know (decision 0023); others
    go to the internal address of the replica they are connected to."""
    execute_timeout_seconds: float = 120.0
    """Longest a module may run when the caller's deadline is later (or absent)."""
    history_timeout_seconds: float = 2.0
    """Longest the history write after a run may take; it never blocks the result."""
    interactive_workers: int = 4
    """Interactive modules running at once."""
    interactive_queue: int = 32
    """Interactive requests waiting beyond the workers; more are refused as BUSY."""
    event_workers: int = 2
    """Event tasks running at once on this replica."""
    event_queue: int = 64
    """Claimed event tasks waiting for a worker (their leases renewed meanwhile)."""
    maintenance_workers: int = 2
    """Maintenance jobs (resuming a joining player's tasks) running at once."""
    maintenance_queue: int = 32
    """Maintenance jobs waiting; more are refused as BUSY."""
    task_lease_seconds: int = 30
    """Lease of a claimed event task, renewed every third. A replica that dies holds its tasks
    this long before another replica takes them over, unless it is restarted under the same
    name first (decision 0014)."""
    event_poll_seconds: float = 1.0
    """How often to look for event tasks nobody woke this replica for (queued by another
    replica, or left by a dead one)."""
    disabled_entry_points: tuple[str, ...] = ()
    """Names of `system.modules` entry points not to load."""
    replica_id: str = ""
    """This replica's stable name, unique among live replicas (e.g. the pod's name); its
    leases are owned by `<name>#<incarnation>`, the incarnation new at every start, and at
    start it takes back the leases its earlier incarnations held (decision 0014). Empty:
    `<hostname>:<pid>`. With `workers` > 1 each worker's name is `<replica_id>:<pid>`. At
    most 80 characters, no `#`."""
    player_lease_seconds: int = 5
    """Length of the `player:<id>` lease an interactive run holds (renewed every third)."""
    advancements_file: str = ""
    """JSON file of advancement rules (advancement id -> module and input; see
    `engine_service.advancements`), checked at start (the engine refuses to start with a bad
    one) and re-read by `ReloadAdvancements`. Empty: the shipped
    `engine_service/advancements.json`."""
    signin_rewards_file: str = ""
    """JSON file of the daily sign-in's reward catalogue (`engine_service.signin_rewards`),
    checked at start (the engine refuses to start with a bad one; the error names the entry).
    Empty: the shipped `engine_service/signin_rewards.json`."""
    knowledge_dir: str = ""
    """Folder of Markdown and plain-text documents (`.md`, `.markdown`, `.txt`) that
    administrators add to the knowledge base in game by file name (`/system knowledge-add FILE
    [player]`); `make run` uses `data/knowledge/`. Empty: that command answers that no folder
    is configured (listing and removing still work; the operator's CLI adds from anywhere)."""
    offer_seconds: int = 300
    """How long a confirmation card's offer (a shop quote) may be confirmed after it was made;
    later its confirm button answers "expired" and charges nothing."""
    admin_permission_level: int = 3
    """Least game permission level (0-4) of the administrators' commands (`/system routing`,
    `reload`, `usage`, `grant`, `revoke`, `reset`, `search-on`, `search-off`, `knowledge`,
    `knowledge-add`, `knowledge-remove`); below it they
    appear nowhere. The router checks the same level, from this engine's catalogue."""
    module_policies: tuple[str, ...] = ()
    """Per-module budget overrides, each `module@budget=value` (env: comma-separated), for
    example `system:chat@model_calls=2` or `system:question@seconds=45`. Budgets: rounds,
    model_calls, tool_calls, steps (whole numbers >= 1, rounds and steps; >= 0 the others),
    seconds and model_call_seconds (positive). A module's write steps are its own and cannot
    be changed here. Checked at start against the registry (`module_policy_overrides`)."""

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.admin_permission_level <= 4:
            raise ConfigError(
                f"admin_permission_level must be 0..4 (the game's permission levels), "
                f"got {self.admin_permission_level}"
            )
        if not self.storage_target:
            raise ConfigError("storage_target is required (host:port of the storage service)")
        if not self.model_target:
            raise ConfigError("model_target is required (host:port of the model gateway)")
        if not self.gateway_target:
            raise ConfigError(
                "gateway_target is required (host:port of the gateway's ToolRelayService)"
            )
        if self.execute_timeout_seconds <= 0 or self.history_timeout_seconds <= 0:
            raise ConfigError(
                "execute_timeout_seconds and history_timeout_seconds must be positive"
            )
        if OWNER_SEPARATOR in self.replica_id:
            raise ConfigError(
                f"replica_id must not contain {OWNER_SEPARATOR!r}: it separates the replica's "
                "name from its incarnation in lease owners"
            )
        if len(self.replica_id) > MAX_REPLICA_ID or not self.replica_id.isprintable():
            raise ConfigError(f"replica_id must be at most {MAX_REPLICA_ID} printable characters")
        if not 1 <= self.player_lease_seconds <= 3600:
            raise ConfigError("player_lease_seconds must be between 1 and 3600")
        for kind in ("interactive", "event", "maintenance"):
            if getattr(self, f"{kind}_workers") < 1 or getattr(self, f"{kind}_queue") < 0:
                raise ConfigError(f"{kind}_workers must be at least 1 and {kind}_queue at least 0")
        if not 3 <= self.task_lease_seconds <= 3600:
            raise ConfigError("task_lease_seconds must be between 3 and 3600")
        if not 0.01 <= self.event_poll_seconds <= 60:
            raise ConfigError("event_poll_seconds must be between 0.01 and 60")
        if not 1 <= self.offer_seconds <= 86400:
            raise ConfigError("offer_seconds must be between 1 and 86400 (a day)")
        self.module_policy_overrides()

    def module_policy_overrides(self) -> dict[str, dict[str, int | float]]:
        """`module_policies` as module id -> {budget: value}. Raises ConfigError naming the
        entry for a malformed one, an unknown budget or a value out of range."""
        found: dict[str, dict[str, int | float]] = {}
        for index, entry in enumerate(self.module_policies):
            module_id, at, assignment = entry.strip().partition("@")
            budget, equals, raw = assignment.partition("=")
            budget = budget.strip()
            if not at or not equals or ":" not in module_id or not budget:
                raise ConfigError(
                    f"module_policies[{index}] must look like module@budget=value "
                    f"(system:chat@model_calls=2), got {entry!r}"
                )
            if budget not in OVERRIDABLE_BUDGETS:
                raise ConfigError(
                    f"module_policies[{index}]: {budget!r} is not a budget; use one of "
                    f"{', '.join(OVERRIDABLE_BUDGETS)}"
                )
            try:
                value: int | float = float(raw) if budget.endswith("seconds") else int(raw)
            except ValueError:
                raise ConfigError(
                    f"module_policies[{index}]: {budget} must be a number, got {raw!r}"
                ) from None
            least = 1 if budget in ("rounds", "steps") else 0
            if value < least or (budget.endswith("seconds") and not 0 < value < 86400):
                raise ConfigError(
                    f"module_policies[{index}]: {budget} must be at least {least} (seconds: "
                    f"positive, under a day), got {raw!r}"
                )
            found.setdefault(module_id.strip(), {})[budget] = value
        return found
