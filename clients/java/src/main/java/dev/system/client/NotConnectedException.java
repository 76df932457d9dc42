package dev.system.client;

/**
 * The request could not be answered because the gateway connection is down: either it was not
 * sent (no connection now) or the connection ended while it waited, in which case it may or
 * may not have been served. Requests are never re-sent on their own; tell the player to try
 * again once {@link GameServerClient#isConnected()} is true.
 */
public class NotConnectedException extends RuntimeException {
  public NotConnectedException(String message) {
    super(message);
  }
}
