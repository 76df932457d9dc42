"""The server host every service runs in: a grpc.aio server with our interceptor, health,
reflection and Prometheus metrics, started on a port (0 for any) and stopped gracefully.

Every service's port is internal: calls need a service credential its access policy allows
(services.runtime.security), over TLS or mutual TLS when configured. The gateway adds a public
port (`PublicPort`) carrying only the game servers' contract, as a separate grpc server so that
no internal service is reachable there. Both keep the keepalive policy of
services.runtime.keepalive.

The internal port closes every client connection once it is `max_connection_age_seconds` old
(after a GOAWAY, calls open on it get `max_connection_age_grace_seconds` to finish), so that
clients connect again: those balancing round robin over a `dns:///` target's addresses
(services.runtime.channels) resolve it anew and spread over replicas started after them, and
those dialling a virtual IP land on another replica. The public port never does: each game
server holds one Connect stream there for as long as it runs.

Shutdown order on SIGTERM/SIGINT: health flips to NOT_SERVING (so load balancers and probes
stop sending work), the host waits `drain_seconds`, then the server stops accepting and gives
running calls `grace_seconds` to finish.

With `workers > 1` each of the forked workers (`workers.py`) runs one ServiceHost; they bind
the same port with `SO_REUSEPORT`, which stays off otherwise so that a second server on a
taken port fails instead of silently sharing it.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from services.runtime.security import (
    ANY_CALLER,
    AccessPolicy,
    CallerBook,
    CallGuard,
    ServerTls,
    is_loopback,
    parse_caller_tokens,
)

__all__ = ["PublicPort", "ServiceHost", "write_port_file"]

log = logging.getLogger("system.server")

Registrar = Callable[[grpc.aio.Server], None]


@dataclasses.dataclass(frozen=True)
class PublicPort:
    """A second port, for services open to callers without a service credential (the
    gateway's game servers, who authenticate in the service itself)."""

    port: int
    """Port to listen on, on the service's `host`; 0 picks a free one."""
    registrars: Sequence[Registrar]
    """Functions that add the public servicers to its server."""
    service_names: Sequence[str]
    """Full names of the services registered there (health, and reflection when on)."""
    tls: ServerTls | None = None
    """Serve TLS with this certificate; None: plaintext."""
    reflection: bool = False
    """Offer server reflection there too (off: the public port lists nothing)."""


class _Listener:
    """One grpc.aio server on one port. Every port of a host answers health checks for all the
    host's services: Kubernetes' native gRPC probes speak no TLS, so they must be able to use
    whichever port is plaintext."""

    def __init__(
        self,
        options: list[tuple[str, Any]],
        guard: CallGuard | None,
        registrars: Sequence[Registrar],
        service_names: Sequence[str],
        reflection_on: bool,
        health_servicer: health.aio.HealthServicer,
    ) -> None:
        self.service_names = list(service_names)
        self.health = health_servicer
        self.server = grpc.aio.server(interceptors=[ServerInterceptor(guard)], options=options)
        for register in registrars:
            register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflection_on:
            reflection.enable_server_reflection(
                [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
            )
        self.port = 0

    def bind(self, name: str, address: str, tls: ServerTls | None) -> int:
        try:
            if tls is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, tls.credentials())
        except RuntimeError as exc:
            raise OSError(f"{name}: cannot listen on {address}: {exc}") from None
        if self.port == 0:
            raise OSError(f"{name}: cannot listen on {address} (is the port in use?)")
        return self.port


class ServiceHost:
    """Runs one service's servicers: on its internal port, where every call needs a service
    credential that `access` allows (services.runtime.security), and, for the gateway, on a
    public port as well.

    Args:
        name: service name for logs (`router`).
        config: the service's settings.
        registrars: functions that add the internal servicers to the server.
        service_names: full names of the internal services (for health and reflection).
        access: which callers may call which methods; None: any authenticated caller.
        public: a public port beside the internal one; `config.port` is then the public
            port and `internal_port` the internal one.
        internal_port: the internal port when `public` is set (0: a free one).
    """

    def __init__(
        self,
        name: str,
        config: ServerConfig,
        registrars: Sequence[Registrar],
        service_names: Sequence[str],
        *,
        access: AccessPolicy | None = None,
        public: PublicPort | None = None,
        internal_port: int = 0,
    ) -> None:
        self.name = name
        self.config = config
        self.service_names = list(service_names)
        options: list[tuple[str, Any]] = [
            # Only workers share a port; otherwise a second server must fail to bind.
            ("grpc.so_reuseport", 1 if config.workers > 1 else 0),
            ("grpc.max_receive_message_length", 4 * 1024 * 1024),
            *config.keepalive().server_options(),
        ]
        tokens = parse_caller_tokens(config.caller_tokens)
        self.guard = CallGuard(
            CallerBook(
                tokens,
                tokens_file=config.caller_tokens_file,
                mutual_tls=bool(config.tls_client_ca_file),
                open_locally=is_loopback(config.host) or config.allow_unauthenticated,
            ),
            access or AccessPolicy({name: [ANY_CALLER] for name in service_names}),
        )
        self.internal_tls = (
            ServerTls(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
            if config.tls_cert_file
            else None
        )
        self.health = health.aio.HealthServicer()
        internal_options = list(options)
        # Internal port only: a GOAWAY on the public port would end game servers' streams.
        if config.max_connection_age_seconds:
            internal_options += [
                ("grpc.max_connection_age_ms", int(config.max_connection_age_seconds * 1000)),
                (
                    "grpc.max_connection_age_grace_ms",
                    int(config.max_connection_age_grace_seconds * 1000),
                ),
            ]
        self._internal = _Listener(
            internal_options, self.guard, registrars, service_names, True, self.health
        )
        self._public: _Listener | None = None
        self.public = public
        if public is not None:
            self._public = _Listener(
                options,
                None,
                public.registrars,
                public.service_names,
                public.reflection,
                self.health,
            )
            self.service_names += list(public.service_names)
        self._internal_port_setting = internal_port if public is not None else config.port
        self.server = self._internal.server
        self.port = 0
        """The bound port of `config.port`: the public port when there is one."""
        self.internal_port = 0
        """The bound internal port."""
        self.metrics_port = -1
        self._metrics_server: object | None = None
        self._stopping = asyncio.Event()
        self._stopped = False

    @property
    def _dial_host(self) -> str:
        host = self.config.host
        return "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host

    @property
    def target(self) -> str:
        """`host:port` of `config.port` that clients on this machine can dial."""
        return f"{self._dial_host}:{self.port}"

    def _listeners(self) -> list[_Listener]:
        return [self._internal] + ([self._public] if self._public is not None else [])

    async def start(self) -> int:
        """Binds, starts serving and marks every service SERVING. Returns the bound port of
        `config.port`."""
        host = self.config.host
        self.internal_port = self._internal.bind(
            self.name, f"{host}:{self._internal_port_setting}", self.internal_tls
        )
        self.port = self.internal_port
        if self._public is not None and self.public is not None:
            self.port = self._public.bind(self.name, f"{host}:{self.config.port}", self.public.tls)
        for listener in self._listeners():
            await listener.server.start()
        if self.config.metrics_port >= 0:
            self._metrics_server, self.metrics_port = start_metrics_server(
                self.config.host, self.config.metrics_port
            )
        for service in ["", *self.service_names]:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.config.port_file:
            write_port_file(
                Path(self.config.port_file),
                {
                    "grpc_port": self.port,
                    "internal_port": self.internal_port,
                    "metrics_port": self.metrics_port,
                    "pid": os.getpid(),
                },
            )
        log.info(
            "%s serving on %s:%d",
            self.name,
            self.config.host,
            self.port,
            extra={
                "grpc_port": self.port,
                "internal_port": self.internal_port,
                "metrics_port": self.metrics_port,
                "internal_tls": self.internal_tls is not None,
                "public_tls": bool(self.public and self.public.tls),
            },
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
        await asyncio.gather(
            *(listener.server.stop(self.config.grace_seconds) for listener in self._listeners())
        )
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
