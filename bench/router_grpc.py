"""Router throughput over gRPC: the router as its own process (a real engine process supplies
the catalogue), 64 calls in flight, Route against the health-check floor on the same server.

Each server setting (one process on asyncio, as shipped; N workers on uvloop) is driven by
each load generator (Python clients in 2 processes; h2load when installed), Route then
health Check, for a fixed time. Recorded per run: calls/s, latency, errors, the router's
CPU per call (every process of it), the generator's CPU per call, and the load average
before and after (other work on the machine shows there).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.cpu import cpu_seconds
from bench.loadgen import h2load_available, h2load_load, loadavg, python_load

__all__ = ["CLIENTS", "measure_grpc", "server_settings"]

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "router_service" / "corpus"
SEED = 4
CLIENTS = 64
H2LOAD_BODIES = 16  # one h2load process (and connection) per body, 4 streams each
ROUTE = "/system.router.v1.RouterService/Route"
HEALTH = "/grpc.health.v1.Health/Check"


def server_settings() -> list[tuple[str, dict[str, str]]]:
    """The router settings measured: as shipped, and the fastest this machine allows."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return [
        ("1 process, asyncio (shipped default)", {}),
        (f"2 workers, {loop}", {"WORKERS": "2", "EVENT_LOOP": loop}),
    ]


def _start(module: str, prefix: str, env: dict[str, str], run: Path) -> tuple[Any, dict[str, Any]]:
    name = module.split(".")[0]
    port_file = run / f"{name}.json"
    log = run / f"{name}.log"
    full = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gen")]),
        f"{prefix}HOST": "127.0.0.1",
        f"{prefix}PORT": "0",
        f"{prefix}METRICS_PORT": "-1",
        f"{prefix}DRAIN_SECONDS": "0",
        f"{prefix}PORT_FILE": str(port_file),
        **{f"{prefix}{k}": v for k, v in env.items()},
    }
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", module],
            cwd=ROOT,
            env=full,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 90
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(
                f"{module} did not start:\n{log.read_text(errors='replace')[-2000:]}"
            )
        time.sleep(0.05)
    return process, json.loads(port_file.read_text())


def _stop(process: Any) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def route_requests() -> list[Any]:
    """Commands, local paraphrases and unmatched texts from the corpus, in a fixed mix."""
    from system.common.v1 import common_pb2
    from system.router.v1 import router_pb2

    cases = [json.loads(line) for line in (CORPUS / "cases.jsonl").read_text().splitlines()]
    rng = random.Random(SEED)
    local = [c for c in cases if c["expected"] and c["category"] in ("plain", "paraphrase")]
    unmatched = [c for c in cases if c["expected"] is None and c["category"] == "out_of_scope"]
    commands = [("/help", "en"), ("help", "en"), ("帮助", "zh"), ("/system help", "en")]
    texts: list[tuple[str, str]] = []
    for i in range(600):  # 20 % commands, 50 % local paraphrases, 30 % unmatched
        kind = i % 10
        if kind < 2:
            texts.append(rng.choice(commands))
        elif kind < 7:
            c = rng.choice(local)
            texts.append((c["text"], c["lang"]))
        else:
            c = rng.choice(unmatched)
            texts.append((c["text"], c["lang"]))
    rng.shuffle(texts)
    return [
        router_pb2.RouteRequest(
            player=common_pb2.PlayerContext(
                server_id="bench",
                player_id=f"00000000-0000-4000-8000-{i % CLIENTS:012d}",
                language=lang,
            ),
            text=text,
        )
        for i, (text, lang) in enumerate(texts)
    ]


def _answers(target: str, requests: list[Any]) -> tuple[list[int], list[str]]:
    """Calls each request once (warming the router): each answer's size, and the mix of
    decisions (each worker routes alike, so the mix is the same under load)."""
    import grpc
    from system.router.v1 import router_pb2, router_pb2_grpc

    sizes: list[int] = []
    sources: list[str] = []
    with grpc.insecure_channel(target) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        deadline = time.monotonic() + 90
        while True:  # until the router has read the catalogue and built its index
            probe = stub.Route(
                router_pb2.RouteRequest(player=requests[0].player, text="查看帮助"), timeout=30
            )
            if probe.source == router_pb2.DECISION_SOURCE_LOCAL:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router never routed locally: {probe}")
            time.sleep(0.2)
        for request in requests:
            response = stub.Route(request, timeout=30)
            sizes.append(response.ByteSize())
            name = router_pb2.DecisionSource.Name(response.source)
            sources.append(name.removeprefix("DECISION_SOURCE_"))
    return sizes, sources


def _measured(pids: list[int], run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`run`'s result plus the router's CPU per call (all its processes) and the load."""
    load_before = loadavg()
    before = sum(cpu_seconds(p) for p in pids)
    result = run()
    cpu = sum(cpu_seconds(p) for p in pids) - before
    result["server_cpu_s"] = round(cpu, 2)
    result["server_cores"] = round(cpu / result["seconds"], 2) if result["seconds"] else None
    if result["completed"]:
        per_call = cpu / result["completed"]
        result["server_cpu_ms_per_call"] = round(per_call * 1000, 4)
        result["server_calls_per_cpu_second"] = round(1 / per_call, 0) if per_call else None
    result["loadavg_before"] = load_before
    result["loadavg_after"] = loadavg()
    return result


def _drive(target: str, pids: list[int], seconds: float) -> dict[str, Any]:
    requests = route_requests()
    sizes, sources = _answers(target, requests)
    bodies = [r.SerializeToString() for r in requests]
    few = bodies[:H2LOAD_BODIES]  # h2load sends one body per process: 16 of the 600
    health_body = b""  # HealthCheckRequest(): the server's overall status
    health_size = 2  # status SERVING
    runs: dict[str, Any] = {
        "answers": dict(Counter(sources).most_common()),
        "h2load_answers": dict(Counter(sources[:H2LOAD_BODIES]).most_common()),
    }
    runs["python"] = {
        "route": _measured(pids, lambda: python_load(target, ROUTE, bodies, seconds=seconds)),
        "health": _measured(
            pids, lambda: python_load(target, HEALTH, [health_body], seconds=seconds)
        ),
    }
    if h2load_available():
        runs["h2load"] = {
            "route": _measured(
                pids,
                lambda: h2load_load(target, ROUTE, few, sizes[:H2LOAD_BODIES], seconds=seconds),
            ),
            "health": _measured(
                pids,
                lambda: h2load_load(
                    target,
                    HEALTH,
                    [health_body] * H2LOAD_BODIES,  # as many connections as for Route
                    [health_size] * H2LOAD_BODIES,
                    seconds=seconds,
                ),
            ),
        }
    return runs


def measure_grpc(seconds: float) -> dict[str, Any]:
    """Every server setting under every generator; see the module docstring."""
    out: dict[str, Any] = {"clients": CLIENTS, "settings": {}}
    with tempfile.TemporaryDirectory() as data:
        run = Path(data)
        engine, engine_info = _start(
            "engine_service",
            "SYSTEM_ENGINE_",
            {"STORAGE_TARGET": "127.0.0.1:1"},  # GetCatalog needs no storage
            run,
        )
        try:
            engine_target = f"127.0.0.1:{engine_info['grpc_port']}"
            for label, env in server_settings():
                router, info = _start(
                    "router_service",
                    "SYSTEM_ROUTER_",
                    {"ENGINE_TARGET": engine_target, "MODEL_TARGET": "", **env},
                    run,
                )
                try:
                    pids = [info["pid"], *(w["pid"] for w in info.get("workers", ()))]
                    result = _drive(f"127.0.0.1:{info['grpc_port']}", pids, seconds)
                    result["env"] = {f"SYSTEM_ROUTER_{k}": v for k, v in env.items()}
                    out["settings"][label] = result
                finally:
                    _stop(router)
                    (run / "router_service.json").unlink(missing_ok=True)
        finally:
            _stop(engine)
    return out
