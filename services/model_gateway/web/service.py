"""WebSearch and WebFetch: validation, metering, the search-session rule, metrics.

Domain code: no gRPC. A search is metered as one web search for the player (reserved against
the daily budgets before the provider is asked, recorded when it answered, released when it
failed); the URLs it returned become fetchable in its (player, search session). A fetch is
refused unless its URL is one of those.
"""

from __future__ import annotations

import logging
import re
import time

from prometheus_client import Counter

from services.model_gateway.chat import check_player_id
from services.model_gateway.config import MAX_SEARCH_RESULTS, ModelConfig
from services.model_gateway.metering import Meter, Used
from services.model_gateway.web.fetch import FetchedPage, SafeFetcher, check_url
from services.model_gateway.web.search import SearchHit, SearchProvider
from services.model_gateway.web.sessions import SearchSessions
from services.runtime.context import remaining_seconds
from services.runtime.errors import (
    DeadlineExceeded,
    InvalidArgument,
    PermissionDenied,
    ServiceError,
    Unavailable,
)

__all__ = ["WEB_CALLS", "WebTools"]

log = logging.getLogger("system.model")

WEB_CALLS = Counter(
    "web_calls",
    "WebSearch and WebFetch calls by kind (search, fetch) and outcome (the status code name "
    "in lower case, or ok).",
    ["kind", "outcome"],
)

MAX_QUERY = 400
LANGUAGE = re.compile(r"^[A-Za-z]{2,3}([-_][A-Za-z0-9]{2,8})?$")
MAX_SESSION_ID = 128
MIN_CALL_SECONDS = 0.05

NO_SEARCH_MESSAGE = (
    "no web search provider is configured: set SYSTEM_MODEL_SEARCH_URL to a SearXNG instance "
    "with its JSON format enabled; until then callers answer from local knowledge only"
)


def _check_session(session: str) -> None:
    if not session:
        raise InvalidArgument(
            "search_session is required: an id of your choosing (for example the execution "
            "id) that ties fetches to the search that returned their URLs"
        )
    if len(session) > MAX_SESSION_ID or not session.isprintable():
        raise InvalidArgument(
            f"search_session must be at most {MAX_SESSION_ID} printable characters"
        )


def _check_search(
    player_id: str, session: str, query: str, max_results: int, language: str
) -> None:
    check_player_id(player_id, required=True)
    _check_session(session)
    if not query:
        raise InvalidArgument("query is empty")
    if len(query) > MAX_QUERY:
        raise InvalidArgument(f"query is {len(query)} characters; the most is {MAX_QUERY}")
    if max_results > MAX_SEARCH_RESULTS:
        raise InvalidArgument(
            f"max_results must be at most {MAX_SEARCH_RESULTS}, got {max_results}"
        )
    if language and not LANGUAGE.match(language):
        raise InvalidArgument(
            f"language must be a language code such as zh, en or zh-CN, got {language!r}"
        )


class WebTools:
    """Args:
    config: the gateway's settings.
    meter: reserves and settles web searches.
    provider: the search provider; None when none is configured.
    fetcher: fetches pages.
    sessions: the URLs each search session may fetch.
    """

    def __init__(
        self,
        config: ModelConfig,
        meter: Meter,
        provider: SearchProvider | None,
        fetcher: SafeFetcher,
        sessions: SearchSessions,
    ) -> None:
        self._config = config
        self._meter = meter
        self._provider = provider
        self._fetcher = fetcher
        self._sessions = sessions

    @property
    def search_configured(self) -> bool:
        return self._provider is not None

    async def aclose(self) -> None:
        if self._provider is not None:
            await self._provider.aclose()
        await self._fetcher.aclose()

    async def search(
        self, player_id: str, session: str, query: str, max_results: int = 0, language: str = ""
    ) -> list[SearchHit]:
        """Searches and remembers the URLs for the session. See ModelGatewayService.WebSearch
        in model.proto for the errors."""
        with _counted("search", player_id):
            query = query.strip()
            _check_search(player_id, session, query, max_results, language)
            if self._provider is None:
                raise Unavailable(NO_SEARCH_MESSAGE)
            timeout = _time_left(self._config.search_timeout_seconds)
            hold = await self._meter.reserve(player_id, web_searches=1, hold_seconds=timeout)
            hits: list[SearchHit] | None = None
            try:
                hits = await self._provider.search(
                    query,
                    max_results=max_results or self._config.search_default_results,
                    language=language,
                    timeout=_time_left(self._config.search_timeout_seconds),
                )
            finally:
                # A search that failed is released, not counted.
                used = Used(web_searches=1) if hits is not None else Used()
                self._meter.settle_later(hold, used)
            self._sessions.remember(player_id, session, (hit.url for hit in hits))
            return hits

    async def fetch(
        self, player_id: str, session: str, url: str, max_chars: int = 0
    ) -> FetchedPage:
        """Fetches a URL a search in this session returned. See ModelGatewayService.WebFetch
        in model.proto for the errors."""
        with _counted("fetch", player_id):
            check_player_id(player_id, required=True)
            _check_session(session)
            if not url:
                raise InvalidArgument("url is required: one a WebSearch in this session returned")
            check_url(url)
            if not self._sessions.allows(player_id, session, url):
                raise PermissionDenied(
                    f"{url[:200]} was not returned by a search in search session {session!r} "
                    f"of this player (or the session expired after "
                    f"{self._config.search_session_ttl_seconds:g} s); only URLs a search "
                    "returned may be fetched"
                )
            limit = min(max_chars or self._config.fetch_max_chars, self._config.fetch_max_chars)
            return await self._fetcher.fetch(
                url, timeout=_time_left(self._config.fetch_timeout_seconds), max_chars=limit
            )


def _time_left(configured: float) -> float:
    left = remaining_seconds(configured)
    assert left is not None  # a default was given
    if left <= MIN_CALL_SECONDS:
        raise DeadlineExceeded("the caller's deadline passed before the web was asked")
    return left


class _counted:
    """Counts one call by outcome and logs it."""

    def __init__(self, kind: str, player_id: str) -> None:
        self._kind = kind
        self._player_id = player_id
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, _tb: object
    ) -> None:
        if exc is None:
            outcome = "ok"
        elif isinstance(exc, ServiceError):
            outcome = exc.code.lower()
        else:
            outcome = "error"
        WEB_CALLS.labels(self._kind, outcome).inc()
        log.info(
            "web %s %s",
            self._kind,
            outcome,
            extra={
                "player_id": self._player_id,
                "outcome": outcome,
                "ms": round((time.perf_counter() - self._started) * 1000, 3),
            },
        )
