"""Assembles the gateway."""

from __future__ import annotations

from system.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from system.relay.v1 import relay_pb2, relay_pb2_grpc

from services.gateway.config import GatewayConfig
from services.gateway.connection import ConnectionRegistry
from services.gateway.players import PlayerRequests
from services.gateway.relay import ToolRelayServicer
from services.gateway.servicer import GatewayServicer
from services.runtime.server import ServiceHost

__all__ = ["GatewayApp", "create_app"]

SERVICE_NAMES = [
    gateway_pb2.DESCRIPTOR.services_by_name["GameGatewayService"].full_name,
    relay_pb2.DESCRIPTOR.services_by_name["ToolRelayService"].full_name,
]


class GatewayApp:
    """The running gateway and what it owns."""

    def __init__(self, config: GatewayConfig) -> None:
        self.connections = ConnectionRegistry()
        self.players = PlayerRequests(
            config.router_target, config.engine_target, config.storage_target
        )
        gateway = GatewayServicer(config, self.connections, self.players)
        relay = ToolRelayServicer(config, self.connections)
        self.host = ServiceHost(
            "gateway",
            config,
            [
                lambda server: gateway_pb2_grpc.add_GameGatewayServiceServicer_to_server(
                    gateway, server
                ),
                lambda server: relay_pb2_grpc.add_ToolRelayServiceServicer_to_server(relay, server),
            ],
            SERVICE_NAMES,
        )

    async def aclose(self) -> None:
        await self.players.aclose()


async def create_app(config: GatewayConfig) -> GatewayApp:
    return GatewayApp(config)
