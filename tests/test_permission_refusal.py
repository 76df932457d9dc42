"""A module the player may not use (issue 18): the engine answers a FAILED result, not an
error, with the failure key, the message in the player's language and the module in
`Failure.args`, so a client can translate it with its argument. Through the engine's real
gRPC server in the in-process chain, in zh and en, for the admin command `system:routing`
asked by an ordinary player (a button of a card shown before they lost the level, say)."""

from __future__ import annotations

import pathlib

import pytest
from system.common.v1 import common_pb2
from system.engine.v1 import engine_pb2, engine_pb2_grpc

from tests.inprocess import SERVER_ID, running_chain

FAILED = common_pb2.RESULT_STATUS_FAILED


@pytest.mark.parametrize(
    ("language", "message"),
    [("zh", "你没有权限使用 system:routing。"), ("en", "You may not use system:routing.")],
)
async def test_a_module_the_player_may_not_use_is_refused_in_their_language_with_args(
    tmp_path: pathlib.Path, language: str, message: str
) -> None:
    async with running_chain(tmp_path) as chain:
        engine = engine_pb2_grpc.EngineServiceStub(chain.channel("engine"))
        player = common_pb2.PlayerContext(
            server_id=SERVER_ID,
            player_id=f"{SERVER_ID}/steve",
            player_name="Steve",
            language=language,
            permission_level=0,
        )
        request = engine_pb2.ExecuteRequest(
            player=player,
            action=common_pb2.ModuleAction(module_id="system:routing"),
            source=engine_pb2.ROUTE_SOURCE_BUTTON,
        )
        answer = await engine.Execute(request, timeout=10)
        result = answer.result
        assert result.status == FAILED
        assert result.failure.key == "system.error.permission_denied"
        assert result.failure.message == message
        assert dict(result.failure.args) == {"module_id": "system:routing"}
        # An administrator is served by the same call.
        request.player.permission_level = 3
        served = await engine.Execute(request, timeout=10)
        assert served.result.status == common_pb2.RESULT_STATUS_SUCCEEDED, served
