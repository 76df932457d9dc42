package dev.system.example;

import dev.system.client.GameTool;
import dev.system.client.Structs;
import dev.system.client.ToolException;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.ConcurrentHashMap;
import java.util.function.Function;

/**
 * The example world's money: balances, a small server shop and payments between players, with
 * their game tools {@code minecraft:shop.list}, {@code minecraft:shop.item}, {@code
 * minecraft:shop.buy}, {@code minecraft:economy.transfer} and {@code minecraft:player.find}, as
 * the game-tool catalogue (docs/game-tools.md) documents them. A purchase checks the quoted price, the stock and the
 * balance, then debits, takes the stock and delivers together; a payment moves money between
 * two balances together. Each order id is decided once per player: a repeat answers the first
 * outcome with {@code replayed} true and changes nothing, so a retry never charges twice.
 */
final class Commerce {
  // The schemas below are docs/game-tools.json's, without its descriptions;
  // scripts/java_client_check.py fails when they drift apart.

  static final String SHOP_LIST_INPUT =
      """
      {"additionalProperties":false,"properties":{"category":{"pattern":"^[a-z0-9_]{1,32}$",\
      "type":"string"},"page":{"minimum":1,"type":"integer"},"page_size":{"maximum":10,\
      "minimum":1,"type":"integer"},"query":{"maxLength":64,"type":"string"}},\
      "type":"object"}""";

  static final String SHOP_LIST_OUTPUT =
      """
      {"properties":{"categories":{"items":{"properties":{"id":{"pattern":"^[a-z0-9_]{1,32}$",\
      "type":"string"},"name":{"properties":{"en":{"minLength":1,"type":"string"},\
      "zh":{"minLength":1,"type":"string"}},"required":["zh","en"],"type":"object"}},\
      "required":["id","name"],"type":"object"},"type":"array"},\
      "currency":{"properties":{"en":{"minLength":1,"type":"string"},"zh":{"minLength":1,\
      "type":"string"}},"required":["zh","en"],"type":"object"},\
      "listings":{"items":{"properties":{"category":{"pattern":"^[a-z0-9_]{1,32}$",\
      "type":"string"},"item":{"properties":{"id":{"maxLength":128,"minLength":1,\
      "type":"string"},"name":{"properties":{"en":{"minLength":1,"type":"string"},\
      "zh":{"minLength":1,"type":"string"}},"required":["zh","en"],"type":"object"}},\
      "required":["id","name"],"type":"object"},"price":{"minimum":0,"type":"integer"},\
      "stock":{"minimum":0,"type":"integer"}},"required":["category","item","price","stock"],\
      "type":"object"},"maxItems":10,"type":"array"},"page":{"minimum":1,"type":"integer"},\
      "page_size":{"maximum":10,"minimum":1,"type":"integer"},"total":{"minimum":0,\
      "type":"integer"}},"required":["categories","currency","listings","page","page_size",\
      "total"],"type":"object"}""";

  static final String SHOP_ITEM_INPUT =
      """
      {"additionalProperties":false,"properties":{"item":{"maxLength":128,"minLength":1,\
      "type":"string"}},"required":["item"],"type":"object"}""";

  static final String SHOP_ITEM_OUTPUT =
      """
      {"properties":{"currency":{"properties":{"en":{"minLength":1,"type":"string"},\
      "zh":{"minLength":1,"type":"string"}},"required":["zh","en"],"type":"object"},\
      "found":{"type":"boolean"},\
      "listing":{"properties":{"category":{"pattern":"^[a-z0-9_]{1,32}$","type":"string"},\
      "item":{"properties":{"id":{"maxLength":128,"minLength":1,"type":"string"},\
      "name":{"properties":{"en":{"minLength":1,"type":"string"},"zh":{"minLength":1,\
      "type":"string"}},"required":["zh","en"],"type":"object"}},"required":["id","name"],\
      "type":"object"},"price":{"minimum":0,"type":"integer"},"stock":{"minimum":0,\
      "type":"integer"}},"required":["category","item","price","stock"],"type":"object"}},\
      "required":["currency","found"],"type":"object"}""";

  static final String SHOP_BUY_INPUT =
      """
      {"additionalProperties":false,"properties":{"count":{"maximum":64,"minimum":1,\
      "type":"integer"},"item":{"maxLength":128,"minLength":1,"type":"string"},\
      "order_id":{"pattern":"^[A-Za-z0-9_.-]{1,64}$","type":"string"},\
      "unit_price":{"minimum":0,"type":"integer"}},"required":["count","item","order_id",\
      "unit_price"],"type":"object"}""";

  static final String SHOP_BUY_OUTPUT =
      """
      {"properties":{"balance":{"minimum":0,"type":"integer"},"count":{"minimum":1,\
      "type":"integer"},"item":{"properties":{"id":{"maxLength":128,"minLength":1,\
      "type":"string"},"name":{"properties":{"en":{"minLength":1,"type":"string"},\
      "zh":{"minLength":1,"type":"string"}},"required":["zh","en"],"type":"object"}},\
      "required":["id","name"],"type":"object"},"order_id":{"type":"string"},\
      "outcome":{"enum":["purchased","insufficient_balance","sold_out","price_changed",\
      "not_for_sale"],"type":"string"},"replayed":{"type":"boolean"},"stock":{"minimum":0,\
      "type":"integer"},"total":{"minimum":0,"type":"integer"},"unit_price":{"minimum":0,\
      "type":"integer"}},"required":["balance","count","item","order_id","outcome",\
      "replayed","stock","total","unit_price"],"type":"object"}""";

  static final String TRANSFER_INPUT =
      """
      {"additionalProperties":false,"properties":{"amount":{"maximum":1000000000,"minimum":1,\
      "type":"integer"},"order_id":{"pattern":"^[A-Za-z0-9_.-]{1,64}$","type":"string"},\
      "to":{"maxLength":32,"minLength":1,"type":"string"}},"required":["amount","order_id",\
      "to"],"type":"object"}""";

  static final String TRANSFER_OUTPUT =
      """
      {"properties":{"amount":{"minimum":0,"type":"integer"},"balance":{"minimum":0,\
      "type":"integer"},"order_id":{"type":"string"},"outcome":{"enum":["transferred",\
      "insufficient_balance","unknown_player","self_payment"],"type":"string"},\
      "recipient_online":{"type":"boolean"},"replayed":{"type":"boolean"},\
      "to":{"type":"string"}},"required":["amount","balance","order_id","outcome",\
      "recipient_online","replayed","to"],"type":"object"}""";

  static final String FIND_INPUT =
      """
      {"additionalProperties":false,"properties":{"name":{"maxLength":32,"minLength":1,\
      "type":"string"}},"required":["name"],"type":"object"}""";

  static final String FIND_OUTPUT =
      """
      {"properties":{"found":{"type":"boolean"},"name":{"type":"string"},\
      "online":{"type":"boolean"}},"required":["found","name","online"],"type":"object"}""";

  /** One listing of the shop: price and stock change, the category does not. */
  static final class Listing {
    final InMemoryWorld.Item item;
    final String category;
    long price;
    long stock;

    Listing(InMemoryWorld.Item item, String category, long price, long stock) {
      this.item = item;
      this.category = category;
      this.price = price;
      this.stock = stock;
    }
  }

  static final Map<String, InMemoryWorld.Names> CATEGORIES =
      new LinkedHashMap<>(
          Map.of(
              "materials", new InMemoryWorld.Names("材料", "Materials"),
              "tools", new InMemoryWorld.Names("工具与武器", "Tools and weapons")));
  static final int PAGE_LIMIT = 10;
  static final int ORDER_MEMORY = 65536;

  private final SigninCalendar.Recorder recorder;
  private final Function<String, TreeMap<String, Integer>> inventories;
  private final Map<String, Listing> listings = new LinkedHashMap<>();
  private final Map<String, Long> balances = new ConcurrentHashMap<>();
  private final Map<String, String> names = new ConcurrentHashMap<>();
  private final Map<String, Map<String, Object>> orders =
      java.util.Collections.synchronizedMap(
          new LinkedHashMap<>(16, 0.75f, true) {
            @Override
            protected boolean removeEldestEntry(Map.Entry<String, Map<String, Object>> eldest) {
              return size() > ORDER_MEMORY;
            }
          });

  Commerce(
      SigninCalendar.Recorder recorder, Function<String, TreeMap<String, Integer>> inventories) {
    this.recorder = recorder;
    this.inventories = inventories;
    for (InMemoryWorld.Item item : InMemoryWorld.ITEMS) {
      if (item.shopPrice() != null) {
        String category = item.id().endsWith("_sword") ? "tools" : "materials";
        listings.put(item.id(), new Listing(item, category, item.shopPrice(), 64));
      }
    }
  }

  /** The player's balance (the starting balance on first sight). */
  long balance(String playerId) {
    return balances.computeIfAbsent(playerId, id -> InMemoryWorld.STARTING_BALANCE);
  }

  /** Remembers the name a player joined with: payments name their recipient by it. */
  void joined(String playerId, String name) {
    names.put(playerId, name);
    balance(playerId);
  }

  List<GameTool> tools() {
    return List.of(
        new GameTool(
            "minecraft:shop.list",
            "List the server shop's items for sale, by page, category and name.",
            SHOP_LIST_INPUT,
            SHOP_LIST_OUTPUT,
            true,
            true,
            true,
            this::list),
        new GameTool(
            "minecraft:shop.item",
            "Read one listing of the server shop by item id.",
            SHOP_ITEM_INPUT,
            SHOP_ITEM_OUTPUT,
            true,
            true,
            true,
            this::item),
        new GameTool(
            "minecraft:shop.buy",
            "Buy at the quoted price: debit, stock and delivery together, once per order id.",
            SHOP_BUY_INPUT,
            SHOP_BUY_OUTPUT,
            false,
            true,
            false,
            this::buy),
        new GameTool(
            "minecraft:economy.transfer",
            "Pay another player by name: both balances together, once per order id.",
            TRANSFER_INPUT,
            TRANSFER_OUTPUT,
            false,
            true,
            false,
            this::transfer),
        new GameTool(
            "minecraft:player.find",
            "Find a player the server knows by name, as a payment names its recipient.",
            FIND_INPUT,
            FIND_OUTPUT,
            true,
            true,
            true,
            this::find));
  }

  private static Map<String, Object> listingMap(Listing listing) {
    Map<String, Object> item = new LinkedHashMap<>();
    item.put("id", listing.item.id());
    item.put("name", listing.item.name().toMap());
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("item", item);
    out.put("price", listing.price);
    out.put("stock", listing.stock);
    out.put("category", listing.category);
    return out;
  }

  private static long optionalInt(Map<String, Object> input, String name, long fallback)
      throws ToolException {
    return input.containsKey(name) ? Structs.intArg(input, name) : fallback;
  }

  private Map<String, Object> list(String playerId, Map<String, Object> input)
      throws ToolException {
    recorder.record("minecraft:shop.list", playerId, input);
    long page = optionalInt(input, "page", 1);
    long size = optionalInt(input, "page_size", 5);
    if (page < 1 || size < 1 || size > PAGE_LIMIT) {
      throw ToolException.invalidInput("shop.list: page from 1, page_size 1 to " + PAGE_LIMIT);
    }
    String category = input.containsKey("category") ? Structs.stringArg(input, "category") : "";
    String query =
        input.get("query") instanceof String q ? q.strip().toLowerCase(Locale.ROOT) : "";
    List<Listing> found = new ArrayList<>();
    for (Listing listing : listings.values()) {
      boolean named =
          query.isEmpty()
              || listing.item.id().contains(query)
              || listing.item.name().zh().contains(query)
              || listing.item.name().en().toLowerCase(Locale.ROOT).contains(query);
      if ((category.isEmpty() || listing.category.equals(category)) && named) {
        found.add(listing);
      }
    }
    List<Map<String, Object>> pageOf = new ArrayList<>();
    for (long i = (page - 1) * size; i < Math.min(found.size(), page * size); i++) {
      pageOf.add(listingMap(found.get((int) i)));
    }
    List<Map<String, Object>> categories = new ArrayList<>();
    CATEGORIES.forEach(
        (id, name) -> {
          Map<String, Object> entry = new LinkedHashMap<>();
          entry.put("id", id);
          entry.put("name", name.toMap());
          categories.add(entry);
        });
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("total", found.size());
    out.put("page", page);
    out.put("page_size", size);
    out.put("categories", categories);
    out.put("currency", InMemoryWorld.CURRENCY.toMap());
    out.put("listings", pageOf);
    return out;
  }

  private Map<String, Object> item(String playerId, Map<String, Object> input)
      throws ToolException {
    recorder.record("minecraft:shop.item", playerId, input);
    Listing listing = listings.get(Structs.stringArg(input, "item"));
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("found", listing != null);
    out.put("currency", InMemoryWorld.CURRENCY.toMap());
    if (listing != null) {
      out.put("listing", listingMap(listing));
    }
    return out;
  }

  private Map<String, Object> buy(String playerId, Map<String, Object> input)
      throws ToolException {
    recorder.record("minecraft:shop.buy", playerId, input);
    String orderId = Structs.stringArg(input, "order_id");
    String itemId = Structs.stringArg(input, "item");
    long count = Structs.intArg(input, "count");
    long quoted = Structs.intArg(input, "unit_price");
    if (count < 1 || count > 64 || quoted < 0) {
      throw ToolException.invalidInput("shop.buy: count 1 to 64 and a unit_price of 0 or more");
    }
    Map<String, Object> decided = orders.get("buy\u001f" + playerId + "\u001f" + orderId);
    if (decided != null) {
      return replay(decided, balance(playerId));
    }
    Listing listing = listings.get(itemId);
    String outcome = "purchased";
    if (listing == null) {
      outcome = "not_for_sale";
    } else if (listing.price != quoted) {
      outcome = "price_changed";
    } else if (listing.stock < count) {
      outcome = "sold_out";
    } else if (balance(playerId) < listing.price * count) {
      outcome = "insufficient_balance";
    }
    long price = listing != null ? listing.price : quoted;
    if (outcome.equals("purchased")) { // debit, stock and delivery together, on the game thread
      balances.put(playerId, balance(playerId) - price * count);
      listing.stock -= count;
      inventories.apply(playerId).merge(itemId, (int) count, Integer::sum);
    }
    Map<String, Object> item = new LinkedHashMap<>();
    item.put("id", itemId);
    item.put("name", listing != null ? listing.item.name().toMap() : Map.of("zh", itemId, "en", itemId));
    Map<String, Object> answer = new LinkedHashMap<>();
    answer.put("outcome", outcome);
    answer.put("order_id", orderId);
    answer.put("item", item);
    answer.put("count", count);
    answer.put("unit_price", price);
    answer.put("total", price * count);
    answer.put("stock", listing != null ? listing.stock : 0);
    orders.put("buy\u001f" + playerId + "\u001f" + orderId, answer);
    Map<String, Object> out = new LinkedHashMap<>(answer);
    out.put("balance", balance(playerId));
    out.put("replayed", false);
    return out;
  }

  private Map<String, Object> transfer(String playerId, Map<String, Object> input)
      throws ToolException {
    recorder.record("minecraft:economy.transfer", playerId, input);
    String orderId = Structs.stringArg(input, "order_id");
    String to = Structs.stringArg(input, "to").strip();
    long amount = Structs.intArg(input, "amount");
    if (amount < 1 || amount > 1_000_000_000L || to.isEmpty() || to.length() > 32) {
      throw ToolException.invalidInput("economy.transfer: a name and an amount of 1 to 10^9");
    }
    Map<String, Object> decided = orders.get("pay\u001f" + playerId + "\u001f" + orderId);
    if (decided != null) {
      return replay(decided, balance(playerId));
    }
    String recipient = named(to);
    String outcome;
    if (recipient == null) {
      outcome = "unknown_player";
    } else if (recipient.equals(playerId)) {
      outcome = "self_payment";
    } else if (balance(playerId) < amount) {
      outcome = "insufficient_balance";
    } else {
      outcome = "transferred"; // both balances together, on the game thread
      balances.put(playerId, balance(playerId) - amount);
      balances.put(recipient, balance(recipient) + amount);
    }
    Map<String, Object> answer = new LinkedHashMap<>();
    answer.put("outcome", outcome);
    answer.put("order_id", orderId);
    answer.put("to", recipient != null ? names.get(recipient) : to);
    answer.put("recipient_online", recipient != null);
    answer.put("amount", amount);
    orders.put("pay\u001f" + playerId + "\u001f" + orderId, answer);
    Map<String, Object> out = new LinkedHashMap<>(answer);
    out.put("balance", balance(playerId));
    out.put("replayed", false);
    return out;
  }

  private Map<String, Object> find(String playerId, Map<String, Object> input)
      throws ToolException {
    recorder.record("minecraft:player.find", playerId, input);
    String name = Structs.stringArg(input, "name").strip();
    if (name.isEmpty() || name.length() > 32) {
      throw ToolException.invalidInput("player.find: a name of 1 to 32 characters");
    }
    String found = named(name);
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("found", found != null);
    out.put("name", found != null ? names.get(found) : name);
    out.put("online", found != null); // this world knows only players who joined
    return out;
  }

  /** The id of the player who joined with {@code name} (case ignored), or null. */
  private String named(String name) {
    for (Map.Entry<String, String> entry : names.entrySet()) {
      if (entry.getValue().equalsIgnoreCase(name)) {
        return entry.getKey();
      }
    }
    return null;
  }

  private static Map<String, Object> replay(Map<String, Object> decided, long balance) {
    Map<String, Object> out = new LinkedHashMap<>(decided);
    out.put("balance", balance);
    out.put("replayed", true);
    return out;
  }
}
