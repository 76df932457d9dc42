"""The server shop of the simulated world: what `minecraft:shop.list`, `minecraft:shop.item`
and `minecraft:shop.buy` answer (docs/game-tools.md).

The listings start as `items.SHOP` and change per world: stock goes down with each sale, and an
operator (a test) may change a price or the stock. A purchase checks the price the buyer was
quoted, the stock and the balance, then debits, takes the stock and delivers the items in one
call on the game thread, together or not at all. Each order id is decided once: a repeat of an
order id (a second confirm, a retry after a crash) answers the first outcome again, marked
`replayed`, and changes nothing.
"""

from __future__ import annotations

import dataclasses
import unicodedata
from collections import Counter
from typing import Any

from services.gamesim import items
from services.gamesim.orders import DecidedOrders

__all__ = ["CATEGORIES", "DEFAULT_PAGE_SIZE", "PAGE_LIMIT", "Shop"]

PAGE_LIMIT = 10
"""Most listings one page holds."""
DEFAULT_PAGE_SIZE = 5
MAX_COUNT = 64
"""Most items one order buys (one stack)."""
CATEGORIES: dict[str, dict[str, str]] = {
    "materials": {"zh": "材料", "en": "Materials"},
    "tools": {"zh": "工具与武器", "en": "Tools and weapons"},
    "food": {"zh": "食物", "en": "Food"},
    "misc": {"zh": "杂项", "en": "Miscellaneous"},
}
"""Browse categories, in display order, with their names."""


def _listing(listing: items.ShopListing) -> dict[str, Any]:
    return {
        "item": {"id": listing.item_id, "name": items.name_of(listing.item_id)},
        "price": listing.price,
        "stock": listing.stock,
        "category": listing.category,
    }


def _fold(text: str) -> str:
    return unicodedata.normalize("NFKC", text).strip().casefold()


def _int(data: dict[str, Any], name: str, low: int, high: int, default: int | None) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ValueError(f"{name} must be a whole number from {low} to {high}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be from {low} to {high}")
    return int(value)


class Shop:
    """This world's listings and the orders it has decided."""

    def __init__(self) -> None:
        self.listings: dict[str, items.ShopListing] = {
            s.item_id: dataclasses.replace(s) for s in items.SHOP
        }
        self._orders = DecidedOrders()

    @staticmethod
    def _matches(listing: items.ShopListing, query: str) -> bool:
        names = items.name_of(listing.item_id).values()
        path = listing.item_id.partition(":")[2]
        return query in path or query == listing.item_id or any(query in _fold(n) for n in names)

    def list_page(self, data: dict[str, Any]) -> dict[str, Any]:
        """`minecraft:shop.list`: a page of the listings, filtered by category and by a name
        or id fragment (zh or en)."""
        unknown = set(data) - {"page", "page_size", "category", "query"}
        if unknown:
            raise ValueError(f"shop.list does not take {', '.join(sorted(unknown))}")
        page = _int(data, "page", 1, 1_000_000, 1)
        size = _int(data, "page_size", 1, PAGE_LIMIT, DEFAULT_PAGE_SIZE)
        category = data.get("category", "")
        if category and category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; known: {', '.join(CATEGORIES)}")
        query = data.get("query", "")
        if not isinstance(query, str) or len(query) > 64:
            raise ValueError("query must be text of at most 64 characters")
        folded = _fold(query)
        found = [
            listing
            for listing in self.listings.values()
            if (not category or listing.category == category)
            and (not folded or self._matches(listing, folded))
        ]
        start = (page - 1) * size
        return {
            "total": len(found),
            "page": page,
            "page_size": size,
            "categories": [{"id": key, "name": dict(name)} for key, name in CATEGORIES.items()],
            "currency": dict(items.CURRENCY),
            "listings": [_listing(listing) for listing in found[start : start + size]],
        }

    def detail(self, data: dict[str, Any]) -> dict[str, Any]:
        """`minecraft:shop.item`: one listing by item id; found false when not for sale."""
        item = data.get("item")
        if not isinstance(item, str) or not 1 <= len(item) <= 128 or set(data) != {"item"}:
            raise ValueError("shop.item takes exactly an item id of 1 to 128 characters")
        listing = self.listings.get(item)
        if listing is None:
            return {"found": False, "currency": dict(items.CURRENCY)}
        return {
            "found": True,
            "currency": dict(items.CURRENCY),
            "listing": _listing(listing),
        }

    def buy(
        self, player_id: str, balance: int, inventory: Counter[str], data: dict[str, Any]
    ) -> tuple[dict[str, Any], int]:
        """`minecraft:shop.buy`: returns the answer and the buyer's balance after it.

        The checks, in order: the order id was decided before (the first answer, replayed),
        not for sale, price changed since the quote, not enough stock, not enough money.
        Only a `purchased` outcome changes anything: the balance, the stock and the inventory
        together.
        """
        order_id, item = data.get("order_id"), data.get("item")
        if not isinstance(order_id, str) or not 1 <= len(order_id) <= 64:
            raise ValueError("shop.buy needs an order_id of 1 to 64 characters")
        if not isinstance(item, str) or not 1 <= len(item) <= 128:
            raise ValueError("shop.buy needs an item id of 1 to 128 characters")
        count = _int(data, "count", 1, MAX_COUNT, None)
        quoted = _int(data, "unit_price", 0, 10**12, None)
        decided = self._orders.get(player_id, order_id)
        if decided is not None:
            return {**decided, "replayed": True, "balance": balance}, balance
        listing = self.listings.get(item)
        outcome = "purchased"
        if listing is None:
            outcome = "not_for_sale"
        elif listing.price != quoted:
            outcome = "price_changed"
        elif listing.stock < count:
            outcome = "sold_out"
        elif balance < listing.price * count:
            outcome = "insufficient_balance"
        price = listing.price if listing else quoted
        answer = {
            "outcome": outcome,
            "order_id": order_id,
            "item": {"id": item, "name": items.name_of(item)},
            "count": count,
            "unit_price": price,
            "total": price * count,
            "stock": listing.stock if listing else 0,
        }
        if outcome == "purchased":
            assert listing is not None
            balance -= listing.price * count
            listing.stock -= count
            inventory[item] += count
            answer["stock"] = listing.stock
        self._orders.decide(player_id, order_id, answer)
        return {**answer, "replayed": False, "balance": balance}, balance
