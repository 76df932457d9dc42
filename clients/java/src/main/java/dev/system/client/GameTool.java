package dev.system.client;

import java.util.Map;
import java.util.Objects;

/**
 * A game tool this server offers: what the hello declares, and the handler that runs it on the
 * game thread. Declare the schemas and flags exactly as the game-tool catalogue
 * (docs/game-tools.md) documents them; the gateway refuses a tool whose schema or flags differ
 * and names it in the Welcome's {@code tool_problems}.
 *
 * @param name tool id, {@code namespace:path}
 * @param description what it does
 * @param inputSchema JSON Schema (draft 2020-12) of the input, as JSON text
 * @param outputSchema JSON Schema of the output, as JSON text (empty: as the catalogue says)
 * @param readOnly never changes game state
 * @param idempotent running it twice with one input has the effect of running it once
 * @param eventAllowed event tasks may call it, not only interactive requests
 * @param honoursCallId a write tool that treats the call id as an idempotency key: a repeated
 *     call id is answered as the first call was, without running again (the handler gets the
 *     call id through {@link Handler#call(String, String, Map)} and keeps the answers)
 * @param handler runs the tool; called on the game thread only
 */
public record GameTool(
    String name,
    String description,
    String inputSchema,
    String outputSchema,
    boolean readOnly,
    boolean idempotent,
    boolean eventAllowed,
    boolean honoursCallId,
    Handler handler) {

  /** A tool that does not honour call ids. */
  public GameTool(
      String name,
      String description,
      String inputSchema,
      String outputSchema,
      boolean readOnly,
      boolean idempotent,
      boolean eventAllowed,
      Handler handler) {
    this(name, description, inputSchema, outputSchema, readOnly, idempotent, eventAllowed, false, handler);
  }

  public GameTool {
    Objects.requireNonNull(name);
    Objects.requireNonNull(handler);
    description = description == null ? "" : description;
    inputSchema = inputSchema == null ? "" : inputSchema;
    outputSchema = outputSchema == null ? "" : outputSchema;
  }

  /** Runs a tool for a player. Called on the game thread. */
  @FunctionalInterface
  public interface Handler {
    /**
     * @param playerId the player on whose behalf the tool runs
     * @param input the call's input: JSON values as Java objects (numbers are {@code Double})
     * @return the output: a JSON object as a map of maps, lists, strings, numbers, booleans
     * @throws ToolException for a failure the player should see (bad input, say)
     */
    Map<String, Object> call(String playerId, Map<String, Object> input) throws ToolException;

    /**
     * Runs the tool with the call's id, which the client passes to every call. A tool that
     * honours call ids overrides this and answers a repeated id as the first call was.
     *
     * @param callId the call's id (an event step's id for writes in event tasks)
     */
    default Map<String, Object> call(String playerId, String callId, Map<String, Object> input)
        throws ToolException {
      return call(playerId, input);
    }
  }

  dev.system.gateway.v1.GameTool toProto() {
    return dev.system.gateway.v1.GameTool.newBuilder()
        .setName(name)
        .setDescription(description)
        .setInputSchema(inputSchema)
        .setOutputSchema(outputSchema)
        .setReadOnly(readOnly)
        .setIdempotent(idempotent)
        .setEventAllowed(eventAllowed)
        .setHonoursCallId(honoursCallId)
        .build();
  }
}
