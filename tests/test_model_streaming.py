"""Complete streams from the provider: the first-token and total timeouts, retries only before
output and within the deadline, broken and unfinished streams, tool calls, JSON mode and the
cache-token usage. The gateway runs in-process on port 0; the real `openai` client streams
from the local test server."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import grpc
import httpx2
import openai
import pytest
from system.model.v1 import model_pb2

from services.model_gateway.chat import (
    ChatMessage,
    ChatRequest,
    Limits,
    ToolCall,
    ToolChoice,
    ToolSpec,
)
from services.model_gateway.failures import failure_for
from services.model_gateway.streaming import AttemptFailed, stream_once
from services.model_testserver import FakeOpenAIServer
from services.results import AgentFailure
from tests.model_gateways import Gateway, gateways

KEY = "test-key"
USER = model_pb2.MESSAGE_ROLE_USER
SYSTEM = model_pb2.MESSAGE_ROLE_SYSTEM
ASSISTANT = model_pb2.MESSAGE_ROLE_ASSISTANT
TOOL = model_pb2.MESSAGE_ROLE_TOOL

SEARCH_TOOL = model_pb2.Tool(
    name="web_search",
    description="Search the web.",
    parameters_json=json.dumps(
        {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
    ),
)


def _request(*texts: str, **fields: Any) -> model_pb2.CompleteRequest:
    messages = [model_pb2.ChatMessage(role=USER, content=t) for t in texts or ("hello",)]
    return model_pb2.CompleteRequest(messages=messages, **{"player_id": "p1", **fields})


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key=KEY) as server:
        yield server


@pytest.fixture
async def gateway(fake: FakeOpenAIServer) -> AsyncIterator[Gateway]:
    async with gateways(base_url=fake.base_url, api_key=KEY, retry_backoff_seconds=0.01) as start:
        yield start


async def _fails(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


# -- timeouts ------------------------------------------------------------------------------


async def test_first_token_timeout(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway(first_token_timeout_seconds=0.3, request_timeout_seconds=5)
    fake.script(content="late", delay=3)
    started = time.monotonic()
    error = await _fails(stub.Complete(_request(), timeout=10))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "sent no token within 0.3 s" in error.details()
    assert time.monotonic() - started < 2
    assert len(fake.completions) == 1  # a timeout is not retried


async def test_total_timeout_after_the_first_token(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    """Tokens keep coming but too slowly: the total timeout ends the call, not the first."""
    stub = await gateway(first_token_timeout_seconds=0.4, request_timeout_seconds=0.8)
    fake.script(content="x" * 80, chunk_chars=8, chunk_delay=0.2)  # ~2 s for the whole answer
    started = time.monotonic()
    error = await _fails(stub.Complete(_request(), timeout=10))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not finish within 0.8 s" in error.details()
    assert 0.7 < time.monotonic() - started < 2
    assert len(fake.completions) == 1


async def test_slow_stream_within_the_total_timeout_succeeds(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    # Each gap is under the first-token timeout; the whole is under the total.
    stub = await gateway(first_token_timeout_seconds=0.3, request_timeout_seconds=5)
    fake.script(content="y" * 40, chunk_chars=8, chunk_delay=0.1)
    response = await stub.Complete(_request(), timeout=10)
    assert response.content == "y" * 40


# -- retries -------------------------------------------------------------------------------


async def test_retries_429_and_5xx_before_output(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway()
    fake.script(status=500)
    fake.script(status=429)
    fake.script(content="third time lucky")
    response = await stub.Complete(_request(), timeout=10)
    assert response.content == "third time lucky"
    assert response.attempts == 3
    assert len(fake.completions) == 3


async def test_retries_a_connection_dropped_before_any_token(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway()
    fake.script(content="lost", drop_after_chunks=1)  # the role chunk only: no token yet
    fake.script(content="found")
    response = await stub.Complete(_request(), timeout=10)
    assert (response.content, response.attempts) == ("found", 2)


async def test_gives_up_after_max_attempts(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway(max_attempts=2)
    for _ in range(3):
        fake.script(status=503)
    error = await _fails(stub.Complete(_request(), timeout=10))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "HTTP 503" in error.details()
    assert len(fake.completions) == 2


async def test_no_retry_that_cannot_finish_before_the_deadline(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway(retry_backoff_seconds=2.0)
    fake.script(status=429)
    fake.script(content="never asked")
    started = time.monotonic()
    error = await _fails(stub.Complete(_request(), timeout=1.0))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rate-limited" in error.details()
    assert time.monotonic() - started < 0.9
    assert len(fake.completions) == 1


@pytest.mark.parametrize("status", [400, 401, 404])
async def test_other_errors_are_not_retried(
    gateway: Gateway, fake: FakeOpenAIServer, status: int
) -> None:
    stub = await gateway()
    fake.script(status=status)
    await _fails(stub.Complete(_request(), timeout=5))
    assert len(fake.completions) == 1


async def test_outage_mid_stream_is_not_retried(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    """Tokens had arrived (and are billed): the call fails instead of paying twice."""
    stub = await gateway()
    fake.script(content="the answer is forty", chunk_chars=4, drop_after_chunks=3)
    fake.script(content="must not be used")
    error = await _fails(stub.Complete(_request(), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "after the answer had begun" in error.details()
    assert len(fake.completions) == 1
    assert failure_for(error.code(), web=False) is AgentFailure.MODEL_UNAVAILABLE


async def test_stream_without_finish_reason_is_a_failure(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway()
    fake.script(content="cut short", finish=False)
    error = await _fails(stub.Complete(_request(), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "without a finish reason" in error.details()
    assert len(fake.completions) == 1


# -- usage, tools, JSON --------------------------------------------------------------------


async def test_cache_hit_and_miss_tokens_are_reported(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway()
    fake.script(
        content="ok",
        prompt_tokens=40,
        completion_tokens=2,
        prompt_cache_hit_tokens=32,
        prompt_cache_miss_tokens=8,
    )
    usage = (await stub.Complete(_request(), timeout=5)).usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (40, 2)
    assert (usage.prompt_cache_hit_tokens, usage.prompt_cache_miss_tokens) == (32, 8)


async def test_tool_calls_pass_through(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway()
    arguments = json.dumps({"query": "钻石剑 合成"}, ensure_ascii=False)
    fake.script(
        content="",
        finish_reason="tool_calls",
        tool_calls=[{"id": "call_1", "function": {"name": "web_search", "arguments": arguments}}],
    )
    request = _request(
        "怎么合成钻石剑?",
        tools=[SEARCH_TOOL],
        tool_choice=model_pb2.ToolChoice(
            mode=model_pb2.TOOL_CHOICE_MODE_TOOL, tool_name="web_search"
        ),
    )
    response = await stub.Complete(request, timeout=5)
    assert response.finish_reason == "tool_calls"
    [call] = response.tool_calls
    assert (call.id, call.name, json.loads(call.arguments_json)) == (
        "call_1",
        "web_search",
        {"query": "钻石剑 合成"},
    )
    sent = fake.completions[-1].json
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "web_search",
                "description": "Search the web.",
                "parameters": json.loads(SEARCH_TOOL.parameters_json),
            },
        }
    ]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "web_search"}}

    # The next round sends the call and its result back.
    fake.script(content="用钻石和木棍合成。")
    follow_up = model_pb2.CompleteRequest(
        player_id="p1",
        messages=[
            model_pb2.ChatMessage(role=USER, content="怎么合成钻石剑?"),
            model_pb2.ChatMessage(role=ASSISTANT, tool_calls=[call]),
            model_pb2.ChatMessage(role=TOOL, tool_call_id="call_1", content="2 钻石 + 1 木棍"),
        ],
        tools=[SEARCH_TOOL],
    )
    assert (await stub.Complete(follow_up, timeout=5)).content == "用钻石和木棍合成。"
    messages = fake.completions[-1].json["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "web_search", "arguments": arguments},
            }
        ],
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "2 钻石 + 1 木棍"}


async def test_json_response_format_passes_through(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway()
    fake.script(content='{"capabilityId": "system:help"}')
    request = model_pb2.CompleteRequest(
        messages=[
            model_pb2.ChatMessage(role=SYSTEM, content="Answer with one JSON object."),
            model_pb2.ChatMessage(role=USER, content="help"),
        ],
        response_format=model_pb2.RESPONSE_FORMAT_JSON_OBJECT,
        tool_choice=model_pb2.ToolChoice(),
    )
    response = await stub.Complete(request, timeout=5)
    assert json.loads(response.content) == {"capabilityId": "system:help"}
    assert fake.completions[-1].json["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"tools": [model_pb2.Tool(name="bad name")]}, "tools[0].name"),
        ({"tools": [SEARCH_TOOL, SEARCH_TOOL]}, "given twice"),
        (
            {"tools": [model_pb2.Tool(name="t", parameters_json="{nope")]},
            "tools[0].parameters_json is not JSON",
        ),
        (
            {"tools": [model_pb2.Tool(name="t", parameters_json="[1]")]},
            "JSON Schema object",
        ),
        (
            {"tool_choice": model_pb2.ToolChoice(mode=model_pb2.TOOL_CHOICE_MODE_AUTO)},
            "tools is empty",
        ),
        (
            {
                "tools": [SEARCH_TOOL],
                "tool_choice": model_pb2.ToolChoice(
                    mode=model_pb2.TOOL_CHOICE_MODE_TOOL, tool_name="other"
                ),
            },
            "not one of the tools",
        ),
        (
            {"response_format": model_pb2.RESPONSE_FORMAT_JSON_OBJECT},
            "needs the word 'json'",
        ),
        ({"response_format": 9}, "response_format 9"),
        ({"max_tokens": 100_000}, "max_tokens is 100000"),
        ({"player_id": "x" * 65}, "player_id is longer"),
    ],
)
async def test_invalid_tools_and_formats(
    gateway: Gateway, fake: FakeOpenAIServer, fields: dict[str, Any], expected: str
) -> None:
    stub = await gateway()
    error = await _fails(stub.Complete(_request("hi", **fields), timeout=5))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in error.details()
    assert fake.completions == []


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (model_pb2.ChatMessage(role=TOOL, content="result"), "tool_call_id is required"),
        (
            model_pb2.ChatMessage(role=USER, content="x", tool_call_id="c1"),
            "tool_call_id is only for tool messages",
        ),
        (
            model_pb2.ChatMessage(
                role=USER, content="x", tool_calls=[model_pb2.ToolCall(id="c", name="t")]
            ),
            "tool_calls is only for assistant messages",
        ),
        (model_pb2.ChatMessage(role=ASSISTANT, content=""), "content is empty"),
    ],
)
async def test_invalid_tool_messages(
    gateway: Gateway, fake: FakeOpenAIServer, message: model_pb2.ChatMessage, expected: str
) -> None:
    stub = await gateway()
    request = model_pb2.CompleteRequest(
        messages=[model_pb2.ChatMessage(role=USER, content="hi"), message]
    )
    error = await _fails(stub.Complete(request, timeout=5))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in error.details()


# -- the raw stream: the same request as the typed client, the same reading of the answer ------


def _rich_request() -> ChatRequest:
    return ChatRequest(
        messages=[
            ChatMessage("system", "Answer with one JSON object."),
            ChatMessage("user", "怎么合成钻石剑?"),
            ChatMessage("assistant", "", (ToolCall("call_1", "web_search", '{"q": "x"}'),)),
            ChatMessage("tool", "2 钻石 + 1 木棍", (), "call_1"),
        ],
        max_tokens=50,
        temperature=0.7,
        tools=[ToolSpec("web_search", "Search the web.", SEARCH_TOOL.parameters_json)],
        tool_choice=ToolChoice("tool", "web_search"),
        response_format="json_object",
    )


async def test_sends_what_the_typed_client_sends(fake: FakeOpenAIServer) -> None:
    """The gateway posts through `client.post` to skip the per-call body transform; the body,
    path and headers must stay what `chat.completions.create` sends."""
    params = _rich_request().openai_params("deepseek-chat", Limits(10_000, 100, 1000))
    async with openai.AsyncOpenAI(api_key=KEY, base_url=fake.base_url, max_retries=0) as client:
        stream = await client.chat.completions.create(**params, timeout=5.0)
        async for _ in stream:
            pass
        await stream_once(
            client, params, first_token_timeout=5, total_timeout=5, attempt=1, base_url=""
        )
    typed, raw = fake.completions[-2:]
    assert (raw.path, raw.json) == (typed.path, typed.json)
    assert raw.headers.keys() == typed.headers.keys()
    for name in ("authorization", "content-type", "accept", "user-agent"):
        assert raw.headers[name] == typed.headers[name]


def _sse(*events: Any) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


def _chunk(delta: dict[str, Any], finish: str | None = None, **fields: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [choice],
        **fields,
    }


async def _stream(body: bytes) -> Any:
    """stream_once against a provider answering `body` as its event stream."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})

    http = httpx2.AsyncClient(transport=httpx2.MockTransport(answer))
    async with openai.AsyncOpenAI(
        api_key=KEY, base_url="http://provider.test/v1", http_client=http, max_retries=0
    ) as client:
        params = ChatRequest([ChatMessage("user", "hi")]).openai_params("m", Limits(100, 10, 10))
        return await stream_once(
            client, params, first_token_timeout=5, total_timeout=5, attempt=1, base_url=""
        )


async def test_raw_stream_assembles_content_tool_calls_and_usage() -> None:
    usage = {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "prompt_cache_hit_tokens": 5,
        "prompt_cache_miss_tokens": 2,
    }
    call = {"index": 0, "id": "call_1", "type": "function"}
    result = await _stream(
        _sse(
            _chunk({"role": "assistant", "content": ""}),
            _chunk({"content": "he"}),
            _chunk({"content": "llo"}),
            _chunk({"tool_calls": [{**call, "function": {"name": "f", "arguments": '{"a"'}}]}),
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
            _chunk({"content": "ignored"}, None) | {"choices": [{"index": 1, "delta": {}}]},
            _chunk({}, "tool_calls"),
            {"id": "c", "model": "m", "choices": [], "usage": usage},
            "[DONE]",
        )
    )
    assert (result.content, result.finish_reason, result.model) == ("hello", "tool_calls", "m")
    assert [(c.id, c.name, c.arguments_json) for c in result.tool_calls] == [
        ("call_1", "f", '{"a": 1}')
    ]
    assert (result.prompt_tokens, result.completion_tokens) == (7, 3)
    assert (result.prompt_cache_hit_tokens, result.prompt_cache_miss_tokens) == (5, 2)


async def test_error_event_mid_stream_fails_after_output() -> None:
    error = {"error": {"message": "overloaded", "type": "server_error"}}
    with pytest.raises(AttemptFailed) as caught:
        await _stream(_sse(_chunk({"content": "partial"}), error))
    assert caught.value.output_started and not caught.value.retryable
    assert caught.value.error.code == "UNAVAILABLE"


@pytest.mark.parametrize(
    "event",
    [
        [1, 2],
        {"choices": "nope"},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": "x"}]}}]},
    ],
)
async def test_unreadable_chunk_is_unavailable(event: Any) -> None:
    with pytest.raises(AttemptFailed) as caught:
        await _stream(_sse(_chunk({"content": "x"}), event, _chunk({}, "stop"), "[DONE]"))
    assert caught.value.error.code == "UNAVAILABLE"
    assert "unreadable" in caught.value.error.message
    assert not caught.value.retryable


async def test_unreadable_usage_is_unavailable() -> None:
    usage = {"id": "c", "model": "m", "choices": [], "usage": {"prompt_tokens": "many"}}
    with pytest.raises(AttemptFailed) as caught:
        await _stream(_sse(_chunk({"content": "x"}, "stop"), usage, "[DONE]"))
    assert "unreadable" in caught.value.error.message


def test_failure_catalogue_mapping() -> None:
    code = grpc.StatusCode
    assert failure_for(code.RESOURCE_EXHAUSTED, web=False) is AgentFailure.BUDGET_EXHAUSTED
    assert failure_for(code.FAILED_PRECONDITION, web=True) is AgentFailure.PERMISSION_DENIED
    assert failure_for(code.PERMISSION_DENIED, web=True) is AgentFailure.PERMISSION_DENIED
    assert failure_for(code.DEADLINE_EXCEEDED, web=True) is AgentFailure.TIMEOUT
    assert failure_for(code.UNAVAILABLE, web=True) is AgentFailure.TOOL_UNAVAILABLE
    assert failure_for(code.INTERNAL, web=False) is AgentFailure.MODEL_UNAVAILABLE
