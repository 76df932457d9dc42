"""Who may call an internal port, and how a service proves who it is when it calls another.

Every internal port (each service's gRPC port; the gateway's relay port) requires a service
credential: a bearer token in `authorization` metadata, or, where mutual TLS is configured, a
client certificate whose common name is the caller's name. A credential names a *caller*
(`gateway`, `router`, `engine`, `model`, `storage` or `operator`); each service declares which
callers may call which of its methods (`AccessPolicy`), so only the gateway speaks for players,
only engine replicas write tasks and receipts, and only operators' tooling resets or revokes.

Health checks and reflection need no credential: probes cannot send one, and reflection only
describes the public protos. A port bound to loopback with no credentials configured accepts
any local caller (what `make run`'s single machine and the in-process tests use); any other
address refuses to start without credentials unless `allow_unauthenticated` says otherwise.

The game servers' public port is not covered here: game servers authenticate with their own
per-server tokens in the gateway's Connect handler.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hmac
import ipaddress
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from services.runtime.config import ConfigError
from services.runtime.errors import PermissionDenied, Unauthenticated
from services.runtime.watched_file import WatchedFile

__all__ = [
    "ANY_CALLER",
    "CALLERS",
    "LOCAL_CALLER",
    "AccessPolicy",
    "CallGuard",
    "CallerBook",
    "ChannelSecurity",
    "ServerTls",
    "current_caller",
    "enter_caller",
    "is_loopback",
    "leave_caller",
    "parse_caller_tokens",
    "read_caller_tokens_file",
    "read_entries_file",
    "read_token_file",
]

log = logging.getLogger("system.security")

CALLERS = ("gateway", "router", "engine", "model", "storage", "operator")
"""Names a service credential may carry: the five services, and operators' tooling."""

LOCAL_CALLER = "local"
"""The caller of a loopback port that has no credentials configured (development only)."""

ANY_CALLER = "*"
"""In an AccessPolicy: every authenticated caller."""

_caller: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="")


def current_caller() -> str:
    """The authenticated caller of the call in progress (`gateway`, ..., `local`), or ""."""
    return _caller.get()


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (`127.0.0.1`, `::1`, `localhost`)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_caller_tokens(pairs: Iterable[str], setting: str = "caller_tokens") -> dict[str, str]:
    """`caller=token` pairs → {token: caller}. Raises ConfigError naming the bad entry.

    A caller may hold several tokens (`engine=old`, `engine=new` during a rotation); a token
    names one caller only.
    """
    book: dict[str, str] = {}
    for index, pair in enumerate(pairs):
        caller, sep, token = pair.partition("=")
        caller, token = caller.strip(), token.strip()
        if not sep or not caller or not token:
            raise ConfigError(f"{setting}[{index}] must look like caller=token")
        if caller not in CALLERS:
            raise ConfigError(
                f"{setting}[{index}]: unknown caller {caller!r}; callers are {', '.join(CALLERS)}"
            )
        if len(token) < 16:
            raise ConfigError(f"{setting}[{index}]: the token for {caller} is shorter than 16")
        if token in book:
            raise ConfigError(f"{setting}[{index}]: this token is given to two callers")
        book[token] = caller
    return book


def read_entries_file(path: str, setting: str) -> list[str]:
    """The entries of a `name=token` file (`caller_tokens_file`, the gateway's `tokens_file`):
    one a line or comma-separated, as the matching variable holds them, so one Secret value
    serves both; blank lines and lines starting with `#` are left out.

    Raises:
        ConfigError: the file cannot be read.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{setting} {path} cannot be read: {exc}") from None
    lines = (line.strip() for line in text.splitlines())
    return [
        entry.strip()
        for line in lines
        if line and not line.startswith("#")
        for entry in line.split(",")
        if entry.strip()
    ]


def read_caller_tokens_file(path: str, setting: str = "caller_tokens_file") -> dict[str, str]:
    """{token: caller} of a caller tokens file. Raises ConfigError when it cannot be read,
    names no entry (a file truncated mid-rewrite would otherwise refuse every caller) or has a
    bad entry."""
    entries = read_entries_file(path, setting)
    if not entries:
        raise ConfigError(f"{setting} {path} holds no caller=token entry")
    return parse_caller_tokens(entries, setting)


def read_token_file(path: str, setting: str = "service_token_file") -> str:
    """The one token in the file at `path` (surrounding whitespace and a final newline left
    out). Raises ConfigError when it cannot be read, is empty or holds more than a token."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{setting} {path} cannot be read: {exc}") from None
    if not token:
        raise ConfigError(f"{setting} {path} is empty")
    if any(c.isspace() for c in token):
        raise ConfigError(f"{setting} {path} must hold one token, without spaces or lines")
    return token


def _read(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from None


@dataclasses.dataclass(frozen=True)
class ChannelSecurity:
    """How a service's outbound channels identify it and check whom they reach."""

    token: str = ""
    """This service's credential, sent as `authorization: Bearer <token>`. Empty: none sent."""
    token_file: str = ""
    """A file holding the credential instead of `token`, read again when it changes (a
    mounted Secret): calls carry its current token without reopening channels."""
    ca_file: str = ""
    """Trust this CA's certificates: dial every internal target over TLS. Empty: plaintext."""
    cert_file: str = ""
    """Client certificate presented to targets requiring mutual TLS (with `key_file`)."""
    key_file: str = ""
    """Private key of `cert_file`."""

    _watched: WatchedFile[str] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.token and self.token_file:
            raise ConfigError("service_token and service_token_file are exclusive: set one")
        if self.token_file:
            path = self.token_file
            watched = WatchedFile([path], lambda: read_token_file(path), what="service_token_file")
            object.__setattr__(self, "_watched", watched)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What an outbound call carries (the bearer token); with `token_file`, the file's
        token as it is now: channels ask for it on each call and each stream they open."""
        if self._watched is not None:
            return (("authorization", f"Bearer {self._watched.current()}"),)
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for `grpc.aio.secure_channel`, or None for plaintext."""
        if not self.ca_file:
            return None
        chain = _read(self.cert_file, "tls_cert_file") if self.cert_file else None
        key = _read(self.key_file, "tls_key_file") if self.key_file else None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "tls_ca_file"),
            private_key=key,
            certificate_chain=chain,
        )


class ServerTls:
    """TLS for one listening port, reloaded when the certificate or key file changes.

    gRPC asks for the current certificate at every new handshake; this answers with the files'
    content when their modification times changed since the last answer, so a renewed
    certificate (cert-manager rewriting a mounted Secret, say) is served without a restart.
    Connections already open keep the certificate they started with.

    Args:
        cert_file: PEM certificate chain.
        key_file: PEM private key.
        client_ca_file: when set, clients must present a certificate signed by this CA.
    """

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = "") -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.client_ca_file = client_ca_file
        # Looked at on every handshake (recheck 0): a handshake is rare next to calls.
        self._watched = WatchedFile(
            [cert_file, key_file, client_ca_file],
            self._configuration,
            what="TLS files",
            recheck_seconds=0.0,
        )

    @property
    def reloads(self) -> int:
        """Times changed files were taken."""
        return self._watched.reloads

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(_read(self.key_file, "tls_key_file"), _read(self.cert_file, "tls_cert_file"))],
            root_certificates=(
                _read(self.client_ca_file, "tls_client_ca_file") if self.client_ca_file else None
            ),
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # Half-written files during a rotation leave the old certificate served (the
        # watcher logs them and tries again on the next handshake).
        return self._watched.value if self._watched.refresh() else None

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials for `add_secure_port`."""
        return grpc.dynamic_ssl_server_credentials(
            self._watched.value,
            # grpc calls this on each handshake and keeps the current certificate when it
            # returns None; the stub's callback type leaves None out.
            self._fetch,  # type: ignore[arg-type]
            require_client_authentication=bool(self.client_ca_file),
        )


def _encoded(tokens: Mapping[str, str]) -> list[tuple[bytes, str]]:
    return [(token.encode(), caller) for token, caller in tokens.items()]


class CallerBook:
    """Authenticates one call: token → caller, or the mutual-TLS certificate's common name.

    Args:
        tokens: {token: caller} (see `parse_caller_tokens`).
        tokens_file: a `caller_tokens_file` whose tokens are accepted instead, read again when
            it changes (looked at no more often than every few seconds, on a call); a file
            that cannot be read or parsed keeps the tokens last taken.
        mutual_tls: the port requires client certificates; their common name names the caller.
        open_locally: no credentials configured on a loopback port: every call is `local`.
    """

    def __init__(
        self,
        tokens: Mapping[str, str],
        *,
        tokens_file: str = "",
        mutual_tls: bool = False,
        open_locally: bool = False,
    ) -> None:
        if tokens and tokens_file:
            raise ConfigError("caller_tokens and caller_tokens_file are exclusive: set one")
        self._tokens = _encoded(tokens)
        self.watched: WatchedFile[list[tuple[bytes, str]]] | None = (
            WatchedFile(
                [tokens_file],
                lambda: _encoded(read_caller_tokens_file(tokens_file)),
                what="caller_tokens_file",
            )
            if tokens_file
            else None
        )
        """The file's tokens, when `tokens_file` is set."""
        self.mutual_tls = mutual_tls
        self.open_locally = open_locally and not tokens and not tokens_file and not mutual_tls

    def caller(self, authorization: str, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        """The caller's name. Raises Unauthenticated with a message saying what to send."""
        if self.open_locally:
            return LOCAL_CALLER
        if authorization:
            scheme, _, token = authorization.partition(" ")
            presented = token.strip().encode()
            found = ""
            known_tokens = self._tokens if self.watched is None else self.watched.current()
            # Every entry compared in constant time, so timing tells nothing about which.
            for known, caller in known_tokens:
                if hmac.compare_digest(known, presented):
                    found = caller
            if scheme.lower() == "bearer" and found:
                return found
            raise Unauthenticated("the service credential is not valid for this service")
        if self.mutual_tls:
            names = (context.auth_context() or {}).get("x509_common_name") or []
            for name in names:
                caller = name.decode() if isinstance(name, bytes) else str(name)
                if caller in CALLERS:
                    return caller
            raise Unauthenticated(
                f"the client certificate's common name is not a known caller ({', '.join(CALLERS)})"
            )
        raise Unauthenticated(
            "this is an internal port: send a service credential as "
            "`authorization: Bearer <token>` metadata"
        )


class AccessPolicy:
    """Which callers may call which methods of one service.

    Args:
        rules: full service name (`system.storage.v1.JournalService`) or full method name
            (`system.storage.v1.JournalService/Commit`) → the callers allowed (`ANY_CALLER`
            for every authenticated one). A method's own rule wins over its service's; a
            method named by neither is refused to everyone but `operator`.
    """

    def __init__(self, rules: Mapping[str, Sequence[str]]) -> None:
        for name, callers in rules.items():
            unknown = set(callers) - {*CALLERS, ANY_CALLER}
            if unknown:
                raise ValueError(f"access rule {name}: unknown callers {sorted(unknown)}")
        self._rules = {name: frozenset(callers) for name, callers in rules.items()}
        self._decided: dict[str, frozenset[str]] = {}

    def callers(self, method: str) -> frozenset[str]:
        """The callers allowed to call `method` (`/package.Service/Method`)."""
        decided = self._decided.get(method)
        if decided is None:
            full = method.lstrip("/")
            service = full.partition("/")[0]
            decided = self._rules.get(full, self._rules.get(service, frozenset()))
            self._decided[method] = decided
        return decided

    def check(self, caller: str, method: str) -> None:
        """Raises PermissionDenied unless `caller` may call `method`."""
        if caller in (LOCAL_CALLER, "operator"):
            return
        allowed = self.callers(method)
        if ANY_CALLER in allowed or caller in allowed:
            return
        raise PermissionDenied(
            f"caller {caller!r} may not call {method.lstrip('/')}"
            + (f"; allowed: {', '.join(sorted(allowed))}" if allowed else "")
        )


def enter_caller(caller: str) -> contextvars.Token[str]:
    """Sets the call's caller (the server interceptor does, for every call)."""
    return _caller.set(caller)


def leave_caller(token: contextvars.Token[str]) -> None:
    _caller.reset(token)


class CallGuard:
    """Authentication and authorization of one internal port, as the interceptor runs them."""

    def __init__(self, book: CallerBook, policy: AccessPolicy) -> None:
        self.book = book
        self.policy = policy

    def admit(
        self, authorization: str, context: grpc.aio.ServicerContext[Any, Any], method: str
    ) -> str:
        """The caller's name, when they may call `method`; raises Unauthenticated or
        PermissionDenied otherwise."""
        caller = self.book.caller(authorization, context)
        self.policy.check(caller, method)
        return caller
