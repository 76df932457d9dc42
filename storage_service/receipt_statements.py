"""A step receipt write's one statement: what applies the write when nothing stands in the way
(storage_service.receipts goes the long way when it changes nothing).

Each rule is written once, over column expressions: bind parameters for one write
(`_RECORD_FAST`, `_COMPLETE_FAST`) or the columns of arrays unnested side by side for a group's
writes on PostgreSQL (`RECEIPT_WRITES_MANY`, run by storage_service.batch_groups). A recording
inserts the receipt (RUNNING, or DONE when its completion came with it) only where the task is
the player's and unfinished, the step is new and the receipt fits the player's ledger without
eviction; a completion stores a RUNNING step's result only where it fits the ledger.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    CompoundSelect,
    DateTime,
    FromClause,
    Insert,
    Integer,
    LargeBinary,
    String,
    Update,
    and_,
    cast,
    exists,
    insert,
    literal_column,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy.types import TypeEngine

from storage_service.dialect import unnested
from storage_service.journal_records import (
    _RECEIPT_COLUMNS,
    _RECEIPTS,
    _TASKS,
    RECOVERABLE,
    STEP_DONE,
    STEP_RUNNING,
    StoredReceipt,
)
from storage_service.ledgers import JournalBounds, _param, player_ledger

__all__ = ["RECEIPT_WRITES_MANY", "array_params"]


class _Recording(NamedTuple):
    """What a recording inserts, as SQL expressions."""

    step_id: ColumnElement[Any]
    task_id: ColumnElement[Any]
    player_id: ColumnElement[Any]
    position: ColumnElement[Any]
    tool: ColumnElement[Any]
    state: ColumnElement[Any]
    result: ColumnElement[Any]
    codec_id: ColumnElement[Any]
    size_bytes: ColumnElement[Any]


class _Completing(NamedTuple):
    """What a completion stores, as SQL expressions; `grows` is by how many bytes."""

    step_id: ColumnElement[Any]
    player_id: ColumnElement[Any]
    tool: ColumnElement[Any]
    grows: ColumnElement[Any]
    result: ColumnElement[Any]
    codec_id: ColumnElement[Any]


_RECORDED_COLUMNS = [*_Recording._fields, "created_at", "updated_at"]
_TYPES: dict[str, TypeEngine[Any]] = {
    "step_id": String(),
    "task_id": String(),
    "player_id": String(),
    "position": BigInteger(),
    "tool": String(),
    "state": String(),
    "result": LargeBinary(),
    "codec_id": String(),
    "size_bytes": Integer(),
    "grows": Integer(),
}
"""The parameter type of each field of `_Recording` and `_Completing`: one write's parameter
is `p_` + the field, a group's array `r_` (recordings) or `c_` (completions) + the field."""


def _record_insert(
    v: _Recording,
    source: FromClause | None,
    created: ColumnElement[Any],
    updated: ColumnElement[Any],
    max_entries: ColumnElement[Any],
    max_bytes: ColumnElement[Any],
) -> Insert:
    """INSERT ... SELECT that records the steps `v` names when nothing stands in the way: the
    task is the player's and unfinished, the step is new and the receipt fits the player's
    ledger without eviction; it inserts nothing for a step otherwise. `source` is the FROM
    item `v`'s columns come from (None for bind parameters): the ledger is then read per row
    (LATERAL)."""
    ledger_query = player_ledger(_RECEIPTS, v.player_id)
    # The task is the player's: a condition on the one task row, or the join of each write's.
    the_task = and_(_TASKS.c.task_id == v.task_id, _TASKS.c.player_id == v.player_id)
    ledger: FromClause
    if source is None:
        ledger = ledger_query.subquery("ledger")
        tables = _TASKS.join(ledger, true())
    else:
        ledger = ledger_query.lateral("ledger")
        tables = source.join(_TASKS, the_task).join(ledger, true())
    existing = _RECEIPTS.alias("e")
    rows = (
        select(
            v.step_id,
            _TASKS.c.task_id,
            _TASKS.c.player_id,
            v.position,
            v.tool,
            v.state,
            v.result,
            v.codec_id,
            v.size_bytes,
            created,
            updated,
        )
        .select_from(tables)
        .where(
            the_task if source is None else true(),
            # Constants in the SQL: an IN list of parameters is expanded on every execution.
            _TASKS.c.state.in_([literal_column(f"'{name}'") for name in sorted(RECOVERABLE)]),
            ~exists().where(existing.c.step_id == v.step_id),
            ledger.c.ledger_count + literal_column("1") <= max_entries,
            ledger.c.ledger_bytes + v.size_bytes <= max_bytes,
        )
    )
    return insert(_RECEIPTS).from_select(_RECORDED_COLUMNS, rows)


def _complete_update(
    v: _Completing, now: ColumnElement[Any], max_bytes: ColumnElement[Any]
) -> Update:
    """UPDATE that completes the RUNNING steps `v` names when each result fits the player's
    ledger without eviction; it changes nothing for a step otherwise. A RUNNING receipt holds
    no result and no codec (see record_step), so its size grows by exactly the codec id's
    and the result's bytes."""
    ledger_bytes = player_ledger(_RECEIPTS, v.player_id, bytes_only=True).scalar_subquery()
    return (
        update(_RECEIPTS)
        .where(
            _RECEIPTS.c.step_id == v.step_id,
            _RECEIPTS.c.player_id == v.player_id,
            _RECEIPTS.c.tool == v.tool,
            _RECEIPTS.c.state == literal_column(f"'{STEP_RUNNING}'"),
            _RECEIPTS.c.codec_id == literal_column("''"),
            _RECEIPTS.c.result.is_(None),
            ledger_bytes + v.grows <= max_bytes,
        )
        .values(
            state=literal_column(f"'{STEP_DONE}'"),
            result=v.result,
            codec_id=v.codec_id,
            size_bytes=_RECEIPTS.c.size_bytes + v.grows,
            updated_at=now,
        )
    )


# One write: the receipt's state, result and codec are parameters (RUNNING with neither, or
# DONE when the step's completion came with it); the completion returns the receipt.
_RECORD_FAST = (
    _record_insert(
        _Recording(*(_param(f"p_{field}", _TYPES[field]) for field in _Recording._fields))._replace(
            # Typed in the SQL: a NULL (a RUNNING receipt's) would be read as text otherwise.
            result=cast(_param("p_result", LargeBinary), LargeBinary)
        ),
        None,
        _param("p_created", DateTime(timezone=True)),
        _param("p_updated", DateTime(timezone=True)),
        _param("p_max_entries", Integer),
        _param("p_max_bytes", BigInteger),
    )
).execution_options(preserve_rowcount=True)
_COMPLETE_FAST = _complete_update(
    _Completing(*(_param(f"p_{field}", _TYPES[field]) for field in _Completing._fields)),
    _param("p_now", DateTime(timezone=True)),
    _param("p_max_bytes", BigInteger),
).returning(*_RECEIPT_COLUMNS)


def _receipt_writes_many() -> CompoundSelect[Any]:
    """A group's receipt writes in one statement (PostgreSQL), each row checked exactly as
    _RECORD_FAST or _COMPLETE_FAST checks its one write: recordings from the `r_` arrays,
    completions from the `c_` arrays (`array_params` makes them); it returns
    the step id of every write applied. Both parts see one snapshot: a chunk holds at most one
    write per player and per step id."""
    recordings = unnested("v", "r_", [(field, _TYPES[field]) for field in _Recording._fields])
    completions = unnested("v", "c_", [(field, _TYPES[field]) for field in _Completing._fields])
    now = _param("now", DateTime(timezone=True))
    max_bytes = _param("max_bytes", BigInteger)
    recorded = (
        _record_insert(
            _Recording(*(recordings.c[field] for field in _Recording._fields)),
            recordings,
            now,
            now,
            _param("max_entries", Integer),
            max_bytes,
        )
        .returning(_RECEIPTS.c.step_id)
        .cte("recorded")
    )
    completed = (
        _complete_update(
            _Completing(*(completions.c[field] for field in _Completing._fields)), now, max_bytes
        )
        .returning(_RECEIPTS.c.step_id)
        .cte("completed")
    )
    return union_all(select(recorded.c.step_id), select(completed.c.step_id))


RECEIPT_WRITES_MANY = _receipt_writes_many()


def _record_params(bounds: JournalBounds, receipt: StoredReceipt) -> dict[str, object]:
    """The parameters of _RECORD_FAST that insert `receipt`."""
    params: dict[str, object] = {
        f"p_{field}": getattr(receipt, field) for field in _Recording._fields
    }
    params.update(
        p_created=receipt.created_at,
        p_updated=receipt.updated_at,
        p_max_entries=bounds.receipt_max_entries,
        p_max_bytes=bounds.receipt_max_bytes,
    )
    return params


def _complete_params(
    bounds: JournalBounds,
    now: dt.datetime,
    step_id: str,
    player_id: str,
    tool: str,
    result: bytes,
    codec_id: str,
) -> dict[str, object]:
    """The parameters of _COMPLETE_FAST."""
    return {
        "p_step_id": step_id,
        "p_player_id": player_id,
        "p_tool": tool,
        "p_grows": len(codec_id.encode()) + len(result),
        "p_result": result,
        "p_codec_id": codec_id,
        "p_now": now,
        "p_max_bytes": bounds.receipt_max_bytes,
    }


def array_params(
    recordings: Sequence[dict[str, object]], completions: Sequence[dict[str, object]]
) -> dict[str, object]:
    """RECEIPT_WRITES_MANY's arrays, from one-write parameters of _RECORD_FAST
    (`recordings`) and _COMPLETE_FAST (`completions`): column by column."""
    params: dict[str, object] = {
        f"r_{field}": [write[f"p_{field}"] for write in recordings] for field in _Recording._fields
    }
    params.update(
        (f"c_{field}", [write[f"p_{field}"] for write in completions])
        for field in _Completing._fields
    )
    return params
