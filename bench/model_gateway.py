"""What the model gateway adds to a chat completion, against the `openai` client calling the
same local test server directly, in the same run.

    python -m bench.model_gateway [--calls 400] [--rounds 4] [--concurrency 1,64] [--quick]
                                  [--out DIR]
    python -m bench.model_gateway --fallback [--calls 200] [--rounds 3] [--concurrency 1,16]
    python -m bench.model_gateway --budgets [--calls 200] [--rounds 3] [--concurrency 1,64]
                                  [--lease-idle-seconds N]

Processes, all on loopback: the local OpenAI-compatible test server
(`python -m services.model_testserver`, echo replies), and three gateways
(`python -m services.model_gateway`, production settings: INFO logs, metrics on) pointed at it:

- `gateway`: metering off (`storage_target` empty): the gateway's own cost, gRPC hop included.
- `gateway+metering`: metering on, as in production, through a storage service on SQLite
  (`python -m storage_service`), with budget leases (the default settings): a player's first
  call reserves a block of budget in storage, later calls draw on it in the gateway's memory,
  and use is written in the background about once a second per player.
- `gateway+metering/call`: the same with leases off (`lease_tokens` 0): every call reserves in
  storage before it is sent and settles after, two round trips and two transactions per call
  (the design before leases), for comparison.

The bench process runs the clients: `direct` is `openai.AsyncOpenAI` streaming the completion
itself (`stream=True` with usage, what the gateway sends); the gateway paths call Complete over
gRPC. Paths are measured in interleaved rounds (direct, gateway, gateway+metering, ..., then again)
so drift in the machine's load falls on all of them alike. Overhead = the path's percentile
minus direct's. Each concurrency level runs that many clients at once, `--calls` calls per
path per round in all. Everything shares the machine's cores, so `uptime` load averages are
recorded with the figures. Results go to bench/results/model_gateway.{json,md,png}.

`--budgets` measures the nested budgets' check instead (issue 21): besides `gateway` (metering
off) and `gateway+metering` (the flat daily token budgets, on leases), `gateway+budgets` runs
with a budgets file (per-rank player limits, per game server, network per day and per month,
in tokens and money from the providers file's prices; every limit set, none reached) on
leases, and `gateway+budgets/call` the same with a reservation and a settle per call. Player ids
are scoped (`bench/<n>`), so the game server's counter is written too. Results in
bench/results/model_gateway_budgets.{json,md}. Each client's first call of a batch is reported
apart from its later ones, with how long the path sat idle before the batch (its leases close
after `lease_idle_seconds`); `--lease-idle-seconds N` sets that on the metered gateways (an
experiment: results in model_gateway_budgets_idle<N>.{json,md}).

`--fallback` measures the fallback between providers instead: two gateways (metering off), each
with two providers in its default list (`providers_file`). `both healthy`: two test servers
answering every call. `first fails 1 in 2`: the first provider is a test server whose every
second completion answers HTTP 500 (`--fail-every 2`), so half the calls fall back to the
second. `first stalls 1 in 2`: the first provider sends no first token for STALL_SECONDS on
every second completion, past the gateways' first-token timeout (FIRST_TOKEN_TIMEOUT_SECONDS,
for every path alike), so those calls give up on it and fall back. Completions per second and
p50/p99 latency per path, in interleaved rounds of the same run; results in
bench/results/model_gateway_fallback.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import openai
from grpc_health.v1 import health_pb2, health_pb2_grpc
from system.model.v1 import model_pb2, model_pb2_grpc

from bench.machine import describe_machine
from bench.report import progress, summarize
from services.stack.launcher import ROOT, free_port

RESULTS = Path(__file__).resolve().parent / "results"
KEY = "bench-key"
MODEL = "deepseek-chat"
TEXT = "open the shop"
MAX_TOKENS = 64
TARGET_OVERHEAD_P50_MS = 2.0
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]  # loopback only; ignore proxy settings
PATHS = ("direct", "direct, raw chunks", "gateway", "gateway+metering", "gateway+metering/call")
DIRECT_PATHS = ("direct", "direct, raw chunks")

Call = Callable[[int], Awaitable[None]]


class _Process:
    """A child process on a free port, stopped with SIGTERM."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], logs: Path) -> None:
        self.name = name
        self.log_path = logs / f"{name}.log"
        full_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gen")]),
            **env,
        }
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def cpu_seconds(self) -> float | None:
        """User and system CPU time the process has used so far; None where /proc is missing."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def check(self) -> None:
        if self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(f"{self.name} exited:\n" + "\n".join(tail))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _service(
    name: str, module: str, prefix: str, settings: dict[str, str], logs: Path
) -> tuple[_Process, str]:
    port = free_port()
    env = {
        f"{prefix}HOST": "127.0.0.1",
        f"{prefix}PORT": str(port),
        f"{prefix}METRICS_PORT": "0",
        f"{prefix}DRAIN_SECONDS": "0",
        **{f"{prefix}{key}": value for key, value in settings.items()},
    }
    return _Process(name, [sys.executable, "-m", module], env, logs), f"127.0.0.1:{port}"


async def _wait_serving(process: _Process, target: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            process.check()
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{process.name} not serving after {timeout} s")
            await asyncio.sleep(0.1)


async def _wait_http(process: _Process, client: openai.AsyncOpenAI, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        process.check()
        try:
            await client.models.list()
            return
        except openai.APIConnectionError:
            if time.monotonic() > deadline:
                raise RuntimeError("the test server did not start") from None
            await asyncio.sleep(0.1)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def _batch(
    call: Call,
    calls: int,
    concurrency: int,
    samples: list[float],
    split: tuple[list[float], list[float]] | None = None,
) -> None:
    """`calls` calls from `concurrency` clients at once; latencies appended to `samples`, and
    with `split` also to its first list (each client's first call of the batch: client `i`
    calls as player `i`, so on a metered path the call that may find the player's lease gone)
    or its second (the client's later calls)."""
    queue = iter(range(calls))

    async def client(index: int) -> None:
        first = True
        for _ in queue:
            began = time.perf_counter()
            await call(index)
            took = (time.perf_counter() - began) * 1000
            samples.append(took)
            if split is not None:
                split[0 if first else 1].append(took)
            first = False

    await asyncio.gather(*(client(i) for i in range(concurrency)))


def _calls(
    direct: openai.AsyncOpenAI,
    stubs: dict[str, model_pb2_grpc.ModelGatewayServiceStub],
    *,
    scoped: bool = False,
) -> dict[str, Call]:
    async def call_direct(index: int) -> None:
        stream = await direct.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": TEXT}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(parts) == f"echo: {TEXT}"

    async def call_direct_raw(index: int) -> None:
        # What the gateway itself does with the provider (services/model_gateway/streaming.py):
        # the same request through the client's `post`, chunks read as plain JSON.
        stream = await direct.post(
            "/chat/completions",
            body={
                "model": MODEL,
                "messages": [{"role": "user", "content": TEXT}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            cast_to=object,
            stream=True,
            stream_cls=openai.AsyncStream[object],
        )
        parts = [
            c["choices"][0]["delta"].get("content") or ""
            async for c in stream
            if c.get("choices")  # type: ignore[attr-defined]
        ]
        assert "".join(parts) == f"echo: {TEXT}"

    def via(stub: model_pb2_grpc.ModelGatewayServiceStub) -> Call:
        async def call(index: int) -> None:
            request = model_pb2.CompleteRequest(
                player_id=f"bench/{index}" if scoped else f"bench-{index}",
                messages=[model_pb2.ChatMessage(role=model_pb2.MESSAGE_ROLE_USER, content=TEXT)],
                max_tokens=MAX_TOKENS,
            )
            response = await stub.Complete(request, timeout=30)
            assert response.content == f"echo: {TEXT}"

        return call

    return {
        "direct": call_direct,
        "direct, raw chunks": call_direct_raw,
        **{name: via(stub) for name, stub in stubs.items()},
    }


def _add_cpu(spent: float | None, before: float | None, after: float | None) -> float | None:
    if spent is None or before is None or after is None:
        return None
    return spent + after - before


async def _measure(
    calls: dict[str, Call],
    concurrency: int,
    per_round: int,
    rounds: int,
    servers: dict[str, _Process],
) -> dict[str, Any]:
    """Latency per path; for the gateway paths also the CPU time the gateway process spent per
    call (`servers`: the gateway of each path), read between batches, outside the timings."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    split: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in calls}
    # None where the CPU time cannot be read (no /proc).
    cpu: dict[str, float | None] = {name: 0.0 for name in servers}
    for call in calls.values():  # warm-up: connections, caches, the first-call costs
        await _batch(call, max(concurrency, 20), concurrency, [])
    load_before = _load()
    total = rounds * len(calls)
    done = 0
    # Seconds between the end of a path's batch and the start of its next one (the other
    # paths' batches): how long its leases sat idle.
    gaps: dict[str, list[float]] = {name: [] for name in calls}
    ended: dict[str, float] = {}
    for _ in range(rounds):
        for name, call in calls.items():
            before = servers[name].cpu_seconds() if name in servers else None
            began = time.perf_counter()
            if name in ended:
                gaps[name].append(began - ended[name])
            await _batch(call, per_round, concurrency, samples[name], split[name])
            ended[name] = time.perf_counter()
            if name in servers:
                cpu[name] = _add_cpu(cpu[name], before, servers[name].cpu_seconds())
            done += 1
            progress(done, total, f"x{concurrency}")
    summaries = {name: summarize(values) for name, values in samples.items()}
    # Each client's first call of a batch apart from its later ones (see `_batch`).
    by_turn = {
        name: {
            "first": summarize(firsts),
            "later": summarize(laters),
            "idle_before_batch_s": round(sum(gaps[name]) / len(gaps[name]), 1)
            if gaps[name]
            else None,
        }
        for name, (firsts, laters) in split.items()
    }
    for name, seconds in cpu.items():
        per_call = None if seconds is None else round(seconds * 1000 / (rounds * per_round), 3)
        summaries[name]["server_cpu_ms_per_call"] = per_call  # type: ignore[assignment]

    def added(baseline: str) -> dict[str, dict[str, float]]:
        base = summaries[baseline]
        return {
            name: {
                "p50_ms": round(s["p50_ms"] - base["p50_ms"], 3),
                "p99_ms": round(s["p99_ms"] - base["p99_ms"], 3),
            }
            for name, s in summaries.items()
            if name not in DIRECT_PATHS
        }

    return {
        "concurrency": concurrency,
        "latency": summaries,
        "latency_by_turn": by_turn,
        "overhead": added("direct"),
        # Against the client doing what the gateway does with the provider: the gateway's own
        # cost (gRPC hop, checks, metering), without its cheaper chunk reading.
        "overhead_raw": added("direct, raw chunks"),
        "load_before": load_before,
        "load_after": _load(),
    }


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


async def run(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    uptime_start = _uptime()
    fake_port = free_port()
    fake = _Process(
        "testserver",
        [
            sys.executable,
            "-m",
            "services.model_testserver",
            "--port",
            str(fake_port),
            "--api-key",
            KEY,
        ],
        {},
        logs,
    )
    base_url = f"http://127.0.0.1:{fake_port}/v1"
    storage, storage_target = _service(
        "storage",
        "storage_service",
        "SYSTEM_STORAGE_",
        {"DATABASE_URL": f"sqlite:///{logs / 'storage.db'}"},
        logs,
    )
    # Budgets off (the reservation is still made); a budget check waits as long as the call.
    # An experiment: leases kept between batches (empty: the gateways' default).
    lease_idle = (
        {}
        if args.lease_idle_seconds is None
        else {"LEASE_IDLE_SECONDS": str(args.lease_idle_seconds)}
    )
    common = {
        "BASE_URL": base_url,
        "API_KEY": KEY,
        "PLAYER_DAILY_TOKENS": "0",
        "STORAGE_TIMEOUT_SECONDS": "30",
        **lease_idle,
    }
    plain, plain_target = _service(
        "gateway", "services.model_gateway", "SYSTEM_MODEL_", {**common, "STORAGE_TARGET": ""}, logs
    )
    metered, metered_target = _service(
        "gateway-metered",
        "services.model_gateway",
        "SYSTEM_MODEL_",
        {**common, "STORAGE_TARGET": storage_target},
        logs,
    )
    # Path name -> (process, target) of every gateway measured.
    gateways: dict[str, tuple[_Process, str]] = {
        "gateway": (plain, plain_target),
        "gateway+metering": (metered, metered_target),
    }
    gateways["gateway+metering/call"] = _service(
        "gateway-per-call",
        "services.model_gateway",
        "SYSTEM_MODEL_",
        {
            **common,
            "STORAGE_TARGET": storage_target,
            "LEASE_TOKENS": "0",
            "LEASE_WEB_SEARCHES": "0",
        },
        logs,
    )
    if args.budgets:
        # The nested budgets on leases, and per call.
        nested = {
            "PROVIDERS_FILE": str(_priced_providers(logs, base_url)),
            "BUDGETS_FILE": str(_budgets_file(logs)),
            "STORAGE_TARGET": storage_target,
            "STORAGE_TIMEOUT_SECONDS": "30",
            **lease_idle,
        }
        gateways["gateway+budgets"] = _service(
            "gateway-budgets", "services.model_gateway", "SYSTEM_MODEL_", nested, logs
        )
        gateways["gateway+budgets/call"] = _service(
            "gateway-budgets-per-call",
            "services.model_gateway",
            "SYSTEM_MODEL_",
            {**nested, "LEASE_TOKENS": "0", "LEASE_WEB_SEARCHES": "0"},
            logs,
        )
    processes = [fake, storage, *(process for process, _ in gateways.values())]
    try:
        direct = openai.AsyncOpenAI(api_key=KEY, base_url=base_url, max_retries=0)
        await _wait_http(fake, direct)
        for process, target in [(storage, storage_target), *gateways.values()]:
            await _wait_serving(process, target)
        servers = {name: process for name, (process, _) in gateways.items()}
        channels = {
            name: grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
            for name, (_, target) in gateways.items()
        }
        stubs = {name: model_pb2_grpc.ModelGatewayServiceStub(c) for name, c in channels.items()}
        calls = _calls(direct, stubs, scoped=args.budgets)
        cells = []
        for concurrency in args.concurrency:
            per_round = max(args.calls, concurrency * 4)
            cells.append(await _measure(calls, concurrency, per_round, args.rounds, servers))
        for channel in channels.values():
            await channel.close()
        await direct.close()
    finally:
        for process in processes:
            process.stop()
    return {
        "benchmark": "model_gateway_budgets" if args.budgets else "model_gateway",
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": describe_machine(),
        "uptime_start": uptime_start,
        "uptime": _uptime(),
        "settings": {
            "calls_per_round": args.calls,
            "rounds": args.rounds,
            "request": {"text": TEXT, "max_tokens": MAX_TOKENS, "stream": True},
            "target_overhead_p50_ms": TARGET_OVERHEAD_P50_MS,
            "lease_idle_seconds": args.lease_idle_seconds,  # None: the gateways' default
        },
        "cells": cells,
    }


BUDGETS_TOML = """
alert_percent = 80
[ranks.player]
min_level = 0
daily_tokens = 1_000_000_000
daily_cost = 100000.0
[ranks.admin]
min_level = 3
daily_tokens = 0
[server]
daily_tokens = 1_000_000_000_000
daily_cost = 1000000.0
[network]
daily_tokens = 1_000_000_000_000
daily_cost = 1000000.0
monthly_tokens = 1_000_000_000_000
monthly_cost = 10000000.0
"""


def _priced_providers(folder: Path, base_url: str) -> Path:
    path = folder / "priced-providers.toml"
    path.write_text(
        f'[providers.fake]\npreset = "custom"\nbase_url = "{base_url}"\n'
        'api_key_env = "BENCH_MODEL_KEY"\n[providers.fake.models]\n'
        f"{MODEL} = {{ input_per_million = 0.27, output_per_million = 1.10 }}\n"
        f'[routes]\ndefault = ["fake/{MODEL}"]\n'
    )
    os.environ["BENCH_MODEL_KEY"] = KEY  # read by the gateways started after this
    return path


def _budgets_file(folder: Path) -> Path:
    path = folder / "budgets.toml"
    path.write_text(BUDGETS_TOML)
    return path


FALLBACK_PATHS = ("both healthy", "first fails 1 in 2", "first stalls 1 in 2")
FIRST_TOKEN_TIMEOUT_SECONDS = 0.25
"""The fallback gateways' first-token timeout: far above a healthy first token here (p99 under
0.1 s at 16 in flight), so only the stalls pass it."""
STALL_SECONDS = 5.0
"""How long the stalling provider holds a stalled completion before its first token."""


def _providers_file(folder: Path, name: str, first: str, second: str) -> Path:
    """A providers file naming two test servers, the first one first in the default list."""
    key_file = folder / "provider.key"
    key_file.write_text(KEY)
    path = folder / f"{name}.toml"
    path.write_text(
        "\n".join(
            [
                "[providers.first]",
                'preset = "custom"',
                f'base_url = "{first}"',
                f'api_key_file = "{key_file}"',
                f'models = ["{MODEL}"]',
                "[providers.second]",
                'preset = "custom"',
                f'base_url = "{second}"',
                f'api_key_file = "{key_file}"',
                f'models = ["{MODEL}"]',
                "[routes]",
                'default = ["first", "second"]',
                "",
            ]
        )
    )
    return path


async def _fallback_cell(
    stubs: dict[str, model_pb2_grpc.ModelGatewayServiceStub],
    concurrency: int,
    per_round: int,
    rounds: int,
) -> dict[str, Any]:
    samples: dict[str, list[float]] = {name: [] for name in stubs}
    seconds = {name: 0.0 for name in stubs}
    answered = {name: {"first": 0, "second": 0} for name in stubs}

    def via(name: str) -> Call:
        stub = stubs[name]

        async def call(index: int) -> None:
            request = model_pb2.CompleteRequest(
                player_id=f"bench-{index}",
                messages=[model_pb2.ChatMessage(role=model_pb2.MESSAGE_ROLE_USER, content=TEXT)],
                max_tokens=MAX_TOKENS,
            )
            response = await stub.Complete(request, timeout=30)
            assert response.content == f"echo: {TEXT}"
            answered[name][response.provider] += 1

        return call

    calls = {name: via(name) for name in stubs}
    for call in calls.values():
        await _batch(call, max(concurrency, 20), concurrency, [])
    for counts in answered.values():
        counts.update(first=0, second=0)
    load_before = _load()
    done = 0
    for _ in range(rounds):
        for name, call in calls.items():
            began = time.perf_counter()
            await _batch(call, per_round, concurrency, samples[name])
            seconds[name] += time.perf_counter() - began
            done += 1
            progress(done, rounds * len(calls), f"fallback x{concurrency}")
    latency: dict[str, Any] = {}
    for name, values in samples.items():
        summary: dict[str, Any] = dict(summarize(values))
        summary["per_second"] = round(len(values) / seconds[name], 1)
        summary["answered_by"] = answered[name]
        latency[name] = summary
    return {
        "concurrency": concurrency,
        "latency": latency,
        "load_before": load_before,
        "load_after": _load(),
    }


async def run_fallback(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    uptime_start = _uptime()
    servers: dict[str, tuple[_Process, str]] = {}
    for name, extra in (
        ("healthy-1", []),
        ("healthy-2", []),
        ("flaky", ["--fail-every", "2", "--fail-status", "500"]),
        ("stalling", ["--fail-every", "2", "--fail-delay", str(STALL_SECONDS)]),
    ):
        port = free_port()
        command = [sys.executable, "-m", "services.model_testserver", "--port", str(port)]
        process = _Process(name, [*command, "--api-key", KEY, *extra], {}, logs)
        servers[name] = (process, f"http://127.0.0.1:{port}/v1")
    healthy_1, healthy_2, flaky, stalling = (
        servers[n][1] for n in ("healthy-1", "healthy-2", "flaky", "stalling")
    )
    files = {
        "both healthy": _providers_file(logs, "healthy", healthy_1, healthy_2),
        "first fails 1 in 2": _providers_file(logs, "flaky", flaky, healthy_2),
        "first stalls 1 in 2": _providers_file(logs, "stalling", stalling, healthy_2),
    }
    gateways = {
        name: _service(
            f"gateway-{index}",
            "services.model_gateway",
            "SYSTEM_MODEL_",
            {
                "PROVIDERS_FILE": str(path),
                "STORAGE_TARGET": "",
                "RETRY_BACKOFF_SECONDS": "0",
                "FIRST_TOKEN_TIMEOUT_SECONDS": str(FIRST_TOKEN_TIMEOUT_SECONDS),
            },
            logs,
        )
        for index, (name, path) in enumerate(files.items())
    }
    processes = [p for p, _ in servers.values()] + [p for p, _ in gateways.values()]
    try:
        for process, url in servers.values():
            probe = openai.AsyncOpenAI(api_key=KEY, base_url=url, max_retries=0)
            await _wait_http(process, probe)
            await probe.close()
        for process, target in gateways.values():
            await _wait_serving(process, target)
        channels = {
            name: grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
            for name, (_, target) in gateways.items()
        }
        stubs = {name: model_pb2_grpc.ModelGatewayServiceStub(c) for name, c in channels.items()}
        cells = []
        for concurrency in args.concurrency:
            per_round = max(args.calls, concurrency * 4)
            cells.append(await _fallback_cell(stubs, concurrency, per_round, args.rounds))
        for channel in channels.values():
            await channel.close()
    finally:
        for process in processes:
            process.stop()
    return {
        "benchmark": "model_gateway_fallback",
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": describe_machine(),
        "uptime_start": uptime_start,
        "uptime": _uptime(),
        "settings": {
            "calls_per_round": args.calls,
            "rounds": args.rounds,
            "request": {"text": TEXT, "max_tokens": MAX_TOKENS, "stream": True},
            "failing": "the first provider answers HTTP 500 to every second completion",
            "stalling": (
                f"the first provider holds every second completion {STALL_SECONDS} s before "
                "its first token"
            ),
            "stall_seconds": STALL_SECONDS,
            "first_token_timeout_seconds": FIRST_TOKEN_TIMEOUT_SECONDS,
            "retry_backoff_seconds": 0,
        },
        "cells": cells,
    }


def _run_line(result: dict[str, Any], command: str = "") -> str:
    """When and where a run was made, and the machine's load before and after it."""
    machine = result["machine"]
    line = (
        f"Run {result['when']} on {machine['cpu']} ({machine['cores']} cores), Python "
        f"{machine['python']}. `uptime` at the start: `{result.get('uptime_start', '?')}`; at "
        f"the end: `{result['uptime']}`."
    )
    return f"{line} Command: `{command}`." if command else line


def _fallback_markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Model gateway: fallback between providers",
        "",
        _run_line(result, "python -m bench.model_gateway --fallback"),
        "",
        "Complete through three gateways (metering off), each with two providers in its "
        "default list, all local test servers (echo reply, streamed). `both healthy`: both "
        "answer every call. `first fails 1 in 2`: the first provider answers HTTP 500 to every "
        "second completion, and those calls fall back to the second provider at once (no "
        "backoff before a fallback). `first stalls 1 in 2`: the first provider sends no first "
        f"token for {result['settings'].get('stall_seconds', '?')} s on "
        "every second completion; the gateway gives up on it after its first-token timeout "
        f"({result['settings'].get('first_token_timeout_seconds', '?')} s, the same on every "
        "path) and falls back, so a stalled call costs that timeout plus the second provider's "
        "answer. On those two paths an even split of the answers (first / second) shows no "
        "call skipped the first provider: its breaker stayed closed. "
        + _breakers(result)
        + "Paths run in interleaved rounds of the same run.",
        "",
        "| concurrency | path | calls | completions/s | p50 ms | p99 ms "
        "| answered by first / second | load 1/5/15 min |",
        "|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for cell in result["cells"]:
        load = "/".join(str(x) for x in cell["load_after"])
        for path, s in cell["latency"].items():
            by = s["answered_by"]
            lines.append(
                f"| {cell['concurrency']} | {path} | {s['n']} | {s['per_second']} "
                f"| {s['p50_ms']} | {s['p99_ms']} | {by['first']} / {by['second']} | {load} |"
            )
    lines += [
        "",
        "All processes (four test servers, three gateways, the clients) share the machine's "
        "cores, with other work beside them (see the load).",
        "",
    ]
    return "\n".join(lines)


def _breakers(result: dict[str, Any]) -> str:
    """What the answers say of the first provider's breaker, where it opened."""
    opened = [
        f"{path} at {cell['concurrency']} in flight"
        for cell in result["cells"]
        for path, s in cell["latency"].items()
        if s["answered_by"]["first"] < s["n"] // 4
    ]
    if not opened:
        return ""
    return (
        f"Where the first provider answered (almost) none ({', '.join(opened)}), its breaker "
        "had opened: with many calls in flight the stalled ones time out together, more than "
        "`breaker_failures` (5) in a row, and the calls after that skip the first provider "
        "without waiting for it until the 30 s cool-down ends (longer than the cell). "
    )


def _tail_note(result: dict[str, Any]) -> str:
    """What the p99 at the highest concurrency is made of, from this run's figures."""
    cell = max(result["cells"], key=lambda c: c["concurrency"])
    turns = cell.get("latency_by_turn", {})
    metered = [path for path in ("gateway+metering", "gateway+budgets") if path in turns]
    if not metered:
        return ""
    shown = "; ".join(
        f"`{path}` first calls p50 {turns[path]['first']['p50_ms']} ms, p99 "
        f"{turns[path]['first']['p99_ms']} ms, later calls p50 {turns[path]['later']['p50_ms']}"
        f" ms, p99 {turns[path]['later']['p99_ms']} ms"
        for path in metered
    )
    idle = turns[metered[0]].get("idle_before_batch_s")
    kept = result["settings"].get("lease_idle_seconds")
    return (
        f"**The p99 tail on the lease paths at {cell['concurrency']} in flight** (issue 21): "
        f"{shown}; the unmetered `gateway`'s first calls p50 "
        f"{turns['gateway']['first']['p50_ms']} ms. The bench runs each path's batch in turn, "
        f"so a path's leases sit idle while the other paths run ({idle} s here). "
        + (
            "That is under `lease_idle_seconds` (10 s), so the leases stayed open between "
            "batches here and the first calls made no reservation."
            if kept is None and idle is not None and idle < 10
            else "That is past `lease_idle_seconds` (10 s), so the refresh closes every lease and "
            "the next batch opens with all its players reserving a new lease in storage at "
            "once. Storage runs a day's reservations one at a time (each locks the day's "
            "totals row first; SQLite has one writer besides), so the n-th waits for the n-1 "
            "before it: the first calls carry the tail. With the leases kept between batches "
            "(`--lease-idle-seconds 600`: bench/results/model_gateway_budgets_idle600.md, the "
            "same machine minutes later) the metered first calls cost what the unmetered "
            "gateway's do and, in the runs recorded so far, the metered p99 comes down to the "
            "unmetered one's. So it is not "
            "a per-call cost of the budget check: it is what a burst of players starting at "
            "once (a game server's restart) pays, one queued storage transaction each; steady "
            "play, with a player's calls less than 10 s apart, does not. What remains at this "
            "concurrency on every path, metered or not, is queueing for the two cores."
            if kept is None
            else f"Here leases are kept idle {kept:g} s, longer than that, so each batch "
            "finds its players' leases open: the experiment beside "
            "bench/results/model_gateway_budgets.md, whose leases close after 10 s idle."
        )
    )


def _budgets_markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Model gateway: the cost of the nested budget check",
        "",
        _run_line(
            result,
            "python -m bench.model_gateway --budgets"
            + (
                ""
                if result["settings"].get("lease_idle_seconds") is None
                else f" --lease-idle-seconds {result['settings']['lease_idle_seconds']:g}"
            ),
        ),
        "",
        "Complete through the gateway with metering off (`gateway`), with the flat daily token "
        "budgets on leases (`gateway+metering`), with the nested budgets (ranks, game server, "
        "network per day and month, in tokens and money; every limit set, none reached) on "
        "leases (`gateway+budgets`, production settings), and with the nested budgets making a "
        "reservation and a settle in storage per call (`gateway+budgets/call`). Storage on "
        "SQLite. **Budget check** = the path's figure minus `gateway`'s (metering off), in the "
        "same run.",
        "",
        "| concurrency | path | calls | p50 ms | p99 ms | budget check p50 ms | budget check p99 ms "
        "| gateway CPU ms/call | load 1/5/15 min |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for cell in result["cells"]:
        load = "/".join(str(x) for x in cell["load_after"])
        base = cell["latency"]["gateway"]
        for path, s in cell["latency"].items():
            if path in DIRECT_PATHS:
                continue
            added = (
                ("", "")
                if path == "gateway"
                else (
                    round(s["p50_ms"] - base["p50_ms"], 3),
                    round(s["p99_ms"] - base["p99_ms"], 3),
                )
            )
            cpu = s.get("server_cpu_ms_per_call")
            lines.append(
                f"| {cell['concurrency']} | {path} | {s['n']} | {s['p50_ms']} | {s['p99_ms']} "
                f"| {added[0]} | {added[1]} | {'' if cpu is None else cpu} | {load} |"
            )
    lines += [
        "",
        "Each client's first call of a batch apart from its later calls (client `i` calls as "
        "player `i`, one call in flight each; a batch is one path's share of a round):",
        "",
        "| concurrency | path | idle before a batch s | first calls | first p50 ms "
        "| first p99 ms | later calls | later p50 ms | later p99 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cell in result["cells"]:
        for path, turns in cell.get("latency_by_turn", {}).items():
            if path in DIRECT_PATHS:
                continue
            first, later = turns["first"], turns["later"]
            idle = turns.get("idle_before_batch_s")
            lines.append(
                f"| {cell['concurrency']} | {path} | {'' if idle is None else idle} "
                f"| {first['n']} | {first.get('p50_ms', '')} "
                f"| {first.get('p99_ms', '')} | {later['n']} | {later.get('p50_ms', '')} "
                f"| {later.get('p99_ms', '')} |"
            )
    lines += [
        "",
        "All processes (test server, storage, five gateways, the clients) share the machine's "
        "cores with other work (see the load). `gateway+metering/call` is the flat budgets "
        "with a reservation per call (storage keeps the counter rows for every reservation, "
        "limited or not, so it writes them too: the per-call figure is no longer the design "
        "before leases, see model_gateway.md for that). On leases a player's first call reserves a "
        "block in storage (now also locking the player's, the server's and the network's day "
        "and month counter rows) and later calls draw on it in memory, so the nested check adds "
        "per call only the in-memory comparison of three amounts instead of two; per call it "
        "adds the counter rows to both storage transactions. At 64 in flight the two cores "
        "are far past full (five gateways, storage, the test server and 64 clients), so every "
        "path's figures are mostly queueing for them and the p50 differences between paths are "
        "within that noise.",
        "",
        _tail_note(result),
        "",
    ]
    return "\n".join(lines)


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Model gateway overhead",
        "",
        _run_line(result),
        "",
        "A chat completion against the local test server (echo reply, streamed): the `openai` "
        "client calling it directly (`chat.completions.create`, chunks parsed into its models, "
        "as an application would; and, as a second baseline, the client's `post` with chunks "
        "read as plain JSON, which is what the gateway itself does with the provider), versus "
        "Complete through the gateway without metering, "
        "with metering through the storage service (SQLite) on budget leases (production "
        "settings), and with metering making a reservation and a settle in storage per call "
        "(`lease_tokens` 0, the design before leases). Overhead is the path's figure minus "
        "direct's, in the same run; target: under "
        f"{result['settings']['target_overhead_p50_ms']} ms added at p50.",
        "",
        "| concurrency | path | calls | p50 ms | p99 ms | added p50 ms | added p99 ms "
        "| added p50 / p99 ms vs raw chunks | gateway CPU ms/call | load 1/5/15 min |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for cell in result["cells"]:
        load = "/".join(str(x) for x in cell["load_after"])
        for path, s in cell["latency"].items():
            added = cell["overhead"].get(path, {"p50_ms": "", "p99_ms": ""})
            raw = cell.get("overhead_raw", {}).get(path)
            versus_raw = f"{raw['p50_ms']} / {raw['p99_ms']}" if raw else ""
            cpu = s.get("server_cpu_ms_per_call")
            lines.append(
                f"| {cell['concurrency']} | {path} | {s['n']} | {s['p50_ms']} | {s['p99_ms']} "
                f"| {added['p50_ms']} | {added['p99_ms']} | {versus_raw} "
                f"| {'' if cpu is None else cpu} | {load} |"
            )
    lines += [
        "",
        "All processes (test server, storage, three gateways, the clients) share the machine's "
        "cores, and other work ran beside them (see the load); at 64 concurrent calls the "
        "figures are mostly queueing for those cores. Gateway CPU is the user and system CPU "
        "time the path's gateway process used per call (storage's is not included), read "
        "from /proc between batches: steadier than latency on a shared machine.",
        "",
    ]
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(result["cells"]), figsize=(6.5 * len(result["cells"]), 4.5))
    if len(result["cells"]) == 1:
        axes = [axes]
    for axis, cell in zip(axes, result["cells"], strict=True):
        names = list(cell["latency"])
        p50 = [cell["latency"][n]["p50_ms"] for n in names]
        p99 = [cell["latency"][n]["p99_ms"] for n in names]
        x = range(len(names))
        axis.bar([i - 0.2 for i in x], p50, width=0.4, label="p50")
        axis.bar([i + 0.2 for i in x], p99, width=0.4, label="p99")
        axis.set_xticks(list(x), names, rotation=12, fontsize=8)
        axis.set_ylabel("ms per completion")
        axis.set_title(f"{cell['concurrency']} concurrent")
        axis.legend()
    figure.suptitle("Chat completion latency: direct vs through the model gateway")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.model_gateway", description=__doc__)
    parser.add_argument("--calls", type=int, default=400, help="calls per path per round")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[1, 64],
        help="comma-separated client counts",
    )
    parser.add_argument("--quick", action="store_true", help="100 calls, 2 rounds, temp output")
    parser.add_argument("--out", type=Path, help="results folder (default bench/results)")
    parser.add_argument(
        "--budgets",
        action="store_true",
        help="measure the nested budget check (tokens and money) against metering off",
    )
    parser.add_argument(
        "--lease-idle-seconds",
        type=float,
        help="the metered gateways' lease_idle_seconds (default: theirs, 10 s): an experiment",
    )
    parser.add_argument(
        "--fallback",
        action="store_true",
        help="measure fallback between two providers, one failing or stalling every other call",
    )
    args = parser.parse_args(argv)
    if args.fallback:
        if "--calls" not in (argv or sys.argv):
            args.calls = 200
        if "--rounds" not in (argv or sys.argv):
            args.rounds = 3
        if "--concurrency" not in (argv or sys.argv):
            args.concurrency = [1, 16]
    if args.budgets:
        if "--calls" not in (argv or sys.argv):
            args.calls = 200
        if "--rounds" not in (argv or sys.argv):
            args.rounds = 3
        if "--concurrency" not in (argv or sys.argv):
            args.concurrency = [1, 64]
    if args.quick:
        args.calls, args.rounds = 100, 2
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench-model-")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    if args.fallback:
        with tempfile.TemporaryDirectory(prefix="bench-model-logs-") as logs:
            result = asyncio.run(run_fallback(args, Path(logs)))
        (out / "model_gateway_fallback.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "model_gateway_fallback.md").write_text(_fallback_markdown(result))
        print(_fallback_markdown(result))
        print(f"results in {out}", file=sys.stderr)
        return
    if args.budgets:
        with tempfile.TemporaryDirectory(prefix="bench-model-logs-") as logs:
            result = asyncio.run(run(args, Path(logs)))
        # The experiment keeps its own files beside the recorded run.
        idle = args.lease_idle_seconds
        name = "model_gateway_budgets" + ("" if idle is None else f"_idle{idle:g}")
        (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / f"{name}.md").write_text(_budgets_markdown(result))
        print(_budgets_markdown(result))
        print(f"results in {out}", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory(prefix="bench-model-logs-") as logs:
        result = asyncio.run(run(args, Path(logs)))
    (out / "model_gateway.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "model_gateway.md").write_text(_markdown(result))
    _plot(result, out / "model_gateway.png")
    print(_markdown(result))
    print(f"results in {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
