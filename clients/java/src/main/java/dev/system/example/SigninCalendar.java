package dev.system.example;

import dev.system.client.GameTool;
import dev.system.client.Structs;
import dev.system.client.ToolException;
import java.time.Clock;
import java.time.LocalDate;
import java.time.ZoneId;
import java.time.ZonedDateTime;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.ConcurrentHashMap;
import java.util.function.Function;

/**
 * The example world's sign-in calendar and its two game tools, {@code minecraft:signin.status}
 * and {@code minecraft:signin.claim}, as the game-tool catalogue (docs/game-tools.md) documents
 * them. The calendar's day is this server's own: the clock in its time zone, moved back by the
 * day start hour. A claim records the day and gives the reward's items together, once per
 * player per day, and honours call ids: a repeated call id is answered as the first call was
 * ({@link CallIdAnswers}).
 */
final class SigninCalendar {
  // The schemas below are docs/game-tools.json's, without its descriptions;
  // scripts/java_client_check.py fails when they drift apart.

  /** {@code minecraft:signin.status}: no input. */
  static final String NO_INPUT =
      """
      {"type":"object","properties":{},"additionalProperties":false}""";

  /** {@code minecraft:signin.status}: today, signed today, the streak, days this month. */
  static final String STATUS_OUTPUT =
      """
      {"properties":{"day_start_hour":{"maximum":23,"minimum":0,"type":"integer"},\
      "days_this_month":{"maximum":31,"minimum":0,"type":"integer"},"reward":{"type":"string"},\
      "signed_today":{"type":"boolean"},"streak":{"minimum":0,"type":"integer"},\
      "time_zone":{"minLength":1,"type":"string"},"today":{\
      "pattern":"^[0-9]{4}-[0-9]{2}-[0-9]{2}$","type":"string"}},"required":["today",\
      "time_zone","day_start_hour","signed_today","reward","streak","days_this_month"],\
      "type":"object"}""";

  /** {@code minecraft:signin.claim}: the day, the reward entry's id and its items. */
  static final String CLAIM_INPUT =
      """
      {"additionalProperties":false,"properties":{"day":{\
      "pattern":"^[0-9]{4}-[0-9]{2}-[0-9]{2}$","type":"string"},"items":{"items":{\
      "additionalProperties":false,"properties":{"count":{"maximum":64,"minimum":1,\
      "type":"integer"},"item":{"maxLength":128,"minLength":1,"type":"string"}},\
      "required":["item","count"],"type":"object"},"maxItems":8,"minItems":1,"type":"array"},\
      "reward":{"maxLength":64,"minLength":1,"type":"string"}},"required":["day","reward",\
      "items"],"type":"object"}""";

  /** {@code minecraft:signin.claim}: claimed or not, and the day's record. */
  static final String CLAIM_OUTPUT =
      """
      {"properties":{"claimed":{"type":"boolean"},"day":{\
      "pattern":"^[0-9]{4}-[0-9]{2}-[0-9]{2}$","type":"string"},"days_this_month":{\
      "maximum":31,"minimum":0,"type":"integer"},"items":{"items":{\
      "additionalProperties":false,"properties":{"count":{"maximum":64,"minimum":1,\
      "type":"integer"},"item":{"maxLength":128,"minLength":1,"type":"string"}},\
      "required":["item","count"],"type":"object"},"maxItems":8,"minItems":1,"type":"array"},\
      "reward":{"type":"string"},"streak":{"minimum":0,"type":"integer"}},"required":["claimed",\
      "day","reward","items","streak","days_this_month"],"type":"object"}""";

  /** Records a call and asserts it runs on the game thread (the world's own check). */
  interface Recorder {
    void record(String tool, String playerId, Map<String, Object> input);
  }

  /** One signed day: the reward entry's id and the stacks given. */
  record Day(String reward, List<Map<String, Object>> items) {}

  private final Recorder recorder;
  private final Function<String, TreeMap<String, Integer>> inventories;
  private final Clock clock;
  private final ZoneId zone;
  private final int dayStartHour;
  private final Map<String, TreeMap<LocalDate, Day>> calendars = new ConcurrentHashMap<>();
  private final CallIdAnswers answers;

  SigninCalendar(
      Recorder recorder,
      Function<String, TreeMap<String, Integer>> inventories,
      CallIdAnswers answers,
      Clock clock,
      ZoneId zone,
      int dayStartHour) {
    this.recorder = recorder;
    this.inventories = inventories;
    this.answers = answers;
    this.clock = clock;
    this.zone = zone;
    this.dayStartHour = dayStartHour;
  }

  GameTool statusTool() {
    return new GameTool(
        "minecraft:signin.status",
        "Read the player's sign-in calendar: today, signed in today, streak, days this month.",
        NO_INPUT,
        STATUS_OUTPUT,
        true,
        true,
        true,
        this::status);
  }

  GameTool claimTool() {
    return new GameTool(
        "minecraft:signin.claim",
        "Sign the player in for today and give the reward, once per day.",
        CLAIM_INPUT,
        CLAIM_OUTPUT,
        false,
        false,
        true,
        true,
        CallIdAnswers.handler(this::claim));
  }

  /** Today on this server's calendar. */
  LocalDate today() {
    return ZonedDateTime.now(clock.withZone(zone)).minusHours(dayStartHour).toLocalDate();
  }

  private TreeMap<LocalDate, Day> calendarOf(String playerId) {
    return calendars.computeIfAbsent(playerId, id -> new TreeMap<>());
  }

  private static void putCounts(
      Map<String, Object> out, TreeMap<LocalDate, Day> calendar, LocalDate today) {
    LocalDate day = calendar.containsKey(today) ? today : today.minusDays(1);
    int streak = 0;
    while (calendar.containsKey(day)) {
      streak++;
      day = day.minusDays(1);
    }
    long month =
        calendar.keySet().stream()
            .filter(d -> d.getYear() == today.getYear() && d.getMonth() == today.getMonth())
            .count();
    out.put("streak", streak);
    out.put("days_this_month", month);
  }

  private Map<String, Object> status(String playerId, Map<String, Object> input)
      throws ToolException {
    recorder.record("minecraft:signin.status", playerId, input);
    if (!input.isEmpty()) {
      throw ToolException.invalidInput("signin.status takes no input");
    }
    LocalDate today = today();
    TreeMap<LocalDate, Day> calendar = calendarOf(playerId);
    Day signed = calendar.get(today);
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("today", today.toString());
    out.put("time_zone", zone.getId());
    out.put("day_start_hour", dayStartHour);
    out.put("signed_today", signed != null);
    out.put("reward", signed == null ? "" : signed.reward());
    putCounts(out, calendar, today);
    return out;
  }

  private Map<String, Object> claim(String playerId, String callId, Map<String, Object> input)
      throws ToolException {
    recorder.record("minecraft:signin.claim", playerId, input);
    return answers.once("minecraft:signin.claim", playerId, callId, () -> sign(playerId, input));
  }

  private Map<String, Object> sign(String playerId, Map<String, Object> input)
      throws ToolException {
    String day = Structs.stringArg(input, "day");
    String reward = Structs.stringArg(input, "reward");
    if (reward.length() > 64) {
      throw ToolException.invalidInput("signin.claim needs a reward id of 1 to 64 characters");
    }
    if (!(input.get("items") instanceof List<?> stacks) || stacks.isEmpty() || stacks.size() > 8) {
      throw ToolException.invalidInput("signin.claim needs 1 to 8 item stacks");
    }
    List<Map<String, Object>> given = new ArrayList<>();
    for (Object stack : stacks) {
      if (!(stack instanceof Map<?, ?> raw)) {
        throw ToolException.invalidInput("signin.claim: each stack needs an item id and a count");
      }
      @SuppressWarnings("unchecked")
      Map<String, Object> fields = (Map<String, Object>) raw;
      String item = Structs.stringArg(fields, "item");
      long count = Structs.intArg(fields, "count");
      if (count < 1 || count > 64 || item.length() > 128) {
        throw ToolException.invalidInput("signin.claim: a stack's count must be 1 to 64");
      }
      Map<String, Object> one = new LinkedHashMap<>();
      one.put("item", item);
      one.put("count", count);
      given.add(one);
    }
    LocalDate today = today();
    if (!day.equals(today.toString())) {
      throw ToolException.invalidInput(
          "signin.claim: day " + day + " is not today (" + today + ") here");
    }
    TreeMap<LocalDate, Day> calendar = calendarOf(playerId);
    Day record = calendar.get(today);
    boolean claimed = record == null;
    if (claimed) { // the record and the items together, on the game thread
      record = new Day(reward, List.copyOf(given));
      calendar.put(today, record);
      TreeMap<String, Integer> inventory = inventories.apply(playerId);
      for (Map<String, Object> stack : given) {
        inventory.merge(
            (String) stack.get("item"), ((Long) stack.get("count")).intValue(), Integer::sum);
      }
    }
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("claimed", claimed);
    out.put("day", today.toString());
    out.put("reward", record.reward());
    out.put("items", record.items());
    putCounts(out, calendar, today);
    return out;
  }
}
