"""Web search providers. One interface, one real implementation: SearXNG's JSON API.

SearXNG (https://docs.searxng.org) is a self-hostable metasearch engine; its JSON answer must
be enabled in its settings (`search: formats: [html, json]`). It is the operator's own
service, often on a private address in the cluster, so its URL is trusted configuration and
is not subject to the public-address rule that fetches follow.

Failure mapping:

    timeout                               DeadlineExceeded
    connection refused, reset, DNS        Unavailable
    HTTP 429                              ResourceExhausted
    HTTP 403 (JSON format not enabled)    Unavailable, saying how to enable it
    any other non-200, unreadable JSON    Unavailable
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from typing import Any, Protocol

import httpx2

from services.runtime.errors import DeadlineExceeded, ResourceExhausted, Unavailable

__all__ = ["SearchHit", "SearchProvider", "SearxngProvider"]

MAX_TITLE = 300
MAX_SNIPPET = 1000


@dataclasses.dataclass(frozen=True)
class SearchHit:
    """One search result."""

    url: str
    title: str
    snippet: str


class SearchProvider(Protocol):
    """Runs a web search."""

    async def search(
        self, query: str, *, max_results: int, language: str, timeout: float
    ) -> list[SearchHit]:
        """Hits, best first, at most `max_results`, only http(s) URLs, no duplicates."""
        ...

    async def aclose(self) -> None: ...


class SearxngProvider:
    """SearXNG's `GET /search?q=...&format=json`.

    Args:
        base_url: the instance's root, for example `http://searxng:8080`.
    """

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        # trust_env=False: no proxy from the environment; the instance is reached directly.
        self._client = httpx2.AsyncClient(trust_env=False, follow_redirects=False)

    async def search(
        self, query: str, *, max_results: int, language: str, timeout: float
    ) -> list[SearchHit]:
        params = {"q": query, "format": "json", "pageno": "1"}
        if language:
            params["language"] = language
        try:
            response = await self._client.get(
                f"{self.base_url}/search", params=params, timeout=timeout
            )
        except httpx2.TimeoutException:
            raise DeadlineExceeded(
                f"the search provider did not answer within {timeout:.1f} s"
            ) from None
        except httpx2.HTTPError as exc:
            raise Unavailable(
                f"cannot reach the search provider at {self.base_url}: {type(exc).__name__}"
            ) from None
        if response.status_code == 429:
            raise ResourceExhausted("the search provider rate-limited the search; retry later")
        if response.status_code == 403:
            raise Unavailable(
                "the search provider refused the JSON format (HTTP 403); enable it in SearXNG's "
                "settings.yml: search: formats: [html, json]"
            )
        if response.status_code != 200:
            raise Unavailable(f"the search provider answered HTTP {response.status_code}")
        try:
            payload = response.json()
        except ValueError:
            raise Unavailable("the search provider's answer is not JSON") from None
        return _hits(payload, max_results)

    async def aclose(self) -> None:
        await self._client.aclose()


def _hits(payload: Any, max_results: int) -> list[SearchHit]:
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, list):
        raise Unavailable("the search provider's answer has no results list")
    hits: list[SearchHit] = []
    seen: set[str] = set()
    for item in results:
        if len(hits) >= max_results:
            break
        if not isinstance(item, dict) or not isinstance(item.get("url"), str):
            continue
        url = item["url"].strip()
        if urllib.parse.urlsplit(url).scheme not in ("http", "https") or url in seen:
            continue
        seen.add(url)
        title = item.get("title")
        title = title if isinstance(title, str) else ""
        snippet = item.get("content")
        snippet = snippet if isinstance(snippet, str) else ""
        hits.append(
            SearchHit(url, " ".join(title.split())[:MAX_TITLE], snippet.strip()[:MAX_SNIPPET])
        )
    return hits
