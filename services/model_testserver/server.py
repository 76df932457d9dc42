"""A local OpenAI-compatible server for tests and offline runs. Standard library only.

It speaks just enough of the OpenAI HTTP API for the real `openai` client:

    POST /v1/chat/completions   non-streaming chat completion, OpenAI's response shape, with usage
    GET  /v1/models             the model list

(the same paths without `/v1` work too, as on DeepSeek's API). Every request must carry
`Authorization: Bearer <api_key>`; otherwise the answer is 401 in OpenAI's error shape.

Replies are scripted: tests queue replies with `script(...)` and each chat completion takes the
next one. A reply is content, or an HTTP error status (with OpenAI error JSON), optionally after
a delay. With the queue empty the optional `responder` answers (see `router_demo_reply` for the
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
from collections.abc import Callable, Sequence
from typing import Any

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


@dataclasses.dataclass(frozen=True)
class RecordedRequest:
    """One request the server received."""

    method: str
    path: str
    headers: dict[str, str]
    """Header names in lower case."""
    body: bytes

    @property
    def json(self) -> Any:
        """The body decoded as JSON, or None when it is empty or not JSON."""
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None

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
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self.server.owner._handle(self)

    def do_POST(self) -> None:
        self.server.owner._handle(self)

    def send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-request-id", f"req_{next(self.server.owner._ids)}")
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
    ) -> ScriptedReply:
        """Queues the reply for the next chat completion; see `ScriptedReply` for the fields."""
        if not 100 <= status <= 599:
            raise ValueError(f"status must be an HTTP status, got {status}")
        if delay < 0:
            raise ValueError(f"delay must not be negative, got {delay}")
        reply = ScriptedReply(
            content=content,
            status=status,
            message=message,
            delay=delay,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )
        with self._lock:
            self._script.append(reply)
        return reply

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
        """Forgets the scripted replies and the recorded requests."""
        with self._lock:
            self._script.clear()
            self._requests.clear()

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
        )
        with self._lock:
            self._requests.append(request)
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
            chunks = []
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
        if payload.get("stream"):
            self._send_error(handler, 400, "streaming is not supported by the test server")
            return
        with self._lock:
            reply = self._script.popleft() if self._script else ScriptedReply()
        if reply.delay and self._stopping.wait(reply.delay):
            handler.close_connection = True  # stopping: drop the reply and the connection
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
        handler.send_json(
            200,
            {
                "id": f"chatcmpl-test-{next(self._ids)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": payload["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "logprobs": None,
                        "finish_reason": reply.finish_reason,
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
                "system_fingerprint": "fake-openai",
            },
        )

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
