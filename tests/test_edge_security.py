"""The edge: service credentials and access policies on internal ports, TLS on the public port
(reloaded without restart), mutual TLS on internal ports, and the one keepalive policy keeping
idle long-lived streams up."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from system.common.v1 import common_pb2
from system.storage.v1 import storage_pb2, storage_pb2_grpc

from services.gamesim.client import GameServerClient, GatewayRefused
from services.runtime.channels import ChannelSettings, open_channel
from services.runtime.config import ConfigError, ServerConfig
from services.runtime.keepalive import KeepalivePolicy
from services.runtime.pki import Authority
from services.runtime.security import (
    ANY_CALLER,
    AccessPolicy,
    ChannelSecurity,
    current_caller,
    parse_caller_tokens,
)
from services.runtime.server import ServiceHost
from tests.inprocess import Chain, running_chain
from tests.waiting import wait_until

ECHO = "test.Whoami"
TOKENS = {"engine": "engine-token-0123456789", "router": "router-token-0123456789"}


async def _whoami(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return current_caller().encode()


async def _peer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return context.peer().encode()


def _register(server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                ECHO,
                {
                    "Call": grpc.unary_unary_rpc_method_handler(_whoami),
                    "Admin": grpc.unary_unary_rpc_method_handler(_whoami),
                    "Peer": grpc.unary_unary_rpc_method_handler(_peer),
                },
            ),
        )
    )


def _config(**overrides: object) -> ServerConfig:
    return ServerConfig(port=0, metrics_port=-1, drain_seconds=0, grace_seconds=0.2, **overrides)  # type: ignore[arg-type]


@pytest.fixture
async def guarded() -> AsyncIterator[ServiceHost]:
    """A host whose `Call` the engine may call and whose `Admin` only operators may."""
    config = _config(caller_tokens=tuple(f"{c}={t}" for c, t in TOKENS.items()))
    host = ServiceHost(
        "whoami",
        config,
        [_register],
        [ECHO],
        access=AccessPolicy({ECHO: ["engine"], f"{ECHO}/Admin": []}),
    )
    await host.start()
    try:
        yield host
    finally:
        await host.stop()


async def _call(target: str, method: str = "Call", token: str = "", **kwargs: object) -> str:
    settings = ChannelSettings(ChannelSecurity(token=token, **kwargs))  # type: ignore[arg-type]
    channel = open_channel(target, settings=settings)
    try:
        answer = await channel.unary_unary(f"/{ECHO}/{method}")(b"", timeout=5)
        return bytes(answer).decode()
    finally:
        await channel.close()


# --- credentials and access ------------------------------------------------------------------


async def test_an_internal_port_names_the_caller_and_refuses_strangers(
    guarded: ServiceHost,
) -> None:
    assert await _call(guarded.target, token=TOKENS["engine"]) == "engine"
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await _call(guarded.target)
    assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in (missing.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as forged:
        await _call(guarded.target, token="engine-token-0123456780")
    assert forged.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # A valid credential for a caller the method does not admit.
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await _call(guarded.target, token=TOKENS["router"])
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "router" in (denied.value.details() or "") and "engine" in denied.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as admin:
        await _call(guarded.target, "Admin", token=TOKENS["engine"])
    assert admin.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_health_needs_no_credential(guarded: ServiceHost) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(guarded.target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=ECHO), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_access_rules_method_over_service_and_operators_everywhere() -> None:
    policy = AccessPolicy({"a.S": ["gateway"], "a.S/M": ["engine"], "a.T": [ANY_CALLER]})
    policy.check("engine", "/a.S/M")
    policy.check("gateway", "/a.S/Other")
    policy.check("router", "/a.T/Any")
    policy.check("operator", "/a.S/M")
    for caller, method in [("gateway", "/a.S/M"), ("engine", "/a.S/Other"), ("engine", "/b.U/X")]:
        with pytest.raises(Exception, match="may not call"):
            policy.check(caller, method)
    with pytest.raises(ValueError, match="unknown callers"):
        AccessPolicy({"a.S": ["admin"]})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"host": "0.0.0.0"}, "no credential is required"),
        ({"caller_tokens": ("engine",)}, "caller=token"),
        ({"caller_tokens": ("wizard=abcdefghijklmnopqrstuvwxyz",)}, "unknown caller"),
        ({"caller_tokens": ("engine=short",)}, "shorter than 16"),
        (
            {"caller_tokens": ("engine=abcdefghijklmnopq", "router=abcdefghijklmnopq")},
            "two callers",
        ),
        ({"tls_cert_file": "/nonexistent.pem"}, "go together"),
        ({"tls_client_ca_file": "/x.pem"}, "needs tls_cert_file"),
        ({"tls_ca_file": "/nonexistent/ca.pem"}, "does not exist"),
        ({"permit_keepalive_seconds": 40.0}, "too_many_pings"),
        ({"client_keepalive_seconds": 0.0}, "must be positive"),
    ],
)
def test_unsafe_or_broken_security_settings_are_refused_at_start(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(**settings).validate()


def test_reachable_addresses_start_with_credentials_or_an_explicit_opt_out() -> None:
    _config(host="0.0.0.0", caller_tokens=("engine=abcdefghijklmnopq",)).validate()
    _config(host="0.0.0.0", allow_unauthenticated=True).validate()
    _config(host="127.0.0.1").validate()
    assert parse_caller_tokens(["engine = abcdefghijklmnopq"]) == {"abcdefghijklmnopq": "engine"}


async def test_the_whole_chain_runs_on_credentials(tmp_path: Path) -> None:
    """Every hop authenticates: gateway → router, engine, storage; engine → storage (journal
    stream) and → gateway (relay stream, for the game tool `/inventory` calls)."""
    async with running_chain(tmp_path, credentials=True) as chain:
        client = await chain.client()
        await client.join("steve", "Steve", "en_us")
        help_reply = await client.chat("steve", "help")
        assert help_reply.reply.result.card.title == "Assistant help"
        inventory = await client.chat("steve", "/inventory")
        assert inventory.reply.result.status == common_pb2.RESULT_STATUS_SUCCEEDED, inventory
        # A caller that is not the gateway cannot speak for players to storage.
        channel = grpc.aio.insecure_channel(chain.storage_target)
        try:
            stub = storage_pb2_grpc.StorageServiceStub(channel)
            request = storage_pb2.ListHistoryRequest(player_id="steve", page_size=1)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.ListHistory(request, timeout=5)
            assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
            router = (("authorization", f"Bearer {chain.credentials['router']}"),)
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await stub.ListHistory(request, timeout=5, metadata=router)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        finally:
            await channel.close()


# --- TLS -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Pki:
    authority: Authority
    cert_file: Path
    key_file: Path


@pytest.fixture
def pki(tmp_path: Path) -> _Pki:
    authority = Authority(tmp_path / "pki")
    issued = authority.issue("gateway")
    return _Pki(authority, issued.cert_file, issued.key_file)


def _tls_client(chain: Chain, ca_file: Path) -> GameServerClient:
    client = GameServerClient(
        chain.gateway_target, chain.server_id, chain.token, tls_ca=ca_file.read_bytes()
    )
    chain._clients.append(client)
    return client


async def test_the_public_port_serves_tls_and_reloads_a_renewed_certificate(
    tmp_path: Path, pki: _Pki
) -> None:
    async with running_chain(
        tmp_path,
        public_tls_cert_file=str(pki.cert_file),
        public_tls_key_file=str(pki.key_file),
    ) as chain:
        client = _tls_client(chain, pki.authority.ca_file)
        await client.connect()
        await client.join("steve", "Steve", "en_us")
        reply = await client.chat("steve", "help")
        assert reply.reply.result.card.title == "Assistant help"

        # A plaintext client, or one trusting another CA, fails the handshake clearly.
        stranger = Authority(tmp_path / "other", "another CA")
        with pytest.raises(GatewayRefused) as untrusted:
            await _tls_client(chain, stranger.ca_file).connect(timeout=5)
        assert untrusted.value.code == grpc.StatusCode.UNAVAILABLE
        assert "CERTIFICATE_VERIFY_FAILED" in untrusted.value.details
        plaintext = GameServerClient(chain.gateway_target, chain.server_id, chain.token)
        chain._clients.append(plaintext)
        with pytest.raises(GatewayRefused) as clear:
            await plaintext.connect(timeout=5)
        assert clear.value.code == grpc.StatusCode.UNAVAILABLE

        # Renewal by another CA into the same files: new connections get the new certificate
        # with no restart, and the connection already open keeps working.
        renewed = Authority(tmp_path / "renewed", "renewing CA")
        renewed.issue("gateway", file_stem="gateway")
        pki.cert_file.write_bytes((tmp_path / "renewed" / "gateway.pem").read_bytes())
        pki.key_file.write_bytes((tmp_path / "renewed" / "gateway-key.pem").read_bytes())
        await client.leave("steve")
        await client.close()
        fresh = _tls_client(chain, renewed.ca_file)
        await fresh.connect()
        await fresh.join("alex", "Alex", "en_us")
        assert (await fresh.chat("alex", "help")).reply.result.card.title == "Assistant help"
        assert chain.apps["gateway"].host.public.tls.reloads == 1


async def test_mutual_tls_names_the_caller_by_its_certificate(tmp_path: Path) -> None:
    authority = Authority(tmp_path / "pki")
    server = authority.issue("localhost")
    engine = authority.issue("engine")
    wizard = authority.issue("wizard")
    config = _config(
        tls_cert_file=str(server.cert_file),
        tls_key_file=str(server.key_file),
        tls_client_ca_file=str(authority.ca_file),
    )
    host = ServiceHost(
        "whoami", config, [_register], [ECHO], access=AccessPolicy({ECHO: ["engine"]})
    )
    await host.start()
    try:
        tls = {"ca_file": str(authority.ca_file)}
        assert (
            await _call(
                host.target, cert_file=str(engine.cert_file), key_file=str(engine.key_file), **tls
            )
            == "engine"
        )
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await _call(
                host.target, cert_file=str(wizard.cert_file), key_file=str(wizard.key_file), **tls
            )
        assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "common name" in (unknown.value.details() or "")
        # No client certificate at all: the handshake itself is refused.
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await _call(host.target, **tls)
        assert anonymous.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await host.stop()


# --- keepalive -------------------------------------------------------------------------------------

# Every interval shortened 60×: clients ping every 0.5 s, servers accept pings every 0.3 s and
# ping idle peers every 1 s.
SHORT = KeepalivePolicy(
    client_seconds=0.5, permit_seconds=0.3, server_seconds=1.0, timeout_seconds=2.0
)
SHORT_SETTINGS = {
    "client_keepalive_seconds": SHORT.client_seconds,
    "permit_keepalive_seconds": SHORT.permit_seconds,
    "server_keepalive_seconds": SHORT.server_seconds,
    "keepalive_timeout_seconds": SHORT.timeout_seconds,
}
IDLE_SECONDS = 6.0  # twelve client ping intervals, six server ones


async def test_every_long_lived_stream_survives_idle_ping_intervals(tmp_path: Path) -> None:
    async with running_chain(tmp_path, credentials=True, every_service=SHORT_SETTINGS) as chain:
        client = GameServerClient(
            chain.gateway_target, chain.server_id, chain.token, keepalive=SHORT
        )
        chain._clients.append(client)
        welcome = await client.connect()
        await client.join("steve", "Steve", "en_us")
        # Opens the engine's journal stream (the run) and relay stream (the game tool).
        assert (
            await client.chat("steve", "/inventory")
        ).reply.result.status == common_pb2.RESULT_STATUS_SUCCEEDED
        engine = chain.apps["engine"]
        journal, relay = engine.runs._calls, engine.game_tools._calls
        assert (journal.streams_opened, relay.streams_opened) == (1, 1)

        await asyncio.sleep(IDLE_SECONDS)

        # The same game-server stream answers (the simulated server never reconnects), and
        # neither engine stream had to be reopened.
        assert (
            await client.chat("steve", "/inventory")
        ).reply.result.status == common_pb2.RESULT_STATUS_SUCCEEDED
        assert client.welcome is not None and client.welcome.session_id == welcome.session_id
        assert (journal.streams_opened, relay.streams_opened) == (1, 1)


async def test_gRPC_default_server_policy_would_end_the_idle_stream(tmp_path: Path) -> None:
    """The control: the same pings against servers that keep gRPC's default (one ping per
    5 minutes) end the game server's stream with GOAWAY too_many_pings, so the test above
    can fail."""
    strict = {
        **SHORT_SETTINGS,
        "permit_keepalive_seconds": 300.0,
        "client_keepalive_seconds": 300.0,
    }
    async with running_chain(tmp_path, every_service=strict) as chain:
        client = GameServerClient(
            chain.gateway_target, chain.server_id, chain.token, keepalive=SHORT
        )
        chain._clients.append(client)
        await client.connect()
        await client.join("steve", "Steve", "en_us")
        # Within the idle time the test above survives, the servers end the stream.
        await asyncio.wait_for(client.wait_closed(), IDLE_SECONDS)
        with pytest.raises(Exception):  # noqa: B017 - any failure: the stream is gone
            await client.chat("steve", "help", timeout=3)


def test_the_policy_is_written_down_for_plugin_authors() -> None:
    """The numbers plugin authors are told are the numbers the servers use."""
    policy = KeepalivePolicy()
    assert (policy.client_seconds, policy.permit_seconds) == (30.0, 20.0)
    options = dict(policy.server_options())
    assert options["grpc.http2.min_recv_ping_interval_without_data_ms"] == 20_000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    # The clients' own options send pings every 30 s, also with no call open.
    client = dict(policy.channel_options())
    assert client["grpc.keepalive_time_ms"] == 30_000
    assert client["grpc.keepalive_permit_without_calls"] == 1


async def test_aged_connections_are_replaced_so_clients_find_new_replicas() -> None:
    host = ServiceHost(
        "whoami",
        _config(max_connection_age_seconds=0.5, max_connection_age_grace_seconds=0.2),
        [_register],
        [ECHO],
    )
    await host.start()
    channel = open_channel(host.target)
    try:
        peer = channel.unary_unary(f"/{ECHO}/Peer")
        first = await peer(b"", timeout=5)

        async def another_connection() -> bool:
            return await peer(b"", timeout=5) != first

        # The old connection is closed once aged (0.5 s, then 0.2 s of grace); the channel
        # makes a new one (another client port).
        await wait_until(another_connection, timeout=1.5, interval=0.05, what="a new connection")
    finally:
        await channel.close()
        await host.stop()
