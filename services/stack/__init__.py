"""Runs the whole stack on one machine: the five services as separate processes on loopback,
with embedded SQLite under a data folder. Used by `make run`, the end-to-end tests and the
benchmarks."""

from services.stack.launcher import SERVICES, ServiceProcess, Stack, StackError

__all__ = ["SERVICES", "ServiceProcess", "Stack", "StackError"]
