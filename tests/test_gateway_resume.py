"""A join's ResumePlayerTasks that no engine can take is asked again while the player stays,
and no longer once they left (services.gateway.players.PlayerRequests.resume_tasks; the whole
path, engine down then back, is in tests/test_engine_events.py)."""

from __future__ import annotations

from prometheus_client import REGISTRY
from system.common.v1 import common_pb2

from services.gateway.players import PlayerRequests
from tests.service_process import free_port
from tests.waiting import holds_for, wait_until


def _asked_again() -> float:
    return (
        REGISTRY.get_sample_value(
            "gateway_engine_calls_asked_again_total", {"call": "ResumePlayerTasks"}
        )
        or 0.0
    )


async def test_a_refused_resume_is_asked_again_only_while_the_player_stays() -> None:
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens: every call is UNAVAILABLE
    players = PlayerRequests(nowhere, nowhere, nowhere)
    staying = True
    try:
        before = _asked_again()
        players.resume_tasks(
            common_pb2.PlayerContext(server_id="sim", player_id="sim/alex"),
            staying=lambda: staying,
        )
        await wait_until(
            lambda: _asked_again() >= before + 2, timeout=10, what="two resumes asked again"
        )

        staying = False
        left_at = _asked_again()
        # At most the ask already past its check of `staying` counts; then the resume ends.
        await holds_for(lambda: _asked_again() <= left_at + 1, 2.0, what="no more asks")
        await wait_until(
            lambda: not players._background,  # noqa: SLF001
            timeout=10,
            what="the resume given up",
        )
    finally:
        await players.aclose()
