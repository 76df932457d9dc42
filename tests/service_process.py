"""A service as a child process (`python -m <package>`) on a fixed port, for fault tests that
kill -9 it and start it again on the address other services already dial."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["ServiceProcess", "free_port"]

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ServiceProcess:
    """One service process.

    Args:
        package: the module run with `python -m` (`engine_service`).
        env_prefix: its settings' prefix (`SYSTEM_ENGINE_`).
        settings: settings without the prefix (`{"STORAGE_TARGET": ...}`).
        log_path: where its output goes (appended across restarts).
    """

    def __init__(
        self, package: str, env_prefix: str, settings: dict[str, str], log_path: Path
    ) -> None:
        self.package = package
        self.port = free_port()
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gen")]),
            f"{env_prefix}HOST": "127.0.0.1",
            f"{env_prefix}PORT": str(self.port),
            f"{env_prefix}METRICS_PORT": "-1",
            f"{env_prefix}DRAIN_SECONDS": "0",
            f"{env_prefix}GRACE_SECONDS": "1",
            **{f"{env_prefix}{key}": value for key, value in settings.items()},
        }

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, timeout: float = 30.0) -> None:
        """Starts the process and waits until its health check says SERVING."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.package],
                cwd=ROOT,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        async with grpc.aio.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.process.poll() is not None:
                    raise AssertionError(
                        f"{self.package} exited with {self.process.returncode}:\n{self.log_tail()}"
                    )
                try:
                    response = await health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{self.package} not serving after {timeout} s:\n{self.log_tail()}"
                    )
                await asyncio.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs; leases it held stay until they expire."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
