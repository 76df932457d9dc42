"""The Java game-server client's `help` round trip against the Python simulated server's, in the
same run, against one stack.

    python -m bench.java_client [--requests 200] [--warmup 50] [--rounds 2]

Starts the stack once (SQLite, free ports, plaintext on loopback) and builds clients/java.
Each round runs the Python client (services/gamesim GameServerClient) and then the Java client
(clients/java, `ExamplePlugin --bench`), each on its own connection with one player, sending
`help` one at a time after a warm-up and timing each request from send to reply at the client.
The two take turns so that drift on a shared machine hits both. Results go to
bench/results/java_client.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from system.common.v1 import common_pb2

from bench.loadgen import loadavg
from bench.machine import describe_machine
from bench.report import progress, summarize
from services.gamesim import GameServerClient
from services.stack import Stack

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def _check_script():  # type: ignore[no-untyped-def]
    """scripts/java_client_check.py: how the Java client is built and started."""
    path = ROOT / "scripts" / "java_client_check.py"
    spec = importlib.util.spec_from_file_location("java_client_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _percentiles(samples: list[float]) -> dict[str, float]:
    """bench.report.summarize plus p95 (nearest rank, as summarize's p90 and p99)."""
    summary = summarize(samples)
    ordered = sorted(samples)
    if ordered:
        summary["p95_ms"] = round(
            ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 3
        )
    return summary


async def _python_round(stack: Stack, requests: int, warmup: int, label: str) -> list[float]:
    client = GameServerClient(stack.target("gateway"), stack.server_id, stack.token)
    await client.connect()
    player = f"bench-py-{time.monotonic_ns()}"
    samples: list[float] = []
    try:
        await client.join(player, "Bench", "en_us")
        for i in range(warmup + requests):
            start = time.perf_counter()
            response = await client.chat(player, "help")
            took = (time.perf_counter() - start) * 1000
            if response.reply.result.status != common_pb2.RESULT_STATUS_SUCCEEDED:
                raise RuntimeError(f"help failed: {response}")
            if i >= warmup:
                samples.append(took)
                progress(i - warmup + 1, requests, label)
    finally:
        await client.close()
    return samples


def _java_round(
    check: Any, classpath: str, stack: Stack, requests: int, warmup: int
) -> tuple[list[float], dict[str, Any]]:
    done = subprocess.run(
        check.java_command(
            classpath,
            "--address",
            stack.target("gateway"),
            "--server-id",
            stack.server_id,
            "--bench",
            str(requests),
            "--warmup",
            str(warmup),
        ),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "SYSTEM_GAME_SERVER_TOKEN": stack.token},
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(
            f"the Java bench failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        )
    data = json.loads(line.removeprefix("BENCH "))
    return [float(x) for x in data["millis"]], data


def _plot(series: dict[str, list[float]], out: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, samples in series.items():
        ordered = sorted(samples)
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        left.plot(ordered, fractions, label=name)
    p99 = max(sorted(s)[round(0.99 * (len(s) - 1))] for s in series.values())
    left.set_xlim(0, p99 * 1.5)  # the slowest 1 % is in the tables, not drawn to scale here
    left.set_xlabel("help round trip (ms), up to 1.5 × the slower p99")
    left.set_ylabel("fraction of requests")
    left.set_title("Round-trip distribution")
    left.grid(alpha=0.3)
    left.legend()
    names = list(series)
    right.boxplot([series[n] for n in names], showfliers=False)
    right.set_xticks(range(1, len(names) + 1), names)
    right.set_ylabel("ms (whiskers 1.5 IQR, outliers hidden)")
    right.set_title("Per client")
    right.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def _uname() -> str:
    try:
        return subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return " ".join(platform.uname())


def _java_version() -> str:
    java = shutil.which("java")
    if java is None:
        return "none"
    done = subprocess.run([java, "-version"], capture_output=True, text=True)
    return (done.stderr or done.stdout).splitlines()[0] if (done.stderr or done.stdout) else "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="timed requests per client")
    parser.add_argument("--warmup", type=int, default=50, help="untimed requests per round")
    parser.add_argument("--rounds", type=int, default=2, help="turns each client takes")
    options = parser.parse_args()
    if options.requests < options.rounds:
        parser.error("--requests must be at least --rounds")
    check = _check_script()
    try:
        classpath = check.build()
    except check.JavaMissing as exc:
        print(f"cannot build the Java client: {exc}", file=sys.stderr)
        return 3
    per_round = [options.requests // options.rounds] * options.rounds
    per_round[-1] += options.requests - sum(per_round)
    started_at = datetime.datetime.now(datetime.UTC)
    load_before = loadavg()
    series: dict[str, list[float]] = {"python (gamesim)": [], "java (clients/java)": []}
    rounds: list[dict[str, Any]] = []
    java_info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-java-") as folder:
        stack = Stack(Path(folder), drain_seconds=0.2)
        stack.start(timeout=90)
        try:
            for number, n in enumerate(per_round, 1):
                py = asyncio.run(_python_round(stack, n, options.warmup, f"python round {number}"))
                java, java_info = _java_round(check, classpath, stack, n, options.warmup)
                print(f"java round {number}: {len(java)} requests", file=sys.stderr)
                series["python (gamesim)"] += py
                series["java (clients/java)"] += java
                rounds.append(
                    {
                        "round": number,
                        "python": _percentiles(py),
                        "java": _percentiles(java),
                    }
                )
        finally:
            stack.stop()
    summaries = {name: _percentiles(samples) for name, samples in series.items()}
    results = {
        "benchmark": "java_client",
        "time_utc": started_at.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "machine": {
            **describe_machine(),
            "uname": _uname(),
            "nproc": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
            "java": _java_version(),
        },
        "settings": {
            "requests_per_client": options.requests,
            "warmup_per_round": options.warmup,
            "rounds": options.rounds,
            "transport": "plaintext on loopback, one connection per client, one request at a time",
        },
        "java_client": {k: v for k, v in java_info.items() if k != "millis"},
        "summary": summaries,
        "rounds": rounds,
        "samples_ms": {name: [round(x, 3) for x in s] for name, s in series.items()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "java_client.json").write_text(json.dumps(results, indent=2) + "\n")
    plotted = _plot(series, RESULTS / "java_client.png")
    machine = results["machine"]
    lines = [
        f"# Java client benchmark — {results['time_utc']}",
        "",
        f"Machine: `{machine['uname']}`; nproc {machine['nproc']}; {machine['cpu']}, "
        f"{machine['memory_gib']} GiB; Python {machine['python']}; {machine['java']}",
        f"Load average before / after: {machine['loadavg_before']} / {machine['loadavg_after']}",
        "",
        "`help` round trip through the whole stack (gateway → router → engine → storage and back),",
        "timed at the client from send to reply, one request at a time on one connection, "
        f"{options.requests} timed requests per client in {options.rounds} alternating rounds "
        f"after {options.warmup} warm-up requests per round; plaintext on loopback, one stack.",
        "",
        "| client | n | p50 ms | p95 ms | p99 ms | mean ms | min ms | max ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        lines.append(
            f"| {name} | {s['n']} | {s['p50_ms']} | {s['p95_ms']} | {s['p99_ms']} | "
            f"{s['mean_ms']} | {s['min_ms']} | {s['max_ms']} |"
        )
    lines += ["", "Per round (p50 / p95 ms):", ""]
    for r in rounds:
        lines.append(
            f"- round {r['round']}: python {r['python']['p50_ms']} / {r['python']['p95_ms']}, "
            f"java {r['java']['p50_ms']} / {r['java']['p95_ms']}"
        )
    lines += [
        "",
        "![round trips](java_client.png)"
        if plotted
        else "(no plot: matplotlib is not installed in this environment)",
        "",
    ]
    (RESULTS / "java_client.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
