"""Several server processes on one port: the supervisor behind the `workers` setting.

A Python server process spends most of a core per few thousand calls, and one process has
one interpreter lock; `workers = N` forks N replicas that bind the same gRPC port with
`SO_REUSEPORT`, so the kernel spreads connections over them and each uses its own core.

The supervisor (the process that was started):
1. reserves the port: a socket bound with `SO_REUSEPORT` but never listening, so port 0 picks
   one free port for every worker and nothing else can take it meanwhile;
2. forks the workers before any gRPC object or event loop exists (gRPC may not be forked
   once it runs); each one runs the service exactly as a single process would, with its own
   health service, drain and grace, and its own metrics endpoint (`metrics_port` + i, or a
   free port each when `metrics_port` is 0);
3. writes `port_file` once every worker serves: the shared `grpc_port`, worker 0's
   `metrics_port`, and each worker's pid and metrics port under `workers`;
4. forwards SIGTERM and SIGINT to every worker, so all of them drain together, and exits
   once they have. A worker that ends on its own stops the others and the supervisor exits 1:
   the orchestrator restarts the whole set, as it would a single process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from services.runtime.config import ServerConfig
from services.runtime.server import write_port_file

__all__ = ["reserve_port", "supervise", "worker_metrics_port"]

log = logging.getLogger("system.server")

C = TypeVar("C", bound=ServerConfig)
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_START_SECONDS = 120.0  # a worker builds its state (e.g. the router's index) before serving


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` with `SO_REUSEPORT` that never listens: it holds the
    port (a free one for port 0) for workers that bind it the same way.

    Raises:
        OSError: the address cannot be bound (in use without `SO_REUSEPORT`, bad host).
    """
    address = host.strip("[]")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def worker_metrics_port(metrics_port: int, index: int) -> int:
    """Worker `index`'s metrics port: off stays off, 0 stays 0 (any), else consecutive."""
    return metrics_port + index if metrics_port > 0 else metrics_port


def supervise(name: str, config: C, run_worker: Callable[[C], int]) -> int:
    """Runs `config.workers` forked copies of `run_worker` on one port; returns the exit
    status for this process (0 after a requested stop in which every worker exited 0)."""
    reserved = reserve_port(config.host, config.port)
    port = reserved.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix=f"{name}-workers-") as scratch:
        files = [Path(scratch, f"worker{i}.json") for i in range(config.workers)]
        # Lines still buffered here would be written once by every worker too.
        for handler in logging.getLogger().handlers:
            handler.flush()
        # Signals wait until the handlers below exist; a worker resets them before it runs.
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        children: dict[int, int] = {}  # pid -> worker index
        for index, file in enumerate(files):
            worker = dataclasses.replace(
                config,
                port=port,
                port_file=str(file),
                metrics_port=worker_metrics_port(config.metrics_port, index),
            )
            pid = os.fork()
            if pid == 0:  # the worker: never returns
                reserved.close()
                _run_child(run_worker, worker)
            children[pid] = index
        supervisor = _Supervisor(children)
        for sig in _SIGNALS:
            signal.signal(sig, supervisor.forward)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
        try:
            if supervisor.wait_serving(files):
                _write_port_file(config, port, files)
                log.info(
                    "%s: %d workers serving on %s:%d",
                    name,
                    len(children),
                    config.host,
                    port,
                    extra={"grpc_port": port, "workers": len(children)},
                )
            return supervisor.wait_all()
        finally:
            for sig in _SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            reserved.close()
            if config.port_file:
                Path(config.port_file).unlink(missing_ok=True)


def _run_child(run_worker: Callable[[C], int], config: C) -> None:
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    code = 1
    try:
        code = run_worker(config)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        log.exception("worker %d crashed", os.getpid())
    finally:
        logging.shutdown()  # flushes what the worker logged
        os._exit(code)


class _Supervisor:
    """The supervisor's view of its workers: who is alive, and whether a stop was asked."""

    def __init__(self, children: dict[int, int]) -> None:
        self.alive = dict(children)
        self.stopping = False
        self.failed = False

    def forward(self, signum: int, _frame: Any = None) -> None:
        """Signal handler: passes a stop on to every live worker."""
        self.stopping = True
        self._signal_all(signal.SIGTERM if signum == signal.SIGTERM else signum)

    def _signal_all(self, signum: int) -> None:
        for pid in list(self.alive):
            with contextlib.suppress(ProcessLookupError):  # it just ended: reaped next
                os.kill(pid, signum)

    def _reaped(self, pid: int, status: int) -> None:
        index = self.alive.pop(pid, None)
        if index is None:
            return
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or not self.stopping:
            self.failed = True
            if not self.stopping:
                log.error(
                    "worker %d (pid %d) exited with %d; stopping the others", index, pid, code
                )
                self.stopping = True
                self._signal_all(signal.SIGTERM)

    def wait_serving(self, files: list[Path]) -> bool:
        """Waits until every worker has written its port file; False if one ended first."""
        deadline = time.monotonic() + _START_SECONDS
        while not all(file.exists() for file in files):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid:
                self._reaped(pid, status)
            if self.stopping:
                return False
            if time.monotonic() > deadline:
                log.error("workers did not start within %.0f s; stopping them", _START_SECONDS)
                self.failed = self.stopping = True
                self._signal_all(signal.SIGTERM)
                return False
            time.sleep(0.05)
        return True

    def wait_all(self) -> int:
        """Reaps every worker; the exit status this process should end with."""
        while self.alive:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            self._reaped(pid, status)
        return 1 if self.failed else 0


def _write_port_file(config: ServerConfig, port: int, files: list[Path]) -> None:
    if not config.port_file:
        return
    workers = []
    for file in files:
        entry = json.loads(file.read_text())
        workers.append({"pid": entry["pid"], "metrics_port": entry["metrics_port"]})
    write_port_file(
        Path(config.port_file),
        {
            "grpc_port": port,
            "metrics_port": workers[0]["metrics_port"],
            "pid": os.getpid(),
            "workers": workers,
        },
    )
