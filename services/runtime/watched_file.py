"""A value read from mounted files and read again when they change: how a rotated Secret
(tokens, certificates) is taken without a restart.

Kubernetes rewrites a mounted Secret by swapping a symlink to a new folder, so a changed file
shows as a new modification time, size or inode behind the same path. `WatchedFile` keeps the
stamp of the files it last read and the value it made from them; on use, at most every
`recheck_seconds`, it compares the stamp with the files' (a `stat` each, never a read) and only
when they differ reads and parses them again. A read or parse that fails (a file half-written
during a rotation, a malformed one, a missing one) keeps the last good value and logs a
warning; the stamp is left as it was, so the next check tries again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from services.runtime.config import ConfigError

__all__ = ["RECHECK_SECONDS", "WatchedFile", "file_stamp"]

log = logging.getLogger("system.watched_file")

T = TypeVar("T")

RECHECK_SECONDS = 2.0
"""How often, at most, a watched file's stamp is looked at on use."""

Stamp = tuple[tuple[int, int, int], ...]


def file_stamp(paths: Sequence[str]) -> Stamp:
    """(modification time, size, inode) of each file; (-1, -1, -1) for one that cannot be
    looked at."""
    stamps = []
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            stamps.append((-1, -1, -1))
        else:
            stamps.append((info.st_mtime_ns, info.st_size, info.st_ino))
    return tuple(stamps)


class WatchedFile(Generic[T]):
    """The value `load` makes from `paths`, made again when any of them changes.

    Args:
        paths: the files `load` reads (empty strings are left out).
        load: reads and parses them; raises ConfigError (or OSError) when it cannot.
        what: names the files in log lines (the setting: `caller_tokens_file`).
        recheck_seconds: how often, at most, `current` looks at the files' stamps (None:
            `RECHECK_SECONDS` as it is at construction).
        clock: seconds, monotonic (a test's own clock).

    Raises:
        ConfigError: the first `load`, at construction, fails: a service refuses to start
            with a file it cannot use.
    """

    def __init__(
        self,
        paths: Sequence[str],
        load: Callable[[], T],
        *,
        what: str,
        recheck_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.paths = tuple(path for path in paths if path)
        self.what = what
        self.recheck_seconds = RECHECK_SECONDS if recheck_seconds is None else recheck_seconds
        self._load = load
        self._clock = clock
        self._stamp = file_stamp(self.paths)
        self._value = load()
        self._checked = clock()
        self.reloads = 0
        """Times changed files were taken."""

    @property
    def value(self) -> T:
        """The last value taken, without looking at the files."""
        return self._value

    def current(self) -> T:
        """The value, made again first if the files changed since it was made (looked at no
        more often than every `recheck_seconds`)."""
        now = self._clock()
        if now - self._checked >= self.recheck_seconds:
            self._checked = now
            self.refresh()
        return self._value

    def refresh(self) -> bool:
        """Looks at the files now; True when they had changed and the new value was taken."""
        stamp = file_stamp(self.paths)
        if stamp == self._stamp:
            return False
        try:
            value = self._load()
        except (ConfigError, OSError, UnicodeDecodeError) as exc:
            log.warning("%s changed but was not taken (the last one stays): %s", self.what, exc)
            return False
        self._stamp = stamp
        self._value = value
        self.reloads += 1
        log.info("%s reloaded from %s", self.what, ", ".join(self.paths))
        return True
