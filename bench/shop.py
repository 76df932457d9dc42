"""A shop purchase (quote, then confirm) end to end through the gateway.

    python -m bench.shop [--requests 200] [--seconds 8] [--backends sqlite,postgres]

Starts the five services as processes (as `make run` does) on each storage backend (SQLite,
and a fresh PostgreSQL database on BENCH_POSTGRES_DSN, else TEST_POSTGRES_DSN, else the local
server, dropped at the end), connects a simulated game server with a well-stocked shop, and:

1. one player, one purchase after another: `/buy minecraft:torch 1` (the quote: the game
   server's listing and balance, and the offer written to storage), then a press of the
   quote's confirm button (the offer taken and the order placed in one storage transaction,
   the game server's buy, the order settled): p50/p99 of the quote, the confirm and the
   purchase;
2. beside it, in the same run, the storage work of one purchase alone: the two document
   reads and three commits the offer tools make, sent straight to storage with the engine's
   credential (the share of a purchase that is storage), and the take transaction alone;
3. players buying at once (closed loop, each player one purchase after another) for a few
   seconds per level, doubling the players until p99 passes 250 ms: purchases per second and
   latency per level; the most purchases per second whose p99 stays under 250 ms.

Every purchase is checked afterwards: the world's balances went down by exactly the price of
the purchases confirmed (none charged twice, none lost). Results go to
bench/results/shop.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
from system.common.v1 import common_pb2
from system.storage.v1 import (
    journal_pb2,
    journal_pb2_grpc,
    player_data_pb2,
    player_data_pb2_grpc,
)

from bench.databases import database
from bench.machine import describe_machine
from bench.report import progress, summarize
from services.gamesim import GameServerClient
from services.gamesim.world import World
from services.stack import Stack

RESULTS = Path(__file__).resolve().parent / "results"
ITEM = "minecraft:torch"
P99_LIMIT_MS = 250.0
RICH = 10**12
"""Every bench player's balance: no purchase is refused for money."""


def _world() -> World:
    world = World()
    world.shop.listings[ITEM].stock = RICH  # no purchase is refused for stock either
    return world


class Buyer:
    """One player buying torches through the gateway, one purchase after another."""

    def __init__(self, client: GameServerClient, player_id: str) -> None:
        self.client = client
        self.player_id = player_id
        self.purchases = 0

    async def purchase(self) -> tuple[float, float]:
        """Quote, then confirm; returns (quote ms, confirm ms)."""
        started = time.perf_counter()
        quoted = await self.client.chat(self.player_id, f"/buy {ITEM} 1")
        card = quoted.reply.result.card
        if quoted.reply.result.status != common_pb2.RESULT_STATUS_SUCCEEDED or not card.buttons:
            raise RuntimeError(f"no quote: {quoted.reply.result}")
        middle = time.perf_counter()
        done = await self.client.press(self.player_id, card, card.buttons[0])
        if done.reply.result.status != common_pb2.RESULT_STATUS_SUCCEEDED:
            raise RuntimeError(f"the purchase failed: {done.reply.result}")
        self.purchases += 1
        ended = time.perf_counter()
        return (middle - started) * 1000, (ended - middle) * 1000


async def _join(client: GameServerClient, count: int, prefix: str) -> list[Buyer]:
    buyers = []
    for i in range(count):
        player_id = f"{prefix}-{i:03d}-{uuid.uuid4().hex[:8]}"
        await client.join(player_id, f"Buyer{i}", "en_us")
        client.world.player(player_id).balance = RICH
        buyers.append(Buyer(client, player_id))
    return buyers


async def one_player(client: GameServerClient, n: int, label: str) -> dict[str, list[float]]:
    (buyer,) = await _join(client, 1, "solo")
    for _ in range(5):  # warm-up: connections, caches, first-call imports
        await buyer.purchase()
    samples: dict[str, list[float]] = {"quote": [], "confirm": [], "purchase": []}
    for i in range(n):
        quote, confirm = await buyer.purchase()
        samples["quote"].append(quote)
        samples["confirm"].append(confirm)
        samples["purchase"].append(quote + confirm)
        progress(i + 1, n, f"{label} one player")
    return samples


async def storage_alone(stack: Stack, n: int, label: str) -> dict[str, list[float]]:
    """The offer tools' six storage calls of one purchase, sent straight to storage."""
    channel = grpc.aio.insecure_channel(stack.target("storage"))
    metadata = stack.credential("engine")
    documents = player_data_pb2_grpc.PlayerDataServiceStub(channel)
    journal = journal_pb2_grpc.JournalServiceStub(channel)
    player = f"bench-storage-{uuid.uuid4().hex[:8]}"

    def key(storage_type: str) -> journal_pb2.DocumentKey:
        return journal_pb2.DocumentKey(
            player_id=player, owner_module="system:shop", storage_type=storage_type
        )

    async def read(storage_type: str) -> int:
        try:
            response = await documents.GetDocument(
                player_data_pb2.GetDocumentRequest(key=key(storage_type)), metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return 0
        return response.document.version

    async def commit(*operations: journal_pb2.CommitOperation) -> journal_pb2.CommitResponse:
        return await journal.Commit(
            journal_pb2.CommitRequest(
                request_id=uuid.uuid4().hex, player_id=player, operations=operations
            ),
            metadata=metadata,
        )

    def put(storage_type: str, version: int) -> journal_pb2.CommitOperation:
        return journal_pb2.CommitOperation(
            put=journal_pb2.DocumentPut(
                key=key(storage_type),
                expected_version=version,
                data=b'{"bench": true}',
                codec_id="application/json",
            )
        )

    async def purchase_calls() -> float:
        order = f"system:order/{uuid.uuid4().hex}"
        version = await read("system:offer")  # offer.make
        made = await commit(put("system:offer", version))
        await read("system:offer")  # offer.take
        started = time.perf_counter()
        taken = await commit(
            journal_pb2.CommitOperation(
                delete=journal_pb2.DocumentDelete(
                    key=key("system:offer"), expected_version=made.versions[0]
                )
            ),
            put(order, 0),
        )
        take = (time.perf_counter() - started) * 1000
        await commit(put(order, taken.versions[1]))  # order.settle, over take's version
        return take

    try:
        for _ in range(5):
            await purchase_calls()
        samples: dict[str, list[float]] = {
            "storage calls of a purchase": [],
            "take transaction": [],
        }
        for i in range(n):
            started = time.perf_counter()
            take = await purchase_calls()
            samples["storage calls of a purchase"].append((time.perf_counter() - started) * 1000)
            samples["take transaction"].append(take)
            progress(i + 1, n, f"{label} storage alone")
        return samples
    finally:
        await channel.close()


async def at_once(
    client: GameServerClient, players: int, seconds: float, label: str
) -> dict[str, Any]:
    buyers = await _join(client, players, f"load{players}")
    for buyer in buyers:  # warm-up: each player's first purchase
        await buyer.purchase()
    latencies: list[float] = []
    failures: list[str] = []
    deadline = time.perf_counter() + seconds

    async def loop(buyer: Buyer) -> None:
        while time.perf_counter() < deadline:
            try:
                quote, confirm = await buyer.purchase()
            except Exception as exc:  # counted, not fatal: the figure says how many
                failures.append(str(exc)[:200])
                continue
            latencies.append(quote + confirm)

    started = time.perf_counter()
    await asyncio.gather(*(loop(buyer) for buyer in buyers))
    elapsed = time.perf_counter() - started
    progress(1, 1, f"{label} {players} players")
    return {
        "players": players,
        "purchases": len(latencies),
        "purchases_per_s": round(len(latencies) / elapsed, 1),
        "failures": len(failures),
        "failure_examples": failures[:3],
        **summarize(latencies),
    }


def _audit(world: World) -> dict[str, Any]:
    """Each bench player's debits against the purchases they confirmed."""
    price = world.shop.listings[ITEM].price
    charged = sum(RICH - state.balance for state in world.players.values())
    delivered = sum(state.inventory[ITEM] - 32 for state in world.players.values())
    return {"coins_charged": charged, "torches_delivered": delivered, "price": price}


async def _bench(stack: Stack, args: argparse.Namespace, label: str) -> dict[str, Any]:
    client = GameServerClient(stack.target("gateway"), stack.server_id, stack.token, _world())
    await client.connect()
    try:
        single = await one_player(client, args.requests, label)
        alone = await storage_alone(stack, args.requests, label)
        levels = []
        players = 1
        while players <= args.max_players:
            level = await at_once(client, players, args.seconds, label)
            levels.append(level)
            if level.get("p99_ms", 0.0) > P99_LIMIT_MS:
                break
            players *= 2
        confirmed = (
            args.requests + 5 + sum(level["purchases"] + level["players"] for level in levels)
        )
        audit = {**_audit(client.world), "purchases_confirmed": confirmed}
    finally:
        await client.close()
    summaries = {name: summarize(samples) for name, samples in {**single, **alone}.items()}
    under = [level for level in levels if level.get("p99_ms", 1e9) <= P99_LIMIT_MS]
    return {
        "one_player": summaries,
        "storage_share_p50": round(
            summaries["storage calls of a purchase"]["p50_ms"] / summaries["purchase"]["p50_ms"], 3
        ),
        "levels": levels,
        "max_purchases_per_s_p99_under_250ms": max(
            (level["purchases_per_s"] for level in under), default=0.0
        ),
        "audit": audit,
    }


def _plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    backends = list(results["backends"])
    names = ["quote", "confirm", "purchase", "storage calls of a purchase", "take transaction"]
    width = 0.8 / max(len(backends), 1)
    for i, backend in enumerate(backends):
        one = results["backends"][backend]["one_player"]
        left.bar(
            [x + i * width for x in range(len(names))],
            [one[name]["p50_ms"] for name in names],
            width,
            label=f"{backend} p50",
        )
        left.scatter(
            [x + i * width for x in range(len(names))],
            [one[name]["p99_ms"] for name in names],
            marker="_",
            s=200,
            color="black",
        )
    left.set_xticks(
        [x + width * (len(backends) - 1) / 2 for x in range(len(names))],
        ["quote", "confirm", "purchase", "storage alone", "take txn"],
    )
    left.set_ylabel("ms (bars p50, ticks p99)")
    left.set_title("One player")
    left.legend()
    for backend in backends:
        levels = results["backends"][backend]["levels"]
        right.plot(
            [level["purchases_per_s"] for level in levels],
            [level["p99_ms"] for level in levels],
            marker="o",
            label=backend,
        )
        for level in levels:
            right.annotate(
                f"{level['players']}p", (level["purchases_per_s"], level["p99_ms"]), fontsize=8
            )
    right.axhline(P99_LIMIT_MS, color="grey", linestyle="--", label="250 ms")
    right.set_xlabel("purchases / s")
    right.set_ylabel("p99 ms")
    right.set_title("Players buying at once")
    right.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def _markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# Shop purchase benchmark — {results['date']}",
        "",
        "Machine: {cpu}, {cores} cores, {memory_gib} GiB, {os}, Python {python}".format(
            **results["machine"]
        ),
        "",
        "A purchase = `/buy minecraft:torch 1` (quote) then a press of the quote's confirm "
        "button, through the gateway, five service processes and a simulated game server. "
        "`storage calls of a purchase`: the offer tools' two reads and three commits sent "
        "straight to storage in the same run; `take transaction`: the one commit that deletes "
        "the offer and creates the order.",
        "",
    ]
    for backend, result in results["backends"].items():
        lines += [
            f"## {backend}",
            "",
            "| one player | n | p50 ms | p90 ms | p99 ms | mean ms |",
            "|---|---|---|---|---|---|",
        ]
        for name, s in result["one_player"].items():
            lines.append(
                f"| {name} | {s['n']} | {s['p50_ms']} | {s['p90_ms']} | {s['p99_ms']} | "
                f"{s['mean_ms']} |"
            )
        lines += [
            "",
            f"Storage's share of a purchase (p50 of its calls alone / purchase p50): "
            f"**{result['storage_share_p50']:.0%}**",
            "",
            "| players at once | purchases | purchases/s | p50 ms | p99 ms | failures |",
            "|---|---|---|---|---|---|",
        ]
        for level in result["levels"]:
            lines.append(
                f"| {level['players']} | {level['purchases']} | {level['purchases_per_s']} | "
                f"{level.get('p50_ms', '-')} | {level.get('p99_ms', '-')} | {level['failures']} |"
            )
        audit = result["audit"]
        lines += [
            "",
            f"Most purchases per second with p99 under 250 ms: "
            f"**{result['max_purchases_per_s_p99_under_250ms']}**",
            "",
            f"Audit: {audit['purchases_confirmed']} purchases confirmed, "
            f"{audit['coins_charged']} coins charged at {audit['price']} each, "
            f"{audit['torches_delivered']} torches delivered.",
            "",
        ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--max-players", type=int, default=64)
    parser.add_argument("--backends", default="sqlite,postgres")
    args = parser.parse_args()

    results: dict[str, Any] = {
        "benchmark": "shop",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": describe_machine(),
        "backends": {},
    }
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory() as folder, database(backend, Path(folder)) as url:
            stack = Stack(
                Path(folder) / "stack",
                service_env={
                    "storage": {"SYSTEM_STORAGE_DATABASE_URL": url},
                    "engine": {"SYSTEM_ENGINE_LOG_LEVEL": "WARNING"},
                    "gateway": {"SYSTEM_GATEWAY_LOG_LEVEL": "WARNING"},
                },
            )
            stack.start(timeout=90)
            try:
                results["backends"][backend] = asyncio.run(_bench(stack, args, backend))
            finally:
                stack.stop()
        audit = results["backends"][backend]["audit"]
        if audit["coins_charged"] != audit["purchases_confirmed"] * audit["price"]:
            print(f"AUDIT FAILED on {backend}: {audit}", file=sys.stderr)
            return 1
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "shop.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    text = _markdown(results)
    (RESULTS / "shop.md").write_text(text)
    _plot(results, RESULTS / "shop.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
