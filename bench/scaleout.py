"""Scale-out on one machine: two replicas of every service, one of each killed in turn.

    python -m bench.scaleout [--quick] [--seconds 20] [--players 24] [--servers 4]
                             [--kill gateway,router,engine,storage] [--out DIR] [--logs DIR]

Starts, as separate processes on loopback: two storage replicas on one fresh PostgreSQL
database (BENCH_POSTGRES_DSN, else TEST_POSTGRES_DSN, else the local server; dropped at the
end), the model gateway (its upstream the project's local OpenAI-compatible test server,
run in this process), two engines, two routers and two gateways. Every client reaches a
service's replicas through one `ipv4:127.0.0.1:p1,127.0.0.1:p2` target (round robin,
decision 0022); the gateways advertise their internal ports in storage's presence
(decision 0023) and the engines have stable replica ids (decision 0014).

Simulated game servers (half on each gateway) hold players who chat (`help`, `/inventory`)
and buy torches (quote, then a press of the confirm button), one action every
`PACE_SECONDS`; each game server also reports an advancement (`mine_diamond`: an event task
with two journaled `item.give` steps) for a fresh player every `EVENT_SECONDS`. After a
steady phase, each phase SIGKILLs replica 0 of one service (gateway, router, engine,
storage in turn), restarts it on the same port after `DOWN_SECONDS`, and runs on.

Counted: requests served; per second, each replica's RPCs handled from its own Prometheus
counter (`grpc_server_handled_total`, health and the stream RPC itself left out); the
gateways' share is counted at the caller (players' requests are frames on a game server's
stream, not RPCs); errors players saw, by status, and whether a retry fixed them; event
tasks resumed (`attempts` > 1); and, at the simulated world, effects lost and applied twice
(gives per event player against its task's final state; torches charged against the
confirms players saw answered and the offers they pressed); and presses of cards shown before
a reconnect (decision 0030): `HOLD_LEAD_SECONDS` before the gateway kill, and again before
the moved game servers go home, the players of those game servers quote an offer and keep the
card unpressed, pressing it on the next connection (worked, refused as stale, or failed
otherwise), beside presses whose reconnect fell between quote and press. Results go to
bench/results/scaleout.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2
from system.storage.v1 import journal_pb2, journal_pb2_grpc

from bench.databases import database
from bench.machine import describe_machine
from services.gamesim import GameServerClient
from services.gamesim.client import FrameRefused, GatewayRefused
from services.gamesim.world import World
from services.model_testserver import FakeOpenAIServer, router_demo_reply
from services.stack import SERVICES, Stack
from services.stack.launcher import ROOT, _die_with_parent, free_port

__all__ = ["Options", "run"]

RESULTS = Path(__file__).resolve().parent / "results"
ITEM = "minecraft:torch"
RICH = 10**12
DIAMOND = "minecraft:story/mine_diamond"
REWARD = {"minecraft:diamond": 1, "minecraft:experience_bottle": 5}
"""What the `mine_diamond` rule gives (engine_service/advancements.json): two give steps."""
PACE_SECONDS = 0.3
EVENT_SECONDS = 0.5
JOIN_LEAD = 4
"""An event player's advancement comes this many event ticks after they joined."""
DOWN_SECONDS = 3.0
SETTLE_SECONDS = 2.0
"""After a restart, seconds left out of the shares (clients reconnect with a backoff)."""
RETRY_PAUSES = (0.25, 0.5, 1.0, 1.0, 2.0, 2.0, 2.0)
"""A player's retries of a failed action: about 9 s in all, longer than a replica's restart."""
STALE_CARD = "system.error.stale_card"
HOLD_LEAD_SECONDS = 3.0
"""Before a gateway is killed (and before the game servers it lost move home), the players on
its game servers quote an offer and keep the card on screen this long, unpressed; they press
it after the reconnect (decision 0030: the card book is in storage)."""
HOLD_MAX_SECONDS = 20.0
"""A held card is pressed after this long even if its game server never reconnected."""
WORKED, STALE, FAILED = "worked", "refused as stale", "failed otherwise"
KILL_ORDER = ("gateway", "router", "engine", "storage")
GATEWAY_UNAVAILABLE = "UNAVAILABLE (as module_failed)"
"""The gateway answers a dependency's UNAVAILABLE as `system.error.module_failed` with this
message (services/gateway/players.py `rpc_failure`; its log names the status)."""
ACCEPTABLE = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", GATEWAY_UNAVAILABLE}
"""Statuses players may see if a retry fixed them."""
_FAILURE_STATUS = {
    "system.error.busy": "RESOURCE_EXHAUSTED",
    "system.error.storage_unavailable": "UNAVAILABLE",
    "system.error.model_unavailable": "UNAVAILABLE",
    "system.error.tool_unavailable": "UNAVAILABLE",
    "system.error.timeout": "DEADLINE_EXCEEDED",
}
_SPEC = {spec.name: spec for spec in SERVICES}


@dataclasses.dataclass(frozen=True)
class Options:
    """What one run does."""

    seconds: float = 20.0
    """Length of each phase (the steady one, then one per killed service)."""
    players: int = 24
    """Chatting and buying players, over all game servers."""
    servers: int = 4
    """Simulated game servers, half on each gateway at the start."""
    kill: tuple[str, ...] = KILL_ORDER
    """Services of which replica 0 is killed, one per phase, in this order."""
    down_seconds: float = DOWN_SECONDS
    """How long a killed replica stays down."""


# -- processes ---------------------------------------------------------------------------


@dataclasses.dataclass
class Replica:
    """One service process: its environment is kept, so a restart is the same replica."""

    service: str
    index: int
    port: int
    metrics_port: int
    health_port: int
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def name(self) -> str:
        return f"{self.service}-{self.index}"

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", _SPEC[self.service].module],
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.starts += 1

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def healthy(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"{self.name} exited:\n" + "\n".join(tail))
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                answer = stub.Check(  # type: ignore[attr-defined]
                    health_pb2.HealthCheckRequest(service=_SPEC[self.service].health_name),
                    timeout=0.5,
                )
            except grpc.RpcError:
                return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not SERVING after {timeout:.0f} s")
            time.sleep(0.05)

    def handled(self) -> int | None:
        """RPCs this process handled since it started (None: not reachable now)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:  # noqa: S310 - loopback
                text = response.read().decode()
        except OSError:
            return None
        total = 0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != "grpc_server_handled_total":
                    continue
                service, method = sample.labels["grpc_service"], sample.labels["grpc_method"]
                if service.startswith("grpc.") or method == "MultiplexCalls":
                    continue  # health, reflection, and the stream itself (its calls count)
                total += int(sample.value)
        return total

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _targets(ports: list[int]) -> str:
    return "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)


class Cluster:
    """Two replicas of storage, engine, router and gateway and one model gateway."""

    def __init__(self, folder: Path, database_url: str, servers: dict[str, str]) -> None:
        self.folder = folder
        (folder / "logs").mkdir(parents=True, exist_ok=True)
        (folder / "run").mkdir(parents=True, exist_ok=True)
        (folder / "config").mkdir(parents=True, exist_ok=True)
        self.stack = Stack(folder, extra_env={})  # tokens and each service's base environment
        self.model_key = secrets.token_urlsafe(24)
        self.fake = FakeOpenAIServer(self.model_key, responder=router_demo_reply)
        ports = {s: [free_port(), free_port()] for s in ("storage", "engine", "router", "gateway")}
        ports["model"] = [free_port()]
        internal = [free_port(), free_port()]
        self.internal_ports = internal
        self.public_ports = ports["gateway"]
        tokens = ",".join(f"{server}={token}" for server, token in servers.items())
        targets = {
            "STORAGE_TARGET": _targets(ports["storage"]),
            "ENGINE_TARGET": _targets(ports["engine"]),
            "ROUTER_TARGET": _targets(ports["router"]),
            "MODEL_TARGET": _targets(ports["model"]),
        }
        self.storage_target = targets["STORAGE_TARGET"]
        self.replicas: dict[str, list[Replica]] = {}
        for service in ("storage", "model", "engine", "router", "gateway"):
            spec = _SPEC[service]
            p = spec.env_prefix
            for index, port in enumerate(ports[service]):
                env = self.stack._env(spec)
                # Every dependency the launcher names (whatever it adds later), balanced.
                for key in [k for k in env if k.startswith(p) and k.endswith("_TARGET")]:
                    dependency = key.removeprefix(p).removesuffix("_TARGET").lower()
                    if dependency == "gateway":
                        env[key] = _targets(internal)
                    elif dependency in ports:
                        env[key] = _targets(ports[dependency])
                metrics = free_port()
                env.update(
                    {
                        f"{p}PORT": str(port),
                        f"{p}METRICS_PORT": str(metrics),
                        f"{p}PORT_FILE": str(folder / "run" / f"{service}-{index}.json"),
                        f"{p}LOG_LEVEL": "WARNING",
                    }
                )
                health = port
                if service == "storage":
                    env[f"{p}DATABASE_URL"] = database_url
                elif service == "model":
                    env.update(
                        {
                            f"{p}STORAGE_TARGET": targets["STORAGE_TARGET"],
                            f"{p}BASE_URL": self.fake.base_url,
                            f"{p}API_KEY": self.model_key,
                            f"{p}API_KEY_FILE": "",
                        }
                    )
                elif service == "engine":
                    env.update({f"{p}{k}": v for k, v in targets.items() if k != "ENGINE_TARGET"})
                    env[f"{p}GATEWAY_TARGET"] = _targets(internal)
                    env[f"{p}REPLICA_ID"] = f"engine-{index}"
                elif service == "router":
                    env[f"{p}ENGINE_TARGET"] = targets["ENGINE_TARGET"]
                    env[f"{p}MODEL_TARGET"] = targets["MODEL_TARGET"]
                    env[f"{p}SEMANTIC_CONFIG"] = str(
                        folder / "config" / f"system-semantic-{index}.json"
                    )
                else:  # gateway
                    env.update(
                        {
                            f"{p}ROUTER_TARGET": targets["ROUTER_TARGET"],
                            f"{p}ENGINE_TARGET": targets["ENGINE_TARGET"],
                            f"{p}STORAGE_TARGET": targets["STORAGE_TARGET"],
                            f"{p}TOKENS": tokens,
                            f"{p}INTERNAL_PORT": str(internal[index]),
                            f"{p}INTERNAL_ADVERTISE": f"127.0.0.1:{internal[index]}",
                            f"{p}REPLICA_NAME": f"gateway-{index}",
                            f"{p}PRESENCE_LEASE_SECONDS": "3",
                        }
                    )
                    health = internal[index]
                replica = Replica(
                    service,
                    index,
                    port,
                    metrics,
                    health,
                    env,
                    folder / "logs" / f"{service}-{index}.log",
                )
                self.replicas.setdefault(service, []).append(replica)

    def credential(self, caller: str) -> tuple[tuple[str, str], ...]:
        return self.stack.credential(caller)

    def start(self) -> float:
        began = time.perf_counter()
        self.fake.start()
        # The first storage replica makes the schema alone; then every other process at once.
        first = self.replicas["storage"][0]
        first.start()
        first.wait_healthy()
        rest = [r for rs in self.replicas.values() for r in rs if r is not first]
        for replica in rest:
            replica.start()
        for replica in rest:
            replica.wait_healthy()
        return time.perf_counter() - began

    def stop(self) -> None:
        for service in ("gateway", "router", "engine", "model", "storage"):
            for replica in self.replicas.get(service, []):
                replica.stop()
        self.fake.stop()


# -- the game side -----------------------------------------------------------------------


class Game(GameServerClient):
    """The simulated game server's connection, recording the writes it ran."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.charged: Counter[str] = Counter()
        """Orders charged (not replayed), by player."""

    def _run_tool(self, call: gateway_pb2.ToolCall) -> gateway_pb2.ConnectRequest:
        frame = super()._run_tool(call)
        if call.tool == "minecraft:shop.buy" and frame.tool_result.HasField("output"):
            output = frame.tool_result.output
            replayed = "replayed" in output.fields and output.fields["replayed"].bool_value
            if not replayed and "order_id" in output.fields:
                self.charged[call.player_id] += 1
        return frame


@dataclasses.dataclass
class Player:
    player_id: str
    name: str
    actions: int = 0
    presses: int = 0
    """Confirm buttons of distinct offers pressed."""
    confirmed: int = 0
    """Confirms answered SUCCEEDED."""
    held: Held | None = None
    """A quoted card kept on screen, to be pressed after the next reconnect."""
    held_round: int = 0
    """The last hold round (GameServer.hold_round) this player took part in."""


@dataclasses.dataclass(frozen=True)
class Held:
    """A card shown on one connection, kept to be pressed on a later one."""

    card: common_pb2.Card
    generation: int
    """The game server's connection (GameServer.generation) the card was shown on."""
    gateway: int
    shown_at: float
    """Seconds since the run began."""
    reason: str
    """What was about to end the connection: `SIGKILL gateway-0` or `move home`."""


class Recorder:
    """Per-second counts of what players were served, and the errors they saw."""

    def __init__(self) -> None:
        self.began = time.monotonic()
        self.served: Counter[tuple[int, str]] = Counter()
        """(second, gateway replica) -> player requests answered."""
        self.errors: Counter[tuple[int, str]] = Counter()
        self.first_errors: Counter[str] = Counter()
        """Every failed attempt, by status (or failure key)."""
        self.fixed: Counter[str] = Counter()
        """Failed attempts a later retry of the same action fixed, by the first status."""
        self.unfixed: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}
        self.carried: Counter[tuple[str, str]] = Counter()
        """Presses of a card shown on an earlier connection of the game server, by (how the
        card got there: held / in flight, outcome: worked / refused as stale / failed)."""
        self.carried_by_reason: Counter[tuple[str, str]] = Counter()
        """Held cards' presses by (what ended the connection, outcome)."""
        self.carried_examples: list[str] = []

    def second(self) -> int:
        return int(time.monotonic() - self.began)


def _status(exc: BaseException) -> str:
    if isinstance(exc, FrameRefused | GatewayRefused):
        return exc.code.name if exc.code != grpc.StatusCode.OK else "UNAVAILABLE"
    if isinstance(exc, TimeoutError):
        return "DEADLINE_EXCEEDED"
    if isinstance(exc, asyncio.InvalidStateError):
        # Written on a stream that had just ended (a gateway killed), before keep_connected
        # saw the end: the request never left, as a plugin finds its connection down.
        return "UNAVAILABLE"
    return type(exc).__name__


class _Failed(Exception):
    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status


def _check(response: gateway_pb2.PlayerResponse) -> gateway_pb2.PlayerResponse:
    if response.WhichOneof("body") != "reply":
        raise _Failed("NO_REPLY", str(response)[:200])
    result = response.reply.result
    if result.status != common_pb2.RESULT_STATUS_SUCCEEDED:
        key = result.failure.key or "system.error.module_failed"
        if (
            key == "system.error.module_failed"
            and "unavailable right now" in result.failure.message
        ):
            raise _Failed(GATEWAY_UNAVAILABLE, f"{key}: {result.failure.message}"[:200])
        raise _Failed(_FAILURE_STATUS.get(key, key), f"{key}: {result.failure.message}"[:200])
    return response


class _Stale(Exception):
    def __init__(self, failures: list[str]) -> None:
        super().__init__(failures[-1])
        self.failures = failures


class GameServer:
    """One simulated game server: a World, its players, and a connection it keeps up,
    reconnecting (to its home gateway first, then the other) when the stream ends."""

    def __init__(
        self, server_id: str, token: str, home: int, cluster: Cluster, recorder: Recorder
    ) -> None:
        self.server_id = server_id
        self.token = token
        self.home = home
        self.cluster = cluster
        self.recorder = recorder
        self.world = World()
        self.world.shop.listings[ITEM].stock = RICH
        self.players: list[Player] = []
        self.event_players: list[str] = []
        """Players whose advancement was reported (one event task each)."""
        self.joined_ahead: list[str] = []
        """Every event player joined, including those whose advancement is still to come."""
        self.sent_events: dict[str, float] = {}
        self.client: Game | None = None
        self.on: int = home
        self.generation = 0
        """Counts the connections made: a card is from an earlier one if its number is lower."""
        self.hold_round = 0
        """Raised by the driver: each player then quotes once and keeps the card (Held)."""
        self.hold_reason = ""
        self.connected = asyncio.Event()
        self.reconnects = 0
        self.events_resent = 0
        self._errors_seen = 0
        self._stopping = False
        self.charged: Counter[str] = Counter()

    def _client(self, gateway: int) -> Game:
        target = f"127.0.0.1:{self.cluster.public_ports[gateway]}"
        return Game(target, self.server_id, self.token, self.world)

    async def connect(self, first: int) -> None:
        order = [first, 1 - first]
        attempt = 0
        while True:
            gateway = order[attempt % 2]
            client = self._client(gateway)
            try:
                await client.connect(timeout=5)
            except (GatewayRefused, TimeoutError, grpc.aio.AioRpcError):
                attempt += 1
                await asyncio.sleep(0.2)
                continue
            break
        if self.client is not None:
            self.charged.update(self.client.charged)
        self.client, self.on = client, gateway
        self.generation += 1
        self._errors_seen = 0
        for player in self.players:
            await client.join(player.player_id, player.name, "en_us")
        for player_id in self.joined_ahead:
            await client.join(player_id, player_id, "en_us")
        self.connected.set()

    async def keep_connected(self) -> None:
        while not self._stopping:
            assert self.client is not None
            await self.client.wait_closed()
            if self._stopping:
                return
            self.connected.clear()
            lost = time.monotonic()
            self.reconnects += 1
            await self.connect(self.home)
            # Events sent just before the stream ended may never have reached the engine:
            # resend them with the same key (SubmitEvent returns the tasks already made).
            for player_id, sent in list(self.sent_events.items()):
                if sent > lost - 10:
                    await self._send_event(player_id)
                    self.events_resent += 1

    async def move_home(self) -> None:
        """Back to the home gateway (after it was restarted), as an operator rebalancing."""
        if self.on == self.home or self.client is None:
            return
        self.connected.clear()
        # Closing ends keep_connected's wait on this connection: it reconnects home, and
        # connect() takes over what the old connection charged. The stream ends before close()
        # returns, so the new connection may be up by then: self.client is connect()'s alone.
        await self.client.close()

    async def _send_event(self, player_id: str) -> None:
        assert self.client is not None
        await self.client.event(
            player_id, "minecraft:advancement", f"bench:{player_id}", {"advancement": DIAMOND}
        )

    async def resend_refused_events(self) -> None:
        """Events the gateway refused with a FrameError are resent with their key."""
        client = self.client
        if client is None:
            return
        new = client.frame_errors[self._errors_seen :]
        self._errors_seen = len(client.frame_errors)
        for error in new:
            player_id = error.request_id.removeprefix("bench:")
            if player_id in self.sent_events:
                self.events_resent += 1
                with contextlib.suppress(Exception):
                    await self._send_event(player_id)

    async def events(self, stop_at: float) -> None:
        """Each tick a new player joins, and the one who joined `JOIN_LEAD` ticks before
        earns the advancement (a player earns one while playing, not at the join)."""
        joined = 0
        while time.monotonic() < stop_at:
            await asyncio.sleep(EVENT_SECONDS)
            await self.connected.wait()
            assert self.client is not None
            player_id = f"ev-{self.server_id}-{joined:05d}"
            joined += 1
            self.joined_ahead.append(player_id)
            with contextlib.suppress(Exception):  # the stream ended: the rejoin covers it
                await self.client.join(player_id, player_id, "en_us")
            if len(self.joined_ahead) <= JOIN_LEAD:
                continue
            earner = self.joined_ahead[-JOIN_LEAD - 1]
            self.event_players.append(earner)
            self.sent_events[earner] = time.monotonic()
            with contextlib.suppress(Exception):  # the stream ended: resent on reconnect
                await self._send_event(earner)
            await self.resend_refused_events()

    async def _attempt(
        self,
        action: str,
        call: Callable[[Game], Awaitable[gateway_pb2.PlayerResponse]],
        used: list[int] | None = None,
    ) -> Any:
        """One action, retried while it fails: returns the response. `used` gets the
        connection (generation) of each attempt."""
        failures: list[str] = []
        for attempt in range(len(RETRY_PAUSES) + 1):
            await self.connected.wait()
            sent = self.recorder.second()
            client, gateway = self.client, self.on
            assert client is not None
            if used is not None:
                used.append(self.generation)
            try:
                response = _check(await call(client))
            except (
                FrameRefused,
                GatewayRefused,
                TimeoutError,
                asyncio.InvalidStateError,
                _Failed,
            ) as exc:
                status = exc.status if isinstance(exc, _Failed) else _status(exc)
                failures.append(status)
                self.recorder.first_errors[status] += 1
                self.recorder.errors[(self.recorder.second(), status)] += 1
                examples = self.recorder.examples.setdefault(status, [])
                if len(examples) < 3:
                    examples.append(
                        f"{action} sent at {sent} s on gateway-{gateway}, failed at "
                        f"{self.recorder.second()} s: {str(exc)[:200]}"
                    )
                if status == STALE_CARD:
                    break  # the card is from before a reconnect: only asking again helps
                if attempt < len(RETRY_PAUSES):
                    await asyncio.sleep(RETRY_PAUSES[attempt])
                continue
            self.recorder.served[(self.recorder.second(), f"gateway-{gateway}")] += 1
            for status in failures:
                self.recorder.fixed[status] += 1
            return response
        if failures[-1] == STALE_CARD:
            raise _Stale(failures)
        for status in failures:
            self.recorder.unfixed[status] += 1
        return None

    async def play(self, player: Player, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            await asyncio.sleep(PACE_SECONDS)
            kind = player.actions % 3
            player.actions += 1
            if kind == 0:
                await self._attempt("help", lambda c: c.chat(player.player_id, "help", timeout=15))
            elif kind == 1:
                await self._attempt(
                    "/inventory", lambda c: c.chat(player.player_id, "/inventory", timeout=15)
                )
            elif player.held is not None:
                held = player.held
                waited = self.recorder.second() - held.shown_at
                if self.generation != held.generation or waited > HOLD_MAX_SECONDS:
                    player.held = None
                    await self._press_held(player, held)
                else:  # still on the connection that showed it: quoting would replace it
                    await self._attempt(
                        "help", lambda c: c.chat(player.player_id, "help", timeout=15)
                    )
            elif self.hold_round > player.held_round:
                player.held_round = self.hold_round
                await self._hold(player)
            else:
                await self._purchase(player)

    async def _hold(self, player: Player) -> None:
        """Quotes an offer and keeps its card on screen, unpressed."""
        generation, gateway = self.generation, self.on
        used: list[int] = []
        quoted = await self._attempt(
            "quote (held)", lambda c: c.chat(player.player_id, f"/buy {ITEM} 1", 15), used
        )
        if quoted is None or not quoted.reply.result.card.buttons:
            return
        if used[-1] != generation:  # answered on a later connection already
            generation, gateway = used[-1], self.on
        player.held = Held(
            quoted.reply.result.card,
            generation,
            gateway,
            time.monotonic() - self.recorder.began,
            self.hold_reason,
        )

    async def _press_held(self, player: Player, held: Held) -> None:
        card = held.card
        player.presses += 1
        used: list[int] = []
        outcome = FAILED
        try:
            done = await self._attempt(
                "confirm (held)", lambda c: c.press(player.player_id, card, card.buttons[0]), used
            )
        except _Stale as stale:
            outcome = STALE
            for status in stale.failures:
                self.recorder.unfixed[status] += 1
        else:
            if done is not None:
                player.confirmed += 1
                outcome = WORKED
        across = bool(used) and used[-1] != held.generation
        how = "held" if across else "held, no reconnect"
        self.recorder.carried[(how, outcome)] += 1
        self.recorder.carried_by_reason[(held.reason if across else "none", outcome)] += 1
        if outcome != WORKED and len(self.recorder.carried_examples) < 5:
            self.recorder.carried_examples.append(
                f"{player.player_id}: card v{card.ref.version} shown at {held.shown_at:.1f} s on "
                f"gateway-{held.gateway} (before {held.reason}), pressed at "
                f"{self.recorder.second()} s on gateway-{self.on}: {outcome}"
            )

    async def _purchase(self, player: Player) -> None:
        try:
            await self._purchase_once(player)
        except _Stale as stale:
            # The quote was made on the connection before a reconnect: ask for a new one,
            # as the card tells the player to.
            try:
                await self._purchase_once(player)
            except _Stale as again:
                stale.failures += again.failures
                for status in stale.failures:
                    self.recorder.unfixed[status] += 1
            else:
                for status in stale.failures:
                    self.recorder.fixed[status] += 1

    async def _purchase_once(self, player: Player) -> None:
        shown: list[int] = []
        quoted = await self._attempt(
            "quote", lambda c: c.chat(player.player_id, f"/buy {ITEM} 1", 15), shown
        )
        if quoted is None or not quoted.reply.result.card.buttons:
            return
        card = quoted.reply.result.card
        player.presses += 1
        used: list[int] = []
        try:
            done = await self._attempt(
                "confirm", lambda c: c.press(player.player_id, card, card.buttons[0]), used
            )
        except _Stale:
            if used[-1] != shown[-1]:
                self.recorder.carried[("in flight", STALE)] += 1
            raise
        if used[-1] != shown[-1]:  # the game server reconnected between quote and press
            self.recorder.carried[("in flight", WORKED if done is not None else FAILED)] += 1
        if done is not None:
            player.confirmed += 1

    async def stop(self) -> None:
        self._stopping = True
        if self.client is not None:
            self.charged.update(self.client.charged)
            self.client.charged.clear()
            await self.client.close()


# -- the run -----------------------------------------------------------------------------


class Sampler:
    """Every second, each replica's handled-RPC counter: calls per second per replica."""

    def __init__(self, cluster: Cluster, began: float) -> None:
        self.cluster = cluster
        self.began = began
        self.last: dict[str, tuple[float, int]] = {}
        self.rate: defaultdict[tuple[int, str], float] = defaultdict(float)

    def sample(self) -> None:
        for service in ("storage", "engine", "router"):
            for replica in self.cluster.replicas[service]:
                value = replica.handled()
                now = time.monotonic() - self.began
                if value is None:  # down: its counter starts from zero when it is back
                    self.last[replica.name] = (now, 0)
                    continue
                then, before = self.last.get(replica.name, (0.0, 0))
                delta = value - before if value >= before else value  # restarted: from zero
                self.last[replica.name] = (now, value)
                # Spread over the seconds since the last sample: a late sample (a busy
                # machine) leaves no second empty and none doubled.
                seconds = list(range(int(then) + 1, int(now) + 1)) or [int(now)]
                for second in seconds:
                    self.rate[(second, replica.name)] += delta / len(seconds)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.sample)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)


async def _tasks(cluster: Cluster, servers: list[GameServer]) -> dict[str, journal_pb2.EventTask]:
    """Each event player's task, read from storage with the engine's credential."""
    found: dict[str, journal_pb2.EventTask] = {}
    async with grpc.aio.insecure_channel(
        cluster.storage_target, options=[("grpc.service_config", _ROUND_ROBIN)]
    ) as channel:
        journal = journal_pb2_grpc.JournalServiceStub(channel)
        for server in servers:
            for player_id in server.event_players:
                listed = await journal.ListTasks(
                    journal_pb2.ListTasksRequest(player_id=f"{server.server_id}/{player_id}"),
                    timeout=10,
                    metadata=cluster.credential("engine"),
                )
                for task in listed.tasks:
                    found[f"{server.server_id}/{player_id}"] = task
    return found


_ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
_TERMINAL = {
    journal_pb2.TASK_STATE_SUCCEEDED,
    journal_pb2.TASK_STATE_FAILED,
    journal_pb2.TASK_STATE_PARTIALLY_SUCCEEDED,
}


def _log(text: str) -> None:
    print(f"[scaleout] {text}", file=sys.stderr, flush=True)


async def _drive(cluster: Cluster, servers: list[GameServer], options: Options) -> dict[str, Any]:
    recorder = Recorder()
    sampler = Sampler(cluster, recorder.began)
    stop = asyncio.Event()
    for server in servers:
        server.recorder = recorder
    per_server = max(options.players // len(servers), 1)
    for server in servers:
        server.players = [
            Player(f"p-{server.server_id}-{i:03d}", f"P{i}") for i in range(per_server)
        ]
        await server.connect(server.home)
    phases = ["steady", *options.kill]
    total = options.seconds * len(phases)
    stop_at = time.monotonic() + total
    sampling = asyncio.create_task(sampler.run(stop))
    work = [asyncio.create_task(s.keep_connected()) for s in servers]
    work += [asyncio.create_task(s.events(stop_at)) for s in servers]
    work += [asyncio.create_task(s.play(p, stop_at)) for s in servers for p in s.players]
    kills: list[dict[str, Any]] = []
    down: dict[str, list[tuple[float, float]]] = {}
    for number, phase in enumerate(phases):
        phase_end = recorder.began + options.seconds * (number + 1)
        if phase != "steady":
            replica = cluster.replicas[phase][0]
            if phase == "gateway":
                await _hold_cards([s for s in servers if s.on == 0], f"SIGKILL {replica.name}")
            killed = time.monotonic() - recorder.began
            _log(f"SIGKILL {replica.name} at {killed:.1f} s")
            replica.kill()
            await asyncio.sleep(options.down_seconds)
            restarted = time.monotonic() - recorder.began
            replica.start()
            await asyncio.to_thread(replica.wait_healthy)
            serving = time.monotonic() - recorder.began
            _log(f"{replica.name} restarted at {restarted:.1f} s, SERVING at {serving:.1f} s")
            if phase == "gateway":
                await _hold_cards([s for s in servers if s.on != s.home], "move home")
                for server in servers:
                    await server.move_home()
            kills.append(
                {
                    "replica": replica.name,
                    "killed_at_s": round(killed, 2),
                    "restarted_at_s": round(restarted, 2),
                    "serving_at_s": round(serving, 2),
                }
            )
            down.setdefault(phase, []).append((killed, serving + SETTLE_SECONDS))
        await asyncio.sleep(max(phase_end - time.monotonic(), 0))
    await asyncio.gather(*work[len(servers) :])  # players and events finish their last action
    ended = time.monotonic() - recorder.began
    # Drain: every task terminal (resending refused events), then the audit.
    drained_at = time.monotonic() + 60
    tasks: dict[str, journal_pb2.EventTask] = {}
    while time.monotonic() < drained_at:
        for server in servers:
            await server.resend_refused_events()
        tasks = await _tasks(cluster, servers)
        sent = sum(len(s.event_players) for s in servers)
        if len(tasks) == sent and all(t.state in _TERMINAL for t in tasks.values()):
            break
        await asyncio.sleep(0.5)
    stop.set()
    await sampling
    for server in servers:
        await server.stop()
    for task in work[: len(servers)]:
        task.cancel()
    await asyncio.gather(*work[: len(servers)], return_exceptions=True)
    return _results(cluster, servers, recorder, sampler, tasks, kills, down, ended, options)


async def _hold_cards(holding: list[GameServer], reason: str) -> None:
    """The players of `holding` each quote an offer and keep the card on screen; returns
    when they had the time to (HOLD_LEAD_SECONDS)."""
    for server in holding:
        server.hold_reason = reason
        server.hold_round += 1
    _log(f"{len(holding)} game servers' players hold a card before {reason}")
    await asyncio.sleep(HOLD_LEAD_SECONDS)


def _share_windows(
    seconds: int, down: dict[str, list[tuple[float, float]]], service: str
) -> list[int]:
    """Seconds in which both replicas of `service` were up and settled."""
    windows = down.get(service, [])
    return [s for s in range(seconds) if not any(a - 1 <= s <= b for a, b in windows)]


def _results(
    cluster: Cluster,
    servers: list[GameServer],
    recorder: Recorder,
    sampler: Sampler,
    tasks: dict[str, journal_pb2.EventTask],
    kills: list[dict[str, Any]],
    down: dict[str, list[tuple[float, float]]],
    ended: float,
    options: Options,
) -> dict[str, Any]:
    seconds = int(ended)
    per_replica: defaultdict[str, defaultdict[int, float]] = defaultdict(lambda: defaultdict(float))
    for (second, name), n in [*recorder.served.items(), *sampler.rate.items()]:
        per_replica[name][second] += n
    shares: dict[str, dict[str, Any]] = {}
    for service in ("gateway", "router", "engine", "storage"):
        window = _share_windows(seconds, down, service)
        counts = {
            f"{service}-{i}": round(sum(per_replica[f"{service}-{i}"][s] for s in window))
            for i in (0, 1)
        }
        total = sum(counts.values()) or 1
        shares[service] = {
            "counted_at": "caller (the game servers)" if service == "gateway" else "server",
            "seconds": len(window),
            "calls": counts,
            "share": {name: round(n / total, 3) for name, n in counts.items()},
            "each_at_least_30_percent": all(n / total >= 0.3 for n in counts.values()),
        }
    # Effects at the world: event gives and purchases.
    lost = twice = unknown = stuck = unknown_not_applied = 0
    unknown_tasks: list[dict[str, Any]] = []
    stuck_tasks: list[dict[str, Any]] = []
    other_tasks: list[dict[str, Any]] = []
    began_unix = time.time() - (time.monotonic() - recorder.began)
    lost_examples: list[str] = []
    for server in servers:
        for player_id in server.event_players:
            scoped = f"{server.server_id}/{player_id}"
            inventory = server.world.player(player_id).inventory
            applied = [inventory[item] // count for item, count in REWARD.items()]
            task = tasks.get(scoped)
            over = sum(max(a - 1, 0) for a in applied)
            twice += over
            if task is None or task.state not in _TERMINAL:
                stuck += 1
                stuck_tasks.append(
                    {
                        "player": scoped,
                        "task": task.task_id if task else None,
                        "state": journal_pb2.TaskState.Name(task.state) if task else None,
                        "attempts": task.attempts if task else None,
                        "applied": dict(zip(REWARD, applied, strict=True)),
                        "sent_at_s": round(server.sent_events[player_id] - recorder.began, 1),
                        "updated_at_s": round(task.updated_at.ToSeconds() - began_unix, 1)
                        if task
                        else None,
                        "result": str(task.result)[:300] if task else None,
                    }
                )
                continue
            if task.result.failure.key == "system.error.effect_unknown":
                unknown += 1
                unknown_tasks.append(
                    {
                        "player": scoped,
                        "attempts": task.attempts,
                        "applied": dict(zip(REWARD, applied, strict=True)),
                        "message": task.result.failure.message[:200],
                        "updated_at_s": round(task.updated_at.ToSeconds() - began_unix, 1),
                    }
                )
                unknown_not_applied += sum(1 for a in applied if a == 0)
                continue
            if task.state != journal_pb2.TASK_STATE_SUCCEEDED:
                # Failed another way: what the player was told, and what the world holds.
                other_tasks.append(
                    {
                        "player": scoped,
                        "state": journal_pb2.TaskState.Name(task.state),
                        "key": task.result.failure.key,
                        "message": task.result.failure.message[:200],
                        "attempts": task.attempts,
                        "applied": dict(zip(REWARD, applied, strict=True)),
                        "updated_at_s": round(task.updated_at.ToSeconds() - began_unix, 1),
                    }
                )
                continue
            missing = sum(1 for a in applied if a == 0)  # SUCCEEDED
            lost += missing
            if missing and len(lost_examples) < 5:
                lost_examples.append(f"{scoped}: SUCCEEDED, applied {applied}")
    purchases_lost = purchases_twice = 0
    for server in servers:
        for player in server.players:
            charged = server.charged[player.player_id]
            purchases_lost += max(player.confirmed - charged, 0)
            purchases_twice += max(charged - player.presses, 0)
    resumed = sum(1 for t in tasks.values() if t.attempts > 1)
    across = sum(
        1
        for t in tasks.values()
        if any(
            t.created_at.ToMilliseconds() / 1000 - began_unix
            <= k["killed_at_s"]
            < t.updated_at.ToMilliseconds() / 1000 - began_unix
            for k in kills
        )
    )
    # A task runs first on its claim (attempts 1); each later claim is a resumption after the
    # replica running it died (decision 0014) or its lease ended.
    states = Counter(journal_pb2.TaskState.Name(t.state) for t in tasks.values())
    served = sum(recorder.served.values())
    unacceptable = {s: n for s, n in recorder.unfixed.items()}
    unacceptable.update({s: n for s, n in recorder.fixed.items() if s not in ACCEPTABLE})
    timeline = {
        name: [round(per_replica[name][s], 1) for s in range(seconds + 1)]
        for name in sorted(per_replica)
    }
    errors_timeline = [
        sum(n for (s, _), n in recorder.errors.items() if s == second)
        for second in range(seconds + 1)
    ]
    by_status: dict[str, dict[int, int]] = {}
    for (second, status), n in sorted(recorder.errors.items()):
        by_status.setdefault(status, {})[second] = n
    carried, carried_by_reason = _nested(recorder.carried), _nested(recorder.carried_by_reason)
    return {
        "options": dataclasses.asdict(options),
        "cards_across_reconnects": {
            "presses": carried,
            "held_by_reason": carried_by_reason,
            "examples": recorder.carried_examples,
        },
        "seconds": round(ended, 1),
        "requests_served": served,
        "requests_per_s": round(served / max(ended, 1e-9), 1),
        "purchases_confirmed": sum(p.confirmed for s in servers for p in s.players),
        "events_sent": sum(len(s.event_players) for s in servers),
        "events_resent": sum(s.events_resent for s in servers),
        "reconnects": sum(s.reconnects for s in servers),
        "shares": shares,
        "errors": {
            "attempts_failed": dict(recorder.first_errors),
            "fixed_by_retry": dict(recorder.fixed),
            "not_fixed": dict(recorder.unfixed),
            "unacceptable": unacceptable,
            "examples": recorder.examples,
        },
        "tasks": {
            "states": dict(states),
            "resumed_after_kills": resumed,
            "in_flight_across_a_kill": across,
            "effect_unknown": unknown,
            "effect_unknown_gives_not_applied": unknown_not_applied,
            "effect_unknown_tasks": unknown_tasks,
            "attempts": {
                str(k): v for k, v in sorted(Counter(t.attempts for t in tasks.values()).items())
            },
            "not_terminal": stuck,
            "not_terminal_tasks": stuck_tasks,
            "failed_otherwise_tasks": other_tasks,
        },
        "effects": {
            "event_gives_lost": lost,
            "event_gives_applied_twice": twice,
            "purchases_lost": purchases_lost,
            "purchases_charged_twice": purchases_twice,
            "lost": lost + purchases_lost,
            "applied_twice": twice + purchases_twice,
            "lost_examples": lost_examples,
        },
        "kills": kills,
        "timeline": {
            "served_per_s": timeline,
            "errors_per_s": errors_timeline,
            "errors_by_status_per_s": by_status,
        },
    }


def _nested(counts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """(outer, inner) counts as {outer: {inner: count}}, sorted."""
    nested: dict[str, dict[str, int]] = {}
    for (outer, inner), n in sorted(counts.items()):
        nested.setdefault(outer, {})[inner] = n
    return nested


def run(database_url: str, folder: Path, options: Options) -> dict[str, Any]:
    """Starts the cluster on `database_url`, drives it, stops it; returns the results."""
    # Ids of this run alone: on a database an earlier run used, a reused event key would be
    # answered with that run's task (SubmitEvent returns the tasks a key already made), whose
    # gives went to the earlier run's world, and the audit would count them lost.
    run_id = secrets.token_hex(2)
    server_ids = [f"sim{i}-{run_id}" for i in range(options.servers)]
    tokens = {server: secrets.token_urlsafe(16) for server in server_ids}
    cluster = Cluster(folder, database_url, tokens)
    try:
        started = cluster.start()
        _log(f"cluster SERVING in {started:.1f} s")

        async def drive() -> dict[str, Any]:
            servers = [
                GameServer(server, tokens[server], i % 2, cluster, Recorder())
                for i, server in enumerate(server_ids)
            ]
            return await _drive(cluster, servers, options)

        results = asyncio.run(drive())
        results["startup_seconds"] = round(started, 1)
        return results
    finally:
        cluster.stop()


# -- report ------------------------------------------------------------------------------


def _markdown(report: dict[str, Any]) -> str:
    r = report["results"]
    m = report["machine"]
    lines = [
        "# Scale-out on one machine",
        "",
        f"Run {report['when']} on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB, "
        f"{m['os']}, Python {m['python']}), load average before {report['load_before']}, "
        f"after {report.get('load_after', '?')} (other work shares the machine). "
        f"Command: `{report['command']}`.",
        "",
        "Two replicas each of gateway, router, engine and storage (PostgreSQL), one model "
        "gateway, separate processes on loopback; clients balance over `ipv4:` targets round "
        f"robin. {r['options']['servers']} simulated game servers, {r['options']['players']} "
        "players chatting and buying, an advancement reward (two journaled gives) every "
        f"{EVENT_SECONDS} s per game server. Phases of {r['options']['seconds']} s: steady, "
        f"then replica 0 of each of {', '.join(r['options']['kill'])} SIGKILLed and restarted "
        f"on its port after {r['options']['down_seconds']} s.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| requests served (player requests answered) | {r['requests_served']} "
        f"({r['requests_per_s']}/s over {r['seconds']} s) |",
        f"| purchases confirmed | {r['purchases_confirmed']} |",
        f"| event tasks (sent / resent) | {r['events_sent']} / {r['events_resent']} |",
        f"| task states | {r['tasks']['states']} |",
        f"| tasks resumed after kills (attempts > 1) | {r['tasks']['resumed_after_kills']} |",
        f"| attempts per task (claims) | {r['tasks']['attempts']} |",
        f"| tasks created before a kill and ended after it | "
        f"{r['tasks']['in_flight_across_a_kill']} |",
        f"| tasks ending EFFECT_UNKNOWN (their gives not applied) / not terminal "
        f"| {r['tasks']['effect_unknown']} ({r['tasks']['effect_unknown_gives_not_applied']}) "
        f"/ {r['tasks']['not_terminal']} |",
        f"| tasks not SUCCEEDED for another reason (failure key: count) | "
        f"{dict(Counter(t['key'] for t in r['tasks']['failed_otherwise_tasks'])) or 'none'} |",
        f"| **effects lost** (gives / purchases) | **{r['effects']['lost']}** "
        f"({r['effects']['event_gives_lost']} / {r['effects']['purchases_lost']}) |",
        f"| **effects applied twice** (gives / purchases) | **{r['effects']['applied_twice']}** "
        f"({r['effects']['event_gives_applied_twice']} / "
        f"{r['effects']['purchases_charged_twice']}) |",
        f"| game-server reconnects | {r['reconnects']} |",
        f"| presses of a card shown before a reconnect, by how (held: kept on screen over a "
        f"gateway kill or move home; in flight: the reconnect fell between quote and press) "
        f"| {r['cards_across_reconnects']['presses'] or 'none'} |",
        f"| held cards' presses by what ended their connection "
        f"| {r['cards_across_reconnects']['held_by_reason'] or 'none'} |",
        f"| failed attempts players saw, by status | {r['errors']['attempts_failed']} |",
        f"| of them fixed by a retry | {r['errors']['fixed_by_retry']} |",
        f"| not fixed, or fixed but not UNAVAILABLE/RESOURCE_EXHAUSTED | "
        f"{r['errors']['unacceptable'] or 'none'} |",
        "",
        "| service | counted at | seconds both up | calls per replica | share | each ≥ 30 % |",
        "|---|---|---|---|---|---|",
    ]
    for service, s in r["shares"].items():
        lines.append(
            f"| {service} | {s['counted_at']} | {s['seconds']} | {s['calls']} | {s['share']} "
            f"| {'yes' if s['each_at_least_30_percent'] else 'NO'} |"
        )
    lines += ["", "| replica killed | at s | restarted s | SERVING s |", "|---|---|---|---|"]
    for k in r["kills"]:
        lines.append(
            f"| {k['replica']} | {k['killed_at_s']} | {k['restarted_at_s']} | {k['serving_at_s']} |"
        )
    if r["cards_across_reconnects"]["examples"]:
        lines += ["", "Held cards not taken:", ""]
        lines += [f"- {e}" for e in r["cards_across_reconnects"]["examples"]]
    if r["errors"]["examples"]:
        lines += ["", "Examples of what players saw:", ""]
        lines += [f"- `{s}`: {e}" for s, es in r["errors"]["examples"].items() for e in es]
    lines += [
        "",
        "Shares: RPCs each replica handled (its `grpc_server_handled_total`, health and the "
        "stream RPC itself left out, a call on a Multiplex stream counted once), summed over "
        "the seconds in which both replicas of that service were up (a killed replica's "
        f"window runs to {SETTLE_SECONDS} s after it is SERVING again). The gateways' share is "
        "counted at the game servers: their requests are frames on one stream. A game server "
        "whose gateway dies reconnects (home first, then the other), joins its players again "
        "and resends events it sent in the 10 s before; after the killed gateway is back the "
        "moved game servers return to it. Cards across reconnects: "
        f"{HOLD_LEAD_SECONDS} s before the gateway kill, every player of a game server on "
        "that gateway quotes an offer and keeps the card unpressed, and likewise before the "
        "moved game servers go home; each presses it after the reconnect (on the other "
        "replica, then on the restarted one), as decision 0030 says they may. Effects at the world: for each event player, gives "
        "beyond one of each reward item are applied twice, a SUCCEEDED task missing one is a "
        "lost give; for each buyer, torches charged beyond the offers pressed are charged "
        "twice, confirms answered SUCCEEDED without a charge are lost.",
        "",
    ]
    return "\n".join(lines)


def _plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = report["results"]
    served = r["timeline"]["served_per_s"]
    fig, axes = plt.subplots(5, 1, figsize=(11, 12), sharex=True)
    for ax, service in zip(axes, ("gateway", "router", "engine", "storage"), strict=False):
        for name in (f"{service}-0", f"{service}-1"):
            series = served.get(name, [])
            ax.plot(range(len(series)), series, label=name)
        ax.set_ylabel("per s")
        counted = "requests (at caller)" if service == "gateway" else "RPCs handled"
        ax.set_title(f"{service}: {counted} per replica")
        ax.legend(loc="upper right", fontsize=8)
    errors = r["timeline"]["errors_per_s"]
    axes[4].bar(range(len(errors)), errors, color="tab:red")
    axes[4].set_title("failed attempts players saw (retried)")
    axes[4].set_xlabel("seconds")
    for ax in axes:
        for k in r["kills"]:
            ax.axvline(k["killed_at_s"], color="black", linestyle="--", linewidth=0.8)
            ax.axvline(k["serving_at_s"], color="green", linestyle=":", linewidth=0.8)
    for k in r["kills"]:
        axes[0].annotate(
            f"kill {k['replica']}",
            (k["killed_at_s"], axes[0].get_ylim()[1] * 0.9),
            fontsize=7,
            rotation=90,
        )
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short phases, a little load")
    parser.add_argument("--seconds", type=float, help="seconds per phase (default 20; quick 8)")
    parser.add_argument("--players", type=int, help="players (default 24; quick 8)")
    parser.add_argument("--servers", type=int, help="game servers (default 4; quick 2)")
    parser.add_argument("--kill", default=",".join(KILL_ORDER))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--logs", type=Path, help="copy the services' logs here at the end")
    args = parser.parse_args(argv)
    options = Options(
        seconds=args.seconds or (8.0 if args.quick else 20.0),
        players=args.players or (8 if args.quick else 24),
        servers=args.servers or (2 if args.quick else 4),
        kill=tuple(k for k in args.kill.split(",") if k),
        down_seconds=2.0 if args.quick else DOWN_SECONDS,
    )
    if options.servers < 2 or any(k not in KILL_ORDER for k in options.kill):
        parser.error(f"--servers must be at least 2 and --kill a subset of {KILL_ORDER}")
    load_before = [round(x, 2) for x in os.getloadavg()]
    with (
        tempfile.TemporaryDirectory() as folder,
        database("postgres", Path(folder), "scaleout") as url,
    ):
        try:
            results = run(url, Path(folder) / "cluster", options)
        finally:
            if args.logs is not None:
                shutil.copytree(Path(folder) / "cluster" / "logs", args.logs, dirs_exist_ok=True)
    load_after = [round(x, 2) for x in os.getloadavg()]
    report = {
        "benchmark": "scaleout",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(
            ["python -m bench.scaleout", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": describe_machine(),
        "load_before": load_before,
        "load_after": load_after,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaleout.json").write_text(json.dumps(report, indent=2) + "\n")
    text = _markdown(report)
    (args.out / "scaleout.md").write_text(text)
    _plot(report, args.out / "scaleout.png")
    print(text)
    effects = results["effects"]
    return 0 if effects["lost"] == 0 and effects["applied_twice"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
