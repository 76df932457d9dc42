package dev.system.example;

import dev.system.client.GameServerClient;
import dev.system.client.Json;
import dev.system.client.Player;
import dev.system.common.v1.ResultStatus;
import dev.system.gateway.v1.PlayerResponse;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.UUID;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.TimeUnit;

/**
 * The {@code help} round trip, one request at a time: after {@code --warmup} requests, times
 * {@code --bench} requests from send to reply and prints one line {@code BENCH {json}} with the
 * milliseconds of each (bench/java_client.py reads it).
 */
final class HelpBench {
  private HelpBench() {}

  static int run(ExamplePlugin.Args a) throws Exception {
    ExecutorService game = ExamplePlugin.gameThread();
    InMemoryWorld world = new InMemoryWorld(ExamplePlugin.GAME_THREAD);
    String player = UUID.randomUUID().toString();
    List<Double> millis = new ArrayList<>();
    int failures = 0;
    try (GameServerClient client = new GameServerClient(ExamplePlugin.options(a), world.tools(), game, null)) {
      client.start();
      client.awaitWelcome(ExamplePlugin.WAIT);
      client.join(new Player(player, "Bench", "en_us", 0));
      for (int i = 0; i < a.benchWarmup + a.benchRequests; i++) {
        long start = System.nanoTime();
        PlayerResponse r = client.chat(player, "help").get(30, TimeUnit.SECONDS);
        long took = System.nanoTime() - start;
        boolean ok = r.hasReply() && r.getReply().getResult().getStatus() == ResultStatus.RESULT_STATUS_SUCCEEDED;
        if (!ok) {
          failures++;
        }
        if (i >= a.benchWarmup) {
          millis.add(took / 1e6);
        }
      }
    } finally {
      game.shutdownNow();
    }
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("client", "java");
    out.put("java_version", System.getProperty("java.version"));
    out.put("warmup", a.benchWarmup);
    out.put("failures", failures);
    out.put("millis", millis);
    System.out.println("BENCH " + Json.write(out));
    return failures == 0 ? 0 : 1;
  }
}
