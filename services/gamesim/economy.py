"""Payments between players in the simulated world: what `minecraft:economy.transfer` and
`minecraft:player.find` answer (docs/game-tools.md).

A payment names its recipient by player name, as `/pay` on a game server does (any player the
server has seen, online or not). It moves the money from the payer's balance to the
recipient's in one call on the game thread, together or not at all. Each order id is decided
once per payer: a repeat answers the first outcome again, marked `replayed`, and moves nothing.
"""

from __future__ import annotations

from typing import Any, Protocol

from services.gamesim.orders import DecidedOrders

__all__ = ["MAX_AMOUNT", "Payments"]

MAX_AMOUNT = 10**9
"""Most money one payment moves."""


class Account(Protocol):
    name: str
    balance: int
    online_since: float | None


class Payments:
    """The payments this world has decided."""

    def __init__(self) -> None:
        self._orders = DecidedOrders()

    def transfer(
        self, payer_id: str, accounts: dict[str, Account], data: dict[str, Any]
    ) -> dict[str, Any]:
        """`minecraft:economy.transfer` for `payer_id`; `accounts` are every known player."""
        order_id, to, amount = data.get("order_id"), data.get("to"), data.get("amount")
        if set(data) != {"order_id", "to", "amount"}:
            raise ValueError("economy.transfer takes exactly order_id, to and amount")
        if not isinstance(order_id, str) or not 1 <= len(order_id) <= 64:
            raise ValueError("economy.transfer needs an order_id of 1 to 64 characters")
        if not isinstance(to, str) or not 1 <= len(to.strip()) <= 32:
            raise ValueError("economy.transfer needs a recipient name of 1 to 32 characters")
        if isinstance(amount, bool) or not isinstance(amount, int | float) or amount != int(amount):
            raise ValueError("economy.transfer needs a whole amount")
        if not 1 <= amount <= MAX_AMOUNT:
            raise ValueError(f"economy.transfer moves 1 to {MAX_AMOUNT}")
        payer = accounts[payer_id]
        decided = self._orders.get(payer_id, order_id)
        if decided is not None:
            return {**decided, "replayed": True, "balance": payer.balance}
        recipient_id = _named(accounts, to)
        recipient = accounts[recipient_id] if recipient_id is not None else None
        if recipient is None:
            outcome = "unknown_player"
        elif recipient_id == payer_id:
            outcome = "self_payment"
        elif payer.balance < amount:
            outcome = "insufficient_balance"
        else:
            outcome = "transferred"
            payer.balance -= int(amount)
            recipient.balance += int(amount)
        answer = {
            "outcome": outcome,
            "order_id": order_id,
            "to": recipient.name if recipient is not None else to.strip(),
            "recipient_online": bool(recipient is not None and recipient.online_since is not None),
            "amount": int(amount),
        }
        self._orders.decide(payer_id, order_id, answer)
        return {**answer, "replayed": False, "balance": payer.balance}

    @staticmethod
    def find(accounts: dict[str, Account], data: dict[str, Any]) -> dict[str, Any]:
        """`minecraft:player.find`: the player named as a payment names its recipient."""
        name = data.get("name")
        if set(data) != {"name"} or not isinstance(name, str) or not 1 <= len(name.strip()) <= 32:
            raise ValueError("player.find takes exactly a name of 1 to 32 characters")
        player_id = _named(accounts, name)
        if player_id is None:
            return {"found": False, "name": name.strip(), "online": False}
        account = accounts[player_id]
        return {"found": True, "name": account.name, "online": account.online_since is not None}


def _named(accounts: dict[str, Account], name: str) -> str | None:
    """The id of the player called `name` (case ignored), or None."""
    wanted = name.strip().casefold()
    return next(
        (pid for pid, account in accounts.items() if account.name.casefold() == wanted), None
    )
