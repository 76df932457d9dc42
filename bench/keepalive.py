"""Long-lived streams at the real keepalive intervals: idle for minutes, then answered.

    python -m bench.keepalive [--idle-minutes 5]

Starts the stack as processes with the shipped keepalive policy (services.runtime.keepalive:
clients ping every 30 s, servers permit pings every 20 s and ping idle peers every 60 s),
connects a simulated game server that pings every 30 s like a plugin should, and opens every
long-lived stream the stack holds (the game server's Connect stream; the engine's journal
stream to storage and relay stream to the gateway, by `/inventory`). Then nothing happens for
several minutes — gRPC's default server policy ended such streams after about two — and the
same connection asks again. Records whether the answer came on the same stream, how many
streams each service reports ending, and the gateway's GOAWAY log lines, in
bench/results/keepalive.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from system.common.v1 import common_pb2

from bench.machine import describe_machine
from bench.report import progress
from services.gamesim import GameServerClient
from services.stack import Stack

RESULTS = Path(__file__).resolve().parent / "results"
PLAYER = "00000000-0000-4000-8000-00000000a11e"


def _log_hits(stack: Stack, needles: tuple[str, ...]) -> dict[str, int]:
    hits = {}
    for name, proc in stack.processes.items():
        text = proc.log_path.read_text(errors="replace")
        hits[name] = sum(text.count(needle) for needle in needles)
    return hits


async def _session(stack: Stack, idle_seconds: float) -> dict[str, Any]:
    client = GameServerClient(stack.target("gateway"), stack.server_id, stack.token)
    welcome = await client.connect()
    await client.join(PLAYER, "Idle", "en_us")
    before = await client.chat(PLAYER, "/inventory")
    started = time.monotonic()
    while (waited := time.monotonic() - started) < idle_seconds:
        await asyncio.sleep(min(5.0, idle_seconds - waited))
        progress(int(time.monotonic() - started), int(idle_seconds), "idle")
    progress(int(idle_seconds), int(idle_seconds), "idle")
    ask = time.perf_counter()
    after = await client.chat(PLAYER, "/inventory", timeout=30)
    answered_ms = (time.perf_counter() - ask) * 1000
    same_stream = client.welcome is not None and client.welcome.session_id == welcome.session_id
    await client.close()
    ok = common_pb2.RESULT_STATUS_SUCCEEDED
    return {
        "before_succeeded": before.reply.result.status == ok,
        "after_succeeded": after.reply.result.status == ok,
        "after_ms": round(answered_ms, 1),
        "same_game_stream": same_stream,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--idle-minutes", type=float, default=5.0)
    args = parser.parse_args()
    idle = args.idle_minutes * 60

    with tempfile.TemporaryDirectory() as data:
        stack = Stack(Path(data))
        stack.start(timeout=90)
        try:
            session = asyncio.run(_session(stack, idle))
            goaway = _log_hits(stack, ("too_many_pings", "GOAWAY"))
            reopened = _log_hits(stack, ("a Multiplex stream ended", "game server disconnected"))
        finally:
            stack.stop()

    passed = (
        session["before_succeeded"]
        and session["after_succeeded"]
        and session["same_game_stream"]
        and not any(goaway.values())
    )
    results = {
        "benchmark": "keepalive",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": describe_machine(),
        "idle_seconds": idle,
        "policy": {
            "client_ping_s": 30,
            "server_permits_ping_s": 20,
            "server_ping_s": 60,
            "ping_timeout_s": 20,
        },
        "session": session,
        "goaway_log_lines": goaway,
        "stream_end_log_lines": reopened,
        "passed": passed,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "keepalive.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        f"# Keepalive at the real intervals — {results['date']}",
        "",
        "Machine: {cpu}, {cores} cores, {memory_gib} GiB, {os}, Python {python}".format(
            **results["machine"]
        ),
        "",
        f"`python -m bench.keepalive --idle-minutes {args.idle_minutes:g}`: the stack as "
        "processes, a game server pinging every 30 s, servers permitting pings every 20 s and "
        f"pinging idle peers every 60 s; {idle / 60:g} minutes without a message on any stream.",
        "",
        f"- `/inventory` before the idle time: {'answered' if session['before_succeeded'] else 'FAILED'}",
        f"- `/inventory` after it, on the same connection: "
        f"{'answered' if session['after_succeeded'] else 'FAILED'} in {session['after_ms']} ms; "
        f"same game-server stream: {session['same_game_stream']}",
        f"- GOAWAY / too_many_pings lines in the service logs: {sum(goaway.values())}",
        f"- stream-ended lines (broken journal or relay streams, disconnected game servers): "
        f"{sum(reopened.values())}",
        "",
        f"**{'PASSED' if passed else 'FAILED'}**",
        "",
    ]
    (RESULTS / "keepalive.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
