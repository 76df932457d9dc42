package dev.system.client;

import java.nio.file.Path;
import java.time.Duration;
import java.util.List;
import java.util.Objects;
import java.util.logging.Logger;

/**
 * How a {@link GameServerClient} reaches the gateway. Immutable; build with {@link #builder}.
 *
 * <p>The keepalive defaults are the stack's written policy (services/runtime/keepalive.py): the
 * client pings every 30 s, also while no call is open, and gives a ping 20 s to be answered
 * (the gateway gives its own pings as long). Gateways permit client pings
 * every 20 s or more, so do not lower {@code keepAliveTime} below 20 s: a gateway answers
 * pings that come too often with GOAWAY {@code too_many_pings} and the stream ends.
 */
public final class ClientOptions {
  final String target;
  final String serverId;
  final String token;
  final boolean tls;
  final Path tlsCaFile;
  final String tlsServerName;
  final Duration keepAliveTime;
  final Duration keepAliveTimeout;
  final boolean keepAliveWithoutCalls;
  final Duration backoffInitial;
  final Duration backoffMax;
  final double backoffMultiplier;
  final double backoffJitter;
  final Duration requestTimeout;
  final String software;
  final List<String> features;
  final Logger logger;

  private ClientOptions(Builder b) {
    this.target = Objects.requireNonNull(b.target, "target (host:port) is required");
    this.serverId = Objects.requireNonNull(b.serverId, "serverId is required");
    this.token = Objects.requireNonNull(b.token, "token is required");
    this.tls = b.tls || b.tlsCaFile != null;
    this.tlsCaFile = b.tlsCaFile;
    this.tlsServerName = b.tlsServerName;
    this.keepAliveTime = b.keepAliveTime;
    this.keepAliveTimeout = b.keepAliveTimeout;
    this.keepAliveWithoutCalls = b.keepAliveWithoutCalls;
    this.backoffInitial = b.backoffInitial;
    this.backoffMax = b.backoffMax;
    this.backoffMultiplier = b.backoffMultiplier;
    this.backoffJitter = b.backoffJitter;
    this.requestTimeout = b.requestTimeout;
    this.software = b.software;
    this.features = List.copyOf(b.features);
    this.logger = b.logger;
    if (serverId.isBlank() || token.isBlank()) {
      throw new IllegalArgumentException("serverId and token must not be blank");
    }
    if (backoffJitter < 0 || backoffJitter >= 1) {
      throw new IllegalArgumentException("backoffJitter must be in [0, 1)");
    }
  }

  /** A builder for the gateway at {@code target} ({@code host:port}). */
  public static Builder builder(String target, String serverId, String token) {
    return new Builder(target, serverId, token);
  }

  /** The gateway's {@code host:port}. */
  public String target() {
    return target;
  }

  /** This game server's id, as its token was issued for. */
  public String serverId() {
    return serverId;
  }

  /** Whether the connection uses TLS. */
  public boolean tls() {
    return tls;
  }

  /** Builder of {@link ClientOptions}. */
  public static final class Builder {
    private final String target;
    private final String serverId;
    private final String token;
    private boolean tls;
    private Path tlsCaFile;
    private String tlsServerName;
    private Duration keepAliveTime = Duration.ofSeconds(30);
    private Duration keepAliveTimeout = Duration.ofSeconds(20);
    private boolean keepAliveWithoutCalls = true;
    private Duration backoffInitial = Duration.ofSeconds(1);
    private Duration backoffMax = Duration.ofSeconds(30);
    private double backoffMultiplier = 2.0;
    private double backoffJitter = 0.2;
    private Duration requestTimeout = Duration.ofSeconds(30);
    private String software = "system-java-client/0.1";
    private List<String> features = List.of();
    private Logger logger = Logger.getLogger("dev.system.client");

    private Builder(String target, String serverId, String token) {
      this.target = target;
      this.serverId = serverId;
      this.token = token;
    }

    /** Use TLS, trusting the JVM's system roots (production: a certificate from a public CA). */
    public Builder tls(boolean tls) {
      this.tls = tls;
      return this;
    }

    /** Use TLS, trusting only the CA certificates in this PEM file (a private CA). */
    public Builder tlsCaFile(Path caFile) {
      this.tlsCaFile = caFile;
      return this;
    }

    /**
     * The name to check the gateway's certificate against, when it differs from the host in
     * the target (for example connecting to {@code 10.0.0.5:50051} with a certificate for
     * {@code gateway.example.net}).
     */
    public Builder tlsServerName(String name) {
      this.tlsServerName = name;
      return this;
    }

    /** Interval of client pings (default 30 s; gateways permit 20 s or more). */
    public Builder keepAliveTime(Duration d) {
      this.keepAliveTime = d;
      return this;
    }

    /** How long a ping may go unanswered before the connection counts as dead (20 s). */
    public Builder keepAliveTimeout(Duration d) {
      this.keepAliveTimeout = d;
      return this;
    }

    /** Whether to ping while no call is open (true). */
    public Builder keepAliveWithoutCalls(boolean b) {
      this.keepAliveWithoutCalls = b;
      return this;
    }

    /**
     * Reconnect delays: the first wait is {@code initial}, each next one {@code multiplier}
     * times longer up to {@code max}, each spread by plus or minus {@code jitter} (a fraction)
     * so that many game servers cut off together do not come back together. Defaults: 1 s,
     * 30 s, 2.0, 0.2.
     */
    public Builder backoff(Duration initial, Duration max, double multiplier, double jitter) {
      this.backoffInitial = initial;
      this.backoffMax = max;
      this.backoffMultiplier = multiplier;
      this.backoffJitter = jitter;
      return this;
    }

    /** How long a player request waits for its answer before it fails (30 s). */
    public Builder requestTimeout(Duration d) {
      this.requestTimeout = d;
      return this;
    }

    /** Software name and version sent in the hello, for the gateway's logs. */
    public Builder software(String software) {
      this.software = software;
      return this;
    }

    /** Optional features installed on this game server (for example {@code ftbquests}). */
    public Builder features(List<String> features) {
      this.features = features;
      return this;
    }

    /** Where the client logs (a Bukkit plugin passes {@code getLogger()}). */
    public Builder logger(Logger logger) {
      this.logger = logger;
      return this;
    }

    public ClientOptions build() {
      return new ClientOptions(this);
    }
  }
}
