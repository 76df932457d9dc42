"""Gateway settings."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import uuid

from system.common.v1 import common_pb2

from services.gateway.tokens import merged_book, read_tokens_file
from services.modes import MODES, mode_by_name
from services.runtime.config import ConfigError, ServerConfig

ENV_PREFIX = "SYSTEM_GATEWAY_"
PROTOCOL_VERSION = 1
"""The game-server protocol version this gateway speaks."""
SCOPE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,27}")
"""A player scope's name (decision 0012)."""


@dataclasses.dataclass(frozen=True)
class GatewayConfig(ServerConfig):
    """Settings of the gateway (env prefix `SYSTEM_GATEWAY_`)."""

    port: int = 50051
    """The public port: game servers' Connect stream (system.gateway.v1) and health, nothing
    else. Only this port should be reachable from outside the cluster."""
    metrics_port: int = 9101
    internal_port: int = 50056
    """The internal port: the engine's tool relay (system.relay.v1), health and reflection;
    every call needs a service credential (`caller_tokens` or mutual TLS)."""
    internal_advertise: str = ""
    """Where other services (engine replicas) reach this replica's internal port, recorded in
    storage with the players it holds (decision 0023): `host:port`, or a host alone (an IPv4
    or IPv6 address or a name), which gets `internal_port`. In Kubernetes the pod's IP
    (deploy/kubernetes/base/gateway.yaml sets it from the downward API). Empty:
    `127.0.0.1:<internal port>`, for one machine."""
    replica_name: str = ""
    """Names this replica in storage's presence rows and in logs: `<replica_name>-<random>`,
    new at every start (a restarted gateway holds none of its earlier connections). Empty:
    the host name (the pod's name in Kubernetes). At most 48 printable characters."""
    presence_lease_seconds: int = 15
    """Lease of this replica's presence in storage, renewed every third of it. When a replica
    dies, tool calls and notices for its players fail at most this long before the engine
    sees them gone (they are offline until their game server reconnects anywhere)."""
    public_tls_cert_file: str = ""
    """PEM certificate chain the public port serves TLS with; reloaded when the file changes.
    Empty: plaintext (loopback development only; game-server tokens would cross in clear)."""
    public_tls_key_file: str = ""
    """PEM private key of `public_tls_cert_file`."""
    public_reflection: bool = False
    """Offer server reflection on the public port too."""
    router_target: str = "127.0.0.1:50052"
    """`host:port` of the router."""
    engine_target: str = "127.0.0.1:50053"
    """`host:port` of the engine."""
    storage_target: str = "127.0.0.1:50055"
    """`host:port` of the storage service (history and preferences controls)."""
    tokens: tuple[str, ...] = ()
    """Game-server credentials as `server_id=token` pairs (env: comma-separated). Secret."""
    tokens_file: str = ""
    """A file of more `server_id=token` lines (a mounted Secret), read again when it changes:
    tokens rotate without a restart (services.gateway.tokens)."""
    max_text_chars: int = 240
    """Longest chat text accepted from a player."""
    request_timeout_seconds: float = 120.0
    """Deadline of one player request across router, engine and storage."""
    max_players_per_connection: int = 1000
    """Players one game server may have joined at once."""
    max_pending_requests: int = 256
    """Player requests in progress per connection; more are refused with RESOURCE_EXHAUSTED."""
    max_pending_requests_total: int = 2048
    """Player requests in progress on all connections together; more are refused with
    RESOURCE_EXHAUSTED before routing, so a few busy game servers cannot queue work without
    bound (the engine's own queues answer BUSY further on)."""
    tool_call_timeout_seconds: float = 10.0
    """Longest a game-tool call may wait for the game server when the caller sets no deadline."""
    networks: tuple[str, ...] = ()
    """Game servers that share their players (a proxy network: lobby, survival, ...), as
    `network=server_a+server_b` entries (env: comma-separated). Within a network a player is one
    player, attached to one server's connection at a time; a server in no network keeps its
    players to itself (decision 0012). Network names and the ids of servers in no network are
    player scopes: 1..27 of `A-Z a-z 0-9 _ . -`."""
    hello_timeout_seconds: float = 10.0
    """How long a new Connect stream may take to send its hello; then it ends DEADLINE_EXCEEDED."""
    outbox_frames: int = 1024
    """Frames waiting to be written to one game server. Beyond it, the oldest waiting notice is
    dropped for a newer frame; when no notice is left to drop, the stream ends
    RESOURCE_EXHAUSTED (the game server is not reading)."""
    outbox_bytes: int = 16 * 1024 * 1024
    """Bytes waiting to be written to one game server; the same policy as `outbox_frames`."""
    conversation_mode: str = "standard"
    """The server's default conversation mode, for players who chose none: `offline` (never a
    model call), `standard`, `extended` or `free` (see system.common.v1.ConversationMode)."""

    def validate(self) -> None:
        super().validate()
        for name in ("router_target", "engine_target", "storage_target"):
            if not getattr(self, name):
                raise ConfigError(f"{name} is required (host:port)")
        if not self.token_book():
            raise ConfigError(
                "no game-server token is set: no game server could connect; set "
                "SYSTEM_GATEWAY_TOKENS=server_id=token or tokens_file"
            )
        if not 0 <= self.internal_port <= 65535:
            raise ConfigError(f"internal_port must be 0..65535, got {self.internal_port}")
        if self.internal_port and self.internal_port == self.port:
            raise ConfigError("internal_port must differ from port (the public port)")
        if bool(self.public_tls_cert_file) != bool(self.public_tls_key_file):
            raise ConfigError(
                "public_tls_cert_file and public_tls_key_file go together: set both or neither"
            )
        for name in ("public_tls_cert_file", "public_tls_key_file"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"{name}: {path} does not exist")
        self.player_scopes()
        self.default_mode()
        if self.workers > 1:
            raise ConfigError(
                "workers must be 1 for the gateway: each worker would hold its own game "
                "servers behind one internal address; run more replicas instead"
            )
        if self.internal_advertise:
            self.advertised_address(self.internal_port or 1)
        if len(self.replica_name) > 48 or not self.replica_name.isprintable():
            raise ConfigError("replica_name must be at most 48 printable characters")
        if not 3 <= self.presence_lease_seconds <= 3600:
            raise ConfigError(
                f"presence_lease_seconds must be between 3 and 3600, got {self.presence_lease_seconds}"
            )
        if self.hello_timeout_seconds <= 0:
            raise ConfigError(
                f"hello_timeout_seconds must be positive, got {self.hello_timeout_seconds}"
            )
        for name in (
            "max_text_chars",
            "max_players_per_connection",
            "max_pending_requests",
            "max_pending_requests_total",
            "outbox_frames",
            "outbox_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.request_timeout_seconds <= 0 or self.tool_call_timeout_seconds <= 0:
            raise ConfigError(
                "request_timeout_seconds and tool_call_timeout_seconds must be positive"
            )

    def advertised_address(self, internal_port: int) -> str:
        """The `host:port` recorded for this replica's internal port, bound at
        `internal_port`. Raises ConfigError for a malformed `internal_advertise`."""
        value = self.internal_advertise.strip()
        if not value:
            return f"127.0.0.1:{internal_port}"
        if value.count(":") > 1 and not value.startswith("["):
            value = f"[{value}]"  # a bare IPv6 address: the host alone
        host, sep, port = value.rpartition(":")
        if not sep or host.endswith(":") or (value.startswith("[") and not host.endswith("]")):
            host, port = value, str(internal_port)
        if not host or " " in host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(
                "internal_advertise must be host:port or a host alone (this replica's internal "
                f"port as other services dial it), got {self.internal_advertise!r}"
            )
        return f"{host}:{port}"

    def new_replica_id(self) -> str:
        """A replica id for this start: `replica_name` (or the host name) and a random part."""
        name = (self.replica_name or socket.gethostname() or "gateway")[:48]
        return f"{name}-{uuid.uuid4().hex[:12]}"

    def default_mode(self) -> common_pb2.ConversationMode:
        """`conversation_mode` as the enum; raises ConfigError for an unknown name."""
        mode = mode_by_name(self.conversation_mode)
        if mode is None:
            raise ConfigError(
                f"conversation_mode must be one of {', '.join(MODES)}; "
                f"got {self.conversation_mode!r}"
            )
        return mode

    def player_scopes(self) -> dict[str, str]:
        """Server id → the scope its players belong to: its network's name, or its own id.
        Raises ConfigError for a malformed `networks` entry, a server in two networks or
        without a token, a network name that is also a server id, or a scope name that is
        not 1..27 of `A-Z a-z 0-9 _ . -` (a scoped player id must fit storage's 64
        characters with a 36-character UUID; see decision 0012)."""
        servers = set(self.token_book().values())
        scopes = {server: server for server in servers}
        named: set[str] = set()
        for index, entry in enumerate(self.networks):
            network, sep, members = entry.partition("=")
            network = network.strip()
            names = [m.strip() for m in members.split("+")]
            if not sep or not network or not all(names):
                raise ConfigError(
                    f"networks[{index}] must look like network=server_a+server_b, got {entry!r}"
                )
            if network in named:
                raise ConfigError(f"networks[{index}]: network {network} is named twice")
            if network in servers:
                raise ConfigError(
                    f"networks[{index}]: {network} is a server id too; give the network a "
                    "name of its own"
                )
            named.add(network)
            for member in names:
                if member not in servers:
                    raise ConfigError(
                        f"networks[{index}]: server {member} of network {network} has no token"
                    )
                if scopes[member] != member:
                    raise ConfigError(
                        f"networks[{index}]: server {member} is in networks {scopes[member]} "
                        f"and {network}; a server belongs to one network at most"
                    )
                scopes[member] = network
        for scope in set(scopes.values()):
            if not SCOPE_NAME.fullmatch(scope):
                raise ConfigError(
                    f"{scope!r} cannot scope players: a network name, or the id of a server "
                    "in no network, must be 1..27 of A-Z a-z 0-9 _ . -"
                )
        return scopes

    def token_book(self) -> dict[str, str]:
        """Token → server id, of `tokens` and `tokens_file` as they are now. Raises
        ConfigError for malformed or duplicate entries, or an unreadable file."""
        entries = read_tokens_file(self.tokens_file) if self.tokens_file else []
        return merged_book(self.tokens, entries)
