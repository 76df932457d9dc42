"""Typed errors that domain code raises. They import no gRPC; the server interceptor maps each
to its status code, so servicers stay thin and domain modules stay testable alone."""

from __future__ import annotations

__all__ = [
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
]


class ServiceError(Exception):
    """Base of errors that become a gRPC status. `code` is the grpc.StatusCode name."""

    code = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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
