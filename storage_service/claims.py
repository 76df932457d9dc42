"""Task claims: ClaimTasks hands runnable tasks to one engine replica, each under a lease of
its own.

On PostgreSQL a claim is one statement that picks and locks the oldest runnable tasks with
FOR UPDATE SKIP LOCKED (two replicas never pick the same row), takes their leases and marks
them RUNNING; on SQLite, whose writers take turns, three statements in one transaction. The
lease upsert follows the rule of storage_service.leases: every taking of a lease gets a
larger token.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import BigInteger, Integer, String, bindparam, literal_column, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.sql.selectable import TextualSelect
from sqlalchemy.types import TypeEngine
from system.storage.v1 import journal_pb2

from storage_service.dialect import aware, is_postgresql
from storage_service.journal_records import _TASKS, StoredTask, task_message
from storage_service.leases import _LEASES, _micros
from storage_service.tasks import _TASK_COLUMN_NAMES, _TASK_COLUMNS

__all__ = ["MAX_CLAIM", "MAX_CLAIM_PLAYERS", "claim_tasks"]

MAX_CLAIM = 100
MAX_CLAIM_PLAYERS = 1000

# ClaimTasks runs whenever an event replica has a free worker, so it is one statement on
# PostgreSQL (three on SQLite) instead of an ORM load, a lease row per task and a flush
# (about 6 ms of Python per claim on PostgreSQL before, 3.7 ms on SQLite).
#
# Runnable: QUEUED (of the given players, when some are given), or RUNNING with no live
# lease (its replica died), oldest first. A claimed task becomes RUNNING, attempts + 1, and
# its lease `task:<task_id>` is taken for the claimer with a larger token: a leftover lease of
# a QUEUED task is taken over (its holder's fence goes stale), a RUNNING task's lease only
# when it is still free or expired when the upsert reaches it.
_RUNNABLE = """(
    (t.state = 'queued'{players})
    OR (t.state = 'running' AND NOT EXISTS (
        SELECT 1 FROM leases AS dead
        WHERE dead.name = 'task:' || t.task_id
          AND dead.owner IS NOT NULL AND dead.expires_at > :now))
)"""
_TAKE_LEASE = """ON CONFLICT (name) DO UPDATE SET
        owner = excluded.owner,
        token = {greatest}(l.token + 1, excluded.token),
        expires_at = excluded.expires_at"""
_SqlType = TypeEngine[Any] | type[TypeEngine[Any]]
_CLAIMED_COLUMNS = ", ".join(f"t.{name}" for name in _TASK_COLUMN_NAMES)


def _claim_binds(*names: str, players: _SqlType | None = None) -> list[BindParameter[Any]]:
    """The typed parameters `names` of a claim statement (SQLite stores times as text, so
    their type matters); `players` is the type of the player filter, when there is one."""
    when = _LEASES.c.expires_at.type
    types: dict[str, _SqlType] = {
        "now": when,
        "expires_at": when,
        "owner": String,
        "token": BigInteger,
    }
    types |= {"max_tasks": Integer, "seqs": String}
    binds = [bindparam(name, type_=types[name]) for name in names]
    return binds + ([bindparam("players", type_=players)] if players is not None else [])


def _claim_postgresql(players: bool) -> TextualSelect:
    """One statement: lock the oldest runnable tasks (skipping rows another replica is
    claiming), take their leases, mark them RUNNING. The lease upsert sees the newest lease
    row even where the statement's snapshot does not, so a RUNNING task another replica
    claimed just before is left alone (its lease is live again) and not marked here."""
    runnable = _RUNNABLE.format(players=" AND t.player_id = ANY(:players)" if players else "")
    sql = f"""
WITH picked AS (
    SELECT t.seq, t.task_id, t.state FROM journal_tasks AS t
    WHERE {runnable}
    ORDER BY t.seq LIMIT :max_tasks
    FOR UPDATE OF t SKIP LOCKED
), leased AS (
    INSERT INTO leases AS l (name, owner, token, expires_at)
    SELECT 'task:' || picked.task_id, :owner, :token, :expires_at FROM picked
    {_TAKE_LEASE.format(greatest="greatest")}
    WHERE l.owner IS NULL OR l.expires_at IS NULL OR l.expires_at <= :now
       OR l.name IN (SELECT 'task:' || queued.task_id FROM picked AS queued
                     WHERE queued.state = 'queued')
    RETURNING l.name, l.token, l.expires_at
), claimed AS (
    UPDATE journal_tasks AS t
    SET state = 'running', attempts = t.attempts + 1, updated_at = :now
    FROM picked JOIN leased ON leased.name = 'task:' || picked.task_id
    WHERE t.seq = picked.seq
    RETURNING {_CLAIMED_COLUMNS}, leased.token AS lease_token,
              leased.expires_at AS lease_expires_at
)
SELECT * FROM claimed ORDER BY seq"""
    binds = _claim_binds(
        "now",
        "expires_at",
        "owner",
        "token",
        "max_tasks",
        players=ARRAY(String) if players else None,
    )
    return (
        text(sql)
        .bindparams(*binds)
        .columns(
            *_TASK_COLUMNS,
            literal_column("lease_token", BigInteger),
            literal_column("lease_expires_at", _LEASES.c.expires_at.type),
        )
    )


# SQLite runs one write transaction at a time (storage_service.db), so nothing can claim
# between its three statements: pick, take the leases, mark the tasks.
_PICK_SQLITE = {
    players: (
        text(
            "SELECT t.seq FROM journal_tasks AS t WHERE "
            + _RUNNABLE.format(
                players=" AND t.player_id IN (SELECT value FROM json_each(:players))"
                if players
                else ""
            )
            + " ORDER BY t.seq LIMIT :max_tasks"
        )
        .bindparams(*_claim_binds("now", "max_tasks", players=String if players else None))
        .columns(_TASKS.c.seq)
    )
    for players in (False, True)
}
_LEASE_SQLITE = (
    text(
        "INSERT INTO leases AS l (name, owner, token, expires_at) "
        "SELECT 'task:' || t.task_id, :owner, :token, :expires_at FROM journal_tasks AS t "
        "WHERE t.seq IN (SELECT value FROM json_each(:seqs)) "
        + _TAKE_LEASE.format(greatest="max")
        + " RETURNING name, token, expires_at"
    )
    .bindparams(*_claim_binds("owner", "token", "expires_at", "seqs"))
    .columns(_LEASES.c.name, _LEASES.c.token, _LEASES.c.expires_at)
)
_MARK_SQLITE = (
    text(
        # SQLite's RETURNING names the table's columns bare, never through an alias.
        "UPDATE journal_tasks SET state = 'running', attempts = attempts + 1, updated_at = :now "
        "WHERE seq IN (SELECT value FROM json_each(:seqs)) "
        f"RETURNING {', '.join(_TASK_COLUMN_NAMES)}"
    )
    .bindparams(*_claim_binds("now", "seqs"))
    .columns(*_TASK_COLUMNS)
)
_CLAIM_POSTGRESQL = {players: _claim_postgresql(players) for players in (False, True)}


def claim_tasks(
    session: Session | Connection,
    now: dt.datetime,
    *,
    owner: str,
    max_tasks: int,
    lease_seconds: int,
    player_ids: Sequence[str],
) -> list[journal_pb2.TaskClaim]:
    """Claims up to `max_tasks` runnable tasks in the session's transaction (see above)."""
    players = sorted(set(player_ids))
    params: dict[str, object] = {
        "now": now,
        "expires_at": now + dt.timedelta(seconds=lease_seconds),
        "owner": owner,
        "token": _micros(now),
        "max_tasks": max_tasks,
    }
    rows: Sequence[Sequence[Any]]
    if is_postgresql(session):
        if players:
            params["players"] = players
        rows = session.execute(_CLAIM_POSTGRESQL[bool(players)], params).all()
    else:
        if players:
            params["players"] = json.dumps(players)
        picked = session.execute(_PICK_SQLITE[bool(players)], params).all()
        if not picked:
            return []
        params["seqs"] = json.dumps([row[0] for row in picked])
        leases = {
            name: (token, expires_at)
            for name, token, expires_at in session.execute(_LEASE_SQLITE, params)
        }
        rows = [
            (*row, *leases[f"task:{row[1]}"])
            for row in sorted(session.execute(_MARK_SQLITE, params).all())
        ]
    claims = []
    width = len(_TASK_COLUMN_NAMES)
    for row in rows:
        task = StoredTask.from_row(row[:width])
        lease = journal_pb2.Lease(name=f"task:{task.task_id}", owner=owner, token=row[width])
        lease.expires_at.FromDatetime(aware(row[width + 1]))
        claims.append(journal_pb2.TaskClaim(task=task_message(task), lease=lease))
    return claims
