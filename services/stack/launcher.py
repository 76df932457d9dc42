"""Starts, health-checks and stops the five service processes."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.runtime.security import CALLERS

__all__ = ["SERVICES", "ServiceProcess", "Stack", "StackError"]

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class ServiceSpec:
    name: str
    module: str
    env_prefix: str
    default_port: int
    health_name: str


SERVICES = (
    ServiceSpec(
        "storage", "storage_service", "SYSTEM_STORAGE_", 50055, "system.storage.v1.StorageService"
    ),
    ServiceSpec(
        "model",
        "services.model_gateway",
        "SYSTEM_MODEL_",
        50054,
        "system.model.v1.ModelGatewayService",
    ),
    ServiceSpec(
        "engine", "engine_service", "SYSTEM_ENGINE_", 50053, "system.engine.v1.EngineService"
    ),
    ServiceSpec(
        "router", "router_service", "SYSTEM_ROUTER_", 50052, "system.router.v1.RouterService"
    ),
    ServiceSpec(
        "gateway",
        "services.gateway",
        "SYSTEM_GATEWAY_",
        50051,
        "system.gateway.v1.GameGatewayService",
    ),
)
"""Every service, in start order (dependencies first)."""

GATEWAY_INTERNAL_PORT = 50056
"""The gateway's internal (relay) port with `fixed_ports`."""


class StackError(RuntimeError):
    """A service did not start; the message holds the end of its log."""


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM it when the launcher dies, so a launcher
    killed with SIGKILL leaves no services behind. Elsewhere it does nothing."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_CHOSEN = 10000
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now, for a service started a little later. Chosen below the
    kernel's ephemeral range where it says what that is (Linux): a port from that range (what
    binding port 0 gives) may meanwhile become the local end of some outgoing connection, and
    the service then cannot listen on it. Never the same port twice in one process."""
    try:
        lowest_ephemeral = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        lowest_ephemeral = 0
    for _ in range(200 if lowest_ephemeral > _LOWEST_CHOSEN + 1000 else 0):
        port = random.randrange(_LOWEST_CHOSEN, lowest_ephemeral)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    _handed_out.add(port)
    return port


@dataclasses.dataclass
class ServiceProcess:
    spec: ServiceSpec
    port: int
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class Stack:
    """The five services as child processes.

    Args:
        data_dir: folder for the SQLite database, logs and port files.
        fixed_ports: use the default ports (50051-50055) instead of free ones.
        server_id / token: the credential the simulated game server uses.
        extra_env: more environment for every service.
        service_env: more environment for one service, by name (for example
            `{"model": {"SYSTEM_MODEL_API_KEY": ...}}`, so the key reaches that child only).
        drain_seconds: how long each service answers NOT_SERVING after SIGTERM before stopping.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        fixed_ports: bool = False,
        server_id: str = "sim",
        token: str | None = None,
        extra_env: dict[str, str] | None = None,
        service_env: dict[str, dict[str, str]] | None = None,
        drain_seconds: float = 0.2,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.server_id = server_id
        self.token = token or secrets.token_urlsafe(24)
        self.extra_env = extra_env or {}
        self.service_env = service_env or {}
        self.drain_seconds = drain_seconds
        self.ports = {
            spec.name: spec.default_port if fixed_ports else free_port() for spec in SERVICES
        }
        # The gateway's second port: the internal relay the engine calls (the first is public).
        self.ports["gateway_internal"] = GATEWAY_INTERNAL_PORT if fixed_ports else free_port()
        # Every internal port requires a service credential, as in production: one token per
        # caller, made for this run (services.runtime.security).
        self.service_tokens = {caller: secrets.token_urlsafe(24) for caller in CALLERS}
        self.processes: dict[str, ServiceProcess] = {}

    def target(self, name: str) -> str:
        """`host:port` of a service (`gateway_internal`: the gateway's relay port)."""
        return f"127.0.0.1:{self.ports[name]}"

    def credential(self, caller: str = "operator") -> tuple[tuple[str, str], ...]:
        """Metadata carrying `caller`'s service credential (operators may call everything)."""
        return (("authorization", f"Bearer {self.service_tokens[caller]}"),)

    def _env(self, spec: ServiceSpec) -> dict[str, str]:
        p = spec.env_prefix
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gen")]),
            f"{p}HOST": "127.0.0.1",
            f"{p}PORT": str(self.ports[spec.name]),
            f"{p}METRICS_PORT": "0",
            f"{p}DRAIN_SECONDS": str(self.drain_seconds),
            f"{p}GRACE_SECONDS": "2",
            f"{p}PORT_FILE": str(self.data_dir / "run" / f"{spec.name}.json"),
            f"{p}SERVICE_TOKEN": self.service_tokens[spec.name],
            f"{p}CALLER_TOKENS": ",".join(
                f"{caller}={token}" for caller, token in self.service_tokens.items()
            ),
        }
        targets = {
            "storage": {"DATABASE_URL": f"sqlite:///{self.data_dir / 'storage.db'}"},
            "model": {
                "STORAGE_TARGET": self.target("storage"),
                "RELAY_TARGET": self.target("gateway_internal"),  # budget alerts to admins
            },
            "engine": {
                "STORAGE_TARGET": self.target("storage"),
                "ROUTER_TARGET": self.target("router"),
                "GATEWAY_TARGET": self.target("gateway_internal"),
                "MODEL_TARGET": self.target("model"),
                # Documents admins add in game: /system knowledge-add FILE [player].
                "KNOWLEDGE_DIR": str(self.data_dir / "knowledge"),
            },
            "router": {
                "ENGINE_TARGET": self.target("engine"),
                "MODEL_TARGET": self.target("model"),
                # The shared exact intent cache (decision 0024).
                "STORAGE_TARGET": self.target("storage"),
                # Written with the defaults on the first start; edit it and /system reload.
                "SEMANTIC_CONFIG": str(self.data_dir / "config" / "system-semantic.json"),
                # A copy of the bundled notification-button phrasings, reloaded with it.
                "BUTTON_PHRASINGS": str(self.data_dir / "config" / "notification-buttons.json"),
            },
            "gateway": {
                "ROUTER_TARGET": self.target("router"),
                "ENGINE_TARGET": self.target("engine"),
                "STORAGE_TARGET": self.target("storage"),
                "TOKENS": f"{self.server_id}={self.token}",
                "INTERNAL_PORT": str(self.ports["gateway_internal"]),
            },
        }
        env.update({f"{p}{key}": value for key, value in targets.get(spec.name, {}).items()})
        env.update(self.extra_env)
        env.update(self.service_env.get(spec.name, {}))
        return env

    def _write_operator_file(self) -> None:
        """`run/operator.json`: where storage listens and this run's operator token, readable
        by this user alone, for operators' tools (`python -m storage_service.knowledge_cli
        --stack DIR`)."""
        path = self.data_dir / "run" / "operator.json"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            json.dump(
                {
                    "storage_target": self.target("storage"),
                    "token": self.service_tokens["operator"],
                },
                file,
            )

    def start(self, timeout: float = 30.0) -> float:
        """Starts every service and waits until all answer SERVING. Returns seconds taken.

        Raises:
            StackError: a service exited or did not become healthy in time.
        """
        started = time.perf_counter()
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.data_dir / "run").mkdir(parents=True, exist_ok=True)
        (self.data_dir / "knowledge").mkdir(parents=True, exist_ok=True)
        self._write_operator_file()
        # All start at once: channels connect lazily, so start order does not matter for
        # correctness, and parallel starts keep the stack's start-up short.
        for spec in SERVICES:
            log_path = self.data_dir / "logs" / f"{spec.name}.log"
            with log_path.open("ab") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", spec.module],
                    cwd=ROOT,
                    env=self._env(spec),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # Ctrl-C in the terminal reaches us, not them
                    preexec_fn=_die_with_parent,
                )
            self.processes[spec.name] = ServiceProcess(
                spec, self.ports[spec.name], log_path, process
            )
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return time.perf_counter() - started

    def health(self, name: str, timeout: float = 1.0) -> str:
        """The service's overall health status name, or UNREACHABLE."""
        proc = self.processes[name]
        # The gateway's internal port: its public one may serve TLS, and answers for the
        # same services.
        target = self.target("gateway_internal") if name == "gateway" else proc.target
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                # types-grpcio-health-checking declares HealthStub without its methods.
                response: health_pb2.HealthCheckResponse = stub.Check(  # type: ignore[attr-defined]
                    health_pb2.HealthCheckRequest(service=proc.spec.health_name), timeout=timeout
                )
            except grpc.RpcError:
                return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = set(self.processes)
        while waiting:
            for name in sorted(waiting):
                proc = self.processes[name]
                if proc.process.poll() is not None:
                    raise StackError(
                        f"{name} exited with code {proc.process.returncode}:\n{proc.log_tail()}"
                    )
                if self.health(name, timeout=0.5) == "SERVING":
                    waiting.discard(name)
            if waiting and time.monotonic() > deadline:
                details = "\n".join(
                    f"--- {n}\n{self.processes[n].log_tail()}" for n in sorted(waiting)
                )
                raise StackError(
                    f"not healthy after {timeout:.0f} s: {', '.join(sorted(waiting))}\n{details}"
                )
            if waiting:
                time.sleep(0.05)

    def metrics_port(self, name: str) -> int:
        """The bound metrics port, from the service's port file."""
        data = json.loads((self.data_dir / "run" / f"{name}.json").read_text())
        return int(data["metrics_port"])

    def stop(self, timeout: float = 10.0) -> dict[str, int | None]:
        """SIGTERM to every service (gateway first), then waits; kills what is left.
        Returns each service's exit code."""
        for spec in reversed(SERVICES):
            proc = self.processes.get(spec.name)
            if proc and proc.process.poll() is None:
                proc.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for name, proc in self.processes.items():
            try:
                codes[name] = proc.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.process.kill()
                codes[name] = proc.process.wait()
        return codes
