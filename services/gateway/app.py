"""Assembles the gateway."""

from __future__ import annotations

from system.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from system.relay.v1 import relay_pb2, relay_pb2_grpc

from services.gateway.card_books import CardBookStore
from services.gateway.config import GatewayConfig
from services.gateway.connection import ConnectionRegistry
from services.gateway.players import PlayerRequests
from services.gateway.presence import PresenceReporter
from services.gateway.relay import ToolRelayServicer
from services.gateway.servicer import GatewayServicer
from services.runtime.security import AccessPolicy, ServerTls
from services.runtime.server import PublicPort, ServiceHost

__all__ = ["GatewayApp", "create_app"]

PUBLIC_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GameGatewayService"].full_name
RELAY_SERVICE = relay_pb2.DESCRIPTOR.services_by_name["ToolRelayService"].full_name
SERVICE_NAMES = [PUBLIC_SERVICE, RELAY_SERVICE]

ACCESS = AccessPolicy(
    {RELAY_SERVICE: ["engine"], f"{RELAY_SERVICE}/NotifyPlayer": ["engine", "model"]}
)
"""Who may call the internal port: engine replicas relay game-tool calls and notices; the model
gateway only notices (budget alerts to administrators, NotifyPlayer with min_permission_level)."""


class GatewayApp:
    """The running gateway and what it owns."""

    def __init__(self, config: GatewayConfig) -> None:
        # The cards each player was shown, in storage, so that a press on a card this
        # replica sent is checked on another one after a failover (decision 0030).
        self.card_books = CardBookStore(config.storage_target, config.channel_settings())
        self.connections = ConnectionRegistry(self.card_books)
        self.players = PlayerRequests(
            config.router_target,
            config.engine_target,
            config.storage_target,
            config.channel_settings(),
            config.default_mode(),
        )
        # Which players this replica holds, in storage, so that engine replicas send their
        # tool calls and notices here (decision 0023).
        self.presence = PresenceReporter(
            config.storage_target,
            config.new_replica_id(),
            config.presence_lease_seconds,
            lambda: self._internal_address(config),
            config.channel_settings(),
        )
        gateway = GatewayServicer(config, self.connections, self.players, self.presence)
        relay = ToolRelayServicer(config, self.connections, self.players.forget)
        # Two servers: game servers reach the public port, which carries their contract alone;
        # the relay lives on the internal port, behind service credentials.
        public = PublicPort(
            config.port,
            [
                lambda server: gateway_pb2_grpc.add_GameGatewayServiceServicer_to_server(
                    gateway, server
                )
            ],
            [PUBLIC_SERVICE],
            tls=(
                ServerTls(config.public_tls_cert_file, config.public_tls_key_file)
                if config.public_tls_cert_file
                else None
            ),
            reflection=config.public_reflection,
        )
        self.host = ServiceHost(
            "gateway",
            config,
            [lambda server: relay_pb2_grpc.add_ToolRelayServiceServicer_to_server(relay, server)],
            [RELAY_SERVICE],
            access=ACCESS,
            public=public,
            internal_port=config.internal_port,
        )

    def _internal_address(self, config: GatewayConfig) -> str:
        """Where other services reach the internal port; "" until it is bound (port 0)."""
        port = config.internal_port or self.host.internal_port
        return config.advertised_address(port) if port else ""

    async def aclose(self) -> None:
        await self.card_books.aclose()
        await self.presence.aclose()
        await self.players.aclose()


async def create_app(config: GatewayConfig) -> GatewayApp:
    app = GatewayApp(config)
    app.presence.start()
    app.card_books.start()
    return app
