"""Input checks every storage service shares, so an id is refused the same way everywhere."""

from __future__ import annotations

from services.runtime.errors import InvalidArgument

__all__ = ["MAX_PLAYER_ID", "check_id", "check_player_id"]

MAX_PLAYER_ID = 64


def check_id(value: str, field: str, limit: int, *, required: bool = True) -> None:
    """Raises InvalidArgument unless `value` is at most `limit` printable characters (and not
    empty, when required)."""
    if not value:
        if required:
            raise InvalidArgument(f"{field} is required")
        return
    if len(value) > limit:
        raise InvalidArgument(f"{field} is longer than {limit} characters")
    if "\x00" in value:
        # PostgreSQL text cannot hold NUL; reject it the same way on every database.
        raise InvalidArgument(f"{field} must not contain NUL characters")
    if not value.isprintable():
        raise InvalidArgument(f"{field} must hold printable characters only")


def check_player_id(player_id: str, field: str = "player_id", *, required: bool = True) -> None:
    """A player id: 1..64 printable characters (may be empty when not required)."""
    check_id(player_id, field, MAX_PLAYER_ID, required=required)
