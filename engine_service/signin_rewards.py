"""The daily sign-in's reward catalogue (seed 004: "签到仍由模型现场选择奖励"): the entries a
sign-in may give, read from a JSON file instead of a table in code.

```json
{
  "rewards": [
    {
      "id": "bread",
      "name": {"zh": "面包补给", "en": "Bread supplies"},
      "items": [{"item": "minecraft:bread", "count": 8}]
    }
  ]
}
```

Each entry has an `id` (lower case letters, digits, `_` and `-`, at most 64, unique), a `name`
in Chinese and English (what the card shows) and 1 to 8 item stacks (`namespace:path` item ids,
1 to 64 each). The model picks one entry by its id; whatever it answers, the sign-in writes an
entry of this catalogue (`system:signin`). The engine ships `signin_rewards.json` beside this
file, used when the `signin_rewards_file` setting is empty. A bad file stops the engine at
start with a ConfigError naming the file, the entry (`rewards[2] (iron)`) and the field.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine_service.registry import IDENTIFIER
from engine_service.schema import LOCALIZED_NAME, violation
from engine_service.tools import SIGNIN_MAX_STACKS
from services.runtime.config import ConfigError, read_json_file

__all__ = [
    "DEFAULT_REWARDS_FILE",
    "SigninReward",
    "SigninRewards",
    "load_signin_rewards",
    "parse_signin_rewards",
]

DEFAULT_REWARDS_FILE = Path(__file__).with_name("signin_rewards.json")
"""The shipped catalogue, used when the `signin_rewards_file` setting is empty."""
MAX_REWARDS = 32
"""Most entries a catalogue holds (all of them go to the model in one call)."""
_REWARD_ID = re.compile(r"^[a-z0-9_-]{1,64}$")

_ENTRY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "name": {**LOCALIZED_NAME, "required": ["zh", "en"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": SIGNIN_MAX_STACKS,
            "items": {
                "type": "object",
                "properties": {
                    "item": {"type": "string", "maxLength": 128, "pattern": IDENTIFIER.pattern},
                    "count": {"type": "integer", "minimum": 1, "maximum": 64},
                    "name": LOCALIZED_NAME,
                },
                "required": ["item", "count"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "name", "items"],
    "additionalProperties": False,
}


@dataclasses.dataclass(frozen=True)
class SigninReward:
    """One entry of the catalogue."""

    reward_id: str
    """The entry's id: what the model answers and the calendar records."""
    name: dict[str, str]
    """The entry's name per language (zh, en)."""
    items: tuple[tuple[str, int], ...]
    """(item id, count) stacks, in order."""
    item_names: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    """The stacks' item names per language, by item id, where the entry gives them: what the
    sign-in card shows (the id otherwise)."""

    def stacks(self) -> list[dict[str, Any]]:
        """The items as `minecraft:signin.claim` takes them."""
        return [{"item": item, "count": count} for item, count in self.items]

    def choice(self) -> dict[str, Any]:
        """The entry as the model sees it."""
        return {"id": self.reward_id, "name": dict(self.name), "items": self.stacks()}


@dataclasses.dataclass(frozen=True)
class SigninRewards:
    """A checked catalogue, as read from `source`."""

    source: str
    rewards: tuple[SigninReward, ...]
    """At least one entry, in file order."""

    def get(self, reward_id: str) -> SigninReward | None:
        return next((r for r in self.rewards if r.reward_id == reward_id), None)


def parse_signin_rewards(data: Any, source: str = "signin_rewards.json") -> SigninRewards:
    """Checks the decoded JSON document and builds the catalogue.

    Raises:
        ConfigError: naming `source`, the entry (`rewards[i] (<id>)`) and the field.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the document must be a JSON object with rewards")
    unknown = sorted(set(data) - {"rewards"})
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; allowed: rewards")
    listed = data.get("rewards")
    if not isinstance(listed, list) or not listed:
        raise ConfigError(f"{source}: rewards is required (a non-empty list of reward entries)")
    if len(listed) > MAX_REWARDS:
        raise ConfigError(f"{source}: rewards holds {len(listed)} entries; at most {MAX_REWARDS}")
    rewards: list[SigninReward] = []
    first: dict[str, int] = {}
    for index, entry in enumerate(listed):
        where = f"{source}: rewards[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be a JSON object (id, name, items)")
        reward_id = entry.get("id")
        if not isinstance(reward_id, str) or not _REWARD_ID.match(reward_id):
            raise ConfigError(
                f"{where}: id must be 1 to 64 lower-case letters, digits, _ or -, "
                f"got {json.dumps(reward_id, ensure_ascii=False)}"
            )
        where = f"{where} ({reward_id})"
        if reward_id in first:
            raise ConfigError(
                f"{where}: id {reward_id} is already used by rewards[{first[reward_id]}]"
            )
        first[reward_id] = index
        found = violation(_ENTRY_SCHEMA, entry)
        if found is not None:
            field = found.path or "the entry"
            raise ConfigError(f"{where}: {field} {found.expected}")
        rewards.append(
            SigninReward(
                reward_id=reward_id,
                name={"zh": entry["name"]["zh"], "en": entry["name"]["en"]},
                items=tuple((s["item"], int(s["count"])) for s in entry["items"]),
                item_names={s["item"]: dict(s["name"]) for s in entry["items"] if s.get("name")},
            )
        )
    return SigninRewards(source=source, rewards=tuple(rewards))


def load_signin_rewards(path: str | Path = "") -> SigninRewards:
    """Reads and checks the catalogue at `path` (empty: the shipped one).

    Raises:
        ConfigError: the file is missing, unreadable or not JSON, or an entry is refused.
    """
    file = Path(path) if path else DEFAULT_REWARDS_FILE
    document = read_json_file(file, "sign-in reward file (setting signin_rewards_file)")
    return parse_signin_rewards(document, str(file))
