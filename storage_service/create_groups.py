"""A group commit's new tasks written together (PostgreSQL).

Every game event makes a task (`CreateTask`). Alone, a creation is the player's lock and one
INSERT that applies where nothing stands in the way (`tasks.create_task`). When a group
(storage_service.group_commit) holds two or more creations, they are written together
instead: the same INSERT (`tasks.create_insert`) over arrays, one
`INSERT ... SELECT FROM unnest(...)` for all of them, each row inserted only where
`tasks.create_task` would insert it without evicting (no task of the player with that event
key, room in the player's ledger). A row not inserted (the event's task exists, or the ledger
must make room) is then created the long way right there, which finds the task or evicts:
nothing of it was written, so the answer is the long way's. A group writes at most one
creation per player this way, so the ledger each row reads is not one another row changes; a
player's next creation in the group runs the ordinary way. On SQLite creations run the
ordinary way (a statement there costs no round trip).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Integer,
    bindparam,
)
from sqlalchemy.orm import Session
from system.storage.v1 import journal_pb2

from services.runtime.errors import ServiceError
from storage_service.batch_groups import _changed
from storage_service.dialect import INSERT, POSTGRESQL, is_postgresql, unnested
from storage_service.journal_records import _TASKS, StoredTask, task_message
from storage_service.ledgers import JournalBounds, Writes
from storage_service.tasks import _CREATED_COLUMNS, _CREATED_TYPES, create_insert, new_task

__all__ = ["CreateWriter", "GroupableCreate"]

Created = tuple[journal_pb2.EventTask, bool, int]

# The players' ledgers are read per row (count, bytes) as `create_task` reads them under the
# player's lock (the group's lock statement took it).
_NEW = unnested("v", "v_", [(name, _CREATED_TYPES[name]) for name in _CREATED_COLUMNS])
_CREATE_MANY = (
    create_insert(
        INSERT[POSTGRESQL](_TASKS),
        {name: _NEW.c[name] for name in _CREATED_COLUMNS},
        _NEW,
        bindparam("now", type_=DateTime(timezone=True)),
        bindparam("max_entries", type_=Integer),
        bindparam("max_bytes", type_=BigInteger),
    )
    .on_conflict_do_nothing()
    .returning(_TASKS.c.task_id)
)


class GroupableCreate:
    """`JournalStore.create_task_unit`: a unit (its long way, `create_task_in`) that can also
    be written together with its group's other creations (group_commit.GroupableUnit)."""

    __slots__ = ("_long_way", "group_writer", "request", "writes")

    def __init__(
        self,
        group_writer: CreateWriter,
        long_way: Callable[[Session], Created],
        request: dict[str, Any],
    ) -> None:
        self.group_writer = group_writer
        self._long_way = long_way
        # create_task's keyword arguments: player_id, module_id, input, event_key,
        # initial_state.
        self.request = request
        self.writes = Writes(players=(request["player_id"],))

    def __call__(self, session: Session) -> Created:
        return self._long_way(session)


class CreateWriter:
    """Writes a group's creations in one statement (group_commit.GroupWriter)."""

    __slots__ = ("_bounds", "_now")

    def __init__(self, bounds: JournalBounds, now: Callable[[], Any]) -> None:
        self._bounds = bounds
        self._now = now

    def write(
        self, session: Session, units: Sequence[GroupableCreate]
    ) -> list[Callable[[], Created] | None]:
        if not is_postgresql(session):
            return [None] * len(units)
        now = self._now()
        rows: list[dict[str, Any] | None] = []
        players: set[str] = set()
        for unit in units:
            player = unit.request["player_id"]
            try:
                row = None if player in players else new_task(self._bounds, now, **unit.request)
            except ServiceError:
                row = None  # the long way says why, in its turn
            if row is not None:
                players.add(player)
            rows.append(row)
        created = [row for row in rows if row is not None]
        if not created:
            return [None] * len(units)
        params: dict[str, object] = {
            f"v_{name}": [row[name] for row in created] for name in _CREATED_COLUMNS
        }
        params.update(
            now=now,
            max_entries=self._bounds.task_max_entries,
            max_bytes=self._bounds.task_max_bytes,
        )
        inserted = _changed(session.execute(_CREATE_MANY, params))
        return [
            None if row is None else functools.partial(_finish, session, unit, row, inserted)
            for unit, row in zip(units, rows, strict=True)
        ]


def _finish(
    session: Session, unit: GroupableCreate, row: dict[str, Any], inserted: frozenset[str]
) -> Created:
    """The creation's answer: the row inserted, or the long way's (the event's task exists,
    or the ledger must make room), which nothing written for it has changed."""
    if row["task_id"] in inserted:
        return task_message(StoredTask.of(row)), True, 0
    return unit(session)
