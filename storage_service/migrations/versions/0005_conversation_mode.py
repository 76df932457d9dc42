"""player preferences: the conversation mode a player chose (0: the server's default)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 23:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("player_preferences", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("conversation_mode", sa.SmallInteger(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("player_preferences", schema=None) as batch_op:
        batch_op.drop_column("conversation_mode")
