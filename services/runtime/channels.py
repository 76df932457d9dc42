"""Outbound channels: one per dependency, owned by the client object that uses it."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import grpc

from services.runtime.interceptors import client_interceptors

__all__ = ["Dependency", "open_channel"]


def _retry_config(idempotent_methods: Sequence[str]) -> str:
    """Service config that retries the named methods on UNAVAILABLE, and nothing else.

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
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}] if names else []})


def open_channel(
    target: str,
    *,
    idempotent_methods: Sequence[str] = (),
    default_timeout: float | None = 10.0,
    private: bool = False,
    interceptors: bool = True,
) -> grpc.aio.Channel:
    """An insecure aio channel to `target` with request-id and deadline propagation.

    Args:
        target: `host:port` of the dependency.
        idempotent_methods: `package.Service/Method` names retried on UNAVAILABLE.
        default_timeout: seconds for calls made outside any request deadline.
        private: give the channel its own connections instead of sharing them with other
            channels to the same target: a background poller's failed attempts (and the
            reconnect backoff they cause) then never delay request traffic.
        interceptors: with request-id and deadline propagation; without, for a long-lived
            stream that outlives every request (services.runtime.multiplex), whose messages
            carry their request ids themselves.
    """
    options: list[tuple[str, object]] = [
        ("grpc.service_config", _retry_config(idempotent_methods)),
        ("grpc.enable_retries", 1),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # gRPC's default backoff grows to two minutes between attempts: a dependency that was
        # down at start (or restarted) would stay unreachable long after it is back.
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
    if private:
        options.append(("grpc.use_local_subchannel_pool", 1))
    return grpc.aio.insecure_channel(
        target,
        options=options,
        interceptors=client_interceptors(default_timeout) if interceptors else None,
    )


S = TypeVar("S")


class Dependency(Generic[S]):
    """A channel to one dependency and the stub on it, owned by the object that uses it.

    Args:
        target: `host:port`.
        stub_factory: the generated `...Stub` class.
        idempotent_methods: `package.Service/Method` names retried on UNAVAILABLE.
        private: connections of its own (see `open_channel`).
    """

    def __init__(
        self,
        target: str,
        stub_factory: Callable[[grpc.aio.Channel], S],
        *,
        idempotent_methods: Sequence[str] = (),
        private: bool = False,
    ) -> None:
        self.target = target
        self.idempotent_methods = frozenset(idempotent_methods)
        self.private = private
        self.channel = open_channel(target, idempotent_methods=idempotent_methods, private=private)
        self.stub = stub_factory(self.channel)

    async def aclose(self) -> None:
        await self.channel.close()
