"""The router's model call is metered as `system:router` (issue 21): its spend shows under that module
in storage's spend view beside the module the engine ran, and a providers file's
`[routes] "system:router" = [...]` gives it a model list of its own. Real services on loopback."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from system.common.v1 import catalog_pb2, common_pb2
from system.model.v1 import model_pb2
from system.storage.v1 import player_data_pb2, player_data_pb2_grpc

from router_service.model_routing import ROUTING_MODULE_ID, ModelRouter
from services.model_testserver import FakeOpenAIServer
from tests.inprocess import SERVER_ID, running_chain

KEY = "router-spend-key"


async def test_the_routing_call_is_metered_as_router_on_its_own_route(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROUTER_SPEND_KEY", KEY)
    with FakeOpenAIServer(api_key=KEY) as fake:
        providers = tmp_path / "providers.toml"
        provider = (
            f'preset = "custom"\nbase_url = "{fake.base_url}"\napi_key_env = "ROUTER_SPEND_KEY"\n'
        )
        providers.write_text(
            f"[providers.main]\n{provider}[providers.main.models]\n"
            "m = { input_per_million = 1000.0, output_per_million = 2000.0 }\n"
            f"[providers.cheap]\n{provider}[providers.cheap.models]\n"
            "c = { input_per_million = 100.0, output_per_million = 200.0 }\n"
            f'[routes]\ndefault = ["main/m"]\n"{ROUTING_MODULE_ID}" = ["cheap/c"]\n'
        )
        settings = {"providers_file": str(providers)}
        async with running_chain(tmp_path, model=fake, model_settings=settings) as chain:
            client = await chain.client()
            await client.join("steve", "Steve", "en_us")
            # The routing call (the model says clarify), then the chat module's own call.
            fake.script(
                json.dumps({"capabilityId": "clarify", "arguments": {}}),
                prompt_tokens=300,
                completion_tokens=10,
            )
            fake.script("Hello Steve!", prompt_tokens=40, completion_tokens=5)
            assert (await client.chat("steve", "hello there")).reply.module_id == "system:chat"
            await chain.apps["model"].meter.drain()
            channel = chain.channel("storage")
            view = await player_data_pb2_grpc.PlayerDataServiceStub(channel).GetSpend(
                player_data_pb2.GetSpendRequest(scope=SERVER_ID), timeout=5
            )
    # 300 prompt tokens at 100 per million are 30,000 micros, 10 answer tokens at 200: 2,000.
    assert [(m.name, m.tokens, m.cost_micros) for m in view.modules] == [  # dearest first
        ("system:chat", 45, 40 * 1000 + 5 * 2000),
        (ROUTING_MODULE_ID, 310, 32_000),
    ]
    assert [(p.name, p.tokens) for p in view.providers] == [("main", 45), ("cheap", 310)]
    assert [(p.name, p.tokens) for p in view.players] == [(f"{SERVER_ID}/steve", 355)]


class _Capture:
    """A model gateway stub that records the request and answers `clarify`."""

    def __init__(self) -> None:
        self.requests: list[model_pb2.CompleteRequest] = []

    async def Complete(self, request: model_pb2.CompleteRequest, **_: Any) -> Any:
        self.requests.append(request)
        return model_pb2.CompleteResponse(content='{"capabilityId": "clarify"}')


async def test_the_routing_call_carries_the_module_id_and_the_players_level() -> None:
    """The player's permission level picks their rank's budget, as for the engine's calls."""
    stub = _Capture()
    player = common_pb2.PlayerContext(player_id="sim/op", language="en", permission_level=3)
    module = catalog_pb2.ModuleDescriptor(
        module_id="system:help", interactive=True, routing_mode=catalog_pb2.ROUTING_MODE_READ
    )
    choice = await ModelRouter(stub).choose(player, "hi", [module])  # type: ignore[arg-type]
    assert choice is not None and choice.module_id == "clarify"
    [request] = stub.requests
    assert (request.module_id, request.permission_level) == (ROUTING_MODULE_ID, 3)
    assert request.player_id == "sim/op"
