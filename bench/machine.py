"""A description of the machine a benchmark ran on, recorded with its results."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

__all__ = ["describe_machine"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("MemTotal"):
                    return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return 0.0


def describe_machine() -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
    }
