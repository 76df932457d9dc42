"""Writes a larger-shot stand-in of a labelled routing set: the first N labelled cases of each
module become more of its examples, and the module's other cases and every out-of-scope case
stay cases.

    python scripts/more_shots.py --set ../shared/routing-dev/hwu64-10shot --move 20 --out /tmp/s30
    python -m router_service.eval --profiles /tmp/s30/profiles.json --cases /tmp/s30/cases.jsonl

A public 100-shot set (150 intents, 15,000 examples) is past what the router fits at once, and no
such set is in the repository; a 10-shot set with 30 test texts an intent, 20 of them moved,
measures the router with three times the examples (issue 17, round 13). With the eval's
`--fit-size` the catalogue is then fitted in chunks as a larger one would be. A case moves in the
language it is labelled in; a module's cases move in file order, whatever their split.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def more_shots(
    profiles: dict[str, Any], cases: list[dict[str, Any]], move: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The profile set with up to `move` cases of each module added to its examples, and the
    cases left. Raises ValueError for a case that names a module the set lacks."""
    modules = {module["id"]: module for module in profiles["modules"]}
    default_lang = profiles.get("language", "zh")
    moved: Counter[str] = Counter()
    left: list[dict[str, Any]] = []
    for number, case in enumerate(cases, start=1):
        expected = case.get("expected")
        if expected is None:
            left.append(case)
            continue
        if expected not in modules:
            raise ValueError(f"case {number} expects {expected!r}, which the profile set lacks")
        if moved[expected] >= move:
            left.append(case)
            continue
        moved[expected] += 1
        examples = modules[expected].setdefault("examples", {})
        examples.setdefault(case.get("lang", default_lang), []).append(case["text"])
    return profiles, left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/more_shots.py", description=__doc__)
    parser.add_argument(
        "--set", required=True, type=Path, help="folder of profiles.json, cases.jsonl"
    )
    parser.add_argument("--move", required=True, type=int, help="cases of each module to move")
    parser.add_argument("--out", required=True, type=Path, help="folder to write the stand-in to")
    args = parser.parse_args(argv)
    if args.move < 1:
        parser.error("--move must be 1 or more")
    try:
        profiles = json.loads((args.set / "profiles.json").read_text(encoding="utf-8"))
        with open(args.set / "cases.jsonl", encoding="utf-8") as lines:
            cases = [json.loads(line) for line in lines if line.strip()]
        profiles, left = more_shots(profiles, cases, args.move)
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profiles.json").write_text(
        json.dumps(profiles, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
    )
    with open(args.out / "cases.jsonl", "w", encoding="utf-8") as out:
        for case in left:
            out.write(json.dumps(case, ensure_ascii=False) + "\n")
    examples = sum(len(t) for m in profiles["modules"] for t in m.get("examples", {}).values())
    print(f"{args.out}: {len(profiles['modules'])} modules, {examples} examples, {len(left)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
