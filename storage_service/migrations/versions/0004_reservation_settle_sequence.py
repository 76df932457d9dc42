"""usage reservations: settle sequence numbers and a closed mark (leases, idempotent settles)

A reservation now stays after it is settled or expires, closed and holding nothing, for an
hour: a retried settle then finds it and is recognised by its sequence number.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 03:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_reservations", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("settled_sequence", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(
            sa.Column("closed", sa.Boolean(), server_default=sa.false(), nullable=False)
        )


def downgrade() -> None:
    # Closed rows hold nothing; without the mark they would read as open, so they go.
    op.execute(sa.text("DELETE FROM usage_reservations WHERE closed"))
    with op.batch_alter_table("usage_reservations", schema=None) as batch_op:
        batch_op.drop_column("closed")
        batch_op.drop_column("settled_sequence")
