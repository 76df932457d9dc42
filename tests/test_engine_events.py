"""Event tasks end to end, with real services on loopback: a game server reports an advancement
through the gateway, the engine persists a task, claims it by lease and gives the reward through
the gateway's tool relay, each give journaled as a step receipt. Offline players' tasks wait
for them; resent events make nothing new; a replica killed with -9 mid-give loses nothing,
gives nothing twice (an interrupted give is sent again with its call id, which
`minecraft:item.give` honours), and its tasks finish on the other replica after the lease."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from prometheus_client import REGISTRY
from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2, engine_pb2_grpc
from system.gateway.v1 import gateway_pb2
from system.storage.v1 import journal_pb2, journal_pb2_grpc

from engine_service.advancements import DEFAULT_RULES_FILE
from engine_service.app import EngineApp
from engine_service.app import create_app as create_engine
from engine_service.config import EngineConfig
from services.gamesim.client import GameServerClient
from services.gateway.app import create_app as create_gateway
from services.gateway.config import GatewayConfig
from services.runtime.multiplex import MultiplexClient
from storage_service.app import create_app as create_storage
from storage_service.config import StorageConfig
from tests.service_process import ServiceProcess, free_port
from tests.waiting import holds_for, wait_until

HOST = {"port": 0, "metrics_port": -1, "drain_seconds": 0, "grace_seconds": 1}
SERVER = "sim"
ADVANCEMENT = "minecraft:advancement"
DIAMOND = "minecraft:story/mine_diamond"
REWARD = Counter(
    {
        stack["item"]: stack["count"]
        for rule in json.loads(DEFAULT_RULES_FILE.read_text())["rules"]
        if rule["advancement"] == DIAMOND
        for stack in rule["input"]["items"]
    }
)
"""What the shipped advancement rules give for DIAMOND."""
TERMINAL = {
    journal_pb2.TASK_STATE_SUCCEEDED,
    journal_pb2.TASK_STATE_FAILED,
    journal_pb2.TASK_STATE_PARTIALLY_SUCCEEDED,
}
FAST_ENGINE = {"task_lease_seconds": 3, "event_poll_seconds": 0.1}


class RecordingGame(GameServerClient):
    """The simulated game server, recording every tool call it ran. For players in `hold` it
    runs the call (the effect happens) but never answers: the engine is left waiting, as if it
    died between the effect and the answer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str, str]] = []
        self.hold: set[str] = set()

    def _run_tool(self, call: gateway_pb2.ToolCall) -> gateway_pb2.ConnectRequest:
        frame = super()._run_tool(call)
        self.calls.append((call.player_id, call.tool, call.call_id))
        return None if call.player_id in self.hold else frame  # type: ignore[return-value]

    async def send(self, frame: gateway_pb2.ConnectRequest) -> None:
        if frame is not None:
            await super().send(frame)

    def gained(self, player_id: str) -> Counter[str]:
        """Items given to the player by tools (their inventory minus the starting stock)."""
        start = Counter({"minecraft:bread": 12, "minecraft:torch": 32})
        inventory = self.world.inventory(player_id)
        return Counter({k: inventory[k] - start[k] for k in inventory if inventory[k] > start[k]})


@dataclasses.dataclass
class Stack:
    storage: Any
    gateway: Any
    game: RecordingGame
    journal: journal_pb2_grpc.JournalServiceStub
    engine_stub: engine_pb2_grpc.EngineServiceStub
    gateway_port: int

    async def tasks(self, player_id: str) -> list[journal_pb2.EventTask]:
        response = await self.journal.ListTasks(
            journal_pb2.ListTasksRequest(player_id=f"{SERVER}/{player_id}"), timeout=5
        )
        return list(response.tasks)

    async def settled(
        self, players: list[str], timeout: float = 30.0, states: set[int] = TERMINAL
    ) -> dict[str, journal_pb2.EventTask]:
        """Waits until every player's (single) task is in one of `states`."""
        found: dict[str, journal_pb2.EventTask] = {}

        async def all_settled() -> bool:
            found.clear()
            for player in players:
                tasks = await self.tasks(player)
                if len(tasks) == 1 and tasks[0].state in states:
                    found[player] = tasks[0]
            return len(found) == len(players)

        await wait_until(
            all_settled,
            timeout,
            interval=0.05,
            what=lambda: f"tasks settled, missing: {sorted(set(players) - set(found))[:5]}",
        )
        return found


@contextlib.asynccontextmanager
async def _stack(
    database_url: str, engine_target: str, gateway_port: int, **gateway_settings: Any
) -> AsyncIterator[Stack]:
    """Storage and gateway (with `gateway_settings`) in process; the engine(s) are the
    caller's."""
    storage = await create_storage(StorageConfig(**HOST, database_url=database_url))
    await storage.host.start()
    token = secrets.token_urlsafe(16)
    config = GatewayConfig(
        **HOST,
        internal_port=gateway_port,  # the relay, which the engine calls
        router_target="127.0.0.1:1",
        engine_target=engine_target,
        storage_target=storage.host.target,
        tokens=(f"{SERVER}={token}",),
        **gateway_settings,
    )
    gateway = await create_gateway(config)
    await gateway.host.start()
    game = RecordingGame(gateway.host.target, SERVER, token)
    storage_channel = grpc.aio.insecure_channel(storage.host.target)
    engine_channel = grpc.aio.insecure_channel(engine_target)
    try:
        await game.connect()
        yield Stack(
            storage,
            gateway,
            game,
            journal_pb2_grpc.JournalServiceStub(storage_channel),
            engine_pb2_grpc.EngineServiceStub(engine_channel),
            gateway_port,
        )
    finally:
        await game.close()
        await storage_channel.close()
        await engine_channel.close()
        await gateway.host.stop()
        await gateway.aclose()
        await storage.host.stop()
        await storage.aclose()


async def _engine(storage_target: str, gateway_port: int, **settings: Any) -> EngineApp:
    engine = await create_engine(
        EngineConfig(
            **{**HOST, **FAST_ENGINE, **settings},
            storage_target=storage_target,
            gateway_target=f"127.0.0.1:{gateway_port}",
        )
    )
    await engine.host.start()
    return engine


async def _stop(engine: EngineApp) -> None:
    await engine.host.stop()
    await engine.aclose()


@contextlib.asynccontextmanager
async def _one_engine(
    database_url: str, gateway: dict[str, Any] | None = None, **settings: Any
) -> AsyncIterator[tuple[Stack, EngineApp]]:
    """The stack with one in-process engine (its port chosen before the gateway starts);
    `gateway`: the gateway's settings beyond the defaults."""
    engine_port = free_port()
    gateway_port = free_port()
    async with _stack(
        database_url, f"127.0.0.1:{engine_port}", gateway_port, **(gateway or {})
    ) as stack:
        engine = await _engine(
            stack.storage.host.target, gateway_port, port=engine_port, **settings
        )
        try:
            yield stack, engine
        finally:
            await _stop(engine)


def _count_claims(engine: EngineApp) -> list[int]:
    """From now on, how many tasks each claim of the engine's event runner got."""
    store = engine.runner_tasks
    real_claim = store.claim
    claims: list[int] = []

    async def counted_claim(*args: Any, **kwargs: Any) -> Any:
        got = await real_claim(*args, **kwargs)
        claims.append(len(got))
        return got

    store.claim = counted_claim  # type: ignore[method-assign]
    return claims


def _asked_again(call: str = "ResumePlayerTasks") -> float:
    """How many times the gateway asked the engine again for `call`
    (gateway_engine_calls_asked_again_total)."""
    return (
        REGISTRY.get_sample_value("gateway_engine_calls_asked_again_total", {"call": call}) or 0.0
    )


def _player(player_id: str) -> common_pb2.PlayerContext:
    """The player as the gateway names them to other services: scoped to their game server
    (decision 0012)."""
    return common_pb2.PlayerContext(
        server_id=SERVER, player_id=f"{SERVER}/{player_id}", language="en"
    )


def _diamond_event(player_id: str, event_key: str) -> engine_pb2.SubmitEventRequest:
    """The player (online) earned the diamond advancement, as the gateway submits it."""
    return engine_pb2.SubmitEventRequest(
        player=_player(player_id),
        event_type=ADVANCEMENT,
        event_key=event_key,
        data=_data(advancement=DIAMOND),
        player_online=True,
    )


def _data(**values: Any) -> struct_pb2.Struct:
    data = struct_pb2.Struct()
    data.update(values)
    return data


# -- one engine --------------------------------------------------------------------------------


async def test_a_rule_without_names_shows_the_item_ids(
    fresh_database_url: str, tmp_path: Path
) -> None:
    """An operator's rule that names no item: the reward card shows the ids it gives."""
    rules = tmp_path / "advancements.json"
    stack_input = {"items": [{"item": "minecraft:diamond", "count": 2}]}
    rules.write_text(
        json.dumps(
            {
                "rules": [
                    {
                        "advancement": DIAMOND,
                        "module": "system:advancement_reward",
                        "input": stack_input,
                    }
                ]
            }
        )
    )
    async with _one_engine(fresh_database_url, advancements_file=str(rules)) as (stack, _):
        await stack.game.join("steve", "Steve")
        await stack.game.event("steve", ADVANCEMENT, "adv-1", {"advancement": DIAMOND})
        task = (await stack.settled(["steve"]))["steve"]
        assert task.state == journal_pb2.TASK_STATE_SUCCEEDED
        assert [line.text for line in task.result.card.lines] == ["minecraft:diamond × 2"]
        assert task.result.card.title == "Advancement reward"  # the rule names no advancement


async def test_an_advancement_gives_its_reward_once(fresh_database_url: str) -> None:
    async with _one_engine(fresh_database_url) as (stack, engine):
        await stack.game.join("steve", "Steve")
        await stack.game.event("steve", ADVANCEMENT, "adv-1", {"advancement": DIAMOND})
        task = (await stack.settled(["steve"]))["steve"]
        assert task.state == journal_pb2.TASK_STATE_SUCCEEDED
        assert task.module_id == "system:advancement_reward"
        assert task.result.status == common_pb2.RESULT_STATUS_SUCCEEDED
        # The rule names its advancement and items: the card shows the names (in the
        # player's language).
        assert task.result.card.title == "Advancement reward: Diamonds!"
        assert [line.text for line in task.result.card.lines] == [
            "Diamond × 1",
            "Bottle o' Enchanting × 5",
        ]
        assert stack.game.gained("steve") == REWARD
        # Call ids are the step ids: a game server may deduplicate on them too.
        assert [c[2] for c in stack.game.calls] == [f"{task.task_id}/0", f"{task.task_id}/1"]
        # Steve is told what he got, once it is stored: a notice with the task's result.
        notice = await asyncio.wait_for(stack.game.notices.get(), 5)
        assert notice.player_id == "steve" and not notice.request_id
        assert notice.notice.result == task.result

        # The game server resends the event (unsure it arrived): nothing new happens.
        await stack.game.event("steve", ADVANCEMENT, "adv-1", {"advancement": DIAMOND})
        resent = await stack.engine_stub.SubmitEvent(_diamond_event("steve", "adv-1"), timeout=5)
        assert [(t.task_id, t.created) for t in resent.tasks] == [(task.task_id, False)]

        async def nothing_new() -> bool:
            return (
                len(await stack.tasks("steve")) == 1
                and stack.game.gained("steve") == REWARD
                and not stack.game.frame_errors
                and stack.game.notices.empty()  # and told once
            )

        # The resend through the gateway is not answered: look for half a second (five of the
        # engine's polls) that nothing is given, told or refused.
        await holds_for(nothing_new, 0.5, interval=0.05, what="nothing new after the resend")


async def test_a_task_goes_where_its_claim_says_its_player_is_without_a_lookup(
    fresh_database_url: str,
) -> None:
    """The claim carries the gateway replica storage knows for the task's player: the task's
    game-tool calls and its notice go there without a LocatePlayer call of their own."""
    async with _one_engine(fresh_database_url) as (stack, engine):
        await stack.game.join("steve", "Steve")
        routes = engine.game_tools.routes
        looked_up = routes.lookups
        await stack.game.event("steve", ADVANCEMENT, "adv-1", {"advancement": DIAMOND})
        task = (await stack.settled(["steve"]))["steve"]
        assert task.state == journal_pb2.TASK_STATE_SUCCEEDED
        assert stack.game.gained("steve") == REWARD
        notice = await asyncio.wait_for(stack.game.notices.get(), 5)
        assert notice.notice.result == task.result
        assert routes.lookups == looked_up


async def test_an_offline_players_task_waits_for_them(fresh_database_url: str) -> None:
    async with _one_engine(fresh_database_url) as (stack, engine):
        # Alex is not on the server: the event is kept, nothing is given yet.
        await stack.game.event("alex", ADVANCEMENT, "adv-1", {"advancement": DIAMOND})
        waiting = await stack.settled(["alex"], states={journal_pb2.TASK_STATE_WAITING})
        claims = _count_claims(engine)
        await wait_until(lambda: len(claims) >= 3, what="three claims of the runner")
        assert not any(claims)  # several polls: a waiting task is never claimed
        assert (await stack.tasks("alex"))[0].state == journal_pb2.TASK_STATE_WAITING
        assert stack.game.calls == []

        await stack.game.join("alex", "Alex")
        done = (await stack.settled(["alex"]))["alex"]
        assert done.task_id == waiting["alex"].task_id
        assert done.state == journal_pb2.TASK_STATE_SUCCEEDED
        assert stack.game.gained("alex") == REWARD


async def test_a_join_while_the_engine_is_down_resumes_the_waiting_task_once_it_is_back(
    fresh_database_url: str,
) -> None:
    """The join's ResumePlayerTasks cannot reach the engine (restarted, say, in a rollout): the
    gateway keeps asking while the player stays, so the task that waited for them runs once an
    engine is back, not at their next join."""
    engine_port = free_port()
    gateway_port = free_port()
    async with _stack(fresh_database_url, f"127.0.0.1:{engine_port}", gateway_port) as stack:
        engine = await _engine(stack.storage.host.target, gateway_port, port=engine_port)
        await stack.game.event("alex", ADVANCEMENT, "adv-1", {"advancement": DIAMOND})
        waiting = (await stack.settled(["alex"], states={journal_pb2.TASK_STATE_WAITING}))["alex"]
        await _stop(engine)

        asked_before = _asked_again()
        await stack.game.join("alex", "Alex")
        await wait_until(
            lambda: _asked_again() > asked_before, what="the refused resume asked again"
        )
        assert (await stack.tasks("alex"))[0].state == journal_pb2.TASK_STATE_WAITING

        engine = await _engine(stack.storage.host.target, gateway_port, port=engine_port)
        try:
            done = (await stack.settled(["alex"]))["alex"]
            assert done.task_id == waiting.task_id
            assert done.state == journal_pb2.TASK_STATE_SUCCEEDED, done.result
            assert stack.game.gained("alex") == REWARD
        finally:
            await _stop(engine)


async def test_an_event_while_the_engine_is_down_is_sent_again_once_it_is_back(
    fresh_database_url: str,
) -> None:
    """No engine can be reached (restarted, say, in a rollout): the gateway sends the event
    again, so the game server is told nothing and the reward comes once an engine is back."""
    engine_port = free_port()
    gateway_port = free_port()
    async with _stack(fresh_database_url, f"127.0.0.1:{engine_port}", gateway_port) as stack:
        await stack.game.join("steve", "Steve")
        asked_before = _asked_again("SubmitEvent")
        await stack.game.event("steve", ADVANCEMENT, "adv-1", {"advancement": DIAMOND})
        await wait_until(
            lambda: _asked_again("SubmitEvent") > asked_before, what="the event sent again"
        )
        engine = await _engine(stack.storage.host.target, gateway_port, port=engine_port)
        try:
            done = (await stack.settled(["steve"]))["steve"]
            assert done.state == journal_pb2.TASK_STATE_SUCCEEDED, done.result
            assert stack.game.gained("steve") == REWARD
            assert stack.game.frame_errors == []
        finally:
            await _stop(engine)


async def test_an_event_no_engine_takes_for_long_is_refused_unavailable(
    fresh_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After EVENT_AGAIN_SECONDS without an engine the game server is told, with the event key
    (it may resend later with the same key); nothing was made."""
    from services.gateway import players

    monkeypatch.setattr(players, "EVENT_AGAIN_SECONDS", 1.0)
    engine_port = free_port()
    gateway_port = free_port()
    async with _stack(fresh_database_url, f"127.0.0.1:{engine_port}", gateway_port) as stack:
        await stack.game.join("steve", "Steve")
        await stack.game.event("steve", ADVANCEMENT, "adv-1", {"advancement": DIAMOND})
        await wait_until(lambda: stack.game.frame_errors, timeout=10, what="the refusal")
        [error] = stack.game.frame_errors
        assert (error.request_id, error.code) == ("adv-1", grpc.StatusCode.UNAVAILABLE.value[0])
        assert await stack.tasks("steve") == []


async def test_a_player_leaving_mid_task_resumes_it_without_repeating(
    fresh_database_url: str,
) -> None:
    """The two gives go out together (ExecutionContext.tools); the first lands, the player
    leaves before the second runs, and it is never answered: its outcome unknown, the task
    waits for the player (item.give honours call ids), and on their return only the second
    runs, under its call id; the first is replayed from its receipt, not given again."""
    async with _one_engine(fresh_database_url, gateway={"tool_call_timeout_seconds": 1.0}) as (
        stack,
        engine,
    ):
        await stack.game.join("alex", "Alex")
        game = stack.game
        original = game._run_tool
        dropped: list[str] = []

        def leave_before_second(call: gateway_pb2.ToolCall) -> gateway_pb2.ConnectRequest | None:
            if not call.call_id.endswith("/1") or dropped:
                return original(call)
            # The player leaves before this give runs: it never runs and is never answered.
            dropped.append(call.call_id)
            asyncio.get_running_loop().create_task(game.leave("alex"))
            return None

        game._run_tool = leave_before_second  # type: ignore[method-assign]
        await game.event("alex", ADVANCEMENT, "adv-1", {"advancement": DIAMOND})
        waiting = (await stack.settled(["alex"], states={journal_pb2.TASK_STATE_WAITING}))["alex"]
        assert game.gained("alex") == Counter({"minecraft:diamond": 1})
        assert dropped == [f"{waiting.task_id}/1"]

        game._run_tool = original  # type: ignore[method-assign]
        await game.join("alex", "Alex")
        done = (await stack.settled(["alex"]))["alex"]
        assert done.task_id == waiting.task_id
        assert done.state == journal_pb2.TASK_STATE_SUCCEEDED, done.result
        assert game.gained("alex") == REWARD
        assert [call_id for _, _, call_id in game.calls] == [
            f"{done.task_id}/0",
            f"{done.task_id}/1",
        ]


async def test_events_travel_on_the_engines_stream_as_unary_calls_do(
    fresh_database_url: str,
) -> None:
    """The gateway hands events and resumes to the engine on its MultiplexCalls stream; a
    call there answers what the unary RPC answers: the task made once per event key, a bad
    event refused INVALID_ARGUMENT naming the field, a resume counted."""
    async with _one_engine(fresh_database_url) as (stack, engine):
        await stack.game.join("steve", "Steve")
        await stack.game.event("steve", ADVANCEMENT, "adv-1", {"advancement": DIAMOND})
        done = (await stack.settled(["steve"]))["steve"]
        assert done.state == journal_pb2.TASK_STATE_SUCCEEDED, done.result
        assert stack.game.gained("steve") == REWARD
        assert stack.gateway.players._engine_calls.streams_opened >= 1  # the join's resume too

        service = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]
        async with grpc.aio.insecure_channel(engine.host.target) as channel:
            calls = MultiplexClient(
                engine_pb2_grpc.EngineServiceStub(channel).MultiplexCalls, service
            )
            try:
                again = await calls.call(
                    "SubmitEvent",
                    _diamond_event("steve", "adv-1"),
                    5,
                )
                assert [(t.task_id, t.created) for t in again.tasks] == [(done.task_id, False)]
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await calls.call(
                        "SubmitEvent",
                        engine_pb2.SubmitEventRequest(
                            player=_player("steve"), event_type=ADVANCEMENT, event_key=""
                        ),
                        5,
                    )
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "event_key" in (refused.value.details() or "")
                resumed = await calls.call(
                    "ResumePlayerTasks",
                    engine_pb2.ResumePlayerTasksRequest(player=_player("steve")),
                    5,
                )
                assert resumed.resumed == 0  # nothing of steve's waits
            finally:
                await calls.aclose()
        assert len(await stack.tasks("steve")) == 1


async def test_bad_events_are_refused_and_make_no_task(fresh_database_url: str) -> None:
    async with _one_engine(fresh_database_url) as (stack, engine):
        cases = [
            (
                dict(event_type=ADVANCEMENT, event_key="", data=_data(advancement=DIAMOND)),
                "event_key",
            ),
            (dict(event_type="", event_key="k", data=_data(advancement=DIAMOND)), "event_type"),
            (dict(event_type=ADVANCEMENT, event_key="k" * 129, data=_data()), "event_key"),
            (dict(event_type=ADVANCEMENT, event_key="k", data=_data(nope=1)), "advancement"),
        ]
        for fields, words in cases:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stack.engine_stub.SubmitEvent(
                    engine_pb2.SubmitEventRequest(player=_player("steve"), **fields), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
            assert words in (refused.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stack.engine_stub.SubmitEvent(
                engine_pb2.SubmitEventRequest(
                    player=_player("steve"), event_type="test:nothing", event_key="k"
                ),
                timeout=5,
            )
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        # Through the gateway: a bad frame gets a FrameError naming the event key.
        await stack.game.event("steve", ADVANCEMENT, "adv-9", {"nope": 1})
        await stack.game.event("steve", "no-namespace", "adv-10", {})
        await wait_until(lambda: len(stack.game.frame_errors) == 2, timeout=20)
        errors = {e.request_id: e for e in stack.game.frame_errors}
        assert errors["adv-9"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "advancement" in errors["adv-9"].message
        assert errors["adv-10"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "namespace:path" in errors["adv-10"].message
        assert await stack.tasks("steve") == []


# -- crash and takeover ------------------------------------------------------------------------


def _engine_process(stack: Stack, tmp_path: Path, name: str) -> ServiceProcess:
    return ServiceProcess(
        "engine_service",
        "SYSTEM_ENGINE_",
        {
            "STORAGE_TARGET": stack.storage.host.target,
            "GATEWAY_TARGET": f"127.0.0.1:{stack.gateway_port}",
            "REPLICA_ID": name,
            "TASK_LEASE_SECONDS": "3",
            "EVENT_POLL_SECONDS": "0.1",
            "LOG_LEVEL": "WARNING",
        },
        tmp_path / f"{name}.log",
    )


@pytest.mark.e2e
async def test_kill_9_mid_give_gives_once_and_the_other_replica_finishes(
    fresh_database_url: str, tmp_path: Path
) -> None:
    """Replica A (a process) and replica B (in process) run one stream of event tasks. A give
    for `stuck` reaches the game and its answer never comes back; A is killed with -9 while
    it waits, then restarted. The interrupted gives (sent together) are sent again with their
    step ids as call ids (item.give honours call ids: the world answers as the first time, giving nothing), so
    every task, `stuck`'s too, SUCCEEDED with exactly its reward (issue 19: no EFFECT_UNKNOWN
    rewards after a kill)."""
    players = [f"p{i:02d}" for i in range(30)]
    gateway_port = free_port()
    b_port = free_port()
    async with _stack(fresh_database_url, f"127.0.0.1:{b_port}", gateway_port) as stack:
        game = stack.game
        for player in [*players, "stuck"]:
            await game.join(player, player)
        replica_a = _engine_process(stack, tmp_path, "replica-a")
        await replica_a.start()
        b: EngineApp | None = None
        try:
            # Only A runs at first, so the stuck give is A's.
            game.hold.add("stuck")
            async with grpc.aio.insecure_channel(replica_a.target) as channel:
                await engine_pb2_grpc.EngineServiceStub(channel).SubmitEvent(
                    _diamond_event("stuck", "adv"),
                    timeout=10,
                )
            await wait_until(lambda: any(c[0] == "stuck" for c in game.calls), timeout=20)
            b = await _engine(stack.storage.host.target, gateway_port, port=b_port)
            # The gateway dialled B in vain while it was down (resuming joined players' tasks);
            # wait for its channel to reconnect rather than have events refused UNAVAILABLE.
            await asyncio.wait_for(stack.gateway.players.engine.channel.channel_ready(), 10)
            for player in players:
                await game.event(player, ADVANCEMENT, "adv", {"advancement": DIAMOND})
            await wait_until(lambda: len(game.calls) >= 12, timeout=20)
            replica_a.kill()
            game.hold.discard("stuck")  # the game server answers the retried give
            await replica_a.start()  # the restarted replica joins B in finishing the work

            settled = await stack.settled([*players, "stuck"], timeout=60)
        finally:
            replica_a.stop()
            if b is not None:
                await _stop(b)

    stuck = settled["stuck"]
    assert stuck.state == journal_pb2.TASK_STATE_SUCCEEDED, stuck.result
    # Claimed by A, then once more after A restarted and took its leases back (decision 0014).
    assert stuck.attempts == 2
    assert game.gained("stuck") == REWARD  # each give once, though each was sent twice
    stuck_calls = [call_id for player, _, call_id in game.calls if player == "stuck"]
    first, second = f"{stuck.task_id}/0", f"{stuck.task_id}/1"
    # Both gives went out together and were held; after the kill, resent in order.
    assert sorted(stuck_calls[:2]) == [first, second], stuck_calls
    assert stuck_calls[2:] == [first, second], stuck_calls

    # A's other worker may have been in its task when it died: a first claim stores its gives
    # only when the task ends (decision 0036), so its gives are sent again too, with their
    # call ids, and answered from the world's memory. Every task completed exactly.
    for player in players:
        task = settled[player]
        assert task.state == journal_pb2.TASK_STATE_SUCCEEDED, (player, task.result)
        assert game.gained(player) == REWARD, player
    gives = Counter(call_id.split(".")[0] for _, _, call_id in game.calls)
    resent = [step for step, sent in gives.items() if sent > 1]
    # Only the steps of tasks claimed again were sent again, once each: those A was running
    # when it died, and those whose final write (made after the worker was free, decision
    # 0032) had not been stored yet.
    assert f"{stuck.task_id}/0" in resent, resent
    claimed_again = {task.task_id for task in settled.values() if task.attempts > 1}
    assert {step.split("/")[0] for step in resent} <= claimed_again, (resent, claimed_again)
    assert max(gives.values()) == 2


async def test_stopping_a_replica_gives_its_tasks_back_at_once(fresh_database_url: str) -> None:
    """A graceful stop releases the leases of claimed tasks; the next replica takes them
    without waiting for the lease (ten minutes here) to run out. The give the stopped replica
    was waiting on had run at the game server: the next replica sends it again with the same
    call id (item.give honours call ids), the world answers as the first time, and the task
    SUCCEEDED with the reward given once instead of ending EFFECT_UNKNOWN (issue 19)."""
    async with _one_engine(fresh_database_url, task_lease_seconds=600) as (stack, engine):
        await stack.game.join("slow", "Slow")
        stack.game.hold.add("slow")
        await stack.game.event("slow", ADVANCEMENT, "adv", {"advancement": DIAMOND})
        # Both gives go out together (ExecutionContext.tools) and run; neither is answered.
        await wait_until(lambda: len(stack.game.calls) == 2, timeout=20)
        await _stop(engine)
        task = (await stack.tasks("slow"))[0]
        assert task.state == journal_pb2.TASK_STATE_RUNNING
        assert stack.game.gained("slow") == REWARD  # they ran
        stack.game.hold.discard("slow")  # from now on the game server answers
        replacement = await _engine(stack.storage.host.target, stack.gateway_port)
        try:
            done = (await stack.settled(["slow"], timeout=30))["slow"]
        finally:
            await _stop(replacement)
        assert done.state == journal_pb2.TASK_STATE_SUCCEEDED, done.result
        assert done.attempts == 2
        assert stack.game.gained("slow") == REWARD  # each stack once, though sent twice
        first, second = f"{task.task_id}/0", f"{task.task_id}/1"
        calls = [call_id for _, _, call_id in stack.game.calls]
        # Resent one at a time in order, each intent stored first (a task claimed again).
        assert sorted(calls[:2]) == [first, second] and calls[2:] == [first, second], calls
