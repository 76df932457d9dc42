"""Web search and fetch for the model gateway: a search provider interface with a SearXNG
implementation, per-session lists of the URLs a search returned, a fetcher that refuses
non-public addresses (after DNS resolution and on every redirect), and HTML reduced to text."""

from services.model_gateway.web.fetch import FetchedPage, SafeFetcher
from services.model_gateway.web.search import SearchHit, SearchProvider, SearxngProvider
from services.model_gateway.web.service import WebTools
from services.model_gateway.web.sessions import SearchSessions

__all__ = [
    "FetchedPage",
    "SafeFetcher",
    "SearchHit",
    "SearchProvider",
    "SearchSessions",
    "SearxngProvider",
    "WebTools",
]
