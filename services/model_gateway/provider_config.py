"""Which OpenAI-compatible providers the gateway may call, and in which order per module.

Domain code: no gRPC, no network. `read_providers_file` turns the `providers_file` TOML into a
`Routing`, checked once at start: every error is a ConfigError naming the key at fault
(`providers.qwen.api_key_env`, `routes.default[1]`). `single_provider` makes the one-provider
`Routing` of the plain settings (`base_url`, `model`, `api_key`), so both shapes run the same
code.

The file:

    [providers.deepseek]
    preset = "deepseek"                  # base_url https://api.deepseek.com, a key is required
    api_key_env = "DEEPSEEK_API_KEY"     # or api_key_file = "/run/secrets/deepseek"
    first_token_timeout_seconds = 8      # optional; the gateway's setting otherwise
    max_concurrent = 64                  # optional; 0 (the default) for no limit
    [providers.deepseek.models]
    deepseek-chat = { input_per_million = 0.27, output_per_million = 1.10 }

    [providers.local]
    preset = "ollama"                    # http://127.0.0.1:11434/v1, no key needed
    models = ["qwen2.5:7b"]              # a list: no prices (a local server costs nothing)

    [routes]
    default = ["deepseek/deepseek-chat", "local/qwen2.5:7b"]
    "system:question" = ["local", "deepseek"]     # a provider alone: its first model

A key is never written in the file: `api_key` there is refused.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.runtime.config import ConfigError

__all__ = [
    "ALL_PROVIDERS_UNAVAILABLE",
    "DEFAULT_ROUTE",
    "PRESETS",
    "Preset",
    "Price",
    "ProviderSpec",
    "Route",
    "Routing",
    "parse_routing",
    "read_providers_file",
    "single_provider",
]

ALL_PROVIDERS_UNAVAILABLE = "ALL_PROVIDERS_UNAVAILABLE"
"""`x-error-reason` of Complete's UNAVAILABLE when every provider of the module's list failed
or was skipped (breaker open, at its concurrency limit): the assistant is busy, not missing."""
DEFAULT_ROUTE = "default"
"""The key of `[routes]` used by modules without a list of their own."""
SINGLE_PROVIDER = "default"
"""Name of the provider the plain settings (`base_url`, `model`, `api_key`) describe."""
MAX_MODULE_ID = 128
MAX_CONCURRENT = 10_000


@dataclasses.dataclass(frozen=True)
class Preset:
    """What a provider kind brings: its endpoint and whether it needs a key."""

    base_url: str
    key_required: bool
    models: tuple[str, ...] = ()
    """Models used when the provider lists none."""


PRESETS: Mapping[str, Preset] = {
    "deepseek": Preset("https://api.deepseek.com", True, ("deepseek-chat",)),
    # Alibaba Cloud Model Studio (DashScope), OpenAI-compatible mode.
    "qwen": Preset("https://dashscope.aliyuncs.com/compatible-mode/v1", True, ("qwen-plus",)),
    "ollama": Preset("http://127.0.0.1:11434/v1", False),
    "vllm": Preset("http://127.0.0.1:8000/v1", False),
    # Any other OpenAI-compatible endpoint: base_url and a key source are required.
    "custom": Preset("", True),
}

_PROVIDER_KEYS = frozenset(
    {
        "preset",
        "base_url",
        "api_key_env",
        "api_key_file",
        "models",
        "first_token_timeout_seconds",
        "request_timeout_seconds",
        "max_concurrent",
    }
)
_PRICE_KEYS = frozenset({"input_per_million", "output_per_million"})
# The openai client needs some key; servers that check none (Ollama, vLLM) ignore it.
_NO_KEY = "no-key"


@dataclasses.dataclass(frozen=True)
class Price:
    """What a model costs, per million tokens (in the provider's currency)."""

    input_per_million: float = 0.0
    output_per_million: float = 0.0

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (
            prompt_tokens * self.input_per_million + completion_tokens * self.output_per_million
        ) / 1_000_000


@dataclasses.dataclass(frozen=True)
class ProviderSpec:
    """One OpenAI-compatible endpoint the gateway may call."""

    name: str
    """The name in `[providers.<name>]` (`default` for the plain settings); in metrics and logs."""
    base_url: str
    models: Mapping[str, Price]
    """Models it serves, in the file's order, with their prices."""
    api_key: str = dataclasses.field(default="", repr=False)
    """The key read from its source; "" when none is configured (the plain settings without a
    key: completions then answer UNAVAILABLE). Out of repr so it never reaches a log."""
    first_token_timeout_seconds: float = 10.0
    """Sending to the first token; past it the next provider is tried."""
    request_timeout_seconds: float = 20.0
    """Sending to the finish reason."""
    max_concurrent: int = 0
    """Calls in flight at once; a call finding it full goes to the next provider. 0: no limit."""

    @property
    def configured(self) -> bool:
        return bool(self.api_key)


@dataclasses.dataclass(frozen=True)
class Route:
    """One step of a module's list: a provider and the model asked there."""

    provider: str
    model: str

    def __str__(self) -> str:
        return f"{self.provider}/{self.model}"


@dataclasses.dataclass(frozen=True)
class Routing:
    """The providers and the ordered list of routes per module."""

    providers: Mapping[str, ProviderSpec]
    default: tuple[Route, ...]
    modules: Mapping[str, tuple[Route, ...]] = dataclasses.field(default_factory=dict)

    def routes(self, module_id: str) -> tuple[Route, ...]:
        """The list for `module_id`; the default list for "" or a module without one."""
        return self.modules.get(module_id, self.default) if module_id else self.default

    @property
    def configured(self) -> bool:
        return all(p.configured for p in self.providers.values())


def single_provider(
    *,
    base_url: str,
    model: str,
    api_key: str,
    first_token_timeout_seconds: float,
    request_timeout_seconds: float,
) -> Routing:
    """The routing of the plain settings: one provider, `default`, with one model."""
    spec = ProviderSpec(
        name=SINGLE_PROVIDER,
        base_url=base_url,
        models={model: Price()},
        api_key=api_key,
        first_token_timeout_seconds=first_token_timeout_seconds,
        request_timeout_seconds=request_timeout_seconds,
    )
    return Routing({spec.name: spec}, (Route(spec.name, model),))


def read_providers_file(
    path: str,
    *,
    first_token_timeout_seconds: float,
    request_timeout_seconds: float,
    environ: Mapping[str, str] | None = None,
) -> Routing:
    """Reads and checks the providers file (see the module docstring).

    Raises:
        ConfigError: the file is missing or not TOML, or a provider or route is wrong; the
            message names the key.
    """
    file = Path(path)
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"providers_file {file} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "unreadable"
        raise ConfigError(f"providers_file {file} cannot be read: {reason}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"providers_file {file} is not valid TOML: {exc}") from None
    return parse_routing(
        raw,
        source=f"providers_file {file}",
        first_token_timeout_seconds=first_token_timeout_seconds,
        request_timeout_seconds=request_timeout_seconds,
        environ=os.environ if environ is None else environ,
    )


def parse_routing(
    raw: Mapping[str, Any],
    *,
    source: str,
    first_token_timeout_seconds: float,
    request_timeout_seconds: float,
    environ: Mapping[str, str],
) -> Routing:
    """The Routing a decoded providers file describes. `source` opens every error message."""
    unknown = sorted(set(raw) - {"providers", "routes"})
    if unknown:
        raise ConfigError(
            f"{source}: unknown table(s) {', '.join(unknown)}; the file holds [providers.<name>] "
            "and [routes]"
        )
    tables = raw.get("providers")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{source}: no providers; add a [providers.<name>] table")
    providers: dict[str, ProviderSpec] = {}
    for name, table in tables.items():
        providers[name] = _provider(
            name,
            table,
            source,
            environ,
            first_token_timeout_seconds,
            request_timeout_seconds,
        )
    routes = raw.get("routes")
    if not isinstance(routes, dict) or DEFAULT_ROUTE not in routes:
        raise ConfigError(
            f"{source}: routes.{DEFAULT_ROUTE} is missing: give the ordered provider/model list "
            'used by modules without a list of their own, for example default = ["deepseek"]'
        )
    modules: dict[str, tuple[Route, ...]] = {}
    for module_id, entries in routes.items():
        if not module_id.strip() or len(module_id) > MAX_MODULE_ID:
            raise ConfigError(f"{source}: routes key {module_id!r} is not a module id")
        modules[module_id] = _routes(f"routes.{_key(module_id)}", entries, providers, source)
    default = modules.pop(DEFAULT_ROUTE)
    return Routing(providers, default, modules)


def _key(name: str) -> str:
    """A TOML key as written in the file (quoted when it must be)."""
    bare = name.replace("_", "").replace("-", "").isalnum() and name.isascii()
    return name if bare else f'"{name}"'


def _provider(
    name: str,
    table: Any,
    source: str,
    environ: Mapping[str, str],
    first_token_timeout_seconds: float,
    request_timeout_seconds: float,
) -> ProviderSpec:
    where = f"providers.{_key(name)}"
    if "/" in name or not name.strip():
        raise ConfigError(f"{source}: {where}: a provider name must not be empty or hold '/'")
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: {where} must be a table")
    if "api_key" in table:
        raise ConfigError(
            f"{source}: {where}.api_key: a key is never written in the config; set api_key_env "
            "(the name of an environment variable holding it) or api_key_file (a file holding it)"
        )
    unknown = sorted(set(table) - _PROVIDER_KEYS)
    if unknown:
        raise ConfigError(
            f"{source}: {where}: unknown key(s) {', '.join(unknown)}; known keys are "
            f"{', '.join(sorted(_PROVIDER_KEYS))}"
        )
    preset_name = table.get("preset")
    if not isinstance(preset_name, str) or preset_name not in PRESETS:
        raise ConfigError(
            f"{source}: {where}.preset must be one of {', '.join(PRESETS)}, got {preset_name!r}"
        )
    preset = PRESETS[preset_name]
    base_url = _string(table, "base_url", where, source) or preset.base_url
    if not base_url:
        raise ConfigError(f"{source}: {where}.base_url is required with preset {preset_name!r}")
    if not base_url.startswith(("http://", "https://")):
        raise ConfigError(
            f"{source}: {where}.base_url must start with http:// or https://, got {base_url!r}"
        )
    models = _models(table.get("models"), preset, where, source)
    first_token = _seconds(
        table, "first_token_timeout_seconds", first_token_timeout_seconds, where, source
    )
    total = _seconds(table, "request_timeout_seconds", request_timeout_seconds, where, source)
    if first_token > total:
        raise ConfigError(
            f"{source}: {where}.first_token_timeout_seconds ({first_token:g}) is over its "
            f"request_timeout_seconds ({total:g})"
        )
    limit = table.get("max_concurrent", 0)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 0 <= limit <= MAX_CONCURRENT:
        raise ConfigError(
            f"{source}: {where}.max_concurrent must be 0 (no limit) to {MAX_CONCURRENT}, "
            f"got {limit!r}"
        )
    key = _api_key(table, preset, preset_name, where, source, environ)
    return ProviderSpec(
        name=name,
        base_url=base_url,
        models=models,
        api_key=key,
        first_token_timeout_seconds=first_token,
        request_timeout_seconds=total,
        max_concurrent=limit,
    )


def _string(table: dict[str, Any], key: str, where: str, source: str) -> str:
    value = table.get(key, "")
    if not isinstance(value, str):
        raise ConfigError(f"{source}: {where}.{key} must be a string, got {value!r}")
    return value.strip()


def _seconds(table: dict[str, Any], key: str, default: float, where: str, source: str) -> float:
    value = table.get(key, default)
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not 0 < value <= 600
        or not math.isfinite(value)
    ):
        raise ConfigError(f"{source}: {where}.{key} must be over 0 and at most 600, got {value!r}")
    return float(value)


def _models(value: Any, preset: Preset, where: str, source: str) -> dict[str, Price]:
    if value is None:
        if not preset.models:
            raise ConfigError(
                f"{source}: {where}.models is required: the model names this provider serves"
            )
        return {model: Price() for model in preset.models}
    if isinstance(value, list):
        if not value or not all(isinstance(m, str) and m.strip() for m in value):
            raise ConfigError(f"{source}: {where}.models must list model names, got {value!r}")
        return {m.strip(): Price() for m in value}
    if not isinstance(value, dict) or not value:
        raise ConfigError(
            f"{source}: {where}.models must be a list of model names or a table of model = "
            "{ input_per_million, output_per_million }"
        )
    models: dict[str, Price] = {}
    for model, prices in value.items():
        at = f"{where}.models.{_key(model)}"
        if not isinstance(prices, dict) or set(prices) - _PRICE_KEYS:
            raise ConfigError(
                f"{source}: {at} must be a table with input_per_million and output_per_million"
            )
        numbers = {}
        for key in _PRICE_KEYS:
            number = prices.get(key, 0.0)
            if (
                not isinstance(number, int | float)
                or isinstance(number, bool)
                or not 0 <= number < math.inf
            ):
                raise ConfigError(f"{source}: {at}.{key} must be 0 or more, got {number!r}")
            numbers[key] = float(number)
        models[model] = Price(**numbers)
    return models


def _api_key(
    table: dict[str, Any],
    preset: Preset,
    preset_name: str,
    where: str,
    source: str,
    environ: Mapping[str, str],
) -> str:
    env_name = _string(table, "api_key_env", where, source)
    file_name = _string(table, "api_key_file", where, source)
    if env_name and file_name:
        raise ConfigError(f"{source}: {where}: set api_key_env or api_key_file, not both")
    if env_name:
        key = environ.get(env_name, "").strip()
        if not key:
            raise ConfigError(
                f"{source}: {where}.api_key_env names {env_name}, which is not set or empty"
            )
        return key
    if file_name:
        try:
            key = Path(file_name).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            # The exception's own text is left out: only the path and the reason's kind.
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "unreadable"
            raise ConfigError(
                f"{source}: {where}.api_key_file {file_name} cannot be read: {reason}"
            ) from None
        if not key:
            raise ConfigError(f"{source}: {where}.api_key_file {file_name} is empty")
        return key
    if preset.key_required:
        raise ConfigError(
            f"{source}: {where} has no key source: preset {preset_name!r} needs a key; set "
            "api_key_env (the name of an environment variable holding it) or api_key_file"
        )
    return _NO_KEY


def _routes(
    where: str, entries: Any, providers: Mapping[str, ProviderSpec], source: str
) -> tuple[Route, ...]:
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            f'{source}: {where} must be a non-empty list of "provider/model" or "provider"'
        )
    routes: list[Route] = []
    for index, entry in enumerate(entries):
        at = f"{where}[{index}]"
        if not isinstance(entry, str) or not entry.strip():
            raise ConfigError(f'{source}: {at} must be "provider/model", got {entry!r}')
        name, _, model = entry.strip().partition("/")
        spec = providers.get(name)
        if spec is None:
            raise ConfigError(
                f"{source}: {at} names provider {name!r}, which is not configured (configured: "
                f"{', '.join(providers)})"
            )
        if not model:
            model = next(iter(spec.models))
        elif model not in spec.models:
            raise ConfigError(
                f"{source}: {at}: provider {name!r} has no model {model!r} (its models: "
                f"{', '.join(spec.models)})"
            )
        route = Route(name, model)
        if route in routes:
            raise ConfigError(f"{source}: {at}: {route} is listed twice")
        routes.append(route)
    return tuple(routes)
