package dev.system.example;

import dev.system.client.GameTool;
import dev.system.client.ToolException;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.Map;

/**
 * The answers of the example world's write tools that honour call ids ({@code
 * minecraft:item.give}, {@code minecraft:signin.claim}: the catalogue's "honours call id"), by
 * tool, player and call id. A repeated call id is answered as the first call was, without
 * running again: the engine retries an event step interrupted by a crash with the same call id,
 * and the effect happens once. The last {@link #MEMORY} answers are kept (the least recently
 * asked forgotten first); a failed call is not kept, since it changed nothing. A real plugin
 * keeps them in its save data, so that a restart of the game server does not forget them.
 */
final class CallIdAnswers {
  /** Most answers kept. */
  static final int MEMORY = 4096;

  /** A tool's work: its answer, or a failure the player sees. */
  @FunctionalInterface
  interface Work {
    Map<String, Object> run() throws ToolException;
  }

  /** A tool's handler that takes the call id. */
  @FunctionalInterface
  interface Body {
    Map<String, Object> call(String playerId, String callId, Map<String, Object> input)
        throws ToolException;
  }

  private final Map<String, Map<String, Object>> answers =
      Collections.synchronizedMap(
          new LinkedHashMap<>(16, 0.75f, true) {
            @Override
            protected boolean removeEldestEntry(Map.Entry<String, Map<String, Object>> eldest) {
              return size() > MEMORY;
            }
          });

  /**
   * The first answer given to {@code callId} for this tool and player, or {@code work}'s answer
   * (kept for the next time) when the id is new. An empty call id is never kept.
   */
  Map<String, Object> once(String tool, String playerId, String callId, Work work)
      throws ToolException {
    if (callId.isEmpty()) {
      return work.run();
    }
    String key = tool + "\n" + playerId + "\n" + callId;
    Map<String, Object> first = answers.get(key);
    if (first != null) {
      return first; // a repeated call id: the first answer, nothing run again
    }
    Map<String, Object> out = work.run();
    answers.put(key, out);
    return out;
  }

  /** A handler that passes the call id to {@code body} (an empty one when called without). */
  static GameTool.Handler handler(Body body) {
    return new GameTool.Handler() {
      @Override
      public Map<String, Object> call(String playerId, Map<String, Object> input)
          throws ToolException {
        return body.call(playerId, "", input);
      }

      @Override
      public Map<String, Object> call(String playerId, String callId, Map<String, Object> input)
          throws ToolException {
        return body.call(playerId, callId, input);
      }
    };
  }
}
