"""Fetching one page safely: public addresses only, redirects checked one by one, capped.

For every hop (the URL, then each redirect target): the host is resolved and every address
it resolves to must be public (see addresses); the request then goes to that checked address
itself, with the original name in the Host header and for TLS (SNI and certificate check),
so a later, different DNS answer cannot redirect it. Redirects are followed by hand, at most
`max_redirects`. The body is read up to `max_bytes` and the whole fetch, redirects included,
must end within `timeout` seconds. HTML is reduced to text; other text types pass as they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import urllib.parse

import httpx2

from services.model_gateway.web.addresses import IPAddress, resolve_public
from services.model_gateway.web.text import html_to_text, tidy
from services.runtime.errors import DeadlineExceeded, InvalidArgument, Unavailable

__all__ = ["FetchedPage", "SafeFetcher", "check_url"]

MAX_URL = 2048
REDIRECTS = frozenset({301, 302, 303, 307, 308})
HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
TEXT_TYPES = frozenset({"application/json", "application/xml", "application/rss+xml"})
_META_CHARSET = re.compile(rb"""<meta[^>]+charset=["']?([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
USER_AGENT = "system-assistant-model-gateway/1 (+fetches pages a web search returned)"


@dataclasses.dataclass(frozen=True)
class FetchedPage:
    """A page reduced to text."""

    url: str
    """Where the text came from, after redirects."""
    title: str
    text: str
    truncated: bool
    content_type: str


def check_url(url: str) -> urllib.parse.SplitResult:
    """Raises InvalidArgument unless `url` is an absolute http(s) URL without credentials."""
    if len(url) > MAX_URL:
        raise InvalidArgument(f"url is longer than {MAX_URL} characters")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"url must be an absolute http:// or https:// URL, got {url[:200]!r}")
    if parts.username is not None or parts.password is not None:
        raise InvalidArgument("url must not carry a user name or password")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        raise InvalidArgument(f"url has an invalid port: {url[:200]!r}") from None
    return parts


class SafeFetcher:
    """Args:
    max_bytes: most bytes of a body read.
    max_redirects: redirects followed.
    allow_loopback: let loopback addresses through (tests against a local server only).
    """

    def __init__(self, *, max_bytes: int, max_redirects: int, allow_loopback: bool) -> None:
        self._max_bytes = max_bytes
        self._max_redirects = max_redirects
        self._allow_loopback = allow_loopback
        # No proxy from the environment (it would resolve names itself), no automatic
        # redirects (each target must be checked), no cookies kept between fetches.
        self._client = httpx2.AsyncClient(trust_env=False, follow_redirects=False)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def fetch(self, url: str, *, timeout: float, max_chars: int) -> FetchedPage:
        """Fetches `url` and reduces it to at most `max_chars` characters of text.

        Raises:
            InvalidArgument: a URL (or redirect target) that is not http(s).
            PermissionDenied: the URL or a redirect resolves to a non-public address.
            DeadlineExceeded: the fetch did not end within `timeout`.
            Unavailable: the site is unreachable, answered an error, redirected too often,
                or sent something that is not text.
        """
        try:
            async with asyncio.timeout(timeout):
                return await self._follow(url, max_chars)
        except TimeoutError:
            raise DeadlineExceeded(f"{_short(url)} did not arrive within {timeout:.1f} s") from None

    async def _follow(self, url: str, max_chars: int) -> FetchedPage:
        for _ in range(self._max_redirects + 1):
            parts = check_url(url)
            host = parts.hostname or ""
            port = parts.port or (443 if parts.scheme == "https" else 80)
            address = await resolve_public(host, port, allow_loopback=self._allow_loopback)
            request = self._client.build_request(
                "GET",
                _pinned(parts, address, port),
                headers={
                    "Host": parts.netloc,
                    "User-Agent": USER_AGENT,
                    "Accept": "text/html, text/plain;q=0.9, */*;q=0.1",
                    "Accept-Encoding": "identity",
                },
                extensions={"sni_hostname": host} if parts.scheme == "https" else {},
            )
            try:
                response = await self._client.send(request, stream=True)
            except httpx2.TimeoutException:
                raise DeadlineExceeded(f"{_short(url)} did not answer in time") from None
            except httpx2.HTTPError as exc:
                raise Unavailable(f"cannot fetch {_short(url)}: {type(exc).__name__}") from None
            try:
                if response.status_code in REDIRECTS and response.headers.get("location"):
                    url = urllib.parse.urljoin(url, response.headers["location"])
                    continue
                return await self._read(url, response, max_chars)
            finally:
                await response.aclose()
        raise Unavailable(f"{_short(url)}: more than {self._max_redirects} redirects")

    async def _read(self, url: str, response: httpx2.Response, max_chars: int) -> FetchedPage:
        if response.status_code != 200:
            raise Unavailable(f"{_short(url)} answered HTTP {response.status_code}")
        declared = response.headers.get("content-type", "")
        media = declared.split(";", 1)[0].strip().lower()
        if media not in HTML_TYPES and media not in TEXT_TYPES and not media.startswith("text/"):
            raise Unavailable(f"{_short(url)} is {media or 'of no declared type'}, not text")
        body, truncated = await self._body(response)
        decoded = body.decode(_charset(declared, body), errors="replace")
        if media in HTML_TYPES:
            title, text = html_to_text(decoded)
        else:
            title, text = "", tidy(decoded)
        if len(text) > max_chars:
            text, truncated = text[:max_chars], True
        return FetchedPage(url, title, text, truncated, media)

    async def _body(self, response: httpx2.Response) -> tuple[bytes, bool]:
        """Up to max_bytes of the body, and whether more was left."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            room = self._max_bytes - size
            if len(chunk) > room:
                chunks.append(chunk[:room])
                return b"".join(chunks), True
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks), False


def _pinned(parts: urllib.parse.SplitResult, address: IPAddress, port: int) -> str:
    """The URL with its host replaced by the checked address."""
    host = f"[{address}]" if address.version == 6 else str(address)
    return urllib.parse.urlunsplit(
        (parts.scheme, f"{host}:{port}", parts.path or "/", parts.query, "")
    )


def _charset(content_type: str, body: bytes) -> str:
    for param in content_type.split(";")[1:]:
        name, _, value = param.strip().partition("=")
        if name.lower() == "charset" and value:
            return _known(value.strip("\"' "))
    found = _META_CHARSET.search(body[:4096])
    return _known(found.group(1).decode("ascii")) if found else "utf-8"


def _known(charset: str) -> str:
    try:
        "".encode(charset)
    except LookupError:
        return "utf-8"
    return charset


def _short(url: str) -> str:
    return url if len(url) <= 200 else url[:197] + "..."
