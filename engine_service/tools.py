"""The tool registry: one tool type, one handler, one behaviour.

A tool is either a *server tool*, whose handler runs inside the engine (say `system:database.query`),
or a *game tool*, which runs inside the game server on its main thread and which the engine
reaches through the gateway's `ToolRelayService.CallGameTool`. The engine never holds a game
tool's handler; it only knows the tool's declaration (read-only, idempotent, event-allowed) so
it can enforce budgets and the write rules before the call leaves the engine.

Tools never dispatch on an "operation" field: two behaviours are two tools. Registration is
refused on any conflict and freezes together with the module registry.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from engine_service.schema import check_schema, violation
from services.runtime.config import ConfigError
from services.runtime.permissions import CORE_FEATURE

__all__ = [
    "BUILTIN_GAME_TOOLS",
    "ECONOMY_GAME_TOOLS",
    "ITEM_LOOKUP_LIMIT",
    "MAIL_PAGE_LIMIT",
    "PAY_MAX_AMOUNT",
    "SERVER_TOOL_NAMESPACE",
    "SHOP_GAME_TOOLS",
    "SHOP_MAX_COUNT",
    "SHOP_PAGE_LIMIT",
    "SIGNIN_GAME_TOOLS",
    "SIGNIN_MAX_STACKS",
    "ToolHandler",
    "ToolKind",
    "ToolRegistry",
    "ToolRegistryError",
    "ToolSpec",
]

TOOL_ID = re.compile(r"^[a-z0-9_.-]+:[a-z0-9_./-]+$")
SERVER_TOOL_NAMESPACE = "system"
"""Namespace reserved for server tools; a `system:` tool must have a handler in the engine."""

ToolHandler = Callable[..., Awaitable[dict[str, Any]]]
"""A server tool's one behaviour: the checked input in (and, for a tool declared with
`needs_context`, the run's execution context after it), a JSON-like object out. It raises
`ModuleFailure` for a catalogued failure; anything else becomes MODULE_FAILED."""


class ToolRegistryError(ConfigError):
    """A tool registration conflicts with another, is malformed, or came after the freeze."""


class ToolKind:
    """Where a tool's handler runs."""

    SERVER = "server"
    GAME = "game"


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """What a tool declares about itself."""

    tool_id: str
    """Identifier, `namespace:path` (`minecraft:inventory.read`)."""
    description: str
    """What the tool does, for module authors and the model."""
    input_schema: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    """JSON Schema (draft 2020-12) of the input, an object; checked before every call."""
    output_schema: dict[str, Any] = dataclasses.field(default_factory=lambda: {"type": "object"})
    """JSON Schema (draft 2020-12) of the output, an object. A game tool's every answer is
    checked against it before any module reads it (an answer that breaks it fails the step
    with TOOL_OUTPUT_INVALID); the default takes any object."""
    read_only: bool = False
    """True when the tool never changes state. Everything else is a write and counts against
    the policy's `write_steps`; it is refused from local and cached routes."""
    idempotent: bool = False
    """True when running it twice with one input has the effect of running it once."""
    event_allowed: bool = False
    """True when event tasks may call it, not only interactive requests."""
    owner_feature: str = CORE_FEATURE
    """Feature exporting the tool. A module's optional tools run only for players with this
    feature enabled."""
    kind: str = ToolKind.SERVER
    """`server` (handler in the engine) or `game` (relayed to the player's game server)."""
    needs_context: bool = False
    """Server tools only: the handler is called as `handler(payload, ctx)` with the run's
    execution context, for tools that act for the player or depend on the run (its web gate,
    its search session)."""
    example_input: dict[str, Any] | None = None
    """An input the tool accepts, for the game-tool catalogue (checked against input_schema)."""
    example_output: dict[str, Any] | None = None
    """An answer the tool may give, for the catalogue (checked against output_schema)."""
    honours_call_id: bool = False
    """Game write tools only: the game server treats the call id (an event step's id) as an
    idempotency key, answering a repeated call id as the first call without running again.
    An event step of such a tool interrupted by a crash, or whose answer was lost with its
    gateway replica, is then resent with its step id instead of reported EFFECT_UNKNOWN. Part of the catalogue's contract: a hello offering
    the tool must say so too (`GameTool.honours_call_id`)."""
    declared: bool = True
    """False for a game tool a module named without anyone declaring it (`resolve`): its
    flags are the most restricted guess and its schemas take any object, so a game server's
    own declaration of it is not judged against them."""


_ITEM_ID = {
    "type": "string",
    "minLength": 1,
    "maxLength": 128,
    "description": "Item id, namespace:path (for example minecraft:bread).",
}

_NAMES = {
    "type": "object",
    "description": "A name per language: zh (Simplified Chinese) and en (English).",
    "properties": {
        "zh": {"type": "string", "minLength": 1},
        "en": {"type": "string", "minLength": 1},
    },
    "required": ["zh", "en"],
}


def _ref(what: str, counted: bool = False) -> dict[str, Any]:
    """A reference to an item, block or mob: its id and names (and a count)."""
    properties: dict[str, Any] = {
        "id": {**_ITEM_ID, "description": f"The {what}'s id, namespace:path."},
        "name": _NAMES,
    }
    if counted:
        properties["count"] = {"type": "integer", "minimum": 1, "description": "How many."}
    return {"type": "object", "properties": properties, "required": sorted(properties)}


def _sources(description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "array",
        "description": description,
        "items": {"type": "object", "properties": properties, "required": sorted(properties)},
    }


ITEM_LOOKUP_LIMIT = 10
"""Most items one `minecraft:item.lookup` answer holds."""

_ITEM_ENTRY = {
    "type": "object",
    "properties": {
        "id": _ITEM_ID,
        "name": _NAMES,
        "sources": {
            "type": "object",
            "description": "Where the item comes from, one list per way (each may be empty).",
            "properties": {
                "crafting": _sources(
                    "Crafting recipes that make it.",
                    {
                        "count": {
                            "type": "integer",
                            "minimum": 1,
                            "description": "How many one crafting makes.",
                        },
                        "inputs": {
                            "type": "array",
                            "minItems": 1,
                            "description": "The ingredients.",
                            "items": _ref("ingredient", counted=True),
                        },
                    },
                ),
                "smelting": _sources(
                    "Items that smelt into it in a furnace.", {"input": _ref("item smelted")}
                ),
                "drops": _sources("Mobs that drop it.", {"mob": _ref("mob")}),
                "mining": _sources("Blocks that drop it when broken.", {"block": _ref("block")}),
                "shop": _sources(
                    "The server shop's listing of it (at most one).",
                    {
                        "price": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "Price of one, in the currency.",
                        },
                        "stock": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "How many the shop has left.",
                        },
                        "currency": _NAMES,
                    },
                ),
            },
            "required": ["crafting", "smelting", "drops", "mining", "shop"],
        },
    },
    "required": ["id", "name", "sources"],
}

SIGNIN_MAX_STACKS = 8
"""Most item stacks one sign-in reward holds."""

_DAY = {
    "type": "string",
    "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$",
    "description": "A calendar day of the game server's sign-in calendar, YYYY-MM-DD.",
}
_STACKS = {
    "type": "array",
    "minItems": 1,
    "maxItems": SIGNIN_MAX_STACKS,
    "description": "Item stacks, in order.",
    "items": {
        "type": "object",
        "properties": {
            "item": _ITEM_ID,
            "count": {"type": "integer", "minimum": 1, "maximum": 64, "description": "How many."},
        },
        "required": ["item", "count"],
        "additionalProperties": False,
    },
}
_STREAK = {
    "type": "integer",
    "minimum": 0,
    "description": "Consecutive days signed in, ending today (or yesterday while today is not "
    "signed yet).",
}
_MONTH_DAYS = {
    "type": "integer",
    "minimum": 0,
    "maximum": 31,
    "description": "Days signed in during today's calendar month.",
}

SIGNIN_GAME_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        tool_id="minecraft:signin.status",
        description=(
            "Read the player's sign-in calendar: the server's current day (by its own time "
            "zone and day start hour, the one source of truth for when a day begins), whether "
            "the player signed in today and with which reward, the streak and the days signed "
            "this month."
        ),
        input_schema={"type": "object", "properties": {}, "additionalProperties": False},
        output_schema={
            "type": "object",
            "properties": {
                "today": _DAY,
                "time_zone": {
                    "type": "string",
                    "minLength": 1,
                    "description": "The IANA time zone the server's days are counted in.",
                },
                "day_start_hour": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": 23,
                    "description": "Hour (in time_zone) at which a new sign-in day begins.",
                },
                "signed_today": {"type": "boolean", "description": "Signed in today already."},
                "reward": {
                    "type": "string",
                    "description": "Today's reward entry id; empty while not signed in today.",
                },
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
        },
        read_only=True,
        idempotent=True,
        event_allowed=True,
        kind=ToolKind.GAME,
        example_input={},
        example_output={
            "today": "2026-12-01",
            "time_zone": "Asia/Shanghai",
            "day_start_hour": 0,
            "signed_today": False,
            "reward": "",
            "streak": 3,
            "days_this_month": 0,
        },
    ),
    ToolSpec(
        tool_id="minecraft:signin.claim",
        description=(
            "Sign the player in for today and give the reward's items, both in one step on the "
            "game thread: once per player per day. `day` must be the server's current day "
            "(as signin.status reported it; another day is refused as invalid input). A "
            "second sign-in the same day gives nothing and answers claimed=false with the "
            "day's first record. A repeated call id answers as the first call did."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "day": _DAY,
                "reward": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 64,
                    "description": "The reward entry's id (from the engine's reward catalogue).",
                },
                "items": _STACKS,
            },
            "required": ["day", "reward", "items"],
            "additionalProperties": False,
        },
        output_schema={
            "type": "object",
            "properties": {
                "claimed": {
                    "type": "boolean",
                    "description": "True when this call signed in and gave the items; false "
                    "when the day was already signed (nothing given).",
                },
                "day": _DAY,
                "reward": {"type": "string", "description": "The day's reward entry id."},
                "items": {**_STACKS, "description": "The day's reward items, as given."},
                "streak": _STREAK,
                "days_this_month": _MONTH_DAYS,
            },
            "required": ["claimed", "day", "reward", "items", "streak", "days_this_month"],
        },
        read_only=False,
        idempotent=False,
        event_allowed=True,
        kind=ToolKind.GAME,
        honours_call_id=True,
        example_input={
            "day": "2026-12-01",
            "reward": "bread",
            "items": [{"item": "minecraft:bread", "count": 8}],
        },
        example_output={
            "claimed": True,
            "day": "2026-12-01",
            "reward": "bread",
            "items": [{"item": "minecraft:bread", "count": 8}],
            "streak": 4,
            "days_this_month": 1,
        },
    ),
)
"""The sign-in calendar's game tools (part of BUILTIN_GAME_TOOLS)."""

MAIL_PAGE_LIMIT = 10
"""Most mails one `minecraft:mail.list` page holds."""

_MAIL_ID = {
    "type": "string",
    "minLength": 1,
    "maxLength": 64,
    "description": "The mail's id, unique among the player's mail.",
}

_MAIL_INPUT = {
    "type": "object",
    "properties": {"mail_id": _MAIL_ID},
    "required": ["mail_id"],
    "additionalProperties": False,
}

_STACK = {
    "type": "object",
    "properties": {
        "item": _ITEM_ID,
        "name": _NAMES,
        "count": {"type": "integer", "minimum": 1, "description": "How many."},
    },
    "required": ["count", "item", "name"],
}

_MAIL = {
    "type": "object",
    "properties": {
        "id": _MAIL_ID,
        "sender": {"type": "string", "minLength": 1, "description": "Who sent it, as shown."},
        "subject": {"type": "string", "description": "The subject, as the sender wrote it."},
        "body": {"type": "string", "description": "The text, as the sender wrote it."},
        "sent_at": {
            "type": "integer",
            "minimum": 0,
            "description": "When it was sent, in seconds since 1970-01-01 UTC.",
        },
        "attachment": {
            "type": "array",
            "description": "Item stacks attached to it; empty when it has none.",
            "items": _STACK,
        },
        "claimed": {
            "type": "boolean",
            "description": "True once the attachment was delivered (false without one).",
        },
    },
    "required": ["attachment", "body", "claimed", "id", "sender", "sent_at", "subject"],
}

_MAIL_EXAMPLE = {
    "id": "m5",
    "sender": "系统",
    "subject": "签到奖励补发",
    "body": "维护期间未发放的签到奖励已补发，请领取附件。",
    "sent_at": 1795983300,
    "attachment": [
        {"item": "minecraft:diamond", "name": {"zh": "钻石", "en": "Diamond"}, "count": 2}
    ],
    "claimed": False,
}

SHOP_PAGE_LIMIT = 10
"""Most listings one `minecraft:shop.list` page holds."""
SHOP_MAX_COUNT = 64
"""Most items one `minecraft:shop.buy` order buys (one stack)."""

_MONEY = {"type": "integer", "minimum": 0, "description": "An amount in the server currency."}
_CURRENCY = {
    **_NAMES,
    "description": "The server currency's name per language, the English in the plural "
    "(`coins`): an amount of one is written with its singular (`1 coin`).",
}
_SHOP_CATEGORY = {
    "type": "string",
    "pattern": "^[a-z0-9_]{1,32}$",
    "description": "A browse category's id (materials, tools, ...).",
}
_LISTING = {
    "type": "object",
    "properties": {
        "item": _ref("item"),
        "price": {**_MONEY, "description": "Price of one, in the server currency."},
        "stock": {"type": "integer", "minimum": 0, "description": "How many are left to sell."},
        "category": _SHOP_CATEGORY,
    },
    "required": ["category", "item", "price", "stock"],
}
_LISTING_EXAMPLE = {
    "item": {"id": "minecraft:diamond", "name": {"zh": "钻石", "en": "Diamond"}},
    "price": 100,
    "stock": 64,
    "category": "materials",
}
_BUY_OUTCOMES = ["purchased", "insufficient_balance", "sold_out", "price_changed", "not_for_sale"]

SHOP_GAME_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        tool_id="minecraft:shop.list",
        description=(
            "List the server shop's items for sale, one page at a time (page from 1, page_size "
            f"1 to {SHOP_PAGE_LIMIT}, default 1 and 5), optionally only one category and only "
            "items whose id or name (zh or en) contains the query. A page past the end is an "
            "empty list. Also names the categories and the currency. Changes nothing."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "page": {"type": "integer", "minimum": 1, "description": "Page number, from 1."},
                "page_size": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": SHOP_PAGE_LIMIT,
                    "description": "Listings per page.",
                },
                "category": {**_SHOP_CATEGORY, "description": "Only this category."},
                "query": {
                    "type": "string",
                    "maxLength": 64,
                    "description": "Only items whose id or name contains this (empty: all).",
                },
            },
            "additionalProperties": False,
        },
        output_schema={
            "type": "object",
            "properties": {
                "total": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "How many listings match in all.",
                },
                "page": {"type": "integer", "minimum": 1, "description": "This page's number."},
                "page_size": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": SHOP_PAGE_LIMIT,
                    "description": "Listings per page, as asked (or the default).",
                },
                "categories": {
                    "type": "array",
                    "description": "Every browse category, in display order.",
                    "items": {
                        "type": "object",
                        "properties": {"id": _SHOP_CATEGORY, "name": _NAMES},
                        "required": ["id", "name"],
                    },
                },
                "currency": _CURRENCY,
                "listings": {
                    "type": "array",
                    "maxItems": SHOP_PAGE_LIMIT,
                    "description": "This page's listings, in the shop's order.",
                    "items": _LISTING,
                },
            },
            "required": ["categories", "currency", "listings", "page", "page_size", "total"],
        },
        read_only=True,
        idempotent=True,
        event_allowed=True,
        kind=ToolKind.GAME,
        example_input={"page": 1, "page_size": 5, "category": "materials"},
        example_output={
            "total": 1,
            "page": 1,
            "page_size": 5,
            "categories": [{"id": "materials", "name": {"zh": "材料", "en": "Materials"}}],
            "currency": {"zh": "金币", "en": "coins"},
            "listings": [_LISTING_EXAMPLE],
        },
    ),
    ToolSpec(
        tool_id="minecraft:shop.item",
        description=(
            "Read one listing of the server shop by item id: price, stock and category now. "
            "An item not for sale answers found false, not an error. Changes nothing."
        ),
        input_schema={
            "type": "object",
            "properties": {"item": _ITEM_ID},
            "required": ["item"],
            "additionalProperties": False,
        },
        output_schema={
            "type": "object",
            "properties": {
                "found": {"type": "boolean", "description": "False when it is not for sale."},
                "currency": _CURRENCY,
                "listing": {**_LISTING, "description": "The listing; present when found."},
            },
            "required": ["currency", "found"],
        },
        read_only=True,
        idempotent=True,
        event_allowed=True,
        kind=ToolKind.GAME,
        example_input={"item": "minecraft:diamond"},
        example_output={
            "found": True,
            "currency": {"zh": "金币", "en": "coins"},
            "listing": _LISTING_EXAMPLE,
        },
    ),
    ToolSpec(
        tool_id="minecraft:shop.buy",
        description=(
            "Buy from the server shop at the quoted unit price: when the price is still the "
            "quoted one, the stock suffices and the balance covers the total, debit the "
            "balance, take the stock and put the items into the inventory, in one step on the "
            "game thread (together or not at all). Each order_id is decided once: a repeat "
            "answers the first outcome again with replayed true and changes nothing. Only "
            "purchased changes anything."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "order_id": {
                    "type": "string",
                    "pattern": "^[A-Za-z0-9_.-]{1,64}$",
                    "description": "The order's id, chosen by the engine; the idempotency key.",
                },
                "item": _ITEM_ID,
                "count": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": SHOP_MAX_COUNT,
                    "description": "How many to buy.",
                },
                "unit_price": {**_MONEY, "description": "The price of one the buyer was quoted."},
            },
            "required": ["count", "item", "order_id", "unit_price"],
            "additionalProperties": False,
        },
        output_schema={
            "type": "object",
            "properties": {
                "outcome": {
                    "type": "string",
                    "enum": _BUY_OUTCOMES,
                    "description": "purchased (debited and delivered), or why nothing was done: "
                    "insufficient_balance, sold_out (stock below count), price_changed (the "
                    "price is not the quoted one), not_for_sale.",
                },
                "order_id": {"type": "string", "description": "The order id, as asked."},
                "item": _ref("item"),
                "count": {"type": "integer", "minimum": 1, "description": "How many, as asked."},
                "unit_price": {**_MONEY, "description": "The price of one now."},
                "total": {**_MONEY, "description": "unit_price times count."},
                "stock": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "Stock left after the order (now, for a refusal).",
                },
                "balance": {**_MONEY, "description": "The buyer's balance after the call."},
                "replayed": {
                    "type": "boolean",
                    "description": "True when this order id was decided before: the first "
                    "outcome, nothing done now.",
                },
            },
            "required": [
                "balance",
                "count",
                "item",
                "order_id",
                "outcome",
                "replayed",
                "stock",
                "total",
                "unit_price",
            ],
        },
        read_only=False,
        idempotent=True,
        event_allowed=False,
        kind=ToolKind.GAME,
        example_input={
            "order_id": "o-3f9a",
            "item": "minecraft:diamond",
            "count": 2,
            "unit_price": 100,
        },
        example_output={
            "outcome": "purchased",
            "order_id": "o-3f9a",
            "item": {"id": "minecraft:diamond", "name": {"zh": "钻石", "en": "Diamond"}},
            "count": 2,
            "unit_price": 100,
            "total": 200,
            "stock": 62,
            "balance": 800,
            "replayed": False,
        },
    ),
)
"""The server shop's game tools (system:shop, system:shop_buy, system:shop_confirm)."""

PAY_MAX_AMOUNT = 10**9
"""Most money one `minecraft:economy.transfer` moves."""

ECONOMY_GAME_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        tool_id="minecraft:economy.transfer",
        description=(
            "Pay another player: move the amount from the player's balance to the recipient's "
            "(named as the game shows them; any player the server knows, online or not), in "
            "one step on the game thread (together or not at all). Each order_id is decided "
            "once per payer: a repeat answers the first outcome again with replayed true and "
            "moves nothing. Only transferred changes anything."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "order_id": {
                    "type": "string",
                    "pattern": "^[A-Za-z0-9_.-]{1,64}$",
                    "description": "The payment's id, chosen by the engine; the idempotency key.",
                },
                "to": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 32,
                    "description": "The recipient's player name.",
                },
                "amount": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": PAY_MAX_AMOUNT,
                    "description": "How much to pay, in the server currency.",
                },
            },
            "required": ["amount", "order_id", "to"],
            "additionalProperties": False,
        },
        output_schema={
            "type": "object",
            "properties": {
                "outcome": {
                    "type": "string",
                    "enum": [
                        "transferred",
                        "insufficient_balance",
                        "unknown_player",
                        "self_payment",
                    ],
                    "description": "transferred (paid), or why nothing moved: "
                    "insufficient_balance, unknown_player (no player of that name), "
                    "self_payment (the recipient is the payer).",
                },
                "order_id": {"type": "string", "description": "The order id, as asked."},
                "to": {
                    "type": "string",
                    "description": "The recipient's name as the game spells it (as asked when "
                    "unknown).",
                },
                "recipient_online": {
                    "type": "boolean",
                    "description": "True when the recipient is online now.",
                },
                "amount": {**_MONEY, "description": "The amount, as asked."},
                "balance": {**_MONEY, "description": "The payer's balance after the call."},
                "replayed": {
                    "type": "boolean",
                    "description": "True when this order id was decided before: the first "
                    "outcome, nothing done now.",
                },
            },
            "required": [
                "amount",
                "balance",
                "order_id",
                "outcome",
                "recipient_online",
                "replayed",
                "to",
            ],
        },
        read_only=False,
        idempotent=True,
        event_allowed=False,
        kind=ToolKind.GAME,
        example_input={"order_id": "p-7c1e", "to": "Alex", "amount": 100},
        example_output={
            "outcome": "transferred",
            "order_id": "p-7c1e",
            "to": "Alex",
            "recipient_online": True,
            "amount": 100,
            "balance": 900,
            "replayed": False,
        },
    ),
    ToolSpec(
        tool_id="minecraft:player.find",
        description=(
            "Find a player the server knows (online or not) by name, as a payment names its "
            "recipient, case ignored. Optional: without it a payment's card is shown for any "
            "name, and a name no player has is refused only when the payment is confirmed."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "name": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 32,
                    "description": "The player name, as typed.",
                }
            },
            "required": ["name"],
            "additionalProperties": False,
        },
        output_schema={
            "type": "object",
            "properties": {
                "found": {
                    "type": "boolean",
                    "description": "True when the server knows a player of that name.",
                },
                "name": {
                    "type": "string",
                    "description": "The name as the game spells it (as asked when not found).",
                },
                "online": {
                    "type": "boolean",
                    "description": "True when that player is online now.",
                },
            },
            "required": ["found", "name", "online"],
        },
        read_only=True,
        idempotent=True,
        event_allowed=True,
        kind=ToolKind.GAME,
        example_input={"name": "alex"},
        example_output={"found": True, "name": "Alex", "online": False},
    ),
)
"""Payments between players (system:pay, system:pay_confirm)."""

BUILTIN_GAME_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        tool_id="minecraft:inventory.read",
        description="List the items in the player's inventory.",
        input_schema={"type": "object", "properties": {}, "additionalProperties": False},
        output_schema={
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "description": "One entry per item kind the player carries (stacks of one "
                    "kind added up); empty when the inventory is empty.",
                    "items": {
                        "type": "object",
                        "properties": {
                            "item": _ITEM_ID,
                            "count": {
                                "type": "integer",
                                "minimum": 0,
                                "description": "How many of the item the player carries.",
                            },
                            "name": {
                                **_NAMES,
                                "description": "The item's name per language (optional; "
                                "without it players see the id).",
                            },
                        },
                        "required": ["item", "count"],
                    },
                }
            },
            "required": ["items"],
        },
        read_only=True,
        idempotent=True,
        event_allowed=True,
        kind=ToolKind.GAME,
        example_input={},
        example_output={
            "items": [
                {"item": "minecraft:bread", "count": 12, "name": {"zh": "面包", "en": "Bread"}},
                {"item": "minecraft:torch", "count": 32, "name": {"zh": "火把", "en": "Torch"}},
            ]
        },
    ),
    ToolSpec(
        tool_id="minecraft:item.give",
        description="Give the player some items. A repeated call id answers as the first call did.",
        input_schema={
            "type": "object",
            "properties": {
                "item": {
                    "type": "string",
                    "maxLength": 128,
                    "description": _ITEM_ID["description"],
                },
                "count": {"type": "integer", "minimum": 1, "description": "How many to give."},
            },
            "required": ["item", "count"],
            "additionalProperties": False,
        },
        output_schema={
            "type": "object",
            "properties": {
                "item": _ITEM_ID,
                "count": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "How many of the item the player holds after the give.",
                },
            },
            "required": ["item", "count"],
        },
        read_only=False,
        idempotent=False,
        event_allowed=True,
        kind=ToolKind.GAME,
        honours_call_id=True,
        example_input={"item": "minecraft:diamond", "count": 1},
        example_output={"item": "minecraft:diamond", "count": 4},
    ),
    ToolSpec(
        tool_id="minecraft:player.profile",
        description="Read the player's balance, level and play time.",
        input_schema={"type": "object", "properties": {}, "additionalProperties": False},
        output_schema={
            "type": "object",
            "properties": {
                "balance": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "The player's money, in whole units of the currency.",
                },
                "currency": _CURRENCY,
                "level": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "The player's experience level.",
                },
                "play_seconds": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "Time played on this server in seconds, this session included.",
                },
            },
            "required": ["balance", "currency", "level", "play_seconds"],
        },
        read_only=True,
        idempotent=True,
        event_allowed=True,
        kind=ToolKind.GAME,
        example_input={},
        example_output={
            "balance": 1000,
            "currency": {"zh": "金币", "en": "coins"},
            "level": 12,
            "play_seconds": 19200,
        },
    ),
    ToolSpec(
        tool_id="minecraft:item.lookup",
        description=(
            "Find items by registry id or by name, with where each comes from. Exact matches "
            "only when there are any: the id (minecraft:diamond; a bare path means the "
            "minecraft namespace) or a whole name in any language, case and width ignored; "
            "otherwise the items whose id path or a name contains the query. Best first, at "
            f"most {ITEM_LOOKUP_LIMIT}; none is an empty list, not an error."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "query": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 64,
                    "description": "A registry id (minecraft:diamond) or a name (钻石, diamond).",
                }
            },
            "required": ["query"],
            "additionalProperties": False,
        },
        output_schema={
            "type": "object",
            "properties": {
                "exact": {
                    "type": "boolean",
                    "description": "True when the items matched the id or a whole name; "
                    "false when they only contain the query (candidates).",
                },
                "total": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "How many items matched (items holds the first ones).",
                },
                "items": {
                    "type": "array",
                    "maxItems": ITEM_LOOKUP_LIMIT,
                    "description": "The matching items, best first.",
                    "items": _ITEM_ENTRY,
                },
            },
            "required": ["exact", "total", "items"],
        },
        read_only=True,
        idempotent=True,
        event_allowed=True,
        kind=ToolKind.GAME,
        example_input={"query": "钻石"},
        example_output={
            "exact": True,
            "total": 1,
            "items": [
                {
                    "id": "minecraft:diamond",
                    "name": {"zh": "钻石", "en": "Diamond"},
                    "sources": {
                        "crafting": [
                            {
                                "count": 9,
                                "inputs": [
                                    {
                                        "id": "minecraft:diamond_block",
                                        "name": {"zh": "钻石块", "en": "Block of Diamond"},
                                        "count": 1,
                                    }
                                ],
                            }
                        ],
                        "smelting": [],
                        "drops": [],
                        "mining": [
                            {
                                "block": {
                                    "id": "minecraft:diamond_ore",
                                    "name": {"zh": "钻石矿石", "en": "Diamond Ore"},
                                }
                            }
                        ],
                        "shop": [
                            {"price": 100, "stock": 64, "currency": {"zh": "金币", "en": "coins"}}
                        ],
                    },
                }
            ],
        },
    ),
    *SIGNIN_GAME_TOOLS,
    ToolSpec(
        tool_id="minecraft:mail.list",
        description=(
            "List the player's mail, newest first, one page at a time (page from 1, "
            f"page_size 1 to {MAIL_PAGE_LIMIT}, default 1 and 5). A page past the end is an "
            "empty list, not an error. Reading changes nothing (there is no read state)."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "page": {"type": "integer", "minimum": 1, "description": "Page number, from 1."},
                "page_size": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAIL_PAGE_LIMIT,
                    "description": "Mails per page.",
                },
            },
            "additionalProperties": False,
        },
        output_schema={
            "type": "object",
            "properties": {
                "total": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "How many mails the player has in all.",
                },
                "page": {"type": "integer", "minimum": 1, "description": "This page's number."},
                "page_size": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAIL_PAGE_LIMIT,
                    "description": "Mails per page, as asked (or the default).",
                },
                "mails": {
                    "type": "array",
                    "maxItems": MAIL_PAGE_LIMIT,
                    "description": "This page's mails, newest first.",
                    "items": _MAIL,
                },
            },
            "required": ["mails", "page", "page_size", "total"],
        },
        read_only=True,
        idempotent=True,
        event_allowed=True,
        kind=ToolKind.GAME,
        example_input={"page": 1, "page_size": 5},
        example_output={"total": 1, "page": 1, "page_size": 5, "mails": [_MAIL_EXAMPLE]},
    ),
    ToolSpec(
        tool_id="minecraft:mail.read",
        description=(
            "Read one of the player's mails by id. An unknown id answers found false, not an "
            "error. Reading changes nothing."
        ),
        input_schema=_MAIL_INPUT,
        output_schema={
            "type": "object",
            "properties": {
                "found": {
                    "type": "boolean",
                    "description": "False when the player has no mail with this id.",
                },
                "mail": {**_MAIL, "description": "The mail; present when found."},
            },
            "required": ["found"],
        },
        read_only=True,
        idempotent=True,
        event_allowed=True,
        kind=ToolKind.GAME,
        example_input={"mail_id": "m5"},
        example_output={"found": True, "mail": _MAIL_EXAMPLE},
    ),
    ToolSpec(
        tool_id="minecraft:mail.claim",
        description=(
            "Claim a mail's attachment: its items go into the player's inventory and the mail "
            "is marked claimed, in one step on the game thread (together or not at all). Once "
            "per mail: claiming it again gives nothing and answers already_claimed, so a "
            "repeated call has the effect of one."
        ),
        input_schema=_MAIL_INPUT,
        output_schema={
            "type": "object",
            "properties": {
                "outcome": {
                    "type": "string",
                    "enum": ["claimed", "already_claimed", "no_attachment", "not_found"],
                    "description": "claimed (delivered now), already_claimed (delivered "
                    "before; nothing given), no_attachment or not_found (nothing given).",
                },
                "items": {
                    "type": "array",
                    "description": "The stacks this call delivered; empty unless claimed.",
                    "items": _STACK,
                },
            },
            "required": ["items", "outcome"],
        },
        read_only=False,
        idempotent=True,
        event_allowed=False,
        kind=ToolKind.GAME,
        example_input={"mail_id": "m5"},
        example_output={"outcome": "claimed", "items": _MAIL_EXAMPLE["attachment"]},
    ),
    *SHOP_GAME_TOOLS,
    *ECONOMY_GAME_TOOLS,
)
"""Game tools the gateway protocol documents for every game server; their declarations are
known to the engine without any server connected. A game server may offer more."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    spec: ToolSpec
    handler: ToolHandler | None


class ToolRegistry:
    """Tools by id. Register server tools and known game tools, then `freeze()`.

    Args:
        game_tools: game-tool declarations known up front (the documented ones by default).
    """

    def __init__(self, game_tools: Iterable[ToolSpec] = BUILTIN_GAME_TOOLS) -> None:
        self._tools: dict[str, _Entry] = {}
        self._frozen = False
        for spec in game_tools:
            self.game(spec)

    @property
    def frozen(self) -> bool:
        return self._frozen

    def _check(self, spec: ToolSpec) -> None:
        if self._frozen:
            raise ToolRegistryError(f"cannot register tool {spec.tool_id}: the registry is frozen")
        if not TOOL_ID.match(spec.tool_id):
            raise ToolRegistryError(f"tool id {spec.tool_id!r} is not of the form namespace:path")
        if spec.tool_id in self._tools:
            raise ToolRegistryError(f"tool {spec.tool_id} is already registered")
        if not spec.description:
            raise ToolRegistryError(f"tool {spec.tool_id}: a description is required")
        for name in ("input", "output"):
            schema = getattr(spec, f"{name}_schema")
            try:
                check_schema(schema)
            except ValueError as exc:
                raise ToolRegistryError(f"tool {spec.tool_id}: {name}_schema: {exc}") from None
            example = getattr(spec, f"example_{name}")
            found = None if example is None else violation(schema, example)
            if found is not None:
                raise ToolRegistryError(
                    f"tool {spec.tool_id}: example_{name} breaks its schema: {found.text()}"
                )

    def server(self, spec: ToolSpec, handler: ToolHandler) -> None:
        """Registers a server tool and its one handler.

        Raises:
            ToolRegistryError: frozen, malformed or taken id, a game-tool spec, or a handler
                already serving another tool (one handler, one behaviour).
        """
        self._check(spec)
        if spec.kind != ToolKind.SERVER:
            raise ToolRegistryError(f"tool {spec.tool_id}: a server tool needs kind 'server'")
        if spec.honours_call_id:
            raise ToolRegistryError(
                f"tool {spec.tool_id}: only game tools can honour call ids (a server tool is "
                "declared idempotent or not)"
            )
        # Equality, not identity: two reads of one bound method are equal, not identical.
        owner = next((e.spec.tool_id for e in self._tools.values() if e.handler == handler), None)
        if owner is not None:
            raise ToolRegistryError(
                f"tool {spec.tool_id}: its handler already serves {owner}; "
                "one handler has one behaviour"
            )
        self._tools[spec.tool_id] = _Entry(spec, handler)

    def game(self, spec: ToolSpec) -> None:
        """Declares a game tool (no handler: the game server runs it).

        Raises:
            ToolRegistryError: frozen, malformed or taken id, a server-tool spec, or an id in
                the server-tool namespace.
        """
        self._check(spec)
        if spec.kind != ToolKind.GAME:
            raise ToolRegistryError(f"tool {spec.tool_id}: a game tool needs kind 'game'")
        if spec.tool_id.split(":", 1)[0] == SERVER_TOOL_NAMESPACE:
            raise ToolRegistryError(
                f"tool {spec.tool_id}: the {SERVER_TOOL_NAMESPACE}: namespace is for server tools"
            )
        if spec.needs_context:
            raise ToolRegistryError(
                f"tool {spec.tool_id}: only server tools get the execution context"
            )
        self._tools[spec.tool_id] = _Entry(spec, None)

    def resolve(self, tool_id: str) -> ToolSpec:
        """The declaration of a tool a module names, declaring unknown game tools on the way.

        A module may name a game tool the engine has no declaration for (a game server's own
        tool): any well-formed id outside the `system:` namespace. Such a tool is taken as the
        most restricted kind: a non-idempotent write that events may not call.

        Raises:
            ToolRegistryError: malformed id, or an unregistered `system:` (server) tool.
        """
        entry = self._tools.get(tool_id)
        if entry is not None:
            return entry.spec
        if not TOOL_ID.match(tool_id):
            raise ToolRegistryError(f"tool id {tool_id!r} is not of the form namespace:path")
        if tool_id.split(":", 1)[0] == SERVER_TOOL_NAMESPACE:
            raise ToolRegistryError(f"server tool {tool_id} is not registered")
        spec = ToolSpec(
            tool_id=tool_id,
            description=f"Game tool {tool_id}.",
            kind=ToolKind.GAME,
            declared=False,
        )
        self.game(spec)
        return spec

    def freeze(self) -> None:
        self._frozen = True

    def get(self, tool_id: str) -> ToolSpec | None:
        entry = self._tools.get(tool_id)
        return entry.spec if entry else None

    def handler(self, tool_id: str) -> ToolHandler | None:
        """The server tool's handler; None for game tools and unknown ids."""
        entry = self._tools.get(tool_id)
        return entry.handler if entry else None

    def specs(self) -> list[ToolSpec]:
        return [entry.spec for entry in self._tools.values()]
