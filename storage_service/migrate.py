"""Brings a database's schema up to date.

    python -m storage_service.migrate [--config FILE]   # upgrade to the newest revision
    python -m storage_service.migrate --current         # print the database's revision

The storage service runs the same upgrade at start (setting `run_migrations`); with several
replicas on PostgreSQL, run this once as a Kubernetes Job before rolling them out instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from services.runtime.config import ConfigError
from services.runtime.main import parse_config
from storage_service.config import ENV_PREFIX, StorageConfig
from storage_service.db import make_engine
from storage_service.dialect import is_postgresql

__all__ = ["current_revision", "head_revision", "upgrade"]

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
_MIGRATION_LOCK = 0x5359_5354_454D  # any constant shared by every replica ("SYSTEM")


def _config(engine_connection: object | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if engine_connection is not None:
        config.attributes["connection"] = engine_connection
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrades the database behind `engine` to `revision` in one transaction."""
    with engine.begin() as connection:
        if is_postgresql(connection):
            # Replicas starting together take turns; the lock ends with the transaction.
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
        command.upgrade(_config(connection), revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(_config()).get_current_head()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m storage_service.migrate", description=__doc__)
    parser.add_argument("--config", help="TOML file (else SYSTEM_STORAGE_CONFIG and environment)")
    parser.add_argument("--current", action="store_true", help="print the revision and exit")
    args = parser.parse_args(argv)
    config: StorageConfig = parse_config(
        "storage-migrate",
        StorageConfig,
        ENV_PREFIX,
        ["--config", args.config] if args.config else [],
    )
    try:
        engine = make_engine(config.database_url)
    except ConfigError as exc:
        print(f"storage-migrate: {exc}", file=sys.stderr)
        return 2
    try:
        if args.current:
            print(current_revision(engine) or "(empty database)")
            return 0
        before = current_revision(engine)
        upgrade(engine)
        after = current_revision(engine)
        print(f"schema at {after}" + ("" if before == after else f" (was {before or 'empty'})"))
        return 0
    finally:
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
