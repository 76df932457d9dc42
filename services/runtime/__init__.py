"""Plumbing every service shares: config, logging, request context, interceptors, metrics,
channels and the server host. Nothing here knows about any one service.

Errors raised by domain code (see `errors`) form this hierarchy, mapped to gRPC codes by the
server interceptor:

    ServiceError
    ├── InvalidArgument      INVALID_ARGUMENT
    ├── NotFound             NOT_FOUND
    ├── AlreadyExists        ALREADY_EXISTS
    ├── FailedPrecondition   FAILED_PRECONDITION
    ├── Aborted              ABORTED
    ├── PermissionDenied     PERMISSION_DENIED
    ├── Unauthenticated      UNAUTHENTICATED
    ├── ResourceExhausted    RESOURCE_EXHAUSTED
    ├── DeadlineExceeded     DEADLINE_EXCEEDED
    └── Unavailable          UNAVAILABLE
"""

from services.runtime.config import ConfigError, ServerConfig, load_config
from services.runtime.context import current_request_id, new_request_id, request_scope
from services.runtime.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "Aborted",
    "AlreadyExists",
    "ConfigError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "ServerConfig",
    "ServiceError",
    "Unauthenticated",
    "Unavailable",
    "current_request_id",
    "load_config",
    "new_request_id",
    "request_scope",
]
