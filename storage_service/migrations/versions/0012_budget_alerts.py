"""budget alerts: each alert claimed once across the model-gateway replicas

`budget_alerts` holds one row per budget, scope, period and threshold whose in-game alert was
sent, naming the model-gateway replica that sends it (PlayerDataService.ClaimBudgetAlert); the
first claim's insert wins, so N replicas send one alert, not N.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 14:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "budget_alerts",
        sa.Column("budget", sa.String(length=64), nullable=False),
        sa.Column("scope", sa.String(length=64), nullable=False),
        sa.Column("period", sa.String(length=10), nullable=False),
        sa.Column("percent", sa.Integer(), nullable=False),
        sa.Column("claimant", sa.String(length=64), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("budget", "scope", "period", "percent"),
        info={"keep_on_reset": True},
    )
    with op.batch_alter_table("budget_alerts", schema=None) as batch_op:
        batch_op.create_index("ix_budget_alerts_claimed_at", ["claimed_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("budget_alerts", schema=None) as batch_op:
        batch_op.drop_index("ix_budget_alerts_claimed_at")
    op.drop_table("budget_alerts")
