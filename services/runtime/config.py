"""Configuration: a frozen dataclass per service, read once at start from a TOML file plus
environment overrides, validated with messages an operator can act on.

Precedence, lowest first: dataclass defaults, the TOML file, environment variables named
`<PREFIX><FIELD>` in upper case (for example `SYSTEM_ROUTER_PORT=50052`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import socket
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from services.runtime.keepalive import KeepalivePolicy

if TYPE_CHECKING:
    from services.runtime.channels import ChannelSettings

__all__ = [
    "DEFAULT_EVENT_LOOP",
    "ConfigError",
    "ServerConfig",
    "load_config",
    "read_json_file",
    "write_file_atomically",
]

C = TypeVar("C")

MAX_WORKERS = 64
EVENT_LOOPS = ("asyncio", "uvloop")
DEFAULT_EVENT_LOOP = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
"""uvloop where it is installed (a dependency everywhere but Windows): every service's gRPC
hops cost less CPU on it (decision 0037); plain asyncio otherwise."""


class ConfigError(ValueError):
    """A configuration file or variable is invalid; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Settings every service has. Services subclass it and add their own fields."""

    host: str = "127.0.0.1"
    """Address to listen on; `0.0.0.0` in containers."""
    port: int = 0
    """gRPC port; 0 picks a free one (written to `port_file`)."""
    metrics_port: int = 0
    """Prometheus metrics port; 0 picks a free one, -1 turns metrics off."""
    drain_seconds: float = 0.5
    """After SIGTERM, how long health answers NOT_SERVING before the server stops accepting."""
    grace_seconds: float = 5.0
    """After draining, how long running calls may take to finish before they are cancelled."""
    port_file: str = ""
    """If set, a JSON file with the bound ports is written here once the server is serving."""
    log_level: str = "INFO"
    """Python logging level name."""
    workers: int = 1
    """Server processes sharing the gRPC port (`SO_REUSEPORT`, Linux; the kernel spreads
    connections over them). 1: this process serves. N > 1: this process forks N workers and
    supervises them; each is a full replica with its own in-memory state (caches, counters)
    and its own metrics endpoint (`metrics_port` + i, or a free port each when 0)."""
    event_loop: str = DEFAULT_EVENT_LOOP
    """`asyncio` or `uvloop` (needs the uvloop package): the event loop `python -m` runs the
    service on. The default is uvloop where it is installed, which lowers the CPU each call
    costs (decision 0037)."""
    service_token: str = ""
    """This service's credential, sent as `authorization: Bearer <token>` on every call it makes
    to another service. Secret. Exclusive with `service_token_file`."""
    service_token_file: str = ""
    """A file holding `service_token` instead (a mounted Secret): read at start and again when
    it changes (looked at every few seconds at most, on a call), so a rotated credential is
    sent without a restart; a file that cannot be read or is empty keeps the last token."""
    caller_tokens: tuple[str, ...] = ()
    """Credentials this service's internal port accepts, as `caller=token` pairs (callers:
    gateway, router, engine, model, storage, operator; env: comma-separated). A caller may
    have two tokens (during a rotation). Secret. Empty on a loopback address: every local
    caller is accepted (development only). Exclusive with `caller_tokens_file`."""
    caller_tokens_file: str = ""
    """A file holding the `caller=token` pairs instead (one a line or comma-separated; `#`
    comments), read at start and again when it changes (looked at every few seconds at most,
    on a call): tokens added are accepted and tokens removed refused without a restart. A file
    that cannot be read, is empty or has a bad entry keeps the pairs last taken."""
    allow_unauthenticated: bool = False
    """Accept calls without a credential on a non-loopback address (a private network the
    operator trusts). Off: such a service refuses to start without credentials."""
    tls_cert_file: str = ""
    """PEM certificate the internal port serves TLS with (and presents as a client certificate
    to targets requiring mutual TLS). Reloaded when the file changes."""
    tls_key_file: str = ""
    """PEM private key of `tls_cert_file`."""
    tls_client_ca_file: str = ""
    """Require mutual TLS on the internal port: clients present a certificate signed by this
    CA whose common name is their caller name (`engine`, ...)."""
    tls_ca_file: str = ""
    """Dial other services over TLS, trusting this CA. Empty: plaintext."""
    client_keepalive_seconds: float = 30.0
    """Keepalive (services.runtime.keepalive): how often outbound connections ping when idle."""
    permit_keepalive_seconds: float = 20.0
    """Keepalive: the shortest interval between a client's pings this server accepts."""
    server_keepalive_seconds: float = 60.0
    """Keepalive: how often this server pings idle client connections."""
    keepalive_timeout_seconds: float = 20.0
    """Keepalive: how long a ping may go unacknowledged before the connection is closed."""
    max_connection_age_seconds: float = 300.0
    """Close each client connection to the internal port after about this long (gRPC adds
    up to 10% either way, so connections made together are not closed together; 0: never).
    The client then connects again, resolving its target anew: it finds replicas added since
    (decision 0022). Calls open then get `max_connection_age_grace_seconds` to finish; new
    calls go on the new connection. The gateway's public port never ages connections: a game
    server holds one stream there for as long as it runs, and closing it would drop its
    players."""
    max_connection_age_grace_seconds: float = 150.0
    """How long calls open on an aged connection may go on before it is closed: more than the
    longest request (the gateway's `request_timeout_seconds`, 120 s), so that aging never cuts
    one. Long-lived streams of calls move to a new stream well within it
    (`ChannelSettings.stream_seconds`)."""
    tracing_exporter: str = ""
    """Where this service's spans go (services.runtime.tracing): "" nowhere (off: no span is
    made), `console` (one JSON line per span on stderr) or `otlp` (OTLP over HTTP to
    `OTEL_EXPORTER_OTLP_ENDPOINT`; needs the opentelemetry-exporter-otlp-proto-http
    package)."""
    tracing_sample_ratio: float = 1.0
    """The share of new traces recorded (0..1); a call inside a trace follows its caller."""

    def validate(self) -> None:
        """Raises ConfigError for values that cannot work. Subclasses extend it."""
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0..65535, got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be -1 (off) or 0..65535, got {self.metrics_port}")
        if self.drain_seconds < 0 or self.grace_seconds < 0:
            raise ConfigError("drain_seconds and grace_seconds must not be negative")
        if self.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ConfigError(
                f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}"
            )
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"workers must be 1..{MAX_WORKERS}, got {self.workers}")
        if self.workers > 1 and not hasattr(socket, "SO_REUSEPORT"):
            raise ConfigError("workers > 1 needs SO_REUSEPORT, which this platform lacks")
        if self.event_loop not in EVENT_LOOPS:
            raise ConfigError(
                f"event_loop must be {' or '.join(EVENT_LOOPS)}, got {self.event_loop!r}"
            )
        if self.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ConfigError("event_loop 'uvloop' needs the uvloop package (pip install uvloop)")
        if self.max_connection_age_seconds < 0 or self.max_connection_age_grace_seconds < 0:
            raise ConfigError(
                "max_connection_age_seconds and max_connection_age_grace_seconds must not be "
                "negative"
            )
        if self.max_connection_age_seconds and not self.max_connection_age_grace_seconds:
            raise ConfigError(
                "max_connection_age_grace_seconds must be positive when "
                "max_connection_age_seconds is set: with no grace every call open on an aged "
                "connection is cut; give it more than the longest request"
            )
        self._validate_tracing()
        problems = self.keepalive().problems()
        if problems:
            raise ConfigError("; ".join(problems))
        self._validate_security()

    def _validate_tracing(self) -> None:
        from services.runtime.tracing import OTLP_MODULE, TRACING_EXPORTERS

        if self.tracing_exporter not in TRACING_EXPORTERS:
            raise ConfigError(
                "tracing_exporter must be empty (off), 'console' or 'otlp', got "
                f"{self.tracing_exporter!r}"
            )
        if self.tracing_exporter == "otlp":
            try:
                found = importlib.util.find_spec(OTLP_MODULE) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                raise ConfigError(
                    "tracing_exporter 'otlp' needs the OTLP exporter package "
                    "(pip install opentelemetry-exporter-otlp-proto-http)"
                )
        if not 0.0 <= self.tracing_sample_ratio <= 1.0:
            raise ConfigError(f"tracing_sample_ratio must be 0..1, got {self.tracing_sample_ratio}")

    def _validate_security(self) -> None:
        from services.runtime.security import (
            is_loopback,
            parse_caller_tokens,
            read_caller_tokens_file,
            read_token_file,
        )

        for setting in ("service_token", "caller_tokens"):
            if getattr(self, setting) and getattr(self, f"{setting}_file"):
                raise ConfigError(
                    f"{setting} and {setting}_file are exclusive: set one (the file, for a "
                    "mounted Secret re-read when it changes)"
                )
        parse_caller_tokens(self.caller_tokens)
        if self.caller_tokens_file:
            read_caller_tokens_file(self.caller_tokens_file)
        if self.service_token_file:
            read_token_file(self.service_token_file)
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError(
                "tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file"
            )
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "tls_ca_file"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"{name}: {path} does not exist")
        credentials = self.caller_tokens or self.caller_tokens_file or self.tls_client_ca_file
        if not credentials and not self.allow_unauthenticated and not is_loopback(self.host):
            raise ConfigError(
                f"host {self.host} is reachable from other machines but no credential is "
                "required: set caller_tokens (caller=token pairs), caller_tokens_file or "
                "tls_client_ca_file, or "
                "allow_unauthenticated=true on a network you trust"
            )

    def keepalive(self) -> KeepalivePolicy:
        """The keepalive policy of this service's servers and channels."""
        return KeepalivePolicy(
            client_seconds=self.client_keepalive_seconds,
            permit_seconds=self.permit_keepalive_seconds,
            server_seconds=self.server_keepalive_seconds,
            timeout_seconds=self.keepalive_timeout_seconds,
        )

    def channel_settings(self) -> ChannelSettings:
        """How this service's outbound channels authenticate, encrypt and keep alive."""
        from services.runtime.channels import ChannelSettings
        from services.runtime.security import ChannelSecurity

        return ChannelSettings(
            ChannelSecurity(
                token=self.service_token,
                token_file=self.service_token_file,
                ca_file=self.tls_ca_file,
                cert_file=self.tls_cert_file if self.tls_ca_file else "",
                key_file=self.tls_key_file if self.tls_ca_file else "",
            ),
            self.keepalive(),
        )


def read_json_file(path: str | os.PathLike[str], what: str) -> Any:
    """The JSON document in the file at `path` (`what` names it in errors, e.g. "semantic
    config file").

    Raises:
        ConfigError: the file is missing, unreadable or not JSON; the message says where.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} {file} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {file} cannot be read: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{file}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None


def write_file_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Writes `text` to `path` whole or not at all (a temporary file beside it, then a rename),
    so a reader or a reload never sees half a file; makes the folder if needed.

    Raises:
        OSError: the folder or the file cannot be written (a read-only mount, say).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, target)


def _coerce(name: str, annotation: Any, value: Any, source: str) -> Any:
    """Converts a file value or an environment string to the field's type, or explains why not."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None or value == "":
            return None
        return _coerce(name, options[0], value, source)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in {"1", "true", "yes", "on"}:
            return True
        if isinstance(value, str) and value.lower() in {"0", "false", "no", "off"}:
            return False
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
    elif annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        items = (
            [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        )
        if isinstance(items, list | tuple) and all(isinstance(v, str) for v in items):
            return tuple(items)
    elif (origin is dict or annotation is dict) and (
        isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    ):
        return dict(value)
    type_name = getattr(annotation, "__name__", str(annotation))
    raise ConfigError(f"{source}: setting '{name}' must be {type_name}, got {value!r}")


def load_config(
    cls: type[C],
    path: str | os.PathLike[str] | None = None,
    *,
    env_prefix: str,
    environ: Mapping[str, str] | None = None,
) -> C:
    """Builds `cls` from defaults, the TOML file at `path` and `environ` overrides.

    Raises:
        ConfigError: the file is missing or malformed, a key is unknown, a value has the wrong
            type, or the result fails `validate()`.
    """
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    if path:
        file = Path(path)
        try:
            raw = tomllib.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise ConfigError(
                f"config file {file}: unknown setting(s) {', '.join(unknown)}; "
                f"known settings are {', '.join(sorted(fields))}"
            )
        for key, value in raw.items():
            values[key] = _coerce(key, hints[key], value, f"config file {file}")
    for name in fields:
        env_name = f"{env_prefix}{name.upper()}"
        if env_name in environ:
            values[name] = _coerce(name, hints[name], environ[env_name], f"environment {env_name}")
    try:
        config = cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config
