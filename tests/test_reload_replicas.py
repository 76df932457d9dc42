"""`/system reload` on every replica (issue 18, decision 0033): two router and two engine
replicas on loopback, each a real gRPC server with service credentials, balanced over static
`ipv4:a,b` lists as on Kubernetes over a headless Service's addresses. One reload puts an edited phrasing, semantic
setting and event rule in force on both replicas of each; a malformed file changes nothing on
either; a replica that cannot be reached is named in the answer while the others reload."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from system.common.v1 import common_pb2

from engine_service.admin_tools import replica_addresses
from router_service.app import create_app as create_router
from router_service.buttons import load_phrasings
from services.gamesim.client import GameServerClient
from services.gamesim.world import World
from services.stack.launcher import free_port
from tests.inprocess import Chain, running_chain
from tests.test_revoke_replicas import add_second_replicas

SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
REWARD = "system:advancement_reward"
DIAMOND = "minecraft:story/mine_diamond"
BUTTONS = [("claim", "claim", "Claim"), ("close", "", "Close")]


def _write(path: pathlib.Path, document: Any) -> None:
    path.write_text(json.dumps(document, ensure_ascii=False), encoding="utf-8")


def _rules(item: str, count: int, module: str = REWARD) -> dict[str, Any]:
    return {
        "rules": [
            {
                "advancement": DIAMOND,
                "module": module,
                "input": {"items": [{"item": item, "count": count}]},
            }
        ]
    }


def _port(target: str) -> int:
    return int(target.rpartition(":")[2])


@dataclasses.dataclass
class Files:
    semantic: pathlib.Path
    phrasings: pathlib.Path
    rules: pathlib.Path


async def two_of_each(chain: Chain, files: Files) -> None:
    """Makes the chain's engine and router two replicas each (`engine`, `engine_b`, `router`,
    `router_b`): the engines' router target lists both routers, the routers' engine target
    both engines. The gateway calls replica A of each, gateway B engine B."""
    router_ports = [_port(chain.router_target), free_port()]
    routers = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in router_ports)
    create_engine, engine_config = chain._restart["engine"]
    chain._restart["engine"] = (
        create_engine,
        dataclasses.replace(engine_config, router_target=routers),
    )
    await chain.restart("engine")
    await add_second_replicas(chain)  # engine B (the same settings), gateway B in front of it
    engines = f"ipv4:{chain.target('engine')},{chain.target('engine_b')}"
    base = chain.apps["router"].host.config  # its settings and credentials
    await chain.stop("router")
    for name, port in zip(("router", "router_b"), router_ports, strict=True):
        router = await create_router(dataclasses.replace(base, port=port, engine_target=engines))
        chain.apps[name] = router
        await router.host.start()
        chain._stopped.discard(name)


@pytest.fixture
async def files(tmp_path: pathlib.Path) -> Files:
    found = Files(
        tmp_path / "config" / "system-semantic.json",
        tmp_path / "config" / "notification-buttons.json",
        tmp_path / "rules.json",
    )
    _write(found.rules, _rules("minecraft:emerald", 7))
    return found


@pytest.fixture
async def chain(tmp_path: pathlib.Path, files: Files) -> AsyncIterator[Chain]:
    async with running_chain(
        tmp_path,
        credentials=True,  # every call with the caller's credential, as in production
        router_settings={
            "semantic_config": str(files.semantic),
            "button_phrasings": str(files.phrasings),
        },
        engine_settings={"advancements_file": str(files.rules)},
    ) as running:
        await two_of_each(running, files)
        yield running


def lines(result: common_pb2.AgentResult) -> list[str]:
    return [line.text for line in result.card.lines]


def presses(chain: Chain, name: str, text: str) -> str | None:
    return chain.apps[name].router._buttons.match(text, "en", BUTTONS).action_id  # type: ignore[no-any-return]


def rule_items(chain: Chain, name: str) -> list[dict[str, Any]]:
    rule = chain.apps[name].advancements.get().rule_for(DIAMOND)
    return rule.data()["items"]  # type: ignore[no-any-return]


async def earn(client: GameServerClient, player: str, key: str) -> Counter[str]:
    before = Counter(client.world.inventory(player))
    await client.event(player, "minecraft:advancement", key, {"advancement": DIAMOND})
    notice = await asyncio.wait_for(client.notices.get(), 20)
    assert notice.notice.result.status == SUCCEEDED, notice
    return Counter(client.world.inventory(player)) - before


async def test_one_reload_reaches_both_replicas_and_a_bad_file_changes_neither(
    chain: Chain, files: Files
) -> None:
    world = World()
    on_a = chain.new_client()
    on_a.world = world
    await on_a.connect()
    on_b = chain.new_client(gateway="gateway_b")
    on_b.world = world
    await on_b.connect()
    await on_a.join("op", "Op", "en_us", permission_level=3)
    await on_a.join("zhop", "Zhop", "zh_cn", permission_level=3)
    await on_b.join("steve", "Steve", "en_us")
    assert await earn(on_b, "steve", "adv-1") == Counter({"minecraft:emerald": 7})
    for name in ("router", "router_b"):
        assert presses(chain, name, "grab the loot") is None
        assert chain.apps[name].router.config.min_coverage == 0.9

    # One reload, through gateway A (engine A, router A): every replica takes the edits.
    phrasings = load_phrasings()
    phrasings["claim"]["en"].append("grab the loot")
    _write(files.phrasings, phrasings)
    semantic = json.loads(files.semantic.read_text(encoding="utf-8"))
    semantic["minCoverage"] = 0.95
    _write(files.semantic, semantic)
    _write(files.rules, _rules("minecraft:gold_ingot", 2))
    done = (await on_a.chat("op", "/system reload")).reply.result
    assert done.status == SUCCEEDED, done
    shown = lines(done)
    assert "Router replicas reloaded: 2 of 2" in shown
    assert "Engine replicas reloaded: 2 of 2" in shown
    assert not [line for line in shown if line.startswith("Replicas that failed")]
    for name in ("router", "router_b"):
        assert presses(chain, name, "grab the loot") == "claim"
        assert chain.apps[name].router.config.min_coverage == 0.95
    for name in ("engine", "engine_b"):
        assert rule_items(chain, name) == [{"item": "minecraft:gold_ingot", "count": 2}]
    # Engine B (behind gateway B, which never saw the command) rewards by the new rule.
    assert await earn(on_b, "steve", "adv-2") == Counter({"minecraft:gold_ingot": 2})

    # Malformed files: refused by name, and neither replica of either service changes.
    digests = {n: chain.apps[n].advancements.get().digest for n in ("engine", "engine_b")}
    semantic["minCoverage"] = 0.8
    _write(files.semantic, semantic)
    _write(files.phrasings, dict(phrasings, cancel={"en": ["nope", 3]}))
    _write(files.rules, _rules("minecraft:gold_ingot", 2, "system:help"))
    refused = (await on_a.chat("zhop", "/system 重载配置")).reply.result
    assert refused.status == SUCCEEDED, refused
    shown = lines(refused)
    (error,) = [line for line in shown if line.startswith("路由配置")]
    assert str(files.phrasings) in error and "'cancel'.'en' must be a list" in error
    (error,) = [line for line in shown if line.startswith("事件规则未重载")]
    assert f"rules[0] ({DIAMOND}): module system:help does not handle" in error
    assert "路由副本已重载：0/2" in shown
    for name in ("router", "router_b"):
        assert chain.apps[name].router.config.min_coverage == 0.95
        assert presses(chain, name, "grab the loot") == "claim"
    for name in ("engine", "engine_b"):
        assert chain.apps[name].advancements.get().digest == digests[name]
    assert await earn(on_b, "steve", "adv-3") == Counter({"minecraft:gold_ingot": 2})

    # The router's file still bad, the rules good: both engines reload, neither router.
    _write(files.rules, _rules("minecraft:iron_ingot", 3))
    half = lines((await on_a.chat("op", "/system reload")).reply.result)
    assert "Router replicas reloaded: 0 of 2" in half
    assert "Engine replicas reloaded: 2 of 2" in half
    assert [line for line in half if "was not reloaded" in line]
    for name in ("engine", "engine_b"):
        assert rule_items(chain, name) == [{"item": "minecraft:iron_ingot", "count": 3}]
    for name in ("router", "router_b"):
        assert chain.apps[name].router.config.min_coverage == 0.95


async def test_a_replica_that_cannot_be_reached_is_named_and_the_others_reload(
    chain: Chain, files: Files
) -> None:
    client = await chain.client()
    await client.join("op", "Op", "en_us", permission_level=3)
    router_b, engine_b = chain.target("router_b"), chain.target("engine_b")
    await chain.stop("router_b")
    await chain.stop("engine_b")
    semantic = json.loads(files.semantic.read_text(encoding="utf-8"))
    semantic["minCoverage"] = 0.95
    _write(files.semantic, semantic)
    done = (await client.chat("op", "/system reload")).reply.result
    assert done.status == SUCCEEDED, done
    shown = lines(done)
    assert "Router replicas reloaded: 1 of 2" in shown
    assert "Engine replicas reloaded: 1 of 2" in shown
    (failed,) = [line for line in shown if line.startswith("Replicas that failed: ")]
    assert f"{router_b}: " in failed and f"{engine_b}: " in failed and "UNAVAILABLE" in failed
    assert chain.apps["router"].router.config.min_coverage == 0.95


async def test_every_address_of_a_target_one_per_replica() -> None:
    assert await replica_addresses("ipv4:10.0.0.1:50052,10.0.0.2:50052") == [
        "10.0.0.1:50052",
        "10.0.0.2:50052",
    ]
    assert await replica_addresses("ipv6:[::1]:50052,[::2]:50052") == ["[::1]:50052", "[::2]:50052"]
    assert await replica_addresses("router:50052") == ["router:50052"]  # a virtual IP: one
    # A headless Service's name resolves to one address per ready replica.
    found = await replica_addresses("dns:///localhost:50052")
    assert "127.0.0.1:50052" in found and all(a.endswith(":50052") for a in found)
    assert "127.0.0.1:50052" in await replica_addresses("dns://8.8.8.8/localhost:50052")
