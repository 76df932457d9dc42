"""One streamed provider call: send, wait for the first token, collect to the finish reason.

Domain code: no gRPC. `stream_once` runs a single attempt under two clocks: the first token
must come within `first_token_timeout`, and the finish reason within `total_timeout`, both
counted from sending. It returns a Completion, or raises AttemptFailed saying what went wrong
(as a typed error), whether any output had arrived, and whether a retry may help.

Failure mapping:

    no first token / no finish in time                  DeadlineExceeded
    openai.APIConnectionError (connect, reset, drop)    Unavailable   retryable before output
    openai.RateLimitError (429)                         ResourceExhausted  retryable
    openai.InternalServerError (5xx)                    Unavailable   retryable
    openai.AuthenticationError / PermissionDeniedError  FailedPrecondition (the key was refused)
    any other openai.APIStatusError                     Unavailable, naming the HTTP status
    stream ended without a finish reason                Unavailable
    a chunk not of OpenAI's chunk shape                 Unavailable

The request goes through the `openai` client's `post` with the body `create` would send, and
the chunks are read as decoded JSON rather than pydantic models (see `_open`): the client's
connection handling, error events, status errors and timeouts are unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import openai

from services.model_gateway.chat import Completion, ToolCall
from services.runtime.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)

__all__ = ["AttemptFailed", "stream_once"]

# Longest Retry-After honoured; beyond it the deadline would be spent waiting anyway.
MAX_RETRY_AFTER_SECONDS = 10.0


class AttemptFailed(Exception):
    """One provider call failed.

    Attributes:
        error: what the caller is told if nothing better follows.
        output_started: True when tokens had arrived before the failure (never retried).
        retryable: True for connection errors and HTTP 429/5xx before any output.
        retry_after: seconds the provider asked to wait, if it said.
        kind: what went wrong, for metrics and for deciding on the next provider:
            first_token_timeout, finish_timeout, timeout (the client's own backstop),
            connection, rate_limited, server_error, key_refused, http_error, broken_stream
            (no finish reason) or unreadable.
    """

    def __init__(
        self,
        error: ServiceError,
        *,
        output_started: bool,
        retryable: bool = False,
        retry_after: float | None = None,
        kind: str = "http_error",
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.kind = kind
        self.output_started = output_started
        self.retryable = retryable and not output_started
        self.retry_after = retry_after


# Chunks come back as their decoded JSON: `openai.AsyncStream` still splits the events, maps
# transport errors and raises on an error event, but no pydantic model is built per chunk
# (with the body transform, about a third of the gateway's CPU per call).
_RAW_CHUNKS = openai.AsyncStream[object]
_CHAT_PATH = "/chat/completions"


class _Unreadable(Exception):
    """A chunk that is not a JSON object of the expected shape."""


def _object(value: Any) -> dict[str, Any]:
    """`value` as a JSON object; None (the field left out or null) as an empty one."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Unreadable(f"expected a JSON object, got {type(value).__name__}")
    return value


def _array(value: Any) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _Unreadable(f"expected a JSON array, got {type(value).__name__}")
    return value


def _tokens(usage: dict[str, Any], key: str) -> int:
    value = usage.get(key)
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        raise _Unreadable(f"usage.{key} is not a number: {value!r}") from None


@dataclasses.dataclass
class _Collected:
    """What the stream delivered so far (chunks as decoded JSON, OpenAI's chunk shape)."""

    content: list[str] = dataclasses.field(default_factory=list)
    calls: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    finish_reason: str = ""
    usage: dict[str, Any] | None = None
    model: str = ""
    output_started: bool = False

    def add(self, chunk: Any) -> None:
        chunk = _object(chunk)
        self.model = chunk.get("model") or self.model
        usage = chunk.get("usage")
        if usage is not None:
            self.usage = _object(usage)
        for choice in _array(chunk.get("choices")):
            choice = _object(choice)
            if choice.get("index", 0) != 0:
                continue
            delta = _object(choice.get("delta"))
            content = delta.get("content")
            if content:
                self.content.append(str(content))
                self.output_started = True
            if delta.get("reasoning_content"):  # DeepSeek's reasoner
                self.output_started = True
            for call in _array(delta.get("tool_calls")):
                self._add_call(_object(call))
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])

    def _add_call(self, call: dict[str, Any]) -> None:
        self.output_started = True
        index = call.get("index", 0)
        if not isinstance(index, int):
            raise _Unreadable(f"tool call index is not a number: {index!r}")
        entry = self.calls.setdefault(index, {"id": "", "name": "", "arguments": []})
        if call.get("id"):
            entry["id"] = str(call["id"])
        function = _object(call.get("function"))
        if function.get("name"):
            entry["name"] = str(function["name"])
        if function.get("arguments"):
            entry["arguments"].append(str(function["arguments"]))

    def completion(self, fallback_model: str, attempts: int) -> Completion:
        usage = self.usage or {}
        return Completion(
            content="".join(self.content),
            finish_reason=self.finish_reason,
            prompt_tokens=_tokens(usage, "prompt_tokens"),
            completion_tokens=_tokens(usage, "completion_tokens"),
            # DeepSeek's context-cache figures, beside OpenAI's fields.
            prompt_cache_hit_tokens=_tokens(usage, "prompt_cache_hit_tokens"),
            prompt_cache_miss_tokens=_tokens(usage, "prompt_cache_miss_tokens"),
            model=str(self.model or fallback_model),
            tool_calls=tuple(
                ToolCall(c["id"], c["name"], "".join(c["arguments"]))
                for _, c in sorted(self.calls.items())
            ),
            attempts=attempts,
        )


async def _open(
    client: openai.AsyncOpenAI, params: dict[str, Any], timeout: float
) -> openai.AsyncStream[object]:
    """Sends the request as `client.chat.completions.create(**params)` would, without its
    per-call transform of the body (a no-op for the plain JSON `ChatRequest.openai_params`
    builds, but a walk of every value against the parameter types), and streams the chunks
    undecoded into models."""
    return await client.post(
        _CHAT_PATH,
        body=params,
        cast_to=object,
        options={"timeout": timeout, "security": {"bearer_auth": True}},
        stream=True,
        stream_cls=_RAW_CHUNKS,
    )


async def stream_once(
    client: openai.AsyncOpenAI,
    params: dict[str, Any],
    *,
    first_token_timeout: float,
    total_timeout: float,
    attempt: int,
    base_url: str,
) -> Completion:
    """Runs one streamed call (see the module docstring). `attempt` counts from 1."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    first_token_timeout = min(first_token_timeout, total_timeout)
    collected = _Collected()
    stream: Any = None
    timer = asyncio.timeout(first_token_timeout)
    try:
        async with timer:
            # The client's own timeout is a backstop; the clocks above decide.
            stream = await _open(client, params, total_timeout)
            async for chunk in stream:
                was_started = collected.output_started
                collected.add(chunk)
                if collected.output_started and not was_started:
                    timer.reschedule(started + total_timeout)
    except TimeoutError:
        if collected.output_started:
            message = f"the model provider did not finish within {total_timeout:.1f} s"
        else:
            message = f"the model provider sent no token within {first_token_timeout:.1f} s"
        raise AttemptFailed(
            DeadlineExceeded(message),
            output_started=collected.output_started,
            kind="finish_timeout" if collected.output_started else "first_token_timeout",
        ) from None
    except openai.APIError as exc:
        raise _failed(exc, collected.output_started, base_url) from None
    except _Unreadable as exc:
        raise _unreadable(exc, collected) from None
    finally:
        if stream is not None:
            await stream.close()
    if not collected.finish_reason:
        raise AttemptFailed(
            Unavailable(
                "the model provider's stream ended without a finish reason; the answer may be "
                "cut short, so it is not used"
            ),
            output_started=collected.output_started,
            kind="broken_stream",
        )
    try:
        return collected.completion(str(params.get("model", "")), attempt)
    except _Unreadable as exc:  # the usage
        raise _unreadable(exc, collected) from None


def _unreadable(exc: _Unreadable, collected: _Collected) -> AttemptFailed:
    return AttemptFailed(
        Unavailable(f"the model provider sent an unreadable chunk: {exc}"),
        output_started=collected.output_started,
        kind="unreadable",
    )


def _failed(exc: openai.APIError, output_started: bool, base_url: str) -> AttemptFailed:
    after = " after the answer had begun" if output_started else ""
    if isinstance(exc, openai.APITimeoutError):
        return AttemptFailed(
            DeadlineExceeded(f"the model provider timed out{after}"),
            output_started=output_started,
            kind="timeout",
        )
    if isinstance(exc, openai.APIConnectionError):
        return AttemptFailed(
            Unavailable(f"cannot reach the model provider at {base_url}{after}: {exc.message}"),
            output_started=output_started,
            retryable=True,
            kind="connection",
        )
    if isinstance(exc, openai.RateLimitError):
        return AttemptFailed(
            ResourceExhausted(
                f"the model provider rate-limited the call (HTTP 429{_detail(exc)}); retry later"
            ),
            output_started=output_started,
            retryable=True,
            retry_after=_retry_after(exc),
            kind="rate_limited",
        )
    if isinstance(exc, openai.AuthenticationError | openai.PermissionDeniedError):
        # The provider's message may echo part of the key; it is left out on purpose.
        return AttemptFailed(
            FailedPrecondition(
                f"the model provider refused the API key (HTTP {exc.status_code}); "
                "check SYSTEM_MODEL_API_KEY or SYSTEM_MODEL_API_KEY_FILE"
            ),
            output_started=output_started,
            kind="key_refused",
        )
    if isinstance(exc, openai.InternalServerError):
        return AttemptFailed(
            Unavailable(
                f"the model provider failed with HTTP {exc.status_code}{_detail(exc)}; retry later"
            ),
            output_started=output_started,
            retryable=True,
            retry_after=_retry_after(exc),
            kind="server_error",
        )
    if isinstance(exc, openai.APIStatusError):
        return AttemptFailed(
            Unavailable(f"the model provider answered HTTP {exc.status_code}{_detail(exc)}"),
            output_started=output_started,
        )
    return AttemptFailed(
        Unavailable(f"the model provider sent an unreadable answer{after}: {exc.message}"),
        output_started=output_started,
        kind="unreadable",
    )


def _detail(exc: openai.APIStatusError) -> str:
    """`: <provider message>` from an OpenAI error body, shortened; "" when there is none."""
    body: Any = exc.body
    message = body.get("message") if isinstance(body, dict) else None
    if not isinstance(message, str) or not message:
        return ""
    return f": {message[:200]}"


def _retry_after(exc: openai.APIStatusError) -> float | None:
    value = exc.response.headers.get("retry-after") if exc.response is not None else None
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: rare from model providers, and the backoff covers it
    if seconds is None or seconds < 0:
        return None
    return min(seconds, MAX_RETRY_AFTER_SECONDS)
