"""The peer baselines the skeleton and engine benches measure beside their own figures
(bench/peers.py): they run and report the figures the benches read. No timing is checked."""

from __future__ import annotations

import asyncio

import pytest

from bench.peers import EchoChain, measure_dbos, measure_echo_chain
from bench.skeleton import _interleaved


def test_echo_chain_reports_round_trips_and_cpu() -> None:
    measured = measure_echo_chain(n=20)
    assert measured["n"] == 20 and len(measured["samples_ms"]) == 20
    assert 0 < measured["p50_ms"] <= measured["p90_ms"] <= measured["p99_ms"]
    assert measured["cpu_ms_per_round_trip"] > 0


def test_the_skeleton_times_its_calls_and_the_chain_in_turns() -> None:
    calls: list[str] = []

    async def ours() -> None:
        calls.append("ours")
        await asyncio.sleep(0.001)

    async def measure(pause: float) -> tuple[list[float], list[float], float]:
        await chain.open()
        try:
            return await _interleaved("test", 30, ours, chain, pause)
        finally:
            await chain.close()

    with EchoChain() as chain:
        ours_ms, echo_ms, cpu_ms = asyncio.run(measure(0.0))
        assert len(ours_ms) == len(echo_ms) == 30
        assert min(ours_ms) > 0.5 and min(echo_ms) > 0 and cpu_ms > 0
        calls.clear()
        ours_ms, echo_ms, cpu_ms = asyncio.run(measure(0.001))
    # Paced, a turn is one call: exactly n of ours after the warm-up.
    assert len(ours_ms) == len(echo_ms) == 30 and len(calls) == 5 + 30 and cpu_ms == 0


@pytest.mark.postgres
def test_dbos_runs_two_step_workflows_on_its_own_database() -> None:
    measured = measure_dbos(seconds=1.0, concurrency=2)
    # Every workflow the run started ended SUCCESS with its two writes (the worker checks the
    # writes and fails otherwise).
    assert set(measured["states"]) == {"SUCCESS"}
    assert measured["concurrency"] == 2 and measured["dbos_version"]
    assert {"workflows_per_s", "latency", "cpu_ms_per_workflow"} <= set(measured)
