"""The server host every service runs in: a grpc.aio server with our interceptor, health,
reflection and Prometheus metrics, started on a port (0 for any) and stopped gracefully.

Shutdown order on SIGTERM/SIGINT: health flips to NOT_SERVING (so load balancers and probes
stop sending work), the host waits `drain_seconds`, then the server stops accepting and gives
running calls `grace_seconds` to finish.

With `workers > 1` each of the forked workers (`workers.py`) runs one ServiceHost; they bind
the same port with `SO_REUSEPORT`, which stays off otherwise so that a second server on a
taken port fails instead of silently sharing it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.runtime.config import ServerConfig
from services.runtime.interceptors import ServerInterceptor
from services.runtime.metrics import start_metrics_server

__all__ = ["ServiceHost", "write_port_file"]

log = logging.getLogger("system.server")

Registrar = Callable[[grpc.aio.Server], None]


class ServiceHost:
    """Runs one service's servicers.

    Args:
        name: service name for logs (`router`).
        config: the service's settings.
        registrars: functions that add servicers to the server.
        service_names: full names of the services registered (for health and reflection).
    """

    def __init__(
        self,
        name: str,
        config: ServerConfig,
        registrars: Sequence[Registrar],
        service_names: Sequence[str],
    ) -> None:
        self.name = name
        self.config = config
        self.service_names = list(service_names)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(
            interceptors=[ServerInterceptor()],
            options=[
                # Only workers share a port; otherwise a second server must fail to bind.
                ("grpc.so_reuseport", 1 if config.workers > 1 else 0),
                ("grpc.max_receive_message_length", 4 * 1024 * 1024),
            ],
        )
        for register in registrars:
            register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0
        self.metrics_port = -1
        self._metrics_server: object | None = None
        self._stopping = asyncio.Event()
        self._stopped = False

    @property
    def target(self) -> str:
        """`host:port` that clients on this machine can dial."""
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "[::]") else self.config.host
        return f"{host}:{self.port}"

    async def start(self) -> int:
        """Binds, starts serving and marks every service SERVING. Returns the bound port."""
        address = f"{self.config.host}:{self.config.port}"
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"{self.name}: cannot listen on {address}: {exc}") from None
        if self.port == 0:
            raise OSError(f"{self.name}: cannot listen on {address} (is the port in use?)")
        await self.server.start()
        if self.config.metrics_port >= 0:
            self._metrics_server, self.metrics_port = start_metrics_server(
                self.config.host, self.config.metrics_port
            )
        for service in ["", *self.service_names]:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.config.port_file:
            write_port_file(
                Path(self.config.port_file),
                {"grpc_port": self.port, "metrics_port": self.metrics_port, "pid": os.getpid()},
            )
        log.info(
            "%s serving on %s:%d",
            self.name,
            self.config.host,
            self.port,
            extra={"grpc_port": self.port, "metrics_port": self.metrics_port},
        )
        return self.port

    async def stop(self) -> None:
        """Drains and stops. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        log.info("%s shutting down", self.name)
        await self.health.enter_graceful_shutdown()
        if self.config.drain_seconds:
            await asyncio.sleep(self.config.drain_seconds)
        await self.server.stop(self.config.grace_seconds)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()  # type: ignore[attr-defined]
            self._metrics_server.server_close()  # type: ignore[attr-defined]  # frees the port
        if self.config.port_file:
            Path(self.config.port_file).unlink(missing_ok=True)
        log.info("%s stopped", self.name)

    def request_stop(self) -> None:
        """Asks `serve_until_signalled` to shut down (what SIGTERM does)."""
        self._stopping.set()

    async def serve_until_signalled(self) -> None:
        """Serves until SIGTERM or SIGINT, then stops gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self._stopping.wait()
        await self.stop()


def write_port_file(path: Path, content: dict[str, Any]) -> None:
    """Writes `content` as JSON to `path` (the `port_file` setting), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(content))
    tmp.replace(path)  # atomic: readers never see half a file
