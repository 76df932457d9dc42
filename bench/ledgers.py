"""What a journal write costs for a player whose ledgers are full, against a fresh player.

    python -m bench.ledgers [--players 200] [--writers 8] [--writes 800] [--rounds 2] [--out DIR]

Storage evicts a player's finished tasks and receipts only when a write would not fit, so an
active player's ledgers fill to the bounds (1,000 tasks and 5,000 receipts by default) and
stay there: every later write of theirs checks a full ledger, and one in so many evicts to
make room (a 64th of the bound: decision 0043). The engine bench gives each player a handful
of tasks; this bench measures the other end (decision 0042). On a fresh PostgreSQL database it
fills `players` players to both bounds (finished tasks and done receipts, written with SQL,
spread over the tables as many players' traffic would spread them; then VACUUM ANALYZE), and
times, through the storage's JournalStore and GroupCommitter in this process (as the storage
service runs its writes, without the gRPC hop), `writes` task creations and as many receipt
writes (a step's intent, RUNNING, on the task just created) spread over `writers` of those
players, and as many for as many fresh ones, the two kinds alternated `--rounds` times: each
full writer makes many writes in a row, as an active player does, so the figures are the
steady state's, evictions included. Per write: PostgreSQL's CPU, this process's CPU (the
storage's share) and the wall time. Results go to bench/results/ledgers.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import sessionmaker

from bench.cpu import postgres_cpu_seconds
from bench.databases import database
from bench.machine import describe_machine
from bench.report import progress
from bench.storage import _step_requests
from storage_service.config import StorageConfig
from storage_service.db import make_engine
from storage_service.group_commit import GroupCommitter
from storage_service.journal import JournalStore
from storage_service.ledgers import HEADROOM_SHARE, JournalBounds
from storage_service.migrate import upgrade

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("fresh", "full")
WRITES = ("CreateTask", "receipt Commit")
FULL = "bench/full-"


def _fill(engine: Engine, players: int, bounds: JournalBounds) -> None:
    """Players FULL0 .. FULL<players - 1> at both count bounds: finished tasks, done
    receipts (task i's receipts are its player's, as the engine writes them)."""
    tasks = bounds.task_max_entries
    receipts = bounds.receipt_max_entries
    with engine.begin() as connection:
        connection.execute(
            text(
                """
INSERT INTO journal_tasks (task_id, player_id, module_id, event_key, state, input, result,
                           attempts, size_bytes, created_at, updated_at)
SELECT 'fill-' || g, :prefix || (g % :players), 'bench:event', 'fill-' || g,
       'succeeded', '\\x00', NULL, 1, 300, now(), now()
FROM generate_series(0, :count - 1) AS g"""
            ),
            {"prefix": FULL, "players": players, "count": tasks * players},
        )
        connection.execute(
            text(
                """
INSERT INTO journal_receipts (step_id, task_id, player_id, position, tool, state, result,
                              codec_id, size_bytes, created_at, updated_at)
SELECT 'fill-' || g, 'fill-' || (g % :tasks), :prefix || ((g % :tasks) % :players),
       g / :tasks, 'bench.tool', 'done', '\\x00', '', 150, now(), now()
FROM generate_series(0, :count - 1) AS g"""
            ),
            {
                "prefix": FULL,
                "players": players,
                "tasks": tasks * players,
                "count": receipts * players,
            },
        )
    with engine.connect() as connection:
        autocommit = connection.execution_options(isolation_level="AUTOCOMMIT")
        autocommit.execute(text("VACUUM ANALYZE journal_tasks"))
        autocommit.execute(text("VACUUM ANALYZE journal_receipts"))


async def _block(
    store: JournalStore, committer: GroupCommitter, players: list[str], writes: int, label: str
) -> dict[str, dict[str, float]]:
    """`writes` creations, then a receipt write on each task created: CPU and wall per write."""
    figures: dict[str, dict[str, float]] = {}
    tasks: list[tuple[str, str]] = []

    async def create(i: int) -> None:
        player = players[i % len(players)]
        task, created, _ = await committer.run(
            store.create_task_unit(player, "bench:event", None, f"bench-{uuid.uuid4().hex}")
        )
        assert created
        tasks.append((player, task.task_id))

    async def receipt(i: int) -> None:
        player, task_id = tasks[i]
        intent, _ = _step_requests(player, task_id, 0)  # the step's intent, RUNNING
        response = await committer.run(store.commit_unit(intent))
        assert not response.replayed

    for name, write in zip(WRITES, (create, receipt), strict=True):
        database_cpu, own_cpu = postgres_cpu_seconds() or 0.0, time.process_time()
        walls = []
        for i in range(writes):
            start = time.perf_counter()
            await write(i)
            walls.append((time.perf_counter() - start) * 1000)
            progress(i + 1, writes, f"{label}: {name}")
        figures[name] = {
            "postgres_cpu_us": 1e6 * ((postgres_cpu_seconds() or 0.0) - database_cpu) / writes,
            "storage_cpu_us": 1e6 * (time.process_time() - own_cpu) / writes,
            "wall_p50_ms": statistics.median(walls),
        }
    return figures


async def _measure(
    url: str, players: int, writers: int, writes: int, rounds: int
) -> dict[str, Any]:
    bounds = JournalBounds.from_config(StorageConfig(database_url=url))
    engine = make_engine(url)
    try:
        upgrade(engine)
        full = [f"{FULL}{i}" for i in range(players)]
        began = time.perf_counter()
        _fill(engine, players, bounds)
        filled = time.perf_counter() - began
        store = JournalStore(sessionmaker(engine, expire_on_commit=False), bounds)
        committer = GroupCommitter(sessionmaker(engine, expire_on_commit=False))
        try:
            runs: dict[str, list[dict[str, dict[str, float]]]] = {kind: [] for kind in KINDS}
            for round_ in range(rounds):
                fresh = [f"bench/fresh-{round_}-{i}" for i in range(writers)]
                for kind, who in (("fresh", fresh), ("full", full[:writers])):
                    runs[kind].append(
                        await _block(store, committer, who, writes, f"round {round_ + 1} {kind}")
                    )
        finally:
            committer.close()
        with engine.connect() as connection:
            held = {
                table: connection.execute(
                    text(f"SELECT count(*) FROM {table} WHERE player_id = :p"), {"p": full[0]}
                ).scalar_one()
                for table in ("journal_tasks", "journal_receipts")
            }
        # A full writer's writes evicted as they went: each ledger between the bound less its
        # headroom and the bound.
        for table, bound in (
            ("journal_tasks", bounds.task_max_entries),
            ("journal_receipts", bounds.receipt_max_entries),
        ):
            assert bound - bound // HEADROOM_SHARE <= held[table] <= bound, (table, held)
    finally:
        engine.dispose()
    medians = {
        kind: {
            write: {
                figure: round(statistics.median(run[write][figure] for run in runs[kind]), 3)
                for figure in ("postgres_cpu_us", "storage_cpu_us", "wall_p50_ms")
            }
            for write in WRITES
        }
        for kind in KINDS
    }
    return {
        "bounds": {"tasks": bounds.task_max_entries, "receipts": bounds.receipt_max_entries},
        "headroom": {
            "tasks": bounds.task_max_entries // HEADROOM_SHARE,
            "receipts": bounds.receipt_max_entries // HEADROOM_SHARE,
        },
        "fill_seconds": round(filled, 1),
        "rounds": runs,
        "medians": medians,
    }


def _markdown(results: dict[str, Any]) -> str:
    machine = results["machine"]
    lines = [
        f"# Ledger benchmark — {results['date']}",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
        f"Python {machine['python']}. Command: `{results['command']}`.",
        "",
        f"{results['players']} players filled to the default bounds "
        f"({results['bounds']['tasks']} finished tasks, {results['bounds']['receipts']} done "
        f"receipts each; {results['fill_seconds']} s to fill); {results['writes']} writes of "
        f"each kind per round spread over {results['writers']} of them and over as many fresh "
        f"players, {results['rounds_run']} rounds, the median of the rounds below. A full "
        "player's write that does not fit evicts, and frees a 64th of the bound beyond its "
        f"need ({results['headroom']['tasks']} tasks, {results['headroom']['receipts']} "
        "receipts): the figures are per write, the evicting ones included.",
        "",
        "| write | player | PostgreSQL CPU µs | storage CPU µs | wall p50 ms |",
        "|---|---|---:|---:|---:|",
    ]
    for write in WRITES:
        for kind in KINDS:
            figures = results["medians"][kind][write]
            lines.append(
                f"| {write} | {kind} | {figures['postgres_cpu_us']:.0f} | "
                f"{figures['storage_cpu_us']:.0f} | {figures['wall_p50_ms']:.3f} |"
            )
    lines += [
        "",
        "Storage CPU is this process's: the JournalStore and GroupCommitter the storage "
        "service runs, without its gRPC hop. PostgreSQL CPU is every `postgres` process's on "
        "this machine.",
        "",
    ]
    return "\n".join(lines)


def _plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, write in zip(axes, WRITES, strict=True):
        database = [results["medians"][kind][write]["postgres_cpu_us"] for kind in KINDS]
        own = [results["medians"][kind][write]["storage_cpu_us"] for kind in KINDS]
        axis.bar(KINDS, database, label="PostgreSQL", color="tab:blue")
        axis.bar(KINDS, own, bottom=database, label="storage", color="tab:orange")
        axis.set_title(write)
        axis.set_ylabel("CPU µs per write")
        axis.legend()
    fig.suptitle("A journal write: a fresh player against one at the ledger bounds")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--players", type=int, default=200)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--writes", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not 1 <= args.writers <= args.players:
        parser.error(f"--writers must be between 1 and --players ({args.players})")
    if args.writes < 1 or args.rounds < 1:
        parser.error("--writes and --rounds must be at least 1")
    with tempfile.TemporaryDirectory() as folder, database("postgres", Path(folder)) as url:
        measured = asyncio.run(_measure(url, args.players, args.writers, args.writes, args.rounds))
    results = {
        "benchmark": "ledgers",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": describe_machine(),
        "command": " ".join(["python -m bench.ledgers", *sys.argv[1:]]),
        "players": args.players,
        "writers": args.writers,
        "writes": args.writes,
        "rounds_run": args.rounds,
        **measured,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ledgers.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "ledgers.md").write_text(_markdown(results))
    _plot(results, args.out / "ledgers.png")
    print(_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
