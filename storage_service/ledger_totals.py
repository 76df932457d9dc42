"""A player's ledger totals, kept by the database: the count and bytes of their tasks and of
their receipts, one row a player (`journal_ledgers`), so that a write checks the ledger's
bounds by reading one row instead of summing the player's entries (decision 0050).

Every statement that adds, deletes or resizes a task or a receipt changes the totals in the
same transaction, because triggers on `journal_tasks` and `journal_receipts` do it, whatever
code wrote the entry: a write's one statement, a group's array statements, the long way, an
eviction, a player's reset. An insert adds to the owner's row (making it); a delete or a
change of size updates it. An entry's owner never changes; an update that tries is refused.
On PostgreSQL the entries added or removed are counted once a statement, over the rows it
changed (one upsert a player a statement: a group's array statements, a reset's delete), a
resize once a row; on SQLite, which has only row triggers, all once a row.

The row of a player stays when their entries go (a reset leaves it at zero: KEEP_ON_RESET).
Reading a ledger (`ledgers.player_ledger`) takes 0 for a player without a row.

The same triggers are made by `Base.metadata.create_all` (the SQLite stacks and tests) and by
migration 0016, from `create_triggers` here.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Connection, String, Table, event, inspect
from sqlalchemy.orm import Mapped, mapped_column

from storage_service.db import KEEP_ON_RESET, Base, table_of
from storage_service.dialect import POSTGRESQL
from storage_service.validation import MAX_PLAYER_ID

__all__ = [
    "LEDGERS",
    "LedgerRow",
    "create_triggers",
    "drop_triggers",
    "totals_of",
]


class LedgerRow(Base):
    """A player's ledger totals: how many tasks and receipts they hold and their bytes."""

    __tablename__ = "journal_ledgers"
    __table_args__ = {"info": {KEEP_ON_RESET: True}}

    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), primary_key=True)
    task_count: Mapped[int] = mapped_column(BigInteger)
    task_bytes: Mapped[int] = mapped_column(BigInteger)
    receipt_count: Mapped[int] = mapped_column(BigInteger)
    receipt_bytes: Mapped[int] = mapped_column(BigInteger)


LEDGERS = table_of(LedgerRow)

_ENTRIES = {"journal_tasks": "task", "journal_receipts": "receipt"}
"""Each table whose entries a ledger counts, and the prefix of its totals' columns."""

_COLUMNS = "player_id, task_count, task_bytes, receipt_count, receipt_bytes"


def _added(prefix: str, player: str, count: str, size: str) -> str:
    """The values, in `_COLUMNS`' order, of a row that adds `count` entries of `size` bytes to
    `player`'s totals of `prefix` (task or receipt) and nothing to the others."""
    return (
        f"{player}, {count}, {size}, 0, 0"
        if prefix == "task"
        else f"{player}, 0, 0, {count}, {size}"
    )


_OWNER_FIXED = "the player_id of a task or receipt never changes"


# PostgreSQL: entries added or removed are counted once a statement, over its transition table
# (one upsert or update a player a statement). Row-level ones would update a player's row once
# an entry, and within one transaction each update walks every earlier version of the row: a
# bulk insert or a reset of 5,000 receipts then costs time quadratic in their number. A resize
# is counted once a row, and only when the size changed (a statement-level trigger on UPDATE
# cannot be limited to a column, and would run on every claim and move): no statement resizes
# many entries of one player. A change of owner is refused before it happens.
def _postgresql_triggers(table: str, prefix: str) -> dict[str, list[str]]:
    count, size = f"{prefix}_count", f"{prefix}_bytes"
    values = _added(prefix, "player_id", "count(*)", "sum(size_bytes)")
    # (body, when the trigger runs) of each function.
    triggers = {
        # Each statement changes the rows of its players in player order.
        "add": (
            f"""INSERT INTO journal_ledgers AS l ({_COLUMNS})
        SELECT {values} FROM new_rows GROUP BY player_id ORDER BY player_id
        ON CONFLICT (player_id) DO UPDATE SET
            {count} = l.{count} + excluded.{count}, {size} = l.{size} + excluded.{size};""",
            f"AFTER INSERT ON {table} REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT",
        ),
        "remove": (
            f"""UPDATE journal_ledgers AS l
        SET {count} = l.{count} - d.n, {size} = l.{size} - d.b
        FROM (SELECT player_id, count(*) AS n, sum(size_bytes) AS b FROM old_rows
              GROUP BY player_id) AS d
        WHERE l.player_id = d.player_id;""",
            f"AFTER DELETE ON {table} REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT",
        ),
        "resize": (
            f"""UPDATE journal_ledgers SET {size} = {size} + NEW.size_bytes - OLD.size_bytes
        WHERE player_id = NEW.player_id;""",
            f"AFTER UPDATE OF size_bytes ON {table} FOR EACH ROW "
            "WHEN (OLD.size_bytes <> NEW.size_bytes)",
        ),
        "owner": (
            f"RAISE EXCEPTION '{_OWNER_FIXED}';",
            f"BEFORE UPDATE OF player_id ON {table} FOR EACH ROW "
            "WHEN (OLD.player_id <> NEW.player_id)",
        ),
    }
    made = {}
    for change, (body, when) in triggers.items():
        name = f"{table}_ledger_{change}"
        made[name] = [
            f"CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
            f"BEGIN\n        {body}\n        RETURN NULL;\nEND $$",
            f"DROP TRIGGER IF EXISTS {name} ON {table}",
            f"CREATE TRIGGER {name} {when} EXECUTE FUNCTION {name}()",
        ]
    return made


# SQLite: row-level triggers (it has no others), which update a row in place.
def _sqlite_triggers(table: str, prefix: str) -> dict[str, list[str]]:
    count, size = f"{prefix}_count", f"{prefix}_bytes"
    values = _added(prefix, "NEW.player_id", "1", "NEW.size_bytes")
    # (body, when the trigger runs) of each, as `_postgresql_triggers`.
    triggers = {
        "insert": (
            f"INSERT INTO journal_ledgers ({_COLUMNS}) VALUES ({values}) "
            f"ON CONFLICT (player_id) DO UPDATE SET {count} = {count} + excluded.{count}, "
            f"{size} = {size} + excluded.{size};",
            f"AFTER INSERT ON {table}",
        ),
        "delete": (
            f"UPDATE journal_ledgers SET {count} = {count} - 1, {size} = {size} - OLD.size_bytes "
            "WHERE player_id = OLD.player_id;",
            f"AFTER DELETE ON {table}",
        ),
        "resize": (
            f"UPDATE journal_ledgers SET {size} = {size} + NEW.size_bytes - OLD.size_bytes "
            "WHERE player_id = NEW.player_id;",
            f"AFTER UPDATE OF size_bytes ON {table} WHEN OLD.size_bytes <> NEW.size_bytes",
        ),
        "owner": (
            f"SELECT RAISE(ABORT, '{_OWNER_FIXED}');",
            f"BEFORE UPDATE OF player_id ON {table} WHEN OLD.player_id <> NEW.player_id",
        ),
    }
    return {
        f"{table}_ledger_{change}": [
            f"CREATE TRIGGER IF NOT EXISTS {table}_ledger_{change} {when} BEGIN {body} END"
        ]
        for change, (body, when) in triggers.items()
    }


def _triggers(connection: Connection) -> dict[str, tuple[str, list[str]]]:
    """Each trigger that keeps `journal_ledgers` on the connection's database: its name, and
    the table it is on with the statements that make it."""
    made = _postgresql_triggers if connection.dialect.name == POSTGRESQL else _sqlite_triggers
    return {
        name: (table, statements)
        for table, prefix in _ENTRIES.items()
        for name, statements in made(table, prefix).items()
    }


def create_triggers(connection: Connection) -> None:
    """Makes (or remakes) the triggers that keep `journal_ledgers`, on the connection's
    database; the three tables must exist."""
    for _, statements in _triggers(connection).values():
        for statement in statements:
            connection.exec_driver_sql(statement)


def drop_triggers(connection: Connection) -> None:
    """Removes what `create_triggers` made."""
    postgresql = connection.dialect.name == POSTGRESQL
    for name, (table, _) in _triggers(connection).items():
        connection.exec_driver_sql(
            f"DROP TRIGGER IF EXISTS {name}" + (f" ON {table}" if postgresql else "")
        )
        if postgresql:
            connection.exec_driver_sql(f"DROP FUNCTION IF EXISTS {name}()")


def totals_of(entries: Table) -> tuple[Column[int], Column[int]]:
    """The totals' columns (count, bytes) that count `entries` (the tasks or the receipts
    table)."""
    prefix = _ENTRIES[entries.name]
    return LEDGERS.c[f"{prefix}_count"], LEDGERS.c[f"{prefix}_bytes"]


@event.listens_for(Base.metadata, "after_create")
def _after_create(target: object, connection: Connection, **kw: object) -> None:
    # create_all made the tables (or found them): the triggers come with them.
    tables = inspect(connection).get_table_names()
    if all(name in tables for name in (*_ENTRIES, LEDGERS.name)):
        create_triggers(connection)
