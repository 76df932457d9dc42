package dev.system.client;

import io.netty.handler.codec.http2.Http2SecurityUtil;
import io.netty.handler.ssl.JdkApplicationProtocolNegotiator;
import io.netty.handler.ssl.JdkSslClientContext;
import io.netty.handler.ssl.SslContext;
import io.netty.handler.ssl.SupportedCipherSuiteFilter;
import java.io.File;
import java.lang.reflect.Constructor;
import java.util.List;
import java.util.Set;
import javax.net.ssl.SSLEngine;
import javax.net.ssl.SSLException;
import javax.net.ssl.SSLHandshakeException;

/**
 * TLS with ALPN on the JDK's own TLS engine, for Debian's netty (4.1.48), which ships without
 * the class that offers JDK ALPN to {@code SslContextBuilder} ("JDK provider does not support
 * ALPN protocol") although it keeps netty's Java 9 ALPN engine. gRPC needs ALPN to agree on
 * HTTP/2 ({@code h2}). With netty from Maven Central this class is never used.
 */
final class JdkAlpn implements JdkApplicationProtocolNegotiator {
  private static final List<String> PROTOCOLS = List.of("h2");

  private JdkAlpn() {}

  /** A client context trusting {@code caFile} (PEM), or the JVM's roots when null. */
  @SuppressWarnings("deprecation") // the one public constructor that takes a negotiator
  static SslContext clientContext(File caFile) throws SSLException {
    return new JdkSslClientContext(
        caFile,
        null,
        Http2SecurityUtil.CIPHERS,
        SupportedCipherSuiteFilter.INSTANCE,
        new JdkAlpn(),
        0,
        0);
  }

  @Override
  public List<String> protocols() {
    return PROTOCOLS;
  }

  @Override
  public SslEngineWrapperFactory wrapperFactory() {
    return (engine, negotiator, isServer) -> java9Engine(engine, negotiator, isServer);
  }

  @Override
  public ProtocolSelectorFactory protocolSelectorFactory() {
    return (SSLEngine engine, Set<String> supported) ->
        new ProtocolSelector() {
          @Override
          public void unsupported() {}

          @Override
          public String select(List<String> offered) throws Exception {
            for (String p : offered) {
              if (supported.contains(p)) {
                return p;
              }
            }
            throw new SSLHandshakeException("no common application protocol in " + offered);
          }
        };
  }

  @Override
  public ProtocolSelectionListenerFactory protocolListenerFactory() {
    return (SSLEngine engine, List<String> ours) ->
        new ProtocolSelectionListener() {
          @Override
          public void unsupported() {}

          @Override
          public void selected(String protocol) throws Exception {
            if (!ours.contains(protocol)) {
              throw new SSLHandshakeException(
                  "the server chose application protocol " + protocol + ", not one of " + ours);
            }
          }
        };
  }

  /** netty's own Java 9 ALPN engine; its constructor is package-private. */
  private static SSLEngine java9Engine(
      SSLEngine engine, JdkApplicationProtocolNegotiator negotiator, boolean isServer) {
    try {
      Constructor<?> c =
          Class.forName("io.netty.handler.ssl.Java9SslEngine")
              .getDeclaredConstructor(
                  SSLEngine.class, JdkApplicationProtocolNegotiator.class, boolean.class);
      c.setAccessible(true);
      return (SSLEngine) c.newInstance(engine, negotiator, isServer);
    } catch (ReflectiveOperationException | RuntimeException e) {
      throw new IllegalStateException(
          "this netty has neither JDK ALPN support nor io.netty.handler.ssl.Java9SslEngine; "
              + "use netty 4.1.x from Maven Central or add netty-tcnative",
          e);
    }
  }
}
