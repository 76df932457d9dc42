"""Writes the game-tool catalogue for plugin authors, or checks that it is current.

    python scripts/gen_tool_catalog.py           # (re)write docs/game-tools.md and .json
    python scripts/gen_tool_catalog.py --check   # exit 1, naming the files, when they are stale

The catalogue comes from the engine's frozen registry with the built-in modules only (no
entry-point modules: what a deployment installs on top is served by the engine's
GetGameToolCatalog, not documented here). tests/test_tool_catalog.py runs the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKDOWN = ROOT / "docs" / "game-tools.md"
JSON = ROOT / "docs" / "game-tools.json"


def render() -> dict[Path, str]:
    """The files' contents as the registry generates them."""
    sys.path.insert(0, str(ROOT))
    from engine_service.modules import SMALL_TALK, register_builtins
    from engine_service.registry import ModuleRegistry
    from engine_service.tool_catalog import game_tool_catalog, to_json, to_markdown

    registry = ModuleRegistry()
    register_builtins(registry)
    registry.reject("system:small_talk", SMALL_TALK)
    registry.freeze()
    catalog = game_tool_catalog(registry)
    document = json.dumps(to_json(catalog), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return {MARKDOWN: to_markdown(catalog), JSON: document}


def stale() -> list[Path]:
    """Files whose committed content differs from what the registry generates."""
    return [
        path
        for path, text in render().items()
        if not path.exists() or path.read_text(encoding="utf-8") != text
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="only check the files are current")
    args = parser.parse_args()
    if args.check:
        differ = stale()
        if differ:
            print(
                "the game-tool catalogue is stale; run `python scripts/gen_tool_catalog.py`:",
                *(str(p.relative_to(ROOT)) for p in differ),
                sep="\n  ",
            )
            return 1
        print("docs/game-tools.md and docs/game-tools.json are current")
        return 0
    for path, text in render().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    print(f"wrote {MARKDOWN.relative_to(ROOT)} and {JSON.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
