"""Typed errors that domain code raises. They import no gRPC; the server interceptor maps each
to its status code, so servicers stay thin and domain modules stay testable alone."""

from __future__ import annotations

__all__ = [
    "ERROR_REASON_KEY",
    "NOT_SENT",
    "STALE_FENCE",
    "Aborted",
    "AlreadyExists",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "ServiceError",
    "Unauthenticated",
    "Unavailable",
    "error_reason",
    "never_sent",
]


# Trailing-metadata key of a machine-readable reason, for errors a caller must tell apart from
# others with the same status code (the protos document which reasons a method can give).
ERROR_REASON_KEY = "x-error-reason"

STALE_FENCE = "STALE_FENCE"
"""FAILED_PRECONDITION reason: the write's lease fence is stale; stop writing for that work."""


NOT_SENT = "NOT_SENT"
"""UNAVAILABLE reason (services.runtime.multiplex): the call never left this process, because
no connection to the service could be made; repeating it cannot repeat an effect."""

# gRPC's status message when a call found no address it could connect to: it was never sent.
_NO_ADDRESS = "failed to connect to all addresses"


def never_sent(error: object) -> bool:
    """True when a failed call (a grpc.aio.AioRpcError) certainly never reached a server: it
    is UNAVAILABLE because every attempt to connect failed, so nothing of it can have run.
    Any other UNAVAILABLE (a connection that broke) may have been delivered."""
    code = getattr(error, "code", None)
    if not callable(code) or getattr(code(), "name", "") != "UNAVAILABLE":
        return False
    details = getattr(error, "details", None)
    return error_reason(error) == NOT_SENT or _NO_ADDRESS in (
        (details() if callable(details) else "") or ""
    )


class ServiceError(Exception):
    """Base of errors that become a gRPC status. `code` is the grpc.StatusCode name; `reason`,
    when set, travels as the `x-error-reason` trailing metadata."""

    code = "INTERNAL"

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


def error_reason(error: object) -> str:
    """The `x-error-reason` of a failed call (a grpc.aio.AioRpcError or grpc.RpcError), or ""."""
    trailing = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == ERROR_REASON_KEY:
            return str(value)
    return ""


class InvalidArgument(ServiceError):
    code = "INVALID_ARGUMENT"


class NotFound(ServiceError):
    code = "NOT_FOUND"


class AlreadyExists(ServiceError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(ServiceError):
    code = "FAILED_PRECONDITION"


class Aborted(ServiceError):
    """A concurrent writer got there first (a compare-and-set lost); re-read and retry."""

    code = "ABORTED"


class PermissionDenied(ServiceError):
    code = "PERMISSION_DENIED"


class Unauthenticated(ServiceError):
    code = "UNAUTHENTICATED"


class ResourceExhausted(ServiceError):
    code = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(ServiceError):
    code = "DEADLINE_EXCEEDED"


class Unavailable(ServiceError):
    code = "UNAVAILABLE"
