"""The model gateway in-process on port 0, calling the real `openai` client against the local
fake OpenAI server. Nothing here leaves loopback."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from system.model.v1 import model_pb2, model_pb2_grpc

from services.model_gateway.app import SERVICE_NAME, create_app
from services.model_gateway.chat import ChatMessage, ChatRequest
from services.model_gateway.config import ENV_PREFIX, ModelConfig
from services.model_gateway.metering import NoMeter
from services.model_gateway.provider import ChatProvider
from services.model_testserver import FakeOpenAIServer, router_demo_reply
from services.runtime import DeadlineExceeded, request_scope
from services.runtime.config import ConfigError, load_config
from services.stack.launcher import free_port
from tests.model_gateways import Gateway, gateways

KEY = "test-key"
USER = model_pb2.MESSAGE_ROLE_USER
SYSTEM = model_pb2.MESSAGE_ROLE_SYSTEM


def _request(*texts: str, **fields: Any) -> model_pb2.CompleteRequest:
    messages = [model_pb2.ChatMessage(role=USER, content=t) for t in texts or ("hello",)]
    return model_pb2.CompleteRequest(player_id="p1", messages=messages, **fields)


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key=KEY) as server:
        yield server


@pytest.fixture
async def gateway(fake: FakeOpenAIServer) -> AsyncIterator[Gateway]:
    """Starts a gateway (pointed at `fake`, keyed with KEY unless overridden) and returns a stub."""
    async with gateways(base_url=fake.base_url, api_key=KEY) as start:
        yield start


async def _fails(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def _still_serves(
    stub: model_pb2_grpc.ModelGatewayServiceStub, fake: FakeOpenAIServer
) -> None:
    fake.script(content="still here")
    response = await stub.Complete(_request("again?"), timeout=5)
    assert response.content == "still here"


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# -- no key --------------------------------------------------------------------------------


async def test_status_without_key(gateway: Gateway) -> None:
    stub = await gateway(api_key="")
    status = await stub.GetModelStatus(model_pb2.GetModelStatusRequest(), timeout=5)
    assert status.configured is False
    assert status.model == "deepseek-chat"
    assert status.search_configured is False


async def test_status_with_key(gateway: Gateway) -> None:
    stub = await gateway(model="deepseek-reasoner")
    status = await stub.GetModelStatus(model_pb2.GetModelStatusRequest(), timeout=5)
    assert status.configured is True
    assert status.model == "deepseek-reasoner"


async def test_complete_without_key_is_unavailable(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    # UNAVAILABLE is what callers turn into their local fallback; the reason says how to fix it.
    stub = await gateway(api_key="")
    before = _sample("model_calls_total", outcome="not_configured")
    error = await _fails(stub.Complete(_request(), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "no model is configured" in error.details()
    assert "SYSTEM_MODEL_API_KEY" in error.details()
    assert "SYSTEM_MODEL_API_KEY_FILE" in error.details()
    assert _sample("model_calls_total", outcome="not_configured") == before + 1
    assert fake.requests == []


# -- completions ---------------------------------------------------------------------------


async def test_complete_returns_scripted_content_and_usage(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway()
    fake.script(
        content="背包里有 3 个苹果", prompt_tokens=42, completion_tokens=7, finish_reason="stop"
    )
    request = model_pb2.CompleteRequest(
        player_id="p1",
        messages=[
            model_pb2.ChatMessage(role=SYSTEM, content="You are a helpful game assistant."),
            model_pb2.ChatMessage(role=USER, content="查看我的背包"),
            model_pb2.ChatMessage(role=model_pb2.MESSAGE_ROLE_ASSISTANT, content="好的"),
            model_pb2.ChatMessage(role=USER, content="还有呢?"),
        ],
        max_tokens=77,
        temperature=0.7,
    )
    response = await stub.Complete(request, timeout=5)

    assert response.content == "背包里有 3 个苹果"
    assert response.finish_reason == "stop"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (42, 7)
    assert response.model == "deepseek-chat"
    [sent] = fake.completions
    assert sent.path == "/v1/chat/completions"
    assert sent.bearer == KEY
    assert sent.json["model"] == "deepseek-chat"
    assert sent.json["messages"] == [
        {"role": "system", "content": "You are a helpful game assistant."},
        {"role": "user", "content": "查看我的背包"},
        {"role": "assistant", "content": "好的"},
        {"role": "user", "content": "还有呢?"},
    ]
    assert sent.json["max_tokens"] == 77
    assert sent.json["temperature"] == 0.7
    assert sent.json["stream"] is True
    assert sent.json["stream_options"] == {"include_usage": True}
    assert "tools" not in sent.json and "response_format" not in sent.json
    assert sent.headers.get("x-stainless-retry-count") == "0"
    assert response.attempts == 1


async def test_default_reply_echoes_and_uses_default_max_tokens(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway(default_max_tokens=256)
    response = await stub.Complete(_request("open the shop"), timeout=5)
    assert response.content == "echo: open the shop"
    assert response.usage.completion_tokens > 0
    assert fake.completions[-1].json["max_tokens"] == 256
    assert fake.completions[-1].json["temperature"] == 0


async def test_tokens_and_calls_are_metered(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway()
    before = (
        _sample("model_tokens_total", direction="prompt"),
        _sample("model_tokens_total", direction="completion"),
        _sample("model_calls_total", outcome="ok"),
    )
    fake.script(content="ok", prompt_tokens=11, completion_tokens=5)
    await stub.Complete(_request(), timeout=5)
    after = (
        _sample("model_tokens_total", direction="prompt"),
        _sample("model_tokens_total", direction="completion"),
        _sample("model_calls_total", outcome="ok"),
    )
    assert [a - b for a, b in zip(after, before, strict=True)] == [11, 5, 1]


# -- invalid input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        pytest.param(model_pb2.CompleteRequest(player_id="p1"), "at least one message", id="none"),
        pytest.param(
            model_pb2.CompleteRequest(messages=[model_pb2.ChatMessage(content="hi")]),
            "messages[0].role",
            id="unspecified-role",
        ),
        pytest.param(_request("hi", ""), "messages[1].content is empty", id="empty"),
        pytest.param(_request("   \n"), "messages[0].content is empty", id="blank"),
        pytest.param(_request("x" * 60, "y" * 41), "limit is 100", id="too-long"),
        pytest.param(_request(temperature=-0.5), "temperature", id="cold"),
        pytest.param(_request(temperature=2.5), "temperature", id="hot"),
        pytest.param(_request(temperature=float("nan")), "temperature", id="nan"),
        pytest.param(
            model_pb2.CompleteRequest(
                messages=[model_pb2.ChatMessage(role=model_pb2.MESSAGE_ROLE_USER, content="hi")],
                module_id="router",
            ),
            "module_id must be a catalogue id `namespace:path`",
            id="module-not-a-catalogue-id",  # storage could not record its spend
        ),
    ],
)
async def test_invalid_input_is_invalid_argument(
    gateway: Gateway, fake: FakeOpenAIServer, request_: model_pb2.CompleteRequest, expected: str
) -> None:
    stub = await gateway(max_prompt_chars=100)
    error = await _fails(stub.Complete(request_, timeout=5))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in error.details()
    assert fake.completions == []
    await _still_serves(stub, fake)


async def test_prompt_at_the_limit_is_accepted(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway(max_prompt_chars=100)
    response = await stub.Complete(_request("x" * 60, "y" * 40, temperature=2.0), timeout=5)
    assert response.content == "echo: " + "y" * 40


# -- provider failures ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate-limited"),
        (500, grpc.StatusCode.UNAVAILABLE, "HTTP 500"),
        (503, grpc.StatusCode.UNAVAILABLE, "HTTP 503"),
        (401, grpc.StatusCode.FAILED_PRECONDITION, "refused the API key"),
        (403, grpc.StatusCode.FAILED_PRECONDITION, "refused the API key"),
        (400, grpc.StatusCode.UNAVAILABLE, "HTTP 400"),
        (404, grpc.StatusCode.UNAVAILABLE, "HTTP 404"),
    ],
)
async def test_provider_errors_map_to_status_codes(
    gateway: Gateway, fake: FakeOpenAIServer, status: int, code: grpc.StatusCode, expected: str
) -> None:
    stub = await gateway(max_attempts=1)
    fake.script(status=status)
    error = await _fails(stub.Complete(_request(), timeout=5))
    assert error.code() == code
    assert expected in error.details()
    assert len(fake.completions) == 1  # the openai client never retried on its own
    await _still_serves(stub, fake)


async def test_provider_request_lines_only_for_failures(
    gateway: Gateway, fake: FakeOpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx2's line per provider request repeats the gateway's own `model call` line: it is
    dropped for successful requests and kept for failed ones."""
    stub = await gateway(max_attempts=1)
    caplog.set_level(logging.INFO)
    await stub.Complete(_request(), timeout=5)
    fake.script(status=500)
    await _fails(stub.Complete(_request(), timeout=5))
    lines = [r.getMessage() for r in caplog.records if r.name == "httpx2"]
    assert len(lines) == 1 and "500" in lines[0]
    calls = [r for r in caplog.records if r.getMessage().startswith("model call")]
    assert [r.getMessage() for r in calls] == ["model call ok", "model call unavailable"]
    failed = calls[-1].__dict__
    assert (failed["player_id"], failed["outcome"], failed["attempts"]) == ("p1", "unavailable", 0)


async def test_wrong_key_is_refused_without_leaking_it(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway(api_key="sk-wrong-secret")
    error = await _fails(stub.Complete(_request(), timeout=5))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "refused the API key" in error.details()
    assert "sk-wrong-secret" not in error.details()
    assert fake.requests[-1].bearer == "sk-wrong-secret"


async def test_unreachable_provider_is_unavailable(gateway: Gateway) -> None:
    port = free_port()  # free a moment ago: nothing listens there
    stub = await gateway(base_url=f"http://127.0.0.1:{port}/v1")
    error = await _fails(stub.Complete(_request(), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot reach the model provider" in error.details()


async def test_slow_provider_past_the_callers_deadline(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway()
    fake.script(delay=5)
    started = time.monotonic()
    error = await _fails(stub.Complete(_request(), timeout=0.5))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3
    await _still_serves(stub, fake)


async def test_slow_provider_past_the_configured_timeout(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway(request_timeout_seconds=0.3, first_token_timeout_seconds=0.3)
    fake.script(delay=5)
    started = time.monotonic()
    error = await _fails(stub.Complete(_request(), timeout=10))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "sent no token within 0.3 s" in error.details()
    assert time.monotonic() - started < 3
    await _still_serves(stub, fake)


async def test_provider_timeout_is_capped_by_the_request_deadline(fake: FakeOpenAIServer) -> None:
    """Domain level: the deadline in the request context, not the 20 s default, bounds the call."""
    provider = ChatProvider(ModelConfig(base_url=fake.base_url, api_key=KEY), NoMeter())
    fake.script(delay=5)
    started = time.monotonic()
    try:
        with request_scope(timeout=0.3), pytest.raises(DeadlineExceeded):
            await provider.complete(ChatRequest([ChatMessage("user", "hi")]))
    finally:
        await provider.aclose()
    assert time.monotonic() - started < 2
    # The openai client reports the timeout it was given; the deadline, not the default, set it.
    assert float(fake.completions[-1].headers["x-stainless-read-timeout"]) <= 0.3


# -- health --------------------------------------------------------------------------------


@pytest.mark.parametrize("api_key", ["", KEY])
async def test_health_reports_serving(fake: FakeOpenAIServer, api_key: str) -> None:
    config = ModelConfig(
        port=0,
        metrics_port=0,
        drain_seconds=0,
        grace_seconds=1,
        api_key=api_key,
        base_url=fake.base_url,
    )
    app = await create_app(config)
    await app.host.start()
    try:
        assert app.host.metrics_port > 0
        async with grpc.aio.insecure_channel(app.host.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_NAME):
                reply = await health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=5
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await app.host.stop()
        await app.aclose()


# -- config --------------------------------------------------------------------------------


def test_config_defaults_and_environment() -> None:
    config = load_config(
        ModelConfig, env_prefix=ENV_PREFIX, environ={"SYSTEM_MODEL_API_KEY": "sk-secret"}
    )
    assert (config.port, config.metrics_port) == (50054, 9104)
    assert (config.base_url, config.model) == ("https://api.deepseek.com", "deepseek-chat")
    assert (config.request_timeout_seconds, config.max_prompt_chars) == (20.0, 32000)
    assert config.default_max_tokens == 1024
    assert config.configured
    assert "sk-secret" not in repr(config)
    assert not load_config(ModelConfig, env_prefix=ENV_PREFIX, environ={}).configured


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"REQUEST_TIMEOUT_SECONDS": "-1"}, "request_timeout_seconds"),
        ({"REQUEST_TIMEOUT_SECONDS": "0"}, "request_timeout_seconds"),
        ({"REQUEST_TIMEOUT_SECONDS": "601"}, "request_timeout_seconds"),
        ({"REQUEST_TIMEOUT_SECONDS": "soon"}, "request_timeout_seconds"),
        ({"MAX_PROMPT_CHARS": "0"}, "max_prompt_chars"),
        ({"DEFAULT_MAX_TOKENS": "-5"}, "default_max_tokens"),
        ({"BASE_URL": "api.deepseek.com"}, "base_url"),
        ({"MODEL": " "}, "model"),
        ({"API_KEY": "sk-abc\n"}, "whitespace"),
        ({"PORT": "70000"}, "port"),
    ],
)
def test_config_validation(env: dict[str, str], expected: str) -> None:
    environ = {ENV_PREFIX + name: value for name, value in env.items()}
    with pytest.raises(ConfigError, match=expected):
        load_config(ModelConfig, env_prefix=ENV_PREFIX, environ=environ)


def test_config_reads_the_key_from_a_file(tmp_path: Any) -> None:
    secret = tmp_path / "model-api-key"
    secret.write_text("  sk-from-file\n", encoding="utf-8")
    config = load_config(
        ModelConfig,
        env_prefix=ENV_PREFIX,
        environ={"SYSTEM_MODEL_API_KEY_FILE": str(secret)},
    )
    assert config.configured
    assert config.key == "sk-from-file"
    assert config.api_key == ""
    assert "sk-from-file" not in repr(config)
    assert "sk-from-file" not in str(config)
    secret.write_text("sk-changed", encoding="utf-8")
    assert config.key == "sk-from-file"  # read once, at start
    assert dataclasses.replace(config, port=0).key == "sk-changed"


async def test_gateway_uses_the_key_from_a_file(
    gateway: Gateway, fake: FakeOpenAIServer, tmp_path: Any
) -> None:
    secret = tmp_path / "key"
    secret.write_text(KEY + "\n", encoding="utf-8")
    stub = await gateway(api_key="", api_key_file=str(secret))
    status = await stub.GetModelStatus(model_pb2.GetModelStatusRequest(), timeout=5)
    assert status.configured is True
    fake.script(content="from file")
    assert (await stub.Complete(_request(), timeout=5)).content == "from file"
    assert fake.completions[-1].bearer == KEY


def test_config_key_file_errors(tmp_path: Any) -> None:
    missing = tmp_path / "absent"
    with pytest.raises(ConfigError, match=f"api_key_file {missing}") as caught:
        load_config(
            ModelConfig, env_prefix=ENV_PREFIX, environ={"SYSTEM_MODEL_API_KEY_FILE": str(missing)}
        )
    assert "cannot be read" in str(caught.value)
    with pytest.raises(ConfigError, match=f"api_key_file {tmp_path}"):  # a folder
        ModelConfig(api_key_file=str(tmp_path))
    empty = tmp_path / "empty"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="is empty"):
        ModelConfig(api_key_file=str(empty))
    secret = tmp_path / "key"
    secret.write_text("sk-secret-in-file", encoding="utf-8")
    with pytest.raises(ConfigError, match="not both") as both:
        load_config(
            ModelConfig,
            env_prefix=ENV_PREFIX,
            environ={
                "SYSTEM_MODEL_API_KEY": "sk-secret-in-env",
                "SYSTEM_MODEL_API_KEY_FILE": str(secret),
            },
        )
    assert "sk-secret" not in str(both.value)


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().api_key = "x"  # type: ignore[misc]


# -- the fake server itself ----------------------------------------------------------------


async def test_fake_server_lists_models_and_checks_the_key(fake: FakeOpenAIServer) -> None:
    async with openai.AsyncOpenAI(api_key=KEY, base_url=fake.base_url, max_retries=0) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["deepseek-chat"]
    async with openai.AsyncOpenAI(api_key="nope", base_url=fake.base_url, max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.models.list()
        assert caught.value.body["code"] == "invalid_api_key"  # type: ignore[index]


def _routing(request: str, catalogue: list[dict[str, Any]]) -> list[dict[str, str]]:
    payload = {"catalogue": catalogue, "playerLanguage": "en_us", "request": request}
    return [
        {"role": "system", "content": 'Reply with JSON only: {"capabilityId": ...}'},
        {"role": "user", "content": json.dumps(payload)},
    ]


def test_router_demo_reply_matches_an_id_word_or_clarifies() -> None:
    catalogue = [
        {"id": "system:help", "explicitOnly": False},
        {"id": "system:history", "explicitOnly": False},
        {"id": "system:inventory_clear", "explicitOnly": True},
        {"id": "clarify"},
    ]
    answer = json.loads(router_demo_reply(_routing("Show my HISTORY please", catalogue)) or "")
    assert answer == {"capabilityId": "system:history", "arguments": {}}
    for text in ("blorp", "histories", "clear inventory"):  # no whole word; explicitOnly skipped
        answer = json.loads(router_demo_reply(_routing(text, catalogue)) or "")
        assert answer == {"capabilityId": "clarify", "arguments": {}}, text
    assert router_demo_reply([{"role": "user", "content": "hello"}]) is None


async def test_fake_server_responder_answers_when_nothing_is_scripted() -> None:
    with FakeOpenAIServer(api_key=KEY, responder=router_demo_reply) as server:
        async with openai.AsyncOpenAI(
            api_key=KEY, base_url=server.base_url, max_retries=0
        ) as client:
            messages: Any = _routing("help", [{"id": "system:help"}, {"id": "clarify"}])
            reply = await client.chat.completions.create(model="m", messages=messages)
            assert json.loads(reply.choices[0].message.content or "")["capabilityId"] == (
                "system:help"
            )
            server.script(content="scripted wins")
            reply = await client.chat.completions.create(model="m", messages=messages)
            assert reply.choices[0].message.content == "scripted wins"
            plain: Any = [{"role": "user", "content": "hi"}]
            reply = await client.chat.completions.create(model="m", messages=plain)
            assert reply.choices[0].message.content == "echo: hi"
