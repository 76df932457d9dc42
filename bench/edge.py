"""The gateway at its edge: overload, and one hostile game server beside an honest one.

    python -m bench.edge [--seconds 12] [--players 50] [--in-flight 8]

Starts the stack as processes (as `make run` does), with tokens for three game servers.

1. **Overload.** `--players` players on one game server each keep `--in-flight` different
   requests in flight at once (several times what the engine queues: a player has one run at
   a time), for `--seconds`. Counted per second: replies, BUSY answers, errors (refused frames,
   failed replies other than BUSY); BUSY latency p50/p99 (the gateway answers BUSY before
   routing); each service's RSS before and after.
2. **Two servers.** An honest server's players chat (`help`, `/inventory`, which calls a game
   tool through the relay) in a closed loop while, in alternate phases of the same run, a
   hostile server writes frames at full speed: Structs nested 20 deep and 200 KB tool answers,
   10,000-character ids, undecodable bytes, requests for players it never joined, JOINs of the
   honest server's player ids. Reported: the honest server's p50/p99 and error count with and
   without the hostile one, the hostile frames per second, the gateway's RSS and log growth.

Results go to bench/results/edge.{json,md,png}, with the machine (`uname -a`, `nproc`) and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import struct_pb2
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

from bench.machine import describe_machine
from bench.report import summarize
from services.gamesim import GameServerClient
from services.gamesim.client import FrameRefused, GatewayRefused
from services.stack import Stack

RESULTS = Path(__file__).resolve().parent / "results"
METHOD = "/system.gateway.v1.GameGatewayService/Connect"
TOKENS = {
    "sim": "token-of-the-sim-server",
    "honest": "token-of-honest",
    "hostile": "token-of-hostile",
}
BUSY = "system.error.busy"
TEXTS = ("help", "/history", "背包", "/inventory", "帮助", "/help", "历史", "/system help")
PHASES = ("alone", "with hostile", "alone", "with hostile")


def _player(index: int) -> str:
    return f"00000000-0000-4000-8000-{index:012d}"


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _memory(stack: Stack) -> dict[str, float]:
    """RSS per service, MiB."""
    return {
        name: round(_rss_kib(proc.process.pid) / 1024, 1) for name, proc in stack.processes.items()
    }


def _log_bytes(stack: Stack, name: str) -> int:
    try:
        return (stack.data_dir / "logs" / f"{name}.log").stat().st_size
    except OSError:
        return 0


# -- 1. overload ---------------------------------------------------------------------------------


async def overload(stack: Stack, players: int, in_flight: int, seconds: float) -> dict[str, Any]:
    client = GameServerClient(stack.target("gateway"), "sim", TOKENS["sim"])
    await client.connect()
    ids = [_player(i) for i in range(players)]
    for player in ids:
        await client.join(player, "Bench", "en_us")
    for _ in range(5):
        await client.chat(ids[0], "help")
    counts = {"replies": 0, "busy": 0, "errors": 0}
    busy_ms: list[float] = []
    reply_ms: list[float] = []
    memory_before = _memory(stack)
    deadline = time.monotonic() + seconds

    async def one(player: str, text: str) -> None:
        start = time.perf_counter()
        try:
            response = await client.chat(player, text, timeout=60)
        except (FrameRefused, GatewayRefused, TimeoutError):
            counts["errors"] += 1
            return
        took = (time.perf_counter() - start) * 1000
        result = response.reply.result
        if result.failure.key == BUSY:
            counts["busy"] += 1
            busy_ms.append(took)
        elif result.status == common_pb2.RESULT_STATUS_SUCCEEDED:
            counts["replies"] += 1
            reply_ms.append(took)
        else:
            counts["errors"] += 1

    async def player_loop(player: str) -> None:
        while time.monotonic() < deadline:
            await asyncio.gather(*(one(player, TEXTS[k % len(TEXTS)]) for k in range(in_flight)))

    started = time.perf_counter()
    await asyncio.gather(*(player_loop(p) for p in ids))
    elapsed = time.perf_counter() - started
    # Served normally right after.
    after = await client.chat(ids[0], "help")
    await client.close()
    return {
        "players": players,
        "in_flight_per_player": in_flight,
        "seconds": round(elapsed, 2),
        "per_second": {k: round(v / elapsed, 1) for k, v in counts.items()},
        "counts": counts,
        "busy_latency": summarize(busy_ms),
        "reply_latency": summarize(reply_ms),
        "served_after": after.reply.result.status == common_pb2.RESULT_STATUS_SUCCEEDED,
        "rss_mib_before": memory_before,
        "rss_mib_after": _memory(stack),
    }


# -- 2. a hostile server beside an honest one -------------------------------------------------------


def _deep(levels: int) -> struct_pb2.Struct:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    struct = struct_pb2.Struct()
    struct.update(value)
    return struct


def _hostile_frames(victims: list[str]) -> list[bytes]:
    huge = "x" * 10_000
    big = struct_pb2.Struct()
    big.update({"blob": "y" * 200_000})
    frames = [
        gateway_pb2.ConnectRequest(
            request=gateway_pb2.PlayerRequest(
                request_id="deep",
                player_id="h1",
                invoke=gateway_pb2.Invoke(
                    call=common_pb2.ModuleAction(module_id="system:help", input=_deep(20))
                ),
            )
        ),
        gateway_pb2.ConnectRequest(
            event=gateway_pb2.GameEvent(
                player_id="h1", event_type="minecraft:advancement", event_key="e", data=_deep(20)
            )
        ),
        gateway_pb2.ConnectRequest(
            request=gateway_pb2.PlayerRequest(
                request_id=huge, player_id="h1", chat=gateway_pb2.Chat(text="help")
            )
        ),
        gateway_pb2.ConnectRequest(
            presence=gateway_pb2.PlayerPresence(kind=gateway_pb2.PRESENCE_KIND_JOIN, player_id=huge)
        ),
        gateway_pb2.ConnectRequest(
            request=gateway_pb2.PlayerRequest(
                request_id="ghost", player_id="never-joined", chat=gateway_pb2.Chat(text="help")
            )
        ),
        gateway_pb2.ConnectRequest(tool_result=gateway_pb2.ToolResult(call_id="nope", output=big)),
        gateway_pb2.ConnectRequest(tool_result=gateway_pb2.ToolResult(call_id=huge)),
        *(
            gateway_pb2.ConnectRequest(
                presence=gateway_pb2.PlayerPresence(
                    kind=gateway_pb2.PRESENCE_KIND_JOIN, player_id=victim
                )
            )
            for victim in victims[:2]
        ),
    ]
    garbage = [b"\xff\xff\xff\xff", b"\x1a\x05ab", b"\x0a" + b"\xff" * 8]
    return [frame.SerializeToString() for frame in frames] + garbage


class Hostile:
    """A game server writing hostile frames as fast as its stream takes them; it reads what
    comes back (so that it is refused frame by frame, not cut off), and reconnects when cut.
    Runs in a process of its own (`_hostile_process`), so that it does not share the honest
    clients' event loop; its counts are shared with the bench process."""

    def __init__(self, target: str, victims: list[str], counts: Any) -> None:
        self.target = target
        self.frames = _hostile_frames(victims)
        self.counts = counts  # multiprocessing Array: sent, answered, reconnects

    @property
    def sent(self) -> int:
        return int(self.counts[0])

    @property
    def errors_back(self) -> int:
        return int(self.counts[1])

    @property
    def reconnects(self) -> int:
        return int(self.counts[2])

    async def run(self, stop: Any) -> None:
        hello = gateway_pb2.ConnectRequest(
            hello=gateway_pb2.Hello(server_id="hostile", protocol_version=1)
        ).SerializeToString()
        join = gateway_pb2.ConnectRequest(
            presence=gateway_pb2.PlayerPresence(kind=gateway_pb2.PRESENCE_KIND_JOIN, player_id="h1")
        ).SerializeToString()
        async with grpc.aio.insecure_channel(self.target) as channel:
            connect = channel.stream_stream(
                METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            while not stop.is_set():
                call = connect(metadata=(("authorization", f"Bearer {TOKENS['hostile']}"),))
                reader = asyncio.ensure_future(self._read(call))
                try:
                    await call.write(hello)
                    await call.write(join)
                    k = 0
                    while not stop.is_set() and not call.done():
                        await call.write(self.frames[k % len(self.frames)])
                        self.counts[0] += 1
                        k += 1
                    with contextlib.suppress(Exception):
                        await call.done_writing()
                except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                    self.counts[2] += 1
                finally:
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await asyncio.wait_for(reader, 5)
                    call.cancel()

    async def _read(self, call: Any) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            while True:
                frame = await call.read()
                if frame is grpc.aio.EOF:
                    return
                self.counts[1] += 1


def _hostile_process(target: str, victims: list[str], stop: Any, counts: Any) -> None:
    asyncio.run(Hostile(target, victims, counts).run(stop))


async def two_servers(stack: Stack, players: int, seconds: float) -> dict[str, Any]:
    honest = GameServerClient(stack.target("gateway"), "honest", TOKENS["honest"])
    await honest.connect()
    ids = [_player(1000 + i) for i in range(players)]
    for player in ids:
        await honest.join(player, "Honest", "en_us")
    for player in ids:
        await honest.chat(player, "help")
    context = multiprocessing.get_context("spawn")
    counts = context.Array("q", 3, lock=False)
    hostile = Hostile(stack.target("gateway"), ids, counts)
    phases: list[dict[str, Any]] = []
    for phase in PHASES:
        latencies: list[float] = []
        errors: list[str] = []
        stop = context.Event()
        sent_before, back_before = hostile.sent, hostile.errors_back
        log_before = _log_bytes(stack, "gateway")
        attacker = None
        if phase != "alone":
            attacker = context.Process(
                target=_hostile_process, args=(stack.target("gateway"), ids, stop, counts)
            )
            attacker.start()
            # The phase starts once the hostile server writes (its process start is not timed).
            while hostile.sent == sent_before:
                await asyncio.sleep(0.05)
            sent_before, back_before = hostile.sent, hostile.errors_back
        deadline = time.monotonic() + seconds

        async def chat_loop(
            player: str, deadline: float, latencies: list[float], errors: list[str]
        ) -> None:
            k = 0
            while time.monotonic() < deadline:
                text = ("help", "/inventory")[k % 2]
                k += 1
                start = time.perf_counter()
                try:
                    response = await honest.chat(player, text, timeout=30)
                except (FrameRefused, GatewayRefused, TimeoutError) as exc:
                    errors.append(type(exc).__name__)
                    continue
                latencies.append((time.perf_counter() - start) * 1000)
                if response.reply.result.status != common_pb2.RESULT_STATUS_SUCCEEDED:
                    errors.append(response.reply.result.failure.key)

        started = time.perf_counter()
        await asyncio.gather(*(chat_loop(p, deadline, latencies, errors) for p in ids))
        elapsed = time.perf_counter() - started
        stop.set()
        if attacker is not None:
            await asyncio.get_running_loop().run_in_executor(None, attacker.join, 30)
        phases.append(
            {
                "phase": phase,
                "honest": summarize(latencies),
                "honest_per_second": round(len(latencies) / elapsed, 1),
                "honest_errors": len(errors),
                "honest_error_kinds": sorted(set(errors)),
                "hostile_frames_per_second": round((hostile.sent - sent_before) / elapsed),
                "hostile_frames_answered": hostile.errors_back - back_before,
                "gateway_log_kib": round((_log_bytes(stack, "gateway") - log_before) / 1024, 1),
                "rss_mib": _memory(stack),
            }
        )
        print(f"  {phase}: {phases[-1]['honest']}", file=sys.stderr)
    await honest.close()
    return {
        "honest_players": players,
        "phase_seconds": seconds,
        "phases": phases,
        "hostile_reconnects": hostile.reconnects,
        "honest_frame_errors": len(honest.frame_errors),
    }


# -- report ------------------------------------------------------------------------------------------


def _combined(phases: list[dict[str, Any]], name: str) -> dict[str, Any]:
    chosen = [p for p in phases if p["phase"] == name]
    return {
        "p50_ms": round(sum(p["honest"]["p50_ms"] for p in chosen) / len(chosen), 3),
        "p99_ms": round(max(p["honest"]["p99_ms"] for p in chosen), 3),
        "errors": sum(p["honest_errors"] for p in chosen),
        "per_second": round(sum(p["honest_per_second"] for p in chosen) / len(chosen), 1),
    }


def _plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rates = results["overload"]["per_second"]
    axes[0].bar(list(rates), list(rates.values()), color=["tab:green", "tab:orange", "tab:red"])
    busy = results["overload"]["busy_latency"]
    axes[0].set_title(
        f"overload: {results['overload']['players']} players × "
        f"{results['overload']['in_flight_per_player']} in flight\n"
        f"BUSY p50 {busy.get('p50_ms')} ms, p99 {busy.get('p99_ms')} ms"
    )
    axes[0].set_ylabel("per second")
    phases = results["two_servers"]["phases"]
    labels = [f"{i + 1}. {p['phase']}" for i, p in enumerate(phases)]
    x = range(len(phases))
    axes[1].bar([i - 0.2 for i in x], [p["honest"]["p50_ms"] for p in phases], 0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [p["honest"]["p99_ms"] for p in phases], 0.4, label="p99")
    axes[1].set_xticks(list(x), labels, fontsize=8)
    axes[1].set_ylabel("ms")
    axes[1].set_title("honest server's chat round trip, phases in run order")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _markdown(results: dict[str, Any]) -> str:
    o = results["overload"]
    t = results["two_servers"]
    lines = [
        f"# The gateway at its edge: overload and a hostile game server — {results['date']}",
        "",
        f"Machine: `{results['uname']}`, nproc {results['nproc']} "
        "({cpu}, {memory_gib} GiB, Python {python}); shared with other work while it ran."
        "".format(**results["machine"]),
        "",
        "`python -m bench.edge` against the stack as processes (SQLite), one run.",
        "",
        f"## Overload: {o['players']} players × {o['in_flight_per_player']} requests in flight, "
        f"{o['seconds']} s",
        "",
        "| replies/s | BUSY/s | errors/s | BUSY p50 ms | BUSY p99 ms | reply p50 ms | reply p99 ms |",
        "|---|---|---|---|---|---|---|",
        f"| {o['per_second']['replies']} | {o['per_second']['busy']} | {o['per_second']['errors']} "
        f"| {o['busy_latency'].get('p50_ms')} | {o['busy_latency'].get('p99_ms')} "
        f"| {o['reply_latency'].get('p50_ms')} | {o['reply_latency'].get('p99_ms')} |",
        "",
        f"Served normally right after: {o['served_after']}.",
        "",
        "| service | RSS before MiB | RSS after MiB |",
        "|---|---|---|",
        *(
            f"| {name} | {o['rss_mib_before'][name]} | {o['rss_mib_after'][name]} |"
            for name in o["rss_mib_before"]
        ),
        "",
        f"## An honest server ({t['honest_players']} players chatting) beside a hostile one, "
        f"phases of {t['phase_seconds']} s",
        "",
        "| phase | honest p50 ms | honest p99 ms | honest req/s | honest errors | hostile frames/s "
        "| frames answered to hostile | gateway log KiB | gateway RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {i + 1}. {p['phase']} | {p['honest']['p50_ms']} | {p['honest']['p99_ms']} "
            f"| {p['honest_per_second']} | {p['honest_errors']} | {p['hostile_frames_per_second']} "
            f"| {p['hostile_frames_answered']} | {p['gateway_log_kib']} | {p['rss_mib']['gateway']} |"
            for i, p in enumerate(t["phases"])
        ),
        "",
        "Combined (p50: mean of the phases; p99: the worst phase):",
        "",
        "| condition | honest p50 ms | honest p99 ms | honest req/s | honest errors |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {c['p50_ms']} | {c['p99_ms']} | {c['per_second']} | {c['errors']} |"
            for name, c in results["two_servers_combined"].items()
        ),
        "",
        f"Hostile stream reconnects: {t['hostile_reconnects']}; FrameErrors the honest server "
        f"got: {t['honest_frame_errors']}.",
        "",
        "On 2 shared cores the hostile writer, the honest clients and all five services compete "
        "for the same CPU, so the honest server's latency with the hostile one running is mostly "
        "the CPU the hostile frames cost, not interference between servers; errors are the "
        "isolation figure.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--players", type=int, default=50)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--honest-players", type=int, default=10)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as data:
        stack = Stack(
            Path(data),
            server_id="sim",
            token=TOKENS["sim"],
            service_env={
                "gateway": {
                    "SYSTEM_GATEWAY_TOKENS": ",".join(f"{s}={t}" for s, t in TOKENS.items())
                }
            },
        )
        stack.start(timeout=90)
        try:
            print("overload ...", file=sys.stderr)
            over = asyncio.run(overload(stack, args.players, args.in_flight, args.seconds))
            print("two servers ...", file=sys.stderr)
            two = asyncio.run(two_servers(stack, args.honest_players, args.seconds))
        finally:
            stack.stop()

    results = {
        "benchmark": "edge",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "uname": subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip(),
        "nproc": int(subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip())
        if os.name == "posix"
        else os.cpu_count(),
        "machine": describe_machine(),
        "overload": over,
        "two_servers": two,
        "two_servers_combined": {
            name: _combined(two["phases"], name) for name in ("alone", "with hostile")
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "edge.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    text = _markdown(results)
    (RESULTS / "edge.md").write_text(text)
    try:
        _plot(results, RESULTS / "edge.png")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
