"""Spans across services (services.runtime.tracing): one trace per player request, from the
gateway through the router, the engine and the storage, multiplexed calls included; nothing
recorded with tracing off."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from services.runtime import tracing
from services.runtime.config import ConfigError, ServerConfig
from tests.inprocess import Chain, running_chain
from tests.waiting import holds_for, wait_until


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on, into memory, for this test alone (the previous provider is put back)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    previous = tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.install(previous)
        provider.shutdown()


@pytest.fixture
async def chain(tmp_path) -> AsyncIterator[Chain]:  # type: ignore[no-untyped-def]
    async with running_chain(tmp_path) as running:
        yield running


async def _help(chain: Chain) -> None:
    client = await chain.client()
    await client.join("steve", "Steve", "en_us")
    response = await client.chat("steve", "help")
    assert response.reply.result.card.lines


async def _settled(exporter: InMemorySpanExporter, name_part: str) -> list[ReadableSpan]:
    """The finished spans, once one whose name holds `name_part` is among them (a run's
    journal writes may land just after the reply)."""
    await wait_until(
        lambda: any(name_part in span.name for span in exporter.get_finished_spans()),
        timeout=5,
        what=lambda: (
            f"a span named *{name_part}*; finished: "
            f"{[span.name for span in exporter.get_finished_spans()]}"
        ),
    )
    return list(exporter.get_finished_spans())


def _one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    matching = [span for span in spans if span.name == name]
    assert matching, f"no span {name}; spans: {sorted({s.name for s in spans})}"
    return matching[0]


def _ancestors(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[str]:
    names = []
    while span.parent is not None:
        parent = by_id.get(span.parent.span_id)
        if parent is None:
            break
        names.append(parent.name)
        span = parent
    return names


async def test_one_trace_links_gateway_router_engine_and_storage(
    spans: InMemorySpanExporter, chain: Chain
) -> None:
    await _help(chain)
    # The run's journal write (the player's join resumes their tasks on the engine's stream
    # too: not that one).
    finished = await _settled(spans, "JournalService/Multiplex/")
    request = _one(finished, "gateway/PlayerRequest")
    assert request.parent is None  # a trace of its own, not the Connect stream's
    trace_id = request.context.trace_id
    in_trace = [span for span in finished if span.context.trace_id == trace_id]
    by_id = {span.context.span_id: span for span in in_trace}

    route = _one(in_trace, "system.router.v1.RouterService/Route")
    assert route.parent is not None and route.parent.span_id == request.context.span_id
    assert route.kind is SpanKind.SERVER
    assert route.attributes is not None
    assert route.attributes["rpc.system"] == "grpc"
    assert route.attributes["rpc.service"] == "system.router.v1.RouterService"
    assert route.attributes["rpc.method"] == "Route"
    assert route.attributes["rpc.grpc.status_code"] == 0
    assert route.attributes["system.request_id"] == request.attributes["system.request_id"]  # type: ignore[index]

    # The gateway asks the router where the request goes, then the engine to run it.
    execute = _one(in_trace, "system.engine.v1.EngineService/Execute")
    assert execute.parent is not None and execute.parent.span_id == request.context.span_id

    storage = [span for span in in_trace if ".storage.v1." in span.name]
    assert storage, f"no storage span in the trace: {sorted(by_id[i].name for i in by_id)}"
    for span in storage:
        assert "gateway/PlayerRequest" in _ancestors(span, by_id), span.name
    # The engine's journal writes go on its multiplexed stream: each call's span is the child
    # of the engine's Execute span it was made in (the finish, sent after the reply, too), not
    # of the long-lived stream's.
    multiplexed = [span for span in storage if "/Multiplex/" in span.name]
    assert multiplexed, f"no multiplexed storage call: {sorted(s.name for s in storage)}"
    for span in multiplexed:
        assert span.parent is not None and span.parent.span_id == execute.context.span_id
        assert span.attributes is not None
        assert span.attributes["rpc.method"].startswith("Multiplex/")  # type: ignore[union-attr]


async def test_tracing_off_records_nothing(chain: Chain) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # Made but not installed: with tracing off no span goes anywhere, and the chain works.
    assert tracing.active() is None
    await _help(chain)
    # The run's journal writes go out just after the reply: none of them makes a span either.
    await holds_for(lambda: exporter.get_finished_spans() == (), 0.2, what="no span finished")
    assert tracing.current_traceparent() == ("", "")
    provider.shutdown()


def test_tracing_settings_are_validated() -> None:
    ServerConfig(tracing_exporter="console").validate()
    with pytest.raises(ConfigError, match="tracing_exporter"):
        ServerConfig(tracing_exporter="jaeger").validate()
    with pytest.raises(ConfigError, match="tracing_sample_ratio"):
        ServerConfig(tracing_sample_ratio=1.5).validate()


def test_otlp_without_its_package_says_what_to_install() -> None:
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-http"):
            ServerConfig(tracing_exporter="otlp").validate()
    else:
        ServerConfig(tracing_exporter="otlp").validate()


def test_configure_tracing_off_installs_nothing() -> None:
    assert tracing.configure_tracing("router", "") is None
    assert tracing.active() is None


def test_console_exporter_writes_one_json_line_per_span(capsys: pytest.CaptureFixture[str]) -> None:
    provider = tracing.make_provider("router", "console")
    previous = tracing.install(provider)
    try:
        tracer = tracing.active()
        assert tracer is not None
        started = tracing.start_server_span(
            tracer, "system.router.v1.RouterService/Route", {"rpc.system": "grpc"}, "r1", ""
        )
        assert tracing.current_traceparent()[0].startswith("00-")
        tracing.end_server_span(started, "NOT_FOUND")
    finally:
        tracing.install(previous)
        provider.shutdown()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    span = json.loads(lines[0])
    assert span["name"] == "system.router.v1.RouterService/Route"
    assert span["resource"]["attributes"]["service.name"] == "router"
    assert span["attributes"]["rpc.grpc.status_code"] == 5
    assert span["attributes"]["system.request_id"] == "r1"
    assert span["status"]["status_code"] == "ERROR"
