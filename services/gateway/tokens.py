"""Game servers' tokens: the `tokens` setting and, when set, the `tokens_file` that a mounted
Secret rewrites on rotation, read again when it changes (no restart, no game server dropped).

A rotation changes tokens, not the set of game servers: the servers, their networks and their
players' scopes are fixed at start (decision 0012), so a server that first appears in a reloaded
file is left out with a warning until the gateway restarts, and a server whose line is removed
can no longer open new connections (those open go on: a token is checked when a stream opens).
A file that cannot be read or does not parse (half-written during a rotation) leaves the last
good book in force.

File format: `server_id=token` entries, one a line or comma-separated (as the `tokens` variable
holds them, so one Secret value serves both); blank lines and lines starting with `#` are
ignored.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable

from services.runtime.config import ConfigError
from services.runtime.security import read_entries_file
from services.runtime.watched_file import WatchedFile

__all__ = ["RECHECK_SECONDS", "TokenBook", "merged_book", "parse_tokens", "read_tokens_file"]

log = logging.getLogger("system.gateway.tokens")

RECHECK_SECONDS = 1.0
"""How often, at most, the file's modification time is looked at (on a new stream)."""
MIN_TOKEN_CHARS = 8


def parse_tokens(pairs: Iterable[str], source: str = "tokens") -> dict[str, str]:
    """Token → server id from `server_id=token` entries. Raises ConfigError naming the entry
    for a malformed, short or duplicate one."""
    book: dict[str, str] = {}
    servers: set[str] = set()
    for index, pair in enumerate(pairs):
        server_id, sep, token = pair.partition("=")
        server_id, token = server_id.strip(), token.strip()
        if not sep or not server_id or not token:
            raise ConfigError(f"{source}[{index}] must look like server_id=token")
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(
                f"{source}[{index}]: the token for {server_id} is shorter than "
                f"{MIN_TOKEN_CHARS} characters"
            )
        if token in book or server_id in servers:
            raise ConfigError(f"{source}[{index}]: server {server_id} or its token appears twice")
        book[token] = server_id
        servers.add(server_id)
    return book


def merged_book(tokens: Iterable[str], file_entries: Iterable[str]) -> dict[str, str]:
    """Token → server id of the `tokens` setting and the tokens file's lines together; a
    server or token in both is refused."""
    book = parse_tokens(tokens, "tokens")
    servers = set(book.values())
    for token, server_id in parse_tokens(file_entries, "tokens_file").items():
        if token in book or server_id in servers:
            raise ConfigError(f"tokens_file: server {server_id} or its token is also in tokens")
        book[token] = server_id
    return book


def read_tokens_file(path: str) -> list[str]:
    """The `server_id=token` entries of a tokens file (a line each, or comma-separated).
    Raises ConfigError when it cannot be read."""
    return read_entries_file(path, "tokens_file")


class TokenBook:
    """Which game server a token belongs to, kept current with `tokens_file`.

    Args:
        tokens: the `tokens` setting's entries.
        tokens_file: a file of more entries, read again when it changes; "" for none.
    """

    def __init__(self, tokens: Iterable[str], tokens_file: str = "") -> None:
        self._fixed = tuple(tokens)
        self._file = tokens_file
        self._book = self._build()
        self.servers = frozenset(self._book.values())
        """The game servers known at start: a reload may change their tokens, not add any."""
        self._watched = (
            WatchedFile(
                [tokens_file],
                self._admitted,
                what="tokens_file",
                recheck_seconds=RECHECK_SECONDS,
            )
            if tokens_file
            else None
        )

    @property
    def reloads(self) -> int:
        """Times a changed file was taken."""
        return self._watched.reloads if self._watched is not None else 0

    def server_of(self, token: str) -> str:
        """The server id `token` belongs to, or "" (compared in constant time)."""
        book = self._watched.current() if self._watched is not None else self._book
        owner = ""
        for known, server_id in book.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                owner = server_id
        return owner

    def _build(self) -> dict[str, str]:
        entries = read_tokens_file(self._file) if self._file else []
        return merged_book(self._fixed, entries)

    def _admitted(self) -> dict[str, str]:
        """The merged book, less servers unknown at start (named in a warning)."""
        book = self._build()
        added = sorted(set(book.values()) - self.servers)
        if added:
            log.warning(
                "tokens_file names game servers unknown at start (%s); they are admitted "
                "after a restart",
                ", ".join(added),
            )
        return {token: server for token, server in book.items() if server in self.servers}
