"""spend view: spend by module and provider per scope and day, budget limits on the counters

`usage_spend` keeps the tokens and money one scope's calls for one module spent on one provider
per UTC day, written by settles that carry spend items (decision 0029's admin view). The budget
counters remember the limits the period's last reservation carried (0 until one does), so the
spend view shows use against limits without storage knowing the ranks.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 10:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_spend",
        sa.Column("period", sa.String(length=10), nullable=False),
        sa.Column("scope", sa.String(length=64), nullable=False),
        sa.Column("module_id", sa.String(length=128), nullable=False),
        sa.Column("provider", sa.String(length=64), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_micros", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("period", "scope", "module_id", "provider"),
        info={"keep_on_reset": True},
    )
    with op.batch_alter_table("usage_budget_counters", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("limit_tokens", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(
            sa.Column("limit_cost_micros", sa.BigInteger(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("usage_budget_counters", schema=None) as batch_op:
        batch_op.drop_column("limit_cost_micros")
        batch_op.drop_column("limit_tokens")
    op.drop_table("usage_spend")
