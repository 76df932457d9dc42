"""card book: the cards each player was shown, so any gateway replica checks a press

One row per (scoped player, card id): the version on screen, template, closed, the buttons as
sent and when it was shown (decision 0030). Starts empty: cards shown before the upgrade are
known only to the replica that sent them.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 10:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "player_cards",
        sa.Column("player_id", sa.String(length=64), nullable=False),
        sa.Column("card_id", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("template", sa.String(length=128), nullable=False),
        sa.Column("closed", sa.Boolean(), nullable=False),
        sa.Column("buttons", sa.LargeBinary(), nullable=False),
        sa.Column("shown_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("player_id", "card_id"),
    )
    with op.batch_alter_table("player_cards", schema=None) as batch_op:
        batch_op.create_index("ix_player_cards_shown_at", ["shown_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("player_cards", schema=None) as batch_op:
        batch_op.drop_index("ix_player_cards_shown_at")
    op.drop_table("player_cards")
