"""Model gateway settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from services.model_gateway.budgets import BudgetPlan, read_budgets_file
from services.model_gateway.provider_config import Routing, read_providers_file, single_provider
from services.runtime.config import ConfigError, ServerConfig

__all__ = ["ENV_PREFIX", "MAX_SEARCH_RESULTS", "ModelConfig"]

ENV_PREFIX = "SYSTEM_MODEL_"

MAX_REQUEST_TIMEOUT_SECONDS = 600.0
MAX_SEARCH_RESULTS = 20


@dataclasses.dataclass(frozen=True)
class ModelConfig(ServerConfig):
    """Settings of the model gateway (env prefix `SYSTEM_MODEL_`)."""

    port: int = 50054
    metrics_port: int = 9104
    base_url: str = "https://api.deepseek.com"
    """Root of the OpenAI-compatible API; `/chat/completions` is appended to it."""
    model: str = "deepseek-chat"
    """Model name sent with every completion."""
    api_key: str = dataclasses.field(default="", repr=False)
    """Bearer key for the provider; empty (and no `api_key_file`) means no model is configured.
    Set it through `SYSTEM_MODEL_API_KEY` rather than the TOML file. Kept out of `repr` so it
    never reaches a log."""
    api_key_file: str = ""
    """Path of a file holding the key (a mounted secret), read once at start with surrounding
    whitespace stripped. Not together with `api_key`."""

    # Not fields (no annotation, or ClassVar): the key read from `api_key_file`, out of repr and settings,
    # and the providers and routes, read once in __post_init__.
    _file_key = ""
    _routing: ClassVar[Routing | None] = None
    _budgets: ClassVar[BudgetPlan | None] = None
    request_timeout_seconds: float = 20.0
    """Longest one provider call may take, from sending it to the finish reason (the total
    timeout); a shorter caller deadline wins."""
    first_token_timeout_seconds: float = 10.0
    """Longest wait from sending a call to its first token; at most `request_timeout_seconds`."""
    max_attempts: int = 3
    """Provider calls per Complete: retries happen only on connection errors and HTTP 429/5xx
    that came before any output, and only within the caller's deadline."""
    retry_backoff_seconds: float = 0.25
    """Wait before the first retry; each further retry waits twice as long (a provider's
    Retry-After, when longer, wins up to the deadline)."""
    providers_file: str = ""
    """Path of a TOML file naming several OpenAI-compatible providers (presets deepseek, qwen,
    ollama, vllm, custom; their models, prices, limits and key sources) and the ordered
    provider/model list per module (see `provider_config.py`). Empty: the one provider of
    `base_url`, `model` and `api_key` (named `default`). Read once at start."""
    breaker_failures: int = 5
    """Consecutive failures (connection, HTTP 429/5xx, no first token in time, broken stream)
    after which a provider's circuit breaker opens and calls skip it; 0 turns breakers off."""
    breaker_cooldown_seconds: float = 30.0
    """How long an open breaker skips its provider before letting one probe call through."""
    max_prompt_chars: int = 32_000
    """Most characters all messages and tool schemas of one request may hold together."""
    default_max_tokens: int = 1024
    """Answer-token bound used when a request leaves `max_tokens` at 0."""
    max_answer_tokens: int = 8192
    """Largest `max_tokens` a request may ask for (DeepSeek's chat model allows 8192)."""

    storage_target: str = "127.0.0.1:50055"
    """`host:port` of the storage service, which keeps usage, budgets and the players'
    preferences. Empty turns metering, budgets and the external-services check off: for
    trying the gateway alone, never for players."""
    storage_timeout_seconds: float = 2.0
    """Longest a budget check (before a call) or a usage record (after it) may take; a budget
    check is also bound by the caller's deadline. Past it the call answers UNAVAILABLE."""
    player_daily_tokens: int = 200_000
    """Tokens (prompt + answer) one player may use a UTC day; 0 for no limit."""
    global_daily_tokens: int = 0
    """Tokens everyone together may use a UTC day; 0 for no limit."""
    player_daily_web_searches: int = 50
    """Web searches one player may make a UTC day; 0 for no limit."""
    global_daily_web_searches: int = 0
    """Web searches everyone together may make a UTC day; 0 for no limit."""
    budgets_file: str = ""
    """Path of a TOML file of nested budgets in tokens and money: per-player daily limits by
    rank (permission level), per game server per day, per network per day and per month, and
    alert thresholds (see `budgets.py`). Empty: the flat `player_daily_*` / `global_daily_*`
    limits alone. Read once at start."""
    relay_target: str = ""
    """`host:port` of the gateway's internal relay (ToolRelayService), where budget alerts are
    sent as in-game notices to the administrators (NotifyPlayer to every player at or above
    `alert_permission_level`): claimed once across the model-gateway replicas in storage, and
    sent to every live gateway replica storage's presence names, this target when it names
    none. Empty: alerts are logged only."""
    alert_permission_level: int = 3
    """Permission level at and above which players get budget alerts in game; keep it the
    engine's `admin_permission_level`, the level of the admin commands."""
    lease_tokens: int = 16_384
    """Tokens of a player's daily budget (and of the global one) this replica reserves at once
    and then draws on for that player's calls without a storage round trip; never more than
    the budgets have left. 0 (with `lease_web_searches` 0): a reservation per call."""
    lease_web_searches: int = 4
    """Web searches a lease reserves at once, like `lease_tokens`."""
    lease_refresh_seconds: float = 1.0
    """How often each lease in use writes its use to storage, renews itself and re-reads the
    player's external-services preference. A lease not in contact with storage for 3 times
    this serves no call until it is: a player who turns external services off is refused on
    every replica within that time."""
    lease_idle_seconds: float = 10.0
    """A lease no call used for this long is closed: its use written, its rest released."""
    lease_ttl_seconds: int = 60
    """Storage releases a lease not renewed for this long: what a replica that died held.
    Calls that could outlast it get a reservation of their own."""

    search_url: str = ""
    """Base URL of a SearXNG instance whose JSON format is enabled (`search.formats: [html,
    json]` in its settings.yml); `/search` is appended. Empty: WebSearch answers UNAVAILABLE."""
    search_timeout_seconds: float = 10.0
    """Longest one search may take; a shorter caller deadline wins."""
    search_default_results: int = 5
    """Results a search returns when the request leaves `max_results` at 0."""
    search_session_ttl_seconds: float = 900.0
    """How long the URLs a search returned stay fetchable in its search session."""
    max_search_sessions: int = 10_000
    """Search sessions remembered at once; the least recently used is forgotten first."""
    fetch_timeout_seconds: float = 10.0
    """Longest one fetch may take, redirects included; a shorter caller deadline wins."""
    fetch_max_bytes: int = 2_000_000
    """Most bytes of a page read; the rest is cut off (the answer says `truncated`)."""
    fetch_max_chars: int = 20_000
    """Most characters of text a fetch returns; requests may ask for fewer."""
    fetch_max_redirects: int = 5
    """Redirects followed per fetch, each target checked again."""
    fetch_allow_loopback: bool = False
    """Allow fetching loopback addresses (127.0.0.0/8, ::1). For tests against the local test
    server only; private, link-local and other non-public addresses stay refused."""

    def __post_init__(self) -> None:
        self._read_key_file()
        if self.providers_file:
            if self.api_key or self.api_key_file:
                raise ConfigError(
                    "api_key and api_key_file are for the single provider of base_url; with "
                    "providers_file give each provider its api_key_env or api_key_file there"
                )
            routing = read_providers_file(
                self.providers_file,
                first_token_timeout_seconds=self.first_token_timeout_seconds,
                request_timeout_seconds=self.request_timeout_seconds,
            )
        else:
            routing = single_provider(
                base_url=self.base_url,
                model=self.model,
                api_key=self.key,
                first_token_timeout_seconds=self.first_token_timeout_seconds,
                request_timeout_seconds=self.request_timeout_seconds,
            )
        object.__setattr__(self, "_routing", routing)
        flat = {
            "player_daily_tokens": self.player_daily_tokens,
            "player_daily_web_searches": self.player_daily_web_searches,
            "global_daily_tokens": self.global_daily_tokens,
            "global_daily_web_searches": self.global_daily_web_searches,
        }
        if self.budgets_file:
            budgets = read_budgets_file(self.budgets_file, **flat)
        else:
            budgets = BudgetPlan.flat(*flat.values())
        object.__setattr__(self, "_budgets", budgets)

    def _read_key_file(self) -> None:
        if not self.api_key_file:
            return
        if self.api_key:
            raise ConfigError(
                "set either api_key (SYSTEM_MODEL_API_KEY) or api_key_file "
                "(SYSTEM_MODEL_API_KEY_FILE), not both"
            )
        path = Path(self.api_key_file)
        try:
            key = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            # The exception's own text is left out: only the path and the reason's kind.
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "unreadable"
            raise ConfigError(f"api_key_file {path} cannot be read: {reason}") from None
        if not key:
            raise ConfigError(f"api_key_file {path} is empty")
        object.__setattr__(self, "_file_key", key)

    @property
    def key(self) -> str:
        """The API key in force: `api_key`, or the content of `api_key_file`; "" for none."""
        return self.api_key or self._file_key

    @property
    def configured(self) -> bool:
        """True when every provider has its key, so completions can be attempted."""
        return self.routing.configured

    @property
    def routing(self) -> Routing:
        """The providers and the provider/model list per module (one provider, `default`,
        without `providers_file`)."""
        assert self._routing is not None  # set in __post_init__
        return self._routing

    @property
    def budgets(self) -> BudgetPlan:
        """The limits per rank, game server and network (the flat settings without
        `budgets_file`)."""
        assert self._budgets is not None  # set in __post_init__
        return self._budgets

    def validate(self) -> None:
        super().validate()
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"base_url must start with http:// or https://, got {self.base_url!r}"
            )
        if not self.model.strip():
            raise ConfigError("model must name the provider's model, for example deepseek-chat")
        if self.api_key != self.api_key.strip():
            # A key read from a secret file often ends in a newline; the provider would refuse it.
            raise ConfigError("api_key has leading or trailing whitespace; remove it")
        timeouts = (
            "request_timeout_seconds",
            "search_timeout_seconds",
            "fetch_timeout_seconds",
            "storage_timeout_seconds",
        )
        for name in timeouts:
            value = getattr(self, name)
            if not 0 < value <= MAX_REQUEST_TIMEOUT_SECONDS:
                raise ConfigError(
                    f"{name} must be over 0 and at most {MAX_REQUEST_TIMEOUT_SECONDS:g}, got {value}"
                )
        if not 0 < self.first_token_timeout_seconds <= self.request_timeout_seconds:
            raise ConfigError(
                "first_token_timeout_seconds must be over 0 and at most request_timeout_seconds "
                f"({self.request_timeout_seconds:g}), got {self.first_token_timeout_seconds}"
            )
        if not 0 <= self.breaker_failures <= 1000:
            raise ConfigError(
                f"breaker_failures must be 0 (off) to 1000, got {self.breaker_failures}"
            )
        if not 0 < self.breaker_cooldown_seconds <= 3600:
            raise ConfigError(
                "breaker_cooldown_seconds must be over 0 and at most 3600, got "
                f"{self.breaker_cooldown_seconds}"
            )
        if not 1 <= self.alert_permission_level <= 4:
            raise ConfigError(
                f"alert_permission_level must be 1 to 4, got {self.alert_permission_level}"
            )
        if not 1 <= self.max_attempts <= 10:
            raise ConfigError(f"max_attempts must be between 1 and 10, got {self.max_attempts}")
        if not 0 <= self.retry_backoff_seconds <= 60:
            raise ConfigError(
                f"retry_backoff_seconds must be between 0 and 60, got {self.retry_backoff_seconds}"
            )
        positive = (
            "max_prompt_chars",
            "default_max_tokens",
            "max_answer_tokens",
            "search_default_results",
            "search_session_ttl_seconds",
            "max_search_sessions",
            "fetch_max_bytes",
            "fetch_max_chars",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.default_max_tokens > self.max_answer_tokens:
            raise ConfigError(
                f"default_max_tokens ({self.default_max_tokens}) is over max_answer_tokens "
                f"({self.max_answer_tokens})"
            )
        counts = (
            "player_daily_tokens",
            "global_daily_tokens",
            "player_daily_web_searches",
            "global_daily_web_searches",
            "fetch_max_redirects",
            "lease_tokens",
            "lease_web_searches",
        )
        for name in counts:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if not 0 < self.lease_refresh_seconds <= 60:
            raise ConfigError(
                f"lease_refresh_seconds must be over 0 and at most 60, got "
                f"{self.lease_refresh_seconds}"
            )
        if self.lease_idle_seconds < self.lease_refresh_seconds:
            raise ConfigError(
                f"lease_idle_seconds ({self.lease_idle_seconds}) must be at least "
                f"lease_refresh_seconds ({self.lease_refresh_seconds})"
            )
        if not 4 * self.lease_refresh_seconds <= self.lease_ttl_seconds <= 3600:
            raise ConfigError(
                "lease_ttl_seconds must be at least 4 times lease_refresh_seconds (renewals "
                f"come that often) and at most 3600, got {self.lease_ttl_seconds}"
            )
        if self.search_default_results > MAX_SEARCH_RESULTS:
            raise ConfigError(
                f"search_default_results must be at most {MAX_SEARCH_RESULTS}, "
                f"got {self.search_default_results}"
            )
        if self.search_url and not self.search_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"search_url must start with http:// or https://, got {self.search_url!r}"
            )
        if self.storage_target and ":" not in self.storage_target:
            raise ConfigError(
                f"storage_target must be host:port of the storage service, got {self.storage_target!r}"
            )
