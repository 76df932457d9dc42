"""Alembic environment: runs on the connection `storage_service.migrate` hands over."""

from __future__ import annotations

from alembic import context

from storage_service.schema import include_name, metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "run migrations through storage_service.migrate, which supplies a connection"
    )

context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying
    compare_type=True,
    include_name=include_name,
)
with context.begin_transaction():
    context.run_migrations()
