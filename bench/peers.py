"""Peer baselines that the skeleton and engine benchmarks measure in their own run (issue 16):
what the same work costs done by the plainest Python that could do it, on the same machine.

    python -m bench.peers [--requests 1000] [--seconds 10] [--concurrency 4]

Echo chain (`measure_echo_chain`): four `grpc.aio` processes with nothing behind them,
arranged like a `help` request's path through the stack, so the skeleton bench can set
`help` beside the transport it cannot avoid:

    client ==one message on a bidi stream==> G ──unary──> R          (gateway → router)
                                             G ──unary──> E ──unary──> S
                                                          (gateway → engine → storage)

G calls R, then E; E calls S before it answers; every answer is ~200 bytes. Generic
handlers on raw bytes as in bench/transport.py, so no protobuf work is counted; each hop runs
on the event loop the services run on (uvloop where installed, decision 0037). (In the
stack the engine's storage calls travel on an open stream and the history write goes out
after the reply, so this chain does if anything more on its critical path than `help` does.)

DBOS (`measure_dbos`): DBOS Transact (the `dbos` package) running workflows of two
`@DBOS.step()` steps, each step one small INSERT: a durable step checkpointed in DBOS's
system tables, like an event task's two journaled write steps. It runs in a process of its
own (DBOS keeps global state) on a PostgreSQL database made for it and dropped after
(bench/databases.py), `concurrency` workflows in flight for `seconds`; every workflow is
checked to have ended SUCCESS with exactly its two writes. The engine bench gives it as many
workflows in flight as the engine runs event tasks at once (2 event workers × 2 replicas =
4, the default here); on a 2-core machine more threads only slow DBOS down (GIL).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from bench.cpu import cpu_seconds, postgres_cpu_seconds
from bench.report import progress, summarize
from bench.transport import _SERVICE, PAYLOAD, _same, serve_echo
from services.runtime.main import run_on_loop
from services.stack.launcher import free_port

__all__ = ["EchoChain", "measure_dbos", "measure_echo_chain"]

ROOT = Path(__file__).resolve().parent.parent
WARM_UP = 100
DBOS_WARM_UP_SECONDS = 1.0


# --- echo chain -------------------------------------------------------------------------


async def _serve_hop(port: int, downstream: list[int]) -> None:
    """One process of the chain: for every message (a unary call, or one on a stream) call
    each downstream process in order with a unary call, then answer PAYLOAD."""
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in downstream]
    for channel in channels:
        await channel.channel_ready()
    calls = [c.unary_unary(f"/{_SERVICE}/Unary", _same, _same) for c in channels]

    async def hop(request: bytes) -> bytes:
        for call in calls:
            await call(request)
        return PAYLOAD

    await serve_echo(port, hop)


def _start_hop(downstream: list[int]) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.peers", "--hop", str(port), *map(str, downstream)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "serving":
        process.kill()
        raise RuntimeError(f"echo hop on port {port} did not start")
    return process, port


class EchoChain:
    """The four hop processes, started and stopped with the object, and one bidi stream to G
    on the caller's event loop (`open`): `round_trip` times one message through the chain.
    The skeleton bench interleaves its round trips with `help`'s, so that both are timed in
    the same moments of a machine whose speed drifts."""

    def __init__(self) -> None:
        self._processes: list[subprocess.Popen[str]] = []
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None

    def __enter__(self) -> EchoChain:
        try:
            s, s_port = _start_hop([])
            self._processes.append(s)
            r, r_port = _start_hop([])
            self._processes.append(r)
            e, e_port = _start_hop([s_port])
            self._processes.append(e)
            g, self._port = _start_hop([r_port, e_port])
            self._processes.append(g)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            process.wait(10)

    def cpu_seconds(self) -> float:
        """CPU the four hops have spent so far."""
        return sum(cpu_seconds(process.pid) for process in self._processes)

    async def open(self) -> None:
        """Opens the stream to G and warms the chain up."""
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self._port}")
        await self._channel.channel_ready()
        self._call = self._channel.stream_stream(f"/{_SERVICE}/Stream", _same, _same)()
        for _ in range(WARM_UP):
            await self.round_trip()

    async def round_trip(self) -> float:
        """One message through the chain and back, in ms."""
        start = time.perf_counter()
        await self._call.write(PAYLOAD)
        await self._call.read()
        return (time.perf_counter() - start) * 1000

    async def close(self) -> None:
        if self._call is not None:
            await self._call.done_writing()
        if self._channel is not None:
            await self._channel.close()


async def _time_chain(chain: EchoChain, n: int) -> tuple[list[float], float]:
    """n round trips after the warm-up, and the CPU every process (the four hops and this
    client) spent per round trip, in ms."""
    await chain.open()
    try:
        cpu = chain.cpu_seconds() + time.process_time()
        samples = []
        for i in range(n):
            samples.append(await chain.round_trip())
            progress(i + 1, n, "echo chain")
        cpu = chain.cpu_seconds() + time.process_time() - cpu
    finally:
        await chain.close()
    return samples, 1000 * cpu / n


def measure_echo_chain(n: int = 1000) -> dict[str, Any]:
    """Round trips of one stream message through the four-process echo chain: summarize()'s
    figures (n, p50_ms, p90_ms, p99_ms, ...), `cpu_ms_per_round_trip` of all five processes,
    and the samples themselves under `samples_ms`. (The skeleton bench times the chain in
    turns with `help` instead, through `EchoChain`.)"""
    with EchoChain() as chain:
        samples, cpu_ms = asyncio.run(_time_chain(chain, n))
    return {**summarize(samples), "cpu_ms_per_round_trip": round(cpu_ms, 3), "samples_ms": samples}


# --- DBOS -------------------------------------------------------------------------------


def _dbos_worker(url: str, seconds: float, concurrency: int) -> dict[str, Any]:
    """In its own process: DBOS on `url`, `concurrency` threads each running two-step
    workflows back to back; a warm-up, then `seconds` on the clock."""
    from dbos import DBOS, DBOSConfig
    from sqlalchemy import create_engine, text

    writes = create_engine(url, pool_size=concurrency, max_overflow=0, isolation_level="AUTOCOMMIT")
    with writes.connect() as conn:
        conn.execute(text("CREATE TABLE bench_writes (workflow text NOT NULL, step int NOT NULL)"))
    config: DBOSConfig = {
        "name": "bench-peers",
        "system_database_url": url,
        "sys_db_pool_size": concurrency + 8,
        "log_level": "WARNING",
    }
    DBOS(config=config)

    @DBOS.step()
    def write(step: int) -> None:
        with writes.connect() as conn:
            conn.execute(
                text("INSERT INTO bench_writes (workflow, step) VALUES (:w, :s)"),
                {"w": DBOS.workflow_id, "s": step},
            )

    @DBOS.workflow()
    def two_steps() -> None:
        write(1)
        write(2)

    DBOS.launch()
    try:
        ended: list[tuple[float, float]] = []  # (when, took) of every workflow
        clock = {"start": float("inf"), "stop": float("inf")}
        warm_until = time.perf_counter() + DBOS_WARM_UP_SECONDS

        def run() -> None:
            while (began := time.perf_counter()) < clock["stop"]:
                two_steps()
                now = time.perf_counter()
                ended.append((now, now - began))  # list.append is atomic

        threads = [threading.Thread(target=run) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        time.sleep(max(0.0, warm_until - time.perf_counter()))
        cpu, database = time.process_time(), postgres_cpu_seconds()
        clock["start"] = time.perf_counter()
        clock["stop"] = clock["start"] + seconds
        for thread in threads:
            thread.join()
        # The rate and latencies count the workflows that ended on the clock; the CPU, every
        # workflow that ended after it started (the last ones end a workflow past the stop).
        cpu = time.process_time() - cpu
        database_after = postgres_cpu_seconds()
        samples = [1000 * took for when, took in ended if clock["start"] <= when < clock["stop"]]
        after_start = max(1, sum(1 for when, _ in ended if when >= clock["start"]))
        with writes.connect() as conn:
            states: dict[str, int] = dict(
                conn.execute(
                    text("SELECT status, count(*) FROM dbos.workflow_status GROUP BY status")
                ).all()
            )
            per_workflow: dict[int, int] = dict(
                conn.execute(
                    text(
                        "SELECT n, count(*) FROM (SELECT count(*) AS n FROM bench_writes"
                        " GROUP BY workflow) AS w GROUP BY n"
                    )
                ).all()
            )
    finally:
        DBOS.destroy()
        writes.dispose()
    if set(per_workflow) != {2} or per_workflow[2] != states.get("SUCCESS"):
        raise RuntimeError(f"workflows {states}, writes per workflow {per_workflow}")
    result: dict[str, Any] = {
        "workflows": len(samples),
        "seconds": seconds,
        "concurrency": concurrency,
        "workflows_per_s": round(len(samples) / seconds, 1),
        "latency": summarize(samples),
        "cpu_ms_per_workflow": {"dbos process": round(1000 * cpu / after_start, 2)},
        "states": {str(k): int(v) for k, v in states.items()},
    }
    if database is not None and database_after is not None:
        result["cpu_ms_per_workflow"]["postgres"] = round(
            1000 * (database_after - database) / after_start, 2
        )
    return result


def measure_dbos(seconds: float = 10.0, concurrency: int = 4) -> dict[str, Any]:
    """Two-step DBOS workflows per second on a fresh PostgreSQL database (BENCH_POSTGRES_DSN,
    else TEST_POSTGRES_DSN, else the local server), `concurrency` in flight for `seconds`:
    workflows_per_s, latency (summarize()), CPU ms per workflow of the DBOS process and of
    PostgreSQL, and the final states, plus the dbos version."""
    from importlib.metadata import version

    from bench.databases import database

    with database("postgres", Path(tempfile.gettempdir()), "bench_dbos") as url:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.peers",
                "--dbos-worker",
                url,
                str(seconds),
                str(concurrency),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    if out.returncode != 0:
        raise RuntimeError(f"DBOS worker failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return {"dbos_version": version("dbos"), **json.loads(out.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="echo-chain round trips")
    parser.add_argument("--seconds", type=float, default=10.0, help="DBOS run on the clock")
    parser.add_argument("--concurrency", type=int, default=4, help="DBOS workflows in flight")
    parser.add_argument("--hop", nargs="+", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dbos-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hop:
        run_on_loop(_serve_hop(args.hop[0], args.hop[1:]))
        return
    if args.dbos_worker:
        url, seconds, concurrency = args.dbos_worker
        print(json.dumps(_dbos_worker(url, float(seconds), int(concurrency))))
        return
    echo = measure_echo_chain(args.requests)
    echo.pop("samples_ms")
    print(
        json.dumps(
            {"echo_chain": echo, "dbos": measure_dbos(args.seconds, args.concurrency)}, indent=2
        )
    )


if __name__ == "__main__":
    main()
