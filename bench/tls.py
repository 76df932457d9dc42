"""The game-server stream over TLS against plaintext, in the same run.

    python -m bench.tls [--requests 400] [--connects 30]

Starts two stacks as processes (as `make run` does): one whose gateway serves its public port
over TLS (a throwaway CA from services.runtime.pki), one in plaintext. Then, alternating
between them in rounds so that machine noise falls on both alike, it times `help` through the
gateway on an open connection, and the set-up of a new game-server connection (channel, TLS
handshake, hello, welcome). Results go to bench/results/tls.{json,md,png}.
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

from bench.machine import describe_machine
from bench.report import progress, summarize
from services.gamesim import GameServerClient
from services.runtime.pki import Authority
from services.stack import Stack

RESULTS = Path(__file__).resolve().parent / "results"
ROUNDS = 8
PLAYER = "00000000-0000-4000-8000-0000000071e5"


def _client(stack: Stack, tls_ca: bytes | None) -> GameServerClient:
    return GameServerClient(stack.target("gateway"), stack.server_id, stack.token, tls_ca=tls_ca)


async def _measure(
    stacks: dict[str, tuple[Stack, bytes | None]], requests: int, connects: int
) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {
        name: {"help": [], "connect": []} for name in stacks
    }
    clients: dict[str, GameServerClient] = {}
    for name, (stack, ca) in stacks.items():
        clients[name] = _client(stack, ca)
        await clients[name].connect()
        await clients[name].join(PLAYER, "Bench", "en_us")
        for _ in range(10):  # warm-up: routes, caches, first-call imports
            await clients[name].chat(PLAYER, "help")
    per_round = max(requests // ROUNDS, 1)
    connects_per_round = max(connects // ROUNDS, 1)
    total = ROUNDS * len(stacks)
    done = 0
    try:
        for _ in range(ROUNDS):
            for name, (stack, ca) in stacks.items():
                for _ in range(per_round):
                    start = time.perf_counter()
                    reply = await clients[name].chat(PLAYER, "help")
                    samples[name]["help"].append((time.perf_counter() - start) * 1000)
                    if reply.reply.result.card.title != "Assistant help":
                        raise RuntimeError(f"{name}: unexpected reply {reply}")
                for _ in range(connects_per_round):
                    # A second server id is not allowed; reconnecting as the same one needs the
                    # first connection closed, so time a fresh one and close it.
                    await clients[name].close()
                    fresh = _client(stack, ca)
                    start = time.perf_counter()
                    await fresh.connect()
                    samples[name]["connect"].append((time.perf_counter() - start) * 1000)
                    clients[name] = fresh
                    await fresh.join(PLAYER, "Bench", "en_us")
                done += 1
                progress(done, total, "help and connects")
    finally:
        for client in clients.values():
            await client.close()
    return samples


def _plot(summary: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in (
        (axes[0], "help", "help round trip on an open stream"),
        (axes[1], "connect", "new connection until welcome"),
    ):
        names = list(summary)
        x = range(len(names))
        for offset, (pct, color) in enumerate((("p50_ms", "tab:blue"), ("p99_ms", "tab:orange"))):
            ax.bar(
                [i + offset * 0.38 for i in x],
                [summary[n][key][pct] for n in names],
                width=0.38,
                color=color,
                label=pct.replace("_ms", ""),
            )
        ax.set_xticks([i + 0.19 for i in x], names)
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--connects", type=int, default=40)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as data:
        root = Path(data)
        authority = Authority(root / "pki")
        cert = authority.issue("gateway")
        plain = Stack(
            root / "plain", service_env={"gateway": {"SYSTEM_GATEWAY_LOG_LEVEL": "WARNING"}}
        )
        tls = Stack(
            root / "tls",
            service_env={
                "gateway": {
                    "SYSTEM_GATEWAY_PUBLIC_TLS_CERT_FILE": str(cert.cert_file),
                    "SYSTEM_GATEWAY_PUBLIC_TLS_KEY_FILE": str(cert.key_file),
                    "SYSTEM_GATEWAY_LOG_LEVEL": "WARNING",
                }
            },
        )
        plain.start(timeout=90)
        try:
            tls.start(timeout=90)
            try:
                samples = asyncio.run(
                    _measure(
                        {
                            "plaintext": (plain, None),
                            "TLS": (tls, authority.ca_file.read_bytes()),
                        },
                        args.requests,
                        args.connects,
                    )
                )
            finally:
                tls.stop()
        finally:
            plain.stop()

    summary = {name: {k: summarize(v) for k, v in kinds.items()} for name, kinds in samples.items()}
    ratio = {
        key: round(summary["TLS"][key]["p50_ms"] / summary["plaintext"][key]["p50_ms"], 2)
        for key in ("help", "connect")
    }
    results = {
        "benchmark": "tls",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": describe_machine(),
        "rounds": ROUNDS,
        "summary": summary,
        "tls_over_plaintext_p50": ratio,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tls.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        f"# Game-server stream over TLS against plaintext — {results['date']}",
        "",
        "Machine: {cpu}, {cores} cores, {memory_gib} GiB, {os}, Python {python}".format(
            **results["machine"]
        ),
        "",
        "Two stacks as processes, alternated in "
        f"{ROUNDS} rounds; `python -m bench.tls`. TLS: ECDSA P-256 certificate, gRPC's default "
        "cipher suites.",
        "",
        "| path | transport | n | p50 ms | p90 ms | p99 ms | mean ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, label in (
        ("help", "`help` on an open stream"),
        ("connect", "new connection to welcome"),
    ):
        for name in summary:
            s = summary[name][key]
            lines.append(
                f"| {label} | {name} | {s['n']} | {s['p50_ms']} | {s['p90_ms']} | {s['p99_ms']} "
                f"| {s['mean_ms']} |"
            )
    lines += [
        "",
        f"TLS / plaintext at p50: help {ratio['help']}×, connection set-up {ratio['connect']}×.",
        "",
    ]
    (RESULTS / "tls.md").write_text("\n".join(lines))
    _plot(summary, RESULTS / "tls.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
