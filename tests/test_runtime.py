"""Unit and in-process tests of the shared plumbing in services/runtime."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import socket
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from services.runtime import context as request_context
from services.runtime.channels import open_channel
from services.runtime.config import ConfigError, ServerConfig, load_config
from services.runtime.errors import InvalidArgument
from services.runtime.logging import (
    ACCESS_LOGGER,
    BatchingStreamHandler,
    JsonFormatter,
    access_handler,
)
from services.runtime.server import ServiceHost
from tests.waiting import wait_until

# --- config -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DemoConfig(ServerConfig):
    """A service's settings, as a service would declare them."""

    name: str = "demo"
    verbose: bool = False
    retries: int = 3
    ratio: float = 0.5
    tags: tuple[str, ...] = ()
    endpoint: str | None = None

    def validate(self) -> None:
        super().validate()
        if self.retries < 0:
            raise ConfigError(f"retries must not be negative, got {self.retries}")


PREFIX = "DEMO_"


def _load(path: Path | None = None, **env: str) -> DemoConfig:
    return load_config(DemoConfig, path, env_prefix=PREFIX, environ=env)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "demo.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_config_defaults() -> None:
    assert _load() == DemoConfig()
    assert _load().port == 0 and _load().host == "127.0.0.1"


def test_config_file_values(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        'name = "router"\nport = 50052\nverbose = true\nratio = 2\ntags = ["a", "b"]\n'
        'endpoint = "http://x"\n',
    )
    config = _load(path)
    assert config.name == "router"
    assert config.port == 50052
    assert config.verbose is True
    assert config.ratio == 2.0 and isinstance(config.ratio, float)
    assert config.tags == ("a", "b")
    assert config.endpoint == "http://x"


def test_env_overrides_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'name = "file"\nport = 50052\n')
    config = _load(path, DEMO_NAME="env", DEMO_PORT="50053", OTHER_PORT="1")
    assert (config.name, config.port) == ("env", 50053)


@pytest.mark.parametrize(
    ("env", "field", "value"),
    [
        ({"DEMO_VERBOSE": "true"}, "verbose", True),
        ({"DEMO_VERBOSE": "ON"}, "verbose", True),
        ({"DEMO_VERBOSE": "0"}, "verbose", False),
        ({"DEMO_VERBOSE": "no"}, "verbose", False),
        ({"DEMO_RETRIES": " 7 "}, "retries", 7),
        ({"DEMO_RATIO": "0.25"}, "ratio", 0.25),
        ({"DEMO_DRAIN_SECONDS": "2"}, "drain_seconds", 2.0),
        ({"DEMO_TAGS": "a, b,,c "}, "tags", ("a", "b", "c")),
        ({"DEMO_TAGS": ""}, "tags", ()),
        ({"DEMO_ENDPOINT": "host:1"}, "endpoint", "host:1"),
        ({"DEMO_ENDPOINT": ""}, "endpoint", None),
    ],
)
def test_env_coercion(env: dict[str, str], field: str, value: Any) -> None:
    assert getattr(_load(**env), field) == value


def test_unknown_key_in_file_names_known_keys(tmp_path: Path) -> None:
    path = _toml(tmp_path, "prot = 1\n")
    with pytest.raises(ConfigError) as info:
        _load(path)
    message = str(info.value)
    assert "prot" in message and str(path) in message
    assert "known settings are" in message and "port" in message and "retries" in message


@pytest.mark.parametrize(
    ("text", "env", "setting", "source"),
    [
        ('port = "fast"\n', {}, "port", "config file"),
        ("verbose = 1\n", {}, "verbose", "config file"),
        ("retries = 1.5\n", {}, "retries", "config file"),
        ("name = 3\n", {}, "name", "config file"),
        ("tags = [1, 2]\n", {}, "tags", "config file"),
        ("", {"DEMO_PORT": "fast"}, "port", "environment DEMO_PORT"),
        ("", {"DEMO_VERBOSE": "maybe"}, "verbose", "environment DEMO_VERBOSE"),
        ("", {"DEMO_RATIO": "half"}, "ratio", "environment DEMO_RATIO"),
    ],
)
def test_wrong_type_names_setting_and_source(
    tmp_path: Path, text: str, env: dict[str, str], setting: str, source: str
) -> None:
    path = _toml(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        _load(path, **env)
    assert f"setting '{setting}'" in str(info.value)
    assert source in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        _load(tmp_path / "nope.toml")


def test_malformed_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        _load(_toml(tmp_path, "port = = 1\n"))


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"DEMO_PORT": "70000"}, "port must be 0..65535, got 70000"),
        ({"DEMO_PORT": "-1"}, "port must be 0..65535"),
        ({"DEMO_METRICS_PORT": "-2"}, "metrics_port must be -1"),
        ({"DEMO_DRAIN_SECONDS": "-1"}, "must not be negative"),
        ({"DEMO_LOG_LEVEL": "LOUD"}, "log_level must be"),
        ({"DEMO_RETRIES": "-1"}, "retries must not be negative"),
    ],
)
def test_validate_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _load(**env)


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        _load().port = 1  # type: ignore[misc]


# --- request context --------------------------------------------------------------------------


def test_request_scope_sets_and_restores() -> None:
    assert request_context.current_request_id() == ""
    assert request_context.current_deadline() is None
    with request_context.request_scope("abc", timeout=5.0) as rid:
        assert rid == request_context.current_request_id() == "abc"
        left = request_context.remaining_seconds()
        assert left is not None and 4.0 < left <= 5.0
    assert request_context.current_request_id() == ""
    assert request_context.current_deadline() is None
    assert request_context.remaining_seconds(3.0) == 3.0


def test_request_scope_nesting_never_extends_deadline() -> None:
    with request_context.request_scope("outer", timeout=1.0):
        outer = request_context.current_deadline()
        with request_context.request_scope(timeout=60.0) as rid:
            assert rid == "outer"  # the id is inherited
            assert request_context.current_deadline() == outer
        with request_context.request_scope():
            assert request_context.current_deadline() == outer
        with request_context.request_scope("inner", timeout=0.1) as rid:
            assert rid == "inner"
            inner = request_context.current_deadline()
            assert inner is not None and outer is not None and inner < outer
            assert request_context.remaining_seconds(10.0) <= 0.1  # type: ignore[operator]
        assert request_context.current_deadline() == outer


def test_request_scope_without_id_makes_one() -> None:
    with request_context.request_scope() as first:
        assert len(first) == 32
    with request_context.request_scope() as second:
        assert second != first


def test_remaining_seconds_never_negative() -> None:
    with request_context.request_scope(timeout=0.0):
        time.sleep(0.001)
        assert request_context.remaining_seconds() == 0.0


# --- logging ----------------------------------------------------------------------------------


def _log_lines(emit: Any) -> list[dict[str, Any]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("router"))
    logger = logging.getLogger("test.runtime.json")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_log_lines_carry_service_request_id_and_extras() -> None:
    def emit(logger: logging.Logger) -> None:
        logger.info("outside")
        with request_context.request_scope("req-1"):
            logger.info("hello %s", "world", extra={"rpc": "/a.B/C", "ms": 1.5, "obj": [1]})
            logger.warning("explicit", extra={"request_id": "other"})
            try:
                raise ValueError("boom")
            except ValueError:
                logger.exception("failed")

    outside, hello, explicit, failed = _log_lines(emit)
    assert outside["service"] == "router" and "request_id" not in outside
    assert hello["msg"] == "hello world"
    assert hello["level"] == "INFO" and hello["logger"] == "test.runtime.json"
    assert hello["request_id"] == "req-1"
    assert (hello["rpc"], hello["ms"], hello["obj"]) == ("/a.B/C", 1.5, "[1]")
    assert hello["ts"].endswith("Z")
    assert explicit["request_id"] == "other"
    assert "ValueError: boom" in failed["exc"]


def test_access_line_is_the_line_a_log_record_would_make() -> None:
    """The access log's fast path writes exactly what logging would have, timestamp aside."""
    formatter = JsonFormatter("storage")
    record = logging.getLogger(ACCESS_LOGGER).makeRecord(
        ACCESS_LOGGER,
        logging.INFO,
        "",
        0,
        "rpc %s %s",
        ("/a.B/C", "NOT_FOUND"),
        None,
        extra={"rpc": "/a.B/C", "code": "NOT_FOUND", "ms": 1.25},
    )
    for request_id in ('req-"1"\\', ""):
        with request_context.request_scope(request_id or None):
            slow = json.loads(formatter.format(record))
            if not request_id:
                slow.pop("request_id")
        fast = json.loads(formatter.access_line("/a.B/C", "NOT_FOUND", 1.25, request_id))
        slow.pop("ts"), fast.pop("ts")
        assert list(fast.items()) == list(slow.items())


def test_access_lines_go_through_logging_when_anything_else_listens() -> None:
    stream = io.StringIO()
    handler = BatchingStreamHandler(stream, interval=60)
    handler.setFormatter(JsonFormatter("router"))
    root = logging.getLogger()
    saved = root.handlers[:]
    try:
        root.handlers[:] = [handler]
        assert access_handler() is handler
        handler.append('{"msg": "x"}')
        handler.flush()
        assert stream.getvalue() == '{"msg": "x"}\n'
        capture = logging.StreamHandler(io.StringIO())
        root.handlers.append(capture)  # a test's capture, say: it must see every record
        assert access_handler() is None
        root.handlers.remove(capture)
        logging.getLogger(ACCESS_LOGGER).addHandler(capture)
        assert access_handler() is None
        logging.getLogger(ACCESS_LOGGER).removeHandler(capture)
    finally:
        root.handlers[:] = saved
        handler.close()


# --- in-process gRPC --------------------------------------------------------------------------

# gRPC rounds a timeout up when it encodes it in the grpc-timeout header (a few significant
# digits), so the server may see slightly more than the client asked for.
SLACK = 1.05

ECHO = "test.Echo"


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"invalid":
        raise InvalidArgument("bad")
    if request == b"crash":
        raise RuntimeError("secret database password")
    if request == b"abort":
        await context.abort(grpc.StatusCode.NOT_FOUND, "gone")
    metadata = dict(context.invocation_metadata() or ())
    return json.dumps(
        {
            "metadata_id": metadata.get(request_context.REQUEST_ID_KEY),
            "scope_id": request_context.current_request_id(),
            "time_remaining": context.time_remaining(),
            "scope_remaining": request_context.remaining_seconds(),
        }
    ).encode()


async def _count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    for i in range(int(request)):
        yield str(i).encode()
    if request == b"2":
        raise InvalidArgument("two is too many")


async def _forever(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    i = 0
    while True:
        yield str(i).encode()
        i += 1
        await asyncio.sleep(0.01)


def _register(server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                ECHO,
                {
                    "Call": grpc.unary_unary_rpc_method_handler(_echo),
                    "Count": grpc.unary_stream_rpc_method_handler(_count),
                    "Forever": grpc.unary_stream_rpc_method_handler(_forever),
                },
            ),
        )
    )


@pytest.fixture
async def host(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ServiceHost]:
    """A started host; metrics are off unless parametrized with True (indirect), because
    stopping the metrics HTTP server costs up to half a second."""
    config = ServerConfig(
        port=0,
        metrics_port=0 if getattr(request, "param", False) else -1,
        drain_seconds=0,
        grace_seconds=0.2,
        port_file=str(tmp_path / "run" / "ports.json"),
    )
    server = ServiceHost("echo", config, [_register], [ECHO])
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def channel(host: ServiceHost) -> AsyncIterator[grpc.aio.Channel]:
    chan = open_channel(host.target)
    try:
        yield chan
    finally:
        await chan.close()


async def _call(channel: grpc.aio.Channel, payload: bytes) -> dict[str, Any]:
    return json.loads(await channel.unary_unary(f"/{ECHO}/Call")(payload))


async def _status(channel: grpc.aio.Channel, payload: bytes) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await channel.unary_unary(f"/{ECHO}/Call")(payload)
    return info.value


def _handled(method: str, code: str) -> float:
    labels = {"grpc_service": ECHO, "grpc_method": method, "grpc_code": code}
    return REGISTRY.get_sample_value("grpc_server_handled_total", labels) or 0.0


async def _handled_soon(method: str, code: str, expected: float) -> float:
    """The counter once it reaches `expected` (or after a second): context.abort sends the
    status before the interceptor's bookkeeping runs, so the client can see it first."""
    await wait_until(
        lambda: _handled(method, code) >= expected,
        timeout=1,
        what=lambda: f"{method} {code} counted {expected:g} times, not {_handled(method, code):g}",
    )
    return _handled(method, code)


async def test_service_error_maps_to_its_status(channel: grpc.aio.Channel) -> None:
    before = _handled("Call", "INVALID_ARGUMENT")
    error = await _status(channel, b"invalid")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "bad"
    assert await _handled_soon("Call", "INVALID_ARGUMENT", before + 1) == before + 1


async def test_unexpected_error_is_internal_and_hidden(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    before = _handled("Call", "INTERNAL")
    with (
        caplog.at_level(logging.ERROR, logger="system.rpc"),
        request_context.request_scope("rid-42"),
    ):
        error = await _status(channel, b"crash")
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "rid-42" in (error.details() or "")
    assert "secret" not in (error.details() or "")
    assert await _handled_soon("Call", "INTERNAL", before + 1) == before + 1
    # The traceback is logged on the server, where it belongs.
    assert any(
        r.exc_info and "secret database password" in str(r.exc_info[1]) for r in caplog.records
    )


async def test_handler_abort_passes_through(channel: grpc.aio.Channel) -> None:
    before = _handled("Call", "NOT_FOUND")
    error = await _status(channel, b"abort")
    assert (error.code(), error.details()) == (grpc.StatusCode.NOT_FOUND, "gone")
    assert await _handled_soon("Call", "NOT_FOUND", before + 1) == before + 1


async def test_request_id_and_deadline_propagate(channel: grpc.aio.Channel) -> None:
    with request_context.request_scope("abc", timeout=2.0):
        seen = await _call(channel, b"echo")
    assert seen["metadata_id"] == "abc"
    assert seen["scope_id"] == "abc"
    assert 0 < seen["time_remaining"] <= 2.0 * SLACK
    assert 0 < seen["scope_remaining"] <= 2.0 * SLACK


async def test_explicit_timeout_is_capped_by_scope(channel: grpc.aio.Channel) -> None:
    with request_context.request_scope("abc", timeout=1.0):
        seen = json.loads(await channel.unary_unary(f"/{ECHO}/Call")(b"echo", timeout=30.0))
    assert 0 < seen["time_remaining"] <= 1.0 * SLACK


async def test_call_outside_scope_gets_fresh_server_request_id(channel: grpc.aio.Channel) -> None:
    first = await _call(channel, b"echo")
    second = await _call(channel, b"echo")
    assert first["metadata_id"] is None
    assert len(first["scope_id"]) == 32 and len(second["scope_id"]) == 32
    assert first["scope_id"] != second["scope_id"]
    # Outside any scope the channel's default timeout (10 s) still bounds the call.
    assert 0 < first["time_remaining"] <= 10.0 * SLACK


async def test_streaming_errors_map_after_messages(channel: grpc.aio.Channel) -> None:
    call = channel.unary_stream(f"/{ECHO}/Count")
    assert [m async for m in call(b"3")] == [b"0", b"1", b"2"]
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for message in call(b"2"):
            received.append(message)
    assert received == [b"0", b"1"]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "two is too many"


# --- ServiceHost ------------------------------------------------------------------------------


async def _health(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
    return response.status


async def test_health_serving_for_server_and_services(channel: grpc.aio.Channel) -> None:
    assert await _health(channel, "") == health_pb2.HealthCheckResponse.SERVING
    assert await _health(channel, ECHO) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _health(channel, "no.Such")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.read().decode()


@pytest.mark.parametrize("host", [True], indirect=True, ids=["metrics"])
async def test_metrics_endpoint_and_port_file(host: ServiceHost, channel: grpc.aio.Channel) -> None:
    assert host.metrics_port > 0
    data = json.loads(Path(host.config.port_file).read_text())
    assert data["grpc_port"] == host.port > 0
    assert data["metrics_port"] == host.metrics_port
    assert host.target == f"127.0.0.1:{host.port}"

    await _call(channel, b"echo")
    await _health(channel, "")
    text = await asyncio.to_thread(_fetch, f"http://127.0.0.1:{host.metrics_port}/metrics")
    assert "grpc_server_handled_total" in text
    assert (
        f'grpc_server_handled_total{{grpc_code="OK",grpc_method="Call",grpc_service="{ECHO}"}}'
        in text
    )
    assert "grpc_server_handling_seconds_bucket" in text
    assert "grpc.health.v1" not in text  # probes are not measured


async def test_stop_drains_with_not_serving_then_cleans_up(tmp_path: Path) -> None:
    config = ServerConfig(
        metrics_port=0,
        drain_seconds=0.5,
        grace_seconds=0.2,
        port_file=str(tmp_path / "ports.json"),
    )
    host = ServiceHost("echo", config, [_register], [ECHO])
    await host.start()
    channel = open_channel(host.target)
    try:
        assert await _health(channel, ECHO) == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        stopping = asyncio.create_task(host.stop())

        async def not_serving() -> bool:
            return await _health(channel, "") == health_pb2.HealthCheckResponse.NOT_SERVING

        await wait_until(not_serving, what="the host to drain")
        assert not stopping.done()
        assert await _health(channel, ECHO) == health_pb2.HealthCheckResponse.NOT_SERVING
        # Calls still work while draining: only new work from balancers stops.
        assert (await _call(channel, b"echo"))["scope_id"]
        await stopping
        assert time.monotonic() - started >= 0.5
        await host.stop()  # a second stop is harmless
    finally:
        await channel.close()
    assert not Path(config.port_file).exists()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", host.metrics_port), 1):
        pass


async def test_metrics_off(host: ServiceHost) -> None:
    assert host.metrics_port == -1
    assert json.loads(Path(host.config.port_file).read_text())["metrics_port"] == -1


async def test_start_fails_clearly_when_port_taken(host: ServiceHost) -> None:
    config = ServerConfig(port=host.port, metrics_port=-1, drain_seconds=0)
    other = ServiceHost("other", config, [_register], [ECHO])
    with pytest.raises(OSError, match="other: cannot listen on"):
        await other.start()


async def test_client_cancel_is_cancelled_not_internal(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    before = {code: _handled("Forever", code) for code in ("CANCELLED", "INTERNAL")}
    call = channel.unary_stream(f"/{ECHO}/Forever")(b"")
    with caplog.at_level(logging.ERROR, logger="system.rpc"):
        async for message in call:
            if message == b"2":
                call.cancel()
                break
        cancelled = await _handled_soon("Forever", "CANCELLED", before["CANCELLED"] + 1)
    assert cancelled == before["CANCELLED"] + 1
    assert _handled("Forever", "INTERNAL") == before["INTERNAL"]
    assert not caplog.records
