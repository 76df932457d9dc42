"""A player's journal ledgers: their bounds, what an entry counts against them, eviction,
and the player's ledger lock.

A player's tasks and a player's receipts are each bounded by count and by encoded bytes. A
write that adds an entry, or makes one larger (a task's final result, a step's result), and
does not fit first evicts the player's terminal entries oldest first (receipts: those whose
task is terminal or gone), a 64th of each bound more than it needs where there are that many
(`HEADROOM_SHARE`: so a player at a bound does not evict on every write); QUEUED, RUNNING and
WAITING tasks and the receipts of such tasks are never evicted. When even the write's own
need cannot be met the write fails with STORAGE_FULL and writes nothing. Moving a task
to a terminal state without a result never grows the ledger, so a full ledger can always be
drained.

Concurrency: on SQLite every write transaction starts with BEGIN IMMEDIATE (see db.py), so
writers are serialized. On PostgreSQL (READ COMMITTED) writes that change a player's ledgers
take a transaction-scoped advisory lock on the player first (`lock_player`, or with the
lookup of the row's owner, `_owner_locked`), so dedupe by event key and the bounds hold under
concurrent writers.

The same lock orders grouped transactions (storage_service.group_commit, decision 0028): a
group first takes, in one statement (`lock_in_order`), the lock of every player its writes
declare (`Writes`: the players named, and the owners of the tasks and steps named), sorted
by the lock's id. Everything else a group locks (lease, history, document, task, receipt and
usage rows) belongs to one of those players, so two groups that share a player, on any
replicas, take turns at that player's lock instead of each holding a row the other wants.
The same statement then reads, share-locked, the lease rows of the fences the writes name
(decision 0032), so a unit's fence check (`check_noted_fence`) costs no statement of its own.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Select,
    String,
    Table,
    bindparam,
    column,
    delete,
    func,
    literal,
    or_,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Row
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import BindParameter, ColumnElement
from sqlalchemy.types import TypeEngine
from system.storage.v1 import journal_pb2

from services.runtime.errors import InvalidArgument, ResourceExhausted
from storage_service.dialect import advisory_lock, is_postgresql
from storage_service.journal_records import _RECEIPTS, _TASKS, TERMINAL
from storage_service.leases import _LEASES, _fence_holds, check_fence
from storage_service.ledger_totals import LEDGERS, totals_of

__all__ = [
    "JournalBounds",
    "Writes",
    "check_noted_fence",
    "lock_in_order",
    "lock_player",
    "receipt_size",
    "task_size",
]

# -- settings ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JournalBounds:
    """Per-player ledger bounds and size limits (see StorageConfig for each)."""

    task_max_entries: int = 1000
    task_max_bytes: int = 1_048_576
    receipt_max_entries: int = 5000
    receipt_max_bytes: int = 4_194_304
    max_result_bytes: int = 262_144
    max_document_bytes: int = 262_144

    @classmethod
    def from_config(cls, config: object) -> JournalBounds:
        """The bounds of a StorageConfig (any object with the same attribute names)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


# -- sizes and bounds --------------------------------------------------------------------------


def _utf8(*values: str) -> int:
    return sum(len(value.encode()) for value in values)


def task_size(
    task_id: str, player_id: str, module_id: str, event_key: str, data: bytes, result: bytes | None
) -> int:
    """Bytes a task counts against its player's bound: encoded input and result plus ids."""
    return _utf8(task_id, player_id, module_id, event_key) + len(data) + len(result or b"")


def receipt_size(
    step_id: str, task_id: str, player_id: str, tool: str, codec_id: str, result: bytes | None
) -> int:
    """Bytes a receipt counts against its player's bound: its result plus ids."""
    return _utf8(step_id, task_id, player_id, tool, codec_id) + len(result or b"")


_PLAYER_LOCK = select(advisory_lock(bindparam("key", type_=String)))
_LOCKED = "system.storage.journal.locked_players"


def _player_lock_key(player_id: str) -> str:
    return f"journal:{player_id}"


def _transaction_locks(session: Session) -> tuple[set[str], dict[tuple[object, str], Any]]:
    """The players whose ledger lock the session's current (innermost) transaction holds, and
    the owners of tasks and steps `lock_in_order` found (keyed by the owner query that would
    have found them, `_TASK_OWNER` or `_STEP_OWNER`, and the row's id) and the fences' lease
    rows it read (keyed by `_NOTED_LEASE` and the lease's name). Keyed by that
    transaction: a lock taken in a savepoint that rolls back is released, and a new
    transaction holds none."""
    transaction = session.get_nested_transaction() or session.get_transaction()
    held = session.info.get(_LOCKED)
    if held is None or held[0] is not transaction:
        held = (transaction, set(), {})
        session.info[_LOCKED] = held
    return held[1], held[2]


def _locks_held(session: Session) -> set[str]:
    """The players whose ledger lock the session's current transaction holds (see
    `_transaction_locks`)."""
    return _transaction_locks(session)[0]


def _ledgers_held(session: Session, player_id: str) -> bool:
    """Whether no other writer can change the player's ledgers before the session's
    transaction ends, so a ledger read now stays true: on PostgreSQL once the transaction
    holds the player's lock; on SQLite always (its writers take turns at BEGIN IMMEDIATE)."""
    return not is_postgresql(session) or player_id in _locks_held(session)


def lock_player(session: Session, player_id: str) -> None:
    """Serializes writers of one player's ledgers until the transaction ends (PostgreSQL; on
    SQLite BEGIN IMMEDIATE already serializes every writer). Taken once per transaction."""
    if not is_postgresql(session):
        return
    held = _locks_held(session)
    if player_id not in held:
        session.execute(_PLAYER_LOCK, {"key": _player_lock_key(player_id)})
        held.add(player_id)


class Writes(NamedTuple):
    """Whose rows a unit of a group will write (see `lock_in_order`): the players it names,
    and the players owning the tasks and the steps it names (looked up: a task's and a
    receipt's player never change); and the leases whose fence it checks (read, share-locked,
    after those players' locks, so its `check_noted_fence` needs no statement of its own)."""

    players: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    steps: tuple[str, ...] = ()
    fences: tuple[str, ...] = ()


# Every named player's ledger lock, one by one in the order of the locks' ids (`ordered` is
# materialized in that order, and `locked` takes the locks as it reads it). What lock_player
# takes, so a unit's own lock calls find it held; with each player, the named tasks and steps
# found to be theirs, so a unit's own owner lookup (_owner_locked) is not run again. Then the
# named fences' lease rows, share-locked as check_fence locks them: only once every lock is
# held (`fenced` waits for `locked`: a lease row is a player's row, decision 0027's order),
# so a unit's fence check (check_noted_fence) is not run again either. Rows of the first
# kind carry a player, rows of the second a lease name.
_LOCK_IN_ORDER = (
    text(
        f"""
WITH ordered AS MATERIALIZED (
    SELECT n.player_id,
           hashtextextended('{_player_lock_key("")}' || n.player_id, 0) AS lock_id,
           array_remove(array_agg(n.task_id), NULL) AS tasks,
           array_remove(array_agg(n.step_id), NULL) AS steps
    FROM (
        SELECT unnest(:players) AS player_id, NULL::varchar AS task_id, NULL::varchar AS step_id
        UNION ALL SELECT t.player_id, t.task_id, NULL FROM journal_tasks AS t
                  WHERE t.task_id = ANY(:tasks)
        UNION ALL SELECT r.player_id, NULL, r.step_id FROM journal_receipts AS r
                  WHERE r.step_id = ANY(:steps)
    ) AS n
    GROUP BY n.player_id
    ORDER BY lock_id
), locked AS MATERIALIZED (
    SELECT o.player_id, pg_advisory_xact_lock(o.lock_id) IS NULL AS locked, o.tasks, o.steps
    FROM ordered AS o
), fenced AS MATERIALIZED (
    SELECT l.name, l.owner, l.token, l.expires_at FROM leases AS l
    WHERE l.name = ANY(:fences) AND (SELECT count(*) FROM locked) >= 0
    FOR SHARE OF l
)
SELECT player_id, locked, tasks, steps, NULL AS name, NULL AS owner, NULL::bigint AS token,
       NULL::timestamptz AS expires_at
FROM locked
UNION ALL
SELECT NULL, NULL, NULL, NULL, name, owner, token, expires_at FROM fenced"""
    )
    .bindparams(
        bindparam("players", type_=ARRAY(String)),
        bindparam("tasks", type_=ARRAY(String)),
        bindparam("steps", type_=ARRAY(String)),
        bindparam("fences", type_=ARRAY(String)),
    )
    # The types of its rows' columns (arrays, timestamps with their time zone).
    .columns(
        column("player_id", String),
        column("locked", Boolean),
        column("tasks", ARRAY(String)),
        column("steps", ARRAY(String)),
        column("name", String),
        column("owner", String),
        column("token", BigInteger),
        column("expires_at", DateTime(timezone=True)),
    )
)
_NOTED_LEASE = "lease"
"""Key (with the lease name) under which a transaction's owners note a fence's lease row."""


def lock_in_order(session: Session, writes: Sequence[Writes]) -> None:
    """Takes the ledger lock of every player `writes` name (PostgreSQL), in one global order:
    the locks' ids ascending, then share-locks the leases of the fences they name, in one
    statement; notes the locks as held and the lease rows as read. SQLite needs nothing: its
    writers take turns at BEGIN IMMEDIATE (and check their fences themselves)."""
    if not is_postgresql(session):
        return
    # An id PostgreSQL's text cannot hold (a NUL) names no row, so it takes no lock: its unit
    # refuses it with its own message, and the group's other units are not failed with it.
    players, tasks, steps, fences = (
        sorted({name for write in writes for name in getattr(write, kind) if "\x00" not in name})
        for kind in Writes._fields
    )
    if not (players or tasks or steps or fences):
        return
    found = session.execute(
        _LOCK_IN_ORDER, {"players": players, "tasks": tasks, "steps": steps, "fences": fences}
    )
    locks, owners = _transaction_locks(session)
    for player, _, owned_tasks, owned_steps, lease, *lease_row in found:
        if lease is not None:
            owners[(_NOTED_LEASE, lease)] = (lease, *lease_row)
            continue
        locks.add(player)
        owners.update({(_TASK_OWNER, task): player for task in owned_tasks})
        owners.update({(_STEP_OWNER, step): player for step in owned_steps})


def check_noted_fence(session: Session, fence: journal_pb2.Fence | None, now: dt.datetime) -> None:
    """`check_fence`, answered from the lease row the transaction's `lock_in_order` read and
    share-locked when it did (a fence the unit's `Writes` named); otherwise, or when that row
    says the fence does not hold (to say why), as check_fence reads it."""
    if fence is None:
        return
    noted = noted_lease(session, fence.lease_name)
    if noted is not None and _fence_holds(noted, fence, now):
        return
    check_fence(session, fence, now)


def noted_lease(session: Session, name: str) -> tuple[object, ...] | None:
    """The lease row (name, owner, token, expires_at) the transaction's `lock_in_order` read
    and share-locked for a fence a unit's `Writes` named; None when it read none."""
    noted: tuple[object, ...] | None = _transaction_locks(session)[1].get((_NOTED_LEASE, name))
    return noted


def _fits(count: int, total: int, add_count: int, add_bytes: int, limits: tuple[int, int]) -> bool:
    max_entries, max_bytes = limits
    return (add_count == 0 or count + add_count <= max_entries) and (
        add_bytes <= 0 or total + add_bytes <= max_bytes
    )


_Candidate = Row[*tuple[Any, ...]]
"""An evictable entry: its seq and size first (a task's id after them)."""


HEADROOM_SHARE = 64
"""A write that must evict frees this share of each bound beyond its own need (1/64: 15 of
1,000 tasks, 78 of 5,000 receipts), where that many entries are finished: a player at a bound
then evicts on one write in so many instead of on every write (decision 0043)."""


def _headroom_limits(limits: tuple[int, int]) -> tuple[int, int]:
    """The ledger an eviction leaves room under: each bound less its headroom."""
    return (
        limits[0] - limits[0] // HEADROOM_SHARE,
        limits[1] - limits[1] // HEADROOM_SHARE,
    )


def _choose_evictions(
    count: int,
    total: int,
    add_count: int,
    add_bytes: int,
    limits: tuple[int, int],
    candidates: Iterable[_Candidate],
) -> list[_Candidate] | None:
    """The candidates (rows whose first two columns are seq and size) to evict, oldest first,
    so the addition fits under the bounds less their headroom, or, when too few candidates
    are left for that, under the bounds; None when it cannot fit. Reads `candidates` only as
    far as it must."""
    roomy = _headroom_limits(limits)
    doomed: list[_Candidate] = []
    for candidate in candidates:
        if _fits(count, total, add_count, add_bytes, roomy):
            break
        doomed.append(candidate)
        count -= 1
        total -= candidate[1]
    return doomed if _fits(count, total, add_count, add_bytes, limits) else None


def _oldest_first(
    session: Session,
    query: Select[*tuple[Any, ...]],
    seq: Column[int],
    first: int,
) -> Iterator[_Candidate]:
    """The rows of `query` in `seq` order, read in pages (the first of `first` rows, then
    growing): an eviction takes the oldest few (what the write needs and the headroom), and
    reading every evictable entry of a full ledger (a thousand tasks, five thousand receipts)
    to find them cost milliseconds a write."""
    size, after = max(first, 1) + _PAGE_SLACK, None
    while True:
        page = query.order_by(seq).limit(size)
        if after is not None:
            page = page.where(seq > after)
        rows = session.execute(page).all()
        yield from rows
        if len(rows) < size:
            return
        after, size = rows[-1][0], min(size * 4, _MAX_PAGE)


def _evictions(
    session: Session,
    query: Select[*tuple[Any, ...]],
    seq: Column[int],
    exclude_seq: int | None,
    ledger: tuple[int, int],
    add_count: int,
    add_bytes: int,
    limits: tuple[int, int],
) -> list[_Candidate] | None:
    """The evictable entries `query` selects (seq and size first; not the one at
    `exclude_seq`, whose own growth is the addition) that `_choose_evictions` picks for a
    ledger of `ledger` (count, bytes) under `limits`; None when the addition cannot fit."""
    if exclude_seq is not None:
        query = query.where(seq != exclude_seq)
    count, total = ledger
    candidates = _oldest_first(session, query, seq, count + add_count - _headroom_limits(limits)[0])
    return _choose_evictions(count, total, add_count, add_bytes, limits, candidates)


_PAGE_SLACK = 8
"""Candidates read beyond the entries the count bound alone asks to evict (the bytes bound
may ask for a few more)."""
_MAX_PAGE = 1024


def player_ledger(
    entries: Table, player: ColumnElement[Any] | str, *, bytes_only: bool = False
) -> Select[Any]:
    """A player's ledger of `entries` (the tasks or the receipts table): how many they hold
    (`ledger_count`) and their bytes (`ledger_bytes`), or the bytes alone; 0 for a player with
    none. One row, read from the totals the database keeps (storage_service.ledger_totals).
    Every read of a ledger is this query: a write's own, a group's per row (LATERAL), the long
    way's."""
    count, size = (func.coalesce(func.max(c), 0) for c in totals_of(entries))
    columns: list[ColumnElement[Any]] = [size.label("ledger_bytes")]
    if not bytes_only:
        columns.insert(0, count.label("ledger_count"))
    return select(*columns).where(LEDGERS.c.player_id == player)


_LEDGER_READS = {
    rows: player_ledger(rows, bindparam("player_id", type_=String)) for rows in (_TASKS, _RECEIPTS)
}


def not_applied(write: str) -> RuntimeError:
    """A write's one statement that changed nothing when run again by its long way, which had
    found nothing in the way and made room under the player's lock: the statement's
    conditions and the long way's checks disagree (a bug, not a state of the data)."""
    return RuntimeError(
        f"{write}'s one statement changed nothing after the long way made room for it"
    )


def _make_room(
    session: Session,
    rows: Table,
    player_id: str,
    need: tuple[int, int],
    limits: tuple[int, int],
    evictable: Select[Any],
    exclude_seq: int | None,
    ledger: tuple[int, int] | None,
    full: Callable[[int, int], str],
) -> list[_Candidate]:
    """Evicts the player's `evictable` entries of `rows` (seq and size first), oldest first,
    until `need` (count, bytes) fits under `limits` with headroom (`_choose_evictions`).
    Returns the evicted entries; STORAGE_FULL, saying `full(count, bytes)`, when it cannot fit
    (nothing deleted).

    `ledger` is the player's (count, bytes) when the caller read them in this transaction,
    under the player's lock (the count may be 0 when the write adds no entry); the ledger is
    only read again when the addition does not fit, so an eviction counts what is stored."""
    if ledger is not None and _fits(*ledger, *need, limits):
        return []
    found = session.execute(_LEDGER_READS[rows], {"player_id": player_id}).first()
    assert found is not None  # an aggregate always returns a row
    count, total = found
    if _fits(count, total, *need, limits):
        return []
    seq = rows.c.seq
    doomed = _evictions(session, evictable, seq, exclude_seq, (count, total), *need, limits)
    if doomed is None:
        raise ResourceExhausted(f"STORAGE_FULL: player {player_id}'s {full(count, total)}")
    session.execute(delete(rows).where(seq.in_([row.seq for row in doomed])))
    return doomed


def _make_room_for_tasks(
    session: Session,
    bounds: JournalBounds,
    player_id: str,
    add_count: int,
    add_bytes: int,
    exclude_seq: int | None = None,
    ledger: tuple[int, int] | None = None,
) -> int:
    """Evicts the player's terminal tasks, and their leases, to make room for `add_count`
    tasks of `add_bytes` (`_make_room`). Returns how many."""
    doomed = _make_room(
        session,
        _TASKS,
        player_id,
        (add_count, add_bytes),
        (bounds.task_max_entries, bounds.task_max_bytes),
        select(_TASKS.c.seq, _TASKS.c.size_bytes, _TASKS.c.task_id).where(
            _TASKS.c.player_id == player_id, _TASKS.c.state.in_(TERMINAL)
        ),
        exclude_seq,
        ledger,
        lambda count, total: (
            f"task ledger holds {count} tasks in {total} bytes (bounds "
            f"{bounds.task_max_entries} tasks, {bounds.task_max_bytes} bytes) and not enough of "
            "them are finished to make room; finish or fail tasks before adding more"
        ),
    )
    if doomed:
        # The leases of evicted tasks go too (tokens stay increasing: see leases._micros).
        names = [f"task:{row.task_id}" for row in doomed]
        session.execute(delete(_LEASES).where(_LEASES.c.name.in_(names)))
    return len(doomed)


def _make_room_for_receipts(
    session: Session,
    bounds: JournalBounds,
    player_id: str,
    add_count: int,
    add_bytes: int,
    exclude_seq: int | None = None,
    ledger: tuple[int, int] | None = None,
) -> int:
    """Evicts the player's receipts whose task is terminal or gone to make room for
    `add_count` receipts of `add_bytes` (`_make_room`). Returns how many."""
    doomed = _make_room(
        session,
        _RECEIPTS,
        player_id,
        (add_count, add_bytes),
        (bounds.receipt_max_entries, bounds.receipt_max_bytes),
        select(_RECEIPTS.c.seq, _RECEIPTS.c.size_bytes)
        .outerjoin(_TASKS, _TASKS.c.task_id == _RECEIPTS.c.task_id)
        .where(
            _RECEIPTS.c.player_id == player_id,
            or_(_TASKS.c.seq.is_(None), _TASKS.c.state.in_(TERMINAL)),
        ),
        exclude_seq,
        ledger,
        lambda count, total: (
            f"step receipts hold {count} receipts in {total} bytes (bounds "
            f"{bounds.receipt_max_entries} receipts, {bounds.receipt_max_bytes} bytes) and not "
            "enough of them belong to finished tasks to make room; finish or fail tasks before "
            "recording more steps"
        ),
    )
    return len(doomed)


def _check_owner(actual: str, player_id: str | None, what: str) -> None:
    if player_id is not None and actual != player_id:
        raise InvalidArgument(
            f"{what} belongs to another player, not {player_id!r}; a batch concerns one player"
        )


def _param(name: str, type_: TypeEngine[Any] | type[TypeEngine[Any]]) -> BindParameter[Any]:
    return bindparam(name, type_=type_)


def _owner_queries(column: Column[str], key: Column[str]) -> tuple[Select[Any], Select[Any]]:
    """The owner of the row whose `key` is :p_key: plainly, and (PostgreSQL) with the owner's
    ledger lock taken in the same statement, one round trip instead of two."""
    where = key == _param("p_key", String)
    lock = advisory_lock(literal(_player_lock_key(""), String) + column).is_(None)
    return select(column).where(where), select(column, lock).where(where)


_TASK_OWNER, _TASK_OWNER_LOCKING = _owner_queries(_TASKS.c.player_id, _TASKS.c.task_id)
_STEP_OWNER, _STEP_OWNER_LOCKING = _owner_queries(_RECEIPTS.c.player_id, _RECEIPTS.c.step_id)


def _owner_locked(
    session: Session, queries: tuple[Select[Any], Select[Any]], key: str
) -> str | None:
    """The player owning the task or receipt `key`, with the player's ledger lock held (see
    lock_player); None when there is no such row (and no lock is taken). Not asked again
    when the transaction's `lock_in_order` found the owner and took their lock (an owner
    never changes; a row deleted since, which only its owner's lock holder can do, is found
    missing by the caller's next statement)."""
    plain, locking = queries
    if not is_postgresql(session):
        row = session.execute(plain, {"p_key": key}).first()
        return None if row is None else row[0]
    locks, owners = _transaction_locks(session)
    known: str | None = owners.get((plain, key))
    if known is not None and known in locks:
        return known
    row = session.execute(locking, {"p_key": key}).first()
    if row is None:
        return None
    owner: str = row[0]
    _locks_held(session).add(owner)
    return owner
