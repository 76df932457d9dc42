"""`python -m services.model_testserver [--host H] [--port P] [--api-key K] [--model M ...]
[--router-demo] [--fail-every N --fail-status S | --fail-drop | --fail-delay SECONDS]`.

Runs the fake OpenAI server until SIGINT or SIGTERM. With no script queued every completion
answers `echo: <last user message>`; with `--router-demo` the router's routing requests get a
keyword-matched capability or `clarify` (see `router_demo_reply`). Point the model gateway at it with
`SYSTEM_MODEL_BASE_URL=http://127.0.0.1:<port>/v1 SYSTEM_MODEL_API_KEY=<key>`. With
`--fail-every N` every N-th completion fails (HTTP `--fail-status`, 500 by default, or a
dropped connection with `--fail-drop`, or a stall of `--fail-delay` seconds before the first
token): a flaky or stalling provider for benchmarks of the fallback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from services.model_testserver.server import FakeOpenAIServer, router_demo_reply


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m services.model_testserver",
        description="Local OpenAI-compatible server with deterministic echo replies.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8089, help="port; 0 picks a free one")
    parser.add_argument("--api-key", default="test-key", help="bearer key clients must send")
    parser.add_argument(
        "--model", action="append", dest="models", help="model listed by /v1/models (repeatable)"
    )
    parser.add_argument(
        "--router-demo",
        action="store_true",
        help="answer the router's routing requests by keyword (else clarify) instead of echoing",
    )
    parser.add_argument(
        "--fail-every", type=int, default=0, help="every N-th completion fails (0: none)"
    )
    parser.add_argument(
        "--fail-status", type=int, default=500, help="HTTP status of the failing completions"
    )
    parser.add_argument(
        "--fail-drop", action="store_true", help="failing completions drop the connection"
    )
    parser.add_argument(
        "--fail-delay",
        type=float,
        default=0.0,
        help="failing completions stall this many seconds before their first token, then "
        "answer normally (instead of --fail-status)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    server = FakeOpenAIServer(
        args.api_key,
        host=args.host,
        port=args.port,
        models=args.models or ("deepseek-chat",),
        responder=router_demo_reply if args.router_demo else None,
    )
    if args.fail_every:
        fault: dict[str, Any] = (
            {"drop": True}
            if args.fail_drop
            else {"delay": args.fail_delay}
            if args.fail_delay
            else {"status": args.fail_status}
        )
        server.fault(args.fail_every, **fault)
    try:
        server.start()
    except OSError as exc:
        print(f"model_testserver: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
