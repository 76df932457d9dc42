package dev.system.example;

import dev.system.client.GameTool;
import dev.system.client.Structs;
import dev.system.client.ToolException;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CopyOnWriteArrayList;

/**
 * A tiny in-memory game: players' inventories, and the game tools the built-in modules call,
 * declared as the game-tool catalogue (docs/game-tools.md) documents them. Every tool asserts
 * that it runs on the game thread, as a Bukkit or NeoForge tool must.
 */
public final class InMemoryWorld {
  // The schemas below are docs/game-tools.json's, without its descriptions;
  // scripts/java_client_check.py fails when they drift apart.

  /** {@code minecraft:inventory.read}: no input. */
  static final String INVENTORY_READ_INPUT =
      """
      {"type":"object","properties":{},"additionalProperties":false}""";

  /** {@code minecraft:inventory.read}: one entry per item kind (its name is optional). */
  static final String INVENTORY_READ_OUTPUT =
      """
      {"properties":{"items":{"items":{"properties":{"count":{"minimum":0,"type":"integer"},\
      "item":{"maxLength":128,"minLength":1,"type":"string"},\
      "name":{"properties":{"en":{"minLength":1,"type":"string"},"zh":{"minLength":1,\
      "type":"string"}},"required":["zh","en"],"type":"object"}},"required":["item","count"],\
      "type":"object"},"type":"array"}},"required":["items"],"type":"object"}""";

  /** {@code minecraft:item.give}: the item and how many to give. */
  static final String ITEM_GIVE_INPUT =
      """
      {"type":"object","properties":{"item":{"type":"string","maxLength":128},\
      "count":{"type":"integer","minimum":1}},"required":["item","count"],\
      "additionalProperties":false}""";

  /** {@code minecraft:item.give}: the item and how many the player holds after the give. */
  static final String ITEM_GIVE_OUTPUT =
      """
      {"type":"object","properties":{"item":{"type":"string","minLength":1,"maxLength":128},\
      "count":{"type":"integer","minimum":0}},"required":["item","count"]}""";

  /** {@code minecraft:player.profile}: balance, currency name, level, play time. */
  static final String PLAYER_PROFILE_OUTPUT =
      """
      {"type":"object","properties":{"balance":{"type":"integer","minimum":0},\
      "currency":{"type":"object","properties":{"zh":{"type":"string","minLength":1},\
      "en":{"type":"string","minLength":1}},"required":["zh","en"]},"level":{"type":"integer",\
      "minimum":0},"play_seconds":{"type":"integer","minimum":0}},"required":["balance",\
      "currency","level","play_seconds"]}""";

  /** {@code minecraft:item.lookup}: an id or a name. */
  static final String ITEM_LOOKUP_INPUT =
      """
      {"type":"object","properties":{"query":{"type":"string","minLength":1,"maxLength":64}},\
      "required":["query"],"additionalProperties":false}""";

  /** {@code minecraft:item.lookup}: the matching items with their sources. */
  static final String ITEM_LOOKUP_OUTPUT =
      """
      {"type":"object","properties":{"exact":{"type":"boolean"},"total":{"type":"integer",\
      "minimum":0},"items":{"type":"array","maxItems":10,"items":{"type":"object",\
      "properties":{"id":{"type":"string","minLength":1,"maxLength":128},"name":{"type":"object",\
      "properties":{"zh":{"type":"string","minLength":1},"en":{"type":"string","minLength":1}},\
      "required":["zh","en"]},"sources":{"type":"object","properties":{"crafting":{"type":"array",\
      "items":{"type":"object","properties":{"count":{"type":"integer","minimum":1},\
      "inputs":{"type":"array","minItems":1,"items":{"type":"object",\
      "properties":{"id":{"type":"string","minLength":1,"maxLength":128},"name":{"type":"object",\
      "properties":{"zh":{"type":"string","minLength":1},"en":{"type":"string","minLength":1}},\
      "required":["zh","en"]},"count":{"type":"integer","minimum":1}},"required":["count","id",\
      "name"]}}},"required":["count","inputs"]}},"smelting":{"type":"array",\
      "items":{"type":"object","properties":{"input":{"type":"object",\
      "properties":{"id":{"type":"string","minLength":1,"maxLength":128},"name":{"type":"object",\
      "properties":{"zh":{"type":"string","minLength":1},"en":{"type":"string","minLength":1}},\
      "required":["zh","en"]}},"required":["id","name"]}},"required":["input"]}},\
      "drops":{"type":"array","items":{"type":"object","properties":{"mob":{"type":"object",\
      "properties":{"id":{"type":"string","minLength":1,"maxLength":128},"name":{"type":"object",\
      "properties":{"zh":{"type":"string","minLength":1},"en":{"type":"string","minLength":1}},\
      "required":["zh","en"]}},"required":["id","name"]}},"required":["mob"]}},\
      "mining":{"type":"array","items":{"type":"object","properties":{"block":{"type":"object",\
      "properties":{"id":{"type":"string","minLength":1,"maxLength":128},"name":{"type":"object",\
      "properties":{"zh":{"type":"string","minLength":1},"en":{"type":"string","minLength":1}},\
      "required":["zh","en"]}},"required":["id","name"]}},"required":["block"]}},\
      "shop":{"type":"array","items":{"type":"object","properties":{"price":{"type":"integer",\
      "minimum":0},"stock":{"type":"integer","minimum":0},"currency":{"type":"object",\
      "properties":{"zh":{"type":"string","minLength":1},"en":{"type":"string","minLength":1}},\
      "required":["zh","en"]}},"required":["currency","price","stock"]}}},"required":["crafting",\
      "smelting","drops","mining","shop"]}},"required":["id","name","sources"]}}},\
      "required":["exact","total","items"]}""";

  /** {@code minecraft:mail.list}: page and page size, both optional. */
  static final String MAIL_LIST_INPUT =
      """
      {"additionalProperties":false,"properties":{"page":{"minimum":1,"type":"integer"},\
      "page_size":{"maximum":10,"minimum":1,"type":"integer"}},"type":"object"}""";

  /** {@code minecraft:mail.list}: one page of mail, newest first. */
  static final String MAIL_LIST_OUTPUT =
      """
      {"properties":{"mails":{"items":{"properties":{"attachment":{"items":{"properties":{\
      "count":{"minimum":1,"type":"integer"},"item":{"maxLength":128,"minLength":1,\
      "type":"string"},"name":{"properties":{"en":{"minLength":1,"type":"string"},"zh":{\
      "minLength":1,"type":"string"}},"required":["zh","en"],"type":"object"}},\
      "required":["count","item","name"],"type":"object"},"type":"array"},"body":{\
      "type":"string"},"claimed":{"type":"boolean"},"id":{"maxLength":64,"minLength":1,\
      "type":"string"},"sender":{"minLength":1,"type":"string"},"sent_at":{"minimum":0,\
      "type":"integer"},"subject":{"type":"string"}},"required":["attachment","body",\
      "claimed","id","sender","sent_at","subject"],"type":"object"},"maxItems":10,\
      "type":"array"},"page":{"minimum":1,"type":"integer"},"page_size":{"maximum":10,\
      "minimum":1,"type":"integer"},"total":{"minimum":0,"type":"integer"}},\
      "required":["mails","page","page_size","total"],"type":"object"}""";

  /** {@code minecraft:mail.read} and {@code minecraft:mail.claim}: the mail's id. */
  static final String MAIL_ID_INPUT =
      """
      {"additionalProperties":false,"properties":{"mail_id":{"maxLength":64,"minLength":1,\
      "type":"string"}},"required":["mail_id"],"type":"object"}""";

  /** {@code minecraft:mail.read}: found, and the mail when found. */
  static final String MAIL_READ_OUTPUT =
      """
      {"properties":{"found":{"type":"boolean"},"mail":{"properties":{"attachment":{\
      "items":{"properties":{"count":{"minimum":1,"type":"integer"},"item":{"maxLength":128,\
      "minLength":1,"type":"string"},"name":{"properties":{"en":{"minLength":1,\
      "type":"string"},"zh":{"minLength":1,"type":"string"}},"required":["zh","en"],\
      "type":"object"}},"required":["count","item","name"],"type":"object"},"type":"array"},\
      "body":{"type":"string"},"claimed":{"type":"boolean"},"id":{"maxLength":64,\
      "minLength":1,"type":"string"},"sender":{"minLength":1,"type":"string"},"sent_at":{\
      "minimum":0,"type":"integer"},"subject":{"type":"string"}},"required":["attachment",\
      "body","claimed","id","sender","sent_at","subject"],"type":"object"}},\
      "required":["found"],"type":"object"}""";

  /** {@code minecraft:mail.claim}: what happened and the stacks delivered. */
  static final String MAIL_CLAIM_OUTPUT =
      """
      {"properties":{"items":{"items":{"properties":{"count":{"minimum":1,"type":"integer"},\
      "item":{"maxLength":128,"minLength":1,"type":"string"},"name":{"properties":{"en":{\
      "minLength":1,"type":"string"},"zh":{"minLength":1,"type":"string"}},"required":["zh",\
      "en"],"type":"object"}},"required":["count","item","name"],"type":"object"},\
      "type":"array"},"outcome":{"enum":["claimed","already_claimed","no_attachment",\
      "not_found"],"type":"string"}},"required":["items","outcome"],"type":"object"}""";

  /** A name in Chinese and English, as the catalogue's {@code name} objects carry it. */
  record Names(String zh, String en) {
    Map<String, Object> toMap() {
      Map<String, Object> out = new LinkedHashMap<>();
      out.put("zh", zh);
      out.put("en", en);
      return out;
    }
  }

  /** One crafting recipe: how many it makes from which ingredients (id to count). */
  record Recipe(int count, Map<String, Integer> inputs) {}

  /** An item of the example's registry and where it comes from. */
  record Item(
      String id,
      Names name,
      List<Recipe> crafting,
      List<String> drops,
      List<String> mining,
      Integer shopPrice) {}

  static final Names CURRENCY = new Names("金币", "coins");
  static final long STARTING_BALANCE = 1000;
  static final long STARTING_LEVEL = 12;
  static final long STARTING_PLAY_SECONDS = 5 * 3600 + 20 * 60;
  static final int LOOKUP_LIMIT = 10;

  /** Blocks and mobs that items come from, by id. */
  static final Map<String, Names> PLACES =
      Map.of(
          "minecraft:diamond_ore", new Names("钻石矿石", "Diamond Ore"),
          "minecraft:zombie", new Names("僵尸", "Zombie"),
          "minecraft:iron_golem", new Names("铁傀儡", "Iron Golem"));

  /** A small registry, in a stable order; a real plugin reads the game's registry. */
  static final List<Item> ITEMS =
      List.of(
          new Item(
              "minecraft:diamond",
              new Names("钻石", "Diamond"),
              List.of(new Recipe(9, Map.of("minecraft:diamond_block", 1))),
              List.of(),
              List.of("minecraft:diamond_ore"),
              100),
          new Item(
              "minecraft:diamond_block",
              new Names("钻石块", "Block of Diamond"),
              List.of(new Recipe(1, Map.of("minecraft:diamond", 9))),
              List.of(),
              List.of(),
              null),
          new Item(
              "minecraft:iron_ingot",
              new Names("铁锭", "Iron Ingot"),
              List.of(),
              List.of("minecraft:iron_golem", "minecraft:zombie"),
              List.of(),
              10),
          new Item(
              "minecraft:stick", new Names("木棍", "Stick"), List.of(), List.of(), List.of(), null),
          new Item(
              "minecraft:diamond_sword",
              new Names("钻石剑", "Diamond Sword"),
              List.of(
                  new Recipe(
                      1,
                      new TreeMap<>(Map.of("minecraft:diamond", 2, "minecraft:stick", 1)))),
              List.of(),
              List.of(),
              300),
          new Item(
              "minecraft:iron_sword",
              new Names("铁剑", "Iron Sword"),
              List.of(
                  new Recipe(
                      1,
                      new TreeMap<>(Map.of("minecraft:iron_ingot", 2, "minecraft:stick", 1)))),
              List.of("minecraft:zombie"),
              List.of(),
              null));

  /** One tool call the world ran, for the example's report. */
  public record Call(String tool, String playerId, Map<String, Object> input, String thread) {}

  private final String gameThreadName;
  private final Map<String, TreeMap<String, Integer>> inventories = new ConcurrentHashMap<>();
  private final List<Call> calls = new CopyOnWriteArrayList<>();
  private final Map<String, Integer> malformed = new ConcurrentHashMap<>();
  private final Map<String, Long> firstSeen = new ConcurrentHashMap<>();
  /** The answers of the tools that honour call ids (item.give, signin.claim). */
  private final CallIdAnswers answers = new CallIdAnswers();
  /** The sign-in calendar: days in Asia/Shanghai, a new day at midnight (server settings). */
  private final SigninCalendar signin =
      new SigninCalendar(
          this::record,
          this::inventoryOf,
          answers,
          java.time.Clock.systemUTC(),
          java.time.ZoneId.of("Asia/Shanghai"),
          0);
  private final Map<String, Map<String, Mail>> mailboxes = new ConcurrentHashMap<>();
  /** Balances, the shop and payments (Commerce). */
  private final Commerce commerce = new Commerce(this::record, this::inventoryOf);

  /** @param gameThreadName the name of the only thread tools may run on */
  public InMemoryWorld(String gameThreadName) {
    this.gameThreadName = gameThreadName;
  }

  /** The tools, as the hello declares them. */
  public List<GameTool> tools() {
    List<GameTool> tools = new ArrayList<>(List.of(
        new GameTool(
            "minecraft:inventory.read",
            "List the items in the player's inventory.",
            INVENTORY_READ_INPUT,
            INVENTORY_READ_OUTPUT,
            true,
            true,
            true,
            this::inventoryRead),
        new GameTool(
            "minecraft:item.give",
            "Give the player some items. A repeated call id answers as the first call did.",
            ITEM_GIVE_INPUT,
            ITEM_GIVE_OUTPUT,
            false,
            false,
            true,
            true, // honours call ids: an interrupted reward is retried, and gives once
            CallIdAnswers.handler(this::itemGive)),
        new GameTool(
            "minecraft:player.profile",
            "Read the player's balance, level and play time.",
            INVENTORY_READ_INPUT,
            PLAYER_PROFILE_OUTPUT,
            true,
            true,
            true,
            this::playerProfile),
        new GameTool(
            "minecraft:item.lookup",
            "Find items by registry id or by name, with where each comes from.",
            ITEM_LOOKUP_INPUT,
            ITEM_LOOKUP_OUTPUT,
            true,
            true,
            true,
            this::itemLookup),
        signin.statusTool(),
        signin.claimTool(),
        new GameTool(
            "minecraft:mail.list",
            "List the player's mail, newest first, one page at a time.",
            MAIL_LIST_INPUT,
            MAIL_LIST_OUTPUT,
            true,
            true,
            true,
            this::mailList),
        new GameTool(
            "minecraft:mail.read",
            "Read one of the player's mails by id.",
            MAIL_ID_INPUT,
            MAIL_READ_OUTPUT,
            true,
            true,
            true,
            this::mailRead),
        new GameTool(
            "minecraft:mail.claim",
            "Claim a mail's attachment into the inventory, once per mail.",
            MAIL_ID_INPUT,
            MAIL_CLAIM_OUTPUT,
            false,
            true,
            false,
            this::mailClaim)));
    tools.addAll(commerce.tools()); // the shop and payments
    return List.copyOf(tools);
  }

  /** A player joined with this name (payments name their recipient by it). */
  public void joined(String playerId, String name) {
    commerce.joined(playerId, name);
  }

  /**
   * The next call of {@code tool} answers with a deliberately malformed output (for {@code
   * minecraft:inventory.read}: stacks with {@code id} instead of {@code item}), to show that
   * the engine refuses it instead of reading it as empty.
   */
  public void malformNext(String tool) {
    malformed.merge(tool, 1, Integer::sum);
  }

  /** The calls run so far, oldest first. */
  public List<Call> calls() {
    return Collections.unmodifiableList(calls);
  }

  /** A copy of a player's inventory. Call it on the game thread in a real game. */
  public Map<String, Integer> inventory(String playerId) {
    return new TreeMap<>(inventoryOf(playerId));
  }

  private TreeMap<String, Integer> inventoryOf(String playerId) {
    return inventories.computeIfAbsent(
        playerId,
        id -> new TreeMap<>(Map.of("minecraft:bread", 12, "minecraft:torch", 32)));
  }

  private void record(String tool, String playerId, Map<String, Object> input) {
    String thread = Thread.currentThread().getName();
    calls.add(new Call(tool, playerId, input, thread));
    if (!thread.equals(gameThreadName)) {
      throw new IllegalStateException(
          tool + " ran on thread " + thread + ", not on the game thread " + gameThreadName);
    }
  }

  private boolean takeMalformed(String tool) {
    boolean[] took = {false};
    malformed.computeIfPresent(
        tool,
        (k, n) -> {
          took[0] = true;
          return n > 1 ? n - 1 : null;
        });
    return took[0];
  }

  private Map<String, Object> inventoryRead(String playerId, Map<String, Object> input)
      throws ToolException {
    boolean malform = takeMalformed("minecraft:inventory.read");
    record("minecraft:inventory.read", playerId, input);
    if (!input.isEmpty()) {
      throw ToolException.invalidInput("inventory.read takes no input");
    }
    List<Map<String, Object>> items = new ArrayList<>();
    if (malform) {
      items.add(Map.of("id", "minecraft:diamond", "count", 3));
      return Map.of("items", items);
    }
    inventoryOf(playerId)
        .forEach(
            (item, count) -> {
              Map<String, Object> stack = new LinkedHashMap<>();
              stack.put("item", item);
              stack.put("count", count);
              items.add(stack);
            });
    return Map.of("items", items);
  }

  private Map<String, Object> itemGive(String playerId, String callId, Map<String, Object> input)
      throws ToolException {
    record("minecraft:item.give", playerId, input);
    return answers.once("minecraft:item.give", playerId, callId, () -> give(playerId, input));
  }

  private Map<String, Object> give(String playerId, Map<String, Object> input)
      throws ToolException {
    String item = Structs.stringArg(input, "item");
    long count = Structs.intArg(input, "count");
    if (count < 1 || item.length() > 128) {
      throw ToolException.invalidInput("item.give needs an item id and a positive count");
    }
    int now = inventoryOf(playerId).merge(item, (int) count, Integer::sum);
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("item", item);
    out.put("count", now);
    return out;
  }

  private Map<String, Object> playerProfile(String playerId, Map<String, Object> input)
      throws ToolException {
    record("minecraft:player.profile", playerId, input);
    if (!input.isEmpty()) {
      throw ToolException.invalidInput("player.profile takes no input");
    }
    long since = firstSeen.computeIfAbsent(playerId, id -> System.nanoTime());
    long session = (System.nanoTime() - since) / 1_000_000_000L;
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("balance", commerce.balance(playerId));
    out.put("currency", CURRENCY.toMap());
    out.put("level", STARTING_LEVEL);
    out.put("play_seconds", STARTING_PLAY_SECONDS + session);
    return out;
  }

  private static String fold(String text) {
    return java.text.Normalizer.normalize(text, java.text.Normalizer.Form.NFKC)
        .strip()
        .toLowerCase(java.util.Locale.ROOT);
  }

  private static Names nameOf(String id) {
    for (Item item : ITEMS) {
      if (item.id().equals(id)) {
        return item.name();
      }
    }
    return PLACES.getOrDefault(id, new Names(id, id));
  }

  private static Map<String, Object> ref(String id) {
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("id", id);
    out.put("name", nameOf(id).toMap());
    return out;
  }

  private static Map<String, Object> entry(Item item) {
    List<Object> crafting = new ArrayList<>();
    for (Recipe recipe : item.crafting()) {
      List<Object> inputs = new ArrayList<>();
      recipe
          .inputs()
          .forEach(
              (id, count) -> {
                Map<String, Object> input = ref(id);
                input.put("count", count);
                inputs.add(input);
              });
      crafting.add(Map.of("count", recipe.count(), "inputs", inputs));
    }
    List<Object> drops = new ArrayList<>();
    item.drops().forEach(mob -> drops.add(Map.of("mob", ref(mob))));
    List<Object> mining = new ArrayList<>();
    item.mining().forEach(block -> mining.add(Map.of("block", ref(block))));
    List<Object> shop = new ArrayList<>();
    if (item.shopPrice() != null) {
      shop.add(Map.of("price", item.shopPrice(), "stock", 64, "currency", CURRENCY.toMap()));
    }
    Map<String, Object> sources = new LinkedHashMap<>();
    sources.put("crafting", crafting);
    sources.put("smelting", List.of());
    sources.put("drops", drops);
    sources.put("mining", mining);
    sources.put("shop", shop);
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("id", item.id());
    out.put("name", item.name().toMap());
    out.put("sources", sources);
    return out;
  }

  /**
   * The catalogue's matching: the id (or its path) or a whole name first; without one, the
   * items whose id path or a name contains the query.
   */
  private Map<String, Object> itemLookup(String playerId, Map<String, Object> input)
      throws ToolException {
    record("minecraft:item.lookup", playerId, input);
    String query = Structs.stringArg(input, "query");
    if (query.length() > 64 || query.isBlank()) {
      throw ToolException.invalidInput("item.lookup needs a query of 1 to 64 characters");
    }
    String folded = fold(query);
    List<Item> exact = new ArrayList<>();
    List<Item> partial = new ArrayList<>();
    for (Item item : ITEMS) {
      String path = item.id().substring(item.id().indexOf(':') + 1);
      String zh = fold(item.name().zh());
      String en = fold(item.name().en());
      if (folded.equals(item.id()) || folded.equals(path) || folded.equals(zh)
          || folded.equals(en)) {
        exact.add(item);
      } else if (!folded.contains(":")
          && (path.contains(folded) || zh.contains(folded) || en.contains(folded))) {
        partial.add(item);
      }
    }
    List<Item> found = exact.isEmpty() ? partial : exact;
    List<Object> items = new ArrayList<>();
    found.stream().limit(LOOKUP_LIMIT).forEach(item -> items.add(entry(item)));
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("exact", !exact.isEmpty());
    out.put("total", found.size());
    out.put("items", items);
    return out;
  }

  /** One mail of a player's mailbox; its attachment as item id to count, in order. */
  private static final class Mail {
    final String id;
    final String sender;
    final String subject;
    final String body;
    final long sentAt;
    final Map<String, Integer> attachment;
    boolean claimed;

    Mail(String id, String sender, String subject, String body, long sentAt,
        Map<String, Integer> attachment) {
      this.id = id;
      this.sender = sender;
      this.subject = subject;
      this.body = body;
      this.sentAt = sentAt;
      this.attachment = attachment;
    }

    Map<String, Object> toMap() {
      Map<String, Object> out = new LinkedHashMap<>();
      out.put("id", id);
      out.put("sender", sender);
      out.put("subject", subject);
      out.put("body", body);
      out.put("sent_at", sentAt);
      out.put("attachment", stacks(attachment));
      out.put("claimed", claimed);
      return out;
    }
  }

  /** A new player's mailbox, newest last; a real plugin reads its mail plugin's store. */
  private static Map<String, Mail> seedMail() {
    Map<String, Mail> box = new LinkedHashMap<>();
    Map<String, Integer> welcome = new LinkedHashMap<>();
    welcome.put("minecraft:iron_ingot", 16);
    box.put("m1", new Mail("m1", "服务器", "欢迎来到服务器！", "这是新手礼包：一些铁锭。", 1795629540L, welcome));
    box.put("m2", new Mail("m2", "Server", "Server rules", "Be kind; no cheating clients.",
        1795685400L, Map.of()));
    box.put("m3", new Mail("m3", "系统", "签到奖励补发", "维护期间未发放的签到奖励已补发，请领取附件。",
        1795983300L, Map.of("minecraft:diamond", 2)));
    return box;
  }

  private static List<Object> stacks(Map<String, Integer> attachment) {
    List<Object> out = new ArrayList<>();
    attachment.forEach(
        (item, count) -> {
          Map<String, Object> stack = new LinkedHashMap<>();
          stack.put("item", item);
          stack.put("name", nameOf(item).toMap());
          stack.put("count", count);
          out.add(stack);
        });
    return out;
  }

  private Map<String, Mail> mailboxOf(String playerId) {
    return mailboxes.computeIfAbsent(playerId, id -> seedMail());
  }

  private static String mailId(Map<String, Object> input, String tool) throws ToolException {
    String id = Structs.stringArg(input, "mail_id");
    if (input.size() != 1 || id.length() > 64) {
      throw ToolException.invalidInput(tool + " takes a mail_id of 1 to 64 characters");
    }
    return id;
  }

  /** {@code minecraft:mail.list}: newest first, one page (from 1; default size 5, at most 10). */
  private Map<String, Object> mailList(String playerId, Map<String, Object> input)
      throws ToolException {
    record("minecraft:mail.list", playerId, input);
    for (String key : input.keySet()) {
      if (!key.equals("page") && !key.equals("page_size")) {
        throw ToolException.invalidInput("mail.list takes page and page_size, not " + key);
      }
    }
    long page = input.containsKey("page") ? Structs.intArg(input, "page") : 1;
    long size = input.containsKey("page_size") ? Structs.intArg(input, "page_size") : 5;
    if (page < 1 || size < 1 || size > 10) {
      throw ToolException.invalidInput("mail.list needs page >= 1 and page_size 1 to 10");
    }
    List<Mail> newest = new ArrayList<>(mailboxOf(playerId).values());
    newest.sort(
        (a, b) -> a.sentAt != b.sentAt ? Long.compare(b.sentAt, a.sentAt) : b.id.compareTo(a.id));
    List<Object> mails = new ArrayList<>();
    newest.stream().skip((page - 1) * size).limit(size).forEach(m -> mails.add(m.toMap()));
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("total", newest.size());
    out.put("page", page);
    out.put("page_size", size);
    out.put("mails", mails);
    return out;
  }

  /** {@code minecraft:mail.read}: one mail by id, or found false. Changes nothing. */
  private Map<String, Object> mailRead(String playerId, Map<String, Object> input)
      throws ToolException {
    record("minecraft:mail.read", playerId, input);
    Mail mail = mailboxOf(playerId).get(mailId(input, "mail.read"));
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("found", mail != null);
    if (mail != null) {
      out.put("mail", mail.toMap());
    }
    return out;
  }

  /**
   * {@code minecraft:mail.claim}: the attachment into the inventory and the mail marked
   * claimed, together on the game thread; once per mail (a repeat answers already_claimed).
   */
  private Map<String, Object> mailClaim(String playerId, Map<String, Object> input)
      throws ToolException {
    record("minecraft:mail.claim", playerId, input);
    Mail mail = mailboxOf(playerId).get(mailId(input, "mail.claim"));
    Map<String, Object> out = new LinkedHashMap<>();
    String outcome;
    if (mail == null) {
      outcome = "not_found";
    } else if (mail.attachment.isEmpty()) {
      outcome = "no_attachment";
    } else if (mail.claimed) {
      outcome = "already_claimed";
    } else {
      TreeMap<String, Integer> inventory = inventoryOf(playerId);
      mail.attachment.forEach((item, count) -> inventory.merge(item, count, Integer::sum));
      mail.claimed = true;
      outcome = "claimed";
    }
    out.put("outcome", outcome);
    out.put("items", outcome.equals("claimed") ? stacks(mail.attachment) : List.of());
    return out;
  }
}
