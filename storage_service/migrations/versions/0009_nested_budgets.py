"""nested budgets: money held by reservations, their game-server scope, budget counters

Reservations now also hold money (millionths of the prices' currency) and remember the
game-server scope of their player id, so a sweep releases both. `usage_budget_counters` keeps
tokens and money used and held per player, per game server and for the network, per UTC day,
and for the network per month. Existing rows start at 0 and "" (server defaults); the counters
start empty, so budgets in money count from the upgrade on.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 06:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_budget_counters",
        sa.Column("budget", sa.String(length=80), nullable=False),
        sa.Column("period", sa.String(length=10), nullable=False),
        sa.Column("used_tokens", sa.BigInteger(), nullable=False),
        sa.Column("reserved_tokens", sa.BigInteger(), nullable=False),
        sa.Column("used_cost_micros", sa.BigInteger(), nullable=False),
        sa.Column("reserved_cost_micros", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("budget", "period"),
        info={"keep_on_reset": True},
    )
    with op.batch_alter_table("usage_reservations", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("scope", sa.String(length=64), server_default="", nullable=False)
        )
        batch_op.add_column(
            sa.Column("cost_micros", sa.BigInteger(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("usage_reservations", schema=None) as batch_op:
        batch_op.drop_column("cost_micros")
        batch_op.drop_column("scope")
    op.drop_table("usage_budget_counters")
