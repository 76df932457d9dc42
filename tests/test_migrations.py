"""Migrations bring an empty database to exactly the schema the code declares, on SQLite and
PostgreSQL, and running them again changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text
from sqlalchemy.orm import sessionmaker
from system.common.v1 import common_pb2

from storage_service.db import make_engine
from storage_service.history import ConversationStore, HistoryBounds
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


def test_history_running_totals_are_numbered_for_the_entries_already_stored(
    fresh_database_url: str,
) -> None:
    """Revision 0013 numbers each player's stored entries from their oldest, so the first
    append after the upgrade evicts exactly what no longer fits."""
    engine = make_engine(fresh_database_url)
    try:
        upgrade(engine, "0012")
        with engine.begin() as connection:
            for player, sizes in (("steve", [10, 20, 30, 40]), ("alex", [5])):
                for size in sizes:
                    connection.execute(
                        text(
                            "INSERT INTO history_entries (player_id, role, text, request_id, "
                            "size_bytes, created_at) VALUES (:p, 1, :t, '', :s, :c)"
                        ),
                        {"p": player, "t": "x" * size, "s": size, "c": "2026-12-01 00:00:00"},
                    )
        upgrade(engine)
        with engine.connect() as connection:
            rows = connection.execute(
                text(
                    "SELECT player_id, seq, bytes_through FROM history_entries "
                    "ORDER BY player_id, id"
                )
            ).all()
        assert [tuple(row) for row in rows] == [
            ("alex", 1, 5),
            ("steve", 1, 10),
            ("steve", 2, 30),
            ("steve", 3, 60),
            ("steve", 4, 100),
        ]
        # 100 stored bytes + 25 > 110: the oldest two go (20 + 30 + 40 + 25 = 115 is still over).
        store = ConversationStore(sessionmaker(engine), HistoryBounds(10, 110, 100))
        entry = common_pb2.HistoryEntry(role=common_pb2.HISTORY_ROLE_PLAYER, text="y" * 25)
        assert store.append("steve", [entry]) == (True, 2)
        assert [len(e.text) for e in store.list("steve", 10, "")[0]] == [30, 40, 25]
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_ledger_indexes_cover_the_sizes_on_postgresql(postgres_url: str) -> None:
    """Revision 0014: a player's task and receipt sizes are summed from the index alone
    (Alembic's comparison above does not look at INCLUDE columns, so this does)."""
    engine = make_engine(postgres_url)
    try:
        upgrade(engine)
        with engine.connect() as connection:
            definitions = dict(
                connection.execute(
                    text(
                        "SELECT indexname, indexdef FROM pg_indexes WHERE indexname IN "
                        "('ix_journal_tasks_player', 'ix_journal_receipts_player')"
                    )
                ).all()
            )
        assert len(definitions) == 2
        for definition in definitions.values():
            assert definition.endswith("(player_id, seq) INCLUDE (size_bytes)"), definition
    finally:
        engine.dispose()
