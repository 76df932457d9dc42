"""covering ledger indexes: a player's task and receipt sizes summed from the index alone

Every write that adds to a player's journal checks the ledger's bounds: the count and the
summed `size_bytes` of the player's tasks (or receipts). Over `(player_id, seq)` alone that
read every row's heap page: at the default bounds (1,000 tasks, 5,000 receipts), which an
active player reaches and stays at, about 4.7 ms of PostgreSQL CPU per receipt written. With
`size_bytes` included in the index the sum is an index-only scan (decision 0042). PostgreSQL
only: SQLite has no INCLUDE, and its indexes stay as they are.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 14:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_INDEXES = {
    "ix_journal_tasks_player": "journal_tasks",
    "ix_journal_receipts_player": "journal_receipts",
}


def _on_postgresql() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    if not _on_postgresql():
        return
    for name, table in _INDEXES.items():
        op.drop_index(name, table_name=table)
        op.create_index(
            name, table, ["player_id", "seq"], unique=False, postgresql_include=["size_bytes"]
        )


def downgrade() -> None:
    if not _on_postgresql():
        return
    for name, table in _INDEXES.items():
        op.drop_index(name, table_name=table)
        op.create_index(name, table, ["player_id", "seq"], unique=False)
