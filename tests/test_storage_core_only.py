"""The storage package reads and writes its tables with Core statements only (issue 16: one
data-access style), and its modules stay small. A mapped class declares a table; code outside
that declaration reaches the table through `table_of(Row)` and never through the class itself: no ORM-enabled
statement (`select(TaskRow)`, `TaskRow.seq == ...`), no `session.get`, no row objects made of
the class. Every statement runs through SQLAlchemy (`Session.execute`, `Connection.execute`):
nothing in the package reaches the database driver's connection or cursor itself."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
from sqlalchemy import Table

from storage_service import schema
from storage_service.db import Base
from storage_service.journal_records import _RECEIPTS, _TASKS, StoredReceipt, StoredTask

PACKAGE = pathlib.Path(schema.__file__).parent
MAPPED = frozenset(mapper.class_.__name__ for mapper in Base.registry.mappers)
_ORM_SESSION_CALLS = frozenset({"get", "scalars", "add", "merge", "query", "refresh"})
"""Session methods that load or keep mapped objects (`session.scalars` of a Core column
statement would be harmless, but the package reads rows with `execute` alone)."""


_DRIVER_ATTRIBUTES = frozenset({"driver_connection", "dbapi_connection", "cursor", "pipeline"})
"""What a module would reach for to run a statement on the driver instead of SQLAlchemy."""


def _driver_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Where the code reaches the driver's connection, its cursors or its pipelines."""
    return sorted(
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in _DRIVER_ATTRIBUTES
    )


def _misuses(tree: ast.AST) -> list[tuple[int, str]]:
    """Where a mapped class is used other than as `table_of`'s argument, its own `class`
    statement or an import."""
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "table_of"
            and node.args
        ):
            allowed.add(id(node.args[0]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in MAPPED and id(node) not in allowed:
            found.append((node.lineno, node.id))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _ORM_SESSION_CALLS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "session"
        ):
            found.append((node.lineno, f"session.{node.func.attr}"))
    return sorted(found)


def test_the_mapped_classes_are_found() -> None:
    assert {"TaskRow", "ReceiptRow", "HistoryRow", "PreferenceRow", "KnowledgeRow"} <= MAPPED


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_storage_code_uses_core_statements_only(path: pathlib.Path) -> None:
    misuses = _misuses(ast.parse(path.read_text(encoding="utf-8")))
    assert not misuses, (
        f"{path.name} uses the ORM where the package uses Core statements "
        f"(reach a table through table_of(Row)): {misuses}"
    )


_SETS_CONNECTIONS_UP = "db.py"
"""The engine's module, which sets each new connection up on the driver (SQLite's pragmas and
its BEGIN IMMEDIATE) and runs no statement of the package's."""


@pytest.mark.parametrize(
    "path",
    sorted(p for p in PACKAGE.glob("*.py") if p.name != _SETS_CONNECTIONS_UP),
    ids=lambda p: p.name,
)
def test_storage_code_runs_statements_through_sqlalchemy_only(path: pathlib.Path) -> None:
    """One way to run a statement (issue 16): SQLAlchemy's, with its parameter and result
    processing, its errors and its connection invalidation; no layer on the driver beside it."""
    uses = _driver_uses(ast.parse(path.read_text(encoding="utf-8")))
    assert not uses, f"{path.name} runs statements on the database driver itself: {uses}"


def test_the_check_finds_driver_use() -> None:
    code = (
        "driver = connection.connection.driver_connection\n"
        "with driver.pipeline():\n"
        "    driver.cursor().execute(sql)\n"
        "session.execute(statement)\n"
    )
    assert _driver_uses(ast.parse(code)) == [
        (1, "driver_connection"),
        (2, "pipeline"),
        (3, "cursor"),
    ]


@pytest.mark.parametrize(
    ("record", "table"), [(StoredTask, _TASKS), (StoredReceipt, _RECEIPTS)], ids=["task", "receipt"]
)
def test_a_record_holds_its_tables_columns_in_order(record: type, table: Table) -> None:
    """`StoredTask.from_row(row)` and `StoredReceipt(*row)` take a row of `select(table)`
    field by field: a column added to the table must be added to the record in its place."""
    assert [field.name for field in dataclasses.fields(record)] == list(table.c.keys())


MAX_MODULE_LINES = 600
"""Issue 16: no storage module over 600 lines (one job each: split by area, not grown)."""


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_no_storage_module_is_over_its_size(path: pathlib.Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, (
        f"{path.name} has {lines} lines, over {MAX_MODULE_LINES}: split it by what it does"
    )


def test_the_check_finds_orm_use() -> None:
    code = (
        "row = session.get(TaskRow, 1)\n"
        "query = select(TaskRow).where(TaskRow.seq == 1)\n"
        "fine = table_of(TaskRow)\n"
    )
    assert _misuses(ast.parse(code)) == [
        (1, "TaskRow"),
        (1, "session.get"),
        (2, "TaskRow"),
        (2, "TaskRow"),
    ]
