"""gateway presence: gateway replicas' leases and the replica each player is attached to

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 00:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gateway_replicas",
        sa.Column("replica_id", sa.String(length=64), nullable=False),
        sa.Column("address", sa.String(length=255), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("replica_id"),
    )
    op.create_table(
        "player_presence",
        sa.Column("player_id", sa.String(length=64), nullable=False),
        sa.Column("replica_id", sa.String(length=64), nullable=False),
        sa.Column("attached_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("player_id"),
        info={"keep_on_reset": True},
    )
    with op.batch_alter_table("player_presence", schema=None) as batch_op:
        batch_op.create_index("ix_player_presence_replica", ["replica_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("player_presence", schema=None) as batch_op:
        batch_op.drop_index("ix_player_presence_replica")
    op.drop_table("player_presence")
    op.drop_table("gateway_replicas")
