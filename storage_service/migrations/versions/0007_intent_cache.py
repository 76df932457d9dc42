"""intent cache: the routers' shared exact intent cache and each player's cache generation

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 05:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "intent_cache_scopes",
        sa.Column("player_id", sa.String(length=64), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("player_id"),
        info={"keep_on_reset": True},
    )
    op.create_table(
        "intent_cache_entries",
        sa.Column("player_id", sa.String(length=64), nullable=False),
        sa.Column("language", sa.String(length=8), nullable=False),
        sa.Column("text_sha256", sa.LargeBinary(length=32), nullable=False),
        sa.Column("runtime_generation", sa.String(length=128), nullable=False),
        sa.Column("module_id", sa.String(length=128), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("player_id", "language", "text_sha256"),
    )
    with op.batch_alter_table("intent_cache_entries", schema=None) as batch_op:
        batch_op.create_index("ix_intent_cache_entries_used", ["used_at"], unique=False)
        batch_op.create_index(
            "ix_intent_cache_entries_player_used", ["player_id", "used_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("intent_cache_entries", schema=None) as batch_op:
        batch_op.drop_index("ix_intent_cache_entries_player_used")
        batch_op.drop_index("ix_intent_cache_entries_used")
    op.drop_table("intent_cache_entries")
    op.drop_table("intent_cache_scopes")
