"""Migrations bring an empty database to exactly the schema the code declares, on SQLite and
PostgreSQL, and running them again changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from storage_service.db import make_engine
from storage_service.migrate import current_revision, head_revision, upgrade
from storage_service.schema import include_name, metadata

ROOT = Path(__file__).resolve().parent.parent


def test_upgrade_yields_the_declared_schema(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        upgrade(engine)
        upgrade(engine)  # a second run is a no-op
        assert current_revision(engine) == head_revision()
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"compare_type": True, "include_name": include_name}
            )
            differences = compare_metadata(context, metadata)
        assert differences == [], f"schema and migrations disagree: {differences}"
    finally:
        engine.dispose()


def test_migrate_command_upgrades_and_reports(tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SYSTEM_")},
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gen")]),
        "SYSTEM_STORAGE_DATABASE_URL": f"sqlite:///{tmp_path / 'fresh.db'}",
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "storage_service.migrate", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert run("--current").stdout.strip() == "(empty database)"
    first = run()
    assert first.returncode == 0, first.stderr
    assert f"schema at {head_revision()} (was empty)" in first.stdout
    assert run("--current").stdout.strip() == head_revision()
