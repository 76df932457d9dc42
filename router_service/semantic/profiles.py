"""Routing profiles: one per module, as its registration declares it, and a JSON loader for
running the router without the other services."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from router_service.semantic.extractors import EXTRACTORS
from services.runtime.config import ConfigError

__all__ = ["EXTRACTOR_NAMES", "PROFILE_KINDS", "Profile", "load_profiles", "parse_profiles"]

PROFILE_KINDS = ("read", "hints", "reject")
EXTRACTOR_NAMES = tuple(EXTRACTORS)
_MODULE_ID = re.compile(r"^[a-z0-9_.-]+:[a-z0-9_./-]+$")
_LANGUAGE = re.compile(r"^[a-z]{2,3}(?:-[a-z0-9]{2,8})?$")

Kind = Literal["read", "hints", "reject"]


@dataclasses.dataclass(frozen=True)
class Profile:
    """How semantic routing may reach one module.

    Raises:
        ConfigError: from the constructor, for an invalid identifier, kind or extractor.
    """

    module_id: str
    """`namespace:path`."""
    kind: Kind
    """`read`: may route directly when every gate passes; `hints`: its examples only add
    candidates; `reject`: examples of requests that must not route (they take part in margins,
    never execute and are never offered as candidates)."""
    examples: Mapping[str, tuple[str, ...]]
    """Example texts by language code."""
    interactive: bool = True
    """Players' requests may run the module."""
    write_steps: int = 0
    """Write steps the module's policy allows; direct routes need 0."""
    read_only_tools: bool = True
    """Every tool the module declares is read-only."""
    explicit_only: bool = False
    """Offered to the model flagged `explicitOnly`; never routed locally or from the cache."""
    structured_only: bool = False
    """Reached only by commands and buttons."""
    extractor: str | None = None
    """Argument extractor run on the player's text (`EXTRACTOR_NAMES`: `item_id`, `list_index`,
    `name`, `item`, `price`), or None for a module that takes no arguments."""
    choice_label: str = ""
    """Label (a translation key) of the module on a local-fallback selection card."""
    direct: bool = True
    """The registration allows local direct routes at all (`direct=true` in the seed)."""
    shortcut: bool | None = None
    """The module's no-argument form may be offered as a read-only shortcut on a selection
    card; None means: when it has no extractor."""

    def __post_init__(self) -> None:
        if not _MODULE_ID.match(self.module_id):
            raise ConfigError(f"module id {self.module_id!r} is not `namespace:path`")
        if self.kind not in PROFILE_KINDS:
            raise ConfigError(
                f"{self.module_id}: kind must be one of {', '.join(PROFILE_KINDS)}, "
                f"got {self.kind!r}"
            )
        if self.extractor is not None and self.extractor not in EXTRACTOR_NAMES:
            raise ConfigError(
                f"{self.module_id}: extractor must be one of {', '.join(EXTRACTOR_NAMES)} or "
                f"null, got {self.extractor!r}"
            )
        if self.write_steps < 0:
            raise ConfigError(f"{self.module_id}: write_steps must not be negative")
        # Freeze the examples so a shared profile cannot change under an index.
        frozen = {lang: tuple(texts) for lang, texts in self.examples.items()}
        object.__setattr__(self, "examples", MappingProxyType(frozen))

    @property
    def read_only(self) -> bool:
        """Could run from a selection card: interactive, no writes, not structured-only, not
        explicit-only, and not a reject profile."""
        return (
            self.kind != "reject"
            and self.interactive
            and self.write_steps == 0
            and self.read_only_tools
            and not self.structured_only
            and not self.explicit_only
        )

    @property
    def is_shortcut(self) -> bool:
        """Offered, without arguments, as a read-only shortcut."""
        wanted = self.extractor is None if self.shortcut is None else self.shortcut
        return wanted and self.read_only

    @property
    def routes_directly(self) -> bool:
        """Every static gate for a direct route passes: a read profile declared direct,
        interactive, with zero write steps and only read-only tools."""
        return self.kind == "read" and self.direct and self.read_only


_KEYS = {
    "id": "module_id",
    "kind": "kind",
    "examples": "examples",
    "direct": "direct",
    "interactive": "interactive",
    "writeSteps": "write_steps",
    "readOnlyTools": "read_only_tools",
    "explicitOnly": "explicit_only",
    "structuredOnly": "structured_only",
    "extractor": "extractor",
    "choiceLabel": "choice_label",
    "shortcut": "shortcut",
}
_BOOLS = ("direct", "interactive", "readOnlyTools", "explicitOnly", "structuredOnly", "shortcut")


def parse_profiles(data: Any, source: str = "profiles") -> tuple[str, list[Profile]]:
    """Builds profiles from the standalone JSON form (see `load_profiles`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: must be a JSON object with `language` and `modules`")
    unknown = sorted(set(data) - {"language", "modules"})
    if unknown:
        raise ConfigError(
            f"{source}: unknown field(s) {', '.join(unknown)}; known: language, modules"
        )
    language = data.get("language")
    if not isinstance(language, str) or not _LANGUAGE.match(language):
        raise ConfigError(
            f"{source}: language must be a language code such as 'zh', got {language!r}"
        )
    modules = data.get("modules")
    if not isinstance(modules, list) or not modules:
        raise ConfigError(f"{source}: modules must be a non-empty list")
    profiles: list[Profile] = []
    seen: set[str] = set()
    for i, entry in enumerate(modules):
        where = f"{source}: modules[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be an object")
        unknown = sorted(set(entry) - set(_KEYS))
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}"
            )
        module_id = entry.get("id")
        if not isinstance(module_id, str):
            raise ConfigError(f"{where}: id must be a module identifier string `namespace:path`")
        where = f"{source}: module {module_id}"
        if module_id in seen:
            raise ConfigError(f"{where} is listed twice")
        seen.add(module_id)
        examples = entry.get("examples", {})
        # A plain list holds examples in the document's language.
        if isinstance(examples, list):
            examples = {language: examples}
        if not isinstance(examples, dict) or not all(
            isinstance(lang, str)
            and _LANGUAGE.match(lang)
            and isinstance(texts, list)
            and all(isinstance(t, str) and t.strip() for t in texts)
            for lang, texts in examples.items()
        ):
            raise ConfigError(
                f"{where}: examples must map language codes to lists of non-empty strings"
            )
        for key in _BOOLS:
            if key in entry and not isinstance(entry[key], bool):
                raise ConfigError(f"{where}: {key} must be true or false, got {entry[key]!r}")
        steps = entry.get("writeSteps", 0)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"{where}: writeSteps must be a non-negative integer, got {steps!r}")
        label = entry.get("choiceLabel", "")
        if not isinstance(label, str):
            raise ConfigError(f"{where}: choiceLabel must be a string, got {label!r}")
        fields = {_KEYS[k]: v for k, v in entry.items()}
        fields["examples"] = examples
        fields.setdefault("kind", "read")
        profiles.append(Profile(**fields))
    return language, profiles


def load_profiles(path: str | Path) -> tuple[str, list[Profile]]:
    """Reads a standalone profile set:

    ```json
    {"language": "zh",
     "modules": [{"id": "system:shop", "examples": {"zh": ["打开商店"], "en": ["open the shop"]},
                  "kind": "read", "direct": true, "extractor": null}]}
    ```

    `kind` defaults to `read` and `direct` to true: modules are read-only and direct unless
    flagged (`interactive`, `writeSteps`, `readOnlyTools`, `explicitOnly`, `structuredOnly`,
    `choiceLabel`, `shortcut` are accepted too). `examples` may be a plain list, meaning the document's
    `language`.

    Returns:
        The document's language and the profiles in file order.

    Raises:
        ConfigError: the file is missing or malformed; the message names the module and key.
    """
    file = Path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"profile file {file} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"profile file {file} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{file}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    return parse_profiles(data, str(file))
