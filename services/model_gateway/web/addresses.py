"""Which addresses a fetch may reach: public ones only.

Checked on the addresses a name resolves to, not on the name, so a public-looking name that
resolves to 10.0.0.5 is refused; and the connection is then made to the checked address
itself, so a second, different DNS answer cannot slip in between (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from services.runtime.errors import PermissionDenied, Unavailable

__all__ = ["IPAddress", "check_address", "resolve_public"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _kind(address: IPAddress) -> str | None:
    """Why `address` is not public, or None when it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return _kind(address.ipv4_mapped)
    if address.is_unspecified:
        return "not a public address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_private:
        return "a private address"
    if address.is_multicast:
        return "a multicast address"
    if address.is_reserved or not address.is_global:
        return "not a public address"
    return None


def check_address(address: IPAddress, host: str, *, allow_loopback: bool) -> None:
    """Raises PermissionDenied unless `address` (what `host` resolved to) is public."""
    kind = _kind(address)
    if kind is None:
        return
    if allow_loopback and kind == "a loopback address":
        return
    where = f"{host} is" if host.strip("[]") == str(address) else f"{host} resolves to {address},"
    raise PermissionDenied(f"{where} {kind}; only public addresses are fetched")


async def resolve_public(host: str, port: int, *, allow_loopback: bool) -> IPAddress:
    """The first address `host` resolves to, after checking that every one of them is public.

    Raises:
        PermissionDenied: any address is not public (one bad answer spoils the name).
        Unavailable: the name does not resolve.
    """
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        check_address(literal, host, allow_loopback=allow_loopback)
        return literal
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise Unavailable(f"cannot resolve {host}: {exc.strerror}") from None
    # An AF_INET or AF_INET6 address is a string (a scope id after "%" for link-local).
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    if not addresses:
        raise Unavailable(f"{host} resolves to no address")
    for address in addresses:
        check_address(address, host, allow_loopback=allow_loopback)
    return addresses[0]
