"""Features granted to one player alone (PlayerDataService.SetPlayerFeature), beside those their
game server offers to everyone in its hello.

Domain code: no gRPC here. A grant is a row (player, feature); granting twice or taking back
what was never granted changes nothing. Grants are an operator's decision, so ResetPlayer keeps
them (KEEP_ON_RESET), as it keeps the binding: a revoked player is refused whatever they were
granted.
"""

from __future__ import annotations

import datetime as dt
import re

from sqlalchemy import DateTime, String, delete, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from services.runtime.errors import InvalidArgument, ResourceExhausted
from storage_service.db import KEEP_ON_RESET, Base, rowcount, table_of, upsert_ignore
from storage_service.dialect import utc_now
from storage_service.validation import MAX_PLAYER_ID, check_player_id

__all__ = ["MAX_FEATURES_PER_PLAYER", "FeatureRow", "player_features", "set_player_feature"]

MAX_FEATURE = 64
"""Longest feature id, as the gateway allows in a hello."""
MAX_FEATURES_PER_PLAYER = 64
"""Most grants one player holds, as many as a hello may list."""
FEATURE_ID = re.compile(r"^[a-z0-9_.-]+:[a-z0-9_./-]+$")


class FeatureRow(Base):
    """One feature granted to one player."""

    __tablename__ = "player_features"
    __table_args__ = {"info": {KEEP_ON_RESET: True}}

    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), primary_key=True)
    feature: Mapped[str] = mapped_column(String(MAX_FEATURE), primary_key=True)
    granted_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


_FEATURES = table_of(FeatureRow)


def check_feature(feature: str) -> None:
    if not feature:
        raise InvalidArgument("feature is required")
    if len(feature) > MAX_FEATURE or not FEATURE_ID.match(feature):
        raise InvalidArgument(
            f"feature {feature[:MAX_FEATURE]!r} is not a feature id: lower-case "
            f"`namespace:name` of at most {MAX_FEATURE} characters, such as `system:search`"
        )


def player_features(session: Session, player_id: str) -> list[str]:
    """The features granted to the player, sorted (in code-point order on every database)."""
    rows = session.execute(select(_FEATURES.c.feature).where(_FEATURES.c.player_id == player_id))
    return sorted(row.feature for row in rows)


def set_player_feature(
    session: Session, player_id: str, feature: str, granted: bool
) -> tuple[list[str], bool]:
    """Grants or takes back one feature inside the caller's transaction; returns (the
    player's features afterwards, whether anything changed)."""
    check_player_id(player_id)
    check_feature(feature)
    if granted:
        held = session.execute(
            select(func.count()).select_from(_FEATURES).where(_FEATURES.c.player_id == player_id)
        ).scalar_one()
        inserted = session.execute(
            upsert_ignore(
                session, _FEATURES, player_id=player_id, feature=feature, granted_at=utc_now()
            )
        )
        changed = rowcount(inserted) == 1
        if changed and held >= MAX_FEATURES_PER_PLAYER:
            raise ResourceExhausted(
                f"the player already holds {MAX_FEATURES_PER_PLAYER} granted features; "
                "take one back first"
            )
    else:
        removed = session.execute(
            delete(_FEATURES).where(
                _FEATURES.c.player_id == player_id, _FEATURES.c.feature == feature
            )
        )
        changed = rowcount(removed) == 1
    return player_features(session, player_id), changed
