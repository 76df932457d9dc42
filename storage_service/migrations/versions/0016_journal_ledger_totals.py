"""journal ledger totals: each player's task and receipt count and bytes in one row

Every write that adds to a player's journal checks the ledger's bounds. It summed the player's
tasks (or receipts) for it: at the default bounds, which an active player reaches and stays at,
1,000 tasks and 5,000 receipts, about 0.1 and 0.5 ms of PostgreSQL CPU a read even from the
covering indexes of revision 0014. `journal_ledgers` holds the totals, kept by triggers on
both tables in the writing transaction (storage_service.ledger_totals, decision 0050); this
revision makes the table and the triggers and counts what is stored. On PostgreSQL the two
tables are locked against writes while it counts, so that no write slips between the count and
the triggers.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07 05:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from storage_service.ledger_totals import create_triggers, drop_triggers

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "journal_ledgers",
        sa.Column("player_id", sa.String(length=64), nullable=False),
        sa.Column("task_count", sa.BigInteger(), nullable=False),
        sa.Column("task_bytes", sa.BigInteger(), nullable=False),
        sa.Column("receipt_count", sa.BigInteger(), nullable=False),
        sa.Column("receipt_bytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("player_id"),
    )
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("LOCK TABLE journal_tasks, journal_receipts IN SHARE ROW EXCLUSIVE MODE")
    create_triggers(bind)
    op.execute(
        """
INSERT INTO journal_ledgers (player_id, task_count, task_bytes, receipt_count, receipt_bytes)
SELECT player_id, sum(task_count), sum(task_bytes), sum(receipt_count), sum(receipt_bytes)
FROM (
    SELECT player_id, 1 AS task_count, size_bytes AS task_bytes,
           0 AS receipt_count, 0 AS receipt_bytes
    FROM journal_tasks
    UNION ALL
    SELECT player_id, 0, 0, 1, size_bytes FROM journal_receipts
) AS entries
GROUP BY player_id"""
    )


def downgrade() -> None:
    drop_triggers(op.get_bind())
    op.drop_table("journal_ledgers")
