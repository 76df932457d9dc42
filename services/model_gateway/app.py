"""Assembles the model gateway: provider, servicer, host."""

from __future__ import annotations

import logging

from system.model.v1 import model_pb2, model_pb2_grpc

from services.model_gateway.config import ModelConfig
from services.model_gateway.provider import ChatProvider
from services.model_gateway.servicer import ModelGatewayServicer
from services.runtime.server import ServiceHost

__all__ = ["ModelApp", "create_app"]

SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["ModelGatewayService"].full_name

log = logging.getLogger("system.model")


class ModelApp:
    """The running model gateway and what it owns."""

    def __init__(self, config: ModelConfig) -> None:
        self.provider = ChatProvider(config)
        servicer = ModelGatewayServicer(self.provider)
        self.host = ServiceHost(
            "model-gateway",
            config,
            [
                lambda server: model_pb2_grpc.add_ModelGatewayServiceServicer_to_server(
                    servicer, server
                )
            ],
            [SERVICE_NAME],
        )
        if not config.configured:
            log.warning(
                "no API key (SYSTEM_MODEL_API_KEY or SYSTEM_MODEL_API_KEY_FILE); Complete answers "
                "UNAVAILABLE and callers fall back to local routing"
            )

    async def aclose(self) -> None:
        await self.provider.aclose()


async def create_app(config: ModelConfig) -> ModelApp:
    return ModelApp(config)
