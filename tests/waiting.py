"""Waiting in tests: for a condition, never for a fixed time.

`wait_until` polls a condition until it holds and fails the test, naming what it waited for,
once `timeout` has passed; `wait_until_sync` is its twin for tests without an event loop.
`holds_for` is the negative check: a condition that must stay true for a while (nothing more
happens after a resend, a waiting task is not claimed); it fails as soon as the condition
breaks. Prefer a positive event that shows the system got past the point where the thing would
have happened; use `holds_for` where there is none.

A plain sleep is left only where time passing is the behaviour under test (a lease, a quote or
a session expiring, a connection left idle) or where it stands for a slow part of the system (a
slow module, a transaction held open, a game server answering late).

    await wait_until(lambda: len(started) == 2, what="both jobs started")
    tasks = await wait_until(lambda: stack.tasks("steve"), timeout=10, what="steve's task")
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["holds_for", "wait_until", "wait_until_sync"]

T = TypeVar("T")
Description = str | Callable[[], str]
"""What is waited for, in words; a callable is asked only when the wait fails, so the message
can name the state at that moment (the requests still running, a log's tail)."""


async def wait_until(
    condition: Callable[[], T | Awaitable[T]],
    timeout: float = 5.0,
    interval: float = 0.01,
    what: Description = "",
) -> T:
    """Calls `condition` (a function, or one returning an awaitable) every `interval` seconds
    until it returns a true value, and returns that value. It is always called at least once,
    and once more after `timeout` has passed; if it is still false then, the test fails with an
    AssertionError naming `what`. An exception from `condition` ends the wait at once (a
    condition may raise to fail fast, say when the process it waits for has exited)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(_failure(condition, what, f"not met within {timeout:g} s"))
        await asyncio.sleep(interval)


def wait_until_sync(
    condition: Callable[[], T],
    timeout: float = 5.0,
    interval: float = 0.01,
    what: Description = "",
) -> T:
    """`wait_until` for synchronous tests: the same contract, sleeping the thread between
    calls; `condition` must not return an awaitable."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            if inspect.iscoroutine(value):
                value.close()  # never run: no "never awaited" warning
            raise TypeError("wait_until_sync got an awaitable condition; use wait_until")
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_failure(condition, what, f"not met within {timeout:g} s"))
        time.sleep(interval)


async def holds_for(
    condition: Callable[[], bool | Awaitable[bool]],
    seconds: float,
    interval: float = 0.01,
    what: Description = "",
) -> None:
    """Checks that `condition` stays true for `seconds`: called every `interval` seconds and
    once at the end, it fails the test as soon as it returns false. The negative check of a
    test (something does not happen); its length says how long the test looks."""
    began = time.monotonic()
    deadline = began + seconds
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if not value:
            elapsed = time.monotonic() - began
            raise AssertionError(
                _failure(condition, what, f"stopped holding after {elapsed:.2f} s")
            )
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(interval, left))


def _failure(condition: Callable[[], object], what: Description, outcome: str) -> str:
    described = what() if callable(what) else what
    return f"{outcome}: {described or _source(condition)}"


def _source(condition: Callable[[], object]) -> str:
    """The condition's source line (a lambda, usually), for a wait that was not described."""
    try:
        return inspect.getsource(condition).strip()[:300]
    except (OSError, TypeError):
        return repr(condition)
