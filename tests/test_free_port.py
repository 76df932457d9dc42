"""`free_port`: a port chosen now for a service that listens a little later must not be one an
outgoing connection can take meanwhile (a CI run lost a test to that: the router could not
listen on the port chosen for it)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from services.stack.launcher import free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if it were taken
    if not RANGE.exists():
        pytest.skip("no ephemeral range to stay out of on this system")
    lowest_ephemeral = int(RANGE.read_text().split()[0])
    assert all(port < lowest_ephemeral for port in ports)
