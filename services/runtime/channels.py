"""Outbound channels: one per dependency, owned by the client object that uses it.

Every channel carries the calling service's credential and keeps the stack's one keepalive
policy (`ChannelSettings`, made from the service's config by `ServerConfig.channel_settings`).

A target that names its resolver balances its calls round robin over every address that
resolves to (decision 0022): `dns:///storage-headless:50054` (a headless Service: one address
per ready replica, resolved again as connections close) and `ipv4:10.0.0.1:50054,10.0.0.2:50054`
(a static list; `ipv6:` alike). gRPC's default, pick_first, would send every call of the
process to one address. A plain `host:port` (a ClusterIP Service's virtual IP,
`127.0.0.1:port`) keeps pick_first: one connection, made again on the next call after it was
lost, so a restarted server is reached at once (round robin would retry it on the reconnect
backoff and fail calls fast meanwhile). Servers close every internal connection after a
maximum age (`ServerConfig.max_connection_age_seconds`), so a client also finds replicas
added after it resolved, and a connection through a virtual IP lands on another replica.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import grpc

from services.runtime.interceptors import client_interceptors
from services.runtime.keepalive import KeepalivePolicy
from services.runtime.security import ChannelSecurity

__all__ = ["ChannelSettings", "Dependency", "open_channel"]


@dataclasses.dataclass(frozen=True)
class ChannelSettings:
    """What every outbound channel of one service shares."""

    security: ChannelSecurity = ChannelSecurity()
    """The service's credential, and TLS to its targets."""
    keepalive: KeepalivePolicy = KeepalivePolicy()
    """Pings on idle connections (services.runtime.keepalive)."""
    stream_seconds: float = 30.0
    """How long a long-lived stream of calls (services.runtime.multiplex) takes new calls:
    after that the next call opens a new stream (on the next address round robin, or on the
    new connection of a server that aged the old one out) and the old stream is closed once
    its calls are answered. It must stay below the servers'
    `max_connection_age_grace_seconds` less the longest call on a stream, so that no stream
    is still in use when its aged connection is closed. 0: one stream for good."""


_BALANCED_SCHEMES = ("dns:", "ipv4:", "ipv6:")
"""Targets starting so are balanced round robin over their addresses (see the module
docstring)."""


def _service_config(idempotent_methods: Sequence[str], balanced: bool) -> str:
    """Service config that retries the named methods on UNAVAILABLE, and nothing else, and,
    when `balanced`, sends calls round robin over the target's addresses.

    Only idempotent calls may be sent twice; everything else fails fast to the caller.
    """
    names = [
        {"service": full.split("/")[0], "method": full.split("/")[1]} for full in idempotent_methods
    ]
    policy = {
        "maxAttempts": 3,
        "initialBackoff": "0.05s",
        "maxBackoff": "0.5s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    config: dict[str, object] = {
        "methodConfig": [{"name": names, "retryPolicy": policy}] if names else []
    }
    if balanced:
        config["loadBalancingConfig"] = [{"round_robin": {}}]
    return json.dumps(config)


DEFAULT_CALL_SECONDS = 10.0
"""The deadline of a call made outside any request's deadline (a background call)."""


def open_channel(
    target: str,
    *,
    idempotent_methods: Sequence[str] = (),
    default_timeout: float | None = DEFAULT_CALL_SECONDS,
    private: bool = False,
    interceptors: bool = True,
    settings: ChannelSettings | None = None,
) -> grpc.aio.Channel:
    """An aio channel to `target` with the service's credential, request-id and deadline
    propagation, over TLS when the settings trust a CA.

    Args:
        target: the dependency's address: `host:port` (one connection), or
            `dns:///host:port` or `ipv4:addr:port,addr:port` (calls round robin over every
            address it resolves to).
        idempotent_methods: `package.Service/Method` names retried on UNAVAILABLE.
        default_timeout: seconds for calls made outside any request deadline.
        private: give the channel its own connections instead of sharing them with other
            channels to the same target: a background poller's failed attempts (and the
            reconnect backoff they cause) then never delay request traffic.
        interceptors: with request-id and deadline propagation; without, for a long-lived
            stream that outlives every request (services.runtime.multiplex), whose messages
            carry their request ids themselves (its opener sends `settings.security.metadata`, asked
            on each open).
        settings: credential, TLS and keepalive; the defaults send no credential.
    """
    settings = settings or ChannelSettings()
    options: list[tuple[str, object]] = [
        (
            "grpc.service_config",
            _service_config(idempotent_methods, target.startswith(_BALANCED_SCHEMES)),
        ),
        # Ours alone: a service config published in DNS (TXT records) never replaces it.
        ("grpc.service_config_disable_resolution", 1),
        ("grpc.enable_retries", 1),
        *settings.keepalive.channel_options(),
        # gRPC's default backoff grows to two minutes between attempts: a dependency that was
        # down at start (or restarted) would stay unreachable long after it is back.
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
    if private:
        options.append(("grpc.use_local_subchannel_pool", 1))
    security = settings.security
    chosen = (
        client_interceptors(default_timeout, lambda: security.metadata) if interceptors else None
    )
    credentials = settings.security.channel_credentials()
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=options, interceptors=chosen)
    return grpc.aio.insecure_channel(target, options=options, interceptors=chosen)


S = TypeVar("S")


class Dependency(Generic[S]):
    """A channel to one dependency and the stub on it, owned by the object that uses it.

    Args:
        target: the dependency's address (see `open_channel`).
        stub_factory: the generated `...Stub` class.
        idempotent_methods: `package.Service/Method` names retried on UNAVAILABLE.
        private: connections of its own (see `open_channel`).
        settings: the calling service's credential, TLS and keepalive.
    """

    def __init__(
        self,
        target: str,
        stub_factory: Callable[[grpc.aio.Channel], S],
        *,
        idempotent_methods: Sequence[str] = (),
        private: bool = False,
        settings: ChannelSettings | None = None,
    ) -> None:
        self.target = target
        self.idempotent_methods = frozenset(idempotent_methods)
        self.private = private
        self.settings = settings or ChannelSettings()
        self.channel = open_channel(
            target, idempotent_methods=idempotent_methods, private=private, settings=self.settings
        )
        self.stub = stub_factory(self.channel)

    async def aclose(self) -> None:
        await self.channel.close()
