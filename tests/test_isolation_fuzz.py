"""Property test of isolation (issue 20): while a hostile game server sends random frames of
every type at the gateway (deep and huge Structs, huge ids, other servers' player ids,
answers to its own tool calls nested too deep or too large), an honest game server's calls
and writes in flight (tool calls through the relay, preference writes, event rewards) all
succeed, exactly once, and the honest server is refused nothing. Storage, engine, router and
gateway run in-process on loopback, as in tests/inprocess.py."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

from services.gamesim.world import World
from services.runtime.metrics import RPC_HANDLED
from tests.inprocess import Chain
from tests.test_gateway_isolation import HoldingClient, connect, deep, servers_chain

HONEST = ("00000000-0000-4000-8000-00000000a001", "00000000-0000-4000-8000-00000000a002")
HOSTILE_OWN = "hostile-own-player"
SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
# No shrinking: an example takes about a second and carries values of hundreds of KB, so
# shrinking one takes many minutes; a failure is reported as generated.
FUZZ = settings(
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclasses.dataclass
class Servers:
    chain: Chain
    honest: HoldingClient
    hostile: HoldingClient
    world: World
    keys: itertools.count[int] = dataclasses.field(default_factory=itertools.count)
    given: int = 0
    """Diamonds the honest server's first player has been given by rewards so far."""


@pytest.fixture
async def servers(tmp_path: Any) -> AsyncIterator[Servers]:
    before = _server_errors()
    async with servers_chain(tmp_path) as chain:
        world = World()
        honest = await connect(chain, "a", world)
        hostile = await connect(chain, "b")
        for player in HONEST:
            await honest.join(player, "Honest")
        await hostile.join(HOSTILE_OWN, "Own")
        yield Servers(chain, honest, hostile, world)
        assert not honest.frame_errors, honest.frame_errors
        internal = [e for e in hostile.frame_errors if e.code == grpc.StatusCode.INTERNAL.value[0]]
        assert not internal, internal
    assert _server_errors() == before, "a service answered INTERNAL or UNKNOWN"


def _server_errors() -> dict[tuple[str, ...], float]:
    return {
        tuple(sample.labels[k] for k in ("grpc_service", "grpc_method", "grpc_code")): sample.value
        for metric in RPC_HANDLED.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
        and sample.labels.get("grpc_code") in ("INTERNAL", "UNKNOWN")
    }


# -- hostile values ------------------------------------------------------------------------------


def _nested(depth: int, width: int) -> dict[str, Any]:
    value: Any = {"leaf": "x" * width}
    for level in range(depth):
        value = {"a": value} if level % 2 else {"l": [value]}
    return value if isinstance(value, dict) else {"v": value}


def _struct(data: dict[str, Any]) -> struct_pb2.Struct:
    value = struct_pb2.Struct()
    value.update(data)
    return value


# Depth up to 20 Struct levels, past the gateway's 16 (much deeper ones cannot even be built
# into a frame here; undecodable bytes are the random-bytes fuzz's part); widths up to 300 KB.
# Values are drawn by index, so that Hypothesis's reports stay short.
_WIDTHS = (0, 10, 20_000, 300_000)
STRUCTS = st.builds(
    lambda depth, width: _struct(_nested(depth, _WIDTHS[width])),
    st.integers(0, 20),
    st.integers(0, len(_WIDTHS) - 1),
)
_HUGE = ("", "x" * 63, "y" * 65, "z" * 10_000, "界" * 3000, "\x00\x01")
HUGE = st.integers(0, len(_HUGE) - 1).map(lambda i: _HUGE[i])
PLAYER = st.one_of(st.sampled_from([*HONEST, HOSTILE_OWN]), HUGE, st.text(max_size=20))
TEXT = st.one_of(st.sampled_from(["help", "/inventory", "/history"]), HUGE)
BODY = st.one_of(
    st.builds(lambda t: {"chat": gateway_pb2.Chat(text=t)}, TEXT),
    st.builds(
        lambda m, s: {
            "invoke": gateway_pb2.Invoke(call=common_pb2.ModuleAction(module_id=m, input=s))
        },
        st.one_of(st.sampled_from(["system:help", "system:inventory"]), HUGE),
        STRUCTS,
    ),
    st.builds(lambda a: {"control": gateway_pb2.Control(action=a)}, st.integers(0, 5)),
    st.builds(lambda h: {"preferences": gateway_pb2.Preferences(history=h)}, st.booleans()),
    st.builds(
        lambda n, v: {
            "card_action": gateway_pb2.CardAction(
                action_id="invoke",
                args={"module_id": "system:help", "input": v, **{str(i): "v" for i in range(n)}},
            )
        },
        st.sampled_from([0, 40]),
        st.integers(0, 2).map(
            lambda i: ('{"a": 1}', '{"a": ' * 40 + "1" + "}" * 40, "q" * 9999)[i]
        ),
    ),
)
REQUEST = st.builds(
    lambda rid, pid, body: gateway_pb2.ConnectRequest(
        request=gateway_pb2.PlayerRequest(request_id=rid, player_id=pid, **body)
    ),
    st.one_of(st.integers(0, 10**9).map(lambda n: f"h{n}"), HUGE),
    PLAYER,
    BODY,
)
PRESENCE = st.builds(
    lambda kind, pid, name: gateway_pb2.ConnectRequest(
        presence=gateway_pb2.PlayerPresence(kind=kind, player_id=pid, player_name=name)
    ),
    st.integers(0, 4),
    PLAYER,
    HUGE,
)
EVENT = st.builds(
    lambda pid, kind, key, data: gateway_pb2.ConnectRequest(
        event=gateway_pb2.GameEvent(player_id=pid, event_type=kind, event_key=key, data=data)
    ),
    PLAYER,
    st.one_of(st.just("minecraft:advancement"), HUGE),
    st.one_of(st.integers(0, 10**9).map(lambda n: f"e{n}"), HUGE),
    STRUCTS,
)
TOOL_RESULT = st.builds(
    lambda cid, output: gateway_pb2.ConnectRequest(
        tool_result=gateway_pb2.ToolResult(call_id=cid, output=output)
    ),
    st.one_of(st.text(max_size=10), HUGE),
    STRUCTS,
)
HELLO = st.just(
    gateway_pb2.ConnectRequest(hello=gateway_pb2.Hello(server_id="b", protocol_version=1))
)
FRAME = st.one_of(
    REQUEST, PRESENCE, EVENT, TOOL_RESULT, HELLO, st.just(gateway_pb2.ConnectRequest())
)
# The hostile server's answers to its own tool calls: up to 32 levels, which the gateway
# decodes and the engine would not (the 375-byte frame).
ANSWER = st.one_of(st.none(), st.builds(deep, st.integers(17, 32)))


@FUZZ
@given(frames=st.lists(FRAME, min_size=5, max_size=30), answer=ANSWER)
async def test_a_hostile_server_harms_no_other(
    servers: Servers, frames: list[gateway_pb2.ConnectRequest], answer: dict[str, Any] | None
) -> None:
    honest, hostile = servers.honest, servers.hostile
    hostile.answer = answer
    key = f"adv-{next(servers.keys)}"
    external = bool(len(frames) % 2)

    # The honest server's work in flight: tool calls through the relay (shared with the
    # hostile server's own), a preference write, a reward given by an event.
    work = asyncio.gather(
        *(honest.chat(player, "/inventory") for player in HONEST),
        honest.request(HONEST[1], preferences=gateway_pb2.Preferences(external=external)),
        honest.event(
            HONEST[0], "minecraft:advancement", key, {"advancement": "minecraft:story/mine_diamond"}
        ),
    )
    # The hostile server's: its own player's tool call (answered as `answer` says) and the
    # frames, as fast as it can write them.
    own = asyncio.ensure_future(hostile.chat(HOSTILE_OWN, "/inventory"))
    for frame in frames:
        await hostile.send(frame)
    *inventories, prefs, _ = await work
    for response in inventories:
        assert response.reply.result.status == SUCCEEDED, response.reply.result.failure
        assert response.reply.module_id == "system:inventory"
    assert prefs.state.external_enabled is external
    notice = await asyncio.wait_for(honest.notices.get(), 15)
    assert notice.player_id == HONEST[0] and notice.notice.result.status == SUCCEEDED
    servers.given += 1
    assert servers.world.inventory(HONEST[0])["minecraft:diamond"] == servers.given
    assert not honest.frame_errors
    # The hostile server's own call is answered too: a reply, BUSY, or a refusal of its frame.
    # With an answer over the limits, that call alone failed.
    [outcome] = await asyncio.gather(own, return_exceptions=True)
    if answer is not None and not isinstance(outcome, BaseException):
        assert outcome.reply.result.status == common_pb2.RESULT_STATUS_FAILED, outcome
    # The honest server is served as before.
    state = await honest.control(HONEST[0], gateway_pb2.CONTROL_ACTION_STATE)
    assert state.WhichOneof("body") == "state" and not state.state.busy
