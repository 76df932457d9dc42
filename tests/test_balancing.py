"""Client balancing (decision 0022): every channel spreads its calls round robin over the
addresses its target resolves to; internal ports close aged connections so that clients find
new replicas, while calls in flight finish; the long-lived streams of calls move to new streams
(and so to every replica, and off aged connections) without losing or repeating a call.

Real servers on loopback, no mocks. Linux routes all of 127.0.0.0/8 to loopback, so two
replicas listen on one port at 127.0.0.1 and 127.0.0.2, reached as one target
(`ipv4:127.0.0.1:P,127.0.0.2:P`, gRPC's static address list: what a headless Service's DNS
name resolves to in a cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from system.relay.v1 import relay_pb2, relay_pb2_grpc

from engine_service.config import EngineConfig
from services.gateway.config import GatewayConfig
from services.runtime.channels import ChannelSettings, Dependency
from services.runtime.config import ConfigError, ServerConfig
from services.runtime.errors import Unavailable
from services.runtime.multiplex import MultiplexServer, StreamedCalls
from services.runtime.server import PublicPort, ServiceHost
from tests.inprocess import internal_target
from tests.waiting import wait_until

RELAY_NAME = "system.relay.v1.ToolRelayService"
RELAY = relay_pb2.DESCRIPTOR.services_by_name["ToolRelayService"]


class _Relay(relay_pb2_grpc.ToolRelayServiceServicer):
    """A tiny ToolRelayService: NotifyPlayer records who it was for and over which connection
    (the client's address and port), as a unary call and as a call on MultiplexCalls."""

    def __init__(self) -> None:
        self.players: list[str] = []
        """`player_id` of every NotifyPlayer served, unary or on a stream."""
        self.peers: list[str] = []
        """The client address of every unary NotifyPlayer."""
        self.stream_peers: list[str] = []
        """The client address of every MultiplexCalls stream."""
        self.gate: asyncio.Event | None = None
        """When set to an event, NotifyPlayer waits for it first (a slow call)."""
        self.entered = asyncio.Event()
        self.refusals = 0
        """So many unary NotifyPlayer calls to come fail UNAVAILABLE (a replica in trouble)."""
        self.attempts = 0
        """Unary NotifyPlayer calls that arrived, refused or not."""
        self._multiplex = MultiplexServer(RELAY, {"NotifyPlayer": self._notify})

    async def _notify(self, request: relay_pb2.NotifyPlayerRequest, context: Any) -> Any:
        gate = self.gate
        if gate is not None:
            self.entered.set()
            await gate.wait()
        self.players.append(request.player_id)
        return relay_pb2.NotifyPlayerResponse()

    async def NotifyPlayer(
        self, request: relay_pb2.NotifyPlayerRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> relay_pb2.NotifyPlayerResponse:
        self.peers.append(context.peer())
        self.attempts += 1
        if self.refusals:
            self.refusals -= 1
            raise Unavailable("refused for the test")
        response: relay_pb2.NotifyPlayerResponse = await self._notify(request, context)
        return response

    async def MultiplexCalls(
        self,
        request_iterator: AsyncIterator[relay_pb2.MultiplexCallsRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[relay_pb2.MultiplexCallsResponse]:
        self.stream_peers.append(context.peer())
        async for response in self._multiplex.serve(request_iterator, context):
            yield response


def _config(host: str = "127.0.0.1", port: int = 0, **overrides: Any) -> ServerConfig:
    return ServerConfig(
        host=host, port=port, metrics_port=-1, drain_seconds=0, grace_seconds=0.2, **overrides
    )


async def _replica(
    config: ServerConfig, public: PublicPort | None = None
) -> tuple[ServiceHost, _Relay]:
    relay = _Relay()
    host = ServiceHost(
        "relay",
        config,
        [lambda server: relay_pb2_grpc.add_ToolRelayServiceServicer_to_server(relay, server)],
        [RELAY_NAME],
        public=public,
    )
    await host.start()
    return host, relay


@pytest.fixture
async def replicas() -> AsyncIterator[tuple[str, list[_Relay]]]:
    """Two replicas on one port, at 127.0.0.1 and 127.0.0.2, and the target naming both."""
    hosts: list[ServiceHost] = []
    try:
        for _ in range(5):  # the free port of 127.0.0.1 may be taken on 127.0.0.2
            first, one = await _replica(_config("127.0.0.1"))
            hosts.append(first)
            try:
                second, two = await _replica(_config("127.0.0.2", first.port))
            except OSError:
                continue
            hosts.append(second)
            yield f"ipv4:127.0.0.1:{first.port},127.0.0.2:{first.port}", [one, two]
            break
        else:
            pytest.fail("found no port free on both 127.0.0.1 and 127.0.0.2")
    finally:
        for host in hosts:
            await host.stop()


async def _notify(dependency: Dependency[Any], player: str) -> None:
    await dependency.stub.NotifyPlayer(relay_pb2.NotifyPlayerRequest(player_id=player), timeout=5)


# -- spreading calls ---------------------------------------------------------------------------


async def test_calls_are_spread_over_every_replica_of_a_target(
    replicas: tuple[str, list[_Relay]],
) -> None:
    target, relays = replicas
    dependency = Dependency(target, relay_pb2_grpc.ToolRelayServiceStub)
    try:
        for n in range(20):
            await _notify(dependency, f"p{n}")
    finally:
        await dependency.aclose()
    served = [len(relay.players) for relay in relays]
    assert sum(served) == 20
    assert min(served) >= 5, served


async def test_gRPC_default_pick_first_would_send_every_call_to_one_replica(
    replicas: tuple[str, list[_Relay]],
) -> None:
    """The control: a channel without our service config (gRPC's pick_first) sends all 20
    calls to one replica, so the test above can fail."""
    target, relays = replicas
    async with grpc.aio.insecure_channel(target) as channel:
        stub = relay_pb2_grpc.ToolRelayServiceStub(channel)
        for n in range(20):
            await stub.NotifyPlayer(relay_pb2.NotifyPlayerRequest(player_id=f"p{n}"), timeout=5)
    assert sorted(len(relay.players) for relay in relays) == [0, 20]


async def test_a_dns_target_and_a_plain_target_reach_the_service() -> None:
    host, relay = await _replica(_config())
    targets = [f"dns:///localhost:{host.port}", host.target]
    dependencies = [Dependency(t, relay_pb2_grpc.ToolRelayServiceStub) for t in targets]
    try:
        for n, dependency in enumerate(dependencies):
            await _notify(dependency, f"p{n}")
    finally:
        for dependency in dependencies:
            await dependency.aclose()
        await host.stop()
    assert relay.players == ["p0", "p1"]


async def test_a_plain_target_reaches_a_restarted_server_on_the_next_call() -> None:
    """A plain `host:port` keeps pick_first: after its server restarted (on the same port),
    the next call connects and gets through. Round robin would have retried the connection
    while the server was down and, within its reconnect backoff, fail the call fast."""
    host, _ = await _replica(_config())
    port = host.port
    dependency = Dependency(host.target, relay_pb2_grpc.ToolRelayServiceStub)
    try:
        await _notify(dependency, "before")
        await host.stop()
        host, relay = await _replica(_config(port=port))
        await _notify(dependency, "after")
    finally:
        await dependency.aclose()
        await host.stop()
    assert relay.players == ["after"]


async def test_idempotent_calls_are_still_retried_on_unavailable() -> None:
    """The balancing config is merged into the retry config, which works as before: a call
    the service answers UNAVAILABLE is sent again when its method is idempotent, and only
    then."""
    host, relay = await _replica(_config())
    idempotent = Dependency(
        host.target,
        relay_pb2_grpc.ToolRelayServiceStub,
        idempotent_methods=[f"{RELAY_NAME}/NotifyPlayer"],
    )
    plain = Dependency(host.target, relay_pb2_grpc.ToolRelayServiceStub)
    try:
        relay.refusals = 1
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _notify(plain, "once")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert relay.attempts == 1
        relay.refusals = 2
        await _notify(idempotent, "again")
        assert relay.attempts == 4  # refused twice, then served: three attempts at most
    finally:
        await idempotent.aclose()
        await plain.aclose()
        await host.stop()
    assert relay.players == ["again"]


async def test_a_stream_of_calls_goes_to_every_replica_in_turn(
    replicas: tuple[str, list[_Relay]],
) -> None:
    """A long-lived stream is replaced after `stream_seconds`: the new one takes the next
    replica, so a client whose calls all go on one stream still spreads them."""
    target, relays = replicas
    settings = ChannelSettings(stream_seconds=0.1)
    dependency = Dependency(target, relay_pb2_grpc.ToolRelayServiceStub, settings=settings)
    calls = StreamedCalls(dependency, RELAY)
    sent = 0

    async def both_replicas_served() -> bool:
        nonlocal sent
        sent += 1
        request = relay_pb2.NotifyPlayerRequest(player_id=f"p{sent}")
        await calls.call("NotifyPlayer", request, timeout=5)
        return all(relay.players for relay in relays)

    try:
        await wait_until(both_replicas_served, timeout=10, what="stream calls on both replicas")
    finally:
        await calls.aclose()
        await dependency.aclose()
    assert all(relay.stream_peers for relay in relays)
    assert calls.streams_opened >= 2
    assert sum(len(relay.players) for relay in relays) == sent


# -- aged connections --------------------------------------------------------------------------


def test_connections_age_by_default_with_a_grace_longer_than_any_request() -> None:
    config = ServerConfig()
    assert (config.max_connection_age_seconds, config.max_connection_age_grace_seconds) == (
        300.0,
        150.0,
    )
    longest = max(GatewayConfig().request_timeout_seconds, EngineConfig().execute_timeout_seconds)
    assert config.max_connection_age_grace_seconds > longest
    # A stream is replaced long before the grace of its aged connection runs out, even with
    # a game-tool call (the gateway's own limit) started just before.
    stream = ChannelSettings().stream_seconds + GatewayConfig().tool_call_timeout_seconds
    assert stream < config.max_connection_age_grace_seconds
    with pytest.raises(ConfigError, match="max_connection_age_grace_seconds"):
        _config(max_connection_age_seconds=60.0, max_connection_age_grace_seconds=0.0).validate()
    _config(max_connection_age_seconds=0.0, max_connection_age_grace_seconds=0.0).validate()


@contextlib.contextmanager
def _no_failure(failures: list[BaseException]) -> Iterator[None]:
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        failures.append(exc)


async def test_unary_calls_go_on_across_aged_connections_and_the_public_port_keeps_its_own() -> (
    None
):
    """Connections to the internal port are replaced as they age, with no call failing: a
    call open at the GOAWAY finishes on the old connection, new calls go on the new one. The
    public port (the game servers' long-lived stream) never ages a connection."""
    public_relay = _Relay()
    public = PublicPort(
        0,
        [
            lambda server: relay_pb2_grpc.add_ToolRelayServiceServicer_to_server(
                public_relay, server
            )
        ],
        [RELAY_NAME],
    )
    host, relay = await _replica(
        _config(max_connection_age_seconds=0.3, max_connection_age_grace_seconds=2.0), public
    )
    internal = Dependency(internal_target(host), relay_pb2_grpc.ToolRelayServiceStub)
    outside = Dependency(host.target, relay_pb2_grpc.ToolRelayServiceStub)
    failures: list[BaseException] = []
    try:
        await _notify(outside, "outside")
        await _notify(internal, "first")
        # A slow call holds the first connection past its age.
        gate = relay.gate = asyncio.Event()
        slow = asyncio.ensure_future(_notify(internal, "slow"))
        await asyncio.wait_for(relay.entered.wait(), 5)
        relay.gate = None
        sent = 0

        async def connections_replaced() -> bool:
            nonlocal sent
            sent += 4
            with _no_failure(failures):
                await asyncio.gather(*(_notify(internal, f"p{sent - i}") for i in range(4)))
            return len(set(relay.peers)) >= 3 or bool(failures)

        await wait_until(connections_replaced, timeout=10, what="two connections replaced")
        # The slow call, open since before the first GOAWAY, finishes within the grace.
        assert not slow.done()
        gate.set()
        await asyncio.wait_for(slow, 5)
        # All the while, the public connection stayed the one it was.
        await _notify(outside, "outside again")
    finally:
        await internal.aclose()
        await outside.aclose()
        await host.stop()
    assert failures == []
    assert "slow" in relay.players
    assert len(set(public_relay.peers)) == 1 and len(public_relay.peers) == 2


async def test_a_stream_of_calls_moves_off_aged_connections_losing_and_repeating_no_call() -> None:
    """Calls on one MultiplexCalls stream, four at a time, while the server ages connections
    out (0.3 s, then 1 s of grace): streams are replaced every 0.1 s, each old one ends once
    answered, so every call is answered OK and served exactly once (none is idempotent: no
    retry hides a failure), on streams over three connections or more."""
    host, relay = await _replica(
        _config(max_connection_age_seconds=0.3, max_connection_age_grace_seconds=1.0)
    )
    settings = ChannelSettings(stream_seconds=0.1)
    dependency = Dependency(host.target, relay_pb2_grpc.ToolRelayServiceStub, settings=settings)
    calls = StreamedCalls(dependency, RELAY)
    sent: list[str] = []
    failures: list[BaseException] = []

    async def call(player: str) -> None:
        sent.append(player)
        with _no_failure(failures):
            await calls.call("NotifyPlayer", relay_pb2.NotifyPlayerRequest(player_id=player), 5)

    async def connections_replaced() -> bool:
        await asyncio.gather(*(call(f"p{len(sent)}-{i}") for i in range(4)))
        return len(set(relay.stream_peers)) >= 3 or bool(failures)

    try:
        await wait_until(connections_replaced, timeout=10, what="streams on three connections")
    finally:
        await calls.aclose()
        await dependency.aclose()
        await host.stop()
    assert failures == []
    assert sorted(relay.players) == sorted(sent) and len(set(sent)) == len(sent)
    assert calls.streams_opened >= 3


async def test_a_stream_still_in_use_when_its_aged_connection_closes_loses_its_calls() -> None:
    """The control, and why streams are replaced well within the grace: a stream kept for
    good (`stream_seconds` 0) is still in use when the server closes its aged connection, and
    the call open on it fails UNAVAILABLE, not knowing whether it ran."""
    host, relay = await _replica(
        _config(max_connection_age_seconds=0.3, max_connection_age_grace_seconds=0.3)
    )
    settings = ChannelSettings(stream_seconds=0)
    dependency = Dependency(host.target, relay_pb2_grpc.ToolRelayServiceStub, settings=settings)
    calls = StreamedCalls(dependency, RELAY)
    relay.gate = asyncio.Event()  # never set: the call outlasts the connection
    try:
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await calls.call("NotifyPlayer", relay_pb2.NotifyPlayerRequest(player_id="p"), 10)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "max connection age" in (cut.value.details() or "")
        # The next call opens a new stream, on a new connection.
        relay.gate = None
        await calls.call("NotifyPlayer", relay_pb2.NotifyPlayerRequest(player_id="q"), 5)
    finally:
        await calls.aclose()
        await dependency.aclose()
        await host.stop()
    assert relay.players == ["q"]
    assert calls.streams_opened == 2 and len(set(relay.stream_peers)) == 2
