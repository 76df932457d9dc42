"""Load generators for gRPC throughput benchmarks: unary calls, `clients` in flight, for a fixed
time, against a server in another process.

Two generators, because on a small machine the generator competes with the server for cores:

- `python_load`: grpc.aio clients in `processes` spawned processes (each its own interpreter
  lock), `clients` tasks in all. What a Python caller (the gateway) costs; it measures and
  reports its own CPU per call.
- `h2load_load`: nghttp2's `h2load` (C, HTTP/2 with gRPC framing), one process per request
  body, `clients` streams in all. It spends a fraction of the CPU per call that a Python
  client does, so more of the machine is left to the server. It cannot read gRPC status
  (sent in trailers), so every answer is checked by size: each body's response bytes are
  known from one call made beforehand, and any error, or any different answer, changes the
  total.

Both return the same summary: seconds, completed, per_second, latency percentiles, errors,
and the generator's own CPU seconds.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import resource
import shutil
import struct
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.report import summarize

__all__ = ["h2load_available", "h2load_load", "python_load"]


# -- Python clients --------------------------------------------------------------------------


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _python_worker(
    target: str,
    method: str,
    bodies: list[bytes],
    clients: int,
    channels: int,
    first: int,
    start_at: float,
    seconds: float,
) -> dict[str, Any]:
    import grpc

    opened = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(channels)
    ]
    identity = bytes  # requests are sent as serialized; responses kept as bytes
    calls = [c.unary_unary(method, request_serializer=identity, response_deserializer=identity)
             for c in opened]  # fmt: skip
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    answers: Counter[int] = Counter()
    try:
        for call in calls:  # connect before the clock starts
            await call(bodies[0], timeout=30)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        stop_at = time.perf_counter() + seconds

        async def client(i: int) -> None:
            call = calls[i % len(calls)]
            n = first + i
            clock = time.perf_counter
            while clock() < stop_at:
                started = clock()
                try:
                    answer = await call(bodies[n % len(bodies)], timeout=10)
                except grpc.aio.AioRpcError as exc:
                    errors[exc.code().name] += 1
                else:
                    latencies.append((clock() - started) * 1000)
                    answers[len(answer)] += 1
                n += clients

        cpu = _cpu_self()
        began = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        return {
            "elapsed": time.perf_counter() - began,
            "cpu": _cpu_self() - cpu,
            "latencies": latencies,
            "errors": dict(errors),
            "answer_sizes": dict(answers),
        }
    finally:
        for channel in opened:
            await channel.close()


def _python_process(args: tuple[Any, ...], results: Any) -> None:
    results.put(asyncio.run(_python_worker(*args)))


def python_load(
    target: str,
    method: str,
    bodies: list[bytes],
    *,
    seconds: float,
    clients: int = 64,
    processes: int = 2,
    channels: int = 8,
) -> dict[str, Any]:
    """`clients` grpc.aio callers spread over `processes` processes and `channels` connections,
    cycling through `bodies` (serialized requests) for `seconds`."""
    context = multiprocessing.get_context("spawn")  # no gRPC state crosses a fork
    results = context.Queue()
    start_at = time.time() + 2.0 + 0.5 * processes  # spawning and connecting take a moment
    workers = []
    for p in range(processes):
        share = clients // processes + (p < clients % processes)
        args = (target, method, bodies, share, max(channels // processes, 1), p, start_at, seconds)
        worker = context.Process(target=_python_process, args=(args, results), daemon=True)
        worker.start()
        workers.append(worker)
    parts = [results.get(timeout=seconds + 120) for _ in workers]
    for worker in workers:
        worker.join(10)
    latencies = [x for part in parts for x in part["latencies"]]
    elapsed = max(part["elapsed"] for part in parts)
    errors: Counter[str] = Counter()
    for part in parts:
        errors.update(part["errors"])
    client_cpu = sum(part["cpu"] for part in parts)
    return {
        "generator": f"python grpc.aio, {processes} processes, {channels} connections",
        "seconds": round(elapsed, 2),
        "completed": len(latencies),
        "per_second": round(len(latencies) / elapsed, 1),
        **(summarize(latencies, digits=4) if latencies else {}),
        "errors": dict(errors),
        "client_cpu_s": round(client_cpu, 2),
        "client_cpu_ms_per_call": round(client_cpu / len(latencies) * 1000, 4)
        if latencies
        else None,
    }


# -- h2load ----------------------------------------------------------------------------------


def h2load_available() -> bool:
    return shutil.which("h2load") is not None


def _framed(body: bytes) -> bytes:
    return b"\0" + struct.pack(">I", len(body)) + body  # gRPC message: uncompressed, length


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def h2load_load(
    target: str,
    method: str,
    bodies: list[bytes],
    answer_sizes: list[int],
    *,
    seconds: float,
    clients: int = 64,
) -> dict[str, Any]:
    """One h2load process per body, one connection each, `clients` streams over all of them.

    Args:
        answer_sizes: the serialized response size of each body, from a call made beforehand;
            the data h2load received must add up to exactly these times the calls.
    """
    streams = [clients // len(bodies) + (i < clients % len(bodies)) for i in range(len(bodies))]
    with tempfile.TemporaryDirectory(prefix="h2load-") as scratch:
        work = Path(scratch)
        runs = []
        cpu = _children_cpu()
        began = time.perf_counter()
        for i, (body, m) in enumerate(zip(bodies, streams, strict=True)):
            if m == 0:
                continue
            (work / f"{i}.grpc").write_bytes(_framed(body))
            command = [
                "h2load", "-D", str(max(1, round(seconds))), "-c", "1", "-m", str(m), "-t", "1",
                "-d", str(work / f"{i}.grpc"), "--log-file", str(work / f"{i}.log"),
                "-H", "content-type: application/grpc", "-H", "te: trailers",
                f"http://{target}{method}",
            ]  # fmt: skip
            runs.append((i, subprocess.Popen(command, stdout=subprocess.PIPE, text=True)))
        outputs = [(i, run.communicate(timeout=seconds + 60)[0]) for i, run in runs]
        elapsed = time.perf_counter() - began
        client_cpu = _children_cpu() - cpu
        completed = 0
        mismatched = 0
        latencies: list[float] = []
        for i, output in outputs:
            done = int(re.search(r"(\d+) succeeded", output).group(1))  # type: ignore[union-attr]
            data = int(re.search(r"\((\d+)\) data", output).group(1))  # type: ignore[union-attr]
            if data != done * (answer_sizes[i] + 5):
                mismatched += done
            completed += done
            for line in (work / f"{i}.log").read_text().splitlines():
                _, status, micros = line.split("\t")
                if status == "200":
                    latencies.append(int(micros) / 1000)
    return {
        "generator": f"h2load (nghttp2, C), {len(runs)} processes and connections",
        "seconds": round(elapsed, 2),
        "completed": completed,
        "per_second": round(completed / max(1, round(seconds)), 1),
        **(summarize(latencies, digits=4) if latencies else {}),
        "errors": {"wrong size (error or other answer)": mismatched} if mismatched else {},
        "client_cpu_s": round(client_cpu, 2),
        "client_cpu_ms_per_call": round(client_cpu / completed * 1000, 4) if completed else None,
    }


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (what `uptime` prints)."""
    return [round(x, 2) for x in os.getloadavg()]
