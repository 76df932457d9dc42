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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from system.gateway.v1 import gateway_pb2

from services.gamesim import economy, items, mail, quests, shop

__all__ = [
    "FEATURES",
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
HONOURS_CALL_ID = frozenset({"minecraft:item.give", "minecraft:signin.claim"})
"""Write tools that treat the call id as an idempotency key: a repeated call id is answered
as the first call was, without running again (docs/game-tools.md, honours call id)."""
CALL_ID_MEMORY = 4096
"""Most call ids remembered (oldest forgotten first)."""

CATALOGUE = Path(__file__).resolve().parents[2] / "docs" / "game-tools.json"
"""The published game-tool catalogue (generated from the engine's registry): this world takes
its hello's schemas and flags from it, as a plugin author copies them."""

TOOLS = (
    "minecraft:inventory.read",
    "minecraft:item.give",
    "minecraft:player.profile",
    "minecraft:item.lookup",
    "minecraft:signin.status",
    "minecraft:signin.claim",
    "minecraft:mail.list",
    "minecraft:mail.read",
    "minecraft:mail.claim",
    "minecraft:shop.list",
    "minecraft:shop.item",
    "minecraft:shop.buy",
    "minecraft:economy.transfer",
    "minecraft:player.find",
    "minecraft:gift.list",
)
"""The catalogue's tools this world implements, in its hello's order (then quests.TOOLS, with
the `ftbquests` feature)."""
FEATURES = (quests.FEATURE,)
"""Optional features of a world unless it is given others: FTB Quests is installed, as on
`make run`'s server. `World(features=())` is a server without it: no quests, no quest tools."""


@dataclasses.dataclass
class PlayerState:
    """One player as the world knows them."""

    inventory: Counter[str] = dataclasses.field(
        default_factory=lambda: Counter({"minecraft:bread": 12, "minecraft:torch": 32})
    )
    name: str = ""
    """The player's name, as the game shows it (from their last join)."""
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
    quest_progress: quests.Progress = dataclasses.field(default_factory=quests.seed)
    """The player's progress in the quest book (quests.py; used with the ftbquests feature)."""

    def play_seconds(self, now: float) -> int:
        """Play time, the current session included."""
        session = now - self.online_since if self.online_since is not None else 0.0
        return int(self.played_seconds + max(session, 0.0))


def _catalogued_tools(names: tuple[str, ...]) -> list[gateway_pb2.GameTool]:
    """The hello entries of `names`, with the catalogue's descriptions, schemas and flags."""
    entries = {entry["name"]: entry for entry in json.loads(CATALOGUE.read_text("utf-8"))["tools"]}
    return [
        gateway_pb2.GameTool(
            name=name,
            description=entries[name]["description"],
            input_schema=json.dumps(entries[name]["input_schema"]),
            output_schema=json.dumps(entries[name]["output_schema"]),
            read_only=entries[name]["read_only"],
            idempotent=entries[name]["idempotent"],
            event_allowed=entries[name]["event_allowed"],
            honours_call_id=entries[name]["honours_call_id"],
        )
        for name in names
    ]


class World:
    """Players, the item registry and the shop, and the tools that read and change them.

    Args:
        clock: seconds of a monotonic clock; play time counts with it (tests pass their own).
        wall_clock: seconds since the epoch; the sign-in calendar's days count with it.
        time_zone: IANA time zone of the sign-in calendar (a server setting).
        day_start_hour: hour in `time_zone` at which a new sign-in day begins.
        features: optional features installed (the hello's `features`): with `ftbquests` the
            world has quests and offers the quest tools.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        wall_clock: Callable[[], float] = time.time,
        time_zone: str = SIGNIN_TIME_ZONE,
        day_start_hour: int = SIGNIN_DAY_START_HOUR,
        features: Iterable[str] = FEATURES,
    ) -> None:
        if not 0 <= day_start_hour <= 23:
            raise ValueError("day_start_hour must be between 0 and 23")
        self.clock = clock
        self.wall_clock = wall_clock
        self.time_zone = zoneinfo.ZoneInfo(time_zone)  # ZoneInfoNotFoundError for a bad name
        self.day_start_hour = day_start_hour
        self.features = tuple(dict.fromkeys(features))
        self._answers: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.players: dict[str, PlayerState] = {}
        self.items = items.ITEMS
        self.shop = shop.Shop()
        self.payments = economy.Payments()

    def player(self, player_id: str) -> PlayerState:
        """The player's state, created with the starting values on first sight."""
        return self.players.setdefault(player_id, PlayerState())

    def inventory(self, player_id: str) -> Counter[str]:
        return self.player(player_id).inventory

    def join(self, player_id: str, name: str = "") -> None:
        """The player came online: their play time runs (and their name is known)."""
        state = self.player(player_id)
        state.name = name or state.name or player_id
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
        """Every tool the simulator implements, quests' included, with the catalogue's schemas
        and flags (docs/game-tools.md)."""
        return _catalogued_tools((*TOOLS, *quests.TOOLS))

    def hello_tools(self) -> list[gateway_pb2.GameTool]:
        """The tools of this world's hello: `tools()` less the quest tools when FTB Quests is
        not installed (a server offers a mod's tools only with the mod)."""
        offered = self.tools()
        if quests.FEATURE in self.features:
            return offered
        return [tool for tool in offered if tool.name not in quests.TOOLS]

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
            answer: dict[str, Any] = json.loads(json.dumps(self._answers[key]))
            return answer
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
        given: list[dict[str, Any]] = []
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
            return {
                "items": [
                    {"item": k, "count": v, "name": items.name_of(k)}
                    for k, v in sorted(inventory.items())
                ]
            }
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
            return items.lookup(query, self.items, tuple(self.shop.listings.values()))
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
        if tool == "minecraft:shop.list":
            return self.shop.list_page(data)
        if tool == "minecraft:shop.item":
            return self.shop.detail(data)
        if tool == "minecraft:shop.buy":
            state = self.player(player_id)
            answer, state.balance = self.shop.buy(player_id, state.balance, state.inventory, data)
            return answer
        if tool == "minecraft:economy.transfer":
            self.player(player_id)
            return self.payments.transfer(player_id, self.players, data)  # type: ignore[arg-type]
        if tool == "minecraft:player.find":
            return self.payments.find(self.players, data)  # type: ignore[arg-type]
        if tool == "minecraft:gift.list":
            return quests.gift_list(data)
        if tool in quests.TOOLS and quests.FEATURE in self.features:
            return self._quest_call(player_id, tool, data)
        raise ValueError(f"unknown tool {tool}")

    def _quest_call(self, player_id: str, tool: str, data: dict[str, Any]) -> dict[str, Any]:
        state = self.player(player_id)
        if tool == "ftbquests:quest.query":
            return quests.query(state.quest_progress, data)
        if tool == "ftbquests:quest.find":
            return quests.find(state.quest_progress, data)
        if tool == "ftbquests:quest.detail":
            return quests.detail(state.quest_progress, data)
        return quests.claim(state.quest_progress, state.inventory, data)
