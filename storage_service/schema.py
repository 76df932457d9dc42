"""The whole schema: importing this module registers every table on `Base.metadata`.

Migrations (`storage_service/migrations/`) are written against this metadata, and a test
checks that upgrading an empty database yields exactly it.
"""

from __future__ import annotations

from storage_service import db

__all__ = ["metadata"]

metadata = db.Base.metadata
