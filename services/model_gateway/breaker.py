"""A circuit breaker per provider. Domain code: no I/O, one event loop (no locks).

    closed     calls go through; `failures` consecutive failures open it
    open       calls skip the provider for `cooldown_seconds`
    half-open  after the cool-down, one call (the probe) goes through, others still skip;
               the probe's success closes the breaker, its failure opens it again

Only failures that say the provider is in trouble count (connection errors, HTTP 429/5xx, no
first token in time, a broken stream): the caller decides, and reports them with `failure()`.
A call that ended for another reason (the request was refused, the caller gave up) reports
`release()` so a probe slot is never left taken.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(enum.IntEnum):
    """The values of the `model_provider_breaker_state` gauge."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    """Args:
    failures: consecutive failures that open it; 0 never opens.
    cooldown_seconds: how long it stays open before a probe.
    clock: monotonic seconds (tests pass their own).
    on_change: called with the new state on every change (the gauge).
    """

    def __init__(
        self,
        failures: int,
        cooldown_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[BreakerState], None] | None = None,
    ) -> None:
        self._threshold = failures
        self._cooldown = cooldown_seconds
        self._clock = clock
        self._on_change = on_change
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False

    @property
    def state(self) -> BreakerState:
        """The state now (an open breaker whose cool-down passed reads half-open)."""
        if self._state is BreakerState.OPEN and self._cooled():
            return BreakerState.HALF_OPEN
        return self._state

    def allow(self) -> bool:
        """True when a call may go to the provider now; the caller then reports its end with
        `success`, `failure` or `release`."""
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN:
            if not self._cooled():
                return False
            self._set(BreakerState.HALF_OPEN)
        if self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        self._failures = 0
        self._probing = False
        if self._state is not BreakerState.CLOSED:
            self._set(BreakerState.CLOSED)

    def failure(self) -> None:
        self._probing = False
        if self._state is BreakerState.HALF_OPEN:
            self._open()
            return
        self._failures += 1
        if self._threshold and self._failures >= self._threshold:
            self._open()

    def release(self) -> None:
        """The call ended saying nothing about the provider's health."""
        self._probing = False

    def _open(self) -> None:
        self._opened_at = self._clock()
        self._failures = 0
        self._set(BreakerState.OPEN)

    def _cooled(self) -> bool:
        return self._clock() - self._opened_at >= self._cooldown

    def _set(self, state: BreakerState) -> None:
        self._state = state
        if self._on_change is not None:
            self._on_change(state)
