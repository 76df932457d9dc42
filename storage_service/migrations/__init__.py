"""Alembic migrations of the storage schema (run at start, or alone with
`python -m storage_service.migrate`)."""
