"""Spans across services (OpenTelemetry), written once for every service.

Every service has `tracing_exporter` (ServerConfig): "" (off, the default), "console" (each
span as one JSON line on stderr) or "otlp" (OTLP over HTTP to `OTEL_EXPORTER_OTLP_ENDPOINT`;
needs the opentelemetry-exporter-otlp-proto-http package), and `tracing_sample_ratio` (the
share of new traces recorded; a call inside a trace follows its caller's decision).
`configure_tracing` sets the provider up once per serving process, with the service's name as
resource.

Off, nothing is made per call: the interceptors ask `active()` and find None. On:
- the server interceptor starts a SERVER span per call (`start_server_span`), named
  `package.Service/Method`, the child of the W3C `traceparent` / `tracestate` the call came
  with, current while the handler runs (so the calls it makes are its children);
- the client interceptor puts the current span's `traceparent` into outgoing metadata
  (`inject`), beside the request id;
- calls on a multiplexed stream carry it in their `StreamedCall` (`current_traceparent`), and
  the stream's server starts each call's span from it;
- the gateway starts a trace per player request (`request_span`): the Connect stream it came
  on lasts as long as the game server stays connected and is a span of its own.

A service with tracing off neither records nor forwards trace context: a trace through it
breaks there.

The provider is this module's, not OpenTelemetry's process-wide one (which can be set only
once): `install` swaps it, so tests install an in-memory one and put the previous back.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "OTLP_MODULE",
    "TRACEPARENT_KEY",
    "TRACESTATE_KEY",
    "TRACING_EXPORTERS",
    "ServerSpan",
    "active",
    "configure_tracing",
    "current_traceparent",
    "detached_context",
    "end_server_span",
    "inject",
    "install",
    "make_provider",
    "request_span",
    "start_server_span",
]

TRACING_EXPORTERS = ("", "console", "otlp")
"""The values of `tracing_exporter`; "" is off."""
OTLP_MODULE = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
"""What "otlp" needs importable (pip install opentelemetry-exporter-otlp-proto-http)."""
TRACEPARENT_KEY = "traceparent"
TRACESTATE_KEY = "tracestate"

_PROPAGATOR = TraceContextTextMapPropagator()
_CODE_NUMBERS: dict[str, int] = {}


class _State:
    tracer: trace.Tracer | None = None
    provider: TracerProvider | None = None


_state = _State()

ServerSpan = tuple[trace.Span, object]
"""A started server span and the token that made it current (`end_server_span` ends both)."""


def active() -> trace.Tracer | None:
    """The tracer spans are made with, or None when tracing is off."""
    return _state.tracer


def install(provider: TracerProvider | None) -> TracerProvider | None:
    """Spans from now on go to `provider` (None: tracing off). Returns the provider installed
    before, for a test to put back."""
    previous = _state.provider
    _state.provider = provider
    _state.tracer = None if provider is None else provider.get_tracer("services.runtime")
    return previous


def _json_line(span: ReadableSpan) -> str:
    line: str = span.to_json(indent=None)
    return line + "\n"


def _exporter(kind: str) -> SpanExporter:
    if kind == "console":
        return ConsoleSpanExporter(out=sys.stderr, formatter=_json_line)
    module = importlib.import_module(OTLP_MODULE)  # config validation checked it is there
    exporter: SpanExporter = module.OTLPSpanExporter()
    return exporter


def make_provider(service: str, exporter: str, sample_ratio: float = 1.0) -> TracerProvider:
    """A provider sending spans, in batches, to `exporter` ("console" or "otlp"), with
    `service` as their resource's `service.name`."""
    provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(_exporter(exporter)))
    return provider


def configure_tracing(
    service: str, exporter: str, sample_ratio: float = 1.0
) -> TracerProvider | None:
    """Sets up tracing for this process as the settings say (`exporter` "": off, nothing is
    installed). Returns the provider, to `shutdown()` (flushing what is buffered) on exit."""
    if not exporter:
        return None
    provider = make_provider(service, exporter, sample_ratio)
    install(provider)
    # Also the process-wide one, for libraries that trace through the API themselves.
    trace.set_tracer_provider(provider)
    return provider


def _parent(traceparent: str, tracestate: str) -> otel_context.Context:
    """The context a call's span is the child of: its caller's span, or none (a new trace)."""
    empty = otel_context.Context()
    if not traceparent:
        return empty
    carrier = {TRACEPARENT_KEY: traceparent}
    if tracestate:
        carrier[TRACESTATE_KEY] = tracestate
    return _PROPAGATOR.extract(carrier, context=empty)


def _code_number(code: str) -> int:
    number = _CODE_NUMBERS.get(code)
    if number is None:
        import grpc

        number = _CODE_NUMBERS[code] = getattr(grpc.StatusCode, code).value[0]
    return number


def start_server_span(
    tracer: trace.Tracer,
    name: str,
    attributes: Mapping[str, Any],
    request_id: str,
    traceparent: str,
    tracestate: str = "",
) -> ServerSpan:
    """Starts the SERVER span of one call as the child of the caller's `traceparent` and makes
    it current; `end_server_span` ends it."""
    parent = _parent(traceparent, tracestate)
    span = tracer.start_span(
        name,
        context=parent,
        kind=SpanKind.SERVER,
        attributes={**attributes, "system.request_id": request_id},
    )
    return span, otel_context.attach(trace.set_span_in_context(span, parent))


def end_server_span(started: ServerSpan, code: str) -> None:
    """Ends a call's span with its status (`code`: a grpc.StatusCode name) and makes current
    again what was before it."""
    span, token = started
    try:
        span.set_attribute("rpc.grpc.status_code", _code_number(code))
        if code != "OK":
            span.set_status(Status(StatusCode.ERROR, code))
        span.end()
    finally:
        otel_context.detach(token)  # type: ignore[arg-type]


def inject(metadata: Any) -> None:
    """Adds the current span's `traceparent` (and `tracestate`) to outgoing `metadata` (a
    grpc.aio.Metadata); nothing outside a span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    for key, value in carrier.items():
        metadata.add(key, value)


def current_traceparent() -> tuple[str, str]:
    """The current span's (`traceparent`, `tracestate`), or ("", "") outside a span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get(TRACEPARENT_KEY, ""), carrier.get(TRACESTATE_KEY, "")


def detached_context() -> contextvars.Context:
    """A fresh context holding only the current trace context: for a task that must not
    inherit the request's scope (its deadline) but whose calls belong to its trace (the
    engine's finish of a run, sent after the reply)."""
    detached = contextvars.Context()
    if _state.tracer is not None:
        detached.run(otel_context.attach, otel_context.get_current())
    return detached


@contextlib.contextmanager
def request_span(name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Runs a block as the root span of a new trace (the gateway's span of one player request),
    current inside; nothing when tracing is off. An exception marks the span failed."""
    tracer = _state.tracer
    if tracer is None:
        yield
        return
    with tracer.start_as_current_span(
        name, context=otel_context.Context(), kind=SpanKind.SERVER, attributes=attributes
    ):
        yield
