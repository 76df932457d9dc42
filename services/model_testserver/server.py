"""A local OpenAI-compatible server for tests and offline runs. Standard library only.

It speaks just enough of the OpenAI HTTP API for the real `openai` client:

    POST /v1/chat/completions   chat completion, OpenAI's response shape, with usage; streamed
                                as server-sent events when the request asks (`stream: true`)
    GET  /v1/models             the model list
    GET  /search?format=json    SearXNG's JSON answer (see web.py), no key
    GET  /pages/<path>          pages to fetch, no key

(the same paths without `/v1` work too, as on DeepSeek's API). Every request must carry
`Authorization: Bearer <api_key>`; otherwise the answer is 401 in OpenAI's error shape.

Replies are scripted: tests queue replies with `script(...)` and each chat completion takes the
next one. A reply is content (and tool calls, cache-token usage), or an HTTP error status (with OpenAI
error JSON), optionally after a delay; streamed replies can also be slow, end without a finish
reason, or lose their connection mid-stream (or before answering at all); `fault(every=n,
...)` makes every n-th unscripted call fail the same way, for long runs. With the queue empty the optional `responder` answers (see `router_demo_reply` for the
one `make run MODEL=offline` uses), and otherwise `echo: <last user message>`, so runs are
deterministic. Every request received is recorded for assertions.

The server runs on its own thread, so it serves the same way under sync or async tests:

    server = FakeOpenAIServer(api_key="test-key")
    port = server.start()                        # port 0 by default: any free port
    server.script(content="hello", prompt_tokens=5, completion_tokens=1)
    server.script(status=429)                    # the next call is rate-limited
    server.script(delay=3.0)                     # the next call answers after 3 s
    ...  # point a client at server.base_url
    assert server.requests[-1].json["model"] == "deepseek-chat"
    server.stop()
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import http.server
import itertools
import json
import logging
import re
import socket
import socketserver
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from services.model_testserver.sse import completion_chunks
from services.model_testserver.web import Page, ScriptedSearch, WebScript

__all__ = ["FakeOpenAIServer", "RecordedRequest", "Responder", "ScriptedReply", "router_demo_reply"]

Responder = Callable[[list[Any]], "str | None"]
"""Answers a chat completion from its `messages` when no reply is scripted; None falls back to
the echo."""

log = logging.getLogger("system.model_testserver")

# Default OpenAI error `type` and `code` per status, as the real API sends them.
_ERRORS: dict[int, tuple[str, str | None, str]] = {
    400: ("invalid_request_error", None, "The request is invalid."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    403: ("invalid_request_error", "unsupported_country_region_territory", "Access denied."),
    404: ("invalid_request_error", "model_not_found", "The model does not exist."),
    429: ("requests", "rate_limit_exceeded", "Rate limit reached; please try again later."),
    500: ("server_error", None, "The server had an error while processing your request."),
    503: ("server_error", None, "The engine is currently overloaded, please try again later."),
}


@dataclasses.dataclass(frozen=True)
class ScriptedReply:
    """What the server does for one chat completion."""

    content: str | None = None
    """Answer text; None answers `echo: <last user message>`."""
    status: int = 200
    """HTTP status; anything but 200 sends an OpenAI error body instead of a completion."""
    message: str | None = None
    """Error message for a non-200 status; None uses OpenAI's usual one."""
    delay: float = 0.0
    """Seconds to wait before answering (cut short when the server stops)."""
    finish_reason: str = "stop"
    """`finish_reason` of the choice."""
    prompt_tokens: int | None = None
    """Reported prompt tokens; None counts about four characters a token."""
    completion_tokens: int | None = None
    """Reported completion tokens; None counts about four characters a token."""
    prompt_cache_hit_tokens: int | None = None
    """DeepSeek's `prompt_cache_hit_tokens` in the usage; None leaves the field out."""
    prompt_cache_miss_tokens: int | None = None
    """DeepSeek's `prompt_cache_miss_tokens` in the usage; None leaves the field out."""
    tool_calls: tuple[dict[str, Any], ...] = ()
    """Tool calls to answer with, OpenAI-shaped: `{"id", "function": {"name", "arguments"}}`."""
    chunk_chars: int = 8
    """Streaming: characters of content (or tool arguments) per chunk."""
    chunk_delay: float = 0.0
    """Streaming: seconds between chunks after the first (a slow stream)."""
    drop_after_chunks: int | None = None
    """Streaming: close the connection after this many chunks, with no end (an outage
    mid-stream); None sends the whole stream."""
    finish: bool = True
    """Streaming: False ends the stream (with `[DONE]`) without a finish reason."""
    drop: bool = False
    """Close the connection without any answer (after `delay`): a provider that went away."""


@dataclasses.dataclass(frozen=True)
class RecordedRequest:
    """One request the server received."""

    method: str
    path: str
    """The path without the query string."""
    headers: dict[str, str]
    """Header names in lower case."""
    body: bytes
    target: str = ""
    """The request target as sent: path and query string."""

    @property
    def json(self) -> Any:
        """The body decoded as JSON, or None when it is empty or not JSON."""
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None

    @property
    def query(self) -> dict[str, list[str]]:
        """The query string's parameters, each with its values."""
        return urllib.parse.parse_qs(urllib.parse.urlsplit(self.target).query)

    @property
    def bearer(self) -> str | None:
        """The bearer token of the Authorization header, if any."""
        value = self.headers.get("authorization", "")
        scheme, _, token = value.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None


def _tokens(chars: int) -> int:
    """A deterministic stand-in for a tokenizer: about four characters a token."""
    return max(1, (chars + 3) // 4)


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog of 5 refuses bursts of concurrent clients.
    request_queue_size = 256
    owner: FakeOpenAIServer

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, which can stall without DNS.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.owner._track(request, add=True)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.owner._track(request, add=False)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (its timeout fired during a scripted delay) is expected here.
        log.debug("connection from %s ended with an error", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client's connection pool expects
    # Streamed replies are many small writes; Nagle's algorithm would hold each one back for
    # the client's delayed ACK (~40 ms).
    disable_nagle_algorithm = True
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self.server.owner._handle(self)

    def do_POST(self) -> None:
        self.server.owner._handle(self)

    def start_chunked(self, status: int, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("x-request-id", f"req_{next(self.server.owner._ids)}")
        self.end_headers()
        self.wfile.flush()

    def write_chunk(self, data: bytes) -> None:
        """One HTTP/1.1 chunk; empty `data` ends the body."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def drop_connection(self) -> None:
        """Closes the socket mid-response, as a failing provider or network would."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

    def send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode()
        self.send_bytes(status, data, "application/json")

    def send_bytes(
        self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-request-id", f"req_{next(self.server.owner._ids)}")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()


class FakeOpenAIServer:
    """An OpenAI-compatible HTTP server on loopback with scripted replies.

    Args:
        api_key: the bearer key every request must carry.
        host: address to listen on.
        port: port to listen on; 0 picks a free one (see `start()` and `port`).
        models: names `GET /v1/models` lists. Completions accept any model name.
        responder: answers completions while no reply is scripted; returning None (or no
            responder) answers `echo: <last user message>`.
    """

    def __init__(
        self,
        api_key: str = "test-key",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        models: Sequence[str] = ("deepseek-chat",),
        responder: Responder | None = None,
    ) -> None:
        self.web = WebScript()
        """Scripted searches and pages (`script_search`, `add_page` are the short ways)."""
        self.api_key = api_key
        self.responder = responder
        self.host = host
        self.port = port
        self.models = tuple(models)
        self._lock = threading.Lock()
        self._script: collections.deque[ScriptedReply] = collections.deque()
        self._requests: list[RecordedRequest] = []
        self._connections: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._ids = itertools.count(1)
        self._fault: ScriptedReply | None = None
        self._fault_every = 0
        self._unscripted = 0
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> int:
        """Binds and starts serving on a background thread. Returns the bound port."""
        if self._httpd is not None:
            raise RuntimeError("the server is already running")
        self._stopping.clear()
        httpd = _HTTPServer((self.host, self.port), _Handler)
        httpd.owner = self
        self._httpd = httpd
        self.port = httpd.server_port
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            daemon=True,
            name=f"fake-openai-{self.port}",
        )
        self._thread.start()
        log.info("fake OpenAI server listening on %s", self.base_url)
        return self.port

    def stop(self) -> None:
        """Stops serving, cuts delayed replies short and closes open connections. Idempotent."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        httpd.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            # Handler threads blocked reading an idle keep-alive connection wake up and end.
            with contextlib.suppress(OSError):  # already closed by the client
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeOpenAIServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        """What to give an OpenAI client as `base_url`: `http://host:port/v1`."""
        return f"http://{self.host}:{self.port}/v1"

    # -- scripting and inspection ----------------------------------------------------------

    def script(
        self,
        content: str | None = None,
        *,
        status: int = 200,
        message: str | None = None,
        delay: float = 0.0,
        finish_reason: str = "stop",
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        **streaming: Any,
    ) -> ScriptedReply:
        """Queues the reply for the next chat completion; see `ScriptedReply` for the fields
        (the cache-token, tool-call and streaming ones go in `streaming`)."""
        if not 100 <= status <= 599:
            raise ValueError(f"status must be an HTTP status, got {status}")
        if delay < 0 or streaming.get("chunk_delay", 0) < 0:
            raise ValueError("delays must not be negative")
        if "tool_calls" in streaming:
            streaming["tool_calls"] = tuple(streaming["tool_calls"])
        reply = ScriptedReply(
            content=content,
            status=status,
            message=message,
            delay=delay,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            **streaming,
        )
        with self._lock:
            self._script.append(reply)
        return reply

    def fault(self, every: int = 1, **reply: Any) -> ScriptedReply:
        """A standing fault, taken by every `every`-th completion that finds no scripted reply
        (the `every`-th, the 2 × `every`-th, ...; 1: all of them), until `clear_fault`. `reply`
        holds `ScriptedReply` fields: `status=500`, `delay=30` (a hang before the first token),
        `drop=True`, `drop_after_chunks=1`. Lets a long run (a benchmark, a breaker test) fail
        on a pattern without queueing a reply per call."""
        if every < 1:
            raise ValueError(f"every must be 1 or more, got {every}")
        if not reply:
            raise ValueError("say what the fault is, for example status=500")
        fault = ScriptedReply(**reply)
        with self._lock:
            self._fault, self._fault_every, self._unscripted = fault, every, 0
        return fault

    def clear_fault(self) -> None:
        """Ends the standing fault: unscripted completions answer normally again."""
        with self._lock:
            self._fault, self._fault_every = None, 0

    def _next_reply(self) -> ScriptedReply:
        with self._lock:
            if self._script:
                return self._script.popleft()
            if self._fault is None:
                return ScriptedReply()
            self._unscripted += 1
            return self._fault if self._unscripted % self._fault_every == 0 else ScriptedReply()

    @property
    def pending(self) -> int:
        """How many scripted replies have not been used yet."""
        with self._lock:
            return len(self._script)

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received so far, oldest first (a copy)."""
        with self._lock:
            return list(self._requests)

    @property
    def completions(self) -> list[RecordedRequest]:
        """The chat-completion requests received so far, oldest first."""
        return [r for r in self.requests if r.path.rstrip("/").endswith("/chat/completions")]

    def reset(self) -> None:
        """Forgets the scripted replies, the standing fault, searches and pages and the
        recorded requests."""
        with self._lock:
            self._script.clear()
            self._requests.clear()
            self._fault, self._fault_every = None, 0
        self.web.clear()

    def script_search(
        self,
        results: Sequence[dict[str, str]] | None = None,
        *,
        status: int = 200,
        delay: float = 0.0,
    ) -> None:
        """Queues the answer of the next `/search`: hits (`url`, `title`, `content`), or an
        error status; None results: the default hits, pages on this server."""
        self.web.script_search(ScriptedSearch(results=results, status=status, delay=delay))

    def add_page(self, path: str, body: str | bytes = b"", **fields: Any) -> str:
        """Serves `body` at `/pages/<path>` (see `Page` for the fields). Returns its URL."""
        data = body.encode() if isinstance(body, str) else body
        self.web.add_page(path, Page(body=data, **fields))
        return self.page_url(path)

    def page_url(self, path: str) -> str:
        """The URL of `/pages/<path>` on this server."""
        return f"{self.root_url}/pages/{path.lstrip('/')}"

    @property
    def root_url(self) -> str:
        """`http://host:port`, the SearXNG base URL of this server."""
        return f"http://{self.host}:{self.port}"

    @property
    def searches(self) -> list[RecordedRequest]:
        """The `/search` requests received so far, oldest first."""
        return [r for r in self.requests if r.path.rstrip("/") == "/search"]

    # -- serving (handler threads) ---------------------------------------------------------

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    def _handle(self, handler: _Handler) -> None:
        body = self._read_body(handler)
        path = handler.path.split("?", 1)[0]
        request = RecordedRequest(
            method=handler.command,
            path=path,
            headers={k.lower(): v for k, v in handler.headers.items()},
            body=body,
            target=handler.path,
        )
        with self._lock:
            self._requests.append(request)
        # The web endpoints imitate SearXNG and ordinary sites: no API key.
        if handler.command == "GET" and path.rstrip("/") == "/search":
            self._search(handler)
            return
        if handler.command == "GET" and path.startswith("/pages/"):
            self._page(handler, path.removeprefix("/pages/"))
            return
        if request.bearer != self.api_key:
            self._send_error(handler, 401, "Incorrect API key provided.")
            return
        route = path.rstrip("/").removeprefix("/v1")
        if handler.command == "GET" and route == "/models":
            handler.send_json(200, self._models())
        elif handler.command == "POST" and route == "/chat/completions":
            self._complete(handler, request)
        else:
            self._send_error(handler, 404, f"Unknown request URL: {handler.command} {path}.")

    @staticmethod
    def _read_body(handler: _Handler) -> bytes:
        if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    handler.rfile.readline()
                    return b"".join(chunks)
                chunks.append(handler.rfile.read(size))
                handler.rfile.readline()
        length = int(handler.headers.get("Content-Length") or 0)
        return handler.rfile.read(length) if length else b""

    def _models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "system-test"}
                for name in self.models
            ],
        }

    def _complete(self, handler: _Handler, request: RecordedRequest) -> None:
        payload = request.json
        if not isinstance(payload, dict):
            self._send_error(handler, 400, "The request body must be a JSON object.")
            return
        messages = payload.get("messages")
        if not isinstance(payload.get("model"), str) or not payload["model"]:
            self._send_error(handler, 400, "you must provide a model parameter", param="model")
            return
        if not isinstance(messages, list) or not messages:
            self._send_error(handler, 400, "messages must be a non-empty array", param="messages")
            return
        reply = self._next_reply()
        if reply.delay and self._stopping.wait(reply.delay):
            handler.close_connection = True  # stopping: drop the reply and the connection
            return
        if reply.drop:
            handler.drop_connection()
            return
        if reply.status != 200:
            self._send_error(handler, reply.status, reply.message)
            return
        content = reply.content
        if content is None and self.responder is not None:
            content = self.responder(messages)
        if content is None:
            last_user = next(
                (
                    m.get("content")
                    for m in reversed(messages)
                    if isinstance(m, dict) and m.get("role") == "user"
                ),
                "",
            )
            content = f"echo: {last_user if isinstance(last_user, str) else json.dumps(last_user)}"
        prompt_chars = sum(
            len(m["content"])
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
        prompt_tokens = (
            _tokens(prompt_chars) if reply.prompt_tokens is None else reply.prompt_tokens
        )
        completion_tokens = (
            _tokens(len(content)) if reply.completion_tokens is None else reply.completion_tokens
        )
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if reply.prompt_cache_hit_tokens is not None:
            usage["prompt_cache_hit_tokens"] = reply.prompt_cache_hit_tokens
        if reply.prompt_cache_miss_tokens is not None:
            usage["prompt_cache_miss_tokens"] = reply.prompt_cache_miss_tokens
        completion_id = f"chatcmpl-test-{next(self._ids)}"
        if payload.get("stream"):
            options = payload.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            self._stream(
                handler,
                reply,
                payload["model"],
                completion_id,
                content,
                usage if include_usage else None,
            )
            return
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reply.tool_calls:
            message["tool_calls"] = [{"type": "function", **call} for call in reply.tool_calls]
        handler.send_json(
            200,
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": payload["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": reply.finish_reason,
                    }
                ],
                "usage": usage,
                "system_fingerprint": "fake-openai",
            },
        )

    def _stream(
        self,
        handler: _Handler,
        reply: ScriptedReply,
        model: str,
        completion_id: str,
        content: str,
        usage: dict[str, Any] | None,
    ) -> None:
        """Sends the answer as server-sent events, with the scripted faults."""
        chunks = completion_chunks(
            completion_id=completion_id,
            created=int(time.time()),
            model=model,
            content=content,
            tool_calls=reply.tool_calls,
            finish_reason=reply.finish_reason if reply.finish else None,
            usage=usage,
            chunk_chars=max(1, reply.chunk_chars),
        )
        handler.start_chunked(200, "text/event-stream; charset=utf-8")
        try:
            for index, chunk in enumerate(chunks):
                if reply.drop_after_chunks is not None and index >= reply.drop_after_chunks:
                    handler.drop_connection()
                    return
                if index and reply.chunk_delay and self._stopping.wait(reply.chunk_delay):
                    handler.drop_connection()
                    return
                event = "data: " + json.dumps(chunk, ensure_ascii=False) + "\n\n"
                handler.write_chunk(event.encode())
            handler.write_chunk(b"data: [DONE]\n\n")
            handler.write_chunk(b"")
        except OSError:  # the client gave up (its timeout fired) mid-stream
            handler.close_connection = True

    def _search(self, handler: _Handler) -> None:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(handler.path).query)
        text = (query.get("q") or [""])[0]
        search = self.web.next_search()
        if search.delay and self._stopping.wait(search.delay):
            handler.close_connection = True
            return
        if search.status != 200:
            handler.send_bytes(search.status, b"search failed", "text/plain")
            return
        if (query.get("format") or [""])[0] != "json":
            handler.send_bytes(403, b"format not allowed", "text/plain")  # as SearXNG does
            return
        results = (
            self.web.default_hits(self.root_url, text)
            if search.results is None
            else [dict(r) for r in search.results]
        )
        handler.send_json(
            200,
            {
                "query": text,
                "number_of_results": len(results),
                "results": results,
                "answers": [],
                "suggestions": [],
                "unresponsive_engines": [],
            },
        )

    def _page(self, handler: _Handler, path: str) -> None:
        page = self.web.page(path)
        if page is None:
            handler.send_bytes(404, b"<html><body>Not found</body></html>", "text/html")
            return
        if page.delay and self._stopping.wait(page.delay):
            handler.close_connection = True
            return
        extra = {"Location": page.location} if page.location else {}
        if page.declare_length and not page.chunk_delay:
            handler.send_bytes(page.status, page.body, page.content_type, extra)
            return
        # No length: the body ends when the connection closes, piece by piece.
        handler.close_connection = True
        handler.send_response(page.status)
        handler.send_header("Content-Type", page.content_type)
        handler.send_header("Connection", "close")
        for name, value in extra.items():
            handler.send_header(name, value)
        handler.end_headers()
        try:
            for start in range(0, len(page.body), 1024):
                if start and page.chunk_delay and self._stopping.wait(page.chunk_delay):
                    return
                handler.wfile.write(page.body[start : start + 1024])
                handler.wfile.flush()
        except OSError:  # the client stopped reading (its cap or timeout)
            return

    @staticmethod
    def _send_error(
        handler: _Handler, status: int, message: str | None, *, param: str | None = None
    ) -> None:
        kind, code, default = _ERRORS.get(
            status, ("server_error" if status >= 500 else "invalid_request_error", None, "Error.")
        )
        handler.send_json(
            status,
            {"error": {"message": message or default, "type": kind, "param": param, "code": code}},
        )


_ID_PARTS = re.compile(r"[^a-z0-9]+")


def router_demo_reply(messages: list[Any]) -> str | None:
    """A deterministic stand-in for the router's model call, for offline demos.

    It answers only routing requests: a user message that is the router's JSON, holding a
    `catalogue` list and the player's `request` text. The answer is
    `{"capabilityId": <id>, "arguments": {}}` for the first catalogue entry (in catalogue order,
    `explicitOnly` entries skipped) one of whose id words appears as a whole word in the request,
    case-insensitively; the id words are the parts after the namespace, so `system:history`
    matches "history" and "show my history". Anything else answers `clarify`. Any other
    request returns None (the echo).
    """
    for message in reversed(messages):
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        try:
            data = json.loads(message.get("content") or "")
        except (TypeError, ValueError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("catalogue"), list):
            return None
        words = set(_ID_PARTS.split(str(data.get("request", "")).lower()))
        for entry in data["catalogue"]:
            if not isinstance(entry, dict) or entry.get("explicitOnly"):
                continue
            module_id = entry.get("id")
            if not isinstance(module_id, str) or module_id == "clarify":
                continue
            name = module_id.lower().rpartition(":")[2]
            if any(len(part) >= 3 and part in words for part in _ID_PARTS.split(name)):
                return json.dumps({"capabilityId": module_id, "arguments": {}})
        return json.dumps({"capabilityId": "clarify", "arguments": {}})
    return None
