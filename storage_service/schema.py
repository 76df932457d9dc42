"""The whole schema: importing this module registers every table on `Base.metadata`.

Migrations (`storage_service/migrations/`) are written against this metadata, and a test
checks that upgrading an empty database yields exactly it.
"""

from __future__ import annotations

# Imported for their tables: the modules that declare one.
from storage_service import (  # noqa: F401
    batches,
    budget_alerts,
    card_book,
    db,
    journal_records,
    leases,
    ledger_totals,
    player_data,
    player_features,
    presence,
    usage_records,
)
from storage_service.knowledge import include_name

__all__ = ["include_name", "metadata"]

metadata = db.Base.metadata
"""Every table of the storage service."""
# `include_name` hides objects made by raw DDL (the knowledge search index) from autogenerate,
# which would otherwise want to drop them.

# The routers' shared intent cache (decision 0024); also imported through player_data.
from storage_service import intent_cache  # noqa: E402, F401
