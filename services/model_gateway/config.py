"""Model gateway settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from services.runtime.config import ConfigError, ServerConfig

__all__ = ["ENV_PREFIX", "ModelConfig"]

ENV_PREFIX = "SYSTEM_MODEL_"

MAX_REQUEST_TIMEOUT_SECONDS = 600.0


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

    # Not a field (no annotation): the key read from `api_key_file`, out of repr and settings.
    _file_key = ""
    request_timeout_seconds: float = 20.0
    """Longest one provider call may take; a shorter caller deadline wins."""
    max_prompt_chars: int = 32_000
    """Most characters all messages of one request may hold together."""
    default_max_tokens: int = 1024
    """Answer-token bound used when a request leaves `max_tokens` at 0."""

    def __post_init__(self) -> None:
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
        """True when an API key is set, so completions can be attempted."""
        return bool(self.key)

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
        if not 0 < self.request_timeout_seconds <= MAX_REQUEST_TIMEOUT_SECONDS:
            raise ConfigError(
                f"request_timeout_seconds must be over 0 and at most {MAX_REQUEST_TIMEOUT_SECONDS:g}, "
                f"got {self.request_timeout_seconds}"
            )
        for name in ("max_prompt_chars", "default_max_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
