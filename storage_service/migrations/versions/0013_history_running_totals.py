"""history running totals: each entry's count and bytes through it, for cheap eviction

`history_entries` gains `seq` and `bytes_through`: the player's entries and their encoded
bytes counted up to and including the entry. Every append evicts what no longer fits; with
them it reads only the oldest entries (those it deletes and one more) instead of a window
over the player's whole history. Existing entries are numbered from each player's oldest.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 13:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("history_entries", schema=None) as batch_op:
        batch_op.add_column(sa.Column("seq", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("bytes_through", sa.BigInteger(), nullable=True))
    # UPDATE ... FROM: PostgreSQL, and SQLite since 3.33.
    op.execute(
        """
UPDATE history_entries SET seq = totals.seq, bytes_through = totals.bytes_through
FROM (
    SELECT id,
           row_number() OVER (PARTITION BY player_id ORDER BY id) AS seq,
           sum(size_bytes) OVER (PARTITION BY player_id ORDER BY id) AS bytes_through
    FROM history_entries
) AS totals
WHERE history_entries.id = totals.id"""
    )
    with op.batch_alter_table("history_entries", schema=None) as batch_op:
        batch_op.alter_column("seq", existing_type=sa.BigInteger(), nullable=False)
        batch_op.alter_column("bytes_through", existing_type=sa.BigInteger(), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("history_entries", schema=None) as batch_op:
        batch_op.drop_column("bytes_through")
        batch_op.drop_column("seq")
