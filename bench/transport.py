"""What one gRPC exchange between two Python processes costs on this machine, with nothing
behind it: an empty unary call, and one message each way on an open stream (how the engine's
journal and game-tool calls travel: decision 0008), one exchange in flight; and the same on
STREAMS open streams at once (`streams`), as the stack's exchanges overlap under load (16
submissions and every worker's calls in flight), where each process wakes once for several
messages. The CPU both processes spend per exchange is the floor under any figure that passes
messages between the stack's processes; the engine bench multiplies it by the exchanges an
event task makes.

    python -m bench.transport [--calls 3000]

Both ends are processes of their own (`grpc.aio`, generic handlers on raw bytes, so no
protobuf work is counted), on loopback, one call in flight, on the event loop the services
run on (`services.runtime.main.run_on_loop`: uvloop where installed, decision 0037).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from bench.cpu import cpu_seconds
from services.runtime.main import run_on_loop
from services.stack.launcher import free_port

__all__ = ["measure_transport", "serve_echo"]

_SERVICE = "bench.transport.Echo"
PAYLOAD = b"x" * 200
"""About the size of a journal call's message."""
WARM_UP = 300
STREAMS = 16
"""Streams in flight at once for the `streams` kind (as many as the engine bench's submitters)."""
OPEN_STREAMS = {"unary": 0, "stream": 1, "streams": STREAMS}
"""Each kind measured, and the streams it opens (none: unary calls, one at a time)."""
KINDS = tuple(OPEN_STREAMS)


def _same(value: bytes) -> bytes:
    return value


async def serve_echo(port: int, answer: Callable[[bytes], Awaitable[bytes]]) -> None:
    """Serves `Unary` and `Stream` (a message each way) on `port`, each message answered by
    `answer`, until the process ends; prints "serving" once up."""

    async def unary(request: bytes, context: Any) -> bytes:
        return await answer(request)

    async def stream(requests: Any, context: Any) -> Any:
        async for request in requests:
            yield await answer(request)

    handler = grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _same, _same),
            "Stream": grpc.stream_stream_rpc_method_handler(stream, _same, _same),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()


async def _echo(request: bytes) -> bytes:
    return request


async def _serve(port: int) -> None:
    await serve_echo(port, _echo)


async def _client(port: int, calls: int, kind: str) -> dict[str, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        unary = channel.unary_unary(f"/{_SERVICE}/Unary", _same, _same)
        stream = channel.stream_stream(f"/{_SERVICE}/Stream", _same, _same)
        opened = [stream() for _ in range(OPEN_STREAMS[kind])]
        lanes: list[Any] = opened or [None]  # None: unary calls, one at a time
        wall: list[float] = []

        async def exchanges(call: Any, count: int, timed: bool) -> None:
            for _ in range(count):
                start = time.perf_counter()
                if call is None:
                    await unary(PAYLOAD)
                else:
                    await call.write(PAYLOAD)
                    await call.read()
                if timed:
                    wall.append(time.perf_counter() - start)

        async def run(count: int, timed: bool) -> None:
            await asyncio.gather(*(exchanges(call, count // len(lanes), timed) for call in lanes))

        warmed = len(lanes) * (WARM_UP // len(lanes))
        await run(WARM_UP, timed=False)
        cpu = time.process_time()
        await run(calls, timed=True)
        cpu = time.process_time() - cpu
        for call in opened:
            await call.done_writing()
    wall.sort()
    return {
        "client_cpu_ms": round(1000 * cpu / len(wall), 4),
        "exchanges": warmed + len(wall),
        "wall_p50_ms": round(1000 * wall[len(wall) // 2], 4),
    }


def measure_transport(calls: int = 3000) -> dict[str, dict[str, float]]:
    """CPU per exchange of each end and its wall time, for each of KINDS."""
    port = free_port()
    here = Path(__file__).resolve().parent.parent
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.transport", "--serve", str(port)],
        cwd=here,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()  # "serving"
        results: dict[str, dict[str, float]] = {}
        for kind in KINDS:
            before = cpu_seconds(server.pid)
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.transport",
                    "--calls",
                    str(calls),
                    "--client",
                    str(port),
                    kind,
                ],
                cwd=here,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            measured = json.loads(out.strip().splitlines()[-1])
            # The server's CPU counts the client's warm-up too.
            spent = cpu_seconds(server.pid) - before
            measured["server_cpu_ms"] = round(1000 * spent / measured.pop("exchanges"), 4)
            measured["in_flight"] = max(OPEN_STREAMS[kind], 1)  # unary: one call at a time
            measured["both_cpu_ms"] = round(
                measured["client_cpu_ms"] + measured["server_cpu_ms"], 4
            )
            results[kind] = measured
        return results
    finally:
        server.terminate()
        server.wait(10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        run_on_loop(_serve(args.serve))
        return
    if args.client:
        port, kind = args.client
        print(json.dumps(run_on_loop(_client(int(port), args.calls, kind))))
        return
    print(json.dumps(measure_transport(args.calls), indent=2))


if __name__ == "__main__":
    main()
