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

  /** {@code minecraft:inventory.read}: one entry per item kind the player carries. */
  static final String INVENTORY_READ_OUTPUT =
      """
      {"type":"object","properties":{"items":{"type":"array","items":{"type":"object",\
      "properties":{"item":{"type":"string","minLength":1,"maxLength":128},\
      "count":{"type":"integer","minimum":0}},"required":["item","count"]}}},\
      "required":["items"]}""";

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

  /** One tool call the world ran, for the example's report. */
  public record Call(String tool, String playerId, Map<String, Object> input, String thread) {}

  private final String gameThreadName;
  private final Map<String, TreeMap<String, Integer>> inventories = new ConcurrentHashMap<>();
  private final List<Call> calls = new CopyOnWriteArrayList<>();
  private final Map<String, Integer> malformed = new ConcurrentHashMap<>();

  /** @param gameThreadName the name of the only thread tools may run on */
  public InMemoryWorld(String gameThreadName) {
    this.gameThreadName = gameThreadName;
  }

  /** The tools, as the hello declares them. */
  public List<GameTool> tools() {
    return List.of(
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
            "Give the player some items.",
            ITEM_GIVE_INPUT,
            ITEM_GIVE_OUTPUT,
            false,
            false,
            true,
            this::itemGive));
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

  private Map<String, Object> itemGive(String playerId, Map<String, Object> input)
      throws ToolException {
    record("minecraft:item.give", playerId, input);
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
}
