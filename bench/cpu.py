"""CPU time of processes on this machine (Linux /proc), for benchmarks that report what an
operation costs each process of the stack, not only how long it took: on a shared machine
the latter moves with the neighbours' load, the former much less."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cpu_seconds", "postgres_cpu_seconds", "tree_cpu_seconds"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and of every process below it so far (a service running `workers`
    forks them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += cpu_seconds(current)
        except OSError:  # it exited meanwhile
            continue
        todo.extend(children.get(current, []))
    return total


def postgres_cpu_seconds() -> float | None:
    """User + system CPU of every `postgres` process on this machine so far (None when there
    is none, e.g. a remote server): what the database spends is part of what a write costs
    on a machine that runs it beside the service."""
    total, found = 0.0, False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "postgres":
                continue
            total += cpu_seconds(int(entry.name))
            found = True
        except OSError:  # it exited meanwhile
            continue
    return total if found else None
