"""`python -m <service>` entry: reads config, sets up logging, runs the app until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from services.runtime.config import DEFAULT_EVENT_LOOP, ConfigError, ServerConfig, load_config
from services.runtime.logging import configure_logging
from services.runtime.server import ServiceHost
from services.runtime.tracing import configure_tracing
from services.runtime.workers import supervise

__all__ = ["App", "run_on_loop", "run_service"]

C = TypeVar("C", bound=ServerConfig)
T = TypeVar("T")


class App(Protocol):
    """What a service's `create_app` returns: its host and a way to release what it holds."""

    host: ServiceHost

    async def aclose(self) -> None: ...


def parse_config(
    name: str, config_cls: type[C], env_prefix: str, argv: list[str] | None = None
) -> C:
    """Reads `--config` (or `<PREFIX>CONFIG`) and the environment; exits 2 with a clear message."""
    parser = argparse.ArgumentParser(
        prog=name,
        description=f"Runs the {name} service. Settings come from a TOML file and "
        f"{env_prefix}<SETTING> environment variables.",
    )
    parser.add_argument("--config", default=os.environ.get(f"{env_prefix}CONFIG"), help="TOML file")
    args = parser.parse_args(argv)
    try:
        return load_config(config_cls, args.config, env_prefix=env_prefix)
    except ConfigError as exc:
        print(f"{name}: invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


async def _serve(create_app: Callable[[C], Awaitable[App]], config: C) -> None:
    app = await create_app(config)
    try:
        await app.host.start()
        await app.host.serve_until_signalled()
    finally:
        await app.host.stop()
        await app.aclose()


def run_on_loop(main: Coroutine[Any, Any, T], event_loop: str = DEFAULT_EVENT_LOOP) -> T:
    """Runs `main` to completion on a new loop of the kind named (`ServerConfig.event_loop`;
    the services' default unless told), and returns its result. The benches run their own
    processes (baselines, load generators) with it, on the loop the services run on."""
    if event_loop == "uvloop":
        import uvloop  # optional; config validation checked it is installed

        return uvloop.run(main)
    return asyncio.run(main)


def _run(name: str, create_app: Callable[[C], Awaitable[App]], config: C) -> int:
    """Runs one serving process to completion; returns its exit status."""
    # Here, in the serving process (a forked worker's own): the exporter's thread is its own.
    provider = configure_tracing(name, config.tracing_exporter, config.tracing_sample_ratio)
    try:
        run_on_loop(_serve(create_app, config), config.event_loop)
    except ConfigError as exc:  # found while assembling, e.g. conflicting module registrations
        print(f"{name}: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        logging.getLogger("system.server").error("%s", exc)
        return 1
    finally:
        if provider is not None:
            provider.shutdown()  # sends the spans still buffered
    return 0


def run_service(
    name: str,
    config_cls: type[C],
    env_prefix: str,
    create_app: Callable[[C], Awaitable[App]],
) -> None:
    """Runs one service to completion: in this process, or in `workers` forked ones."""
    config = parse_config(name, config_cls, env_prefix)
    configure_logging(name, config.log_level)
    if config.workers > 1:
        try:
            code = supervise(name, config, lambda worker: _run(name, create_app, worker))
        except OSError as exc:
            logging.getLogger("system.server").error("%s: %s", name, exc)
            code = 1
    else:
        code = _run(name, create_app, config)
    if code:
        raise SystemExit(code)
