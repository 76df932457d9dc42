package dev.system.example;

import dev.system.client.CardText;
import dev.system.client.ClientOptions;
import dev.system.client.FrameRefusedException;
import dev.system.client.GameServerClient;
import dev.system.client.GameTool;
import dev.system.client.Json;
import dev.system.client.Player;
import dev.system.client.Structs;
import dev.system.common.v1.AgentResult;
import dev.system.common.v1.Card;
import dev.system.common.v1.CardButton;
import dev.system.common.v1.ResultStatus;
import dev.system.gateway.v1.FrameError;
import dev.system.gateway.v1.PlayerResponse;
import dev.system.gateway.v1.ToolCall;
import dev.system.gateway.v1.ToolProblem;
import dev.system.gateway.v1.ToolResult;
import dev.system.gateway.v1.Welcome;
import io.grpc.Status;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.StringReader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.UUID;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;
import java.util.function.BooleanSupplier;

/**
 * An example game-server plugin's main: connects, joins two players and runs a scripted
 * session, printing what each step did and a CHECK line for every expected behaviour. Exits 1
 * when any check fails, 2 for bad arguments.
 *
 * <pre>
 * java -cp "$(cat clients/java/build/classpath)" dev.system.example.ExamplePlugin \
 *     --address 127.0.0.1:50051 --server-id sim --token TOKEN [--tls-ca ca.pem]
 * </pre>
 *
 * <p>The token may come from the environment variable SYSTEM_GAME_SERVER_TOKEN instead of the
 * command line (where other users of the machine can read it).
 */
public final class ExamplePlugin {
  static final String GAME_THREAD = "game-main";
  static final String OUTPUT_INVALID = "system.error.tool_output_invalid";
  static final Duration WAIT = Duration.ofSeconds(30);

  private final List<String> failed = new ArrayList<>();
  private int checks;

  public static void main(String[] args) throws Exception {
    Args a;
    try {
      a = Args.parse(args);
    } catch (IllegalArgumentException e) {
      System.err.println("error: " + e.getMessage());
      System.err.println(Args.USAGE);
      System.exit(2);
      return;
    }
    if (a.printTools) {
      printTools();
      return;
    }
    int code = a.benchRequests > 0 ? HelpBench.run(a)
        : a.console ? consoleSession(a)
        : new ExamplePlugin().session(a);
    System.exit(code);
  }

  /**
   * {@code --console}: the server console alone. Connects, joins the console (ServerConsole)
   * and forwards every line of standard input as its chat until the input ends, printing each
   * answer. Exits 1 when a line got no answer. A real plugin joins the console on its one
   * connection instead: a second connection with the server's id replaces the first.
   */
  static int consoleSession(Args a) throws Exception {
    ExecutorService game = gameThread();
    InMemoryWorld world = new InMemoryWorld(GAME_THREAD);
    try (GameServerClient client = new GameServerClient(options(a), world.tools(), game, null)) {
      client.start();
      try {
        client.awaitWelcome(WAIT);
      } catch (ExecutionException e) {
        System.err.println("error: the gateway refused the connection: " + e.getCause().getMessage());
        return 1;
      }
      ServerConsole console = new ServerConsole(client, a.consoleLanguage, System.out);
      console.join();
      BufferedReader in =
          new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
      return console.forward(in, WAIT).contains(null) ? 1 : 0;
    } finally {
      game.shutdownNow();
    }
  }

  /** Prints the tools the hello declares, as one line {@code TOOLS [json]}, and nothing else. */
  static void printTools() {
    List<Map<String, Object>> tools = new ArrayList<>();
    for (GameTool t : new InMemoryWorld(GAME_THREAD).tools()) {
      Map<String, Object> m = new LinkedHashMap<>();
      m.put("name", t.name());
      m.put("description", t.description());
      m.put("input_schema", t.inputSchema());
      m.put("output_schema", t.outputSchema());
      m.put("read_only", t.readOnly());
      m.put("idempotent", t.idempotent());
      m.put("event_allowed", t.eventAllowed());
      m.put("honours_call_id", t.honoursCallId());
      tools.add(m);
    }
    System.out.println("TOOLS " + Json.write(tools));
  }

  static ClientOptions options(Args a) {
    ClientOptions.Builder b =
        ClientOptions.builder(a.address, a.serverId, a.token)
            .software("system-java-example/0.1")
            .backoff(Duration.ofMillis(500), Duration.ofSeconds(10), 2.0, 0.2);
    if (a.tlsCa != null) {
      b.tlsCaFile(a.tlsCa);
    } else if (a.tls) {
      b.tls(true);
    }
    if (a.tlsServerName != null) {
      b.tlsServerName(a.tlsServerName);
    }
    return b.build();
  }

  static ExecutorService gameThread() {
    return Executors.newSingleThreadExecutor(
        r -> {
          Thread t = new Thread(r, GAME_THREAD);
          t.setDaemon(true);
          return t;
        });
  }

  private void check(boolean ok, String name, String detail) {
    checks++;
    if (ok) {
      System.out.println("CHECK ok " + name);
    } else {
      failed.add(name);
      System.out.println("CHECK FAIL " + name + ": " + detail);
    }
  }

  private static void show(String who, String what, PlayerResponse r) {
    System.out.println("<" + who + "> " + what);
    for (String line : CardText.render(r).split("\n")) {
      System.out.println("    " + line);
    }
  }

  private static boolean await(BooleanSupplier condition, Duration timeout)
      throws InterruptedException {
    long end = System.nanoTime() + timeout.toNanos();
    while (System.nanoTime() < end) {
      if (condition.getAsBoolean()) {
        return true;
      }
      Thread.sleep(50);
    }
    return condition.getAsBoolean();
  }

  private static PlayerResponse get(CompletableFuture<PlayerResponse> f) throws Exception {
    return f.get(WAIT.toMillis(), TimeUnit.MILLISECONDS);
  }

  private static boolean succeeded(PlayerResponse r) {
    return r.hasReply() && r.getReply().getResult().getStatus() == ResultStatus.RESULT_STATUS_SUCCEEDED;
  }

  private static String describe(PlayerResponse r) {
    AgentResult result = r.hasReply() ? r.getReply().getResult() : r.getNotice().getResult();
    return r.getBodyCase()
        + " module="
        + (r.hasReply() ? r.getReply().getModuleId() : "")
        + " status="
        + result.getStatus()
        + " failure="
        + result.getFailure().getKey()
        + " "
        + result.getFailure().getMessage();
  }

  int session(Args a) throws Exception {
    ExecutorService game = gameThread();
    InMemoryWorld world = new InMemoryWorld(GAME_THREAD);
    BlockingQueue<PlayerResponse> notices = new LinkedBlockingQueue<>();
    List<FrameError> frameErrors = new CopyOnWriteArrayList<>();
    List<Status> disconnects = new CopyOnWriteArrayList<>();
    GameServerClient.Listener listener =
        new GameServerClient.Listener() {
          @Override
          public void onWelcome(Welcome w, int connection) {
            System.out.println(
                "welcome #" + connection + ": session " + w.getSessionId() + ", protocol "
                    + w.getProtocolVersion() + ", max text " + w.getMaxTextChars() + " chars, "
                    + w.getToolProblemsCount() + " tool problems");
            for (ToolProblem p : w.getToolProblemsList()) {
              System.out.println("  tool problem: " + p.getTool() + ": " + p.getProblem()
                  + " (unavailable: " + String.join(", ", p.getUnavailableModulesList()) + ")");
            }
          }

          @Override
          public void onUnsolicited(PlayerResponse r) {
            notices.add(r);
          }

          @Override
          public void onFrameError(FrameError e) {
            frameErrors.add(e);
            System.out.println("frame error: request " + e.getRequestId() + " "
                + Status.fromCodeValue(e.getCode()).getCode() + ": " + e.getMessage());
          }

          @Override
          public void onToolCall(ToolCall call, ToolResult result) {
            System.out.println("tool call " + call.getTool() + " " + Structs.toJson(call.getInput())
                + " -> " + (result.hasOutput() ? Structs.toJson(result.getOutput())
                    : "failure " + result.getFailure().getKey() + ": " + result.getFailure().getMessage()));
          }

          @Override
          public void onDisconnected(Status status, Duration retryIn) {
            disconnects.add(status);
            System.out.println("disconnected: " + status.getCode() + " " + status.getDescription()
                + (retryIn == null ? "; not reconnecting" : "; retry in " + retryIn.toMillis() + " ms"));
          }
        };

    backoffGrows(a);

    String steve = UUID.randomUUID().toString();
    String li = UUID.randomUUID().toString();
    System.out.println("connecting to " + a.address + (a.tlsCa != null ? " over TLS (CA " + a.tlsCa + ")"
        : a.tls ? " over TLS (system roots)" : " in plaintext") + " as " + a.serverId);
    try (GameServerClient client = new GameServerClient(options(a), world.tools(), game, listener)) {
      client.start();
      Welcome welcome;
      try {
        welcome = client.awaitWelcome(WAIT);
      } catch (ExecutionException e) {
        check(false, "welcome", "the gateway refused the connection: " + e.getCause().getMessage());
        return finish();
      }
      check(welcome.getProtocolVersion() == 1, "welcome", "protocol " + welcome.getProtocolVersion());
      check(welcome.getToolProblemsCount() == 0, "no-tool-problems",
          welcome.getToolProblemsList().toString());

      client.join(new Player(steve, "Steve", "en_us", 0));
      client.join(new Player(li, "Li", "zh_cn", 0));
      world.joined(steve, "Steve");
      world.joined(li, "Li");
      // The server console: a player of its own at level 4, whose answers are printed to the
      // console (ServerConsole; --console forwards standard input the same way).
      ServerConsole console = new ServerConsole(client, "en_us", System.out);
      console.join();

      // 1. help, in English.
      PlayerResponse help = get(client.chat(steve, "help"));
      show("Steve", "help", help);
      Card helpCard = help.getReply().getResult().getCard();
      check(succeeded(help) && help.getReply().getModuleId().equals("system:help")
              && helpCard.getButtonsCount() > 0,
          "chat-help", describe(help));

      // 2. 帮助, in Chinese.
      PlayerResponse bangzhu = get(client.chat(li, "帮助"));
      show("Li", "帮助", bangzhu);
      check(succeeded(bangzhu) && bangzhu.getReply().getResult().getCard().getTitle().equals("助手帮助"),
          "chat-bangzhu", describe(bangzhu));

      // 2b. The operator types an admin command on the console; the same command from an
      // ordinary player is unknown to them (admin commands appear only at the admin level).
      List<PlayerResponse> typed = console.forward(
          new BufferedReader(new StringReader("/system routing\n\n/help\n")), WAIT);
      PlayerResponse routing = typed.isEmpty() ? null : typed.get(0);
      PlayerResponse consoleHelp = typed.size() < 2 ? null : typed.get(1);
      check(typed.size() == 2 && routing != null && succeeded(routing)
              && routing.getReply().getResult().getCard().getTitle().equals("Routing diagnostics")
              && consoleHelp != null && cardText(consoleHelp).contains("/revoke <player>")
              && !cardText(help).contains("/revoke"),
          "console-admin-command", routing == null ? "no answer: " + typed : describe(routing));
      PlayerResponse notAdmin = get(client.chat(steve, "/system routing"));
      show("Steve", "/system routing", notAdmin);
      check(!succeeded(notAdmin) && notAdmin.getReply().getResult().getFailure().getKey()
              .equals("system.error.unknown_command"),
          "admin-command-refused-for-player", describe(notAdmin));

      // 3. /inventory: the engine calls minecraft:inventory.read, answered on the game thread.
      int before = world.calls().size();
      PlayerResponse inv = get(client.chat(steve, "/inventory"));
      show("Steve", "/inventory", inv);
      String lines = cardText(inv);
      check(succeeded(inv) && lines.contains("minecraft:bread × 12") && lines.contains("minecraft:torch × 32"),
          "chat-inventory", describe(inv) + " " + lines);
      check(world.calls().size() > before
              && world.calls().get(before).tool().equals("minecraft:inventory.read")
              && world.calls().get(before).thread().equals(GAME_THREAD),
          "tool-call-on-game-thread", world.calls().toString());

      // 3b. /profile and /item 钻石: minecraft:player.profile and minecraft:item.lookup.
      PlayerResponse profile = get(client.chat(steve, "/profile"));
      show("Steve", "/profile", profile);
      check(succeeded(profile) && cardText(profile).contains("Balance: 1000 coins"),
          "chat-profile", describe(profile) + " " + cardText(profile));
      PlayerResponse item = get(client.chat(li, "/item 钻石"));
      show("Li", "/item 钻石", item);
      check(succeeded(item) && item.getReply().getResult().getCard().getTitle().equals("物品：钻石")
              && cardText(item).contains("钻石矿石"),
          "chat-item", describe(item) + " " + cardText(item));
      // 3c. /签到 twice: signed in once (the reward's items given), then "already signed in".
      Map<String, Integer> beforeSignin = world.inventory(li);
      PlayerResponse signin = get(client.chat(li, "/签到"));
      show("Li", "/签到", signin);
      Map<String, Integer> afterSignin = world.inventory(li);
      PlayerResponse signinAgain = get(client.chat(li, "/签到"));
      show("Li", "/签到 again", signinAgain);
      check(succeeded(signin) && cardText(signin).contains("连续签到 1 天")
              && !afterSignin.equals(beforeSignin)
              && succeeded(signinAgain) && cardText(signinAgain).contains("已经签到过了")
              && world.inventory(li).equals(afterSignin),
          "chat-signin", describe(signin) + " " + cardText(signin) + " / " + cardText(signinAgain));
      // The mail: list, open the newest, press its claim button twice (delivered once).
      PlayerResponse inbox = get(client.chat(steve, "/mail"));
      show("Steve", "/mail", inbox);
      Card inboxCard = inbox.getReply().getResult().getCard();
      String mailProblem = succeeded(inbox) && inboxCard.getTitle().equals("Inbox (3 mails)")
          && inboxCard.getButtonsCount() == 3 ? "" : "the inbox card: " + describe(inbox);
      if (mailProblem.isEmpty()) {
        PlayerResponse opened = get(client.press(steve, inboxCard, inboxCard.getButtons(0)));
        show("Steve", "pressed " + inboxCard.getButtons(0).getLabel(), opened);
        Card mailCard = opened.getReply().getResult().getCard();
        CardButton claim = mailCard.getButtonsList().stream()
            .filter(b -> "system:mail_claim".equals(b.getArgsMap().get("module_id")))
            .findFirst().orElse(null);
        if (claim == null) {
          mailProblem = "the mail card has no claim button: " + describe(opened);
        } else {
          int diamonds = world.inventory(steve).getOrDefault("minecraft:diamond", 0);
          PlayerResponse first = get(client.press(steve, mailCard, claim));
          show("Steve", "pressed " + claim.getLabel(), first);
          PlayerResponse again = get(client.press(steve, mailCard, claim));
          show("Steve", "pressed " + claim.getLabel() + " again", again);
          int after = world.inventory(steve).getOrDefault("minecraft:diamond", 0);
          if (!succeeded(first) || !succeeded(again) || after != diamonds + 2
              || !again.getReply().getResult().getCard().getTitle().equals("Already claimed")) {
            mailProblem = "claimed twice: diamonds " + diamonds + " -> " + after + ", "
                + describe(first) + ", " + describe(again);
          }
        }
      }
      check(mailProblem.isEmpty(), "chat-mail", mailProblem);

      // 4. A button from the help card: the /inventory button.
      CardButton button = helpCard.getButtonsList().stream()
          .filter(b -> "system:inventory".equals(b.getArgsMap().get("module_id")))
          .findFirst().orElse(helpCard.getButtonsCount() > 0 ? helpCard.getButtons(0) : null);
      if (button == null) {
        check(false, "button-press", "the help card has no buttons");
      } else {
        System.out.println("pressing [" + button.getLabel() + "] action " + button.getActionId()
            + " args " + Json.write(button.getArgsMap()) + " on card " + helpCard.getRef().getCardId()
            + " v" + helpCard.getRef().getVersion());
        PlayerResponse pressed = get(client.press(steve, helpCard, button));
        show("Steve", "pressed " + button.getLabel(), pressed);
        check(succeeded(pressed) && pressed.getReply().getResult().getCard().getTemplate().equals("system:inventory"),
            "button-press", describe(pressed));
      }

      // 5. A game event: the advancement reward gives bread through minecraft:item.give.
      String eventKey = "adv-" + UUID.randomUUID();
      boolean sent = client.event(steve, "minecraft:advancement", eventKey,
          Map.of("advancement", "minecraft:story/mine_stone"));
      // The world records a call before the game thread applies it: wait for the bread too.
      boolean given = await(() -> world.calls().stream().anyMatch(
              c -> c.tool().equals("minecraft:item.give") && c.playerId().equals(steve))
          && Integer.valueOf(15).equals(world.inventory(steve).get("minecraft:bread")), WAIT);
      System.out.println("<Steve> earns minecraft:story/mine_stone (event " + eventKey + ")");
      check(sent && given,
          "event-item-give", "sent=" + sent + " given=" + given + " inventory=" + world.inventory(steve)
              + " frame errors=" + frameErrors);
      PlayerResponse notice = notices.poll(WAIT.toSeconds(), TimeUnit.SECONDS);
      if (notice != null) {
        show("Steve", "(notice)", notice);
      }
      check(notice != null && notice.getPlayerId().equals(steve) && notice.hasNotice(),
          "event-notice", String.valueOf(notice));
      PlayerResponse inv2 = get(client.chat(steve, "/inventory"));
      show("Steve", "/inventory", inv2);
      check(succeeded(inv2) && cardText(inv2).contains("minecraft:bread × 15"),
          "inventory-after-give", describe(inv2) + " " + cardText(inv2));

      // 5b. item.give honours call ids: an engine that crashed while a reward's give was in
      // flight retries it with the same call id (the event step's id), and the world answers
      // as the first call did, giving nothing again; a new call id gives again.
      GameTool give = world.tools().stream()
          .filter(t -> t.name().equals("minecraft:item.give")).findFirst().orElseThrow();
      Map<String, Object> apples = Map.of("item", "minecraft:apple", "count", 2.0);
      Map<String, Object> first = game.submit(() -> give.handler().call(li, "example-task/0", apples))
          .get(WAIT.toMillis(), TimeUnit.MILLISECONDS);
      Map<String, Object> repeated = game.submit(() -> give.handler().call(li, "example-task/0", apples))
          .get(WAIT.toMillis(), TimeUnit.MILLISECONDS);
      Map<String, Object> next = game.submit(() -> give.handler().call(li, "example-task/1", apples))
          .get(WAIT.toMillis(), TimeUnit.MILLISECONDS);
      Integer held = game.submit(() -> world.inventory(li).get("minecraft:apple"))
          .get(WAIT.toMillis(), TimeUnit.MILLISECONDS);
      check(give.honoursCallId() && first.equals(repeated) && Integer.valueOf(4).equals(held)
              && Integer.valueOf(4).equals(next.get("count")),
          "item-give-call-id", "first=" + first + " repeated=" + repeated + " next=" + next
              + " apples=" + held);

      // 6. A request for a player who never joined: a FrameError, the stream stays up.
      try {
        PlayerResponse r = get(client.chat("never-joined", "help"));
        check(false, "frame-error-not-found", "answered: " + describe(r));
      } catch (ExecutionException e) {
        boolean ok = e.getCause() instanceof FrameRefusedException f && f.code() == Status.Code.NOT_FOUND;
        check(ok && !frameErrors.isEmpty(), "frame-error-not-found", String.valueOf(e.getCause()));
      }

      // 6b. The game thread is busy past the call's timeout_ms (a long tick): the library
      // answers the call as timed out before the gateway gives up, and the tool never runs.
      java.util.concurrent.CountDownLatch release = new java.util.concurrent.CountDownLatch(1);
      game.execute(() -> {
        try {
          release.await(60, TimeUnit.SECONDS);
        } catch (InterruptedException e) {
          Thread.currentThread().interrupt();
        }
      });
      int callsBefore = world.calls().size();
      long started = System.nanoTime();
      PlayerResponse stalled;
      try {
        stalled = get(client.chat(steve, "/inventory"));
      } finally {
        release.countDown();
      }
      long tookMs = (System.nanoTime() - started) / 1_000_000;
      show("Steve", "/inventory while the game thread is stuck", stalled);
      Thread.sleep(300); // the game thread drains its queue: the timed-out call must not run
      AgentResult stalledResult = stalled.getReply().getResult();
      System.out.println("stuck game thread: answered after " + tookMs + " ms, status "
          + stalledResult.getStatus() + ", failure " + stalledResult.getFailure().getKey() + ": "
          + stalledResult.getFailure().getMessage());
      check(stalledResult.getStatus() == ResultStatus.RESULT_STATUS_FAILED
              && stalledResult.getFailure().getKey().equals("system.error.timeout")
              && world.calls().size() == callsBefore,
          "busy-game-thread-times-out", describe(stalled) + " calls " + world.calls().size()
              + " (before " + callsBefore + ")");

      // 7. A malformed tool answer: `id` instead of `item`. It must be refused, not read as empty.
      world.malformNext("minecraft:inventory.read");
      PlayerResponse bad = get(client.chat(steve, "/inventory"));
      show("Steve", "/inventory (the game answers {\"items\":[{\"id\":\"minecraft:diamond\",\"count\":3}]})", bad);
      AgentResult badResult = bad.getReply().getResult();
      boolean refused = badResult.getStatus() == ResultStatus.RESULT_STATUS_FAILED
          && badResult.getFailure().getKey().equals(OUTPUT_INVALID);
      System.out.println("malformed answer: status " + badResult.getStatus() + ", failure "
          + badResult.getFailure().getKey() + ": " + badResult.getFailure().getMessage());
      if (a.requireOutputValidation) {
        check(refused, "malformed-tool-output-refused", describe(bad));
      } else if (!refused) {
        System.out.println("WARN the engine did not refuse the malformed answer with " + OUTPUT_INVALID
            + " (this engine does not validate tool outputs yet): " + describe(bad));
      } else {
        check(true, "malformed-tool-output-refused", "");
      }

      // 8. Reconnect: drop the stream; the client reconnects, re-sends its hello and JOINs.
      client.dropConnection("example: simulated network failure");
      boolean back = await(() -> client.welcomes() >= 2, WAIT);
      check(back && !disconnects.isEmpty(), "reconnect", "welcomes=" + client.welcomes());
      if (back) {
        PlayerResponse again = get(client.chat(steve, "help"));
        show("Steve", "help (after reconnecting)", again);
        check(succeeded(again), "rejoined-after-reconnect", describe(again));
        PlayerResponse consoleAgain = console.type("/system routing", WAIT);
        check(consoleAgain != null && succeeded(consoleAgain), "console-rejoined-after-reconnect",
            consoleAgain == null ? "no answer" : describe(consoleAgain));
      }

      // 9. A second process with this server's id and token: the gateway keeps the newer
      // connection and ends ours ABORTED; this client stops instead of fighting over the id.
      try (GameServerClient second = new GameServerClient(options(a), world.tools(), game, null)) {
        second.start();
        second.awaitWelcome(WAIT);
        boolean aborted = await(() -> disconnects.stream()
            .anyMatch(st -> st.getCode() == Status.Code.ABORTED), WAIT);
        Thread.sleep(2000); // longer than the backoff's first waits: no reconnect may come
        check(aborted && client.welcomes() == 2 && !client.isConnected(), "replaced-not-reconnecting",
            "aborted=" + aborted + " welcomes=" + client.welcomes() + " connected=" + client.isConnected());
      }

      if (a.idleSeconds > 0) {
        // The real keepalive intervals: a new connection stays idle (pings only) for minutes,
        // then a request must be answered on the same stream.
        try (GameServerClient idle = new GameServerClient(options(a), world.tools(), game, null)) {
          idle.start();
          idle.awaitWelcome(WAIT);
          idle.join(new Player(steve, "Steve", "en_us", 0));
          get(idle.chat(steve, "help"));
          System.out.println("idle for " + a.idleSeconds + " s (keepalive pings only) ...");
          Thread.sleep(a.idleSeconds * 1000L);
          PlayerResponse after = get(idle.chat(steve, "help"));
          check(succeeded(after) && idle.welcomes() == 1, "idle-stream-survives",
              "welcomes=" + idle.welcomes() + " " + describe(after));
        }
      }

      boolean gameThreadOnly = world.calls().stream().allMatch(c -> c.thread().equals(GAME_THREAD));
      check(gameThreadOnly, "tools-only-on-game-thread", world.calls().toString());
      System.out.println("world: " + world.calls().size() + " tool calls; Steve has " + world.inventory(steve));
    } finally {
      game.shutdownNow();
    }
    return finish();
  }

  /**
   * Points a client at a port where nothing listens and checks that its reconnect waits grow
   * exponentially within the jitter: 100 ms, 200, 400, 800, then capped at 1 s, each ±20 %.
   */
  private void backoffGrows(Args a) throws Exception {
    int port;
    try (java.net.ServerSocket socket = new java.net.ServerSocket(0)) {
      port = socket.getLocalPort(); // closed again: nothing listens there
    }
    List<Duration> waits = new CopyOnWriteArrayList<>();
    ClientOptions o =
        ClientOptions.builder("127.0.0.1:" + port, a.serverId, a.token)
            .backoff(Duration.ofMillis(100), Duration.ofSeconds(1), 2.0, 0.2)
            .logger(quiet("dev.system.example.backoff-probe")) // its refusals are expected
            .build();
    GameServerClient.Listener listener =
        new GameServerClient.Listener() {
          @Override
          public void onDisconnected(Status status, Duration retryIn) {
            waits.add(retryIn);
          }
        };
    ExecutorService game = gameThread();
    try (GameServerClient client = new GameServerClient(o, List.of(), game, listener)) {
      client.start();
      await(() -> waits.size() >= 6, WAIT);
    } finally {
      game.shutdownNow();
    }
    long[] expected = {100, 200, 400, 800, 1000, 1000};
    boolean ok = waits.size() >= expected.length;
    for (int i = 0; ok && i < expected.length; i++) {
      long ms = waits.get(i).toMillis();
      ok = ms >= expected[i] * 0.8 - 1 && ms <= expected[i] * 1.2 + 1;
    }
    System.out.println("reconnect waits with nothing listening: "
        + waits.stream().map(d -> d.toMillis() + " ms").toList());
    check(ok, "backoff-grows", "waits " + waits + ", expected about " + java.util.Arrays.toString(expected) + " ±20 %");
  }

  private static java.util.logging.Logger quiet(String name) {
    java.util.logging.Logger logger = java.util.logging.Logger.getLogger(name);
    logger.setLevel(java.util.logging.Level.OFF);
    return logger;
  }

  private static String cardText(PlayerResponse r) {
    StringBuilder sb = new StringBuilder();
    r.getReply().getResult().getCard().getLinesList().forEach(l -> sb.append(l.getText()).append('\n'));
    return sb.toString();
  }

  private int finish() {
    if (failed.isEmpty()) {
      System.out.println("RESULT ok " + checks + " checks");
      return 0;
    }
    System.out.println("RESULT FAIL " + failed.size() + " of " + checks + " checks: " + failed);
    return 1;
  }

  /** Command-line arguments. */
  static final class Args {
    static final String USAGE =
        "usage: ExamplePlugin --address HOST:PORT --server-id ID [--token TOKEN] [--tls-ca FILE | --tls]\n"
            + "                     [--tls-server-name NAME] [--require-output-validation]\n"
            + "                     [--idle SECONDS] [--bench N [--warmup N]]\n"
            + "                     [--console [--console-language LANG]]   (stdin to the console)\n"
            + "   or: ExamplePlugin --print-tools   (the hello's tools as JSON)\n"
            + "   or: ExamplePlugin ADDRESS TOKEN SERVER_ID [options]\n"
            + "The token may come from the environment variable SYSTEM_GAME_SERVER_TOKEN.";
    String address;
    String token = System.getenv("SYSTEM_GAME_SERVER_TOKEN");
    String serverId;
    Path tlsCa;
    boolean tls;
    String tlsServerName;
    boolean requireOutputValidation;
    boolean printTools;
    int benchRequests;
    int benchWarmup = 20;
    int idleSeconds;
    boolean console;
    String consoleLanguage = "en_us";

    static Args parse(String[] argv) {
      Args a = new Args();
      List<String> positional = new ArrayList<>();
      for (int i = 0; i < argv.length; i++) {
        String arg = argv[i];
        switch (arg) {
          case "--address" -> a.address = value(argv, ++i, arg);
          case "--token" -> a.token = value(argv, ++i, arg);
          case "--server-id" -> a.serverId = value(argv, ++i, arg);
          case "--tls-ca" -> a.tlsCa = Path.of(value(argv, ++i, arg));
          case "--tls" -> a.tls = true;
          case "--tls-server-name" -> a.tlsServerName = value(argv, ++i, arg);
          case "--require-output-validation" -> a.requireOutputValidation = true;
          case "--print-tools" -> a.printTools = true;
          case "--bench" -> a.benchRequests = Integer.parseInt(value(argv, ++i, arg));
          case "--warmup" -> a.benchWarmup = Integer.parseInt(value(argv, ++i, arg));
          case "--idle" -> a.idleSeconds = Integer.parseInt(value(argv, ++i, arg));
          case "--console" -> a.console = true;
          case "--console-language" -> a.consoleLanguage = value(argv, ++i, arg);
          case "-h", "--help" -> throw new IllegalArgumentException("help");
          default -> {
            if (arg.startsWith("--")) {
              throw new IllegalArgumentException("unknown option " + arg);
            }
            positional.add(arg);
          }
        }
      }
      if (a.printTools) {
        return a;
      }
      if (!positional.isEmpty()) {
        if (positional.size() != 3) {
          throw new IllegalArgumentException("give ADDRESS TOKEN SERVER_ID, or use the options");
        }
        a.address = positional.get(0);
        a.token = positional.get(1);
        a.serverId = positional.get(2);
      }
      if (a.address == null || a.serverId == null || a.token == null || a.token.isBlank()) {
        throw new IllegalArgumentException("--address, --server-id and a token are required");
      }
      if (a.tlsCa != null && !a.tlsCa.toFile().isFile()) {
        throw new IllegalArgumentException("--tls-ca " + a.tlsCa + " is not a file");
      }
      return a;
    }

    private static String value(String[] argv, int i, String option) {
      if (i >= argv.length) {
        throw new IllegalArgumentException(option + " needs a value");
      }
      return argv[i];
    }
  }
}
