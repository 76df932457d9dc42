"""Chat completions through an OpenAI-compatible provider.

Domain code: no gRPC here. `ChatProvider` validates a request, calls the provider through the
real `openai.AsyncOpenAI` client with a timeout capped by the caller's deadline, maps provider
failures to the typed errors in `services.runtime.errors`, and meters tokens and outcomes.

Failure mapping (the caller decides whether to retry; the client itself never does):

    openai.APITimeoutError                          DeadlineExceeded
    openai.RateLimitError (429)                     ResourceExhausted
    no API key configured                           Unavailable (callers fall back locally)
    openai.AuthenticationError (401)                FailedPrecondition (the key was refused)
    openai.PermissionDeniedError (403)              FailedPrecondition (the key was refused)
    openai.APIConnectionError, InternalServerError  Unavailable
    any other openai.APIStatusError                 Unavailable, naming the HTTP status
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

import openai
from prometheus_client import Counter

from services.model_gateway.config import ModelConfig
from services.runtime.context import remaining_seconds
from services.runtime.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)

__all__ = [
    "MODEL_CALLS",
    "MODEL_TOKENS",
    "ChatMessage",
    "ChatProvider",
    "Completion",
    "ModelStatus",
    "Role",
]

log = logging.getLogger("system.model")

Role = Literal["system", "user", "assistant"]
ROLES: frozenset[str] = frozenset({"system", "user", "assistant"})

# No player label: players are unbounded and would explode the series count. Per-player figures
# go to the log line of each call (and to the storage service's usage records later).
MODEL_TOKENS = Counter(
    "model_tokens",
    "Tokens used by model calls, by direction (prompt or completion).",
    ["direction"],
)
MODEL_CALLS = Counter(
    "model_calls",
    "Complete calls by outcome: ok, invalid_argument, not_configured, deadline_exceeded, "
    "rate_limited, key_refused, unavailable, cancelled, error.",
    ["outcome"],
)

_OUTCOMES = {
    "INVALID_ARGUMENT": "invalid_argument",
    "FAILED_PRECONDITION": "key_refused",
    "DEADLINE_EXCEEDED": "deadline_exceeded",
    "RESOURCE_EXHAUSTED": "rate_limited",
    "UNAVAILABLE": "unavailable",
}

NO_KEY_MESSAGE = (
    "no model is configured: set SYSTEM_MODEL_API_KEY (or SYSTEM_MODEL_API_KEY_FILE, a file "
    "holding the key) on the model gateway; until then callers fall back to local routing"
)


class _NotConfigured(Unavailable):
    """No API key: UNAVAILABLE, which callers turn into their local fallback; metered apart
    from a provider outage."""


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    """One message of the conversation sent to the model."""

    role: str
    """`system`, `user` or `assistant`."""
    content: str
    """The text."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """The model's answer and what it cost."""

    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model: str


@dataclasses.dataclass(frozen=True)
class ModelStatus:
    """Whether completions can be attempted, and with which model."""

    configured: bool
    model: str


class ChatProvider:
    """Runs chat completions for the gateway. One instance per process; close with `aclose`.

    Args:
        config: the gateway's settings. Without an API key no client is made and every
            completion fails with Unavailable (see NO_KEY_MESSAGE); the service still starts and answers.
    """

    def __init__(self, config: ModelConfig) -> None:
        self._config = config
        self._client: openai.AsyncOpenAI | None = None
        if config.configured:
            self._client = openai.AsyncOpenAI(
                api_key=config.key,
                base_url=config.base_url,
                timeout=config.request_timeout_seconds,
                # Retries belong to the caller, who knows its budget; a hidden retry here
                # would spend the caller's deadline twice.
                max_retries=0,
            )

    def status(self) -> ModelStatus:
        return ModelStatus(configured=self._client is not None, model=self._config.model)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()

    def validate(self, messages: Sequence[ChatMessage], temperature: float) -> None:
        """Raises InvalidArgument, with a message a caller can act on, for a request that
        cannot be sent."""
        if not messages:
            raise InvalidArgument("messages must hold at least one message")
        total = 0
        for index, message in enumerate(messages):
            if message.role not in ROLES:
                raise InvalidArgument(
                    f"messages[{index}].role must be system, user or assistant, got {message.role!r}"
                )
            if not message.content.strip():
                raise InvalidArgument(f"messages[{index}].content is empty")
            total += len(message.content)
        if total > self._config.max_prompt_chars:
            raise InvalidArgument(
                f"the messages hold {total} characters; the limit is {self._config.max_prompt_chars}"
            )
        # Written so NaN fails too.
        if not 0.0 <= temperature <= 2.0:
            raise InvalidArgument(f"temperature must be between 0 and 2, got {temperature:g}")

    async def complete(
        self,
        messages: Sequence[ChatMessage],
        *,
        max_tokens: int = 0,
        temperature: float = 0.0,
        player_id: str = "",
    ) -> Completion:
        """Runs one completion.

        Args:
            messages: the conversation, oldest first.
            max_tokens: upper bound on answer tokens; 0 uses `default_max_tokens`.
            temperature: sampling temperature, 0 to 2.
            player_id: who the call is metered to; "" for none.

        Raises:
            InvalidArgument: the request cannot be sent (see `validate`).
            FailedPrecondition: the provider refused the API key.
            DeadlineExceeded: the provider did not answer in time.
            ResourceExhausted: the provider rate-limited the call.
            Unavailable: no API key is configured, or the provider could not be reached or
                failed.
        """
        started = time.perf_counter()
        outcome = "error"
        usage = (0, 0)
        try:
            self.validate(messages, temperature)
            if self._client is None:
                raise _NotConfigured(NO_KEY_MESSAGE)
            result = await self._call(self._client, messages, max_tokens, temperature)
            usage = (result.prompt_tokens, result.completion_tokens)
            outcome = "ok"
            return result
        except _NotConfigured:
            outcome = "not_configured"
            raise
        except ServiceError as exc:
            outcome = _OUTCOMES.get(exc.code, "error")
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            MODEL_CALLS.labels(outcome).inc()
            MODEL_TOKENS.labels("prompt").inc(usage[0])
            MODEL_TOKENS.labels("completion").inc(usage[1])
            log.info(
                "model call %s",
                outcome,
                extra={
                    "player_id": player_id,
                    "outcome": outcome,
                    "prompt_tokens": usage[0],
                    "completion_tokens": usage[1],
                    "ms": round((time.perf_counter() - started) * 1000, 3),
                },
            )

    async def _call(
        self,
        client: openai.AsyncOpenAI,
        messages: Sequence[ChatMessage],
        max_tokens: int,
        temperature: float,
    ) -> Completion:
        timeout = remaining_seconds(self._config.request_timeout_seconds)
        assert timeout is not None  # a default was given
        if timeout <= 0.001:
            raise DeadlineExceeded("the caller's deadline passed before the model was called")
        try:
            response = await client.chat.completions.create(
                model=self._config.model,
                messages=[{"role": m.role, "content": m.content} for m in messages],  # type: ignore[misc]
                max_tokens=max_tokens or self._config.default_max_tokens,
                # Proto floats are 32-bit: 0.7 arrives as 0.699999988; send what was meant.
                temperature=round(temperature, 3),
                timeout=timeout,
            )
        except openai.APITimeoutError:
            raise DeadlineExceeded(
                f"the model provider did not answer within {timeout:.1f} s"
            ) from None
        except openai.APIConnectionError as exc:
            raise Unavailable(
                f"cannot reach the model provider at {self._config.base_url}: {exc.message}"
            ) from None
        except openai.RateLimitError as exc:
            raise ResourceExhausted(
                f"the model provider rate-limited the call (HTTP 429{_detail(exc)}); retry later"
            ) from None
        except (openai.AuthenticationError, openai.PermissionDeniedError) as exc:
            # The provider's message may echo part of the key; it is left out on purpose.
            raise FailedPrecondition(
                f"the model provider refused the API key (HTTP {exc.status_code}); "
                "check SYSTEM_MODEL_API_KEY or SYSTEM_MODEL_API_KEY_FILE"
            ) from None
        except openai.InternalServerError as exc:
            raise Unavailable(
                f"the model provider failed with HTTP {exc.status_code}{_detail(exc)}; retry later"
            ) from None
        except openai.APIStatusError as exc:
            raise Unavailable(
                f"the model provider answered HTTP {exc.status_code}{_detail(exc)}"
            ) from None
        except openai.APIError as exc:
            raise Unavailable(
                f"the model provider sent an unreadable answer: {exc.message}"
            ) from None
        if not response.choices:
            raise Unavailable("the model provider answered with no choices")
        choice = response.choices[0]
        usage = response.usage
        return Completion(
            content=choice.message.content or "",
            finish_reason=str(choice.finish_reason or ""),
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            model=response.model or self._config.model,
        )


def _detail(exc: openai.APIStatusError) -> str:
    """`: <provider message>` from an OpenAI error body, shortened; "" when there is none."""
    body: Any = exc.body
    message = body.get("message") if isinstance(body, dict) else None
    if not isinstance(message, str) or not message:
        return ""
    return f": {message[:200]}"
