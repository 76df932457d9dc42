"""Scale-out, slim: two replicas of every service as processes on PostgreSQL, a little load,
one engine replica SIGKILLed and restarted on its port (bench/scaleout.py does it for every
service, longer). Nothing is lost or applied twice at the simulated world, and every replica
of every service got calls while both were up."""

from __future__ import annotations

import pathlib

import pytest

from bench.scaleout import Options, run

pytestmark = pytest.mark.e2e


def test_an_engine_replica_killed_under_load_loses_and_repeats_nothing(
    tmp_path: pathlib.Path, postgres_url: str
) -> None:
    results = run(
        postgres_url,
        tmp_path / "cluster",
        Options(seconds=6.0, players=4, servers=2, kill=("engine",), down_seconds=1.5),
    )
    effects = results["effects"]
    assert (effects["lost"], effects["applied_twice"]) == (0, 0), effects
    assert results["tasks"]["not_terminal"] == 0, results["tasks"]
    assert results["events_sent"] > 0 and results["requests_served"] > 0
    assert [k["replica"] for k in results["kills"]] == ["engine-0"]
    for service, share in results["shares"].items():
        assert all(n > 0 for n in share["calls"].values()), (service, share)
    # What players saw: only statuses a retry may fix, and a retry fixed each of them.
    assert results["errors"]["unacceptable"] == {}, results["errors"]
