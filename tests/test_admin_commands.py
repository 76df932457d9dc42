"""The administrators' in-game commands end to end (issue 18): `/system routing` and
`/system reload` through the gateway, router and engine, in zh and en, and their absence for an
ordinary player."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re

import grpc
import pytest
from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2
from system.relay.v1 import relay_pb2

from services.gamesim.client import GameServerClient
from services.model_testserver import FakeOpenAIServer
from tests.inprocess import HoldingClient, running_chain
from tests.waiting import holds_for, wait_until

SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED


def card_lines(result: common_pb2.AgentResult) -> list[str]:
    return [line.text for line in result.card.lines]


async def join_admins_and_steve(client: GameServerClient) -> None:
    """op (admin level 3, en), zhop (level 4, zh) and steve (an ordinary player, en)."""
    await client.join("op", "Op", "en_us", permission_level=3)
    await client.join("zhop", "Zhop", "zh_cn", permission_level=4)
    await client.join("steve", "Steve", "en_us")


async def says_hello(
    client: GameServerClient, fake: FakeOpenAIServer, player: str, prompt_tokens: int = 40
) -> None:
    """`player` chats once: the router's model call (clarify), then the chat's own
    (`prompt_tokens` in, 5 out)."""
    fake.script(json.dumps({"capabilityId": "clarify", "arguments": {}}))
    fake.script(f"Hello {player}!", prompt_tokens=prompt_tokens, completion_tokens=5)
    assert (await client.chat(player, "hello there")).reply.module_id == "system:chat"


def priced_providers(tmp_path: pathlib.Path, fake: FakeOpenAIServer, key_env: str) -> str:
    """A providers file: `fake` as the one route, priced 1000 per million input tokens and
    2000 per million output tokens, its key read from `key_env`."""
    providers = tmp_path / "providers.toml"
    providers.write_text(
        f'[providers.fake]\npreset = "custom"\nbase_url = "{fake.base_url}"\n'
        f'api_key_env = "{key_env}"\n[providers.fake.models]\n'
        "m = { input_per_million = 1000.0, output_per_million = 2000.0 }\n"
        '[routes]\ndefault = ["fake/m"]\n'
    )
    return str(providers)


async def test_an_admin_sees_routing_diagnostics_and_an_ordinary_player_does_not(
    tmp_path: pathlib.Path,
) -> None:
    async with running_chain(tmp_path, credentials=True) as chain:
        client = await chain.client()
        await join_admins_and_steve(client)
        assert (await client.chat("op", "help")).reply.result.status == SUCCEEDED
        await client.chat("op", "what is in my inventory")  # a local route, counted

        shown = (await client.chat("op", "/system routing")).reply.result
        assert shown.status == SUCCEEDED and shown.card.title == "Routing diagnostics"
        lines = card_lines(shown)
        assert lines[0].startswith("Mode ENFORCE, ready;")
        assert lines[1].startswith("By source: COMMAND 2, LOCAL 1")  # help; the inventory text
        assert lines[2].startswith("Gates and fallback reasons: ")
        # The last local match: its top candidates by module and score, and what stopped it.
        assert lines[3].startswith("Last local match: system:inventory (score ")
        assert lines[4].startswith("Candidates: system:inventory ")
        assert lines[5] == "Gate that stopped it: none (it routed)"
        assert "what is in my inventory" not in " ".join(lines)  # never the text
        zh = (await client.chat("zhop", "/system 路由诊断")).reply.result
        assert zh.status == SUCCEEDED and zh.card.title == "路由诊断"
        assert card_lines(zh)[0].startswith("模式 ENFORCE")

        refused = (await client.chat("steve", "/system routing")).reply.result
        assert refused.status != SUCCEEDED
        assert refused.failure.key == "system.error.unknown_command"
        helped = card_lines((await client.chat("steve", "/help")).reply.result)
        assert not any("/routing" in line or "/reload" in line for line in helped)


async def test_reload_applies_an_edited_semantic_config_and_names_a_bad_key(
    tmp_path: pathlib.Path,
) -> None:
    semantic = tmp_path / "config" / "system-semantic.json"
    async with running_chain(tmp_path, router_settings={"semantic_config": str(semantic)}) as chain:
        assert json.loads(semantic.read_text(encoding="utf-8"))["mode"] == "ENFORCE"  # written
        client = await chain.client()
        await client.join("op", "Op", "en_us", permission_level=3)

        document = json.loads(semantic.read_text(encoding="utf-8"))
        document["minCoverage"] = 0.95
        semantic.write_text(json.dumps(document), encoding="utf-8")
        done = (await client.chat("op", "/system reload")).reply.result
        assert done.status == SUCCEEDED and done.card.title == "Configuration reloaded"
        assert any(
            line.startswith("Applied: ") and "minCoverage" in line for line in card_lines(done)
        )
        assert chain.apps["router"].router.config.min_coverage == 0.95

        document["scorer"] = {"mode": "loud"}
        semantic.write_text(json.dumps(document), encoding="utf-8")
        broken = (await client.chat("op", "/system reload")).reply.result
        assert broken.status == SUCCEEDED
        (error,) = [line for line in card_lines(broken) if "was not reloaded" in line]
        assert "scorer.mode" in error and "the previous settings stay in force" in error
        assert chain.apps["router"].router.config.min_coverage == 0.95  # still the last good one


async def test_an_admin_reads_a_players_usage_and_an_ordinary_player_cannot(
    tmp_path: pathlib.Path,
) -> None:
    with FakeOpenAIServer(api_key="usage-test-key") as fake:
        async with running_chain(tmp_path, model=fake) as chain:
            client = await chain.client()
            await join_admins_and_steve(client)
            await says_hello(client, fake, "steve")

            async def settled() -> list[str] | None:
                shown = (await client.chat("op", "/system usage steve")).reply.result
                assert shown.status == SUCCEEDED and shown.card.title == "Usage of steve"
                lines = card_lines(shown)
                return lines if lines[-1].startswith("Last 7 days: 2 model calls,") else None

            # The model gateway settles metered use in batches, a moment after the calls.
            lines = await wait_until(settled, timeout=10, what="steve's two model calls settled")
            assert "web searches" in lines[0]
            mine = (await client.chat("zhop", "/system 用量")).reply.result
            assert mine.card.title == "zhop 的用量"
            assert card_lines(mine) == ["近 7 天没有用量。"]
            bad = (await client.chat("op", "/system usage other/steve")).reply.result
            assert bad.failure.key == "system.error.invalid_input"

            refused = (await client.chat("steve", "/system usage op")).reply.result
            assert refused.failure.key == "system.error.unknown_command"

            # The whole server: every player's use summed per day.
            await client.join("alex", "Alex", "en_us")
            await says_hello(client, fake, "alex", prompt_tokens=30)

            async def server_settled() -> list[str] | None:
                shown = (await client.chat("op", "/system usage *")).reply.result
                assert shown.card.title == "Usage of every player on this server"
                lines = card_lines(shown)
                return lines if lines[-1].startswith("Last 7 days: 4 model calls,") else None

            await wait_until(server_settled, timeout=10, what="alex's calls in the server's sum")
            assert (
                (await client.chat("op", "/system usage steve"))
                .reply.result.card.lines[-1]
                .text.startswith("Last 7 days: 2 model calls,")
            )


async def test_a_revoked_player_is_refused_at_once_and_after_a_reconnect_until_granted(
    tmp_path: pathlib.Path,
) -> None:
    async with running_chain(tmp_path, credentials=True) as chain:
        client = await chain.client()
        await client.join("op", "Op", "en_us", permission_level=3)
        await client.join("steve", "Steve", "zh_cn")
        await client.join("alex", "Alex", "en_us")
        assert (await client.chat("steve", "/help")).reply.result.status == SUCCEEDED

        # An ordinary player cannot revoke anyone.
        refused = (await client.chat("alex", "/system revoke steve")).reply.result
        assert refused.failure.key == "system.error.unknown_command"

        done = (await client.chat("op", "/system revoke steve")).reply.result
        assert done.status == SUCCEEDED and done.card.title == "Revoked steve"
        assert card_lines(done) == ["In force at once on the player's game server."]
        frame = await asyncio.wait_for(client.notices.get(), 5)  # unsolicited: the change
        assert frame.player_id == "steve" and frame.WhichOneof("body") == "binding"
        assert frame.binding.change == gateway_pb2.BINDING_CHANGE_REVOKED
        for text in ("/help", "帮助", "/system settings"):
            answer = (await client.chat("steve", text)).reply.result
            assert answer.failure.key == "system.error.permission_denied", text
            assert answer.failure.message == "管理员已停用你使用助手的权限。"  # in his language
        assert (await client.chat("alex", "/help")).reply.result.status == SUCCEEDED

        # His game events are refused too: an advancement gives a revoked player nothing.
        await client.event(
            "steve",
            "minecraft:advancement",
            "adv-1",
            {"advancement": "minecraft:story/mine_diamond"},
        )
        await wait_until(lambda: client.frame_errors, what="the event refused")
        refusal = client.frame_errors[-1]
        assert refusal.request_id == "adv-1" and "revoked" in refusal.message
        assert refusal.code == grpc.StatusCode.PERMISSION_DENIED.value[0]

        # A reconnect does not undo it: the gateway reads the binding from storage.
        again = await chain.client()
        await again.join("steve", "Steve", "zh_cn")
        answer = (await again.chat("steve", "/help")).reply.result
        assert answer.failure.key == "system.error.permission_denied"

        await again.join("op", "Op", "en_us", permission_level=3)
        granted = (await again.chat("op", "/system grant steve")).reply.result
        assert granted.card.title == "Granted steve"
        assert (await again.chat("steve", "/help")).reply.result.status == SUCCEEDED
        # An offline player hears it when they join.
        later = (await again.chat("op", "/system revoke nobody")).reply.result
        assert card_lines(later) == ["The player is offline: in force when they next join."]
        # An offline revoked player's events are refused as well: their binding is read.
        await again.event(
            "nobody",
            "minecraft:advancement",
            "adv-2",
            {"advancement": "minecraft:story/mine_diamond"},
        )
        await wait_until(lambda: again.frame_errors, what="the offline player's event refused")
        assert again.frame_errors[-1].request_id == "adv-2"
        bad = (await again.chat("op", "/system revoke a/b")).reply.result
        assert bad.failure.key == "system.error.invalid_input"


async def test_web_search_granted_to_one_player_holds_at_once_and_its_loss_stops_his_run(
    tmp_path: pathlib.Path,
) -> None:
    async with running_chain(tmp_path, credentials=True) as chain:
        client = await chain.client(kind=HoldingClient)
        assert isinstance(client, HoldingClient)
        await client.join("op", "Op", "en_us", permission_level=3)
        await client.join("steve", "Steve", "en_us")
        await client.join("alex", "Alex", "en_us")

        async def offers_search(player: str) -> bool:
            shown = (await client.chat(player, "/help")).reply.result
            return any(line.startswith("/search ") for line in card_lines(shown))

        assert not await offers_search("steve")  # the server does not offer it to everyone
        refused = (await client.chat("steve", "/system search-on steve")).reply.result
        assert refused.failure.key == "system.error.unknown_command"

        done = (await client.chat("op", "/system search-on steve")).reply.result
        assert done.status == SUCCEEDED and done.card.title == "Web search on for steve"
        assert card_lines(done) == ["In force at once on the player's game server."]
        assert await offers_search("steve")
        assert not await offers_search("alex")  # his alone

        # Taken back while a request of his runs: that request stops, nothing runs on with it.
        client.hold.add("steve")
        running = asyncio.ensure_future(client.chat("steve", "/inventory"))
        await asyncio.wait_for(client.held.wait(), 10)
        off = (await client.chat("op", "/system 关闭联网 steve")).reply.result
        assert off.status == SUCCEEDED and off.card.title == "Web search off for steve"
        answered = await asyncio.wait_for(running, 10)
        assert answered.reply.result.failure.key == "system.error.cancelled"
        client.hold.clear()
        assert not await offers_search("steve")

        # Kept in storage: a reconnect reads the player's grants again.
        await client.chat("op", "/system search-on steve")
        again = await chain.client()
        await again.join("steve", "Steve", "en_us")
        shown = (await again.chat("steve", "/help")).reply.result
        assert any(line.startswith("/search ") for line in card_lines(shown))


async def test_a_lowered_permission_level_stops_the_players_running_request(
    tmp_path: pathlib.Path,
) -> None:
    async with running_chain(tmp_path, credentials=True) as chain:
        client = await chain.client(kind=HoldingClient)
        assert isinstance(client, HoldingClient)
        await client.join("op", "Op", "en_us", permission_level=3)
        client.hold.add("op")
        running = asyncio.ensure_future(client.chat("op", "/inventory"))
        await asyncio.wait_for(client.held.wait(), 10)
        await client.update("op", "en_us", permission_level=4)  # raised: nothing stops
        await holds_for(lambda: not running.done(), 0.3)
        await client.update("op", "en_us", permission_level=0)
        answered = await asyncio.wait_for(running, 10)
        assert answered.reply.result.failure.key == "system.error.cancelled"
        client.hold.clear()
        refused = (await client.chat("op", "/system routing")).reply.result
        assert refused.failure.key == "system.error.unknown_command"


async def test_the_admin_level_is_configured_once_and_the_router_follows_it(
    tmp_path: pathlib.Path,
) -> None:
    async with running_chain(
        tmp_path, credentials=True, engine_settings={"admin_permission_level": 2}
    ) as chain:
        client = await chain.client()
        await client.join("mod", "Mod", "en_us", permission_level=2)
        await client.join("steve", "Steve", "en_us", permission_level=1)
        await client.chat("mod", "help")  # the router has read the catalogue
        shown = (await client.chat("mod", "/system routing")).reply.result
        assert shown.status == SUCCEEDED and shown.card.title == "Routing diagnostics"
        refused = (await client.chat("steve", "/system routing")).reply.result
        assert refused.failure.key == "system.error.unknown_command"


def test_an_admin_level_outside_the_games_levels_stops_the_start() -> None:
    import pytest

    from engine_service.config import EngineConfig
    from services.runtime.config import ConfigError

    with pytest.raises(ConfigError, match="admin_permission_level must be 0..4"):
        EngineConfig(admin_permission_level=5).validate()


async def test_an_admin_sees_the_servers_spend_and_an_ordinary_player_does_not(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`/system spend` (花费): the server's spend today and this month by player, module and
    provider, the network's, and the server budget against its limit; `/system usage` shows
    the money too. Through the gateway, router, engine, a priced model gateway and storage."""
    monkeypatch.setenv("SPEND_TEST_KEY", "spend-test-key")
    with FakeOpenAIServer(api_key="spend-test-key") as fake:
        providers = priced_providers(tmp_path, fake, "SPEND_TEST_KEY")
        budgets = tmp_path / "budgets.toml"
        budgets.write_text("[server]\ndaily_cost = 100.0\n")
        settings = {"providers_file": providers, "budgets_file": str(budgets)}
        async with running_chain(tmp_path, model=fake, model_settings=settings) as chain:
            client = await chain.client()
            await join_admins_and_steve(client)
            await says_hello(client, fake, "steve")

            async def spent() -> list[str] | None:
                shown = (await client.chat("op", "/system spend")).reply.result
                assert shown.status == SUCCEEDED, shown
                lines = card_lines(shown)
                return [shown.card.title, *lines] if "By module" in " ".join(lines) else None

            # The model gateway settles metered use in batches, a moment after the calls.
            title, *lines = await wait_until(spent, timeout=10, what="steve's spend settled")
            print("\n".join([title, *lines]))
            assert title.startswith("Spend on this server today (")
            # Steve's chat (45 tokens) and the router's model call before it (no module named).
            assert re.fullmatch(r"This server: \d+ tokens, cost [\d.]+", lines[0])
            assert lines[1].startswith("Whole network: ")
            assert lines[2].startswith("By player (1 in all): steve ")
            assert "system:chat 45 tokens / 0.05" in lines[3]  # 40 * 1000 + 5 * 2000 micros
            assert lines[4].startswith("By provider: fake ")
            spent = re.fullmatch(r"This server: \d+ tokens, cost ([\d.]+)", lines[0])
            assert spent is not None
            assert lines[5].startswith(f"Budget server_daily_cost: {spent[1]} spent, ")
            assert lines[5].endswith(" % taken)") and " held, of 100 (" in lines[5]
            usage = card_lines((await client.chat("op", "/system usage steve")).reply.result)
            assert f"cost {spent[1]}," in usage[-1]

            zh = (await client.chat("zhop", "/system 花费 本月")).reply.result
            assert zh.status == SUCCEEDED and zh.card.title.startswith("本服本月花费（")
            print("\n".join([zh.card.title, *card_lines(zh)]))
            assert card_lines(zh)[2].startswith("按玩家（共 1 人）：steve ")
            assert any(line.startswith("按服务商：fake ") for line in card_lines(zh))

            bad = (await client.chat("op", "/system spend yesterday")).reply.result
            assert bad.failure.key == "system.error.invalid_input"
            assert "say today or month" in bad.failure.message
            refused = (await client.chat("steve", "/system spend")).reply.result
            assert refused.failure.key == "system.error.unknown_command"
            helped = card_lines((await client.chat("steve", "/help")).reply.result)
            assert not any("/spend" in line for line in helped)


async def test_a_budget_alert_reaches_the_online_admins_in_game(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget past its `alert_percent` logs and notifies, once per budget and period, the
    players at or above the admin level on the game server (the network's budget: on every
    game server), each in their language, through the gateway's NotifyPlayer; an ordinary
    player gets nothing. Real services on loopback, with service credentials."""
    monkeypatch.setenv("ALERT_TEST_KEY", "alert-test-key")
    with FakeOpenAIServer(api_key="alert-test-key") as fake:
        providers = priced_providers(tmp_path, fake, "ALERT_TEST_KEY")
        budgets = tmp_path / "budgets.toml"
        # A lease holds 16,384 tokens and more at once: the first reservation passes 10 % of
        # the server's budget and 1 % of the network's (network budgets: every game server).
        budgets.write_text(
            "[server]\ndaily_tokens = 100000\nalert_percent = 10\n"
            "[network]\ndaily_tokens = 1000000\nalert_percent = 1\n"
        )
        settings = {"providers_file": providers, "budgets_file": str(budgets)}
        async with running_chain(
            tmp_path, credentials=True, model=fake, model_settings=settings
        ) as chain:
            client = await chain.client()
            await join_admins_and_steve(client)
            for _ in range(2):
                await says_hello(client, fake, "steve")
            notices = chain.apps["model"].notices
            await notices.drain()
            # Once per budget and period: the second chat sent none.
            assert notices.sent == 2
            got: dict[tuple[str, str], gateway_pb2.PlayerResponse] = {}
            while len(got) < 4:
                frame = await asyncio.wait_for(client.notices.get(), 5)
                budget = frame.notice.result.card.lines[0].text.split()[1].split("（")[0]
                got[(frame.player_id, budget)] = frame
            assert client.notices.empty()
            assert set(got) == {  # not steve
                (player, budget)
                for player in ("op", "zhop")
                for budget in ("server_daily_tokens", "network_daily_tokens")
            }
            network = got[("op", "network_daily_tokens")].notice.result.card.lines[0].text
            assert network.startswith("Budget network_daily_tokens passed 1 % for ")
            en = got[("op", "server_daily_tokens")].notice.result.card
            assert en.title == "Budget alert"
            assert en.lines[0].text.startswith(
                f"Budget server_daily_tokens of {chain.server_id} passed 10 % for "
            )
            assert en.lines[0].text.endswith(" / 100000 tokens used or held.")
            assert en.lines[1].suggest_command == "/system spend"
            zh = got[("zhop", "server_daily_tokens")].notice.result.card
            assert zh.title == "预算提醒"
            assert zh.lines[0].text.startswith(f"预算 server_daily_tokens（{chain.server_id}）在 ")

            # The relay's checks of such a notice.
            relay = chain.relay_stub()
            for wrong, says in (
                ({"min_permission_level": 5}, "min_permission_level must be 1..4"),
                ({"every_server": True}, "min_permission_level must be 1..4"),
                (
                    {"min_permission_level": 3, "features_changed": True},
                    "changes no binding or features",
                ),
            ):
                request = relay_pb2.NotifyPlayerRequest(
                    player_id=f"{chain.server_id}/op",
                    result=common_pb2.AgentResult(status=SUCCEEDED),
                    **wrong,
                )
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await relay.NotifyPlayer(request, timeout=5)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert says in (caught.value.details() or "")
            request = relay_pb2.NotifyPlayerRequest(
                player_id=f"{chain.server_id}/op",
                result=common_pb2.AgentResult(status=SUCCEEDED),
                min_permission_level=4,
                every_server=True,
            )
            request.results_by_language["fr"].status = SUCCEEDED
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await relay.NotifyPlayer(request, timeout=5)
            assert "keys are zh and en" in (caught.value.details() or "")
            del request.results_by_language["fr"]
            answer = await relay.NotifyPlayer(request, timeout=5)
            assert answer.notified == 1  # zhop alone is at level 4
            assert (await asyncio.wait_for(client.notices.get(), 5)).player_id == "zhop"
