"""The web half of the test server: a SearXNG-compatible search and pages to fetch.

    GET /search?q=...&format=json   SearXNG's JSON answer (`{"query", "results": [...]}`)
    GET /pages/<path>               a page added with `add_page` (or a redirect to elsewhere)

Thread-safe data only; the server's handler threads read it. Searches take the next scripted
answer; with none queued they return `default_results` hits, each a page on this server
(`/pages/result-<n>`) that is made on the fly, so a search followed by a fetch works without
scripting anything.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence

__all__ = ["Page", "ScriptedSearch", "WebScript"]


@dataclasses.dataclass(frozen=True)
class Page:
    """What `GET /pages/<path>` answers."""

    body: bytes = b""
    content_type: str = "text/html; charset=utf-8"
    status: int = 200
    location: str | None = None
    """Redirect target (sent as `Location`) for a 3xx status."""
    delay: float = 0.0
    """Seconds to wait before answering (cut short when the server stops)."""
    chunk_delay: float = 0.0
    """Seconds between 1 KiB pieces of the body, for a slow page."""
    declare_length: bool = True
    """Send Content-Length; False streams the body with no length (closing the connection)."""


@dataclasses.dataclass(frozen=True)
class ScriptedSearch:
    """What the next `GET /search` answers."""

    results: Sequence[dict[str, str]] | None = None
    """Hits as SearXNG sends them (`url`, `title`, `content`); None: the default hits."""
    status: int = 200
    """HTTP status; anything but 200 sends a plain error page."""
    delay: float = 0.0
    """Seconds to wait before answering."""


class WebScript:
    """Scripted searches and pages of one test server."""

    def __init__(self, default_results: int = 3) -> None:
        self.default_results = default_results
        self._lock = threading.Lock()
        self._searches: collections.deque[ScriptedSearch] = collections.deque()
        self._pages: dict[str, Page] = {}

    def script_search(self, search: ScriptedSearch) -> None:
        with self._lock:
            self._searches.append(search)

    def next_search(self) -> ScriptedSearch:
        with self._lock:
            return self._searches.popleft() if self._searches else ScriptedSearch()

    def add_page(self, path: str, page: Page) -> None:
        with self._lock:
            self._pages[path.lstrip("/")] = page

    def page(self, path: str) -> Page | None:
        path = path.lstrip("/")
        with self._lock:
            page = self._pages.get(path)
        if page is None and path.startswith("result-"):
            title = f"Result page {path.removeprefix('result-')}"
            body = f"<html><head><title>{title}</title></head><body><p>{title}.</p></body></html>"
            return Page(body=body.encode())
        return page

    def clear(self) -> None:
        with self._lock:
            self._searches.clear()
            self._pages.clear()

    def default_hits(self, base_url: str, query: str) -> list[dict[str, str]]:
        return [
            {
                "url": f"{base_url}/pages/result-{n}",
                "title": f"Result {n} for {query}",
                "content": f"Snippet {n} about {query}.",
                "engine": "fake",
            }
            for n in range(1, self.default_results + 1)
        ]
