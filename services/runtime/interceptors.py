"""gRPC interceptors.

Server side, one interceptor for every service: takes the request id and deadline from the
call into the request context, maps typed `ServiceError`s to status codes, turns anything else
into INTERNAL (logged with its traceback, never leaked), writes one access-log line per call
and records Prometheus metrics. With tracing on (services.runtime.tracing) each call is a
span, the child of the `traceparent` it came with, current while the handler runs.

Client side: puts the current request id (and, with tracing on, the current `traceparent`)
into outgoing metadata and caps each call's timeout by the current deadline, so deadlines
shrink as a request crosses services.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from services.runtime import context as request_context
from services.runtime import tracing
from services.runtime.context import current_request_id
from services.runtime.errors import ERROR_REASON_KEY, ServiceError
from services.runtime.logging import ACCESS_LOGGER, JsonFormatter, access_handler, log_info
from services.runtime.metrics import RPC_HANDLED, RPC_LATENCY
from services.runtime.security import CallGuard, enter_caller, leave_caller

__all__ = [
    "ContextClientInterceptor",
    "Method",
    "ServerInterceptor",
    "client_interceptors",
    "error_status",
    "record_call",
]

log = logging.getLogger(ACCESS_LOGGER)

# Standard services are neither logged nor measured: probes would drown the access log.
OutboundMetadata = tuple[tuple[str, str], ...]
"""(key, value) pairs an outbound call carries."""

_QUIET_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def _split(method: str) -> tuple[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return service, name


class Method:
    """What every call of one method shares: its names and its metric series, looked up once
    (a labelled series costs a locked dictionary lookup per call otherwise)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.service, self.name = _split(method)
        self.latency = RPC_LATENCY.labels(self.service, self.name)
        self._handled: dict[str, Any] = {}
        self.span_name = method.lstrip("/")
        self.span_attributes = {
            "rpc.system": "grpc",
            "rpc.service": self.service,
            "rpc.method": self.name,
        }

    def handled(self, code: str) -> Any:
        counter = self._handled.get(code)
        if counter is None:
            counter = self._handled[code] = RPC_HANDLED.labels(self.service, self.name, code)
        return counter


class _Call:
    """Bookkeeping for one server call: context variables, error mapping, log and metrics."""

    def __init__(self, method: Method, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.info = method
        self.method = method.method
        self.context = context
        self.request_id = ""
        self.authorization = ""
        traceparent = tracestate = ""
        for key, value in context.invocation_metadata() or ():
            if key == request_context.REQUEST_ID_KEY:
                self.request_id = str(value)
            elif key == "authorization":
                self.authorization = str(value)
            elif key == tracing.TRACEPARENT_KEY:
                traceparent = str(value)
            elif key == tracing.TRACESTATE_KEY:
                tracestate = str(value)
        self.started = time.perf_counter()
        self.code = "OK"
        self._caller: contextvars.Token[str] | None = None
        # The call runs in its request scope from here until `finish`.
        self._tokens = request_context.enter_request(
            self.request_id or None, context.time_remaining()
        )
        tracer = tracing.active()
        self._span = (
            None
            if tracer is None
            else tracing.start_server_span(
                tracer,
                method.span_name,
                method.span_attributes,
                current_request_id(),
                traceparent,
                tracestate,
            )
        )

    def admit(self, guard: CallGuard | None) -> None:
        """Authenticates and authorizes the call (raises Unauthenticated / PermissionDenied);
        the caller's name is the call's `current_caller()` from here on."""
        if guard is not None:
            caller = guard.admit(self.authorization, self.context, self.method)
            self._caller = enter_caller(caller)

    async def fail(self, exc: BaseException) -> None:
        """Aborts the call with the status `exc` maps to. Always raises; an abort the handler
        made itself passes through as it is."""
        if _is_abort(exc):
            raise exc
        if isinstance(exc, asyncio.CancelledError):
            self.code = "CANCELLED"
            raise exc
        code, message, reason = error_status(exc, self.method)
        self.code = code
        await self.context.abort(
            getattr(grpc.StatusCode, code),
            message,
            ((ERROR_REASON_KEY, reason),) if reason else (),
        )

    def finish(self) -> None:
        """Records the end (metrics, access line, span) and leaves the request scope."""
        try:
            self._record()
        finally:
            request_context.leave_request(self._tokens)
            if self._caller is not None:
                leave_caller(self._caller)

    def _record(self) -> None:
        code = self.code
        if code == "OK":
            status = self.context.code()
            if status is not None and status != grpc.StatusCode.OK:
                code = status.name
        try:
            record_call(self.info, code, time.perf_counter() - self.started)
        finally:
            if self._span is not None:
                tracing.end_server_span(self._span, code)


def record_call(method: Method, code: str, elapsed: float) -> None:
    """Metrics and the access line of one finished call (`code`: a grpc.StatusCode name)."""
    method.handled(code).inc()
    method.latency.observe(elapsed)
    # One INFO line per call: it is how one request is followed across services by its id.
    if not log.isEnabledFor(logging.INFO):
        return
    handler = access_handler()
    if handler is not None:
        # The usual case in a service: the line is made directly (a LogRecord and its
        # formatting cost about as much as the rest of this interceptor).
        formatter: JsonFormatter = handler.formatter  # type: ignore[assignment]
        handler.append(
            formatter.access_line(
                method.method, code, round(elapsed * 1000, 3), current_request_id()
            )
        )
    else:
        log_info(
            log,
            "rpc %s %s",
            (method.method, code),
            {"rpc": method.method, "code": code, "ms": round(elapsed * 1000, 3)},
        )


def error_status(exc: BaseException, method: str) -> tuple[str, str, str]:
    """The status a handler's exception answers with: (grpc.StatusCode name, message,
    reason). A ServiceError says its own; anything else is INTERNAL, logged here with its
    traceback and never shown to the caller beyond the request id to quote."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message, exc.reason
    log.exception("unhandled error in %s", method, exc_info=exc)
    return (
        "INTERNAL",
        f"internal error; quote request id {current_request_id()} when reporting it",
        "",
    )


def _is_abort(exc: BaseException) -> bool:
    # context.abort raises AbortError; it already carries its status and must pass through.
    return isinstance(exc, grpc.aio.AbortError)


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler of our own services; see the module docstring.

    Args:
        guard: who may call (services.runtime.security); None on the public port, whose one
            service authenticates game servers itself.
    """

    def __init__(self, guard: CallGuard | None = None) -> None:
        self._guard = guard
        # method -> (the handler found for it, its wrapped version): grpc asks the
        # interceptor on every call, and the handlers of a server do not change.
        self._wrapped: dict[
            str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]
        ] = {}

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_QUIET_PREFIXES):
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, Method(method))
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], method: Method
    ) -> grpc.RpcMethodHandler[Any, Any]:
        guard = self._guard
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method, guard),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                self._streaming(handler.stream_stream, method, guard),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(handler.unary_stream, method, guard),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        # A handler has exactly one of the four behaviours set.
        assert handler.stream_unary is not None
        return grpc.stream_unary_rpc_method_handler(
            self._unary(handler.stream_unary, method, guard),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    @staticmethod
    def _unary(
        behavior: Callable[..., Any], method: Method, guard: CallGuard | None
    ) -> Callable[..., Any]:
        """Wraps a handler that is a coroutine (unary responses, or streams written with
        context.write)."""

        async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            # What _guard does, written out: this runs for every call, and an async context
            # manager costs an async generator and two more awaits per call.
            call = _Call(method, context)
            try:
                call.admit(guard)
                return await behavior(request, context)
            except BaseException as exc:
                await call.fail(exc)
            finally:
                call.finish()

        return wrapper

    @classmethod
    def _streaming(
        cls, behavior: Callable[..., Any], method: Method, guard: CallGuard | None
    ) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(behavior):
            return cls._unary(behavior, method, guard)

        async def generator(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            async with _guard(method, context, guard):
                async for response in behavior(request, context):
                    yield response

        return generator


@contextlib.asynccontextmanager
async def _guard(
    method: Method, context: grpc.aio.ServicerContext[Any, Any], guard: CallGuard | None
) -> AsyncIterator[None]:
    """Runs one call's body inside its request scope, mapping errors and recording the end."""
    call = _Call(method, context)
    try:
        call.admit(guard)
        yield
    except BaseException as exc:
        await call.fail(exc)
    finally:
        call.finish()


class ContextClientInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """Adds the request id, the trace context when tracing is on, and the service's credential
    to metadata, and caps the timeout by the current deadline."""

    def __init__(
        self, default_timeout: float | None, metadata: Callable[[], OutboundMetadata] = tuple
    ) -> None:
        self.default_timeout = default_timeout
        self.metadata = metadata
        """Asked on every call: what it carries (the credential as it is now)."""

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self.metadata())
        request_id = request_context.current_request_id()
        # Metadata is a collection of (key, value) pairs whose `in` tests a key.
        if request_id and request_context.REQUEST_ID_KEY not in metadata:  # type: ignore[comparison-overlap]
            metadata.add(request_context.REQUEST_ID_KEY, request_id)
        if tracing.active() is not None:
            tracing.inject(metadata)
        timeout = request_context.remaining_seconds(details.timeout or self.default_timeout)
        return grpc.aio.ClientCallDetails(
            details.method, timeout, metadata, details.credentials, details.wait_for_ready
        )

    async def intercept_unary_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, Any], Awaitable[grpc.aio.UnaryUnaryCall[Any, Any]]
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> grpc.aio.UnaryUnaryCall[Any, Any]:
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, Any], Awaitable[grpc.aio.UnaryStreamCall[Any, Any]]
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> grpc.aio.UnaryStreamCall[Any, Any]:
        return await continuation(self._details(client_call_details), request)

    async def intercept_stream_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, AsyncIterable[Any] | Iterable[Any]],
            Awaitable[grpc.aio.StreamUnaryCall[Any, Any]],
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[Any] | Iterable[Any],
    ) -> grpc.aio.StreamUnaryCall[Any, Any]:
        return await continuation(self._details(client_call_details), request_iterator)

    async def intercept_stream_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, AsyncIterable[Any] | Iterable[Any]],
            Awaitable[grpc.aio.StreamStreamCall[Any, Any]],
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[Any] | Iterable[Any],
    ) -> grpc.aio.StreamStreamCall[Any, Any]:
        return await continuation(self._details(client_call_details), request_iterator)


def client_interceptors(
    default_timeout: float | None = 10.0, metadata: Callable[[], OutboundMetadata] = tuple
) -> list[grpc.aio.ClientInterceptor]:
    """The interceptors every outbound channel uses; what `metadata` answers, asked on every
    call, goes on it (the service's credential as it is now)."""
    return [ContextClientInterceptor(default_timeout, metadata)]
