package dev.system.client;

import dev.system.common.v1.Card;
import dev.system.common.v1.CardButton;
import dev.system.common.v1.Failure;
import dev.system.gateway.v1.CardAction;
import dev.system.gateway.v1.Chat;
import dev.system.gateway.v1.ConnectRequest;
import dev.system.gateway.v1.ConnectResponse;
import dev.system.gateway.v1.Control;
import dev.system.gateway.v1.ControlAction;
import dev.system.gateway.v1.FrameError;
import dev.system.gateway.v1.GameEvent;
import dev.system.gateway.v1.GameGatewayServiceGrpc;
import dev.system.gateway.v1.Hello;
import dev.system.gateway.v1.PlayerPresence;
import dev.system.gateway.v1.PlayerRequest;
import dev.system.gateway.v1.PlayerResponse;
import dev.system.gateway.v1.PresenceKind;
import dev.system.gateway.v1.ToolCall;
import dev.system.gateway.v1.ToolProblem;
import dev.system.gateway.v1.ToolResult;
import dev.system.gateway.v1.Welcome;
import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.ClientInterceptors;
import io.grpc.ForwardingClientCall;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import io.grpc.Status;
import io.grpc.netty.GrpcSslContexts;
import io.grpc.netty.NettyChannelBuilder;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import io.netty.handler.ssl.SslContext;
import io.netty.handler.ssl.SslContextBuilder;
import java.io.File;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collection;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.Executor;
import java.util.concurrent.Executors;
import java.util.concurrent.RejectedExecutionException;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;
import java.util.logging.Level;
import java.util.logging.Logger;

/**
 * A game server's connection to the gateway: one long-lived {@code Connect} stream that
 * carries every player of this server (protocol version 1, protos/system/gateway/v1).
 *
 * <p>What it does for a plugin:
 *
 * <ul>
 *   <li>opens the stream with {@code authorization: Bearer <token>}, over TLS or plaintext, and
 *       sends the hello with this server's tools;
 *   <li>re-joins every player it knows after each Welcome, so after a reconnect the gateway
 *       knows the same players as before;
 *   <li>reconnects after any end of the stream with exponential backoff and jitter (the first
 *       retry after about 1 s, then 2, 4, ... up to 30 s; a Welcome resets it);
 *   <li>runs every ToolCall on the game thread (the {@code gameThread} executor: on Bukkit
 *       {@code r -> Bukkit.getScheduler().runTask(plugin, r)}) and answers it before its
 *       {@code timeout_ms}: a call the game thread has not started by then is answered with
 *       failure {@code system.error.timeout} and never runs;
 *   <li>correlates replies with requests and hands unsolicited responses (notices) and
 *       FrameErrors to the {@link Listener}, and logs the Welcome's {@code tool_problems}.
 * </ul>
 *
 * <p>Thread-safe: call it from any thread. Callbacks of the listener run on gRPC's threads;
 * move to the game thread before touching game state.
 */
public final class GameServerClient implements AutoCloseable {
  /** The protocol version this client speaks. */
  public static final int PROTOCOL_VERSION = 1;

  private static final Duration WELCOME_TIMEOUT = Duration.ofSeconds(15);
  private static final Set<Status.Code> CONFIGURATION_ERRORS =
      Set.of(
          Status.Code.UNAUTHENTICATED,
          Status.Code.PERMISSION_DENIED,
          Status.Code.INVALID_ARGUMENT,
          Status.Code.FAILED_PRECONDITION,
          Status.Code.UNIMPLEMENTED);
  private static final Metadata.Key<String> AUTHORIZATION =
      Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER);

  /** What happens on the connection, for a plugin to log or show. Every method is optional. */
  public interface Listener {
    /** The gateway accepted the hello; {@code connection} counts Welcomes from 1. */
    default void onWelcome(Welcome welcome, int connection) {}

    /** A response that answers no pending request: a notice, a binding change, an open. */
    default void onUnsolicited(PlayerResponse response) {}

    /** The gateway refused one frame (the stream stays open). Already logged. */
    default void onFrameError(FrameError error) {}

    /** A game-tool call was answered (on the game thread, after the handler ran). */
    default void onToolCall(ToolCall call, ToolResult result) {}

    /**
     * The stream ended with {@code status}; the next attempt starts after {@code retryIn}, or
     * never when it is null (another connection of this server id replaced this one: ABORTED).
     */
    default void onDisconnected(Status status, Duration retryIn) {}
  }

  private final ClientOptions options;
  private final Logger log;
  private final Map<String, GameTool> tools = new LinkedHashMap<>();
  private final Executor gameThread;
  private final Listener listener;
  private final ManagedChannel channel;
  private final Channel authorized;
  private final ScheduledExecutorService timers;
  private final Map<String, Player> players = new LinkedHashMap<>(); // guarded by lock
  private final Map<String, Pending> pending = new ConcurrentHashMap<>();
  private final AtomicLong requestIds = new AtomicLong();
  private final Object lock = new Object();
  private final CompletableFuture<Welcome> firstWelcome = new CompletableFuture<>();
  private Session session; // guarded by lock; null while disconnected
  private Welcome welcome; // guarded by lock
  private int welcomes; // guarded by lock
  private int failures; // guarded by lock: consecutive ends without a Welcome
  private int generation; // guarded by lock
  private boolean started; // guarded by lock
  private boolean closed; // guarded by lock
  private boolean stopped; // guarded by lock: replaced by another process; no reconnects

  /**
   * @param options where and how to connect
   * @param tools the game tools this server offers (declared in the hello)
   * @param gameThread runs tool handlers; the game's main thread
   * @param listener connection events; may be null
   */
  public GameServerClient(
      ClientOptions options, Collection<GameTool> tools, Executor gameThread, Listener listener) {
    this.options = options;
    this.log = options.logger;
    for (GameTool tool : tools) {
      if (this.tools.put(tool.name(), tool) != null) {
        throw new IllegalArgumentException("tool " + tool.name() + " is declared twice");
      }
    }
    this.gameThread = gameThread;
    this.listener = listener == null ? new Listener() {} : listener;
    this.channel = buildChannel(options);
    this.authorized = ClientInterceptors.intercept(channel, new BearerToken(options.token));
    this.timers =
        Executors.newSingleThreadScheduledExecutor(
            r -> {
              Thread t = new Thread(r, "system-client-timers");
              t.setDaemon(true);
              return t;
            });
  }

  private static ManagedChannel buildChannel(ClientOptions o) {
    NettyChannelBuilder b =
        NettyChannelBuilder.forTarget(o.target)
            .keepAliveTime(o.keepAliveTime.toMillis(), TimeUnit.MILLISECONDS)
            .keepAliveTimeout(o.keepAliveTimeout.toMillis(), TimeUnit.MILLISECONDS)
            .keepAliveWithoutCalls(o.keepAliveWithoutCalls)
            .disableRetry(); // the stream is re-opened by this class, with its hello
    if (o.tls) {
      File ca = o.tlsCaFile == null ? null : o.tlsCaFile.toFile();
      try {
        SslContextBuilder ssl = GrpcSslContexts.forClient();
        if (ca != null) {
          ssl.trustManager(ca);
        }
        SslContext context;
        try {
          context = ssl.build();
        } catch (UnsupportedOperationException noJdkAlpn) {
          context = JdkAlpn.clientContext(ca); // Debian's netty: see JdkAlpn
        }
        b.sslContext(context);
      } catch (IOException e) {
        throw new UncheckedIOException("cannot set up TLS: " + e.getMessage(), e);
      } catch (IllegalArgumentException e) {
        throw new IllegalArgumentException(
            "cannot read the TLS CA file " + o.tlsCaFile + ": " + e.getMessage(), e);
      }
      if (o.tlsServerName != null) {
        b.overrideAuthority(o.tlsServerName);
      }
    } else {
      b.usePlaintext();
    }
    return b.build();
  }

  /** Opens the connection in the background; see {@link #awaitWelcome}. Idempotent. */
  public void start() {
    synchronized (lock) {
      if (started || closed) {
        return;
      }
      started = true;
      if (!options.tls && !isLoopback(options.target)) {
        log.warning(
            "connecting to "
                + options.target
                + " without TLS: the token crosses the network in plain text");
      }
    }
    connect();
  }

  /**
   * Waits for the first Welcome. Throws when the gateway refused the first connection with a
   * configuration error (UNAUTHENTICATED: wrong token or server id; FAILED_PRECONDITION: a
   * protocol version the gateway does not speak; INVALID_ARGUMENT: a malformed hello); the
   * client keeps retrying in the background at the longest backoff in case the gateway's
   * configuration is being changed.
   */
  public Welcome awaitWelcome(Duration timeout)
      throws InterruptedException, TimeoutException, ExecutionException {
    return firstWelcome.get(timeout.toMillis(), TimeUnit.MILLISECONDS);
  }

  /** True while a welcomed stream is open. */
  public boolean isConnected() {
    synchronized (lock) {
      return session != null && session.welcomed;
    }
  }

  /** The latest Welcome, or null before the first. */
  public Welcome welcome() {
    synchronized (lock) {
      return welcome;
    }
  }

  /** How many Welcomes this client has had (1 + the reconnects that succeeded). */
  public int welcomes() {
    synchronized (lock) {
      return welcomes;
    }
  }

  /** Announces a player (JOIN); remembered and re-sent after every reconnect. */
  public void join(Player player) {
    synchronized (lock) {
      players.put(player.id(), player);
      if (session != null && session.welcomed) {
        session.send(presence(PresenceKind.PRESENCE_KIND_JOIN, player));
      }
    }
  }

  /** The player's language or permission level changed (UPDATE). */
  public void update(Player player) {
    synchronized (lock) {
      if (!players.containsKey(player.id())) {
        throw new IllegalStateException("player " + player.id() + " has not joined");
      }
      players.put(player.id(), player);
      if (session != null && session.welcomed) {
        session.send(presence(PresenceKind.PRESENCE_KIND_UPDATE, player));
      }
    }
  }

  /** The player left (LEAVE); their pending requests are cancelled by the gateway. */
  public void leave(String playerId) {
    synchronized (lock) {
      Player player = players.remove(playerId);
      if (player != null && session != null && session.welcomed) {
        session.send(presence(PresenceKind.PRESENCE_KIND_LEAVE, player));
      }
    }
  }

  private static ConnectRequest presence(PresenceKind kind, Player p) {
    return ConnectRequest.newBuilder()
        .setPresence(
            PlayerPresence.newBuilder()
                .setKind(kind)
                .setPlayerId(p.id())
                .setPlayerName(p.name())
                .setLanguage(p.language())
                .setPermissionLevel(p.permissionLevel()))
        .build();
  }

  /** A player typed {@code text} (chat, or the text after {@code /system}). */
  public CompletableFuture<PlayerResponse> chat(String playerId, String text) {
    return request(playerId, PlayerRequest.newBuilder().setChat(Chat.newBuilder().setText(text)));
  }

  /** A player pressed {@code button} on {@code card}: sends the card's ref, action id, args. */
  public CompletableFuture<PlayerResponse> press(String playerId, Card card, CardButton button) {
    return request(
        playerId,
        PlayerRequest.newBuilder()
            .setCardAction(
                CardAction.newBuilder()
                    .setSource(card.getRef())
                    .setActionId(button.getActionId())
                    .putAllArgs(button.getArgsMap())));
  }

  /** A control action (state, cancel, history, clear history). */
  public CompletableFuture<PlayerResponse> control(String playerId, ControlAction action) {
    return request(
        playerId, PlayerRequest.newBuilder().setControl(Control.newBuilder().setAction(action)));
  }

  /**
   * Sends a request with {@code body} (its request and player ids are set here) and completes
   * with its answer, or exceptionally with {@link FrameRefusedException} (the gateway refused
   * it), {@link NotConnectedException} (no connection, or it ended while waiting) or {@link
   * TimeoutException} (no answer within the request timeout).
   */
  public CompletableFuture<PlayerResponse> request(String playerId, PlayerRequest.Builder body) {
    String requestId = "j" + requestIds.incrementAndGet();
    CompletableFuture<PlayerResponse> future = new CompletableFuture<>();
    ConnectRequest frame =
        ConnectRequest.newBuilder()
            .setRequest(body.setRequestId(requestId).setPlayerId(playerId))
            .build();
    synchronized (lock) {
      if (session == null || !session.welcomed) {
        future.completeExceptionally(
            new NotConnectedException("not connected to the gateway; the request was not sent"));
        return future;
      }
      pending.put(requestId, new Pending(future, session));
      session.send(frame);
    }
    future
        .orTimeout(options.requestTimeout.toMillis(), TimeUnit.MILLISECONDS)
        .whenComplete((r, e) -> pending.remove(requestId));
    return future;
  }

  /**
   * Reports a game event (an advancement, say). Not answered unless refused: a refusal comes
   * to {@link Listener#onFrameError} with the event key as its request id. Returns false when
   * not connected (resend it later with the same key: the key makes it safe).
   */
  public boolean event(String playerId, String eventType, String eventKey, Map<String, ?> data) {
    ConnectRequest frame =
        ConnectRequest.newBuilder()
            .setEvent(
                GameEvent.newBuilder()
                    .setPlayerId(playerId)
                    .setEventType(eventType)
                    .setEventKey(eventKey)
                    .setData(Structs.fromMap(data)))
            .build();
    synchronized (lock) {
      if (session == null || !session.welcomed) {
        return false;
      }
      session.send(frame);
      return true;
    }
  }

  /**
   * Ends the current stream from this side as a network failure would (for tests, and for a
   * plugin's reload command); the client then reconnects as after any failure.
   */
  public void dropConnection(String why) {
    Session s;
    synchronized (lock) {
      s = session;
    }
    if (s != null) {
      s.cancel(why);
    }
  }

  /**
   * Half-closes the stream, lets the gateway answer what is in progress (up to 5 s), and shuts
   * the channel down. Pending requests that got no answer fail with NotConnectedException.
   */
  @Override
  public void close() {
    Session s;
    synchronized (lock) {
      if (closed) {
        return;
      }
      closed = true;
      s = session;
    }
    if (s != null) {
      s.halfClose();
      try {
        s.ended.get(5, TimeUnit.SECONDS);
      } catch (Exception e) {
        s.cancel("closing");
      }
    }
    channel.shutdown();
    try {
      if (!channel.awaitTermination(5, TimeUnit.SECONDS)) {
        channel.shutdownNow();
      }
    } catch (InterruptedException e) {
      channel.shutdownNow();
      Thread.currentThread().interrupt();
    }
    timers.shutdownNow();
    failPending(null, "the client was closed");
  }

  // --- the connection ---------------------------------------------------------------------

  private void connect() {
    Session s;
    synchronized (lock) {
      if (closed) {
        return;
      }
      s = new Session(++generation);
      session = s;
    }
    GameGatewayServiceGrpc.newStub(authorized).connect(s);
    Hello.Builder hello =
        Hello.newBuilder()
            .setServerId(options.serverId)
            .setProtocolVersion(PROTOCOL_VERSION)
            .addAllFeatures(options.features)
            .setSoftware(options.software);
    tools.values().forEach(t -> hello.addTools(t.toProto()));
    s.send(ConnectRequest.newBuilder().setHello(hello).build());
    timers.schedule(
        () -> {
          if (!s.welcomed) {
            s.cancel("no Welcome within " + WELCOME_TIMEOUT.toSeconds() + " s of the hello");
          }
        },
        WELCOME_TIMEOUT.toMillis(),
        TimeUnit.MILLISECONDS);
  }

  private void onWelcome(Session s, Welcome w) {
    int number;
    synchronized (lock) {
      if (s != session) {
        return;
      }
      s.welcomed = true;
      welcome = w;
      number = ++welcomes;
      failures = 0;
      for (Player p : players.values()) {
        s.send(presence(PresenceKind.PRESENCE_KIND_JOIN, p));
      }
    }
    log.info(
        "connected to "
            + options.target
            + " as "
            + options.serverId
            + " (session "
            + w.getSessionId()
            + ", protocol "
            + w.getProtocolVersion()
            + ", connection "
            + number
            + ")");
    for (ToolProblem p : w.getToolProblemsList()) {
      log.warning(
          "the gateway will not use tool "
              + p.getTool()
              + ": "
              + p.getProblem()
              + (p.getUnavailableModulesCount() > 0
                  ? "; unavailable here: " + String.join(", ", p.getUnavailableModulesList())
                  : ""));
    }
    listener.onWelcome(w, number);
    firstWelcome.complete(w);
  }

  private void onEnd(Session s, Status ended) {
    String tlsProblem = s.welcomed ? null : tlsProblem(ended);
    Status status =
        tlsProblem == null
            ? ended
            : Status.UNAVAILABLE.withDescription(tlsProblem).withCause(ended.getCause());
    boolean tlsFailed = tlsProblem != null;
    Duration delay;
    synchronized (lock) {
      if (s != session) {
        return;
      }
      session = null;
      if (closed) {
        return;
      }
      if (status.getCode() == Status.Code.ABORTED && s.welcomed) {
        // The gateway keeps the newest connection of a server id. Our own reconnects replace
        // sessions this client already gave up, so this is another process with our token.
        stopped = true;
        log.severe(
            "another connection of server "
                + options.serverId
                + " replaced this one ("
                + status.getDescription()
                + "); is a second game server using this server id and token? Not reconnecting");
      }
      if (stopped) {
        delay = null;
      } else {
        delay = afterFailure(s, status, tlsFailed);
      }
    }
    failPending(s, "the connection to the gateway ended (" + status.getCode() + ")");
    listener.onDisconnected(status, delay);
    if (delay == null) {
      return;
    }
    try {
      timers.schedule(this::connect, delay.toMillis(), TimeUnit.MILLISECONDS);
    } catch (RejectedExecutionException e) {
      // closed meanwhile
    }
  }

  /** Logs why the stream ended and returns the wait before the next attempt. */
  private Duration afterFailure(Session s, Status status, boolean tlsFailed) {
    failures++;
    boolean configuration =
        !s.welcomed && (tlsFailed || CONFIGURATION_ERRORS.contains(status.getCode()));
    if (configuration) {
      log.severe(
          "cannot connect to the gateway: "
              + status.getCode()
              + ": "
              + status.getDescription()
              + " (fix the configuration; retrying every "
              + options.backoffMax.toSeconds()
              + " s)");
      firstWelcome.completeExceptionally(
          new IllegalStateException(status.getCode() + ": " + status.getDescription()));
      return options.backoffMax;
    }
    Duration delay = backoff(failures);
    log.warning(
        "connection "
            + s.number
            + " to the gateway ended: "
            + status.getCode()
            + (status.getDescription() == null ? "" : ": " + status.getDescription())
            + "; reconnecting in "
            + delay.toMillis()
            + " ms");
    return delay;
  }

  /**
   * A readable reason when the stream failed in the TLS handshake (an untrusted or mismatched
   * certificate, a plaintext gateway): retrying will not help until a setting changes.
   */
  private String tlsProblem(Status status) {
    if (!options.tls) {
      return null;
    }
    for (Throwable t = status.getCause(); t != null; t = t.getCause()) {
      if (t instanceof javax.net.ssl.SSLException) {
        return "TLS handshake with "
            + options.target
            + " failed: "
            + t.getMessage()
            + (options.tlsCaFile != null
                ? " (is the gateway's certificate issued by the CA in " + options.tlsCaFile + "?)"
                : " (is the gateway's certificate trusted by this JVM's roots?)");
      }
    }
    return null;
  }

  /** The wait before attempt {@code n} (1-based): exponential, capped, with jitter. */
  Duration backoff(int n) {
    double base =
        Math.min(
            options.backoffMax.toMillis(),
            options.backoffInitial.toMillis() * Math.pow(options.backoffMultiplier, n - 1));
    double spread = 1 + options.backoffJitter * (2 * ThreadLocalRandom.current().nextDouble() - 1);
    return Duration.ofMillis(Math.max(1, Math.round(base * spread)));
  }

  private void failPending(Session s, String why) {
    for (Map.Entry<String, Pending> e : new ArrayList<>(pending.entrySet())) {
      if (s == null || e.getValue().session == s) {
        pending.remove(e.getKey());
        e.getValue().future.completeExceptionally(new NotConnectedException(why));
      }
    }
  }

  private void onFrame(Session s, ConnectResponse frame) {
    switch (frame.getFrameCase()) {
      case WELCOME -> onWelcome(s, frame.getWelcome());
      case RESPONSE -> {
        PlayerResponse r = frame.getResponse();
        Pending p = r.getRequestId().isEmpty() ? null : pending.remove(r.getRequestId());
        if (p != null) {
          p.future.complete(r);
        } else {
          listener.onUnsolicited(r);
        }
      }
      case ERROR -> {
        FrameError e = frame.getError();
        log.warning(
            "the gateway refused a frame"
                + (e.getRequestId().isEmpty() ? "" : " (" + e.getRequestId() + ")")
                + ": "
                + Status.fromCodeValue(e.getCode()).getCode()
                + ": "
                + e.getMessage());
        listener.onFrameError(e);
        Pending p = e.getRequestId().isEmpty() ? null : pending.remove(e.getRequestId());
        if (p != null) {
          p.future.completeExceptionally(new FrameRefusedException(e));
        }
      }
      case TOOL_CALL -> runTool(s, frame.getToolCall());
      default -> log.fine("ignoring an empty or newer frame: " + frame.getFrameCase());
    }
  }

  // --- game tools ------------------------------------------------------------------------

  private void runTool(Session s, ToolCall call) {
    GameTool tool = tools.get(call.getTool());
    if (tool == null) {
      s.send(failure(call, "system.error.tool_unavailable", "this server offers no tool " + call.getTool()));
      return;
    }
    long timeoutMs = call.getTimeoutMs() > 0 ? call.getTimeoutMs() : 10_000;
    // 0 waiting for the game thread, 1 running, 2 answered without running.
    AtomicInteger state = new AtomicInteger();
    Runnable task =
        () -> {
          if (!state.compareAndSet(0, 1)) {
            return; // answered as timed out: it never runs
          }
          ToolResult result;
          try {
            Map<String, Object> output = tool.handler().call(call.getPlayerId(), call.getCallId(), Structs.toMap(call.getInput()));
            result =
                ToolResult.newBuilder()
                    .setCallId(call.getCallId())
                    .setOutput(Structs.fromMap(output == null ? Map.of() : output))
                    .build();
          } catch (ToolException e) {
            result = failureResult(call, e.key(), e.getMessage());
          } catch (RuntimeException e) {
            log.log(Level.WARNING, "tool " + call.getTool() + " threw", e);
            result = failureResult(call, "system.error.module_failed", "tool " + call.getTool() + " failed: " + e);
          }
          s.send(ConnectRequest.newBuilder().setToolResult(result).build());
          listener.onToolCall(call, result);
        };
    long margin = Math.min(250, timeoutMs / 10);
    timers.schedule(
        () -> {
          if (state.compareAndSet(0, 2)) {
            s.send(
                failure(
                    call,
                    "system.error.timeout",
                    "the game thread did not start " + call.getTool() + " within " + timeoutMs + " ms; it did not run"));
          }
        },
        timeoutMs - margin,
        TimeUnit.MILLISECONDS);
    try {
      gameThread.execute(task);
    } catch (RejectedExecutionException e) {
      if (state.compareAndSet(0, 2)) {
        s.send(failure(call, "system.error.tool_unavailable", "the game thread takes no tasks (server stopping)"));
      }
    }
  }

  private static ToolResult failureResult(ToolCall call, String key, String message) {
    return ToolResult.newBuilder()
        .setCallId(call.getCallId())
        .setFailure(Failure.newBuilder().setKey(key).setMessage(message == null ? "" : message))
        .build();
  }

  private static ConnectRequest failure(ToolCall call, String key, String message) {
    return ConnectRequest.newBuilder().setToolResult(failureResult(call, key, message)).build();
  }

  private static boolean isLoopback(String target) {
    String t = target.replaceFirst("^dns:///", "");
    return t.startsWith("127.") || t.startsWith("localhost") || t.startsWith("[::1]");
  }

  // --- plumbing ---------------------------------------------------------------------------

  private record Pending(CompletableFuture<PlayerResponse> future, Session session) {}

  /** One attempt's stream. */
  private final class Session implements ClientResponseObserver<ConnectRequest, ConnectResponse> {
    final int number; // for logs
    final CompletableFuture<Status> ended = new CompletableFuture<>();
    volatile boolean welcomed;
    private ClientCallStreamObserver<ConnectRequest> requests; // guarded by this

    Session(int number) {
      this.number = number;
    }

    @Override
    public synchronized void beforeStart(ClientCallStreamObserver<ConnectRequest> requests) {
      this.requests = requests;
    }

    /** Writes a frame unless the stream has ended; StreamObserver is not thread-safe. */
    synchronized void send(ConnectRequest frame) {
      if (!ended.isDone() && requests != null) {
        try {
          requests.onNext(frame);
        } catch (RuntimeException e) {
          log.fine("frame not sent on an ending stream: " + e);
        }
      }
    }

    synchronized void halfClose() {
      if (!ended.isDone() && requests != null) {
        requests.onCompleted();
      }
    }

    synchronized void cancel(String why) {
      if (!ended.isDone() && requests != null) {
        requests.cancel(why, null);
      }
    }

    @Override
    public void onNext(ConnectResponse frame) {
      onFrame(this, frame);
    }

    @Override
    public void onError(Throwable t) {
      Status status = Status.fromThrowable(t);
      ended.complete(status);
      onEnd(this, status);
    }

    @Override
    public void onCompleted() {
      Status status = Status.UNAVAILABLE.withDescription("the gateway ended the stream");
      ended.complete(status);
      onEnd(this, status);
    }
  }

  /** Adds {@code authorization: Bearer <token>} to every call. */
  private static final class BearerToken implements ClientInterceptor {
    private final String header;

    BearerToken(String token) {
      this.header = "Bearer " + token;
    }

    @Override
    public <Q, R> ClientCall<Q, R> interceptCall(
        MethodDescriptor<Q, R> method, CallOptions callOptions, Channel next) {
      return new ForwardingClientCall.SimpleForwardingClientCall<>(next.newCall(method, callOptions)) {
        @Override
        public void start(ClientCall.Listener<R> responseListener, Metadata headers) {
          headers.put(AUTHORIZATION, header);
          super.start(responseListener, headers);
        }
      };
    }
  }

  /** The players this client re-joins after a reconnect, in join order. */
  public List<Player> players() {
    synchronized (lock) {
      return List.copyOf(players.values());
    }
  }
}
