"""Daily sign-in (issue 15): the simulated world's sign-in calendar (day boundary by the
server's time zone and day start hour, once per player per day, call-id de-duplication), the
reward catalogue file and its checks, the reward pick (the model's when it names an entry, a
deterministic one otherwise), the registration against the routing corpus, and the module end
to end through the gateway in Chinese and English (twice the same day refused politely, the
next day with a longer streak, the profile's streak line). A retried event step with the same
call id applies once (real storage, the engine's TaskSteps, the simulated world)."""

from __future__ import annotations

import asyncio
import datetime
import json
import pathlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from system.common.v1 import catalog_pb2, common_pb2
from system.engine.v1 import engine_pb2
from system.gateway.v1 import gateway_pb2

from engine_service.app import build_registry
from engine_service.config import EngineConfig
from engine_service.context import ExecutionContext
from engine_service.models import Completion
from engine_service.modules.signin import SIGNIN_CLAIM, SigninModule, _items, deterministic_pick
from engine_service.signin_rewards import load_signin_rewards, parse_signin_rewards
from engine_service.steps import TaskSteps
from engine_service.task_store import Claim, TaskStore
from services.gamesim.world import World
from services.model_gateway.app import create_app as create_model_gateway
from services.model_gateway.config import ModelConfig
from services.model_testserver import FakeOpenAIServer
from services.results import AgentFailure, ModuleFailure
from services.runtime.config import ConfigError
from tests.inprocess import Chain, card_lines, running_chain, task_store
from tests.waiting import wait_until

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
SHANGHAI = datetime.timezone(datetime.timedelta(hours=8))
# 2026-12-01 10:00 in Asia/Shanghai.
MORNING = datetime.datetime(2026, 12, 1, 10, 0, tzinfo=SHANGHAI).timestamp()
DAY = 86400.0


class WallClock:
    """Seconds since the epoch, moved by hand."""

    def __init__(self, now: float = MORNING) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _claim_input(world: World, reward: str = "bread", count: int = 8) -> dict[str, Any]:
    return {
        "day": world.today().isoformat(),
        "reward": reward,
        "items": [{"item": "minecraft:bread", "count": count}],
    }


# -- the simulated world's calendar ----------------------------------------------------------


def test_a_day_begins_at_the_servers_hour_in_its_time_zone() -> None:
    clock = WallClock(datetime.datetime(2026, 12, 1, 3, 30, tzinfo=SHANGHAI).timestamp())
    midnight = World(wall_clock=clock)
    four = World(wall_clock=clock, day_start_hour=4)
    utc = World(wall_clock=clock, time_zone="UTC")
    assert midnight.today() == datetime.date(2026, 12, 1)
    assert four.today() == datetime.date(2026, 11, 30)  # before 04:00: still yesterday
    assert utc.today() == datetime.date(2026, 11, 30)  # 19:30 UTC the day before
    status = four.call("steve", "minecraft:signin.status", {})
    assert (status["time_zone"], status["day_start_hour"]) == ("Asia/Shanghai", 4)
    clock.now += 3600  # 04:30
    assert four.today() == datetime.date(2026, 12, 1)
    with pytest.raises(ValueError):
        World(day_start_hour=24)


def test_once_a_day_the_streak_and_the_month() -> None:
    clock = WallClock()
    world = World(wall_clock=clock)
    first = world.call("steve", "minecraft:signin.claim", _claim_input(world))
    assert first["claimed"] and (first["streak"], first["days_this_month"]) == (1, 1)
    assert world.inventory("steve")["minecraft:bread"] == 12 + 8
    again = world.call("steve", "minecraft:signin.claim", _claim_input(world, "iron", 3))
    assert not again["claimed"]
    assert (again["reward"], again["items"]) == ("bread", [{"item": "minecraft:bread", "count": 8}])
    assert world.inventory("steve")["minecraft:bread"] == 12 + 8  # nothing given twice
    status = world.call("steve", "minecraft:signin.status", {})
    assert status["signed_today"] and status["reward"] == "bread" and status["streak"] == 1
    clock.now += DAY
    status = world.call("steve", "minecraft:signin.status", {})
    assert not status["signed_today"] and status["streak"] == 1  # yesterday's still counts
    assert world.call("steve", "minecraft:signin.claim", _claim_input(world))["streak"] == 2
    clock.now += 2 * DAY  # a day missed: the streak starts again
    assert world.call("steve", "minecraft:signin.status", {})["streak"] == 0
    third = world.call("steve", "minecraft:signin.claim", _claim_input(world))
    assert (third["streak"], third["days_this_month"]) == (1, 3)
    assert world.call("alex", "minecraft:signin.status", {})["streak"] == 0  # per player


def test_a_claim_for_another_day_is_refused() -> None:
    world = World(wall_clock=WallClock())
    stale = {**_claim_input(world), "day": "2026-11-30"}
    with pytest.raises(ValueError, match=r"day 2026-11-30 is not today \(2026-12-01\)"):
        world.call("steve", "minecraft:signin.claim", stale)
    assert not world.call("steve", "minecraft:signin.status", {})["signed_today"]


def test_a_repeated_call_id_answers_as_the_first_call() -> None:
    clock = WallClock()
    world = World(wall_clock=clock)
    first = world.call_with_id("steve", SIGNIN_CLAIM, _claim_input(world), "task-1/0")
    clock.now += DAY  # even a day later, the same call id is the same call
    again = world.call_with_id("steve", SIGNIN_CLAIM, _claim_input(world, count=1), "task-1/0")
    assert again == first and first["claimed"]
    assert world.inventory("steve")["minecraft:bread"] == 12 + 8
    other = world.call_with_id("steve", SIGNIN_CLAIM, _claim_input(world, count=1), "task-2/0")
    assert other["claimed"] and world.inventory("steve")["minecraft:bread"] == 12 + 8 + 1


# -- the reward catalogue ---------------------------------------------------------------------


def test_the_shipped_catalogue_loads() -> None:
    rewards = load_signin_rewards()
    assert len(rewards.rewards) >= 3
    assert len({r.reward_id for r in rewards.rewards}) == len(rewards.rewards)
    assert all(r.name["zh"] and r.name["en"] and r.items for r in rewards.rewards)
    # Every shipped stack names its item, in both languages, for the card.
    assert all(
        set(r.item_names.get(item, {})) == {"zh", "en"}
        for r in rewards.rewards
        for item, _ in r.items
    )


def test_an_entry_names_its_items_or_the_card_shows_their_ids() -> None:
    named = {"item": "minecraft:bread", "count": 8, "name": {"zh": "面包", "en": "Bread"}}
    plain = {"item": "minecraft:torch", "count": 4}
    (reward,) = parse_signin_rewards({"rewards": [_entry(items=[named, plain])]}).rewards
    assert reward.stacks() == [  # what the claim tool takes: no names
        {"item": "minecraft:bread", "count": 8},
        {"item": "minecraft:torch", "count": 4},
    ]
    assert _items(reward.stacks(), reward.item_names, "en") == "Bread × 8, minecraft:torch × 4"
    assert _items(reward.stacks(), reward.item_names, "zh") == "面包 × 8, minecraft:torch × 4"


def _entry(**fields: Any) -> dict[str, Any]:
    return {
        "id": "bread",
        "name": {"zh": "面包", "en": "Bread"},
        "items": [{"item": "minecraft:bread", "count": 8}],
        **fields,
    }


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "the document must be a JSON object"),
        ({"rewards": []}, "rewards is required"),
        ({"rewards": [_entry()], "extra": 1}, "unknown key(s) extra"),
        ({"rewards": [_entry(id="Bread!")]}, "rewards[0]: id must be 1 to 64 lower-case"),
        (
            {"rewards": [_entry(), _entry()]},
            "rewards[1] (bread): id bread is already used by rewards[0]",
        ),
        ({"rewards": [_entry(name={"zh": "面包"})]}, "rewards[0] (bread): name.en is required"),
        ({"rewards": [_entry(items=[])]}, "rewards[0] (bread): items"),
        (
            {"rewards": [_entry(id="iron", items=[{"item": "minecraft:iron_ingot", "count": 65}])]},
            "rewards[0] (iron): items[0].count must be at most 64",
        ),
        (
            {"rewards": [_entry(id="x", items=[{"item": "Iron", "count": 1}])]},
            "rewards[0] (x): items[0].item must match the pattern",
        ),
        ({"rewards": [_entry(weight=3)]}, "rewards[0] (bread): "),
    ],
)
def test_a_bad_catalogue_is_refused_naming_the_entry(document: Any, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_signin_rewards(document, "rewards.json")
    assert str(caught.value).startswith("rewards.json: ")
    assert message in str(caught.value)


def test_the_engine_refuses_to_start_with_a_bad_catalogue_file(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "rewards.json"
    bad.write_text(json.dumps({"rewards": [_entry(items=[{"item": "minecraft:bread"}])]}))
    with pytest.raises(ConfigError, match=r"rewards\[0\] \(bread\): items\[0\]\.count is required"):
        build_registry(EngineConfig(signin_rewards_file=str(bad)))
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON at line 1"):
        build_registry(EngineConfig(signin_rewards_file=str(bad)))
    with pytest.raises(ConfigError, match="does not exist"):
        build_registry(EngineConfig(signin_rewards_file=str(tmp_path / "missing.json")))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"rewards": [_entry(id="only")]}))
    module = build_registry(EngineConfig(signin_rewards_file=str(good))).get("system:signin")
    assert isinstance(module, SigninModule)
    assert [r.reward_id for r in module.rewards.rewards] == ["only"]


# -- the registration ---------------------------------------------------------------------------


def test_the_registration_is_an_explicit_only_write_matching_the_corpus() -> None:
    registry = build_registry(EngineConfig())
    descriptor = registry.descriptor("system:signin")
    assert descriptor.routing_mode == catalog_pb2.ROUTING_MODE_EXPLICIT_ONLY
    assert descriptor.write_steps == 1 and not descriptor.semantic.read_only_tools
    assert [list(c.aliases) for c in descriptor.commands] == [["signin", "签到", "每日签到"]]
    corpus = json.loads((ROOT / "router_service/corpus/profiles.json").read_text("utf-8"))
    profile = {m["id"]: m for m in corpus["modules"]}["system:signin"]
    examples = {e.language: list(e.examples) for e in descriptor.semantic.examples}
    assert examples == profile["examples"]
    assert profile["kind"] == "hints" and profile["direct"] is False
    assert profile["explicitOnly"] is True and profile["readOnlyTools"] is False
    assert profile["writeSteps"] == descriptor.write_steps
    assert (descriptor.semantic.extractor or None) == profile["extractor"]
    tools = {t.tool_id: t for t in registry.tools.specs()}
    assert tools[SIGNIN_CLAIM].honours_call_id and not tools[SIGNIN_CLAIM].read_only
    assert tools["minecraft:signin.status"].read_only


# -- the reward pick ---------------------------------------------------------------------------


class ScriptedModel:
    """Answers `complete` with the scripted replies in order."""

    def __init__(self, *replies: str | ModuleFailure) -> None:
        self.replies = list(replies)
        self.requests: list[list[Any]] = []

    async def complete(
        self, player_id: str, messages: list[Any], timeout: float, **_: Any
    ) -> Completion:
        self.requests.append(list(messages))
        reply = self.replies.pop(0)
        if isinstance(reply, ModuleFailure):
            raise reply
        return Completion(reply, (), "stop")


class WorldTools:
    """The engine's game-tool relay, answered by a simulated world in-process."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.call_ids: list[str] = []

    async def call(
        self,
        player_id: str,
        call_id: str,
        tool: str,
        payload: dict[str, Any],
        timeout: float,
        idempotent: bool,
        server_id: str = "",
        language: str = "en",
    ) -> dict[str, Any]:
        self.call_ids.append(call_id)
        try:
            return self.world.call_with_id(player_id, tool, payload, call_id)
        except ValueError as exc:
            raise ModuleFailure(AgentFailure.INVALID_INPUT, str(exc)) from None


def _context(
    world: World, model: ScriptedModel | None, source: int = engine_pb2.ROUTE_SOURCE_COMMAND
) -> ExecutionContext:
    registry = build_registry(EngineConfig())
    module = registry.get("system:signin")
    assert module is not None
    player = common_pb2.PlayerContext(
        player_id="steve", player_name="Steve", language="en", server_id="sim"
    )
    return ExecutionContext(
        player=player,
        spec=module.spec,
        registry=registry,
        history=None,  # type: ignore[arg-type]
        source=source,
        game_tools=WorldTools(world),
        deadline=time.monotonic() + 30,
        models=model,  # type: ignore[arg-type]
    )


async def _sign_in(
    world: World, model: ScriptedModel | None, **kwargs: Any
) -> common_pb2.AgentResult:
    ctx = _context(world, model, **kwargs)
    module = ctx.registry.get("system:signin")
    return await module.run({}, ctx)  # type: ignore[union-attr]


async def test_the_models_pick_is_used_when_it_names_an_entry() -> None:
    world = World(wall_clock=WallClock())
    model = ScriptedModel('{"reward": "iron"}')
    result = await _sign_in(world, model)
    assert result.status == SUCCEEDED
    assert world.call("steve", "minecraft:signin.status", {})["reward"] == "iron"
    assert world.inventory("steve")["minecraft:iron_ingot"] == 6
    assert "Reward: Iron ingots (Iron Ingot × 6)" in [line.text for line in result.card.lines]
    # The model saw the catalogue's entries as the only choices.
    sent = json.loads(model.requests[0][1].content)
    assert [r["id"] for r in sent["rewards"]] == [
        r.reward_id for r in load_signin_rewards().rewards
    ]
    assert sent["day"] == "2026-12-01"


@pytest.mark.parametrize(
    "reply",
    [
        '{"reward": "diamond_block"}',  # no such entry
        '{"reward": "ir',  # cut short
        "I think iron would be nice!",
        '{"reward": ["iron"]}',
        '["iron"]',
        ModuleFailure(AgentFailure.MODEL_UNAVAILABLE, "no model configured"),
        ModuleFailure(AgentFailure.TIMEOUT, "slow"),
    ],
)
async def test_a_bad_or_missing_answer_falls_back_to_the_deterministic_pick(reply: Any) -> None:
    world = World(wall_clock=WallClock())
    result = await _sign_in(world, ScriptedModel(reply))
    assert result.status == SUCCEEDED
    expected = deterministic_pick(load_signin_rewards(), "2026-12-01", "steve")
    assert world.call("steve", "minecraft:signin.status", {})["reward"] == expected.reward_id


async def test_without_a_model_the_pick_is_deterministic_by_day_and_player() -> None:
    rewards = load_signin_rewards()
    world = World(wall_clock=WallClock())
    result = await _sign_in(world, None)
    assert result.status == SUCCEEDED
    picked = world.call("steve", "minecraft:signin.status", {})["reward"]
    assert picked == deterministic_pick(rewards, "2026-12-01", "steve").reward_id
    assert deterministic_pick(rewards, "2026-12-01", "steve") == deterministic_pick(
        rewards, "2026-12-01", "steve"
    )
    days = {
        deterministic_pick(rewards, f"2026-12-{d:02d}", "steve").reward_id for d in range(1, 29)
    }
    players = {deterministic_pick(rewards, "2026-12-01", f"p{n}").reward_id for n in range(40)}
    assert len(days) > 1 and len(players) > 1


async def test_a_local_route_cannot_sign_in() -> None:
    world = World(wall_clock=WallClock())
    for source in (engine_pb2.ROUTE_SOURCE_LOCAL, engine_pb2.ROUTE_SOURCE_CACHE):
        with pytest.raises(ModuleFailure) as caught:
            await _sign_in(world, None, source=source)
        assert caught.value.failure is AgentFailure.WRITE_NOT_ALLOWED
    assert not world.call("steve", "minecraft:signin.status", {})["signed_today"]
    assert world.inventory("steve")["minecraft:bread"] == 12


# -- a retried step applies once ----------------------------------------------------------------


@pytest.fixture
async def store(tmp_path: pathlib.Path) -> AsyncIterator[TaskStore]:
    async with task_store(tmp_path) as tasks:
        yield tasks


async def _claim(store: TaskStore, owner: str, task_id: str) -> Claim:
    async def claimed() -> Claim | None:
        claims = await store.claim(owner, 8, 1)
        return next((claim for claim in claims if claim.task.task_id == task_id), None)

    return await wait_until(claimed, timeout=15, interval=0.1, what=f"{owner} to claim {task_id}")


async def test_a_sign_in_step_retried_after_a_crash_applies_once(store: TaskStore) -> None:
    """The game server signed in, but the engine died before the answer came back: the next
    replica retries the step with the same step id, and the world answers as the first time."""
    world = World(wall_clock=WallClock())
    spec = build_registry(EngineConfig()).tools.get(SIGNIN_CLAIM)
    assert spec is not None and spec.honours_call_id
    task, _ = await store.create("steve", "system:signin", "key-steve", {}, waiting=False)
    claim = await _claim(store, "replica-a", task.task_id)
    applied = asyncio.Event()

    async def applied_then_crashed(step_id: str) -> dict[str, Any]:
        world.call_with_id("steve", SIGNIN_CLAIM, _claim_input(world), step_id)
        applied.set()
        await asyncio.Event().wait()  # the answer never arrives
        raise AssertionError

    run = asyncio.create_task(TaskSteps(store, claim).run(spec, applied_then_crashed))
    await applied.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    retried = await _claim(store, "replica-b", task.task_id)  # after replica-a's lease ran out
    step_ids: list[str] = []

    async def answered(step_id: str) -> dict[str, Any]:
        step_ids.append(step_id)
        return world.call_with_id("steve", SIGNIN_CLAIM, _claim_input(world), step_id)

    output = await TaskSteps(store, retried).run(spec, answered)
    assert step_ids == [f"{task.task_id}/0"]  # the same call id
    assert output["claimed"] is True  # the first call's answer
    assert world.inventory("steve")["minecraft:bread"] == 12 + 8  # given once


# -- end to end through the gateway -------------------------------------------------------------


@pytest.fixture
async def chain(tmp_path: pathlib.Path) -> AsyncIterator[Chain]:
    async with running_chain(tmp_path) as running:
        yield running


async def test_sign_in_in_chinese_and_english_once_a_day(chain: Chain) -> None:
    clock = WallClock()
    world = World(wall_clock=clock)
    client = await chain.steve_and_alex(world)
    rewards = load_signin_rewards()

    response = await client.chat("steve", "签到")  # no model here: the deterministic pick
    reply = response.reply
    assert reply.module_id == "system:signin"
    assert reply.result.status == SUCCEEDED, reply.result.failure
    assert reply.result.card.title == "每日签到"
    # The engine knows Steve by his scoped id; the world's record names the entry given.
    picked = rewards.get(world.call("steve", "minecraft:signin.status", {})["reward"])
    assert picked is not None
    assert card_lines(response)[0] == "签到成功（2026-12-01）"
    assert card_lines(response)[1].startswith(f"奖励：{picked.name['zh']}（")
    assert card_lines(response)[-1] == "连续签到 1 天，本月签到 1 天"
    for item, count in picked.items:
        assert world.inventory("steve")[item] >= count

    inventory = dict(world.inventory("steve"))
    again = await client.chat("steve", "/每日签到")
    assert again.reply.module_id == "system:signin"
    assert again.reply.result.status == SUCCEEDED  # a polite card, not an error
    assert card_lines(again)[0] == "今天（2026-12-01）已经签到过了，明天再来吧。"
    assert card_lines(again)[1].startswith(f"今日奖励：{picked.name['zh']}")
    assert dict(world.inventory("steve")) == inventory  # nothing given twice

    english = await client.chat("alex", "/signin")
    assert english.reply.result.card.title == "Daily sign-in"
    assert card_lines(english)[0] == "Signed in for 2026-12-01"
    assert card_lines(english)[-1] == "Sign-in streak: 1 day, 1 this month"
    twice = await client.chat("alex", "/signin")
    assert (
        card_lines(twice)[0] == "You have already signed in today (2026-12-01). Come back tomorrow."
    )

    clock.now += DAY  # the next day on the server's calendar
    next_day = await client.chat("steve", "签到")
    assert card_lines(next_day)[0] == "签到成功（2026-12-02）"
    assert card_lines(next_day)[-1] == "连续签到 2 天，本月签到 2 天"
    profile = await client.chat("steve", "/profile")
    assert profile.reply.module_id == "system:profile"
    assert card_lines(profile)[-1] == "连续签到 2 天，本月签到 2 天"
    await client.close()


async def test_an_engine_killed_in_the_middle_of_a_sign_in_signs_in_once(chain: Chain) -> None:
    client = await chain.cut_off_client()
    world = client.world
    # The claim is applied on the game thread; the engine that asked dies before the answer.
    client.cut_off(SIGNIN_CLAIM, lambda: chain.restart("engine"), drop=True)
    cut = await client.chat("steve", "/signin")
    assert cut.reply.result.status != common_pb2.RESULT_STATUS_SUCCEEDED
    state = world.player("steve")
    assert len(state.signins) == 1
    given = dict(state.inventory)

    # Asked again once the engine is back (as a player would): already signed in, nothing
    # given twice.
    async def answered() -> gateway_pb2.PlayerResponse | None:
        response = await client.chat("steve", "/signin")
        return response if response.reply.module_id == "system:signin" else None

    again = await wait_until(
        answered, timeout=15, interval=0.25, what="an answer from the restarted engine"
    )
    assert again.reply.result.status == common_pb2.RESULT_STATUS_SUCCEEDED
    assert card_lines(again)[0].startswith("今天（") and "已经签到过了" in card_lines(again)[0]
    assert len(state.signins) == 1 and dict(state.inventory) == given


async def test_typed_sign_in_words_never_sign_in_directly(chain: Chain) -> None:
    world = World(wall_clock=WallClock())
    client = await chain.steve_and_alex(world)
    for player, text in (
        ("steve", "我要签到"),
        ("steve", "帮我签到"),
        ("alex", "sign me in please"),
    ):
        response = await client.chat(player, text)
        assert response.reply.module_id != "system:signin", text
        assert not world.call(player, "minecraft:signin.status", {})["signed_today"], text
    await client.close()


# -- through the gateway with a model -------------------------------------------------------------


@pytest.fixture
async def chain_with_model(tmp_path: pathlib.Path) -> AsyncIterator[tuple[Chain, FakeOpenAIServer]]:
    with FakeOpenAIServer(api_key="test-key") as fake:
        config = ModelConfig(
            port=0,
            metrics_port=-1,
            drain_seconds=0,
            grace_seconds=1,
            base_url=fake.base_url,
            api_key="test-key",
            storage_target="",  # no metering here
            max_attempts=1,
        )
        config.validate()
        gateway = await create_model_gateway(config)
        await gateway.host.start()
        try:
            async with running_chain(
                tmp_path, engine_settings={"model_target": gateway.host.target}
            ) as running:
                yield running, fake
        finally:
            await gateway.host.stop()
            await gateway.aclose()


async def test_the_model_picks_the_reward_through_the_gateway(
    chain_with_model: tuple[Chain, FakeOpenAIServer],
) -> None:
    chain, fake = chain_with_model
    world = World(wall_clock=WallClock())
    client = await chain.steve_and_alex(world)
    rewards = load_signin_rewards()

    fake.script(content='{"reward": "experience"}')
    response = await client.chat("steve", "/签到")
    assert response.reply.result.status == SUCCEEDED, response.reply.result.failure
    assert world.call("steve", "minecraft:signin.status", {})["reward"] == "experience"
    assert world.inventory("steve")["minecraft:experience_bottle"] == 4
    assert card_lines(response)[1] == "奖励：经验瓶（附魔之瓶 × 4）"
    asked = json.loads(fake.completions[0].json["messages"][1]["content"])
    assert [r["id"] for r in asked["rewards"]] == [r.reward_id for r in rewards.rewards]

    # An id outside the catalogue (and the items the model made up) is never written.
    fake.script(content='{"reward": "netherite", "items": [{"item": "minecraft:netherite_block"}]}')
    english = await client.chat("alex", "/signin")
    assert english.reply.result.status == SUCCEEDED
    written = world.call("alex", "minecraft:signin.status", {})["reward"]
    assert rewards.get(written) is not None
    assert "minecraft:netherite_block" not in world.inventory("alex")
    assert len(fake.completions) == 2

    again = await client.chat("steve", "/签到")  # signed already: no model call at all
    assert card_lines(again)[0] == "今天（2026-12-01）已经签到过了，明天再来吧。"
    assert len(fake.completions) == 2
    await client.close()
