"""Advancement rules from configuration (engine_service.advancements): the shipped file, every
kind of refused file and rule with its message, reload good and bad, the engine refusing to
start with a bad file, advancement events through the in-process chain giving exactly what
the rules say (before and after ReloadAdvancements), and make run's `:advance`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2, engine_pb2_grpc

from engine_service.advancements import (
    DEFAULT_RULES_FILE,
    AdvancementConfig,
    load_advancement_rules,
    parse_advancement_rules,
)
from engine_service.app import build_registry
from engine_service.config import EngineConfig
from engine_service.registry import ExecutionPolicy, ModuleSpec
from services.runtime.config import ConfigError
from services.runtime.errors import InvalidArgument
from tests.inprocess import running_chain
from tests.make_run import make_run

ROOT = Path(__file__).resolve().parent.parent
REWARD = "system:advancement_reward"
ADVANCEMENT = "minecraft:advancement"
DIAMOND = "minecraft:story/mine_diamond"


@pytest.fixture(scope="module")
def registry() -> Any:
    return build_registry(EngineConfig())


def _stacks(*pairs: tuple[str, int]) -> dict[str, Any]:
    return {"items": [{"item": item, "count": count} for item, count in pairs]}


def _rule(advancement: str, *pairs: tuple[str, int], module: str = REWARD) -> dict[str, Any]:
    return {"advancement": advancement, "module": module, "input": _stacks(*pairs)}


def _struct(**values: Any) -> struct_pb2.Struct:
    data = struct_pb2.Struct()
    data.update(values)
    return data


def _write(path: Path, document: Any) -> Path:
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


# -- the file ----------------------------------------------------------------------------------


def test_the_shipped_rules_pass_and_hold_todays_rewards(registry: Any) -> None:
    rules = load_advancement_rules(DEFAULT_RULES_FILE, registry)
    assert rules.source == str(DEFAULT_RULES_FILE)
    assert list(rules.rules) == [
        "minecraft:story/mine_stone",
        "minecraft:story/smelt_iron",
        DIAMOND,
        "minecraft:nether/root",
        "minecraft:end/kill_dragon",
    ]
    diamond = rules.rule_for(DIAMOND)
    assert diamond is not None and diamond.module_id == REWARD
    stacks = [(s["item"], s["count"]) for s in diamond.data()["items"]]
    assert stacks == [("minecraft:diamond", 1), ("minecraft:experience_bottle", 5)]
    # Every shipped stack names its item for the reward card, in both languages.
    assert all(
        set(s["name"]) == {"zh", "en"} for r in rules.rules.values() for s in r.data()["items"]
    )
    # Any other advancement: the default rule.
    other = rules.rule_for("minecraft:story/root")
    assert other is rules.default and other is not None
    assert [(s["item"], s["count"]) for s in other.data()["items"]] == [
        ("minecraft:experience_bottle", 1)
    ]
    # The same rules read twice have the same digest; a task's copy is its own.
    again = load_advancement_rules(DEFAULT_RULES_FILE, registry)
    assert again.digest == rules.digest and len(rules.digest) == 16
    copy = diamond.data()
    copy["items"].clear()
    assert diamond.data()["items"]


def test_without_a_default_other_advancements_make_no_task(registry: Any) -> None:
    rules = parse_advancement_rules({"rules": [_rule(DIAMOND, ("minecraft:diamond", 2))]}, registry)
    assert rules.default is None
    assert rules.rule_for_event({"advancement": "minecraft:story/root"}) is None
    found = rules.rule_for_event({"advancement": DIAMOND})
    assert found is not None and found.data() == _stacks(("minecraft:diamond", 2))
    # Whole numbers arrive as floats from protobuf Structs: the checked input holds ints.
    floats = parse_advancement_rules(
        {"rules": [], "default": {"module": REWARD, "input": _stacks(("minecraft:torch", 4.0))}},
        registry,
    )
    assert floats.default is not None
    count = floats.default.data()["items"][0]["count"]
    assert count == 4 and isinstance(count, int)
    assert parse_advancement_rules({"rules": [], "default": None}, registry).default is None


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        # Unknown module, and modules that do not handle advancement events.
        (
            {"rules": [_rule("minecraft:a/b", ("minecraft:diamond", 1), module="system:nope")]},
            "rules[0] (minecraft:a/b): module 'system:nope' is not registered; modules "
            "handling minecraft:advancement events: system:advancement_reward",
        ),
        (
            {"rules": [{"advancement": "minecraft:a/b", "module": "system:help", "input": {}}]},
            "rules[0] (minecraft:a/b): module system:help does not handle "
            "minecraft:advancement events",
        ),
        (
            {"rules": [{"advancement": "minecraft:a/b", "input": {}}]},
            "rules[0] (minecraft:a/b): module is required",
        ),
        # Input that breaks the module's schema.
        (
            {"rules": [_rule("minecraft:a/b", ("minecraft:diamond", 0))]},
            "rules[0] (minecraft:a/b): input.items[0].count must be at least 1 "
            "(system:advancement_reward's input schema)",
        ),
        (
            {"rules": [_rule("minecraft:a/b", ("minecraft:diamond", 65))]},
            "input.items[0].count must be at most 64",
        ),
        (
            {"rules": [_rule("minecraft:a/b", ("Diamond!", 1))]},
            "rules[0] (minecraft:a/b): input.items[0].item must match the pattern",
        ),
        (
            {"rules": [{"advancement": "minecraft:a/b", "module": REWARD, "input": {}}]},
            "rules[0] (minecraft:a/b): input.items is required",
        ),
        (
            {"rules": [{"advancement": "minecraft:a/b", "module": REWARD, "input": []}]},
            "rules[0] (minecraft:a/b): input must be a JSON object",
        ),
        (
            {
                "rules": [
                    {
                        "advancement": "minecraft:a/b",
                        "module": REWARD,
                        "input": {**_stacks(("minecraft:diamond", 1)), "colour": "blue"},
                    }
                ]
            },
            "rules[0] (minecraft:a/b): input has unknown field(s) colour; known fields are advancement_name, items",
        ),
        # More write steps than the module's policy allows.
        (
            {
                "rules": [
                    _rule("minecraft:a/b", ("minecraft:diamond", 1)),
                    _rule(
                        "minecraft:a/c",
                        ("minecraft:diamond", 1),
                        ("minecraft:torch", 1),
                        ("minecraft:bread", 1),
                    ),
                ]
            },
            "rules[1] (minecraft:a/c): input needs 3 write steps, but "
            "system:advancement_reward's policy allows 2 (write_steps)",
        ),
        # Repeated and malformed advancement ids.
        (
            {
                "rules": [
                    _rule(DIAMOND, ("minecraft:diamond", 1)),
                    _rule("minecraft:a/b", ("minecraft:diamond", 1)),
                    _rule(DIAMOND, ("minecraft:torch", 1)),
                ]
            },
            f"rules[2] ({DIAMOND}): advancement {DIAMOND} already has a rule, rules[0]",
        ),
        (
            {"rules": [_rule("mine_diamond", ("minecraft:diamond", 1))]},
            "rules[0]: advancement 'mine_diamond' is not an advancement id of the form "
            "namespace:path",
        ),
        (
            {"rules": [_rule("Minecraft:Story/Mine", ("minecraft:diamond", 1))]},
            "rules[0]: advancement 'Minecraft:Story/Mine' is not an advancement id",
        ),
        (
            {"rules": [_rule("minecraft:" + "a" * 200, ("minecraft:diamond", 1))]},
            "at most 128 characters",
        ),
        (
            {"rules": [{"module": REWARD, "input": _stacks(("minecraft:diamond", 1))}]},
            "rules[0]: advancement is required",
        ),
        # Unknown keys, at every level.
        (
            {"rules": [], "rule": []},
            "the document has unknown key(s) rule; allowed: rules, default",
        ),
        (
            {"rules": [{**_rule(DIAMOND, ("minecraft:diamond", 1)), "reward": 1}]},
            "rules[0] has unknown key(s) reward; allowed: advancement, module, input",
        ),
        (
            {"rules": [], "default": {**_rule(DIAMOND, ("minecraft:diamond", 1))}},
            "default has unknown key(s) advancement; allowed: module, input",
        ),
        # The default rule is checked like the others.
        (
            {"rules": [], "default": {"module": REWARD, "input": _stacks(("minecraft:x", -1))}},
            "default: input.items[0].count must be at least 1",
        ),
        (
            {"rules": [], "default": {"module": "system:inventory", "input": {}}},
            "default: module system:inventory does not handle minecraft:advancement events",
        ),
        # The document's shape.
        ({"default": None}, "rules is required"),
        ({"rules": {DIAMOND: {}}}, "rules must be a list of rules"),
        ({"rules": ["minecraft:a/b"]}, "rules[0] must be a JSON object"),
        ([], "the document must be a JSON object"),
    ],
)
def test_a_bad_rule_is_refused_naming_the_file_the_rule_and_the_field(
    tmp_path: Path, registry: Any, document: Any, expected: str
) -> None:
    path = _write(tmp_path / "rules.json", document)
    with pytest.raises(ConfigError) as refused:
        load_advancement_rules(path, registry)
    assert str(refused.value).startswith(f"{path}: "), refused.value
    assert expected in str(refused.value)


def test_unreadable_files_are_refused(tmp_path: Path, registry: Any) -> None:
    with pytest.raises(
        ConfigError, match="rules file \\(setting advancements_file\\) .* does not exist"
    ):
        load_advancement_rules(tmp_path / "missing.json", registry)
    broken = _write(tmp_path / "broken.json", '{"rules": [\n  {"advancement": }\n]}')
    with pytest.raises(ConfigError, match="not valid JSON at line 2 column"):
        load_advancement_rules(broken, registry)


@dataclasses.dataclass
class _Module:
    spec: ModuleSpec


class _Registry:
    """Handlers as a registry lists them, one of them not allowed to run from events (the
    real registry refuses to register such a module; the rules check it on their own)."""

    def __init__(self) -> None:
        policy = ExecutionPolicy(tool_calls=1, write_steps=1)
        schema = {"type": "object", "properties": {}, "additionalProperties": False}
        self.modules = {
            "test:quiet": _Module(
                ModuleSpec("test:quiet", {"en": "x"}, schema, events=(ADVANCEMENT,), policy=policy)
            )
        }

    def get(self, module_id: str) -> Any:
        return self.modules.get(module_id)

    def handlers(self, event_type: str) -> list[Any]:
        return list(self.modules.values())


def test_a_module_not_allowed_to_run_from_events_is_refused() -> None:
    document = {"rules": [{"advancement": DIAMOND, "module": "test:quiet", "input": {}}]}
    with pytest.raises(ConfigError, match=r"rules\[0\] \(.*\): module test:quiet may not run"):
        parse_advancement_rules(document, _Registry(), "x.json")


def test_event_data_is_checked(registry: Any) -> None:
    rules = load_advancement_rules(DEFAULT_RULES_FILE, registry)
    for data, expected in [
        ({}, "data field 'advancement' is required"),
        ({"advancement": "Mine Diamond"}, "must be an advancement id of the form namespace:path"),
        ({"advancement": 3}, "data field 'advancement' must be a string"),
        ({"advancement": DIAMOND, "extra": 1}, "data has unknown field(s) extra"),
    ]:
        with pytest.raises(InvalidArgument) as refused:
            rules.rule_for_event(data)
        assert refused.value.message.startswith("minecraft:advancement event: ")
        assert expected in refused.value.message, refused.value.message


# -- reload ------------------------------------------------------------------------------------


def test_reload_replaces_the_rules_only_when_the_file_passes(
    tmp_path: Path, registry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write(tmp_path / "rules.json", {"rules": [_rule(DIAMOND, ("minecraft:diamond", 1))]})
    config = AdvancementConfig(str(path), registry)
    first = config.get()
    assert config.path == path and first.rule_for("minecraft:story/root") is None

    _write(
        path,
        {
            "rules": [_rule(DIAMOND, ("minecraft:diamond", 2))],
            "default": {"module": REWARD, "input": _stacks(("minecraft:bread", 1))},
        },
    )
    second = config.reload()
    assert config.get() is second and second.digest != first.digest
    assert second.rule_for(DIAMOND).data() == _stacks(("minecraft:diamond", 2))  # type: ignore[union-attr]
    assert second.rule_for("minecraft:story/root") is second.default

    _write(path, {"rules": [_rule(DIAMOND, ("minecraft:diamond", 1))] * 2})
    with (
        caplog.at_level(logging.ERROR, logger="system.engine.advancements"),
        pytest.raises(ConfigError, match=r"rules\[1\] .*already has a rule"),
    ):
        config.reload()
    assert config.get() is second  # the rules in force stay
    assert "advancement rules not reloaded" in caplog.text and "already has a rule" in caplog.text

    path.unlink()
    with pytest.raises(ConfigError, match="does not exist"):
        config.reload()
    assert config.get() is second


def test_an_empty_setting_reads_the_shipped_file(registry: Any) -> None:
    assert AdvancementConfig("", registry).path == DEFAULT_RULES_FILE


def test_the_engine_refuses_to_start_with_a_bad_rules_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "rules.json", {"rules": [_rule(DIAMOND, ("minecraft:diamond", 0))]})
    base = {k: v for k, v in os.environ.items() if not k.startswith("SYSTEM_")}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "gen")])
    done = subprocess.run(
        [sys.executable, "-m", "engine_service"],
        cwd=ROOT,
        env={**base, "SYSTEM_ENGINE_ADVANCEMENTS_FILE": str(path), "SYSTEM_ENGINE_PORT": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "engine: invalid configuration: " in done.stderr
    assert f"{path}: rules[0] ({DIAMOND}): input.items[0].count must be at least 1" in done.stderr


# -- through the chain -------------------------------------------------------------------------


async def _earn(client: Any, player: str, advancement: str, key: str) -> Counter[str]:
    """What the player gained from one advancement: the reward task's gives, once its notice
    (sent after the task's end is stored) has arrived."""
    before = Counter(client.world.inventory(player))
    await client.event(player, ADVANCEMENT, key, {"advancement": advancement})
    notice = await asyncio.wait_for(client.notices.get(), 20)
    assert notice.notice.result.status == common_pb2.RESULT_STATUS_SUCCEEDED, notice
    return Counter(client.world.inventory(player)) - before


async def test_advancement_events_give_exactly_the_configured_items_and_follow_reloads(
    tmp_path: Path,
) -> None:
    path = _write(
        tmp_path / "rules.json",
        {
            "rules": [
                _rule(DIAMOND, ("minecraft:emerald", 7), ("minecraft:torch", 3)),
                _rule("minecraft:story/smelt_iron", ("minecraft:iron_ingot", 2)),
            ]
        },
    )
    async with running_chain(
        tmp_path, credentials=True, engine_settings={"advancements_file": str(path)}
    ) as chain:
        client = await chain.client()
        await client.join("steve", "Steve", "en_us")
        assert await _earn(client, "steve", DIAMOND, "adv-1") == Counter(
            {"minecraft:emerald": 7, "minecraft:torch": 3}
        )
        assert await _earn(client, "steve", "minecraft:story/smelt_iron", "adv-2") == Counter(
            {"minecraft:iron_ingot": 2}
        )

        def as_(caller: str) -> tuple[tuple[str, str], ...]:
            return (("authorization", f"Bearer {chain.credentials[caller]}"),)

        engine = engine_pb2_grpc.EngineServiceStub(chain.channel("engine"))
        steve = common_pb2.PlayerContext(server_id="sim", player_id="sim/steve", language="en")
        # No rule and no default: the event is accepted and makes no task.
        submitted = await engine.SubmitEvent(
            engine_pb2.SubmitEventRequest(
                player=steve,
                event_type=ADVANCEMENT,
                event_key="adv-3",
                player_online=True,
                data=_struct(advancement="minecraft:story/root"),
            ),
            timeout=5,
            metadata=as_("gateway"),
        )
        assert list(submitted.tasks) == []

        # Reloading is for operators only.
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await engine.ReloadAdvancements(
                engine_pb2.ReloadAdvancementsRequest(), timeout=5, metadata=as_("gateway")
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED

        # A good file: later events follow it.
        _write(
            path,
            {
                "rules": [_rule(DIAMOND, ("minecraft:gold_ingot", 1))],
                "default": {"module": REWARD, "input": _stacks(("minecraft:bread", 2))},
            },
        )
        reloaded = await engine.ReloadAdvancements(
            engine_pb2.ReloadAdvancementsRequest(), timeout=5, metadata=as_("operator")
        )
        assert (reloaded.file, reloaded.rules, reloaded.default_module_id) == (str(path), 1, REWARD)
        assert (
            reloaded.digest
            == load_advancement_rules(path, chain.apps["engine"].engine.registry).digest
        )
        assert reloaded.replica == chain.apps["engine"].identity.owner
        assert await _earn(client, "steve", DIAMOND, "adv-4") == Counter(
            {"minecraft:gold_ingot": 1}
        )
        assert await _earn(client, "steve", "minecraft:story/root", "adv-5") == Counter(
            {"minecraft:bread": 2}
        )

        # A bad file: refused, naming the rule; the rules in force stay.
        _write(path, {"rules": [_rule(DIAMOND, ("minecraft:gold_ingot", 1), module="system:help")]})
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await engine.ReloadAdvancements(
                engine_pb2.ReloadAdvancementsRequest(), timeout=5, metadata=as_("operator")
            )
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = refused.value.details() or ""
        assert f"rules[0] ({DIAMOND}): module system:help does not handle" in details
        assert "the rules in force stay" in details
        assert await _earn(client, "steve", DIAMOND, "adv-6") == Counter(
            {"minecraft:gold_ingot": 1}
        )
        assert client.notices.empty() and not client.frame_errors


@pytest.mark.e2e
def test_make_run_advance_shows_the_configured_reward(tmp_path: Path) -> None:
    """`make run`, then `:advance minecraft:story/mine_diamond`: the reward card lists the
    shipped rule's stacks; the same advancement again rewards nothing."""
    shipped = load_advancement_rules(DEFAULT_RULES_FILE, build_registry(EngineConfig()))
    # Steve's client is English (no --say text to read a language from): the English names.
    stacks = shipped.rule_for(DIAMOND).data()["items"]  # type: ignore[union-attr]
    lines = [f"{s['name']['en']} × {s['count']}" for s in stacks]
    done = make_run(tmp_path, input=f":advance {DIAMOND}\n:advance {DIAMOND}\n:quit\n")
    assert done.returncode == 0, done.stderr
    # The card's title names the advancement (the rule's advancement_name).
    title = f"Advancement reward: {shipped.rule_for(DIAMOND).data()['advancement_name']['en']}"  # type: ignore[union-attr]
    assert title == "Advancement reward: Diamonds!"
    card = done.stdout.split(title, 1)[1].split("└", 1)[0]
    assert [line.strip("│ ") for line in card.strip().splitlines()] == lines
    assert done.stdout.count("Advancement reward") == 1
    assert "no reward task ended" in done.stdout
