"""Many unary calls on one long-lived gRPC stream (a service's `MultiplexCalls`).

In Python gRPC a unary call costs each end a few hundred microseconds of its own machinery
(a call object, metadata, an HTTP/2 stream opened and closed); a message on a stream that is
already open costs a fraction of that (measured: about three times the messages per second for
the same CPU). A client that calls one service all the time (an engine replica writing receipts
and taking leases) sends its calls as messages on one stream instead. Every such stream carries
the one envelope of `system/common/v1/stream.proto`: a `StreamedCall` names its unary RPC
(`method`) and holds that RPC's request, serialized, with an id the client chose; its
`StreamedAnswer`, with the same id, holds the RPC's response, serialized, or the status it
failed with. Calls made while a message is being written go together in the next one, and
answers ready together go back together, so under load a message carries several.

Server: `MultiplexServer.serve` runs each call on the stream as its own task through the
handler its unary RPC uses, so a call does and answers exactly what the unary call would; per
call it keeps what the server interceptor keeps for a unary call (request scope with the
call's request id and `timeout_ms` as its deadline, error mapping, metrics, one access-log
line, named `<Service>/Multiplex/<Method>`, and with tracing on a span of that name, the
child of the call's own `traceparent`).

Client: `MultiplexClient` opens the stream on first use and again after it broke, and raises
`grpc.aio.AioRpcError` like a unary call would, with the `x-error-reason` trailing metadata,
so callers handle both alike. Calls in flight when the stream breaks fail UNAVAILABLE;
idempotent ones are retried as the unary channels' retry policy would. `StreamedCalls` adds
the owner's channel settings and the fall back to unary calls where the service answers
UNIMPLEMENTED (decision 0021).

Streams are replaced, not held for good (decision 0022): a stream takes new calls for
`stream_seconds` (`ChannelSettings.stream_seconds`, 30 s), then the next call opens a new
stream and the old one is closed cleanly once its calls are answered: the client ends its
side, the server answers what it runs and ends the stream with OK. No call is cut or sent
twice by it. That way a stream follows its channel's round robin to every replica in turn,
and it is never in use when a server closes its aged connection (`max_connection_age_seconds`
with a grace longer than `stream_seconds` plus the longest call): after the GOAWAY the next
stream goes on the new connection, and the old one ends within the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from system.common.v1.stream_pb2 import StreamedAnswer, StreamedCall

from services.runtime import context as request_context
from services.runtime import tracing
from services.runtime.channels import ChannelSettings, Dependency, open_channel
from services.runtime.errors import ERROR_REASON_KEY, NOT_SENT, never_sent
from services.runtime.interceptors import Method, error_status, record_call
from services.runtime.logging import RepeatedLines

__all__ = [
    "MAX_IN_FLIGHT",
    "MAX_ITEM_BYTES",
    "PACK_BYTES",
    "STREAM_METHOD",
    "MultiplexClient",
    "MultiplexServer",
    "StreamedCalls",
]

log = logging.getLogger("system.multiplex")

STREAM_METHOD = "MultiplexCalls"
"""The stream RPC of a service that has one; its request holds `calls` (StreamedCall), its
response `answers` (StreamedAnswer)."""

MAX_IN_FLIGHT = 1024
"""Calls one stream may have in flight on the server; more are refused RESOURCE_EXHAUSTED."""

MAX_ITEM_BYTES = 4 * 1024 * 1024 - 1024
"""The largest call or answer a message carries: gRPC's default limit on a received message
(4 MiB), less room for the envelope. A larger one would end the whole stream at the receiver,
so it is refused alone, RESOURCE_EXHAUSTED, as its unary call would have been."""

PACK_BYTES = 1024 * 1024
"""Calls or answers are packed into one message up to this size (one larger goes alone)."""

_DONE = object()
_CODE_NUMBERS = {code.name: code.value[0] for code in grpc.StatusCode}
_CODES = {code.value[0]: code for code in grpc.StatusCode}

Handler = Callable[[Any, Any], Awaitable[Any]]


def _unary_methods(service: ServiceDescriptor) -> dict[str, MethodDescriptor]:
    return {m.name: m for m in service.methods if not (m.client_streaming or m.server_streaming)}


def _stream_types(service: ServiceDescriptor) -> tuple[type[Message], type[Message]]:
    """The request and response messages of the service's stream RPC."""
    method = service.methods_by_name.get(STREAM_METHOD)
    if method is None:
        raise ValueError(f"{service.full_name} has no {STREAM_METHOD} stream")
    return (
        message_factory.GetMessageClass(method.input_type),
        message_factory.GetMessageClass(method.output_type),
    )


def _packed(items: list[tuple[Any, int]]) -> Iterator[list[Any]]:
    """`items` (each with its size) in consecutive groups of at most PACK_BYTES, each group
    holding at least one item."""
    group: list[Any] = []
    size = 0
    for item, item_size in items:
        if group and size + item_size > PACK_BYTES:
            yield group
            group, size = [], 0
        group.append(item)
        size += item_size
    if group:
        yield group


def _error(call_id: int, code: str, message: str, reason: str = "") -> StreamedAnswer:
    answer = StreamedAnswer(call_id=call_id)
    answer.error.code = _CODE_NUMBERS[code]
    answer.error.message = message
    answer.error.reason = reason
    return answer


def _sized(answer: StreamedAnswer) -> tuple[StreamedAnswer, int]:
    """The answer and its size; an answer too large for a message becomes the error its unary
    call's caller would have seen."""
    size = answer.ByteSize()
    if size <= MAX_ITEM_BYTES:
        return answer, size
    error = _error(
        answer.call_id,
        "RESOURCE_EXHAUSTED",
        f"the answer is {size} bytes, more than a message carries ({MAX_ITEM_BYTES})",
    )
    return error, error.ByteSize()


class MultiplexServer:
    """Serves the `MultiplexCalls` stream of one service.

    Args:
        service: the service's descriptor (`journal_pb2.DESCRIPTOR.services_by_name[...]`):
            its stream's messages, and each unary RPC's request message.
        handlers: per unary RPC served on the stream (`Commit`), its handler; each is called
            as `handler(request, None)`.
        max_in_flight: calls one stream may have in flight.
    """

    def __init__(
        self,
        service: ServiceDescriptor,
        handlers: Mapping[str, Handler],
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        unary = _unary_methods(service)
        unknown = sorted(set(handlers) - set(unary))
        if unknown:
            raise ValueError(f"{service.full_name} has no unary RPC {', '.join(unknown)}")
        self._name = service.name
        self._response_type = _stream_types(service)[1]
        self._routes = {
            name: (
                message_factory.GetMessageClass(unary[name].input_type),
                handler,
                Method(f"/{service.full_name}/Multiplex/{name}"),
            )
            for name, handler in handlers.items()
        }
        self._served = ", ".join(sorted(handlers))
        self._max_in_flight = max_in_flight
        self._repeated = RepeatedLines(log)

    def _refusal(
        self, call: StreamedCall, in_flight: Mapping[int, object]
    ) -> StreamedAnswer | None:
        """The answer refusing `call` before it runs, or None when it may run."""
        call_id = call.call_id
        if not call.method:
            return _error(call_id, "INVALID_ARGUMENT", "the call names no method")
        if call.method not in self._routes:
            return _error(
                call_id,
                "UNIMPLEMENTED",
                f"{self._name} serves no {call.method[:100]!r} on this stream; "
                f"it serves {self._served}",
            )
        if call_id in in_flight:
            return _error(
                call_id,
                "INVALID_ARGUMENT",
                f"call id {call_id} is already in flight on this stream; "
                "give each call in flight its own id",
            )
        if len(in_flight) >= self._max_in_flight:
            return _error(
                call_id,
                "RESOURCE_EXHAUSTED",
                f"{self._max_in_flight} calls are in flight on this stream; "
                "wait for answers before sending more",
            )
        return None

    async def serve(
        self,
        requests: AsyncIterator[Any],
        context: grpc.aio.ServicerContext[Any, Any] | None = None,
    ) -> AsyncIterator[Any]:
        """The answers to the calls read from `requests`, as they finish. Ends once the client
        closed its side and every call answered.

        With the stream's `context`, messages are read from it instead, so that a message
        whose envelope cannot be decoded (corrupt framing) ends no stream: its calls, which
        cannot be told apart, get no answer (each caller's own deadline ends it) and every
        other call goes on. Without it, such a message ends the stream as gRPC does. A call
        whose own request cannot be decoded is refused alone, INVALID_ARGUMENT."""
        loop = asyncio.get_running_loop()
        answers: asyncio.Queue[Any] = asyncio.Queue()
        in_flight: dict[int, asyncio.Task[None]] = {}

        async def run(call: StreamedCall, request: Any) -> None:
            call_id = call.call_id
            _, handler, method = self._routes[call.method]
            tokens = request_context.enter_request(
                call.request_id or None, call.timeout_ms / 1000 if call.timeout_ms else None
            )
            tracer = tracing.active()
            span = (
                None
                if tracer is None
                else tracing.start_server_span(
                    tracer,
                    method.span_name,
                    method.span_attributes,
                    request_context.current_request_id(),
                    call.traceparent,
                    call.tracestate,
                )
            )
            started = time.perf_counter()
            code = "OK"
            try:
                response = await handler(request, None)
                answer = StreamedAnswer(call_id=call_id, response=response.SerializeToString())
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception as exc:  # noqa: BLE001 - becomes this call's status
                code, message, reason = error_status(exc, method.method)
                answer = _error(call_id, code, message, reason)
            finally:
                del in_flight[call_id]
                record_call(method, code, time.perf_counter() - started)
                if span is not None:
                    tracing.end_server_span(span, code)
                request_context.leave_request(tokens)
            answers.put_nowait(answer)

        def start(call: StreamedCall) -> None:
            refusal = self._refusal(call, in_flight)
            if refusal is not None:
                answers.put_nowait(refusal)
                return
            try:
                request = self._routes[call.method][0].FromString(call.request)
            except DecodeError as exc:
                answers.put_nowait(
                    _error(
                        call.call_id,
                        "INVALID_ARGUMENT",
                        f"the request of {call.method} could not be decoded: {str(exc)[:200]}",
                    )
                )
                return
            # A context of its own per call: its request scope (id, deadline) is its own.
            in_flight[call.call_id] = loop.create_task(
                run(call, request),
                context=contextvars.Context(),
            )

        async def read() -> None:
            try:
                if context is None:
                    async for request in requests:
                        for call in request.calls:
                            start(call)
                else:
                    while True:
                        try:
                            request = await context.read()
                        except DecodeError as exc:
                            self._repeated.log(
                                logging.WARNING,
                                "undecodable",
                                "a stream message could not be decoded; its calls go "
                                "unanswered, the stream goes on: %s",
                                str(exc)[:200],
                            )
                            continue
                        if request is grpc.aio.EOF:
                            break
                        for call in request.calls:
                            start(call)
                while in_flight:
                    await asyncio.wait(list(in_flight.values()))
            finally:
                answers.put_nowait(_DONE)

        reader = loop.create_task(read())
        try:
            done = False
            while not done:
                ready = [await answers.get()]
                # One turn of the loop first: a call finishing in the same turn as this one
                # (the other of two results the game server sent in one read, say) goes in
                # the same message, one write and one read fewer for both ends.
                await asyncio.sleep(0)
                while not answers.empty():  # what finished together goes together
                    ready.append(answers.get_nowait())
                if ready[-1] is _DONE:
                    done = True
                    ready.pop()
                for packed in _packed([_sized(answer) for answer in ready]):
                    yield self._response_type(answers=packed)
            await reader  # the request stream's own failure, if it failed
        finally:
            reader.cancel()
            for task in list(in_flight.values()):
                task.cancel()


class MultiplexClient:
    """Calls on one `MultiplexCalls` stream (see the module docstring).

    Args:
        open_stream: starts the stream RPC (a stub's `MultiplexCalls`, called with no
            arguments).
        service: the service's descriptor: its stream's request message, and each unary
            RPC's request and response messages.
        retries: attempts after the first for calls marked idempotent that failed UNAVAILABLE.
        stream_seconds: how long a stream takes new calls before the next call opens a new
            one (see the module docstring); 0: one stream until it breaks.
    """

    def __init__(
        self,
        open_stream: Callable[[], Any],
        service: ServiceDescriptor,
        retries: int = 2,
        stream_seconds: float = ChannelSettings.stream_seconds,
    ) -> None:
        self._open_stream = open_stream
        self._service = service.full_name
        self._request_type = _stream_types(service)[0]
        self._methods = {
            name: (m.input_type, message_factory.GetMessageClass(m.output_type))
            for name, m in _unary_methods(service).items()
        }
        self._retries = retries
        self._stream_seconds = stream_seconds
        self._stream: _Stream | None = None
        self._replacement: asyncio.TimerHandle | None = None
        self._retiring: dict[_Stream, asyncio.Task[None]] = {}
        self._next_id = 0
        self._closed = False
        self.streams_opened = 0
        """Streams opened so far: 1 while the first stays up, and one more after each
        `stream_seconds` with calls, or after a stream broke."""

    async def call(
        self, method: str, request: Message, timeout: float | None, idempotent: bool = False
    ) -> Any:
        """The answer to `request` sent as a call of the unary RPC `method` (`Commit`);
        raises grpc.aio.AioRpcError as the unary RPC would. `timeout` (for all attempts
        together) is capped by the current request's deadline."""
        types = self._methods.get(method)
        if types is None:
            raise ValueError(f"{self._service} has no unary RPC {method!r}")
        expected, response_type = types
        if request.DESCRIPTOR is not expected:
            raise TypeError(
                f"{method} takes {expected.full_name}, not {request.DESCRIPTOR.full_name}"
            )
        loop = asyncio.get_running_loop()
        timeout = request_context.remaining_seconds(timeout)
        deadline = None if timeout is None else loop.time() + timeout
        delay = 0.05
        attempt = 0
        while True:
            left = None if deadline is None else deadline - loop.time()
            try:
                return await self._call_once(method, request, response_type, left)
            except grpc.aio.AioRpcError as exc:
                if (
                    not idempotent
                    or attempt >= self._retries
                    or exc.code() != grpc.StatusCode.UNAVAILABLE
                ):
                    raise
            attempt += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _call_once(
        self, method: str, request: Message, response_type: type[Message], timeout: float | None
    ) -> Any:
        if self._closed:
            raise _rpc_error(grpc.StatusCode.CANCELLED, "the client is closed")
        if timeout is not None and timeout <= 0:
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        stream = self._stream
        if stream is None or stream.broken:
            stream = self._open()
        # From here to `submit` nothing awaits: the call goes on the stream just taken, which
        # a replacement cannot retire in between.
        self._next_id += 1
        call_id = self._next_id
        future = stream.expect(call_id)
        call = StreamedCall(
            call_id=call_id,
            request_id=request_context.current_request_id(),
            method=method,
            request=request.SerializeToString(),
        )
        if timeout is not None:
            call.timeout_ms = max(1, int(timeout * 1000))
        if tracing.active() is not None:
            call.traceparent, call.tracestate = tracing.current_traceparent()
        stream.submit(call)
        timer = None
        if timeout is not None:
            timer = asyncio.get_running_loop().call_later(
                timeout, stream.expire, call_id, "deadline exceeded"
            )
        try:
            answer = await future
        finally:
            if timer is not None:
                timer.cancel()
            stream.forget(call_id)
            if future.done() and not future.cancelled():
                future.exception()  # heard of here or by the caller: never "not retrieved"
        if answer.WhichOneof("outcome") == "error":
            error = answer.error
            code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
            raise _rpc_error(code, error.message, error.reason)
        try:
            return response_type.FromString(answer.response)
        except DecodeError as exc:  # nested deeper than protobuf decodes, say: this call alone
            raise _rpc_error(
                grpc.StatusCode.INTERNAL, f"the answer could not be decoded: {str(exc)[:200]}"
            ) from None

    def _open(self) -> _Stream:
        if self._replacement is not None:
            self._replacement.cancel()
        stream = self._stream = _Stream(self._open_stream(), self._request_type)
        self.streams_opened += 1
        if self._stream_seconds > 0:
            self._replacement = asyncio.get_running_loop().call_later(
                self._stream_seconds, self._retire, stream
            )
        return stream

    def _retire(self, stream: _Stream) -> None:
        """`stream` takes no more calls (the next call opens a new stream) and is closed once
        the calls on it are answered."""
        if self._stream is stream:
            self._stream = None
            self._replacement = None
        if self._closed or stream.broken:
            return
        # Detached, like the stream's reader: it outlives the call that happened to open it.
        retirement = asyncio.get_running_loop().create_task(
            stream.finish(), context=contextvars.Context()
        )
        self._retiring[stream] = retirement
        retirement.add_done_callback(lambda _: self._retiring.pop(stream, None))

    async def aclose(self) -> None:
        self._closed = True
        if self._replacement is not None:
            self._replacement.cancel()
        for stream, retirement in list(self._retiring.items()):
            retirement.cancel()
            await stream.close()
            with contextlib.suppress(asyncio.CancelledError):
                await retirement
        if self._stream is not None:
            await self._stream.close()


class StreamedCalls:
    """A client's calls to one service on that service's `MultiplexCalls` stream, on a
    channel of its own, without interceptors: the stream outlives every request, and each
    call carries its request id and deadline itself.

    Everything else comes from the owner's `Dependency` on the service: its target, whether
    its connections are private, how long a stream takes calls before it is replaced (its
    settings' `stream_seconds`), which methods are idempotent (those calls are retried on
    UNAVAILABLE, as its channel's retry policy retries them), and its stub, on which a call
    goes as a unary RPC once the service answered UNIMPLEMENTED for its method on the stream:
    a service without the stream (another version, during a rolling upgrade: decision 0021)
    or without that method on it.

    Args:
        dependency: the owner's channel and stub to the service.
        service: the service's descriptor (`journal_pb2.DESCRIPTOR.services_by_name[...]`).
    """

    def __init__(self, dependency: Dependency[Any], service: ServiceDescriptor) -> None:
        self._unary = dependency.stub
        self._idempotent = {
            name
            for name in _unary_methods(service)
            if f"{service.full_name}/{name}" in dependency.idempotent_methods
        }
        self._unary_only: set[str] = set()
        self._channel = open_channel(
            dependency.target,
            interceptors=False,
            private=dependency.private,
            settings=dependency.settings,
        )
        security = dependency.settings.security
        request_type, response_type = _stream_types(service)
        open_stream = self._channel.stream_stream(
            f"/{service.full_name}/{STREAM_METHOD}",
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString,
        )
        self._client = MultiplexClient(
            # The credential as it is when each stream opens (a rotated token file).
            lambda: open_stream(metadata=security.metadata or None),
            service,
            stream_seconds=dependency.settings.stream_seconds,
        )

    @property
    def streams_opened(self) -> int:
        """Streams opened so far (see MultiplexClient.streams_opened)."""
        return self._client.streams_opened

    async def call(
        self, method: str, request: Message, timeout: float, idempotent: bool | None = None
    ) -> Any:
        """The answer of a call of the unary RPC `method` (`Commit`); raises
        grpc.aio.AioRpcError as the unary RPC does. `idempotent`: whether this call may be
        retried on UNAVAILABLE; None: as the dependency declares for the method."""
        if idempotent is None:
            idempotent = method in self._idempotent
        if method not in self._unary_only:
            try:
                return await self._client.call(method, request, timeout, idempotent=idempotent)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                # Nothing ran: the service has no such stream, or not this method on it.
                self._unary_only.add(method)
        return await getattr(self._unary, method)(request, timeout=timeout)

    async def aclose(self) -> None:
        await self._client.aclose()
        await self._channel.close()


def _rpc_error(code: grpc.StatusCode, message: str, reason: str = "") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((ERROR_REASON_KEY, reason)) if reason else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, message)


class _Stream:
    """One open stream: the calls waiting for answers, the calls waiting to be written, and
    the tasks that write and read."""

    def __init__(self, call: Any, request_type: type[Any]) -> None:
        self._call = call
        self._request_type = request_type
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._unsent: list[tuple[Any, int]] = []
        self._writer: asyncio.Task[None] | None = None
        self._answered = asyncio.Event()
        """Set whenever no call waits for an answer (a retired stream may then end)."""
        self.broken = False
        # Detached: the reader outlives the request that happened to open the stream.
        self._reader = asyncio.get_running_loop().create_task(
            self._read(), context=contextvars.Context()
        )

    def expect(self, call_id: int) -> asyncio.Future[Any]:
        """The future of a call about to be submitted (on a stream that is not broken: the
        client opens a new one first)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        return future

    def forget(self, call_id: int) -> None:
        self._waiting.pop(call_id, None)
        if not self._waiting:
            self._answered.set()

    def expire(self, call_id: int, message: str) -> None:
        future = self._waiting.pop(call_id, None)
        if future is not None and not future.done():
            future.set_exception(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, message))
        if not self._waiting:
            self._answered.set()

    def submit(self, call: Any) -> None:
        """Queues a call for the next message: one message at a time is written, and what
        was queued meanwhile goes in the one after."""
        size = call.ByteSize()
        if size > MAX_ITEM_BYTES:
            future = self._waiting.pop(call.call_id, None)
            if future is not None and not future.done():
                future.set_exception(
                    _rpc_error(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the call is {size} bytes, more than a message carries ({MAX_ITEM_BYTES})",
                    )
                )
            return
        self._unsent.append((call, size))
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(
                self._write(), context=contextvars.Context()
            )

    async def _write(self) -> None:
        try:
            # One turn of the loop first, so that calls made in the same turn as this one
            # (by tasks woken together) go in the same message.
            await asyncio.sleep(0)
            while self._unsent:
                waiting, self._unsent = self._unsent, []
                for calls in _packed(waiting):
                    await self._call.write(self._request_type(calls=calls))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            # The stream has ended: say what it ended with (UNIMPLEMENTED: the service has
            # no such stream, and the caller falls back to unary calls).
            status = await self._call.code()
            self._break(exc, status)
        finally:
            self._writer = None

    async def _read(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    break
                for answer in response.answers:
                    future = self._waiting.get(answer.call_id)
                    if future is not None and not future.done():
                        future.set_result(answer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every waiting call hears of it below
            error = exc
        finally:
            self._break(error, error.code() if isinstance(error, grpc.aio.AioRpcError) else None)

    def _break(self, error: BaseException | None, status: grpc.StatusCode | None) -> None:
        if error is not None and not self.broken:
            log.warning(
                "a Multiplex stream ended: %s; its %d calls in flight fail, the next call "
                "opens a new stream",
                error.details() if isinstance(error, grpc.aio.AioRpcError) else repr(error),
                len(self._waiting),
            )
        self.broken = True
        self._unsent.clear()
        # A service without the stream answers UNIMPLEMENTED, and the caller falls back.
        code = status if status == grpc.StatusCode.UNIMPLEMENTED else grpc.StatusCode.UNAVAILABLE
        detail = f": {error.details()}" if isinstance(error, grpc.aio.AioRpcError) else ""
        # A stream that never connected carried nothing: its callers may send the calls again.
        reason = NOT_SENT if never_sent(error) else ""
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(
                    _rpc_error(
                        code,
                        f"the stream to the service ended before the answer came{detail}",
                        reason,
                    )
                )
        self._waiting.clear()
        self._answered.set()

    async def finish(self) -> None:
        """Ends the stream cleanly once no call on it waits for its answer (the client takes
        no new calls onto it): the rest of what was submitted is written, the client ends
        its side, and the server, having answered every call it read, ends the stream with OK
        (the reader's EOF)."""
        while self._waiting:
            self._answered.clear()
            await self._answered.wait()
        if self._writer is not None:
            await self._writer
        if not self.broken:
            # A stream that ended meanwhile fails here; its reader has heard how.
            with contextlib.suppress(Exception):
                await self._call.done_writing()
        await self._reader

    async def close(self) -> None:
        self._break(None, None)
        self._call.cancel()
        for task in (self._reader, self._writer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
