"""Budget alerts in game: a notice to the administrators when a budget passes its
`alert_percent` (decision 0029), sent through the gateway's one notice path,
ToolRelayService.NotifyPlayer, with `min_permission_level` (every player at or above it on the
game server of the player whose call passed the threshold; for a network budget, on every game
server of that gateway replica), in Chinese and English.

Best effort and off the call's path: the notice is sent in the background after the
reservation that found the threshold passed, never retried (a retry could show it twice), and a
failure is logged. One alert per budget, scope and period per model-gateway replica
(`budgets.BudgetAlerts` decides when), so N replicas may each send one.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from system.common.v1 import common_pb2
from system.relay.v1 import relay_pb2, relay_pb2_grpc

from services.model_gateway.budgets import MICROS, Use
from services.results import card, succeeded
from services.runtime.channels import ChannelSettings, Dependency

__all__ = ["AdminNotices", "alert_results"]

log = logging.getLogger("system.model")

NOTICE_TIMEOUT_SECONDS = 2.0
NETWORK_SENDER = "network"
"""The player id sent with a network budget's alert when no player's call passed it (the relay
needs one; with `every_server` it names nobody in particular)."""

_TITLE = {"zh": "预算提醒", "en": "Budget alert"}
_LINE = {
    "zh": "预算 {budget}{whose}在 {period} 已过 {percent}%：已用或预留 {shown}。",
    "en": "Budget {budget}{whose} passed {percent} % for {period}: {shown} used or held.",
}
_WHOSE = {"zh": "（{scope}）", "en": " of {scope}"}
_NO_SCOPE = {"zh": " ", "en": ""}
_SEE = {"zh": "详情见 /system 花费", "en": "See /system spend"}


def _shown(use: Use) -> str:
    if use.budget.endswith("_cost"):
        return f"{use.used / MICROS:.2f} / {use.limit / MICROS:.2f}"
    return f"{use.used} / {use.limit} tokens"


def alert_results(use: Use, percent: int) -> dict[str, common_pb2.AgentResult]:
    """The notice of one alert, per language."""
    results = {}
    for language in ("zh", "en"):
        line = _LINE[language].format(
            budget=use.budget,
            whose=_WHOSE[language].format(scope=use.scope) if use.scope else _NO_SCOPE[language],
            period=use.period,
            percent=percent,
            shown=_shown(use),
        )
        see = _SEE[language]
        results[language] = succeeded(
            card("system:budget.alert", _TITLE[language], [line, (see, "/system spend")])
        )
    return results


class AdminNotices:
    """Sends budget alerts to the administrators in game, over the gateway's relay.

    Args:
        target: the gateway's internal relay, `host:port`.
        level: the permission level the notice goes to, and above.
    """

    def __init__(self, target: str, level: int, settings: ChannelSettings | None = None) -> None:
        self._relay = Dependency(target, relay_pb2_grpc.ToolRelayServiceStub, settings=settings)
        self._level = level
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0
        """Notices the relay accepted (for tests and the log)."""

    def alert(self, use: Use, percent: int, player_id: str) -> None:
        """Sends the notice of `use` passing `percent` in the background; never raises."""
        network = use.budget.startswith("network_")
        if not player_id and not network:
            return
        results = alert_results(use, percent)
        request = relay_pb2.NotifyPlayerRequest(
            player_id=player_id or NETWORK_SENDER,
            result=results["en"],
            min_permission_level=self._level,
            every_server=network,
        )
        for language, result in results.items():
            request.results_by_language[language].CopyFrom(result)
        task = asyncio.get_running_loop().create_task(self._send(request, use))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, request: relay_pb2.NotifyPlayerRequest, use: Use) -> None:
        try:
            response = await self._relay.stub.NotifyPlayer(request, timeout=NOTICE_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "budget alert %s%s not shown in game: %s %s",
                use.budget,
                f" of {use.scope}" if use.scope else "",
                exc.code().name,
                exc.details(),
            )
            return
        self.sent += 1
        log.info(
            "budget alert %s%s shown to %d administrators in game",
            use.budget,
            f" of {use.scope}" if use.scope else "",
            response.notified,
        )

    async def drain(self) -> None:
        """Waits for the notices being sent."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def aclose(self) -> None:
        await self.drain()
        await self._relay.aclose()
