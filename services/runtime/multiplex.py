"""Many unary calls on one long-lived gRPC stream (`JournalService.Multiplex`).

In Python gRPC a unary call costs each end a few hundred microseconds of its own machinery
(a call object, metadata, an HTTP/2 stream opened and closed); a message on a stream that is
already open costs a fraction of that (measured: about three times the messages per second for
the same CPU). A client that calls one service all the time (an engine replica writing receipts
and taking leases) sends its calls as messages on one stream instead; each carries an id the
client chose, and its answer, or the status it failed with, comes back with that id.

Server: `MultiplexServer.serve` runs each call on the stream as its own task through the
handler its unary RPC uses, so a call does and answers exactly what the unary call would; per
call it keeps what the server interceptor keeps for a unary call (request scope, error mapping,
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
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc

from services.runtime import context as request_context
from services.runtime.errors import ERROR_REASON_KEY
from services.runtime.interceptors import Method, error_status, record_call

__all__ = ["MAX_IN_FLIGHT", "MultiplexClient", "MultiplexServer"]

log = logging.getLogger("system.multiplex")

MAX_IN_FLIGHT = 1024
"""Calls one stream may have in flight on the server; more are refused RESOURCE_EXHAUSTED."""

_DONE = object()
_CODE_NUMBERS = {code.name: code.value[0] for code in grpc.StatusCode}
_CODES = {code.value[0]: code for code in grpc.StatusCode}

Handler = Callable[[Any, Any], Awaitable[Any]]


class MultiplexServer:
    """Serves `Multiplex` streams of one service.

    Args:
        service: the full service name (`system.storage.v1.JournalService`), for logs and
            metrics.
        response_type: the stream's response message: `call_id`, an `error` (CallStatus) and
            one answer field per call, named as the request's.
        handlers: per request field (`commit`), the unary RPC's handler (`Commit`) and its
            method name; each is called as `handler(request, None)`.
        max_in_flight: calls one stream may have in flight.
    """

    def __init__(
        self,
        service: str,
        response_type: type[Any],
        handlers: Mapping[str, tuple[str, Handler]],
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self._response_type = response_type
        self._routes = {
            field: (handler, Method(f"/{service}/Multiplex/{name}"))
            for field, (name, handler) in handlers.items()
        }
        self._max_in_flight = max_in_flight

    def _error(self, call_id: int, code: str, message: str, reason: str = "") -> Any:
        response = self._response_type(call_id=call_id)
        error = response.error
        error.code = _CODE_NUMBERS[code]
        error.message = message
        error.reason = reason
        return response

    async def serve(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The answers to the calls read from `requests`, as they finish. Ends once the client
        closed its side and every call answered."""
        loop = asyncio.get_running_loop()
        answers: asyncio.Queue[Any] = asyncio.Queue()
        in_flight: dict[int, asyncio.Task[None]] = {}

        async def run(call_id: int, field: str, request: Any, request_id: str) -> None:
            handler, method = self._routes[field]
            tokens = request_context.enter_request(request_id or None)
            started = time.perf_counter()
            code = "OK"
            try:
                answer = await handler(request, None)
                response = self._response_type(call_id=call_id, **{field: answer})
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception as exc:  # noqa: BLE001 - becomes this call's status
                code, message, reason = error_status(exc, method.method)
                response = self._error(call_id, code, message, reason)
            finally:
                del in_flight[call_id]
                record_call(method, code, time.perf_counter() - started)
                request_context.leave_request(tokens)
            answers.put_nowait(response)

        async def read() -> None:
            try:
                async for request in requests:
                    call_id = request.call_id
                    field = request.WhichOneof("call")
                    if field is None or field not in self._routes:
                        answers.put_nowait(
                            self._error(call_id, "INVALID_ARGUMENT", "the request holds no call")
                        )
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
                        # A context of its own per call: its request scope is its own.
                        in_flight[call_id] = loop.create_task(
                            run(call_id, field, getattr(request, field), request.request_id),
                            context=contextvars.Context(),
                        )
                while in_flight:
                    await asyncio.wait(list(in_flight.values()))
            finally:
                answers.put_nowait(_DONE)

        reader = loop.create_task(read())
        try:
            while True:
                answer = await answers.get()
                if answer is _DONE:
                    break
                yield answer
            await reader  # the request stream's own failure, if it failed
        finally:
            reader.cancel()
            for task in list(in_flight.values()):
                task.cancel()


class MultiplexClient:
    """Calls on one `Multiplex` stream (see the module docstring).

    Args:
        open_stream: starts the stream RPC (a stub's `Multiplex`, called with no arguments).
        request_type: the stream's request message.
        retries: attempts after the first for calls marked idempotent that failed UNAVAILABLE.
    """

    def __init__(
        self,
        open_stream: Callable[[], Any],
        request_type: type[Any],
        retries: int = 2,
    ) -> None:
        self._open_stream = open_stream
        self._request_type = request_type
        self._retries = retries
        self._stream: _Stream | None = None
        self._next_id = 0
        self._closed = False

    async def call(
        self, field: str, request: Any, timeout: float | None, idempotent: bool = False
    ) -> Any:
        """The answer to `request` sent as the call `field`; raises grpc.aio.AioRpcError as
        the unary RPC would. `timeout` is capped by the current request's deadline."""
        delay = 0.05
        attempt = 0
        while True:
            try:
                return await self._call_once(field, request, timeout)
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
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "the client is closed")
        timeout = request_context.remaining_seconds(timeout)
        if timeout is not None and timeout <= 0:
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        stream = self._stream
        if stream is None or stream.broken:
            stream = self._stream = _Stream(self._open_stream())
        self._next_id += 1
        call_id = self._next_id
        future = stream.expect(call_id)
        message = self._request_type(
            call_id=call_id, request_id=request_context.current_request_id(), **{field: request}
        )
        timer = None
        if timeout is not None:
            timer = asyncio.get_running_loop().call_later(
                timeout, stream.expire, call_id, "deadline exceeded"
            )
        try:
            await stream.send(message)
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


def _rpc_error(code: grpc.StatusCode, message: str, reason: str = "") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((ERROR_REASON_KEY, reason)) if reason else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, message)


class _Stream:
    """One open stream: the calls waiting for answers, and the task that reads them."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._write_lock = asyncio.Lock()
        self.broken = False
        # Detached: the reader outlives the request that happened to open the stream.
        self._reader = asyncio.get_running_loop().create_task(
            self._read(), context=contextvars.Context()
        )

    def expect(self, call_id: int) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        return future

    def forget(self, call_id: int) -> None:
        self._waiting.pop(call_id, None)

    def expire(self, call_id: int, message: str) -> None:
        future = self._waiting.pop(call_id, None)
        if future is not None and not future.done():
            future.set_exception(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, message))

    async def send(self, message: Any) -> None:
        if self.broken:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "the stream to the service broke")
        try:
            async with self._write_lock:  # one write at a time on a stream
                await self._call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            # The stream has ended: say what it ended with (UNIMPLEMENTED: the service has
            # no such stream, and the caller falls back to unary calls).
            status = await self._call.code()
            self._break(exc)
            code = status if status == grpc.StatusCode.UNIMPLEMENTED else None
            raise _rpc_error(
                code or grpc.StatusCode.UNAVAILABLE, f"the stream to the service broke: {exc}"
            ) from None

    async def _read(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    break
                future = self._waiting.get(response.call_id)
                if future is not None and not future.done():
                    future.set_result(response)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every waiting call hears of it below
            error = exc
        finally:
            self._break(error)

    def _break(self, error: BaseException | None) -> None:
        self.broken = True
        code = grpc.StatusCode.UNAVAILABLE
        detail = ""
        if isinstance(error, grpc.aio.AioRpcError):
            detail = f": {error.details()}"
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                code = error.code()  # a service without the stream: the caller falls back
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(
                    _rpc_error(
                        code, f"the stream to the service ended before the answer came{detail}"
                    )
                )
        self._waiting.clear()

    async def close(self) -> None:
        self._break(None)
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
