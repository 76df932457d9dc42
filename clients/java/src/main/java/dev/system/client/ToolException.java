package dev.system.client;

/**
 * A game tool failed in a way the caller should see; it becomes the ToolResult's failure.
 * Use a key from the failure catalogue, for example {@code system.error.invalid_input}.
 */
public class ToolException extends Exception {
  private final String key;

  public ToolException(String key, String message) {
    super(message);
    this.key = key;
  }

  /** Bad input: {@code system.error.invalid_input}. */
  public static ToolException invalidInput(String message) {
    return new ToolException("system.error.invalid_input", message);
  }

  public String key() {
    return key;
  }
}
