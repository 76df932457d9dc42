"""The simulated game's state and the game tools it offers.

Players have an inventory, a balance in the server currency, a level and a play time; the item
registry, the mobs and the shop listings are in `items.py`, players' mail in `mail.py`.
Tools run one at a time (the client calls them from its one reader task, as a game runs them
on its main thread).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
import zoneinfo
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from system.gateway.v1 import gateway_pb2

from services.gamesim import items, mail

__all__ = [
    "HONOURS_CALL_ID",
    "SIGNIN_DAY_START_HOUR",
    "SIGNIN_TIME_ZONE",
    "STARTING_BALANCE",
    "STARTING_LEVEL",
    "STARTING_PLAY_SECONDS",
    "PlayerState",
    "World",
]

STARTING_BALANCE = 1000
"""Every player's balance (in items.CURRENCY) the first time the world sees them."""
STARTING_LEVEL = 12
"""Every player's experience level at first sight."""
STARTING_PLAY_SECONDS = 5 * 3600 + 20 * 60
"""Play time before the simulator first saw the player (5 h 20 min); sessions add to it."""
SIGNIN_TIME_ZONE = "Asia/Shanghai"
"""The sign-in calendar's time zone unless the world is given another (a server setting)."""
SIGNIN_DAY_START_HOUR = 0
"""Hour (in the time zone) at which a new sign-in day begins, unless given another."""
HONOURS_CALL_ID = frozenset({"minecraft:signin.claim"})
"""Write tools that treat the call id as an idempotency key: a repeated call id is answered
as the first call was, without running again (docs/game-tools.md, honours call id)."""
CALL_ID_MEMORY = 4096
"""Most call ids remembered (oldest forgotten first)."""

# The schemas as docs/game-tools.md documents them, descriptions left out (a plugin copies
# them the same way; tests/test_tool_contract.py checks the hello against the catalogue).
_ITEM_ID = {"type": "string", "minLength": 1, "maxLength": 128}
_NAMES = {
    "type": "object",
    "properties": {
        "zh": {"type": "string", "minLength": 1},
        "en": {"type": "string", "minLength": 1},
    },
    "required": ["zh", "en"],
}
_NO_INPUT = {"type": "object", "properties": {}, "additionalProperties": False}
_INVENTORY_OUTPUT = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"item": _ITEM_ID, "count": {"type": "integer", "minimum": 0}},
                "required": ["item", "count"],
            },
        }
    },
    "required": ["items"],
}
_GIVE_INPUT = {
    "type": "object",
    "properties": {"item": {"type": "string"}, "count": {"type": "integer", "minimum": 1}},
    "required": ["item", "count"],
    "additionalProperties": False,
}
_GIVE_OUTPUT = {
    "type": "object",
    "properties": {"item": _ITEM_ID, "count": {"type": "integer", "minimum": 0}},
    "required": ["item", "count"],
}
_PROFILE_OUTPUT = {
    "type": "object",
    "properties": {
        "balance": {"type": "integer", "minimum": 0},
        "currency": _NAMES,
        "level": {"type": "integer", "minimum": 0},
        "play_seconds": {"type": "integer", "minimum": 0},
    },
    "required": ["balance", "currency", "level", "play_seconds"],
}
_LOOKUP_INPUT = {
    "type": "object",
    "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 64}},
    "required": ["query"],
    "additionalProperties": False,
}
_REF = {
    "type": "object",
    "properties": {"id": _ITEM_ID, "name": _NAMES},
    "required": ["id", "name"],
}
_COUNTED_REF = {
    "type": "object",
    "properties": {"id": _ITEM_ID, "name": _NAMES, "count": {"type": "integer", "minimum": 1}},
    "required": ["count", "id", "name"],
}


def _list_of(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "array",
        "items": {"type": "object", "properties": properties, "required": sorted(properties)},
    }


_LOOKUP_OUTPUT = {
    "type": "object",
    "properties": {
        "exact": {"type": "boolean"},
        "total": {"type": "integer", "minimum": 0},
        "items": {
            "type": "array",
            "maxItems": items.LOOKUP_LIMIT,
            "items": {
                "type": "object",
                "properties": {
                    "id": _ITEM_ID,
                    "name": _NAMES,
                    "sources": {
                        "type": "object",
                        "properties": {
                            "crafting": _list_of(
                                {
                                    "count": {"type": "integer", "minimum": 1},
                                    "inputs": {
                                        "type": "array",
                                        "minItems": 1,
                                        "items": _COUNTED_REF,
                                    },
                                }
                            ),
                            "smelting": _list_of({"input": _REF}),
                            "drops": _list_of({"mob": _REF}),
                            "mining": _list_of({"block": _REF}),
                            "shop": _list_of(
                                {
                                    "price": {"type": "integer", "minimum": 0},
                                    "stock": {"type": "integer", "minimum": 0},
                                    "currency": _NAMES,
                                }
                            ),
                        },
                        "required": ["crafting", "smelting", "drops", "mining", "shop"],
                    },
                },
                "required": ["id", "name", "sources"],
            },
        },
    },
    "required": ["exact", "total", "items"],
}

_DAY = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
_STACKS = {
    "type": "array",
    "minItems": 1,
    "maxItems": 8,
    "items": {
        "type": "object",
        "properties": {"item": _ITEM_ID, "count": {"type": "integer", "minimum": 1, "maximum": 64}},
        "required": ["item", "count"],
        "additionalProperties": False,
    },
}
_STREAK = {"type": "integer", "minimum": 0}
_MONTH_DAYS = {"type": "integer", "minimum": 0, "maximum": 31}
_SIGNIN_STATUS_OUTPUT = {
    "type": "object",
    "properties": {
        "today": _DAY,
        "time_zone": {"type": "string", "minLength": 1},
        "day_start_hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "signed_today": {"type": "boolean"},
        "reward": {"type": "string"},
        "streak": _STREAK,
        "days_this_month": _MONTH_DAYS,
    },
    "required": [
        "today",
        "time_zone",
        "day_start_hour",
        "signed_today",
        "reward",
        "streak",
        "days_this_month",
    ],
}
_SIGNIN_CLAIM_INPUT = {
    "type": "object",
    "properties": {
        "day": _DAY,
        "reward": {"type": "string", "minLength": 1, "maxLength": 64},
        "items": _STACKS,
    },
    "required": ["day", "reward", "items"],
    "additionalProperties": False,
}
_SIGNIN_CLAIM_OUTPUT = {
    "type": "object",
    "properties": {
        "claimed": {"type": "boolean"},
        "day": _DAY,
        "reward": {"type": "string"},
        "items": _STACKS,
        "streak": _STREAK,
        "days_this_month": _MONTH_DAYS,
    },
    "required": ["claimed", "day", "reward", "items", "streak", "days_this_month"],
}


@dataclasses.dataclass
class PlayerState:
    """One player as the world knows them."""

    inventory: Counter[str] = dataclasses.field(
        default_factory=lambda: Counter({"minecraft:bread": 12, "minecraft:torch": 32})
    )
    balance: int = STARTING_BALANCE
    """Money, in items.CURRENCY."""
    level: int = STARTING_LEVEL
    played_seconds: float = STARTING_PLAY_SECONDS
    """Play time of the sessions that ended."""
    online_since: float | None = None
    """Clock reading at the current session's join; None while offline."""
    signins: dict[datetime.date, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """The sign-in calendar: day -> that day's record (reward id and items given)."""
    mailbox: dict[str, mail.Mail] = dataclasses.field(default_factory=mail.seed)
    """The player's mail by id (mail.py)."""

    def play_seconds(self, now: float) -> int:
        """Play time, the current session included."""
        session = now - self.online_since if self.online_since is not None else 0.0
        return int(self.played_seconds + max(session, 0.0))


def _tool(
    name: str,
    description: str,
    input_schema: dict[str, Any],
    output_schema: dict[str, Any],
    *,
    read_only: bool,
    idempotent: bool,
    event_allowed: bool = True,
    honours_call_id: bool = False,
) -> gateway_pb2.GameTool:
    return gateway_pb2.GameTool(
        name=name,
        description=description,
        input_schema=json.dumps(input_schema),
        output_schema=json.dumps(output_schema),
        read_only=read_only,
        idempotent=idempotent,
        event_allowed=event_allowed,
        honours_call_id=honours_call_id,
    )


class World:
    """Players, the item registry and the shop, and the tools that read and change them.

    Args:
        clock: seconds of a monotonic clock; play time counts with it (tests pass their own).
        wall_clock: seconds since the epoch; the sign-in calendar's days count with it.
        time_zone: IANA time zone of the sign-in calendar (a server setting).
        day_start_hour: hour in `time_zone` at which a new sign-in day begins.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        wall_clock: Callable[[], float] = time.time,
        time_zone: str = SIGNIN_TIME_ZONE,
        day_start_hour: int = SIGNIN_DAY_START_HOUR,
    ) -> None:
        if not 0 <= day_start_hour <= 23:
            raise ValueError("day_start_hour must be between 0 and 23")
        self.clock = clock
        self.wall_clock = wall_clock
        self.time_zone = zoneinfo.ZoneInfo(time_zone)  # ZoneInfoNotFoundError for a bad name
        self.day_start_hour = day_start_hour
        self._answers: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.players: dict[str, PlayerState] = {}
        self.items = items.ITEMS
        self.shop = items.SHOP

    def player(self, player_id: str) -> PlayerState:
        """The player's state, created with the starting values on first sight."""
        return self.players.setdefault(player_id, PlayerState())

    def inventory(self, player_id: str) -> Counter[str]:
        return self.player(player_id).inventory

    def join(self, player_id: str) -> None:
        """The player came online: their play time runs."""
        state = self.player(player_id)
        if state.online_since is None:
            state.online_since = self.clock()

    def leave(self, player_id: str) -> None:
        """The player went offline: the session's time is added to their play time."""
        state = self.player(player_id)
        if state.online_since is not None:
            state.played_seconds += max(self.clock() - state.online_since, 0.0)
            state.online_since = None

    @staticmethod
    def tools() -> list[gateway_pb2.GameTool]:
        """The tools of the hello, with the catalogue's schemas and flags (docs/game-tools.md)."""
        return [
            _tool(
                "minecraft:inventory.read",
                "List the items in the player's inventory.",
                _NO_INPUT,
                _INVENTORY_OUTPUT,
                read_only=True,
                idempotent=True,
            ),
            _tool(
                "minecraft:item.give",
                "Give the player some items.",
                _GIVE_INPUT,
                _GIVE_OUTPUT,
                read_only=False,
                idempotent=False,
            ),
            _tool(
                "minecraft:player.profile",
                "Read the player's balance, level and play time.",
                _NO_INPUT,
                _PROFILE_OUTPUT,
                read_only=True,
                idempotent=True,
            ),
            _tool(
                "minecraft:item.lookup",
                "Find items by registry id or by name, with where each comes from.",
                _LOOKUP_INPUT,
                _LOOKUP_OUTPUT,
                read_only=True,
                idempotent=True,
            ),
            _tool(
                "minecraft:signin.status",
                "Read the player's sign-in calendar: today, signed in today, streak, days "
                "this month.",
                _NO_INPUT,
                _SIGNIN_STATUS_OUTPUT,
                read_only=True,
                idempotent=True,
            ),
            _tool(
                "minecraft:signin.claim",
                "Sign the player in for today and give the reward, once per day.",
                _SIGNIN_CLAIM_INPUT,
                _SIGNIN_CLAIM_OUTPUT,
                read_only=False,
                idempotent=False,
                honours_call_id=True,
            ),
            _tool(
                "minecraft:mail.list",
                "List the player's mail, newest first, one page at a time.",
                mail.LIST_INPUT,
                mail.LIST_OUTPUT,
                read_only=True,
                idempotent=True,
            ),
            _tool(
                "minecraft:mail.read",
                "Read one of the player's mails by id.",
                mail.MAIL_INPUT,
                mail.READ_OUTPUT,
                read_only=True,
                idempotent=True,
            ),
            _tool(
                "minecraft:mail.claim",
                "Claim a mail's attachment into the inventory, once per mail.",
                mail.MAIL_INPUT,
                mail.CLAIM_OUTPUT,
                read_only=False,
                idempotent=True,
                event_allowed=False,
            ),
        ]

    def call_with_id(
        self, player_id: str, tool: str, data: dict[str, Any], call_id: str
    ) -> dict[str, Any]:
        """Runs a tool call as the gateway sent it (`call`, and its call id).

        A tool in HONOURS_CALL_ID answers a call id it has seen (for the same player and
        tool) with the first call's answer, without running again: an engine that retries
        an interrupted step with its step id gets the effect once. A failed call is not
        remembered (it changed nothing).
        """
        if tool not in HONOURS_CALL_ID or not call_id:
            return self.call(player_id, tool, data)
        key = json.dumps([player_id, tool, call_id])
        if key in self._answers:
            self._answers.move_to_end(key)
            return json.loads(json.dumps(self._answers[key]))
        output = self.call(player_id, tool, data)
        self._answers[key] = json.loads(json.dumps(output))
        while len(self._answers) > CALL_ID_MEMORY:
            self._answers.popitem(last=False)
        return output

    # -- the sign-in calendar ------------------------------------------------------------------

    def today(self) -> datetime.date:
        """The sign-in calendar's current day: the wall clock in the world's time zone, moved
        back by the day start hour (at 03:00 with a 04:00 start it is still yesterday)."""
        local = datetime.datetime.fromtimestamp(self.wall_clock(), self.time_zone)
        return (local - datetime.timedelta(hours=self.day_start_hour)).date()

    def _calendar(self, state: PlayerState, today: datetime.date) -> dict[str, int]:
        day = today if today in state.signins else today - datetime.timedelta(days=1)
        streak = 0
        while day in state.signins:
            streak += 1
            day -= datetime.timedelta(days=1)
        month = sum(1 for d in state.signins if (d.year, d.month) == (today.year, today.month))
        return {"streak": streak, "days_this_month": month}

    def _signin_status(self, player_id: str) -> dict[str, Any]:
        state, today = self.player(player_id), self.today()
        record = state.signins.get(today)
        return {
            "today": today.isoformat(),
            "time_zone": self.time_zone.key,
            "day_start_hour": self.day_start_hour,
            "signed_today": record is not None,
            "reward": record["reward"] if record else "",
            **self._calendar(state, today),
        }

    def _signin_claim(self, player_id: str, data: dict[str, Any]) -> dict[str, Any]:
        day, reward, stacks = data.get("day"), data.get("reward"), data.get("items")
        if not isinstance(reward, str) or not 1 <= len(reward) <= 64:
            raise ValueError("signin.claim needs a reward id of 1 to 64 characters")
        if not isinstance(stacks, list) or not 1 <= len(stacks) <= 8:
            raise ValueError("signin.claim needs 1 to 8 item stacks")
        given = []
        for stack in stacks:
            item = stack.get("item") if isinstance(stack, dict) else None
            count = stack.get("count") if isinstance(stack, dict) else None
            if not isinstance(item, str) or not isinstance(count, int | float):
                raise ValueError("signin.claim: each stack needs an item id and a count")
            if not 1 <= count <= 64:
                raise ValueError("signin.claim: a stack's count must be 1 to 64")
            given.append({"item": item, "count": int(count)})
        state, today = self.player(player_id), self.today()
        if day != today.isoformat():
            raise ValueError(f"signin.claim: day {day} is not today ({today.isoformat()}) here")
        record = state.signins.get(today)
        claimed = record is None
        if claimed:  # the record and the items together, on the one game thread
            record = {"reward": reward, "items": given}
            state.signins[today] = record
            for stack in given:
                state.inventory[stack["item"]] += stack["count"]
        assert record is not None
        return {
            "claimed": claimed,
            "day": today.isoformat(),
            "reward": record["reward"],
            "items": [dict(stack) for stack in record["items"]],
            **self._calendar(state, today),
        }

    def call(self, player_id: str, tool: str, data: dict[str, Any]) -> dict[str, Any]:
        """Runs a tool. Raises ValueError with a message for bad input or unknown tools."""
        if tool == "minecraft:inventory.read":
            inventory = self.inventory(player_id)
            return {"items": [{"item": k, "count": v} for k, v in sorted(inventory.items())]}
        if tool == "minecraft:item.give":
            item, count = data.get("item"), data.get("count")
            if not isinstance(item, str) or not isinstance(count, int | float) or count < 1:
                raise ValueError("item.give needs an item id and a positive count")
            inventory = self.inventory(player_id)
            inventory[item] += int(count)
            return {"item": item, "count": inventory[item]}
        if tool == "minecraft:player.profile":
            if data:
                raise ValueError("player.profile takes no input")
            state = self.player(player_id)
            return {
                "balance": state.balance,
                "currency": dict(items.CURRENCY),
                "level": state.level,
                "play_seconds": state.play_seconds(self.clock()),
            }
        if tool == "minecraft:item.lookup":
            query = data.get("query")
            if not isinstance(query, str) or not query.strip() or len(query) > 64:
                raise ValueError("item.lookup needs a query of 1 to 64 characters")
            return items.lookup(query, self.items, self.shop)
        if tool == "minecraft:signin.status":
            if data:
                raise ValueError("signin.status takes no input")
            return self._signin_status(player_id)
        if tool == "minecraft:signin.claim":
            return self._signin_claim(player_id, data)
        if tool == "minecraft:mail.list":
            return mail.list_page(self.player(player_id).mailbox, data)
        if tool == "minecraft:mail.read":
            return mail.read(self.player(player_id).mailbox, data)
        if tool == "minecraft:mail.claim":
            state = self.player(player_id)
            return mail.claim(state.mailbox, state.inventory, data)
        raise ValueError(f"unknown tool {tool}")
