"""Leases with fencing tokens: acquire, renew, release, an engine replica's earlier
incarnations ended, and the fence a fenced write checks.

One row per name. Fencing tokens grow with every acquisition of a name, and are at least the
acquisition time in microseconds, so they keep growing even if a lease row is deleted (a
player reset, or the eviction of a finished task) and made again. An engine replica's leases
are owned by `<name>#<incarnation>`: a restarted replica ends its earlier incarnations'
leases at start (`release_earlier_incarnations`, decision 0014).

Each lease call is a function of a session (or a connection) doing its work in that
transaction: the journal's own lease calls run it alone, BeginRun and FinishRun beside the
run's reads and history write.
A fence locks its lease FOR SHARE until the fenced write commits, so a concurrent acquisition
waits and no write lands under a token that has already been replaced.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any, NamedTuple

from sqlalchemy import BigInteger, DateTime, Integer, String, bindparam, func, or_, select, update
from sqlalchemy.engine import Connection, Result
from sqlalchemy.orm import Mapped, Session, mapped_column
from sqlalchemy.sql.dml import ReturningInsert, Update
from sqlalchemy.sql.elements import ColumnElement
from system.storage.v1 import journal_pb2

from services.runtime.errors import STALE_FENCE, FailedPrecondition, InvalidArgument
from storage_service.db import Base, rowcount, table_of
from storage_service.dialect import (
    GREATEST,
    INSERT,
    POSTGRESQL,
    SQLITE,
    DialectInsert,
    aware,
    name_of,
)
from storage_service.journal_records import MAX_ID, _check_id

__all__ = [
    "ACQUIRE_ATTEMPTS",
    "OWNER_SEPARATOR",
    "LeaseRow",
    "acquire",
    "check_fence",
    "check_holder",
    "release",
    "release_earlier_incarnations",
    "renew",
]

MAX_TTL_SECONDS = 3600
MAX_TOKEN = 2**63 - 1  # tokens live in a signed BIGINT


class LeaseRow(Base):
    """A named lease. `owner` and `expires_at` are NULL once released; the row (and its
    token) stays so the next acquisition gets a larger token."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(MAX_ID), primary_key=True)
    owner: Mapped[str | None] = mapped_column(String(MAX_ID), nullable=True)
    token: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


def _check_ttl(seconds: int, field: str) -> None:
    if not 1 <= seconds <= MAX_TTL_SECONDS:
        raise InvalidArgument(
            f"{field} must be between 1 and {MAX_TTL_SECONDS} seconds, got {seconds}"
        )


def _check_token(token: int, field: str = "token") -> None:
    if token <= 0:
        raise InvalidArgument(f"{field} is required: the token the lease was acquired with")
    if token > MAX_TOKEN:
        raise InvalidArgument(f"{field} {token} is larger than any token ever issued")


def _micros(now: dt.datetime) -> int:
    """The time in microseconds: every taking of a lease gets token max(previous token + 1,
    this), so a lease row deleted and made again never hands out a token seen before (the
    rule of _acquire_statement and of _TAKE_LEASE, the claims' form of it)."""
    return int((now - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) / dt.timedelta(microseconds=1))


def _live(row: _FencedLease, now: dt.datetime) -> bool:
    return row.owner is not None and row.expires_at is not None and aware(row.expires_at) > now


def _acquire_statement(
    dialect_insert: DialectInsert, greatest: Callable[..., ColumnElement[Any]]
) -> ReturningInsert[Any]:
    """One statement that makes the row or takes it over when it is free, expired or already
    the owner's, returning the new token; no row comes back when someone else holds it."""
    inserted = dialect_insert(_LEASES).values(
        name=bindparam("name", type_=String),
        owner=bindparam("owner", type_=String),
        token=bindparam("token", type_=BigInteger),
        expires_at=bindparam("expires_at", type_=_LEASES.c.expires_at.type),
    )
    return inserted.on_conflict_do_update(
        index_elements=[_LEASES.c.name],
        set_={
            "owner": inserted.excluded.owner,
            "token": greatest(_LEASES.c.token + 1, inserted.excluded.token),
            "expires_at": inserted.excluded.expires_at,
        },
        where=or_(
            _LEASES.c.owner.is_(None),
            _LEASES.c.expires_at.is_(None),
            _LEASES.c.expires_at <= bindparam("now", type_=_LEASES.c.expires_at.type),
            _LEASES.c.owner == inserted.excluded.owner,
        ),
    ).returning(_LEASES.c.token)


_LEASES = table_of(LeaseRow)
_ACQUIRE_SQLITE = _acquire_statement(INSERT[SQLITE], GREATEST[SQLITE])
_ACQUIRE_POSTGRESQL = _acquire_statement(INSERT[POSTGRESQL], GREATEST[POSTGRESQL])


def _held_lease_update(**values: Any) -> Update:
    """UPDATE of a lease the caller holds (name, owner and token match); its row count says
    whether it was still theirs. Its parameters are not named as columns, which SQLAlchemy
    keeps for the SET clause."""
    return (
        update(_LEASES)
        .where(
            _LEASES.c.name == bindparam("lease_name", type_=String),
            _LEASES.c.owner == bindparam("holder", type_=String),
            _LEASES.c.token == bindparam("held_token", type_=BigInteger),
        )
        .values(**values)
    )


# Every interactive run gives its player's lease back, and held leases (tasks, long runs) are
# renewed every third of their length: one statement each.
_RELEASE = _held_lease_update(owner=None, expires_at=None)
_RENEW = _held_lease_update(expires_at=bindparam("until", type_=_LEASES.c.expires_at.type))


ACQUIRE_ATTEMPTS = 3
"""Times AcquireLease asks for a lease that was held, then free again before it could say by
whom (the holder gave it back in between)."""


def acquire(
    target: Session | Connection, name: str, owner: str, ttl_seconds: int, now: dt.datetime
) -> journal_pb2.Lease:
    """Takes `name` for `owner` until now + ttl when it is free, expired or already the
    owner's; every acquisition gets a larger token (see _micros). FAILED_PRECONDITION when
    someone else holds it.

    One statement (an upsert that only updates a row it may take, returning the token): the
    player's lease is taken before every interactive run (BeginRun), so its cost is on every
    request's critical path."""
    _check_id(name, "name")
    _check_id(owner, "owner")
    _check_ttl(ttl_seconds, "ttl_seconds")
    expires_at = now + dt.timedelta(seconds=ttl_seconds)
    params = {
        "name": name,
        "owner": owner,
        "token": _micros(now),
        "expires_at": expires_at,
        "now": now,
    }
    statement = _ACQUIRE_SQLITE if name_of(target) == SQLITE else _ACQUIRE_POSTGRESQL
    for _ in range(ACQUIRE_ATTEMPTS):
        taken = target.execute(statement, params).first()
        if taken is not None:
            lease = journal_pb2.Lease(name=name, owner=owner, token=int(taken[0]))
            lease.expires_at.FromDatetime(expires_at)
            return lease
        # Someone held it. Read who, to say so; in autocommit (PostgreSQL) the holder may have
        # given it back between the two statements, and then it is asked for again.
        holder = _lease_row(target.execute(_LEASE_STATE, {"name": name}))
        if holder is not None and _live(holder, now):
            assert holder.expires_at is not None
            raise FailedPrecondition(
                f"lease {name!r} is held by {holder.owner!r} until "
                f"{aware(holder.expires_at).isoformat()}; try again after it expires"
            )
    raise FailedPrecondition(
        f"lease {name!r} changed hands {ACQUIRE_ATTEMPTS} times while being taken; try again"
    )


def renew(
    target: Session | Connection,
    name: str,
    owner: str,
    token: int,
    ttl_seconds: int,
    now: dt.datetime,
) -> journal_pb2.Lease:
    """Extends a lease the caller holds (also after it expired, if nobody took it since);
    answers the Lease. FAILED_PRECONDITION when it is not the caller's."""
    _check_id(name, "name")
    _check_id(owner, "owner")
    _check_token(token)
    _check_ttl(ttl_seconds, "ttl_seconds")
    expires_at = now + dt.timedelta(seconds=ttl_seconds)
    renewed = target.execute(
        _RENEW, {"lease_name": name, "holder": owner, "held_token": token, "until": expires_at}
    )
    if rowcount(renewed) == 1:
        lease = journal_pb2.Lease(name=name, owner=owner, token=token)
        lease.expires_at.FromDatetime(expires_at)
        return lease
    row = _lease_row(target.execute(_LEASE_STATE, {"name": name}))
    if row is None or row.owner is None:
        raise FailedPrecondition(f"lease {name!r} is not held; acquire it again")
    raise FailedPrecondition(
        f"lease {name!r} is held by {row.owner!r} with token {row.token}, not by "
        f"{owner!r} with token {token}; acquire it again"
    )


def check_holder(name: str, owner: str, token: int) -> None:
    """INVALID_ARGUMENT unless `name`, `owner` and `token` can name a held lease."""
    _check_id(name, "name")
    _check_id(owner, "owner")
    _check_token(token)


def release(target: Session | Connection, name: str, owner: str, token: int) -> bool:
    """Gives a lease up; answers False when it was no longer the caller's. The token is
    kept."""
    check_holder(name, owner, token)
    released = target.execute(_RELEASE, {"lease_name": name, "holder": owner, "held_token": token})
    return rowcount(released) == 1


OWNER_SEPARATOR = "#"
"""Separates an engine replica's stable name from its incarnation in a lease owner
(`<name>#<incarnation>`)."""


def _check_owner_part(value: str, field: str) -> None:
    _check_id(value, field)
    if OWNER_SEPARATOR in value:
        raise InvalidArgument(
            f"{field} must not contain {OWNER_SEPARATOR!r}: it separates a replica's name from "
            f"its incarnation in a lease owner (`<name>{OWNER_SEPARATOR}<incarnation>`), "
            f"got {value[:MAX_ID]!r}"
        )


# Every lease held by an owner `<name>#...` other than the caller's own `<name>#<incarnation>`.
# A prefix comparison (substr) rather than LIKE, so a name's `%` and `_` match only themselves;
# both databases count characters. Runs once per engine start: a scan of the leases table
# rather than an index on `owner`, which every lease call would pay to keep up.
_RELEASE_EARLIER = (
    update(_LEASES)
    .where(
        func.substr(_LEASES.c.owner, 1, bindparam("prefix_length", type_=Integer))
        == bindparam("prefix", type_=String),
        _LEASES.c.owner != bindparam("own", type_=String),
    )
    .values(owner=None, expires_at=None)
)


def release_earlier_incarnations(target: Session | Connection, name: str, incarnation: str) -> int:
    """Ends every lease held by an earlier incarnation of replica `name`: owner
    `<name>#<anything but incarnation>`, live or expired; answers how many. Tokens are kept,
    so the earlier incarnation's fences are stale from now on, and its RUNNING tasks are
    claimable at once (ClaimTasks takes a task no live lease protects). The caller's own
    incarnation and other names are left alone. INVALID_ARGUMENT for an empty part, a part
    containing `#`, or an owner that would be over MAX_ID characters."""
    _check_owner_part(name, "name")
    _check_owner_part(incarnation, "incarnation")
    own = f"{name}{OWNER_SEPARATOR}{incarnation}"
    if len(own) > MAX_ID:
        raise InvalidArgument(
            f"name and incarnation make an owner of {len(own)} characters "
            f"(`<name>{OWNER_SEPARATOR}<incarnation>`); an owner is at most {MAX_ID}"
        )
    prefix = f"{name}{OWNER_SEPARATOR}"
    result = target.execute(
        _RELEASE_EARLIER, {"prefix": prefix, "prefix_length": len(prefix), "own": own}
    )
    return rowcount(result)


_LEASE_ROW = select(
    _LEASES.c.name,
    _LEASES.c.owner,
    _LEASES.c.token,
    _LEASES.c.expires_at,
).where(_LEASES.c.name == bindparam("name", type_=String))
# A lease row as it is now (to say who holds it), and share-locked (a fence being checked).
_LEASE_STATE = _LEASE_ROW
_FENCE_QUERY = _LEASE_ROW.with_for_update(read=True)


class _FencedLease(NamedTuple):
    name: str
    owner: str | None
    token: int
    expires_at: dt.datetime | None


def _lease_row(result: Result[Any]) -> _FencedLease | None:
    """The lease row a _LEASE_STATE or _FENCE_QUERY read found, if any."""
    found: tuple[Any, ...] | None = result.first()
    return None if found is None else _FencedLease(*found)


def check_fence(session: Session, fence: journal_pb2.Fence | None, now: dt.datetime) -> None:
    """FAILED_PRECONDITION ("stale fence") unless the fence's lease is held, unexpired, with
    the fence's token. The lease row stays share-locked until the transaction ends, so it
    cannot be taken again before the fenced write commits."""
    if fence is None:
        return
    _check_id(fence.lease_name, "fence.lease_name")
    _check_token(fence.token, "fence.token")
    row = _lease_row(session.execute(_FENCE_QUERY, {"name": fence.lease_name}))
    where = f"stale fence: lease {fence.lease_name!r} token {fence.token}"
    if row is None or row.owner is None:
        raise FailedPrecondition(
            f"{where} is not held by anyone; acquire the lease again", STALE_FENCE
        )
    if row.token != fence.token:
        raise FailedPrecondition(
            f"{where} was replaced by token {row.token} ({row.owner!r} holds it); stop and let "
            "the current holder write",
            STALE_FENCE,
        )
    if not _live(row, now):
        raise FailedPrecondition(f"{where} has expired; acquire the lease again", STALE_FENCE)


def _fence_holds(
    found: tuple[object, ...] | None, fence: journal_pb2.Fence, now: dt.datetime
) -> bool:
    """Whether _FENCE_QUERY's row says `fence` holds (check_fence says why it does not)."""
    if found is None:
        return False
    row = _FencedLease(*found)  # type: ignore[arg-type]
    return row.owner is not None and row.token == fence.token and _live(row, now)
