"""Prometheus metrics shared by every service: RPCs handled, by method and status code, and
their latency. Services add their own gauges next to these."""

from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

__all__ = ["RPC_HANDLED", "RPC_LATENCY", "start_metrics_server"]

RPC_HANDLED = Counter(
    "grpc_server_handled_total",
    "RPCs completed on the server, by method and status code.",
    ["grpc_service", "grpc_method", "grpc_code"],
)
RPC_LATENCY = Histogram(
    "grpc_server_handling_seconds",
    "Time from an RPC's start to its end on the server.",
    ["grpc_service", "grpc_method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


def start_metrics_server(host: str, port: int) -> tuple[object, int]:
    """Serves /metrics over HTTP on a daemon thread; returns the server and the bound port."""
    server, _thread = start_http_server(port, addr=host)
    return server, server.server_port
