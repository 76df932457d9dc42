package dev.system.example;

import dev.system.client.CardText;
import dev.system.client.GameServerClient;
import dev.system.client.Player;
import dev.system.gateway.v1.PlayerResponse;
import java.io.BufferedReader;
import java.io.IOException;
import java.io.PrintStream;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;

/**
 * The server console as a player of its own, as the plugin guide says (clients/java/README.md,
 * "Administrators, and the server console"): a JOIN with a fixed id no player can have (not a
 * UUID), the operators' language and permission level 4. What the operator types goes to the
 * gateway as that player's chat, and every answer is printed to the console with {@link
 * CardText}. The console is then an administrator like any other: its commands are checked and
 * logged the same way, and its usage is its own.
 *
 * <p>A real plugin registers a console command ({@code /assistant <text>}, say) whose handler
 * calls {@link #type}; the example's {@code --console} mode forwards the lines of standard
 * input with {@link #forward}.
 *
 * <pre>
 * ServerConsole console = new ServerConsole(client, "en_us", System.out);
 * console.join();                      // once; the client re-sends it after a reconnect
 * console.type("/system routing");     // the answer is printed when it comes
 * </pre>
 */
public final class ServerConsole {
  /** The console's player id: not a UUID, so no player of the game can have it. */
  public static final String PLAYER_ID = "console";
  /** The console's permission level: the game's highest, as a server operator has it. */
  public static final int PERMISSION_LEVEL = 4;
  /** What every line this class prints starts with. */
  public static final String PREFIX = "[console] ";

  private final GameServerClient client;
  private final PrintStream out;
  private final Player player;

  /**
   * @param client the plugin's connection to the gateway
   * @param language the operators' language ({@code en_us}, {@code zh_cn})
   * @param out where the answers are printed (the server console)
   */
  public ServerConsole(GameServerClient client, String language, PrintStream out) {
    this.client = client;
    this.out = out;
    this.player = new Player(PLAYER_ID, "Console", language, PERMISSION_LEVEL);
  }

  /** Joins the console as its own player (JOIN); call once, after the client started. */
  public void join() {
    client.join(player);
  }

  /**
   * Sends a line the operator typed as the console's chat and waits for the answer, which is
   * printed to the console (a refused or lost request too) and returned; null when none came.
   */
  public PlayerResponse type(String line, Duration timeout) throws InterruptedException {
    try {
      PlayerResponse answer =
          client.chat(PLAYER_ID, line).get(timeout.toMillis(), TimeUnit.MILLISECONDS);
      print("> " + line + "\n" + CardText.render(answer));
      return answer;
    } catch (ExecutionException e) {
      print("> " + line + "\n(not answered: " + e.getCause().getMessage() + ")");
    } catch (TimeoutException e) {
      print("> " + line + "\n(no answer within " + timeout.toSeconds() + " s)");
    }
    return null;
  }

  /**
   * Forwards every non-blank line of {@code in} until it ends, one at a time (each answer
   * printed before the next line is sent); returns the answers, null for a line without one.
   */
  public List<PlayerResponse> forward(BufferedReader in, Duration timeout)
      throws IOException, InterruptedException {
    List<PlayerResponse> answers = new ArrayList<>();
    for (String line = in.readLine(); line != null; line = in.readLine()) {
      if (!line.isBlank()) {
        answers.add(type(line.strip(), timeout));
      }
    }
    return answers;
  }

  private void print(String text) {
    synchronized (out) {
      for (String line : text.split("\n")) {
        out.println(PREFIX + line);
      }
      out.flush();
    }
  }
}
