"""`workers = N`: N forked server processes on one port (services/runtime/workers.py).

Runs the real router as `python -m router_service` (standalone profiles, no engine) with two
workers, and checks what an operator relies on: one port file, both workers answering Route
and health on the shared port, a metrics endpoint each, a graceful stop of all on SIGTERM,
and a supervisor that stops everything when a worker dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from system.common.v1 import common_pb2
from system.router.v1 import router_pb2, router_pb2_grpc

from services.runtime.config import ConfigError, ServerConfig, load_config
from services.runtime.main import run_on_loop
from services.runtime.workers import worker_metrics_port
from tests.waiting import wait_until_sync

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT")


def _router(tmp_path: Path, **env: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    port_file = tmp_path / "router.json"
    full = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gen")]),
        "SYSTEM_ROUTER_PORT": "0",
        "SYSTEM_ROUTER_METRICS_PORT": "0",
        "SYSTEM_ROUTER_DRAIN_SECONDS": "0.2",
        "SYSTEM_ROUTER_PORT_FILE": str(port_file),
        "SYSTEM_ROUTER_PROFILES_FILE": str(ROOT / "router_service/corpus/profiles.json"),
        "SYSTEM_ROUTER_ENGINE_TARGET": "",
        "SYSTEM_ROUTER_MODEL_TARGET": "",
        "SYSTEM_ROUTER_LOG_LEVEL": "WARNING",
        **{f"SYSTEM_ROUTER_{k.upper()}": v for k, v in env.items()},
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "router_service"],
        cwd=ROOT,
        env=full,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )

    def started() -> bool:
        if process.poll() is not None:
            pytest.fail(_start_failure(process))
        return port_file.exists()

    wait_until_sync(started, timeout=60, interval=0.05, what=lambda: _start_failure(process))
    return process, json.loads(port_file.read_text())


def _start_failure(process: subprocess.Popen[bytes]) -> str:
    """Why the router did not start: its stderr, once it is killed (the wait failed)."""
    process.kill()
    _, err = process.communicate()
    return f"router did not start: {err.decode(errors='replace')[-2000:]}"


@pytest.fixture
def two_workers(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    process, info = _router(tmp_path, workers="2")
    try:
        yield process, info
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        for worker in info["workers"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker["pid"], signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _routes_handled(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith("grpc_server_handled_total") and 'grpc_method="Route"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_workers_share_the_port_and_each_serve(
    two_workers: tuple[subprocess.Popen[bytes], dict[str, Any]],
) -> None:
    process, info = two_workers
    workers = info["workers"]
    assert info["pid"] == process.pid
    assert len({w["pid"] for w in workers}) == 2
    assert len({w["metrics_port"] for w in workers}) == 2
    assert info["metrics_port"] == workers[0]["metrics_port"]
    request = router_pb2.RouteRequest(
        player=common_pb2.PlayerContext(player_id="p1", language="zh"), text="查看帮助"
    )
    connections = 16  # each its own TCP connection; the kernel spreads them over the workers
    for _ in range(connections):
        with grpc.insecure_channel(
            f"127.0.0.1:{info['grpc_port']}", options=[("grpc.use_local_subchannel_pool", 1)]
        ) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="system.router.v1.RouterService"), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            response = router_pb2_grpc.RouterServiceStub(channel).Route(request, timeout=10)
            assert response.source == router_pb2.DECISION_SOURCE_LOCAL
    counts = [_routes_handled(w["metrics_port"]) for w in workers]
    assert sum(counts) == connections
    assert all(c > 0 for c in counts), counts  # 1 in 2**15 that one worker got none


def test_sigterm_drains_every_worker_and_removes_the_port_file(
    two_workers: tuple[subprocess.Popen[bytes], dict[str, Any]], tmp_path: Path
) -> None:
    process, info = two_workers
    process.send_signal(signal.SIGTERM)
    assert process.wait(20) == 0
    assert not (tmp_path / "router.json").exists()
    assert not any(_alive(w["pid"]) for w in info["workers"])
    log = process.stderr.read().decode() if process.stderr else ""
    assert "Traceback" not in log


def test_a_dead_worker_stops_the_others_and_the_supervisor_fails(
    two_workers: tuple[subprocess.Popen[bytes], dict[str, Any]],
) -> None:
    process, info = two_workers
    os.kill(info["workers"][0]["pid"], signal.SIGKILL)
    assert process.wait(20) == 1
    assert not _alive(info["workers"][1]["pid"])


def test_a_port_in_use_fails_fast() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:  # another program's listener
        process = subprocess.run(
            [sys.executable, "-m", "router_service"],
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gen")]),
                "SYSTEM_ROUTER_WORKERS": "2",
                "SYSTEM_ROUTER_PORT": str(taken.getsockname()[1]),
                "SYSTEM_ROUTER_METRICS_PORT": "-1",
                "SYSTEM_ROUTER_PROFILES_FILE": str(ROOT / "router_service/corpus/profiles.json"),
                "SYSTEM_ROUTER_ENGINE_TARGET": "",
            },
            capture_output=True,
            timeout=60,
        )
    assert process.returncode == 1
    assert b"cannot listen on" in process.stderr


# -- settings --------------------------------------------------------------------------------


def test_workers_and_event_loop_settings_validate() -> None:
    config = load_config(
        ServerConfig,
        env_prefix="T_",
        environ={"T_WORKERS": "4", "T_EVENT_LOOP": "asyncio"},
    )
    assert (config.workers, config.event_loop) == (4, "asyncio")
    assert ServerConfig().workers == 1
    for env, message in (
        ({"T_WORKERS": "0"}, "workers must be 1..64"),
        ({"T_WORKERS": "65"}, "workers must be 1..64"),
        ({"T_WORKERS": "two"}, "setting 'workers' must be int"),
        ({"T_EVENT_LOOP": "trio"}, "event_loop must be asyncio or uvloop"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(ServerConfig, env_prefix="T_", environ=env)


def test_services_run_on_uvloop_by_default_where_it_is_installed() -> None:
    """Decision 0037: the default loop is uvloop (a locked dependency here), and run_on_loop,
    which serves every service, runs on the loop asked for."""
    pytest.importorskip("uvloop")
    assert ServerConfig().event_loop == "uvloop"

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_on_loop(loop_module()).startswith("uvloop")
    assert run_on_loop(loop_module(), "asyncio").startswith("asyncio")


def test_uvloop_setting_needs_the_package() -> None:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="needs the uvloop package"):
            load_config(ServerConfig, env_prefix="T_", environ={"T_EVENT_LOOP": "uvloop"})
    else:
        config = load_config(ServerConfig, env_prefix="T_", environ={"T_EVENT_LOOP": "uvloop"})
        assert config.event_loop == "uvloop"


def test_worker_metrics_ports() -> None:
    assert [worker_metrics_port(9102, i) for i in range(3)] == [9102, 9103, 9104]
    assert worker_metrics_port(0, 2) == 0  # each picks a free one
    assert worker_metrics_port(-1, 2) == -1  # off stays off
