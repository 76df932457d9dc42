"""The peer baselines the skeleton and engine benches measure beside their own figures
(bench/peers.py): they run and report the figures the benches read. No timing is checked."""

from __future__ import annotations

import pytest

from bench.peers import measure_dbos, measure_echo_chain


def test_echo_chain_reports_round_trips_and_cpu() -> None:
    measured = measure_echo_chain(n=20)
    assert measured["n"] == 20 and len(measured["samples_ms"]) == 20
    assert 0 < measured["p50_ms"] <= measured["p90_ms"] <= measured["p99_ms"]
    assert measured["cpu_ms_per_round_trip"] > 0


@pytest.mark.postgres
def test_dbos_runs_two_step_workflows_on_its_own_database() -> None:
    measured = measure_dbos(seconds=1.0, concurrency=2)
    # Every workflow the run started ended SUCCESS with its two writes (the worker checks the
    # writes and fails otherwise).
    assert set(measured["states"]) == {"SUCCESS"}
    assert measured["concurrency"] == 2 and measured["dbos_version"]
    assert {"workflows_per_s", "latency", "cpu_ms_per_workflow"} <= set(measured)
