"""The scale-out bench's own bookkeeping, without a cluster (bench/scaleout.py): a simulated
game server moved back to its home gateway counts every purchase its connections charged, and
a request written on a stream that just ended is a failure a retry fixes, not a crash."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

from bench.scaleout import GameServer, Recorder


class _Connection:
    """A game server's connection to a gateway, as GameServer uses it: its stream ends before
    close() returns (the channel closes after the gateway finished the stream)."""

    def __init__(self) -> None:
        self.charged: Counter[str] = Counter()
        self._ended = asyncio.Event()

    async def connect(self, timeout: float) -> None:
        del timeout

    async def join(self, *args: Any) -> None:
        del args

    async def wait_closed(self) -> None:
        await self._ended.wait()

    async def close(self) -> None:
        self._ended.set()
        await asyncio.sleep(0.2)


def test_moving_home_keeps_what_every_connection_charged() -> None:
    async def scenario() -> tuple[Counter[str], bool]:
        server = GameServer("sim0", "token", 0, None, Recorder())  # type: ignore[arg-type]
        made: list[_Connection] = []

        def connection(gateway: int) -> _Connection:
            del gateway
            made.append(_Connection())
            return made[-1]

        server._client = connection  # type: ignore[method-assign,assignment]
        away = _Connection()
        away.charged["p"] = 2  # charged on the other gateway, after a failover
        server.client, server.on = away, 1  # type: ignore[assignment]
        server.connected.set()
        keeping = asyncio.create_task(server.keep_connected())
        await asyncio.sleep(0)  # it waits on the connection's end
        await server.move_home()
        await asyncio.wait_for(server.connected.wait(), 5)
        home = server.client
        assert isinstance(home, _Connection)
        home.charged["p"] = 3  # charged at home, after the move
        await server.stop()
        keeping.cancel()
        await asyncio.gather(keeping, return_exceptions=True)
        return server.charged, home is not away and server.on == 0

    charged, moved = asyncio.run(scenario())
    assert moved
    assert charged == Counter({"p": 5})


class _EndedOnce(_Connection):
    """A connection whose stream ended just as a request was written (the gateway killed):
    grpc.aio refuses the write with InvalidStateError; the next connection answers."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    async def chat(self, *args: Any, **kwargs: Any) -> gateway_pb2.PlayerResponse:
        del args, kwargs
        self.writes += 1
        if self.writes == 1:
            raise asyncio.InvalidStateError("RPC already finished.")
        return gateway_pb2.PlayerResponse(
            reply=gateway_pb2.Reply(
                result=common_pb2.AgentResult(status=common_pb2.RESULT_STATUS_SUCCEEDED)
            )
        )


def test_a_request_written_on_an_ended_stream_is_unavailable_and_retried() -> None:
    async def scenario() -> tuple[Any, Recorder]:
        recorder = Recorder()
        server = GameServer("sim0", "token", 0, None, recorder)  # type: ignore[arg-type]
        server.client = _EndedOnce()  # type: ignore[assignment]
        server.connected.set()
        answer = await server._attempt("help", lambda c: c.chat("p", "help"))
        return answer, recorder

    answer, recorder = asyncio.run(scenario())
    assert answer is not None
    assert recorder.fixed == Counter({"UNAVAILABLE": 1})
    assert not recorder.unfixed
