"""Scale-out, slim: two replicas of every service as processes on PostgreSQL, a little load,
one replica SIGKILLed and restarted on its port (bench/scaleout.py does it for every service,
longer). Nothing is lost or applied twice at the simulated world, and what players saw was
only what a retry fixed. The two tests share the module's database: the bench's ids are its
run's own."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from bench.scaleout import Options, run

pytestmark = pytest.mark.e2e


def _killed(tmp_path: pathlib.Path, url: str, service: str, seconds: float) -> dict[str, Any]:
    """A run with 4 players on 2 game servers and replica 0 of `service` killed once; what
    must hold after any such run is checked here."""
    results = run(
        url,
        tmp_path / "cluster",
        Options(seconds=seconds, players=4, servers=2, kill=(service,), down_seconds=1.5),
    )
    effects = results["effects"]
    assert (effects["lost"], effects["applied_twice"]) == (0, 0), effects
    assert [k["replica"] for k in results["kills"]] == [f"{service}-0"]
    # What players saw: only statuses a retry may fix, and a retry fixed each of them.
    assert results["errors"]["unacceptable"] == {}, results["errors"]
    return results


def test_an_engine_replica_killed_under_load_loses_and_repeats_nothing(
    tmp_path: pathlib.Path, postgres_url: str
) -> None:
    results = _killed(tmp_path, postgres_url, "engine", 6.0)
    assert results["tasks"]["not_terminal"] == 0, results["tasks"]
    assert results["events_sent"] > 0 and results["requests_served"] > 0
    for service, share in results["shares"].items():
        assert all(n > 0 for n in share["calls"].values()), (service, share)


def test_cards_shown_before_a_gateway_is_killed_are_taken_after_the_failover(
    tmp_path: pathlib.Path, postgres_url: str
) -> None:
    """Decision 0030: the players of the game server on gateway-0 quote an offer and keep the
    card on screen; gateway-0 is SIGKILLed, the game server reconnects to gateway-1, and each
    press of the card gateway-0 showed works there (none refused as stale), charged once."""
    results = _killed(tmp_path, postgres_url, "gateway", 8.0)
    cards = results["cards_across_reconnects"]
    assert cards["held_by_reason"].get("SIGKILL gateway-0", {}).get("worked", 0) > 0, cards
    for how, outcomes in cards["presses"].items():
        assert set(outcomes) <= {"worked"}, (how, cards)
