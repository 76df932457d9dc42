"""Several providers, per-module lists, fallback and circuit breakers: the model gateway
in-process on port 0, calling the real `openai` client against TWO local OpenAI-compatible test
servers. Nothing here leaves loopback."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY
from system.model.v1 import model_pb2

from engine_service.models import model_failure
from services.model_gateway.breaker import BreakerState, CircuitBreaker
from services.model_gateway.config import ENV_PREFIX, ModelConfig
from services.model_gateway.failures import (
    ALL_PROVIDERS_UNAVAILABLE,
    failure_for,
    providers_busy,
)
from services.model_gateway.provider_config import PRESETS, Route, parse_routing
from services.model_testserver import FakeOpenAIServer
from services.results import AgentFailure
from services.runtime.config import ConfigError, load_config
from services.runtime.errors import error_reason
from tests.model_gateways import Gateway, gateways
from tests.waiting import wait_until

KEY_A, KEY_B = "key-a", "key-b"
ENV_A = "SYSTEM_TEST_PROVIDER_A_KEY"
USER = model_pb2.MESSAGE_ROLE_USER


def _request(text: str = "hello", **fields: Any) -> model_pb2.CompleteRequest:
    return model_pb2.CompleteRequest(
        player_id="p1", messages=[model_pb2.ChatMessage(role=USER, content=text)], **fields
    )


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _fails(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


@pytest.fixture
def fake_a() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key=KEY_A) as server:
        yield server


@pytest.fixture
def fake_b() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key=KEY_B) as server:
        yield server


def _providers_toml(
    a: FakeOpenAIServer,
    b: FakeOpenAIServer,
    key_file: Path,
    first_token_timeout: float = 0.5,
    **extra: Any,
) -> str:
    a_limits = "".join(f"{k} = {v}\n" for k, v in extra.items())
    return f"""
[providers.a]
preset = "custom"
base_url = "{a.base_url}"
api_key_env = "{ENV_A}"
first_token_timeout_seconds = {first_token_timeout}
{a_limits}
[providers.a.models]
model-a = {{ input_per_million = 1.0, output_per_million = 2.0 }}

[providers.b]
preset = "vllm"
base_url = "{b.base_url}"
api_key_file = "{key_file}"
models = ["model-b"]

[routes]
default = ["a/model-a", "b/model-b"]
"system:question" = ["b", "a"]
"system:only-a" = ["a"]
"""


def _write_providers(
    tmp_path: Path,
    fake_a: FakeOpenAIServer,
    fake_b: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
    **options: Any,
) -> Path:
    """The providers file of a and b (`_providers_toml` with `options`), their keys in place."""
    monkeypatch.setenv(ENV_A, KEY_A)
    key_file = tmp_path / "b.key"
    key_file.write_text(KEY_B + "\n")
    path = tmp_path / "providers.toml"
    path.write_text(_providers_toml(fake_a, fake_b, key_file, **options))
    return path


@pytest.fixture
def providers_file(
    tmp_path: Path,
    fake_a: FakeOpenAIServer,
    fake_b: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
) -> Path:
    return _write_providers(tmp_path, fake_a, fake_b, monkeypatch)


@pytest.fixture
async def gateway(providers_file: Path) -> AsyncIterator[Gateway]:
    async with gateways(providers_file=str(providers_file), retry_backoff_seconds=0.01) as start:
        yield start


# -- fallback --------------------------------------------------------------------------------


async def test_healthy_first_provider_answers(
    gateway: Gateway, fake_a: FakeOpenAIServer, fake_b: FakeOpenAIServer
) -> None:
    stub = await gateway()
    response = await stub.Complete(_request(), timeout=5)
    assert (response.provider, response.model, response.attempts) == ("a", "model-a", 1)
    assert fake_a.completions[-1].json["model"] == "model-a"
    assert fake_a.completions[-1].bearer == KEY_A
    assert fake_b.completions == []
    status = await stub.GetModelStatus(model_pb2.GetModelStatusRequest(), timeout=5)
    assert (status.configured, status.model) == (True, "model-a")


FAILURES = {
    "rate_limited": {"status": 429},
    "server_error": {"status": 500},
    "server_error_503": {"status": 503},
    "first_token_timeout": {"delay": 5.0},
    "connection": {"drop": True},
    "connection_before_token": {"content": "lost", "drop_after_chunks": 1},
}


@pytest.mark.parametrize("case", sorted(FAILURES))
async def test_each_failure_falls_back_to_the_second_provider(
    gateway: Gateway, fake_a: FakeOpenAIServer, fake_b: FakeOpenAIServer, case: str
) -> None:
    stub = await gateway()
    kind = case.removesuffix("_503").removesuffix("_before_token")
    before = _sample("model_fallbacks_total", provider="a", kind=kind)
    failures_before = _sample("model_provider_failures_total", provider="a", kind=kind)
    fake_a.script(**FAILURES[case])
    fake_b.script(content="from b")
    response = await stub.Complete(_request(), timeout=5)
    assert (response.content, response.provider, response.model) == ("from b", "b", "model-b")
    assert response.attempts == 2
    assert len(fake_a.completions) == 1 and len(fake_b.completions) == 1
    assert fake_b.completions[0].bearer == KEY_B
    assert _sample("model_fallbacks_total", provider="a", kind=kind) == before + 1
    assert _sample("model_provider_failures_total", provider="a", kind=kind) == (
        failures_before + 1
    )


async def test_module_lists_choose_the_order(
    gateway: Gateway, fake_a: FakeOpenAIServer, fake_b: FakeOpenAIServer
) -> None:
    stub = await gateway()
    first = await stub.Complete(_request(module_id="system:question"), timeout=5)
    assert (first.provider, first.model) == ("b", "model-b")
    fake_b.script(status=500)
    second = await stub.Complete(_request(module_id="system:question"), timeout=5)
    assert (second.provider, second.model) == ("a", "model-a")
    other = await stub.Complete(_request(module_id="system:unlisted"), timeout=5)
    assert other.provider == "a"  # the default list


async def test_output_already_streamed_is_not_sent_elsewhere(
    gateway: Gateway, fake_a: FakeOpenAIServer, fake_b: FakeOpenAIServer
) -> None:
    stub = await gateway()
    fake_a.script(content="the answer is forty", chunk_chars=4, drop_after_chunks=3)
    error = await _fails(stub.Complete(_request(), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "provider a/model-a" in error.details()
    assert error_reason(error) == ""  # a broken answer, not a busy assistant
    assert fake_b.completions == []


async def test_a_first_token_clock_cut_by_the_deadline_is_not_the_providers_fault(
    tmp_path: Path,
    fake_a: FakeOpenAIServer,
    fake_b: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a's first-token timeout is 4 s; the caller leaves 1.5 s: the caller's clock ran out.
    # (Seconds, not tenths: on a loaded machine a 0.3 s deadline could pass before the
    # gateway called a at all.)
    path = _write_providers(tmp_path, fake_a, fake_b, monkeypatch, first_token_timeout=4.0)
    calls = ("cancelled", "deadline_exceeded")
    async with gateways(providers_file=str(path), breaker_failures=1) as start:
        stub = await start()
        ended = sum(_sample("model_calls_total", outcome=outcome) for outcome in calls)
        timeouts = _sample(
            "model_provider_failures_total", provider="a", kind="first_token_timeout"
        )
        fake_a.script(delay=3.0)
        error = await _fails(stub.Complete(_request(), timeout=1.5))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(fake_a.completions) == 1 and fake_b.completions == []
        # The caller's deadline ends its call first; the gateway ends its side just after,
        # either by its own cut clock (a failure of kind `deadline`) or by the call's
        # cancellation, whichever comes first: both are the caller's clock, never a's fault.
        await wait_until(
            lambda: (
                sum(_sample("model_calls_total", outcome=outcome) for outcome in calls) == ended + 1
            ),
            what="the call's end counted",
        )
        kind = "first_token_timeout"
        assert _sample("model_provider_failures_total", provider="a", kind=kind) == timeouts
        # Not counted against a: its breaker (1 failure opens it) is still closed.
        assert (await stub.Complete(_request(), timeout=5)).provider == "a"


async def test_a_refused_key_does_not_fall_back(
    gateway: Gateway, fake_a: FakeOpenAIServer, fake_b: FakeOpenAIServer
) -> None:
    stub = await gateway()
    fake_a.script(status=401)
    error = await _fails(stub.Complete(_request(), timeout=5))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert fake_b.completions == []


# -- every provider down ---------------------------------------------------------------------


async def test_all_providers_failing_is_a_clear_unavailable(
    gateway: Gateway, fake_a: FakeOpenAIServer, fake_b: FakeOpenAIServer
) -> None:
    stub = await gateway(max_attempts=2)
    fake_a.fault(status=500)
    fake_b.fault(status=429)
    busy = _sample("model_calls_total", outcome="providers_busy")
    error = await _fails(stub.Complete(_request(), timeout=5))
    assert _sample("model_calls_total", outcome="providers_busy") == busy + 1
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(error) == ALL_PROVIDERS_UNAVAILABLE
    assert providers_busy(error)
    assert failure_for(error.code(), web=False) is AgentFailure.MODEL_UNAVAILABLE
    # The engine tells the player the assistant is busy, not that there is no model.
    assert model_failure(error, "the model call failed").failure is AgentFailure.BUSY
    details = error.details()
    assert "a/model-a: the model provider failed with HTTP 500" in details
    assert "b/model-b: the model provider rate-limited" in details
    assert "try again shortly" in details
    assert "Traceback" not in details
    assert len(fake_a.completions) == 1 and len(fake_b.completions) == 1


async def test_all_providers_failing_retries_the_list_within_max_attempts(
    gateway: Gateway, fake_a: FakeOpenAIServer, fake_b: FakeOpenAIServer
) -> None:
    stub = await gateway(max_attempts=3)
    fake_a.script(status=500)
    fake_b.script(status=503)
    # The third call goes back to the head of the list, after a backoff.
    response = await stub.Complete(_request(), timeout=5)
    assert (response.provider, response.attempts) == ("a", 3)


# -- circuit breaker -------------------------------------------------------------------------

COOLDOWN = 2.0
"""The breaker tests' cool-down: long enough that the calls meant to find the breaker open
come before it ends, however loaded the machine."""


async def test_breaker_opens_skips_probes_and_closes(
    gateway: Gateway, fake_a: FakeOpenAIServer, fake_b: FakeOpenAIServer
) -> None:
    # The open phase's checks must fall inside the cool-down even on a loaded machine (0.5 s
    # did not: a fresh-clone CI run's third call came after it and probed a).
    stub = await gateway(breaker_failures=2, breaker_cooldown_seconds=COOLDOWN)
    fake_a.fault(status=500)
    for _ in range(2):
        assert (await stub.Complete(_request(), timeout=5)).provider == "b"
    assert len(fake_a.completions) == 2
    assert _sample("model_provider_breaker_state", provider="a") == BreakerState.OPEN
    skips = _sample("model_provider_skips_total", provider="a", reason="breaker_open")

    # Open: a is not called at all; b answers at once (one attempt).
    response = await stub.Complete(_request(), timeout=5)
    assert (response.provider, response.attempts) == ("b", 1)
    assert len(fake_a.completions) == 2
    assert _sample("model_provider_skips_total", provider="a", reason="breaker_open") == skips + 1

    # After the cool-down one probe goes through; it succeeds and the breaker closes.
    fake_a.clear_fault()
    await asyncio.sleep(COOLDOWN + 0.1)
    response = await stub.Complete(_request(), timeout=5)
    assert response.provider == "a"
    assert len(fake_a.completions) == 3
    assert _sample("model_provider_breaker_state", provider="a") == BreakerState.CLOSED
    assert (await stub.Complete(_request(), timeout=5)).provider == "a"


async def test_failed_probe_opens_the_breaker_again(
    gateway: Gateway, fake_a: FakeOpenAIServer, fake_b: FakeOpenAIServer
) -> None:
    stub = await gateway(breaker_failures=1, breaker_cooldown_seconds=COOLDOWN)
    fake_a.fault(status=503)
    assert (await stub.Complete(_request(), timeout=5)).provider == "b"
    await asyncio.sleep(COOLDOWN + 0.1)
    assert (await stub.Complete(_request(), timeout=5)).provider == "b"  # the probe failed
    assert len(fake_a.completions) == 2
    assert _sample("model_provider_breaker_state", provider="a") == BreakerState.OPEN
    assert (await stub.Complete(_request(), timeout=5)).attempts == 1
    assert len(fake_a.completions) == 2


async def test_every_breaker_open_answers_busy_without_calling(
    gateway: Gateway, fake_a: FakeOpenAIServer, fake_b: FakeOpenAIServer
) -> None:
    stub = await gateway(breaker_failures=1, breaker_cooldown_seconds=30, max_attempts=2)
    fake_a.fault(status=500)
    fake_b.fault(drop=True)
    first = await _fails(stub.Complete(_request(), timeout=5))
    assert error_reason(first) == ALL_PROVIDERS_UNAVAILABLE
    error = await _fails(stub.Complete(_request(), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(error) == ALL_PROVIDERS_UNAVAILABLE
    assert "circuit open" in error.details()
    assert len(fake_a.completions) == 1 and len(fake_b.completions) == 1


async def test_a_lone_provider_with_its_breaker_open_is_busy(
    gateway: Gateway, fake_a: FakeOpenAIServer, fake_b: FakeOpenAIServer
) -> None:
    stub = await gateway(breaker_failures=1, max_attempts=1)
    fake_a.script(status=500)
    error = await _fails(stub.Complete(_request(module_id="system:only-a"), timeout=5))
    # A list of one: the provider's own failure, as before fallbacks existed.
    assert error.code() == grpc.StatusCode.UNAVAILABLE and error_reason(error) == ""
    error = await _fails(stub.Complete(_request(module_id="system:only-a"), timeout=5))
    assert error_reason(error) == ALL_PROVIDERS_UNAVAILABLE
    assert "module system:only-a" in error.details()
    assert len(fake_a.completions) == 1


async def test_a_saturated_provider_is_passed_over(
    tmp_path: Path,
    fake_a: FakeOpenAIServer,
    fake_b: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = _write_providers(tmp_path, fake_a, fake_b, monkeypatch, max_concurrent=1)
    async with gateways(providers_file=str(path)) as start:
        stub = await start()
        fake_a.script(content="slow", chunk_chars=2, chunk_delay=0.1)
        slow = asyncio.ensure_future(stub.Complete(_request(), timeout=5))
        while not fake_a.completions:
            await asyncio.sleep(0.01)
        quick = await stub.Complete(_request(), timeout=5)
        assert (quick.provider, quick.attempts) == ("b", 1)
        assert (await slow).provider == "a"


# -- settings --------------------------------------------------------------------------------


def _load(tmp_path: Path, body: str, **environ: str) -> ModelConfig:
    providers = tmp_path / "providers.toml"
    providers.write_text(body)
    settings = tmp_path / "model.toml"
    settings.write_text(f'providers_file = "{providers}"\n')
    return load_config(ModelConfig, settings, env_prefix=ENV_PREFIX, environ=environ)


def _error(tmp_path: Path, body: str) -> str:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, body)
    return str(caught.value)


GOOD = """
[providers.deepseek]
preset = "deepseek"
api_key_env = "SYSTEM_TEST_PROVIDER_A_KEY"
[providers.deepseek.models]
deepseek-chat = { input_per_million = 0.27, output_per_million = 1.10 }
deepseek-reasoner = { input_per_million = 0.55, output_per_million = 2.19 }

[providers.qwen]
preset = "qwen"
api_key_env = "SYSTEM_TEST_PROVIDER_A_KEY"
max_concurrent = 8

[providers.local]
preset = "ollama"
models = ["qwen2.5:7b"]

[routes]
default = ["deepseek/deepseek-chat", "qwen", "local"]
"system:question" = ["qwen/qwen-plus", "deepseek/deepseek-reasoner"]
"""


def test_presets_and_routes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_A, "sk-secret")
    config = _load(tmp_path, GOOD)
    routing = config.routing
    assert routing.providers["deepseek"].base_url == "https://api.deepseek.com"
    assert routing.providers["qwen"].base_url == "https://dashscope.aliyuncs.com/compatible-mode/v1"
    assert routing.providers["local"].base_url == "http://127.0.0.1:11434/v1"
    assert PRESETS["vllm"].base_url == "http://127.0.0.1:8000/v1"
    assert routing.providers["qwen"].max_concurrent == 8
    assert routing.providers["deepseek"].models["deepseek-chat"].cost(1_000_000, 1_000_000) == (
        pytest.approx(1.37)
    )
    assert routing.default == (
        Route("deepseek", "deepseek-chat"),
        Route("qwen", "qwen-plus"),
        Route("local", "qwen2.5:7b"),
    )
    assert routing.routes("system:question")[1] == Route("deepseek", "deepseek-reasoner")
    assert routing.routes("") == routing.routes("system:other") == routing.default
    assert config.configured
    assert "sk-secret" not in repr(config) and "sk-secret" not in repr(routing)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ('preset = "qwen"', 'preset = "openrouter"'),
            "providers.qwen.preset must be one of deepseek, qwen, ollama, vllm, custom, got "
            "'openrouter'",
        ),
        (
            ('"qwen/qwen-plus", "deepseek', '"mistral/large", "deepseek'),
            "routes.\"system:question\"[0] names provider 'mistral', which is not configured "
            "(configured: deepseek, qwen, local)",
        ),
        (
            ('"local"]\n"system', '"local/llama3"]\n"system'),
            "routes.default[2]: provider 'local' has no model 'llama3' (its models: qwen2.5:7b)",
        ),
        (
            ('preset = "qwen"\napi_key_env = "SYSTEM_TEST_PROVIDER_A_KEY"\n', 'preset = "qwen"\n'),
            "providers.qwen has no key source: preset 'qwen' needs a key; set api_key_env",
        ),
        (
            ('preset = "qwen"\napi_key_env', 'preset = "qwen"\napi_key = "sk-1"\napi_key_env'),
            "providers.qwen.api_key: a key is never written in the config",
        ),
        (
            ('api_key_env = "SYSTEM_TEST_PROVIDER_A_KEY"\n[', 'api_key_env = "SYSTEM_UNSET_X"\n['),
            "providers.deepseek.api_key_env names SYSTEM_UNSET_X, which is not set or empty",
        ),
        (
            ("max_concurrent = 8", "max_concurrent = -1"),
            "providers.qwen.max_concurrent must be 0 (no limit) to 10000, got -1",
        ),
        (
            ('models = ["qwen2.5:7b"]', 'modles = ["qwen2.5:7b"]'),
            "providers.local: unknown key(s) modles",
        ),
        (
            ('[routes]\ndefault = ["deepseek/deepseek-chat", "qwen", "local"]\n', "[routes]\n"),
            "routes.default is missing",
        ),
    ],
)
def test_invalid_provider_settings_name_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: tuple[str, str], message: str
) -> None:
    monkeypatch.setenv(ENV_A, "sk-secret")
    old, new = change
    assert old in GOOD
    error = _error(tmp_path, GOOD.replace(old, new, 1))
    assert message in error
    assert "sk-secret" not in error and "sk-1" not in error


def test_custom_preset_needs_a_base_url() -> None:
    with pytest.raises(ConfigError, match=r"providers.x.base_url is required with preset 'custom'"):
        parse_routing(
            {"providers": {"x": {"preset": "custom", "models": ["m"]}}, "routes": {}},
            source="test",
            first_token_timeout_seconds=10,
            request_timeout_seconds=20,
            environ={},
        )


def test_providers_file_and_single_key_are_exclusive(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text("")
    with pytest.raises(ConfigError, match="with providers_file give each provider"):
        ModelConfig(api_key="sk-x", providers_file=str(tmp_path / "p.toml"))


def test_missing_providers_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="providers_file .*nope.toml does not exist"):
        ModelConfig(providers_file=str(tmp_path / "nope.toml"))


def test_single_endpoint_settings_are_one_provider() -> None:
    config = ModelConfig(api_key="sk-x", base_url="http://127.0.0.1:1/v1", model="m")
    routing = config.routing
    assert list(routing.providers) == ["default"]
    assert routing.default == (Route("default", "m"),)
    assert routing.providers["default"].api_key == "sk-x"
    assert not ModelConfig().configured


def test_breaker_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="breaker_failures must be 0"):
        ModelConfig(breaker_failures=-1).validate()
    with pytest.raises(ConfigError, match="breaker_cooldown_seconds must be over 0"):
        ModelConfig(breaker_cooldown_seconds=0).validate()


# -- the breaker alone -----------------------------------------------------------------------


def test_breaker_state_machine() -> None:
    now = [0.0]
    changes: list[BreakerState] = []
    breaker = CircuitBreaker(3, 10.0, clock=lambda: now[0], on_change=changes.append)
    for _ in range(2):
        assert breaker.allow()
        breaker.failure()
    assert breaker.allow()
    breaker.success()  # a success resets the count
    for _ in range(3):
        assert breaker.allow()
        breaker.failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    now[0] = 10.0
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one at a time
    breaker.release()  # the probe ended saying nothing: another may go
    assert breaker.allow()
    breaker.failure()
    assert breaker.state is BreakerState.OPEN
    now[0] = 20.0
    assert breaker.allow()
    breaker.success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()
    assert changes == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.CLOSED,
    ]


def test_breaker_off() -> None:
    breaker = CircuitBreaker(0, 1.0)
    for _ in range(100):
        assert breaker.allow()
        breaker.failure()
    assert breaker.state is BreakerState.CLOSED


def test_fault_pattern_of_the_test_server() -> None:
    with FakeOpenAIServer(api_key="k") as fake:
        fake.fault(every=2, status=500)
        statuses = []
        for _ in range(4):
            request = urllib.request.Request(
                fake.base_url + "/chat/completions",
                data=json.dumps(
                    {"model": "m", "messages": [{"role": "user", "content": "x"}]}
                ).encode(),
                headers={"Authorization": "Bearer k", "Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=5) as answer:
                    statuses.append(answer.status)
            except urllib.error.HTTPError as exc:
                statuses.append(exc.code)
        assert statuses == [200, 500, 200, 500]
