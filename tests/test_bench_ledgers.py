"""The ledger bench (bench/ledgers.py) fills players to the bounds and measures both kinds of
player; no timing is checked."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from bench.databases import database
from bench.ledgers import KINDS, WRITES, _measure


@pytest.mark.postgres
def test_ledger_bench_measures_fresh_and_full_players() -> None:
    with tempfile.TemporaryDirectory() as folder, database("postgres", Path(folder)) as url:
        # _measure checks itself that a full player's ledgers are still near the bounds.
        measured = asyncio.run(_measure(url, players=2, writers=2, writes=3, rounds=1))
    assert set(measured["medians"]) == set(KINDS)
    for kind in KINDS:
        for write in WRITES:
            figures = measured["medians"][kind][write]
            assert figures["wall_p50_ms"] > 0 and figures["storage_cpu_us"] >= 0
