"""The whole request path in one process: storage (SQLite file), engine, router and gateway,
each a real grpc.aio server on a free loopback port, started dependencies first.

    async with running_chain(tmp_path) as chain:
        client = await chain.client()          # connected GameServerClient for `chain.server_id`
        await client.join("steve", "Steve", "zh_cn")
        response = await client.chat("steve", "帮助")

Test files wrap it in a pytest fixture: `async with running_chain(tmp_path) as chain: yield chain`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from system.gateway.v1 import gateway_pb2
from system.relay.v1 import relay_pb2_grpc
from system.storage.v1 import storage_pb2_grpc

from engine_service.app import create_app as create_engine
from engine_service.config import EngineConfig
from engine_service.task_store import TaskStore
from router_service.app import create_app as create_router
from router_service.config import RouterConfig
from services.gamesim.client import GameServerClient
from services.gamesim.world import World
from services.gateway.app import create_app as create_gateway
from services.gateway.config import GatewayConfig
from services.model_gateway.app import create_app as create_model_gateway
from services.model_gateway.config import ModelConfig
from services.model_testserver import FakeOpenAIServer
from services.runtime.interceptors import client_interceptors
from services.runtime.security import CALLERS
from services.runtime.server import ServiceHost
from services.stack.launcher import free_port
from storage_service.app import create_app as create_storage
from storage_service.config import StorageConfig

__all__ = ["Chain", "CutOffClient", "card_lines", "internal_target", "running_chain"]

SERVER_ID = "sim"
# Every service in tests: any free port, no metrics endpoint, no drain, a short grace.
_HOST = {"port": 0, "metrics_port": -1, "drain_seconds": 0, "grace_seconds": 1}


@dataclasses.dataclass
class Chain:
    """The running services, their targets and what tests need to talk to them."""

    apps: dict[str, Any]
    token: str
    credentials: dict[str, str] = dataclasses.field(default_factory=dict)
    """Service credentials by caller name (`engine`, `operator`, ...) when the chain was started
    with them; empty: every service accepts any local caller."""
    server_id: str = SERVER_ID
    _clients: list[GameServerClient] = dataclasses.field(default_factory=list)
    _channels: list[grpc.aio.Channel] = dataclasses.field(default_factory=list)
    _stopped: set[str] = dataclasses.field(default_factory=set)
    _restart: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Per service, how to start it again on its port (`restart`)."""

    def target(self, name: str) -> str:
        return self.apps[name].host.target

    @property
    def gateway_target(self) -> str:
        return self.target("gateway")

    @property
    def router_target(self) -> str:
        return self.target("router")

    @property
    def engine_target(self) -> str:
        return self.target("engine")

    @property
    def storage_target(self) -> str:
        return self.target("storage")

    def new_client(
        self,
        server_id: str | None = None,
        token: str | None = None,
        *,
        gateway: str = "gateway",
        kind: type[GameServerClient] = GameServerClient,
    ) -> GameServerClient:
        """A GameServerClient (not connected; of class `kind`) closed with the chain, for the
        public port of `gateway` (`gateway_b`, ... with `gateway_replicas`)."""
        client = kind(
            self.target(gateway),
            self.server_id if server_id is None else server_id,
            self.token if token is None else token,
        )
        self._clients.append(client)
        return client

    async def client(
        self,
        server_id: str | None = None,
        token: str | None = None,
        *,
        gateway: str = "gateway",
        kind: type[GameServerClient] = GameServerClient,
    ) -> GameServerClient:
        """A connected GameServerClient (welcome received; of class `kind`), closed with the
        chain."""
        client = self.new_client(server_id, token, gateway=gateway, kind=kind)
        await client.connect()
        return client

    async def steve_and_alex(self, world: World | None = None) -> GameServerClient:
        """A connected client over `world` (a fresh one by default) whose hello drew no tool
        problems, with Steve (zh) and Alex (en) joined."""
        client = self.new_client()
        client.world = world or World()
        welcome = await client.connect()
        assert list(welcome.tool_problems) == []
        await client.join("steve", "Steve", "zh_cn")
        await client.join("alex", "Alex", "en_us")
        return client

    async def cut_off_client(self) -> CutOffClient:
        """A connected CutOffClient over a fresh world, with Steve (zh) and Alex (en) joined."""
        client = CutOffClient(self.gateway_target, self.server_id, self.token)
        self._clients.append(client)
        await client.connect()
        await client.join("steve", "Steve", "zh_cn")
        await client.join("alex", "Alex", "en_us")
        return client

    def channel(self, name: str) -> grpc.aio.Channel:
        """A plain channel to a service, closed with the chain."""
        channel = grpc.aio.insecure_channel(self.target(name))
        self._channels.append(channel)
        return channel

    def storage_stub(self) -> storage_pb2_grpc.StorageServiceStub:
        return storage_pb2_grpc.StorageServiceStub(self.channel("storage"))

    def relay_stub(self) -> relay_pb2_grpc.ToolRelayServiceStub:
        """A stub on the gateway's internal port, with the engine's credential when the chain
        has credentials."""
        metadata = (
            (("authorization", f"Bearer {self.credentials['engine']}"),) if self.credentials else ()
        )
        channel = grpc.aio.insecure_channel(
            internal_target(self.apps["gateway"].host),
            interceptors=client_interceptors(metadata=lambda: metadata),
        )
        self._channels.append(channel)
        return relay_pb2_grpc.ToolRelayServiceStub(channel)

    def auth(self) -> tuple[tuple[str, str], ...]:
        """The metadata a game server sends."""
        return (("authorization", f"Bearer {self.token}"),)

    async def health(self, name: str, service: str = "") -> int:
        """The health status (`HealthCheckResponse.ServingStatus`) of a service."""
        stub = health_pb2_grpc.HealthStub(self.channel(name))
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return reply.status

    async def stop(self, name: str) -> None:
        """Stops one service early (the chain's exit skips it)."""
        if name in self._stopped:
            return
        self._stopped.add(name)
        app = self.apps[name]
        await app.host.stop()
        await app.aclose()

    async def restart(self, name: str) -> None:
        """Stops a service (if it runs) and starts a new one on the same port with the same
        settings: a crashed process come back. Storage keeps its database file."""
        port = int(self.target(name).rpartition(":")[2])
        await self.stop(name)
        create, config = self._restart[name]
        app = await create(dataclasses.replace(config, port=port))
        await app.host.start()
        self.apps[name] = app
        self._stopped.discard(name)

    async def _close(self) -> None:
        for client in reversed(self._clients):
            with contextlib.suppress(Exception):
                await client.close()
        for channel in self._channels:
            await channel.close()
        # The engines and the model gateway first: their streams to a gateway's relay would
        # otherwise hold its stop for the whole grace (a second per gateway, per test).
        names = list(reversed(list(self.apps)))
        dialers = [name for name in names if name.startswith("engine") or name == "model"]
        for name in dialers + [name for name in names if name not in dialers]:
            await self.stop(name)


@contextlib.asynccontextmanager
async def running_chain(
    tmp_path: pathlib.Path,
    *,
    credentials: bool = False,
    every_service: dict[str, Any] | None = None,
    engine_settings: dict[str, Any] | None = None,
    router_settings: dict[str, Any] | None = None,
    model: FakeOpenAIServer | None = None,
    model_settings: dict[str, Any] | None = None,
    gateway_replicas: int = 1,
    **gateway_overrides: Any,
) -> AsyncIterator[Chain]:
    """Starts storage, engine, router and gateway; stops them in reverse order on exit.

    With `credentials`, every service requires service credentials and holds its own, as
    in production (services.runtime.security); `chain.credentials` has them all.
    `every_service` holds settings given to all four (keepalive intervals, say);
    `engine_settings` the engine's own (its `advancements_file`, say), `router_settings` the
    router's (its `semantic_config`). With `model` (a running FakeOpenAIServer), a model gateway
    in front of it serves the engine and the router (`chain.apps["model"]`); without, their
    model target is a closed port; `model_settings` are that model gateway's own (its
    `providers_file`, say).
    """
    common = every_service or {}
    token = secrets.token_urlsafe(16)
    apps: dict[str, Any] = {}
    minted = {name: secrets.token_urlsafe(24) for name in CALLERS} if credentials else {}
    chain = Chain(apps, token, minted)

    def auth(name: str) -> dict[str, Any]:
        if not minted:
            return dict(common)
        return {
            **common,
            "service_token": minted[name],
            "caller_tokens": tuple(f"{caller}={tok}" for caller, tok in minted.items()),
        }

    try:
        storage_config = StorageConfig(
            **_HOST, **auth("storage"), database_url=f"sqlite:///{tmp_path / 'storage.db'}"
        )
        chain._restart["storage"] = (create_storage, storage_config)
        storage = await create_storage(storage_config)
        apps["storage"] = storage
        await storage.host.start()
        model_target = "127.0.0.1:1"
        # The engine and the model gateway must know the gateway's address before the gateway
        # starts (game tools and notices go to it); channels connect lazily, so a port chosen
        # up front is enough.
        relay_ports = [free_port() for _ in range(gateway_replicas)]
        if model is not None:
            own = {
                "max_attempts": 1,
                "relay_target": f"127.0.0.1:{relay_ports[0]}",  # budget alerts to admins
                **(model_settings or {}),
            }
            if "providers_file" not in own:  # else the file names the providers and keys
                own.update(base_url=model.base_url, api_key=model.api_key)
            model_config = ModelConfig(
                **_HOST, **auth("model"), storage_target=storage.host.target, **own
            )
            chain._restart["model"] = (create_model_gateway, model_config)
            apps["model"] = await create_model_gateway(model_config)
            await apps["model"].host.start()
            model_target = apps["model"].host.target

        router_port = free_port()
        engine_config = EngineConfig(
            **_HOST,
            **auth("engine"),
            **{"model_target": model_target, **(engine_settings or {})},
            storage_target=storage.host.target,
            gateway_target=f"127.0.0.1:{relay_ports[-1]}",
            router_target=f"127.0.0.1:{router_port}",
        )
        chain._restart["engine"] = (create_engine, engine_config)
        engine = await create_engine(engine_config)
        apps["engine"] = engine
        await engine.host.start()

        router = await create_router(
            RouterConfig(
                **{**_HOST, "port": router_port},
                **auth("router"),
                **{
                    "model_target": model_target,
                    # The intent cache every router replica shares (decision 0024).
                    "storage_target": storage.host.target,
                    **(router_settings or {}),
                },
                engine_target=engine.host.target,
            )
        )
        apps["router"] = router
        await router.host.start()

        for index, relay_port in enumerate(relay_ports):
            name = "gateway" if index == 0 else f"gateway_{chr(ord('a') + index)}"
            config = GatewayConfig(
                **_HOST,
                **auth("gateway"),
                internal_port=relay_port,
                router_target=router.host.target,
                engine_target=engine.host.target,
                storage_target=storage.host.target,
                tokens=(f"{SERVER_ID}={token}",),
                **gateway_overrides,
            )
            config.validate()
            chain._restart[name] = (create_gateway, config)
            gateway = await create_gateway(config)
            apps[name] = gateway
            await gateway.host.start()
        yield chain
    finally:
        await chain._close()


@contextlib.asynccontextmanager
async def task_store(tmp_path: pathlib.Path, **config: Any) -> AsyncIterator[TaskStore]:
    """The engine's TaskStore over a storage service of its own on SQLite (`config`: more
    StorageConfig fields), on loopback; stopped at the end."""
    storage = await create_storage(
        StorageConfig(
            port=0,
            metrics_port=-1,
            drain_seconds=0,
            grace_seconds=1,
            database_url=f"sqlite:///{tmp_path / 'storage.db'}",
            **config,
        )
    )
    await storage.host.start()
    tasks = TaskStore(storage.host.target)
    try:
        yield tasks
    finally:
        await tasks.aclose()
        await storage.host.stop()
        await storage.aclose()


class HoldingClient(GameServerClient):
    """A game server that records the tool calls it gets and, for players in `hold`, never
    answers them (the request stays in progress until something ends it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str]] = []
        self.hold: set[str] = set()
        self.held = asyncio.Event()
        self.answer: dict[str, Any] | None = None
        """When set, every tool call is answered with this output instead of the world's."""

    def _run_tool(self, call: gateway_pb2.ToolCall) -> gateway_pb2.ConnectRequest:
        self.calls.append((call.player_id, call.tool))
        if call.player_id in self.hold:
            self.held.set()
            return None  # type: ignore[return-value]
        if self.answer is not None:
            result = gateway_pb2.ToolResult(call_id=call.call_id)
            result.output.update(self.answer)
            return gateway_pb2.ConnectRequest(tool_result=result)
        return super()._run_tool(call)

    async def send(self, frame: gateway_pb2.ConnectRequest) -> None:
        if frame is not None:
            await super().send(frame)


class CutOffClient(GameServerClient):
    """A game server whose answer to the next call of one tool is held back while `interrupt`
    (stopping or restarting a service) runs: the call is applied on the game thread, and then
    the engine or the storage goes away. With `drop` the answer is never sent, as when the
    engine that asked died."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cut: tuple[str, Callable[[], Awaitable[None]], bool] | None = None
        self._calls: dict[str, str] = {}

    def cut_off(self, tool: str, interrupt: Callable[[], Awaitable[None]], drop: bool) -> None:
        """Arms the cut-off for the next call of `tool`."""
        self._cut = (tool, interrupt, drop)

    def _run_tool(self, call: gateway_pb2.ToolCall) -> gateway_pb2.ConnectRequest:
        self._calls[call.call_id] = call.tool
        return super()._run_tool(call)

    async def send(self, frame: gateway_pb2.ConnectRequest) -> None:
        cut = self._cut
        if cut is not None and frame.WhichOneof("frame") == "tool_result":
            tool, interrupt, drop = cut
            if self._calls.get(frame.tool_result.call_id) == tool:
                self._cut = None
                # Off the reader task, which must go on reading while the service goes away.
                asyncio.get_running_loop().create_task(interrupt())
                # Not a wait for a condition: a game server answering late, its answer held
                # while the service goes away.
                await asyncio.sleep(0.5)
                if drop:
                    return
        await super().send(frame)


def internal_target(host: ServiceHost) -> str:
    """`host:port` of the host's internal port that clients on this machine can dial (the
    address `target` dials, with the internal port)."""
    return f"{host.target.rpartition(':')[0]}:{host.internal_port}"


def card_lines(response: gateway_pb2.PlayerResponse) -> list[str]:
    """The text lines of a reply's card."""
    return [line.text for line in response.reply.result.card.lines]
