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
from prometheus_client import Counter, Gauge

from services.model_gateway.breaker import BreakerState, CircuitBreaker
from services.model_gateway.budgets import cost_micros, count_spend, worst_case_micros
from services.model_gateway.chat import ChatRequest, Completion, Limits
from services.model_gateway.config import ModelConfig
from services.model_gateway.metering import BudgetExhausted, ExternalServicesOff, Meter, Spend, Used
from services.model_gateway.provider_config import ALL_PROVIDERS_UNAVAILABLE, ProviderSpec, Route
from services.model_gateway.streaming import AttemptFailed, stream_once
from services.runtime.context import remaining_seconds
from services.runtime.errors import DeadlineExceeded, ServiceError, Unavailable
from services.runtime.logging import log_info

__all__ = [
    "MODEL_BREAKER_STATE",
    "MODEL_CALLS",
    "MODEL_FALLBACKS",
    "MODEL_PROVIDER_CALLS",
    "MODEL_PROVIDER_FAILURES",
    "MODEL_RETRIES",
    "MODEL_TOKENS",
    "ChatProvider",
    "ModelStatus",
]

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
    "rate_limited, budget_exhausted, key_refused, external_off, unavailable, providers_busy "
    "(every provider of the list failed or was skipped), cancelled, error.",
    ["outcome"],
)
MODEL_RETRIES = Counter(
    "model_retries",
    "Provider calls repeated after a retryable failure before any output, once every provider "
    "of the call's list had been tried (a move to the next provider is a fallback).",
)
# Provider names come from the configuration, so these labels are bounded.
MODEL_PROVIDER_CALLS = Counter(
    "model_provider_calls",
    "Calls sent to each configured provider, by outcome (ok, failed).",
    ["provider", "outcome"],
)
MODEL_PROVIDER_FAILURES = Counter(
    "model_provider_failures",
    "Failed provider calls by kind: connection, rate_limited, server_error, "
    "first_token_timeout, finish_timeout, timeout, deadline, key_refused, http_error, "
    "broken_stream, unreadable.",
    ["provider", "kind"],
)
MODEL_PROVIDER_SKIPS = Counter(
    "model_provider_skips",
    "Providers passed over without a call: breaker_open, or saturated (at max_concurrent).",
    ["provider", "reason"],
)
MODEL_FALLBACKS = Counter(
    "model_fallbacks",
    "Calls moved on to the next provider of their list, by the provider that failed and why.",
    ["provider", "kind"],
)
MODEL_BREAKER_STATE = Gauge(
    "model_provider_breaker_state",
    "Circuit breaker of each provider: 0 closed, 1 open, 2 half-open (a probe let through).",
    ["provider"],
)
MODEL_PROVIDER_COST = Counter(
    "model_provider_cost",
    "What answered calls cost at the configured prices per million tokens, by provider and "
    "model (in each provider's currency).",
    ["provider", "model"],
)

# Series looked up once: a labelled series costs a locked dictionary lookup per call otherwise.
_TOKENS = {
    direction: MODEL_TOKENS.labels(direction)
    for direction in ("prompt", "completion", "prompt_cache_hit", "prompt_cache_miss")
}
_CALLS: dict[str, Any] = {}

# Below this, a provider call cannot usefully start.
MIN_CALL_SECONDS = 0.05

# Failures that say a provider is in trouble: they count against its breaker.
BREAKER_KINDS = frozenset(
    {
        "connection",
        "rate_limited",
        "server_error",
        "first_token_timeout",
        "finish_timeout",
        "timeout",
        "broken_stream",
        "unreadable",
    }
)
# Failures before any output after which the next provider is tried.
FALLBACK_KINDS = frozenset(
    {"connection", "rate_limited", "server_error", "first_token_timeout", "timeout"}
)

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
        "module_id": request.module_id,
        "provider": result.provider if result else "",
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

    def __init__(self, base_urls: list[str]) -> None:
        super().__init__()
        self._base_urls = tuple(url.rstrip("/") + "/" for url in base_urls)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5 or not isinstance(args[3], int):
            return True  # not the request line this filter knows
        return args[3] >= 400 or not str(args[1]).startswith(self._base_urls)


class _NotConfigured(Unavailable):
    """No API key: UNAVAILABLE, which callers turn into their local fallback; metered apart
    from a provider outage."""


@dataclasses.dataclass(frozen=True)
class ModelStatus:
    """Whether completions can be attempted, and with which model."""

    configured: bool
    model: str


class _Upstream:
    """One configured provider: its client, breaker, calls in flight and metric series."""

    def __init__(self, spec: ProviderSpec, config: ModelConfig) -> None:
        self.spec = spec
        self.client = openai.AsyncOpenAI(
            api_key=spec.api_key,
            base_url=spec.base_url,
            timeout=spec.request_timeout_seconds,
            # Retries and fallbacks are decided here, where the output and the deadline are known.
            max_retries=0,
        )
        state = MODEL_BREAKER_STATE.labels(spec.name)
        state.set(BreakerState.CLOSED)
        self.breaker = CircuitBreaker(
            config.breaker_failures,
            config.breaker_cooldown_seconds,
            on_change=lambda new: self._changed(new, state),
        )
        self.in_flight = 0
        self.ok = MODEL_PROVIDER_CALLS.labels(spec.name, "ok")
        self.failed = MODEL_PROVIDER_CALLS.labels(spec.name, "failed")

    def _changed(self, state: BreakerState, gauge: Any) -> None:
        gauge.set(state)
        log.warning("model provider %s: circuit breaker %s", self.spec.name, state.name.lower())

    @property
    def saturated(self) -> bool:
        return 0 < self.spec.max_concurrent <= self.in_flight


class ChatProvider:
    """Runs chat completions for the gateway over the configured providers, with fallback
    along each module's list and a circuit breaker per provider. One instance per process;
    close with `aclose`.

    Args:
        config: the gateway's settings. Without an API key no client is made and every
            completion fails with Unavailable (see NO_KEY_MESSAGE); the service still starts
            and answers.
        meter: reserves and settles usage; owned by the caller.
    """

    def __init__(self, config: ModelConfig, meter: Meter) -> None:
        self._config = config
        self._meter = meter
        self._routing = config.routing
        self._limits = Limits(
            config.max_prompt_chars, config.default_max_tokens, config.max_answer_tokens
        )
        self._upstreams: dict[str, _Upstream] = {}
        specs = list(self._routing.providers.values())
        self._quiet = _ProviderRequestLines([spec.base_url for spec in specs])
        if config.configured:
            logging.getLogger("httpx2").addFilter(self._quiet)
            self._upstreams = {spec.name: _Upstream(spec, config) for spec in specs}

    def status(self) -> ModelStatus:
        return ModelStatus(configured=bool(self._upstreams), model=self._routing.default[0].model)

    async def aclose(self) -> None:
        logging.getLogger("httpx2").removeFilter(self._quiet)
        for upstream in self._upstreams.values():
            await upstream.client.close()

    async def complete(self, request: ChatRequest) -> Completion:
        """Runs one completion.

        Raises:
            InvalidArgument: the request cannot be sent (see `ChatRequest.validate`).
            FailedPrecondition: the player turned external services off, or the provider
                refused the API key.
            ResourceExhausted: a daily budget would be exceeded, or the provider kept
                rate-limiting (a list of one provider).
            DeadlineExceeded: no first token or no finish in time, or the deadline passed.
            Unavailable: no API key, storage unreachable, or the provider unreachable, failing,
                or its stream broken or unfinished; with reason ALL_PROVIDERS_UNAVAILABLE when
                every provider of the list failed or was skipped.
        """
        started = time.perf_counter()
        outcome = "error"
        result: Completion | None = None
        try:
            request.validate(self._limits)
            if not self._upstreams:
                raise _NotConfigured(NO_KEY_MESSAGE)
            result = await self._metered(request)
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

    async def _metered(self, request: ChatRequest) -> Completion:
        overall = remaining_seconds(self._config.request_timeout_seconds)
        assert overall is not None  # a default was given
        if overall <= MIN_CALL_SECONDS:
            raise DeadlineExceeded("the caller's deadline passed before the model was called")
        deadline = time.monotonic() + overall
        answer = request.answer_tokens(self._limits)
        hold = await self._meter.reserve(
            request.player_id,
            tokens=request.worst_case_tokens(self._limits),
            cost_micros=worst_case_micros(
                self._routing, request.module_id, request.prompt_chars(), answer
            ),
            level=request.permission_level,
            hold_seconds=overall,
        )
        calls = [0]
        result: Completion | None = None
        try:
            routes = self._routing.routes(request.module_id)
            result = await self._along(request, routes, deadline, calls)
            return result
        finally:
            # Also when the caller gave up: the hold must not stay in place.
            used = self._used(request, result, calls[0])
            self._meter.settle_later(hold, used)
            if result is not None:
                count_spend(
                    result.provider,
                    request.module_id,
                    request.player_id,
                    used.prompt_tokens + used.completion_tokens,
                    used.cost_micros,
                )

    async def _along(
        self, request: ChatRequest, routes: tuple[Route, ...], deadline: float, calls: list[int]
    ) -> Completion:
        """Tries the routes in order, then again from the start after a backoff, while calls
        and the deadline allow (see model.proto). `calls[0]` counts the provider calls made."""
        most = max(self._config.max_attempts, len(routes))
        notes: dict[Route, str] = {}
        while True:
            last: AttemptFailed | None = None  # the last failure of this pass
            for position, route in enumerate(routes):
                upstream = self._upstreams[route.provider]
                # Saturation first: `allow` hands out a half-open breaker's one probe.
                if upstream.saturated:
                    MODEL_PROVIDER_SKIPS.labels(route.provider, "saturated").inc()
                    notes.setdefault(route, f"at its limit of {upstream.spec.max_concurrent} calls")
                    continue
                if not upstream.breaker.allow():
                    MODEL_PROVIDER_SKIPS.labels(route.provider, "breaker_open").inc()
                    notes.setdefault(route, "paused after repeated failures (circuit open)")
                    continue
                if deadline - time.monotonic() <= MIN_CALL_SECONDS:
                    upstream.breaker.release()
                    raise DeadlineExceeded("the call's deadline passed before a provider answered")
                calls[0] += 1
                try:
                    return await self._call(upstream, route, request, deadline, calls[0])
                except AttemptFailed as failure:
                    last = failure
                    notes[route] = failure.error.message
                    if failure.kind not in FALLBACK_KINDS or failure.output_started:
                        raise self._error(failure, route, routes) from None
                    if calls[0] >= most:
                        break
                    if position + 1 < len(routes):
                        MODEL_FALLBACKS.labels(route.provider, failure.kind).inc()
            # The whole list was tried or skipped, or the calls ran out.
            if last is None:
                raise self._busy(request, routes, notes)
            if not self._may_retry(last, calls[0], most, deadline):
                if len(routes) == 1:
                    raise last.error from None  # as the provider said it
                raise self._busy(request, routes, notes)
            await asyncio.sleep(self._backoff(last, calls[0], deadline))
            MODEL_RETRIES.inc()

    @staticmethod
    def _error(failure: AttemptFailed, route: Route, routes: tuple[Route, ...]) -> ServiceError:
        """What the caller is told when `failure` ends the call: the provider named when the
        list holds several."""
        error = failure.error
        if len(routes) == 1:
            return error
        return type(error)(f"provider {route}: {error.message}", error.reason)

    @staticmethod
    def _busy(
        request: ChatRequest, routes: tuple[Route, ...], notes: dict[Route, str]
    ) -> Unavailable:
        which = f"module {request.module_id}" if request.module_id else "the default list"
        told = "; ".join(f"{route}: {notes.get(route, 'not tried')}" for route in routes)
        return Unavailable(
            f"every model provider for {which} failed or is paused ({told}); the assistant is "
            "busy, try again shortly",
            ALL_PROVIDERS_UNAVAILABLE,
        )

    async def _call(
        self,
        upstream: _Upstream,
        route: Route,
        request: ChatRequest,
        deadline: float,
        attempt: int,
    ) -> Completion:
        spec = upstream.spec
        left = deadline - time.monotonic()
        total = min(spec.request_timeout_seconds, left)
        first_token = min(spec.first_token_timeout_seconds, total)
        upstream.in_flight += 1
        healthy: bool | None = None
        try:
            result = await stream_once(
                upstream.client,
                request.openai_params(route.model, self._limits),
                first_token_timeout=first_token,
                total_timeout=total,
                attempt=attempt,
                base_url=spec.base_url,
            )
        except AttemptFailed as failure:
            cut = (
                first_token < spec.first_token_timeout_seconds
                if failure.kind == "first_token_timeout"
                else total < spec.request_timeout_seconds
            )
            if failure.kind.endswith("timeout") and cut:
                # The call's deadline cut the provider's clock: says nothing of the provider.
                failure.kind = "deadline"
            healthy = False if failure.kind in BREAKER_KINDS else None
            upstream.failed.inc()
            MODEL_PROVIDER_FAILURES.labels(spec.name, failure.kind).inc()
            raise
        else:
            healthy = True
            upstream.ok.inc()
            price = spec.models.get(route.model)
            if price is not None and (price.input_per_million or price.output_per_million):
                MODEL_PROVIDER_COST.labels(spec.name, route.model).inc(
                    price.cost(result.prompt_tokens, result.completion_tokens)
                )
            return dataclasses.replace(
                result,
                provider=spec.name,
                cost_micros=cost_micros(price, *_billed_tokens(request, result)),
            )
        finally:
            upstream.in_flight -= 1
            if healthy is True:
                upstream.breaker.success()
            elif healthy is False:
                upstream.breaker.failure()
            else:
                upstream.breaker.release()

    def _may_retry(self, failure: AttemptFailed, calls: int, most: int, deadline: float) -> bool:
        if not failure.retryable or calls >= most:
            return False
        wait = self._backoff(failure, calls, deadline)
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
        prompt, completion = _billed_tokens(request, result)
        cost = result.cost_micros
        return Used(
            prompt_tokens=prompt,
            completion_tokens=completion,
            prompt_cache_hit_tokens=result.prompt_cache_hit_tokens,
            prompt_cache_miss_tokens=result.prompt_cache_miss_tokens,
            model_calls=calls,
            cost_micros=cost,
            spend=(
                Spend(request.module_id, result.provider or "default", prompt + completion, cost),
            ),
        )


def _billed_tokens(request: ChatRequest, result: Completion) -> tuple[int, int]:
    """The prompt and completion tokens a call is counted for."""
    prompt, completion = result.prompt_tokens, result.completion_tokens
    if prompt == 0 and completion == 0:
        # The provider reported no usage: count the bound held, never nothing.
        prompt = request.prompt_chars()
        completion = len(result.content) + sum(len(c.arguments_json) for c in result.tool_calls)
    return prompt, completion


_OUTCOMES = {
    "INVALID_ARGUMENT": "invalid_argument",
    "RESOURCE_EXHAUSTED": "rate_limited",
    "FAILED_PRECONDITION": "key_refused",
    "DEADLINE_EXCEEDED": "deadline_exceeded",
    "UNAVAILABLE": "unavailable",
}


def _outcome(exc: ServiceError) -> str:
    if exc.reason == ALL_PROVIDERS_UNAVAILABLE:
        return "providers_busy"
    if isinstance(exc, BudgetExhausted):
        return "budget_exhausted"
    if isinstance(exc, ExternalServicesOff):
        return "external_off"
    return _OUTCOMES.get(exc.code, "error")
