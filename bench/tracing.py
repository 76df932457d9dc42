"""What tracing adds to a help round trip: the whole stack with tracing off against on.

    python -m bench.tracing [--requests 200] [--rounds 2] [--out DIR]

Starts the five services as processes (as `make run` does) with `tracing_exporter` "" (off)
and then "console" (every span one JSON line on the service's stderr, which the stack writes
to its log file), in turns for `--rounds` rounds so that drift of the machine hits both alike,
and times `help` back to back through the gateway (gateway → router, gateway → engine →
storage, each call a span) `--requests` times per round. Results go to
bench/results/tracing.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from bench.machine import describe_machine
from bench.report import summarize
from bench.skeleton import PLAYER, _connect, _time
from services.stack import SERVICES, Stack

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {"off": "", "console": "console"}


async def _help_round_trips(stack: Stack, n: int, label: str) -> list[float]:
    client, _ = await _connect(stack)
    try:
        await client.join(PLAYER, "Bench", "en_us")
        return await _time(label, n, lambda: client.chat(PLAYER, "help"))
    finally:
        await client.close()


def _spans_logged(stack: Stack) -> int:
    """Lines of exported spans in the services' logs."""
    count = 0
    for process in stack.processes.values():
        with process.log_path.open(encoding="utf-8", errors="replace") as log:
            count += sum(1 for line in log if '"span_id"' in line)
    return count


def measure(mode: str, n: int) -> tuple[list[float], int]:
    exporter = MODES[mode]
    env = {f"{spec.env_prefix}TRACING_EXPORTER": exporter for spec in SERVICES}
    with tempfile.TemporaryDirectory() as data:
        stack = Stack(Path(data), extra_env=env)
        stack.start(timeout=60)
        try:
            samples = asyncio.run(_help_round_trips(stack, n, f"help, tracing {mode}"))
        finally:
            stack.stop()
        return samples, _spans_logged(stack)


def _markdown(results: dict[str, object]) -> str:
    machine = results["machine"]
    summaries: dict[str, dict[str, float]] = results["round_trips"]  # type: ignore[assignment]
    lines = [
        "# Tracing: a help round trip with spans off and on",
        "",
        f"Run {results['date']} with `{results['command']}`.",
        "",
        f"Machine: {json.dumps(machine)}",
        "",
        "Every service a separate process on loopback (services.stack); `help` back to back "
        "through the gateway; the modes alternate per round. `console`: each span one JSON line "
        "on the service's stderr (its log file). Off: `tracing_exporter` empty, no span made.",
        "",
        "| tracing | n | p50 ms | p90 ms | p99 ms | mean ms | spans exported |",
        "|---|---|---|---|---|---|---|",
    ]
    spans: dict[str, int] = results["spans_exported"]  # type: ignore[assignment]
    for mode, s in summaries.items():
        lines.append(
            f"| {mode} | {s['n']} | {s['p50_ms']} | {s['p90_ms']} | {s['p99_ms']} | "
            f"{s['mean_ms']} | {spans[mode]} |"
        )
    added = results["added_p50_ms"]
    lines += [
        "",
        f"Added by tracing (console exporter), p50: {added} ms "
        f"({results['added_p50_percent']} %); mean: {results['added_mean_ms']} ms.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    spans = dict.fromkeys(MODES, 0)
    for _ in range(args.rounds):
        for mode in MODES:
            taken, exported = measure(mode, args.requests)
            samples[mode] += taken
            spans[mode] += exported
    summaries = {mode: summarize(values) for mode, values in samples.items()}
    off, on = summaries["off"], summaries["console"]
    results: dict[str, object] = {
        "benchmark": "tracing",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": f"python -m bench.tracing --requests {args.requests} --rounds {args.rounds}",
        "machine": describe_machine(),
        "round_trips": summaries,
        "spans_exported": spans,
        "added_p50_ms": round(on["p50_ms"] - off["p50_ms"], 3),
        "added_p50_percent": round(100 * (on["p50_ms"] / off["p50_ms"] - 1), 1),
        "added_mean_ms": round(on["mean_ms"] - off["mean_ms"], 3),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tracing.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "tracing.md").write_text(_markdown(results))
    print(_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
