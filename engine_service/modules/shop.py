"""The server shop (商城): browse, search and item detail (`system:shop`), a quote
(`system:shop_buy`), and buying by confirming the quote (`system:shop_confirm`).

`system:shop` only reads (`minecraft:shop.list`, `minecraft:shop.item`), so local routing may
pick it: `/shop` lists the first page with a button per category, `/shop 钻石` searches names
(zh and en) and ids and opens the detail when one item matches.

`system:shop_buy` (`/buy <item> [count]`, the Buy buttons of a detail card, or the model's
routing; never a local match or the cache) makes a quote: price, total, balance after and
stock, kept as the player's current shop offer (engine_service/offers.py). Its card has id
`system:shop.quote` and the offer's version: a newer quote replaces it on screen and makes
it stale. When the balance or the stock cannot cover it, the quote shows the price and why,
without a confirm button.

`system:shop_confirm` has no command and no routing profile: only a structured press of the
quote card's confirm button (marked `press_only`) reaches it, and it refuses any other source.
It takes the offer and places the order in one storage transaction, then buys on the game
server with the order id as the idempotency key (`minecraft:shop.buy`: debit, stock and
delivery together on the game thread), then settles the order. Pressing confirm twice, or
again after a crash, charges once: the second press finds the order and shows its receipt, or
finishes an order left placed (the game server answers a known order id with its first
outcome).
"""

from __future__ import annotations

import re
from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.modules.buttons import invoke
from engine_service.modules.confirm import CONFIRM_INPUT, ConfirmTexts, confirm_offer, valid_span
from engine_service.modules.profile import PLAYER_PROFILE
from engine_service.modules.text import pick, singular
from engine_service.offers import OFFER_MAKE, OFFER_TAKE, ORDER_SETTLE
from engine_service.registry import (
    CommandSpec,
    ExecutionPolicy,
    ModuleContext,
    ModuleSpec,
    SemanticSpec,
)
from engine_service.tools import SHOP_MAX_COUNT
from services.results import AgentFailure, ModuleFailure, card, failed, succeeded
from services.texts import CHINESE_NUMERALS, MEASURE_WORDS, chinese_number

__all__ = [
    "BOOK",
    "PAGE_SIZE",
    "QUOTE_CARD",
    "SHOP_BUY",
    "SHOP_ITEM",
    "SHOP_LIST",
    "ShopBuyModule",
    "ShopConfirmModule",
    "ShopModule",
]

SHOP_LIST = "minecraft:shop.list"
SHOP_ITEM = "minecraft:shop.item"
SHOP_BUY = "minecraft:shop.buy"
SHOP = "system:shop"
BUY = "system:shop_buy"
CONFIRM = "system:shop_confirm"
BOOK = "system:shop"
"""The offers book of the shop: one current quote per player."""
QUOTE_CARD = "system:shop.quote"
"""Card id of the quote: each new quote is a newer version of it."""
PAGE_SIZE = 5
MAX_PAGE = 1000
BULK = 16
"""The detail card's second Buy button buys this many."""
_TRAILING_COUNT = re.compile(
    rf"^(?P<item>.*?)\s*(?:[x×*]\s*)?(?<!\d)(?P<count>-?\d{{1,18}})\s*[{MEASURE_WORDS}]?$"
)
_LEADING_COUNT = re.compile(
    rf"^(?:[x×*]\s*)?(?P<count>-?\d{{1,18}}|[{CHINESE_NUMERALS}]{{1,4}}(?=[{MEASURE_WORDS}]))"
    rf"\s*(?:[{MEASURE_WORDS}]|[x×*](?=\s))?\s*(?P<item>[^\d\s].*)$"
)
"""`3 bread`, `x3 bread`, `3个面包`, `三个面包`: a Chinese numeral only with its measure word
(`三叉戟` is the trident, not three of something)."""

_ITEM_TEXT = {
    "type": "string",
    "minLength": 1,
    "maxLength": 64,
    "description": "An item id (minecraft:diamond) or name (钻石, diamond).",
}

_SHOP_TITLE = {"zh": "商城", "en": "Shop"}
_PAGED = {"zh": "{title}（第 {page}/{pages} 页）", "en": "{title} (page {page} of {pages})"}
_SEARCH_TITLE = {"zh": "商城搜索：{query}", "en": "Shop search: {query}"}
_ENTRY = {
    "zh": "{n}. {name} — {price} {currency}（库存 {stock}）",
    "en": "{n}. {name} — {price:~~{currency}} ({stock} in stock)",
}
_COUNT_RANGE = {
    "zh": "一次可以买 1 到 {most} 个，不能买 {count} 个。",
    "en": "Buy 1 to {most} at a time, not {count}.",
}
_EMPTY = {"zh": "没有符合的商品。", "en": "Nothing for sale matches."}
_NO_PAGE = {
    "zh": "没有第 {page} 页（共 {pages} 页）。",
    "en": "There is no page {page} (there are {pages}).",
}
_PREVIOUS = {"zh": "上一页", "en": "Previous page"}
_NEXT = {"zh": "下一页", "en": "Next page"}
_ALL = {"zh": "全部商品", "en": "All items"}
_BACK = {"zh": "返回商城", "en": "Back to the shop"}

_ID = {"zh": "物品 ID：{id}", "en": "Item id: {id}"}
_PRICE = {"zh": "单价：{price} {currency}", "en": "Price: {price:~~{currency}} each"}
_STOCK = {"zh": "库存：{stock}", "en": "In stock: {stock}"}
_BUY_N = {"zh": "购买 {count} 个", "en": "Buy {count}"}
_ITEM_INFO = {"zh": "物品来源", "en": "Where it comes from"}
_NOT_SOLD_TITLE = {"zh": "商城没有这件商品", "en": "Not for sale"}
_NOT_SOLD = {
    "zh": "商城没有出售“{query}”。输入 /shop 查看全部商品。",
    "en": "The shop does not sell “{query}”. Type /shop to see everything for sale.",
}
_CANDIDATES_TITLE = {"zh": "你想买哪一件？", "en": "Which one do you want to buy?"}

_QUOTE_TITLE = {"zh": "确认购买", "en": "Confirm purchase"}
_QUOTE_ITEM = {"zh": "{name} × {count}", "en": "{name} × {count}"}
_QUOTE_TOTAL = {
    "zh": "单价 {price}，合计 {total} {currency}",
    "en": "{price} each, {total:~~{currency}} in all",
}
_QUOTE_BALANCE = {
    "zh": "余额 {balance}，购买后 {after} {currency}",
    "en": "Balance {balance}, {after:~~{currency}} after buying",
}
_QUOTE_VALID = {
    "zh": "报价 {time}内有效；请按“确认购买”按钮。",
    "en": "This quote holds for {time}; press “Confirm purchase”.",
}
_CONFIRM = {"zh": "确认购买", "en": "Confirm purchase"}
_CANNOT = {"zh": "无法购买：{reason}", "en": "You cannot buy this: {reason}"}

_DONE_TITLE = {"zh": "购买成功", "en": "Purchase complete"}
_PAID = {
    "zh": "已支付 {total} {currency}，余额 {balance}",
    "en": "Paid {total:~~{currency}}; balance {balance}",
}
_DELIVERED = {"zh": "物品已放入背包。", "en": "The items are in your inventory."}
_ORDER = {"zh": "订单号：{order}", "en": "Order: {order}"}
_REPLAYED = {
    "zh": "这笔订单之前已经完成，这次没有再扣款。",
    "en": "This order was completed before; you were not charged again.",
}
_INSUFFICIENT_TITLE = {"zh": "余额不足", "en": "Not enough money"}
_INSUFFICIENT = {
    "zh": "需要 {total} {currency}，你的余额是 {balance}。没有扣款。",
    "en": "It costs {total:~~{currency}} and your balance is {balance}. Nothing was charged.",
}
_SOLD_OUT_TITLE = {"zh": "库存不足", "en": "Sold out"}
_SOLD_OUT = {
    "zh": "{name} 只剩 {stock} 个，不够 {count} 个。没有扣款。",
    "en": "Only {stock} {name} left, fewer than {count}. Nothing was charged.",
}
_PRICE_CHANGED_TITLE = {"zh": "价格已变动", "en": "The price changed"}
_PRICE_CHANGED = {
    "zh": "{name} 的单价已从 {quoted} 变为 {price} {currency}。没有扣款；可按新价格重新报价。",
    "en": "{name} now costs {price:~~{currency}} each, not {quoted}. Nothing was charged; ask "
    "for a new quote at the new price.",
}
_REQUOTE = {"zh": "按新价格报价", "en": "Quote at the new price"}
_NOT_FOR_SALE = {
    "zh": "{name} 已经下架。没有扣款。",
    "en": "{name} is no longer for sale. Nothing was charged.",
}
_STALE_TITLE = {"zh": "报价已失效", "en": "This quote is no longer valid"}
_STALE = {
    "zh": "这张报价已被更新的报价取代或已作废。没有扣款；请重新报价。",
    "en": "A newer quote replaced this one, or it was withdrawn. Nothing was charged; ask "
    "for a new quote.",
}
_EXPIRED = {
    "zh": "这张报价已超过有效期。没有扣款；请重新报价。",
    "en": "This quote has expired. Nothing was charged; ask for a new quote.",
}
_SEARCH = {"zh": "商品名", "en": "item name"}
"""How help writes the shop's search argument (`/shop [商品名]`, `/shop [item name]`)."""
_CONFIRM_TEXTS = ConfirmTexts(stale_title=_STALE_TITLE, stale=_STALE, expired=_EXPIRED)


def _listing_line(n: int, listing: dict[str, Any], currency: dict[str, str], language: str) -> str:
    return pick(
        _ENTRY,
        language,
        n=n,
        name=pick(listing["item"]["name"], language),
        price=listing["price"],
        currency=pick(currency, language),
        stock=listing["stock"],
    )


class ShopModule:
    """Browses the shop by page and category, searches it, and shows one item."""

    spec = ModuleSpec(
        module_id=SHOP,
        description={
            "zh": "逛商城：按分类和页浏览商品、按名称搜索、查看商品详情（价格与库存）；购买在"
            "详情卡片上报价后确认。",
            "en": "The server shop: browse by category and page, search by name, see an item's "
            "price and stock; buy from its card (quote, then confirm).",
        },
        input_schema={
            "type": "object",
            "properties": {
                "page": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAX_PAGE,
                    "description": "Page of the list, from 1.",
                },
                "category": {
                    "type": "string",
                    "pattern": "^[a-z0-9_]{1,32}$",
                    "description": "Only this category (materials, tools, food, misc).",
                },
                "query": {**_ITEM_TEXT, "description": "Search item names and ids."},
                "item": {**_ITEM_TEXT, "description": "Show this item's listing (an id)."},
            },
            "additionalProperties": False,
        },
        commands=(
            CommandSpec(
                ("shop", "store", "商城", "商店"), argument="query", argument_label=_SEARCH
            ),
        ),
        routing_mode=catalog_pb2.ROUTING_MODE_READ,
        semantic=SemanticSpec(
            examples={
                "zh": (
                    "打开商店",
                    "逛逛系统商铺",
                    "查看商城",
                    "商店里卖什么",
                    "显示商品列表",
                    "看看商店有什么",
                    "浏览商城",
                    "商店价格表",
                    "查看商品价格",
                    "商城有哪些商品",
                    "钻石多少钱",
                    "火把在商店卖多少钱",
                    "金锭的价格",
                ),
                "en": (
                    "open the shop",
                    "browse the store",
                    "show the market",
                    "what does the shop sell",
                    "list shop items",
                    "show shop prices",
                    "what's for sale",
                    "view the item shop",
                    "how much is a diamond",
                    "how much do torches cost in the shop",
                    "price of a gold ingot",
                ),
            },
            # A price question's item becomes the search (`钻石多少钱`: the diamond's listing).
            extractor="price",
            choice_label="system.shop.choice",
        ),
        tools=(SHOP_LIST, SHOP_ITEM),
        policy=ExecutionPolicy(rounds=1, model_calls=0, tool_calls=2, steps=2, seconds=10.0),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        if "item" in data:
            item = str(data["item"]).strip()
            found = await ctx.tool(SHOP_ITEM, {"item": item})
            if not found["found"]:
                return _not_sold(item, language)
            return succeeded(_detail_card(found["listing"], found["currency"], language))
        query = str(data.get("query", "")).strip()
        request: dict[str, Any] = {"page": int(data.get("page", 1)), "page_size": PAGE_SIZE}
        if data.get("category"):
            request["category"] = data["category"]
        if query:
            request["query"] = query
        listed = await ctx.tool(SHOP_LIST, request)
        second = _second_search(request, listed["categories"]) if not listed["total"] else None
        if second is not None:
            found = await ctx.tool(SHOP_LIST, second)
            if found["total"] or "query" not in second:  # a category's page, even empty
                request, listed, query = second, found, second.get("query", "")
        # A search that names one listing whole (`钻石`, not only `钻石剑`), or finds one, is
        # that listing's card.
        named = _named(listed["listings"], query) if query else None
        if named is None and query and listed["total"] == 1 and listed["listings"]:
            named = listed["listings"][0]
        if named is not None:
            return succeeded(_detail_card(named, listed["currency"], language))
        if query and not listed["total"]:
            return _not_sold(query, language)
        return succeeded(_list_card(listed, request, language))


def _second_search(
    request: dict[str, Any], categories: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """Where a search found nothing: the category its words name instead (`/shop food`), or
    the search in the English singular (`diamonds`); None for neither (or no search)."""
    query = request.get("query", "")
    category = _category(categories, query) if query else None
    if category:
        return {**{k: v for k, v in request.items() if k != "query"}, "category": category}
    again = singular(query) if query else None
    return {**request, "query": again} if again else None


def _category(categories: list[dict[str, Any]], text: str) -> str | None:
    """The id of the category `text` names whole (its id or a name in any language)."""
    folded = text.casefold()
    return next(
        (
            c["id"]
            for c in categories
            if folded in (c["id"], *(n.casefold() for n in c["name"].values()))
        ),
        None,
    )


def _named(listings: list[dict[str, Any]], text: str) -> dict[str, Any] | None:
    """The one listing `text` names whole: a name in any language or the id's path."""
    folded = text.casefold()
    exact = [
        listing
        for listing in listings
        if folded
        in (
            listing["item"]["id"].partition(":")[2],
            *(n.casefold() for n in listing["item"]["name"].values()),
        )
    ]
    return exact[0] if len(exact) == 1 else None


def _not_sold(query: str, language: str) -> common_pb2.AgentResult:
    result = failed(
        AgentFailure.NOT_FOUND,
        pick(_NOT_SOLD, language, query=query),
        title=pick(_NOT_SOLD_TITLE, language),
    )
    result.card.buttons.append(invoke(SHOP, pick(_BACK, language), {}, label_key="back"))
    return result


def _list_card(listed: dict[str, Any], request: dict[str, Any], language: str) -> common_pb2.Card:
    total, page, size = listed["total"], listed["page"], listed["page_size"]
    pages = max((total + size - 1) // size, 1)
    names = {c["id"]: pick(c["name"], language) for c in listed["categories"]}
    if "query" in request:
        title = pick(_SEARCH_TITLE, language, query=request["query"])
    elif "category" in request:
        title = (
            f"{pick(_SHOP_TITLE, language)} · {names.get(request['category'], request['category'])}"
        )
    else:
        title = pick(_SHOP_TITLE, language)
    if pages > 1 or page > 1:
        title = pick(_PAGED, language, title=title, page=page, pages=pages)
    lines: list[str | tuple[str, str]] = []
    buttons = []
    for n, listing in enumerate(listed["listings"], 1):
        item_id = listing["item"]["id"]
        lines.append((_listing_line(n, listing, listed["currency"], language), f"/shop {item_id}"))
        buttons.append(invoke(SHOP, pick(listing["item"]["name"], language), {"item": item_id}))
    if not listed["listings"]:
        lines.append(
            pick(_NO_PAGE, language, page=page, pages=pages) if total else pick(_EMPTY, language)
        )
    keep = {k: v for k, v in request.items() if k in ("category", "query")}
    if 1 < page <= pages:
        buttons.append(
            invoke(
                SHOP, pick(_PREVIOUS, language), {**keep, "page": page - 1}, label_key="previous"
            )
        )
    if page < pages:
        buttons.append(
            invoke(SHOP, pick(_NEXT, language), {**keep, "page": page + 1}, label_key="next")
        )
    if not keep:  # the front page offers the categories
        buttons += [invoke(SHOP, name, {"category": key}) for key, name in names.items()]
    else:
        buttons.append(invoke(SHOP, pick(_ALL, language), {}))
    return card(SHOP, title, lines, buttons)


def _detail_card(
    listing: dict[str, Any], currency: dict[str, str], language: str
) -> common_pb2.Card:
    item = listing["item"]
    lines: list[str | tuple[str, str]] = [
        (pick(_ID, language, id=item["id"]), f"/item {item['id']}"),
        pick(_PRICE, language, price=listing["price"], currency=pick(currency, language)),
        pick(_STOCK, language, stock=listing["stock"]),
    ]
    buttons = []
    for count in (1, BULK):
        if listing["stock"] >= count:
            # `buy it` / `买` typed at the card means one: the single purchase is the `buy`
            # kind (a quote, still confirmed by a press); the bulk one is pressed by its label.
            buttons.append(
                invoke(
                    BUY,
                    pick(_BUY_N, language, count=count),
                    {"item": item["id"], "count": count},
                    label_key="buy" if count == 1 else "",
                )
            )
    buttons.append(invoke("system:item", pick(_ITEM_INFO, language), {"item_id": item["id"]}))
    buttons.append(invoke(SHOP, pick(_BACK, language), {}, label_key="back"))
    return card(SHOP, pick(item["name"], language), lines, buttons)


def _split_count(text: str) -> tuple[str, int | None]:
    """`钻石 3` / `diamond x3` / `面包 10 个` / `3 bread` / `三个面包` → (item text, count); no
    count: None."""
    stripped = text.strip()
    match = _TRAILING_COUNT.match(stripped)
    if match and match["item"].strip():
        return match["item"].strip(), int(match["count"])
    match = _LEADING_COUNT.match(stripped)
    if match:
        count = match["count"]
        return match["item"].strip(), (
            int(count) if count.lstrip("-").isdigit() else chinese_number(count)
        )
    return stripped, None


class ShopBuyModule:
    """Quotes a purchase: the confirmation card of the player's current shop offer."""

    spec = ModuleSpec(
        module_id=BUY,
        description={
            "zh": "购买商城商品：先给出报价（单价、合计、购买后余额、库存），在报价卡片上按"
            "“确认购买”后才扣款发货。",
            "en": "Buy from the shop: first a quote (price, total, balance after, stock); "
            "nothing is charged until Confirm is pressed on the quote card.",
        },
        input_schema={
            "type": "object",
            "properties": {
                "item": {
                    **_ITEM_TEXT,
                    "description": "The item (id or name), optionally "
                    "followed by a count (钻石 3).",
                },
                "count": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": SHOP_MAX_COUNT,
                    "description": "How many to buy (default 1).",
                },
            },
            "required": ["item"],
            "additionalProperties": False,
        },
        commands=(
            CommandSpec(
                ("buy", "购买"),
                argument="item",
                argument_required=True,
                argument_label={"zh": "物品 [数量]", "en": "item [count]"},
            ),
        ),
        routing_mode=catalog_pb2.ROUTING_MODE_HINTS,
        semantic=SemanticSpec(
            examples={
                "zh": (
                    "购买钻石",
                    "买 10 个面包",
                    "在商店购买",
                    "我要买这个",
                    "从商城买一把剑",
                    "下单购买",
                    "购买一组火把",
                    "我想买一个信标",
                ),
                "en": (
                    "buy a diamond sword",
                    "purchase 10 bread",
                    "buy from the shop",
                    "I want to buy this",
                    "order an item from the store",
                    "purchase it",
                    "buy 5 torches",
                    "I'd like to purchase a beacon",
                ),
            }
        ),
        tools=(SHOP_LIST, SHOP_ITEM, PLAYER_PROFILE, OFFER_MAKE),
        policy=ExecutionPolicy(
            rounds=1, model_calls=0, tool_calls=4, steps=4, seconds=15.0, write_steps=1
        ),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        text, typed = _split_count(str(data["item"]))
        # `diamond 0` is a count out of range, not a count left out.
        count = int(data.get("count", 1 if typed is None else typed))
        if not 1 <= count <= SHOP_MAX_COUNT:
            raise ModuleFailure(
                AgentFailure.INVALID_INPUT,
                pick(_COUNT_RANGE, language, most=SHOP_MAX_COUNT, count=count),
            )
        listing, currency, candidates = await self._find(ctx, text)
        if listing is None:
            if not candidates:
                return _not_sold(text, language)
            lines: list[str | tuple[str, str]] = []
            buttons = []
            for n, candidate in enumerate(candidates, 1):
                lines.append(_listing_line(n, candidate, currency, language))
                buttons.append(
                    invoke(
                        BUY,
                        pick(candidate["item"]["name"], language),
                        {"item": candidate["item"]["id"], "count": count},
                    )
                )
            return succeeded(card(BUY, pick(_CANDIDATES_TITLE, language), lines, buttons))
        profile = await ctx.tool(PLAYER_PROFILE, {})
        return succeeded(await self._quote(ctx, listing, currency, count, profile["balance"]))

    @staticmethod
    async def _find(
        ctx: ModuleContext, text: str
    ) -> tuple[dict[str, Any] | None, dict[str, str], list[dict[str, Any]]]:
        """The listing `text` names (an id, or a whole name or id path), or the candidates."""
        if ":" in text:
            found = await ctx.tool(SHOP_ITEM, {"item": text})
            return (found.get("listing"), found["currency"], [])
        listed = await ctx.tool(SHOP_LIST, {"query": text, "page_size": 10})
        again = None if listed["listings"] else singular(text)
        if again is not None:
            # `64 torches`, `2 diamond swords`: the shop names an item in the singular, as the
            # shop's search tries it (`_second_search`).
            text = again
            listed = await ctx.tool(SHOP_LIST, {"query": text, "page_size": 10})
        named = _named(listed["listings"], text)
        if named is not None:
            return named, listed["currency"], []
        if len(listed["listings"]) == 1:
            return listed["listings"][0], listed["currency"], []
        return None, listed["currency"], listed["listings"]

    @staticmethod
    async def _quote(
        ctx: ModuleContext,
        listing: dict[str, Any],
        currency: dict[str, str],
        count: int,
        balance: int,
    ) -> common_pb2.Card:
        language = ctx.player.language
        item, price = listing["item"], listing["price"]
        total = price * count
        name = pick(item["name"], language)
        money = pick(currency, language)
        lines: list[str | tuple[str, str]] = [
            pick(_QUOTE_ITEM, language, name=name, count=count),
            pick(_QUOTE_TOTAL, language, price=price, total=total, currency=money),
        ]
        if balance >= total:  # short of money, the refusal below says the balance instead
            after = balance - total
            lines.append(
                pick(_QUOTE_BALANCE, language, balance=balance, after=after, currency=money)
            )
        lines.append(pick(_STOCK, language, stock=listing["stock"]))
        back = invoke(SHOP, pick(_BACK, language), {}, label_key="back")
        # The seed's prepared cost: the price is always shown; a refusal is optional.
        if listing["stock"] < count:
            reason = pick(_SOLD_OUT, language, name=name, stock=listing["stock"], count=count)
        elif balance < total:
            reason = pick(_INSUFFICIENT, language, total=total, currency=money, balance=balance)
        else:
            reason = ""
        if reason:
            lines.append(pick(_CANNOT, language, reason=reason))
            return card(BUY, pick(_QUOTE_TITLE, language), lines, [back])
        offer = await ctx.tool(
            OFFER_MAKE,
            {
                "book": BOOK,
                "terms": {
                    "item": item["id"],
                    "name": item["name"],
                    "count": count,
                    "unit_price": price,
                    "total": total,
                    "currency": currency,
                },
            },
        )
        lines.append(
            pick(_QUOTE_VALID, language, time=valid_span(offer["valid_seconds"], language))
        )
        confirm = invoke(
            CONFIRM,
            pick(_CONFIRM, language),
            {"offer_id": offer["offer_id"], "version": offer["version"]},
            press_only=True,
            label_key="confirm",
        )
        quote = card(BUY, pick(_QUOTE_TITLE, language), lines, [confirm, back])
        quote.ref.card_id = QUOTE_CARD
        quote.ref.version = offer["version"]
        return quote


class ShopConfirmModule:
    """Confirms the quote: places the order, buys on the game server, settles the order."""

    spec = ModuleSpec(
        module_id=CONFIRM,
        description={
            "zh": "确认购买（仅限报价卡片上的“确认购买”按钮）：扣款、发货并记录订单，同一报价"
            "只扣一次款。",
            "en": "Confirm a purchase (only the Confirm button of a quote card): charge, deliver "
            "and record the order; one quote is charged at most once.",
        },
        input_schema=CONFIRM_INPUT,
        routing_mode=catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY,
        tools=(OFFER_TAKE, SHOP_BUY, ORDER_SETTLE),
        policy=ExecutionPolicy(
            rounds=1, model_calls=0, tool_calls=3, steps=3, seconds=20.0, write_steps=3
        ),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language

        async def buy(order: dict[str, Any]) -> dict[str, Any]:
            terms = order["terms"]
            return await ctx.tool(
                SHOP_BUY,
                {
                    "order_id": order["order_id"],
                    "item": terms["item"],
                    "count": terms["count"],
                    "unit_price": terms["unit_price"],
                },
            )

        applied = await confirm_offer(
            ctx,
            BOOK,
            data,
            buy,
            lambda outcome: outcome["outcome"] == "purchased",
            _CONFIRM_TEXTS,
            invoke(SHOP, pick(_BACK, language), {}, label_key="back"),
        )
        if isinstance(applied, common_pb2.AgentResult):
            return applied
        return _outcome_result(applied.outcome, applied.terms, language, replayed=applied.replayed)


def _outcome_result(
    bought: dict[str, Any], terms: dict[str, Any], language: str, *, replayed: bool
) -> common_pb2.AgentResult:
    """The card of a buy outcome: the receipt, or the failure card of a refusal."""
    money = pick(terms["currency"], language)
    name = pick(terms["name"], language)
    back = invoke(SHOP, pick(_BACK, language), {}, label_key="back")
    outcome = bought["outcome"]
    if outcome == "purchased":
        lines = [
            pick(_QUOTE_ITEM, language, name=name, count=bought["count"]),
            pick(_PAID, language, total=bought["total"], currency=money, balance=bought["balance"]),
            pick(_DELIVERED, language),
            pick(_ORDER, language, order=bought["order_id"]),
        ]
        if replayed:
            lines.append(pick(_REPLAYED, language))
        return succeeded(card(CONFIRM, pick(_DONE_TITLE, language), lines, [back]))
    requote = invoke(
        BUY, pick(_REQUOTE, language), {"item": terms["item"], "count": terms["count"]}
    )
    if outcome == "insufficient_balance":
        key, title = AgentFailure.INSUFFICIENT_BALANCE, _INSUFFICIENT_TITLE
        message = pick(
            _INSUFFICIENT,
            language,
            total=bought["total"],
            currency=money,
            balance=bought["balance"],
        )
        buttons = [back]
    elif outcome == "sold_out":
        key, title = AgentFailure.SOLD_OUT, _SOLD_OUT_TITLE
        message = pick(_SOLD_OUT, language, name=name, stock=bought["stock"], count=bought["count"])
        buttons = [back]
    elif outcome == "price_changed":
        key, title = AgentFailure.PRICE_CHANGED, _PRICE_CHANGED_TITLE
        message = pick(
            _PRICE_CHANGED,
            language,
            name=name,
            quoted=terms["unit_price"],
            price=bought["unit_price"],
            currency=money,
        )
        buttons = [requote, back]
    else:  # not_for_sale
        key, title = AgentFailure.NOT_FOUND, _NOT_SOLD_TITLE
        message = pick(_NOT_FOR_SALE, language, name=name)
        buttons = [back]
    result = failed(key, message, title=pick(title, language))
    result.card.template = CONFIRM
    result.card.buttons.extend(buttons)
    return result
