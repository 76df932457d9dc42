"""`make run` (`python -m services.stack`) as a child process on free ports, for tests of what
a person sees: its stdout (the cards), stderr (the launcher's lines) and exit status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["make_run"]

ROOT = Path(__file__).resolve().parent.parent


def make_run(
    data_dir: Path, *args: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs the stack with `args` (`--say 帮助`, `--offline-model`) on `data_dir`, typing `input`
    at its prompt; the caller's `SYSTEM_*` settings are left out, so none leaks in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSTEM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "gen")])
    return subprocess.run(
        [sys.executable, "-m", "services.stack", "--free-ports", "--data", str(data_dir), *args],
        input=input,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
