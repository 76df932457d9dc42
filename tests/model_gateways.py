"""Model gateways started in-process for tests, pointed at the local OpenAI-compatible test
server. A test module wraps `gateways` in its own `gateway` fixture with its defaults:

    @pytest.fixture
    async def gateway(fake):
        async with gateways(base_url=fake.base_url, api_key=KEY) as start:
            yield start

    stub = await gateway(max_attempts=1)   # overrides for this gateway only
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from system.model.v1 import model_pb2_grpc

from services.model_gateway.app import create_app
from services.model_gateway.config import ModelConfig

__all__ = ["Gateway", "Gateways", "gateways"]

Gateway = Callable[..., Awaitable[model_pb2_grpc.ModelGatewayServiceStub]]

_HOST = {"port": 0, "metrics_port": -1, "drain_seconds": 0, "grace_seconds": 1}


class Gateways:
    """`start(**overrides)` starts a gateway and returns a stub on it (see `gateways`)."""

    def __init__(self, defaults: dict[str, Any]) -> None:
        self._defaults = defaults
        self.started: list[tuple[Any, grpc.aio.Channel]] = []

    async def __call__(self, **overrides: Any) -> model_pb2_grpc.ModelGatewayServiceStub:
        config = ModelConfig(**{**_HOST, "storage_target": "", **self._defaults, **overrides})
        config.validate()
        app = await create_app(config)
        await app.host.start()
        channel = grpc.aio.insecure_channel(app.host.target)
        self.started.append((app, channel))
        return model_pb2_grpc.ModelGatewayServiceStub(channel)

    async def settled(self) -> None:
        """Waits for every gateway's background settles, so the recorded usage can be read."""
        for app, _ in self.started:
            await app.meter.drain()

    async def aclose(self) -> None:
        for app, channel in self.started:
            await channel.close()
            await app.host.stop()
            await app.aclose()


@contextlib.asynccontextmanager
async def gateways(**defaults: Any) -> AsyncIterator[Gateways]:
    """Yields a `Gateways` (call it with overrides to start one); every gateway started is
    stopped on exit. Metering is off (`storage_target` empty) unless a setting names a storage
    service."""
    started = Gateways(defaults)
    try:
        yield started
    finally:
        await started.aclose()
