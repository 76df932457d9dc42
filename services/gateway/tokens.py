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
import os
import time
from collections.abc import Iterable
from pathlib import Path

from services.runtime.config import ConfigError

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
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"tokens_file {path} cannot be read: {exc}") from None
    lines = (line.strip() for line in text.splitlines())
    return [
        entry.strip()
        for line in lines
        if line and not line.startswith("#")
        for entry in line.split(",")
        if entry.strip()
    ]


class TokenBook:
    """Which game server a token belongs to, kept current with `tokens_file`.

    Args:
        tokens: the `tokens` setting's entries.
        tokens_file: a file of more entries, read again when it changes; "" for none.
    """

    def __init__(self, tokens: Iterable[str], tokens_file: str = "") -> None:
        self._fixed = tuple(tokens)
        self._file = tokens_file
        self._stamp = self._mtime()
        self._book = self._build(self._file_entries())
        self.servers = frozenset(self._book.values())
        """The game servers known at start: a reload may change their tokens, not add any."""
        self._checked = time.monotonic()
        self.reloads = 0
        """Times a changed file was taken."""

    def server_of(self, token: str) -> str:
        """The server id `token` belongs to, or "" (compared in constant time)."""
        self._maybe_reload()
        owner = ""
        for known, server_id in self._book.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                owner = server_id
        return owner

    def _file_entries(self) -> list[str]:
        return read_tokens_file(self._file) if self._file else []

    def _build(self, entries: list[str]) -> dict[str, str]:
        return merged_book(self._fixed, entries)

    def _mtime(self) -> int:
        if not self._file:
            return 0
        try:
            return os.stat(self._file).st_mtime_ns
        except OSError:
            return -1

    def _maybe_reload(self) -> None:
        if not self._file or time.monotonic() - self._checked < RECHECK_SECONDS:
            return
        self._checked = time.monotonic()
        stamp = self._mtime()
        if stamp == self._stamp:
            return
        try:
            book = self._build(self._file_entries())
        except ConfigError as exc:
            log.warning("tokens_file changed but was not taken (the last one stays): %s", exc)
            return
        self._stamp = stamp
        added = sorted(set(book.values()) - self.servers)
        if added:
            log.warning(
                "tokens_file names game servers unknown at start (%s); they are admitted "
                "after a restart",
                ", ".join(added),
            )
        self._book = {token: server for token, server in book.items() if server in self.servers}
        self.reloads += 1
        log.info("game-server tokens reloaded from %s", self._file)
