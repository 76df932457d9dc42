"""The URLs each search session may fetch: only what a search in that session returned.

Kept in memory, per (player, search session), with a time to live and a bound on the number
of sessions (least recently used forgotten first) and of URLs per session. With several
gateway replicas a fetch must reach the replica that ran the search; on another one it is
refused (PERMISSION_DENIED), which is the safe way to be wrong.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable

__all__ = ["SearchSessions"]

MAX_URLS_PER_SESSION = 200


class SearchSessions:
    """Args:
    ttl_seconds: how long a session's URLs stay fetchable after its last search.
    max_sessions: sessions kept at once.
    clock: monotonic seconds (a parameter so tests can move time).
    """

    def __init__(
        self,
        ttl_seconds: float,
        max_sessions: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl = ttl_seconds
        self._max = max_sessions
        self._clock = clock
        # (player, session) -> (expires at, URLs in the order returned)
        self._sessions: collections.OrderedDict[tuple[str, str], tuple[float, dict[str, None]]] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._sessions)

    def remember(self, player_id: str, session: str, urls: Iterable[str]) -> None:
        """Adds `urls` to the session and renews its time to live."""
        key = (player_id, session)
        now = self._clock()
        known = self._live(key, now) or {}
        for url in urls:
            known[url] = None
        while len(known) > MAX_URLS_PER_SESSION:
            del known[next(iter(known))]  # the oldest results go first
        self._sessions[key] = (now + self._ttl, known)
        self._sessions.move_to_end(key)
        while len(self._sessions) > self._max:
            self._sessions.popitem(last=False)

    def allows(self, player_id: str, session: str, url: str) -> bool:
        """True when a search in this session returned exactly `url` and has not expired."""
        known = self._live((player_id, session), self._clock())
        return known is not None and url in known

    def _live(self, key: tuple[str, str], now: float) -> dict[str, None] | None:
        entry = self._sessions.get(key)
        if entry is None:
            return None
        if entry[0] <= now:
            del self._sessions[key]
            return None
        return entry[1]
