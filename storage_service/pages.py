"""Keyset pages of the list calls (tasks, history, knowledge): how a page is read and the
opaque page tokens they hand out, so every list refuses a forged token the same way.

A token is the last row's sort key behind the list's one-letter kind, base64 (URL-safe): a
list refuses another list's token, and nothing but a key of its own reaches the database.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable
from typing import Any

from sqlalchemy import Select
from sqlalchemy.engine import Row
from sqlalchemy.orm import Session

from services.runtime.errors import InvalidArgument

__all__ = ["PageTokens"]

MALFORMED = "page_token is malformed; pass the next_page_token of a previous response unchanged"


@dataclasses.dataclass(frozen=True)
class PageTokens:
    """The page tokens of one list, told apart from other lists' by `kind`."""

    kind: str

    def encode(self, key: str | int) -> str:
        """The page token that carries `key` (the last row's sort key)."""
        return base64.urlsafe_b64encode(f"{self.kind}{key}".encode()).decode()

    def decode(self, token: str) -> str:
        """The key a token of this list carries; INVALID_ARGUMENT for anything else (not
        base64 of UTF-8 text, another list's kind, or no key)."""
        try:
            raw = base64.urlsafe_b64decode(token.encode()).decode()
        except (ValueError, UnicodeDecodeError):
            raw = ""
        if not raw.startswith(self.kind) or len(raw) <= len(self.kind):
            raise InvalidArgument(MALFORMED)
        return raw[len(self.kind) :]

    def decode_number(self, token: str) -> int:
        """The row number a token of this list carries. Only what `encode` makes of one: a
        positive number that fits a BIGINT column (a forged huge one would otherwise reach
        the driver, and SQLite raises OverflowError: INTERNAL)."""
        digits = self.decode(token)
        try:
            if not (digits.isascii() and digits.isdigit()):
                raise ValueError
            number = int(digits)  # ValueError too past int()'s digit limit
            if not 0 < number < 2**63:
                raise ValueError
            return number
        except ValueError:
            raise InvalidArgument(MALFORMED) from None

    def read(
        self, session: Session, query: Select[Any], size: int, key: Callable[[Row[Any]], str | int]
    ) -> tuple[list[Row[Any]], str]:
        """The first `size` rows of `query` (ordered by its key), and the next page's token
        (the `key` of the page's last row), "" on the last page. One row more than the page
        is read: it only says that another page follows."""
        rows = list(session.execute(query.limit(size + 1)))
        more = len(rows) > size
        rows = rows[:size]
        return rows, self.encode(key(rows[-1])) if more else ""
