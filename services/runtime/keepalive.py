"""The one keepalive policy of every long-lived connection the stack holds or accepts.

Written once here, applied by every server (`ServiceHost`) and every outbound channel
(`open_channel`), and published to plugin authors (clients/java/README.md):

- **Clients ping every 30 s** (`client_seconds`), also while no call is open, and drop the
  connection when a ping is not acknowledged within 20 s (`timeout_seconds`). That keeps idle
  game-server streams alive through load balancers' idle timeouts (typically 60-350 s) and
  finds a dead network path within a minute.
- **Servers accept pings every 20 s or more** (`permit_seconds`, below the clients' interval so
  jitter never counts as a strike), with or without calls open. gRPC's default (one ping per
  5 minutes, two strikes) ended idle streams with GOAWAY `too_many_pings` after ~2 minutes.
- **Servers ping idle connections every 60 s** (`server_seconds`) and close a connection whose
  peer does not answer within 20 s: a stalled game server or a dead engine replica frees its
  connection, and its server id, in under 90 s.

Tests shorten every interval (all four are service settings) to show idle streams surviving
many intervals; `bench/keepalive.py` runs the real ones.
"""

from __future__ import annotations

import dataclasses

__all__ = ["KeepalivePolicy"]


@dataclasses.dataclass(frozen=True)
class KeepalivePolicy:
    """Keepalive intervals, in seconds; see the module docstring for why these values."""

    client_seconds: float = 30.0
    """How often a client pings its server when the connection is idle."""
    permit_seconds: float = 20.0
    """The shortest interval between client pings a server accepts without a strike."""
    server_seconds: float = 60.0
    """How often a server pings an idle client connection."""
    timeout_seconds: float = 20.0
    """How long a ping may go unacknowledged before the connection is closed."""

    def problems(self) -> list[str]:
        """What makes the policy unusable (empty when it is fine)."""
        found = []
        for name in ("client_seconds", "permit_seconds", "server_seconds", "timeout_seconds"):
            if getattr(self, name) <= 0:
                found.append(f"keepalive {name} must be positive")
        if self.permit_seconds > self.client_seconds:
            found.append(
                "the permitted ping interval must not exceed the clients' own interval, or "
                "servers would end our own clients' connections (too_many_pings)"
            )
        return found

    def server_options(self) -> list[tuple[str, int]]:
        """Channel arguments for a server."""
        return [
            ("grpc.keepalive_time_ms", int(self.server_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.timeout_seconds * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", int(self.permit_seconds * 1000)),
            ("grpc.http2.min_ping_interval_without_data_ms", int(self.permit_seconds * 1000)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def channel_options(self) -> list[tuple[str, int]]:
        """Channel arguments for a client."""
        return [
            ("grpc.keepalive_time_ms", int(self.client_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.timeout_seconds * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            # gRPC core stops pinging after two pings without data unless told otherwise.
            ("grpc.http2.max_pings_without_data", 0),
        ]
