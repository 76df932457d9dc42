"""Chat completions through an OpenAI-compatible provider, metered and retried within budget.

Domain code: no gRPC here. `ChatProvider.complete` validates a request, reserves its worst
case against the daily budgets (see metering), streams it from the provider through the real
`openai.AsyncOpenAI` client (see streaming for the per-call clocks and the failure mapping),
retries what may be retried, and settles the reservation to the actual use.

Time: one overall deadline, the caller's (the gRPC deadline), caps everything, retries
included; without one, `request_timeout_seconds` is the overall bound. Each provider call also
has its own first-token and total timeouts, cut to what is left of the overall deadline.

Retries: only connection errors and HTTP 429/5xx, only before any output arrived, at most
`max_attempts` calls, with a doubling backoff (or the provider's Retry-After). A retry that
could not finish before the deadline is not started; the last failure is reported instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import openai
from prometheus_client import Counter

from services.model_gateway.chat import ChatRequest, Completion, Limits
from services.model_gateway.config import ModelConfig
from services.model_gateway.metering import BudgetExhausted, ExternalServicesOff, Meter, Used
from services.model_gateway.streaming import AttemptFailed, stream_once
from services.runtime.context import remaining_seconds
from services.runtime.errors import DeadlineExceeded, ServiceError, Unavailable
from services.runtime.logging import log_info

__all__ = ["MODEL_CALLS", "MODEL_RETRIES", "MODEL_TOKENS", "ChatProvider", "ModelStatus"]

log = logging.getLogger("system.model")

# No player label: players are unbounded and would explode the series count. Per-player figures
# go to the log line of each call and to the storage service's usage records.
MODEL_TOKENS = Counter(
    "model_tokens",
    "Tokens used by model calls, by direction (prompt, completion, prompt_cache_hit, "
    "prompt_cache_miss).",
    ["direction"],
)
MODEL_CALLS = Counter(
    "model_calls",
    "Complete calls by outcome: ok, invalid_argument, not_configured, deadline_exceeded, "
    "rate_limited, budget_exhausted, key_refused, external_off, unavailable, cancelled, error.",
    ["outcome"],
)
MODEL_RETRIES = Counter(
    "model_retries", "Provider calls repeated after a retryable failure before any output."
)

# Series looked up once: a labelled series costs a locked dictionary lookup per call otherwise.
_TOKENS = {
    direction: MODEL_TOKENS.labels(direction)
    for direction in ("prompt", "completion", "prompt_cache_hit", "prompt_cache_miss")
}
_CALLS: dict[str, Any] = {}

# Below this, a provider call cannot usefully start.
MIN_CALL_SECONDS = 0.05

NO_KEY_MESSAGE = (
    "no model is configured: set SYSTEM_MODEL_API_KEY (or SYSTEM_MODEL_API_KEY_FILE, a file "
    "holding the key) on the model gateway; until then callers fall back to local routing"
)


def _count_call(outcome: str) -> None:
    counter = _CALLS.get(outcome)
    if counter is None:
        counter = _CALLS[outcome] = MODEL_CALLS.labels(outcome)
    counter.inc()


def _count_tokens(result: Completion) -> None:
    _TOKENS["prompt"].inc(result.prompt_tokens)
    _TOKENS["completion"].inc(result.completion_tokens)
    _TOKENS["prompt_cache_hit"].inc(result.prompt_cache_hit_tokens)
    _TOKENS["prompt_cache_miss"].inc(result.prompt_cache_miss_tokens)


def _log_call(request: ChatRequest, outcome: str, result: Completion | None, ms: float) -> None:
    """The call's INFO line (written once per call, hence `log_info`)."""
    if not log.isEnabledFor(logging.INFO):
        return
    extra = {
        "player_id": request.player_id,
        "outcome": outcome,
        "prompt_tokens": result.prompt_tokens if result else 0,
        "completion_tokens": result.completion_tokens if result else 0,
        "attempts": result.attempts if result else 0,
        "ms": ms,
    }
    log_info(log, "model call %s", (outcome,), extra)


class _ProviderRequestLines(logging.Filter):
    """Drops httpx2's INFO line for each successful request to the model provider: the
    gateway's own `model call` line records every call, and the second line per call was a
    measurable part of the gateway's CPU. Failed requests, and the web tools' requests, are
    still logged."""

    def __init__(self, base_url: str) -> None:
        super().__init__()
        self._base_url = base_url.rstrip("/") + "/"

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5 or not isinstance(args[3], int):
            return True  # not the request line this filter knows
        return args[3] >= 400 or not str(args[1]).startswith(self._base_url)


class _NotConfigured(Unavailable):
    """No API key: UNAVAILABLE, which callers turn into their local fallback; metered apart
    from a provider outage."""


@dataclasses.dataclass(frozen=True)
class ModelStatus:
    """Whether completions can be attempted, and with which model."""

    configured: bool
    model: str


class ChatProvider:
    """Runs chat completions for the gateway. One instance per process; close with `aclose`.

    Args:
        config: the gateway's settings. Without an API key no client is made and every
            completion fails with Unavailable (see NO_KEY_MESSAGE); the service still starts
            and answers.
        meter: reserves and settles usage; owned by the caller.
    """

    def __init__(self, config: ModelConfig, meter: Meter) -> None:
        self._config = config
        self._meter = meter
        self._limits = Limits(
            config.max_prompt_chars, config.default_max_tokens, config.max_answer_tokens
        )
        self._client: openai.AsyncOpenAI | None = None
        self._quiet = _ProviderRequestLines(config.base_url)
        if config.configured:
            logging.getLogger("httpx2").addFilter(self._quiet)
            self._client = openai.AsyncOpenAI(
                api_key=config.key,
                base_url=config.base_url,
                timeout=config.request_timeout_seconds,
                # Retries are decided here, where the output and the deadline are known.
                max_retries=0,
            )

    def status(self) -> ModelStatus:
        return ModelStatus(configured=self._client is not None, model=self._config.model)

    async def aclose(self) -> None:
        logging.getLogger("httpx2").removeFilter(self._quiet)
        if self._client is not None:
            await self._client.close()

    async def complete(self, request: ChatRequest) -> Completion:
        """Runs one completion.

        Raises:
            InvalidArgument: the request cannot be sent (see `ChatRequest.validate`).
            FailedPrecondition: the player turned external services off, or the provider
                refused the API key.
            ResourceExhausted: a daily budget would be exceeded, or the provider kept
                rate-limiting.
            DeadlineExceeded: no first token or no finish in time, or the deadline passed.
            Unavailable: no API key, storage unreachable, or the provider unreachable, failing,
                or its stream broken or unfinished.
        """
        started = time.perf_counter()
        outcome = "error"
        result: Completion | None = None
        try:
            request.validate(self._limits)
            if self._client is None:
                raise _NotConfigured(NO_KEY_MESSAGE)
            result = await self._metered(self._client, request)
            outcome = "ok"
            return result
        except _NotConfigured:
            outcome = "not_configured"
            raise
        except ServiceError as exc:
            outcome = _outcome(exc)
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            _count_call(outcome)
            if result is not None:
                _count_tokens(result)
            _log_call(request, outcome, result, round((time.perf_counter() - started) * 1000, 3))

    async def _metered(self, client: openai.AsyncOpenAI, request: ChatRequest) -> Completion:
        overall = remaining_seconds(self._config.request_timeout_seconds)
        assert overall is not None  # a default was given
        if overall <= MIN_CALL_SECONDS:
            raise DeadlineExceeded("the caller's deadline passed before the model was called")
        deadline = time.monotonic() + overall
        hold = await self._meter.reserve(
            request.player_id,
            tokens=request.worst_case_tokens(self._limits),
            hold_seconds=overall,
        )
        attempt = 0
        result: Completion | None = None
        try:
            while True:
                attempt += 1
                try:
                    result = await self._call(client, request, deadline, attempt)
                    return result
                except AttemptFailed as failure:
                    if not self._may_retry(failure, attempt, deadline):
                        raise failure.error from None
                    await asyncio.sleep(self._backoff(failure, attempt, deadline))
                    MODEL_RETRIES.inc()
        finally:
            # Also when the caller gave up: the hold must not stay in place.
            self._meter.settle_later(hold, self._used(request, result, attempt))

    async def _call(
        self, client: openai.AsyncOpenAI, request: ChatRequest, deadline: float, attempt: int
    ) -> Completion:
        left = deadline - time.monotonic()
        total = min(self._config.request_timeout_seconds, left)
        return await stream_once(
            client,
            request.openai_params(self._config.model, self._limits),
            first_token_timeout=min(self._config.first_token_timeout_seconds, total),
            total_timeout=total,
            attempt=attempt,
            base_url=self._config.base_url,
        )

    def _may_retry(self, failure: AttemptFailed, attempt: int, deadline: float) -> bool:
        if not failure.retryable or attempt >= self._config.max_attempts:
            return False
        wait = self._backoff(failure, attempt, deadline)
        return deadline - time.monotonic() - wait > MIN_CALL_SECONDS

    def _backoff(self, failure: AttemptFailed, attempt: int, deadline: float) -> float:
        wait: float = self._config.retry_backoff_seconds * 2 ** (attempt - 1)
        if failure.retry_after is not None:
            wait = max(wait, failure.retry_after)
        return max(0.0, min(wait, deadline - time.monotonic()))

    @staticmethod
    def _used(request: ChatRequest, result: Completion | None, calls: int) -> Used:
        if result is None:
            # Failed: tokens of a broken stream are not reported; the calls made are.
            return Used(model_calls=calls)
        prompt, completion = result.prompt_tokens, result.completion_tokens
        if prompt == 0 and completion == 0:
            # The provider reported no usage: count the bound held, never nothing.
            prompt = request.prompt_chars()
            completion = len(result.content) + sum(len(c.arguments_json) for c in result.tool_calls)
        return Used(
            prompt_tokens=prompt,
            completion_tokens=completion,
            prompt_cache_hit_tokens=result.prompt_cache_hit_tokens,
            prompt_cache_miss_tokens=result.prompt_cache_miss_tokens,
            model_calls=calls,
        )


_OUTCOMES = {
    "INVALID_ARGUMENT": "invalid_argument",
    "RESOURCE_EXHAUSTED": "rate_limited",
    "FAILED_PRECONDITION": "key_refused",
    "DEADLINE_EXCEEDED": "deadline_exceeded",
    "UNAVAILABLE": "unavailable",
}


def _outcome(exc: ServiceError) -> str:
    if isinstance(exc, BudgetExhausted):
        return "budget_exhausted"
    if isinstance(exc, ExternalServicesOff):
        return "external_off"
    return _OUTCOMES.get(exc.code, "error")
