"""player features: features granted to one player alone (PlayerDataService.SetPlayerFeature)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 06:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "player_features",
        sa.Column("player_id", sa.String(length=64), nullable=False),
        sa.Column("feature", sa.String(length=64), nullable=False),
        sa.Column("granted_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("player_id", "feature"),
        info={"keep_on_reset": True},
    )


def downgrade() -> None:
    op.drop_table("player_features")
