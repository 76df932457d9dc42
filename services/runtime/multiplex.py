"""Many unary calls on one long-lived gRPC stream (`JournalService.Multiplex`).

In Python gRPC a unary call costs each end a few hundred microseconds of its own machinery
(a call object, metadata, an HTTP/2 stream opened and closed); a message on a stream that is
already open costs a fraction of that (measured: about three times the messages per second for
the same CPU). A client that calls one service all the time (an engine replica writing receipts
and taking leases) sends its calls as messages on one stream instead; each carries an id the
client chose, and its answer, or the status it failed with, comes back with that id. Calls
made while a message is being written go together in the next one, and answers ready together
go back together, so under load a message carries several.

Server: `MultiplexServer.serve` runs each call on the stream as its own task through the
handler its unary RPC uses, so a call does and answers exactly what the unary call would; per
call it keeps what the server interceptor keeps for a unary call (request scope with the
call's request id and, where the envelope has `timeout_ms`, its deadline; error mapping,
metrics, one access-log line, named `<Service>/Multiplex/<Method>`).

Client: `MultiplexClient` opens the stream on first use and again after it broke, and raises
`grpc.aio.AioRpcError` like a unary call would, with the `x-error-reason` trailing metadata,
so callers handle both alike. Calls in flight when the stream breaks fail UNAVAILABLE;
idempotent ones are retried as the unary channels' retry policy would.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

from services.runtime import context as request_context
from services.runtime.channels import Dependency, open_channel
from services.runtime.errors import ERROR_REASON_KEY
from services.runtime.interceptors import Method, error_status, record_call
from services.runtime.logging import RepeatedLines

__all__ = [
    "MAX_IN_FLIGHT",
    "MAX_ITEM_BYTES",
    "PACK_BYTES",
    "MultiplexClient",
    "MultiplexServer",
    "StreamedCalls",
]

log = logging.getLogger("system.multiplex")

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


class MultiplexServer:
    """Serves `Multiplex` streams of one service.

    Args:
        service: the full service name (`system.storage.v1.JournalService`), for logs and
            metrics.
        response_type: the stream's response message, whose `answers` holds answers.
        answer_type: one answer: `call_id`, an `error` (CallStatus) and one field per call,
            named as the call's.
        handlers: per call field (`commit`), the unary RPC's method name (`Commit`) and its
            handler; each is called as `handler(request, None)`.
        max_in_flight: calls one stream may have in flight.
    """

    def __init__(
        self,
        service: str,
        response_type: type[Any],
        answer_type: type[Any],
        handlers: Mapping[str, tuple[str, Handler]],
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self._response_type = response_type
        self._answer_type = answer_type
        self._routes = {
            field: (handler, Method(f"/{service}/Multiplex/{name}"))
            for field, (name, handler) in handlers.items()
        }
        self._max_in_flight = max_in_flight
        self._repeated = RepeatedLines(log)

    def _error(self, call_id: int, code: str, message: str, reason: str = "") -> Any:
        answer = self._answer_type(call_id=call_id)
        error = answer.error
        error.code = _CODE_NUMBERS[code]
        error.message = message
        error.reason = reason
        return answer

    def _sized(self, answer: Any) -> tuple[Any, int]:
        """The answer and its size; an answer too large for a message becomes the error its
        unary call's caller would have seen."""
        size = answer.ByteSize()
        if size <= MAX_ITEM_BYTES:
            return answer, size
        error = self._error(
            answer.call_id,
            "RESOURCE_EXHAUSTED",
            f"the answer is {size} bytes, more than a message carries ({MAX_ITEM_BYTES})",
        )
        return error, error.ByteSize()

    async def serve(
        self,
        requests: AsyncIterator[Any],
        context: grpc.aio.ServicerContext[Any, Any] | None = None,
    ) -> AsyncIterator[Any]:
        """The answers to the calls read from `requests`, as they finish. Ends once the client
        closed its side and every call answered.

        With the stream's `context`, messages are read from it instead, so that one message
        that cannot be decoded (corrupt, or nested deeper than protobuf decodes) ends no
        stream: its calls, which cannot be told apart, get no answer (each caller's own
        deadline ends it) and every other call goes on. Without it, such a message ends the
        stream as gRPC does."""
        loop = asyncio.get_running_loop()
        answers: asyncio.Queue[Any] = asyncio.Queue()
        in_flight: dict[int, asyncio.Task[None]] = {}
        # Whether this envelope's calls carry `timeout_ms`, known from the first call.
        with_deadline: bool | None = None

        async def run(
            call_id: int, field: str, request: Any, request_id: str, timeout: float | None
        ) -> None:
            handler, method = self._routes[field]
            tokens = request_context.enter_request(request_id or None, timeout)
            started = time.perf_counter()
            code = "OK"
            try:
                response = await handler(request, None)
                answer = self._answer_type(call_id=call_id, **{field: response})
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception as exc:  # noqa: BLE001 - becomes this call's status
                code, message, reason = error_status(exc, method.method)
                answer = self._error(call_id, code, message, reason)
            finally:
                del in_flight[call_id]
                record_call(method, code, time.perf_counter() - started)
                request_context.leave_request(tokens)
            answers.put_nowait(answer)

        def start(call: Any) -> None:
            nonlocal with_deadline
            if with_deadline is None:
                with_deadline = "timeout_ms" in call.DESCRIPTOR.fields_by_name
            call_id = call.call_id
            field = call.WhichOneof("call")
            if field is None or field not in self._routes:
                answers.put_nowait(self._error(call_id, "INVALID_ARGUMENT", "the call is empty"))
            elif call_id in in_flight:
                answers.put_nowait(
                    self._error(
                        call_id,
                        "INVALID_ARGUMENT",
                        f"call id {call_id} is already in flight on this stream; "
                        "give each call in flight its own id",
                    )
                )
            elif len(in_flight) >= self._max_in_flight:
                answers.put_nowait(
                    self._error(
                        call_id,
                        "RESOURCE_EXHAUSTED",
                        f"{self._max_in_flight} calls are in flight on this stream; "
                        "wait for answers before sending more",
                    )
                )
            else:
                # A context of its own per call: its request scope (id, deadline) is its own.
                timeout_ms = call.timeout_ms if with_deadline else 0
                in_flight[call_id] = loop.create_task(
                    run(
                        call_id,
                        field,
                        getattr(call, field),
                        call.request_id,
                        timeout_ms / 1000 if timeout_ms else None,
                    ),
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
                                "a Multiplex message could not be decoded; its calls go "
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
                while not answers.empty():  # what finished together goes together
                    ready.append(answers.get_nowait())
                if ready[-1] is _DONE:
                    done = True
                    ready.pop()
                for packed in _packed([self._sized(answer) for answer in ready]):
                    yield self._response_type(answers=packed)
            await reader  # the request stream's own failure, if it failed
        finally:
            reader.cancel()
            for task in list(in_flight.values()):
                task.cancel()


class MultiplexClient:
    """Calls on one `Multiplex` stream (see the module docstring).

    Args:
        open_stream: starts the stream RPC (a stub's `Multiplex`, called with no arguments).
        request_type: the stream's request message, whose `calls` holds calls.
        call_type: one call: `call_id`, `request_id` and one field per call.
        retries: attempts after the first for calls marked idempotent that failed UNAVAILABLE.
    """

    def __init__(
        self,
        open_stream: Callable[[], Any],
        request_type: type[Any],
        call_type: type[Any],
        retries: int = 2,
    ) -> None:
        self._open_stream = open_stream
        self._request_type = request_type
        self._call_type = call_type
        # An envelope with `timeout_ms` carries each call's deadline to the server.
        self._sends_deadline = "timeout_ms" in call_type.DESCRIPTOR.fields_by_name
        self._retries = retries
        self._stream: _Stream | None = None
        self._next_id = 0
        self._closed = False
        self.streams_opened = 0
        """Streams opened so far: 1 while the first stays up (a broken one is reopened)."""

    async def call(
        self, field: str, request: Any, timeout: float | None, idempotent: bool = False
    ) -> Any:
        """The answer to `request` sent as the call `field`; raises grpc.aio.AioRpcError as
        the unary RPC would. `timeout` (for all attempts together) is capped by the current
        request's deadline."""
        loop = asyncio.get_running_loop()
        timeout = request_context.remaining_seconds(timeout)
        deadline = None if timeout is None else loop.time() + timeout
        delay = 0.05
        attempt = 0
        while True:
            left = None if deadline is None else deadline - loop.time()
            try:
                return await self._call_once(field, request, left)
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

    async def _call_once(self, field: str, request: Any, timeout: float | None) -> Any:
        if self._closed:
            raise _rpc_error(grpc.StatusCode.CANCELLED, "the client is closed")
        if timeout is not None and timeout <= 0:
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        stream = self._stream
        if stream is None or stream.broken:
            stream = self._stream = _Stream(self._open_stream(), self._request_type)
            self.streams_opened += 1
        self._next_id += 1
        call_id = self._next_id
        future = stream.expect(call_id)
        call = self._call_type(
            call_id=call_id, request_id=request_context.current_request_id(), **{field: request}
        )
        if self._sends_deadline and timeout is not None:
            call.timeout_ms = max(1, int(timeout * 1000))
        stream.submit(call)
        timer = None
        if timeout is not None:
            timer = asyncio.get_running_loop().call_later(
                timeout, stream.expire, call_id, "deadline exceeded"
            )
        try:
            response = await future
        finally:
            if timer is not None:
                timer.cancel()
            stream.forget(call_id)
            if future.done() and not future.cancelled():
                future.exception()  # heard of here or by the caller: never "not retrieved"
        if response.WhichOneof("outcome") == "error":
            error = response.error
            code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
            raise _rpc_error(code, error.message, error.reason)
        return getattr(response, field)

    async def aclose(self) -> None:
        self._closed = True
        if self._stream is not None:
            await self._stream.close()


class StreamedCalls:
    """A client's calls to one service on that service's `Multiplex` stream, on a channel of
    its own, without interceptors: the stream outlives every request, and each call carries
    its request id (and deadline, where the envelope has one) itself.

    Everything else comes from the owner's `Dependency` on the service: its target, whether
    its connections are private, which methods are idempotent (those calls are retried on
    UNAVAILABLE, as its channel's retry policy retries them), and its stub, on which the calls
    go as unary RPCs once the service answered UNIMPLEMENTED (an older version without the
    stream, during a rolling upgrade).

    Args:
        dependency: the owner's channel and stub to the service.
        stub_type: the generated stub class (its `Multiplex` opens the stream).
        request_type: the stream's request message (`calls`).
        call_type: one call in it.
        methods: per call field (`commit`), the unary RPC's full name
            (`system.storage.v1.JournalService/Commit`).
    """

    def __init__(
        self,
        dependency: Dependency[Any],
        stub_type: Callable[[grpc.aio.Channel], Any],
        request_type: type[Any],
        call_type: type[Any],
        methods: Mapping[str, str],
    ) -> None:
        self._unary = dependency.stub
        self._methods = {field: name.rpartition("/")[2] for field, name in methods.items()}
        self._idempotent = {
            field for field, name in methods.items() if name in dependency.idempotent_methods
        }
        self._streamed = True
        self._channel = open_channel(
            dependency.target,
            interceptors=False,
            private=dependency.private,
            settings=dependency.settings,
        )
        metadata = dependency.settings.security.metadata
        # Opened with a parser that fails one undecodable answer alone (tolerant_parser).
        path, response_type, answer_type = _stream_method(request_type)
        open_stream = self._channel.stream_stream(
            path,
            request_serializer=request_type.SerializeToString,
            response_deserializer=tolerant_parser(response_type, answer_type),
        )
        self._client = MultiplexClient(
            functools.partial(open_stream, metadata=metadata) if metadata else open_stream,
            request_type,
            call_type,
        )

    @property
    def streams_opened(self) -> int:
        """Streams opened so far (see MultiplexClient.streams_opened)."""
        return self._client.streams_opened

    async def call(self, field: str, request: Any, timeout: float) -> Any:
        """The answer of the call `field`; raises grpc.aio.AioRpcError as the unary RPC
        does."""
        if self._streamed:
            try:
                return await self._client.call(
                    field, request, timeout, idempotent=field in self._idempotent
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._streamed = False
        return await getattr(self._unary, self._methods[field])(request, timeout=timeout)

    async def aclose(self) -> None:
        await self._client.aclose()
        await self._channel.close()


def _stream_method(request_type: type[Any]) -> tuple[str, type[Any], type[Any]]:
    """The `Multiplex` method whose requests are `request_type`: its path, its response
    message and the response's answer message."""
    descriptor = request_type.DESCRIPTOR
    for service in descriptor.file.services_by_name.values():
        method = service.methods_by_name.get("Multiplex")
        if method is not None and method.input_type is descriptor:
            response = method.output_type
            answer = response.fields_by_name["answers"].message_type
            return (
                f"/{service.full_name}/Multiplex",
                message_factory.GetMessageClass(response),
                message_factory.GetMessageClass(answer),
            )
    raise ValueError(f"no Multiplex method takes {descriptor.full_name}")


def tolerant_parser(response_type: type[Any], answer_type: type[Any]) -> Callable[[bytes], Any]:
    """A deserializer of a stream's responses that fails one answer, not the stream, when
    the answer cannot be decoded (nested deeper than protobuf decodes, say): that answer
    becomes an INTERNAL error for its call. Only a message whose envelope itself is corrupt
    still fails to decode (and ends the stream, as before)."""

    def parse(raw: bytes) -> Any:
        try:
            return response_type.FromString(raw)
        except DecodeError:
            pass
        response = response_type()
        for item in _fields(raw, 1):
            try:
                response.answers.append(answer_type.FromString(item))
            except DecodeError as exc:
                call_id = _varint_field(item, 1)
                if call_id:
                    answer = response.answers.add(call_id=call_id)
                    answer.error.code = grpc.StatusCode.INTERNAL.value[0]
                    answer.error.message = f"the answer could not be decoded: {str(exc)[:200]}"
        return response

    return parse


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise DecodeError("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _walk(data: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value: an int, or bytes for length-delimited) of each field
    at the top level of a message. Raises DecodeError on corrupt framing."""
    at = 0
    value: int | bytes
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 1:
            value, at = data[at : at + 8], at + 8
        elif wire == 2:
            size, at = _varint(data, at)
            value, at = data[at : at + size], at + size
        elif wire == 5:
            value, at = data[at : at + 4], at + 4
        else:
            raise DecodeError(f"unsupported wire type {wire}")
        if at > len(data):
            raise DecodeError("truncated field")
        yield number, wire, value


def _fields(data: bytes, number: int) -> list[bytes]:
    return [v for n, wire, v in _walk(data) if n == number and wire == 2]


def _varint_field(data: bytes, number: int) -> int:
    try:
        return next((v for n, wire, v in _walk(data) if n == number and wire == 0), 0)
    except DecodeError:
        return 0


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

    def expire(self, call_id: int, message: str) -> None:
        future = self._waiting.pop(call_id, None)
        if future is not None and not future.done():
            future.set_exception(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, message))

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
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(
                    _rpc_error(
                        code, f"the stream to the service ended before the answer came{detail}"
                    )
                )
        self._waiting.clear()

    async def close(self) -> None:
        self._break(None, None)
        self._call.cancel()
        for task in (self._reader, self._writer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
