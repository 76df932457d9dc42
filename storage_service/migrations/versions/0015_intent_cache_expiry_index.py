"""intent cache expiry index: expired entries swept a few at a time by every write

An entry lives `intent_cache_ttl_seconds` (300 s). Expired entries were deleted only by their
own player's next write or, once the table held `intent_cache_max_entries` (65,536) rows, all
at once; the entries of players who never wrote again piled up to that bound, and every write
counted a table of up to 65,536 rows (3.3 ms of PostgreSQL CPU a write, against 0.5 ms on an
empty table). Every write now deletes the oldest expired entries, a few at a time, found by
this index (decision 0044).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 15:45:00
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_intent_cache_entries_expires", "intent_cache_entries", ["expires_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_intent_cache_entries_expires", table_name="intent_cache_entries")
