"""Brings a database's schema up to date.

    python -m storage_service.migrate [--config FILE]   # upgrade to the newest revision
    python -m storage_service.migrate --current         # print the database's revision
    python -m storage_service.migrate --check           # may this build serve on it? (exit 0)

The storage service runs the same upgrade at start (setting `run_migrations`); with several
replicas on PostgreSQL, run this once as a Kubernetes Job before rolling them out instead,
and turn `run_migrations` off: the service then waits, not serving, until `schema_state`
finds the schema its build needs (decision 0028).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import sys
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from sqlalchemy import Connection, Engine, inspect

from services.runtime.config import ConfigError
from services.runtime.main import parse_config
from storage_service.config import ENV_PREFIX, StorageConfig
from storage_service.db import make_engine
from storage_service.dialect import is_postgresql

__all__ = [
    "SchemaState",
    "SchemaVerdict",
    "current_revision",
    "head_revision",
    "schema_state",
    "upgrade",
]

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


class SchemaVerdict(enum.Enum):
    """What a database's schema is to this build."""

    CURRENT = "current"
    """At this build's head, or at a revision this build knows that descends from it."""
    NEWER = "newer"
    """At a revision this build does not know (a later release's), with every table and
    column this build declares: served, since migrations only add (decision 0028)."""
    OLDER = "older"
    """At a revision this build knows that comes before its head: not yet upgraded."""
    EMPTY = "empty"
    """No revision at all: never upgraded."""
    INCOMPATIBLE = "incompatible"
    """At a revision this build does not know, and without tables or columns this build
    declares: a migration that removed or renamed something, or another application's."""

    @property
    def serves(self) -> bool:
        """Whether a service of this build may serve on the schema."""
        return self in (SchemaVerdict.CURRENT, SchemaVerdict.NEWER)


@dataclasses.dataclass(frozen=True)
class SchemaState:
    """A database's revision compared with this build's."""

    verdict: SchemaVerdict
    current: tuple[str, ...]
    """The database's revisions (its Alembic heads; one, since the history is linear)."""
    head: str
    """This build's head revision: the schema it was built for."""
    missing: tuple[str, ...] = ()
    """For NEWER and INCOMPATIBLE: the tables and `table.column`s this build declares that
    the database lacks."""

    def describe(self) -> str:
        at = ", ".join(self.current) or "no revision (empty)"
        text = f"database at {at}, this build needs {self.head}: {self.verdict.value}"
        if self.missing:
            shown = ", ".join(self.missing[:10])
            more = len(self.missing) - 10
            text += f"; missing {shown}" + (f" and {more} more" if more > 0 else "")
        return text


def _missing_objects(connection: Connection) -> tuple[str, ...]:
    """This build's declared tables and columns that the database lacks."""
    from storage_service.schema import metadata  # every table module, imported once needed

    inspector = inspect(connection)
    tables = set(inspector.get_table_names())
    missing: list[str] = []
    for table in metadata.sorted_tables:
        if table.name not in tables:
            missing.append(table.name)
            continue
        present = {column["name"] for column in inspector.get_columns(table.name)}
        missing += [f"{table.name}.{c.name}" for c in table.columns if c.name not in present]
    return tuple(missing)


def schema_state(engine: Engine) -> SchemaState:
    """Compares the database's revision with this build's head (decision 0028).

    A revision this build knows serves when the head is it or one of its ancestors; one it
    does not know is a later release's and serves when every table and column this build
    declares is there (migrations add; removing comes a release after nothing uses it).
    """
    script = ScriptDirectory.from_config(_config())
    head = script.get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations in {MIGRATIONS}")
    with engine.connect() as connection:
        current = tuple(MigrationContext.configure(connection).get_current_heads())
        if not current:
            return SchemaState(SchemaVerdict.EMPTY, current, head)
        unknown = False
        reaches_head = True
        for revision in current:
            try:
                lineage = {r.revision for r in script.iterate_revisions(revision, "base")}
            except RevisionError:  # not in this build's history: a later release's
                unknown = True
                continue
            reaches_head = reaches_head and head in lineage
        if unknown:
            missing = _missing_objects(connection)
            verdict = SchemaVerdict.INCOMPATIBLE if missing else SchemaVerdict.NEWER
            return SchemaState(verdict, current, head, missing)
    return SchemaState(
        SchemaVerdict.CURRENT if reaches_head else SchemaVerdict.OLDER, current, head
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m storage_service.migrate", description=__doc__)
    parser.add_argument("--config", help="TOML file (else SYSTEM_STORAGE_CONFIG and environment)")
    parser.add_argument("--current", action="store_true", help="print the revision and exit")
    parser.add_argument(
        "--check",
        action="store_true",
        help="say whether this build may serve on the database's schema; exit 0 if so, 1 if not",
    )
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
        if args.check:
            state = schema_state(engine)
            print(state.describe())
            return 0 if state.verdict.serves else 1
        before = current_revision(engine)
        upgrade(engine)
        after = current_revision(engine)
        print(f"schema at {after}" + ("" if before == after else f" (was {before or 'empty'})"))
        return 0
    finally:
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
