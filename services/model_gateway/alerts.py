"""Budget alerts in game: a notice to the administrators when a budget passes its
`alert_percent` (decision 0029), sent through the gateway's one notice path,
ToolRelayService.NotifyPlayer, with `min_permission_level` (every player at or above it on the
game server of the player whose call passed the threshold; for a network budget, on every game
server of that gateway replica), in Chinese and English.

Once across the replicas, to every gateway replica: each model-gateway replica sees a
threshold passed on its own (`budgets.BudgetAlerts`, once per budget, scope and period per
replica), so before sending it claims the alert in storage (PlayerDataService.ClaimBudgetAlert,
a conditional insert keyed by budget, scope, period and percent): the first replica to claim
sends it, the others send nothing. The claim answers the internal address of every live
gateway replica (storage's presence leases), and the notice goes to each of them: a network
budget's alert reaches the administrators on every game server, whichever replica it is
connected to, and a game server's (or player's) alert reaches the one replica holding that game
server (the others answer FAILED_PRECONDITION: not connected here). Without a storage service
(no metering) or while no gateway replica holds a lease, the notice goes to `relay_target`.

Best effort and off the call's path: the claim and the notices are sent in the background after
the reservation that found the threshold passed; a notice is never retried (a retry could show
it twice), and a failure is logged. A claim whose storage call fails sends nothing (another
replica may have claimed it): the alert is in the log all the same.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import grpc
from system.common.v1 import common_pb2
from system.relay.v1 import relay_pb2, relay_pb2_grpc
from system.storage.v1 import player_data_pb2, player_data_pb2_grpc

from services.model_gateway.budgets import MICROS, Use
from services.results import card, succeeded
from services.runtime.channels import ChannelSettings, Dependency

__all__ = ["AdminNotices", "alert_results"]

log = logging.getLogger("system.model")

NOTICE_TIMEOUT_SECONDS = 2.0
CLAIM = "system.storage.v1.PlayerDataService/ClaimBudgetAlert"
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
    """Claims budget alerts in storage and sends the claimed ones to the administrators in
    game, over every gateway replica's relay.

    Args:
        target: the gateway's internal relay, `host:port`: where notices go when storage names
            no gateway replica (or there is no storage).
        level: the permission level the notice goes to, and above.
        storage_target: the storage service, where alerts are claimed; empty: none (each
            replica sends its own, to `target`).
        claimant: this replica's name in the claims; a random one by default (new at every
            start, as a replica's claims are its own).
    """

    def __init__(
        self,
        target: str,
        level: int,
        settings: ChannelSettings | None = None,
        *,
        storage_target: str = "",
        claimant: str = "",
    ) -> None:
        self._settings = settings
        self._target = target
        self._relays: dict[str, Dependency[relay_pb2_grpc.ToolRelayServiceAsyncStub]] = {}
        self._storage = (
            Dependency(
                storage_target,
                player_data_pb2_grpc.PlayerDataServiceStub,
                idempotent_methods=[CLAIM],  # a repeated claim of the same claimant is granted
                settings=settings,
            )
            if storage_target
            else None
        )
        self._level = level
        self.claimant = claimant or f"model-{secrets.token_hex(8)}"
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0
        """Alerts this replica sent that a relay accepted (for tests and the log)."""
        self.left_to_others = 0
        """Alerts another replica had claimed, so this one sent nothing."""

    def alert(self, use: Use, percent: int, player_id: str) -> None:
        """Claims and sends the notice of `use` passing `percent` in the background; never
        raises."""
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
        task = asyncio.get_running_loop().create_task(self._send(request, use, percent))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, request: relay_pb2.NotifyPlayerRequest, use: Use, percent: int) -> None:
        shown = f"{use.budget}{f' of {use.scope}' if use.scope else ''}"
        targets = [self._target]
        if self._storage is not None:
            claim = player_data_pb2.ClaimBudgetAlertRequest(
                budget=use.budget,
                scope=use.scope,
                period=use.period,
                percent=percent,
                claimant=self.claimant,
            )
            try:
                claimed = await self._storage.stub.ClaimBudgetAlert(
                    claim, timeout=NOTICE_TIMEOUT_SECONDS
                )
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "budget alert %s not claimed, so not shown in game: %s %s",
                    shown,
                    exc.code().name,
                    exc.details(),
                )
                return
            if not claimed.claimed:
                self.left_to_others += 1
                log.info("budget alert %s: another model-gateway replica sends it", shown)
                return
            targets = list(claimed.gateway_addresses) or targets
        answers = await asyncio.gather(*(self._notify(target, request) for target in targets))
        self._forget_relays(set(targets) | {self._target})
        notified = [n for n in answers if n is not None]
        if not notified:
            log.warning(
                "budget alert %s not shown in game: no gateway replica of %d took it",
                shown,
                len(targets),
            )
            return
        self.sent += 1
        log.info(
            "budget alert %s shown to %d administrators in game (%d gateway replicas)",
            shown,
            sum(notified),
            len(targets),
        )

    async def _notify(self, target: str, request: relay_pb2.NotifyPlayerRequest) -> int | None:
        """Sends the notice to one gateway replica; the administrators it reached, or None
        when it did not take it (a game server's alert: its server is not connected there)."""
        relay = self._relays.get(target)
        if relay is None:
            relay = self._relays[target] = Dependency(
                target,
                relay_pb2_grpc.ToolRelayServiceStub,
                settings=self._settings,
            )
        try:
            response = await relay.stub.NotifyPlayer(request, timeout=NOTICE_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                log.warning(
                    "budget alert to gateway replica %s failed: %s %s",
                    target,
                    exc.code().name,
                    exc.details(),
                )
            return None
        notified: int = response.notified
        return notified

    def _forget_relays(self, keep: set[str]) -> None:
        """Closes the channels of gateway replicas no longer live (replicas come and go)."""
        for target in set(self._relays) - keep:
            relay = self._relays.pop(target)
            task = asyncio.get_running_loop().create_task(relay.aclose())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Waits for the notices being sent."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def aclose(self) -> None:
        await self.drain()
        for relay in self._relays.values():
            await relay.aclose()
        self._relays.clear()
        if self._storage is not None:
            await self._storage.aclose()
