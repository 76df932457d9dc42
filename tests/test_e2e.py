"""The whole chain as separate processes on loopback: a simulated game server connects to the
gateway and player Steve asks for help; the router, engine and storage each do their part."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2, engine_pb2_grpc
from system.relay.v1 import relay_pb2, relay_pb2_grpc
from system.storage.v1 import storage_pb2, storage_pb2_grpc

from services.gamesim import GameServerClient
from services.stack import SERVICES, Stack
from services.stack.launcher import ROOT
from tests.make_run import make_run
from tests.waiting import wait_until, wait_until_sync

pytestmark = pytest.mark.e2e

PLAYER = "00000000-0000-4000-8000-0000000000aa"
OTHER_PLAYER = "00000000-0000-4000-8000-0000000000bb"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(tmp_path_factory.mktemp("stack"), drain_seconds=1.0)
    running.start(timeout=60)
    try:
        yield running
    finally:
        running.stop()


def _help_lines(card: common_pb2.Card) -> str:
    return "\n".join(line.text for line in card.lines)


async def test_help_through_all_five_services(stack: Stack) -> None:
    client = GameServerClient(stack.target("gateway"), stack.server_id, stack.token)
    welcome = await client.connect()
    assert welcome.protocol_version == 1
    try:
        await client.join(PLAYER, "Steve", "zh_cn")
        for text in ("帮助", "help", "/help"):
            response = await client.chat(PLAYER, text)
            reply = response.reply
            assert response.request_id
            assert reply.module_id == "system:help"
            assert reply.result.status == common_pb2.RESULT_STATUS_SUCCEEDED
            assert reply.result.card.title == "助手帮助"
            body = _help_lines(reply.result.card)
            assert "/help" in body and "/history" in body  # every registered module is listed
    finally:
        await client.close()

    # Storage recorded each exchange in Steve's history: his words and the card he got (the
    # last one is written just after its reply went back: settling waits for it).
    with grpc.insecure_channel(stack.target("engine")) as channel:
        settled = engine_pb2_grpc.EngineServiceStub(channel).SettleHistory(
            engine_pb2.SettleHistoryRequest(
                player=common_pb2.PlayerContext(player_id=f"{stack.server_id}/{PLAYER}")
            ),
            timeout=5,
            metadata=stack.credential("gateway"),
        )
    assert settled.settled
    with grpc.insecure_channel(stack.target("storage")) as channel:
        page = storage_pb2_grpc.StorageServiceStub(channel).ListHistory(
            storage_pb2.ListHistoryRequest(player_id=f"{stack.server_id}/{PLAYER}", page_size=20),
            timeout=5,
            metadata=stack.credential(),
        )
    texts = [entry.text for entry in page.entries if entry.role == common_pb2.HISTORY_ROLE_PLAYER]
    assert texts == ["帮助", "help", "/help"]
    answers = [e for e in page.entries if e.role == common_pb2.HISTORY_ROLE_ASSISTANT]
    assert all(e.result.card.template == "system:help" for e in answers)


def test_every_service_is_serving_with_metrics(stack: Stack) -> None:
    import urllib.request

    for spec in SERVICES:
        assert stack.health(spec.name) == "SERVING", spec.name
        with urllib.request.urlopen(
            f"http://127.0.0.1:{stack.metrics_port(spec.name)}/metrics"
        ) as r:
            assert b"grpc_server_handled_total" in r.read()


def test_every_service_lists_its_contract_by_reflection(stack: Stack) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def listed(target: str) -> set[str]:
        with grpc.insecure_channel(target) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            (answer,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
        return {service.name for service in answer.list_services_response.service}

    for spec in SERVICES:
        if spec.name == "gateway":
            continue
        assert {spec.health_name, "grpc.health.v1.Health"} <= listed(stack.target(spec.name))
    # The gateway's internal port lists the relay; its public port offers no reflection.
    assert "system.relay.v1.ToolRelayService" in listed(stack.target("gateway_internal"))
    with pytest.raises(grpc.RpcError) as refused:
        listed(stack.target("gateway"))
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_the_public_port_carries_the_game_server_contract_alone(stack: Stack) -> None:
    """The relay gives items to online players: it must not be reachable where game servers
    (or anyone else) connect, with or without a credential."""
    call = relay_pb2.CallGameToolRequest(call_id="c1", player_id=PLAYER, tool="minecraft:item.give")
    with (
        grpc.insecure_channel(stack.target("gateway")) as channel,
        pytest.raises(grpc.RpcError) as refused,
    ):
        relay_pb2_grpc.ToolRelayServiceStub(channel).CallGameTool(
            call, timeout=5, metadata=stack.credential("engine")
        )
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_internal_ports_require_a_credential_that_allows_the_call(stack: Stack) -> None:
    request = storage_pb2.ListHistoryRequest(player_id=PLAYER, page_size=1)
    with grpc.insecure_channel(stack.target("storage")) as channel:
        stub = storage_pb2_grpc.StorageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as missing:
            stub.ListHistory(request, timeout=5)
        assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in (missing.value.details() or "")
        with pytest.raises(grpc.RpcError) as wrong:
            stub.ListHistory(
                request, timeout=5, metadata=(("authorization", "Bearer not-a-real-token-at-all"),)
            )
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The router has a valid credential, but history is not its business.
        with pytest.raises(grpc.RpcError) as denied:
            stub.ListHistory(request, timeout=5, metadata=stack.credential("router"))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "router" in (denied.value.details() or "")
        stub.ListHistory(request, timeout=5, metadata=stack.credential("gateway"))
    # The relay: engine replicas only.
    call = relay_pb2.CallGameToolRequest(call_id="c1", player_id="nobody", tool="minecraft:x")
    with grpc.insecure_channel(stack.target("gateway_internal")) as channel:
        relay = relay_pb2_grpc.ToolRelayServiceStub(channel)
        with pytest.raises(grpc.RpcError) as missing:
            relay.CallGameTool(call, timeout=5)
        assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as denied:
            relay.CallGameTool(call, timeout=5, metadata=stack.credential("router"))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as offline:
            relay.CallGameTool(call, timeout=5, metadata=stack.credential("engine"))
        assert offline.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_request_id_travels_across_services(stack: Stack) -> None:
    """Each help request is logged by router, engine and storage under one id (its own
    requests: under xdist this test may run without the others of this module)."""
    import json

    client = GameServerClient(stack.target("gateway"), stack.server_id, stack.token)
    await client.connect()
    try:
        await client.join(OTHER_PLAYER, "Alex", "en_us")
        for _ in range(3):
            assert (await client.chat(OTHER_PLAYER, "help")).reply.module_id == "system:help"
    finally:
        await client.close()

    def ids(name: str, rpc: str) -> set[str]:
        lines = (stack.data_dir / "logs" / f"{name}.log").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.startswith("{")]
        return {
            r["request_id"] for r in records if r.get("rpc", "").endswith(rpc) and "request_id" in r
        }

    def shared() -> set[str]:
        return ids("router", "/Route") & ids("engine", "/Execute") & ids("storage", "/FinishRun")

    # Access logs are written in batches (at most 0.1 s late): give the last lines a moment.
    await wait_until(
        lambda: len(shared()) >= 3,
        interval=0.05,
        what=lambda: f"three request ids in every access log, shared: {shared()}",
    )


def _not_serving_or_gone(stack: Stack, name: str, seen: set[str]) -> bool:
    """True once the service answered NOT_SERVING (added to `seen`) or its process ended."""
    if stack.processes[name].process.poll() is not None:
        return True
    seen.add(stack.health(name, timeout=0.3))
    return "NOT_SERVING" in seen


def test_health_turns_not_serving_during_shutdown(tmp_path: Path) -> None:
    stack = Stack(tmp_path, drain_seconds=1.5)
    stack.start(timeout=60)
    try:
        for spec in SERVICES:
            proc = stack.processes[spec.name]
            proc.process.send_signal(signal.SIGTERM)
            seen: set[str] = set()
            wait_until_sync(
                functools.partial(_not_serving_or_gone, stack, spec.name, seen),
                interval=0.02,
                what=f"{spec.name} to drain or exit",
            )
            assert "NOT_SERVING" in seen, f"{spec.name} never answered NOT_SERVING: {seen}"
            assert proc.process.wait(10) == 0, f"{spec.name} did not exit cleanly"
    finally:
        stack.stop()


def test_make_run_say_prints_the_help_card(tmp_path: Path) -> None:
    done = make_run(tmp_path, "--say", "帮助")
    assert done.returncode == 0, done.stderr
    assert "助手帮助" in done.stdout and "/history" in done.stdout
    assert "stack ready in" in done.stderr


def test_make_run_typing_at_the_card_on_screen_presses_its_button(tmp_path: Path) -> None:
    """The simulator sends the last card as `Chat.viewing`, as a client that shows cards does:
    `claim it` at a mail's card claims its attachment; at the inbox (no claim button) it does
    not."""
    done = make_run(tmp_path, input="/mail\nclaim it\n/mail\n3\nclaim it\n:quit\n")
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split("─ Some iron for you\n", 1)
    assert "Attachment claimed" not in before and "Not claimed yet." in after
    assert after.count("Attachment claimed") == 1 and "Iron Ingot × 16" in after


def test_make_run_offline_model_answers_through_the_scripted_model(tmp_path: Path) -> None:
    # `make run MODEL=offline`: an unclear text reaches the model gateway, which asks the
    # in-process scripted server; it answers clarify, so a selection card comes back.
    done = make_run(tmp_path, "--say", "blorp zzz", "--offline-model")
    assert done.returncode == 0, done.stderr
    assert "offline scripted model at http://127.0.0.1:" in done.stderr
    assert '"model call ok"' in (tmp_path / "logs" / "model.log").read_text()


@pytest.mark.parametrize(
    ("module", "env", "config", "expected"),
    [
        ("router_service", {"SYSTEM_ROUTER_PORT": "99999"}, None, "port must be 0..65535"),
        (
            "engine_service",
            {"SYSTEM_ENGINE_EXECUTE_TIMEOUT_SECONDS": "soon"},
            None,
            "must be float",
        ),
        ("services.gateway", {"SYSTEM_GATEWAY_TOKENS": ""}, None, "no game-server token is set"),
        (
            "storage_service",
            {},
            "history_max_entries = 10\ncolour = 'blue'\n",
            "unknown setting(s) colour",
        ),
        ("services.model_gateway", {}, "port = [", "is not valid TOML"),
    ],
)
def test_a_service_refuses_bad_config_with_a_clear_message(
    tmp_path: Path, module: str, env: dict[str, str], config: str | None, expected: str
) -> None:
    args = [sys.executable, "-m", module]
    if config is not None:
        path = tmp_path / "bad.toml"
        path.write_text(config)
        args += ["--config", str(path)]
    base = {k: v for k, v in os.environ.items() if not k.startswith("SYSTEM_")}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "gen")])
    done = subprocess.run(
        args, cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert expected in done.stderr


def test_make_run_op_shows_the_administrators_commands_until_deop(tmp_path: Path) -> None:
    """`:op` makes Steve an operator, as a game server would say of him: the admin commands
    work and a language switch keeps them; `:deop` takes them away again."""
    done = make_run(
        tmp_path,
        "--language",
        "en_us",
        input=":op\n/routing\n:lang zh\n/knowledge\n:deop\n/routing\n:op 9\n:quit\n",
    )
    assert done.returncode == 0, done.stderr
    opped, deopped = done.stdout.split("permission level is now 0", 1)
    assert "Steve's permission level is now 4" in opped
    assert "Routing diagnostics" in opped and "知识条目：共享知识库" in opped
    assert "/routing 不是指令" in deopped
    assert "(a permission level is 0 to 4, for example :op 3)" in deopped
    # The prompt :quit was typed at is the last: none after it.
    assert done.stdout.rstrip().endswith("for example :op 3)\nSteve>")
