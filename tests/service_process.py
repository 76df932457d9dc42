"""A service as a child process (`python -m <package>`) on a fixed port, for fault tests that
kill -9 it and start it again on the address other services already dial."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.stack.launcher import free_port
from tests.waiting import wait_until

__all__ = ["ServiceProcess", "free_port"]

ROOT = Path(__file__).resolve().parent.parent


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
        self._prefix = env_prefix
        self._settings = settings

    def _env(self) -> dict[str, str]:
        """Built at each start, so a process given another port (say, a restart taking over
        the port of the one it replaces) listens there."""
        p = self._prefix
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gen")]),
            f"{p}HOST": "127.0.0.1",
            f"{p}PORT": str(self.port),
            f"{p}METRICS_PORT": "-1",
            f"{p}DRAIN_SECONDS": "0",
            f"{p}GRACE_SECONDS": "1",
            **{f"{p}{key}": value for key, value in self._settings.items()},
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
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        process = self.process
        # Loopback: never through a proxy the environment may name.
        options = [("grpc.enable_http_proxy", 0)]
        async with grpc.aio.insecure_channel(self.target, options=options) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def serving() -> bool:
                if process.poll() is not None:
                    raise AssertionError(
                        f"{self.package} exited with {process.returncode}:\n{self.log_tail()}"
                    )
                try:
                    response = await health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                except grpc.aio.AioRpcError:
                    return False
                return response.status == health_pb2.HealthCheckResponse.SERVING

            await wait_until(
                serving,
                timeout,
                interval=0.05,
                what=lambda: f"{self.package} to serve:\n{self.log_tail()}",
            )

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
