"""Gateway settings."""

from __future__ import annotations

import dataclasses

from services.runtime.config import ConfigError, ServerConfig

ENV_PREFIX = "SYSTEM_GATEWAY_"
PROTOCOL_VERSION = 1
"""The game-server protocol version this gateway speaks."""


@dataclasses.dataclass(frozen=True)
class GatewayConfig(ServerConfig):
    """Settings of the gateway (env prefix `SYSTEM_GATEWAY_`)."""

    port: int = 50051
    metrics_port: int = 9101
    router_target: str = "127.0.0.1:50052"
    """`host:port` of the router."""
    engine_target: str = "127.0.0.1:50053"
    """`host:port` of the engine."""
    storage_target: str = "127.0.0.1:50055"
    """`host:port` of the storage service (history and preferences controls)."""
    tokens: tuple[str, ...] = ()
    """Game-server credentials as `server_id=token` pairs (env: comma-separated). Secret."""
    max_text_chars: int = 240
    """Longest chat text accepted from a player."""
    request_timeout_seconds: float = 120.0
    """Deadline of one player request across router, engine and storage."""
    max_players_per_connection: int = 1000
    """Players one game server may have joined at once."""
    max_pending_requests: int = 256
    """Player requests in progress per connection; more are refused with RESOURCE_EXHAUSTED."""
    tool_call_timeout_seconds: float = 10.0
    """Longest a game-tool call may wait for the game server when the caller sets no deadline."""

    def validate(self) -> None:
        super().validate()
        for name in ("router_target", "engine_target", "storage_target"):
            if not getattr(self, name):
                raise ConfigError(f"{name} is required (host:port)")
        if not self.tokens:
            raise ConfigError(
                "tokens is empty: no game server could connect; set SYSTEM_GATEWAY_TOKENS=server_id=token"
            )
        self.token_book()
        for name in ("max_text_chars", "max_players_per_connection", "max_pending_requests"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.request_timeout_seconds <= 0 or self.tool_call_timeout_seconds <= 0:
            raise ConfigError(
                "request_timeout_seconds and tool_call_timeout_seconds must be positive"
            )

    def token_book(self) -> dict[str, str]:
        """Token → server id. Raises ConfigError for malformed or duplicate entries."""
        book: dict[str, str] = {}
        servers: set[str] = set()
        for index, pair in enumerate(self.tokens):
            server_id, sep, token = pair.partition("=")
            server_id, token = server_id.strip(), token.strip()
            if not sep or not server_id or not token:
                raise ConfigError(f"tokens[{index}] must look like server_id=token")
            if len(token) < 8:
                raise ConfigError(
                    f"tokens[{index}]: the token for {server_id} is shorter than 8 characters"
                )
            if token in book or server_id in servers:
                raise ConfigError(f"tokens[{index}]: server {server_id} or its token appears twice")
            book[token] = server_id
            servers.add(server_id)
        return book
