"""Per-request context that travels across services: the request id and the deadline.

Both live in context variables, set by the server interceptor from incoming metadata and read
by the client interceptor for every outbound call, so handlers never pass them by hand.
"""

from __future__ import annotations

import contextlib
import contextvars
import random
import time
from collections.abc import Iterator

__all__ = [
    "REQUEST_ID_KEY",
    "current_deadline",
    "current_request_id",
    "enter_request",
    "leave_request",
    "new_request_id",
    "remaining_seconds",
    "request_scope",
]

REQUEST_ID_KEY = "x-request-id"

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
# Absolute deadline on the time.monotonic() clock; None when the caller set none.
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("deadline", default=None)


def new_request_id() -> str:
    """A fresh request id: 32 hex characters. Made for every call that arrives without one,
    so from the `random` module's generator (reseeded in forked children) rather than
    uuid4's system call: it names a request in logs and is not a secret."""
    return f"{random.getrandbits(128):032x}"


def current_request_id() -> str:
    """The request id of the work in progress, or "" outside a request."""
    return _request_id.get()


def current_deadline() -> float | None:
    """The absolute monotonic deadline of the work in progress, if any."""
    return _deadline.get()


def remaining_seconds(default: float | None = None) -> float | None:
    """Seconds left before the current deadline, capped by `default` when both exist."""
    deadline = _deadline.get()
    if deadline is None:
        return default
    left = max(deadline - time.monotonic(), 0.0)
    return left if default is None else min(left, default)


RequestTokens = tuple[contextvars.Token[str], contextvars.Token[float | None]]


def enter_request(request_id: str | None = None, timeout: float | None = None) -> RequestTokens:
    """`request_scope` without the context manager (the server interceptor's hot path): sets
    the id and deadline; `leave_request` with the returned tokens restores what was there."""
    rid = request_id or _request_id.get() or new_request_id()
    deadline = _deadline.get()
    if timeout is not None:
        mine = time.monotonic() + timeout
        deadline = mine if deadline is None else min(deadline, mine)
    return _request_id.set(rid), _deadline.set(deadline)


def leave_request(tokens: RequestTokens) -> None:
    id_token, deadline_token = tokens
    _deadline.reset(deadline_token)
    _request_id.reset(id_token)


@contextlib.contextmanager
def request_scope(request_id: str | None = None, timeout: float | None = None) -> Iterator[str]:
    """Runs a block as one request: sets its id and, if given, a deadline `timeout` from now.

    A deadline already in force is never extended: the earlier one wins.
    """
    tokens = enter_request(request_id, timeout)
    try:
        yield _request_id.get()
    finally:
        leave_request(tokens)
