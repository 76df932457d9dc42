"""Gateway replicas and the players attached to each (system.storage.v1.PresenceService,
decision 0023).

Two tables. `gateway_replicas` holds one row per gateway process: its internal address and
when its lease ends; the replica renews it every third of the lease. `player_presence` holds
one row per attached player (scoped id, decision 0012): the replica that attached them last.
A replica whose lease ended counts as gone at once: its players are not located, and the next
renewal of any replica deletes its rows. A JOIN on another replica takes the player's row
over (AttachPlayers always writes); a sync (SyncPlayers) only repairs, and never takes a row
from a live replica, so a replica that still believes it holds a player (a half-dead link it
has not noticed yet) cannot take them back from where they joined since.

Every call takes `now` (the storage service's clock, one clock for every replica's lease), so
tests say what time it is.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Sequence
from typing import NamedTuple

from sqlalchemy import DateTime, Index, String, bindparam, delete, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from services.presence import players_digest
from services.runtime.errors import FailedPrecondition, InvalidArgument
from storage_service.db import Base, rowcount, table_of
from storage_service.dialect import aware, insert_for
from storage_service.player_data import KEEP_ON_RESET
from storage_service.validation import MAX_PLAYER_ID, check_id, check_player_id

__all__ = [
    "MAX_ADDRESS",
    "MAX_ATTACH",
    "MAX_LEASE_SECONDS",
    "MAX_REPLICA_ID",
    "MAX_SYNC",
    "Location",
    "PlayerPresenceRow",
    "PresenceStore",
    "Renewal",
    "ReplicaRow",
    "Sync",
    "live_replica_addresses",
    "locate_players",
]

MAX_REPLICA_ID = 64
MAX_ADDRESS = 255
MAX_LEASE_SECONDS = 3600
MAX_ATTACH = 1000
"""Players in one AttachPlayers or DetachPlayers call."""
MAX_SYNC = 32768
"""Players in one SyncPlayers call (32768 ids of 64 characters stay under 4 MiB)."""
_DIGEST_CHARS = 64


class ReplicaRow(Base):
    """A gateway replica: where its internal port is reached, and until when it is alive."""

    __tablename__ = "gateway_replicas"

    replica_id: Mapped[str] = mapped_column(String(MAX_REPLICA_ID), primary_key=True)
    address: Mapped[str] = mapped_column(String(MAX_ADDRESS))
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class PlayerPresenceRow(Base):
    """The gateway replica a (scoped) player is attached to."""

    __tablename__ = "player_presence"
    __table_args__ = (
        Index("ix_player_presence_replica", "replica_id"),
        # A reset player who is online stays where they are.
        {"info": {KEEP_ON_RESET: True}},
    )

    player_id: Mapped[str] = mapped_column(String(MAX_PLAYER_ID), primary_key=True)
    replica_id: Mapped[str] = mapped_column(String(MAX_REPLICA_ID))
    attached_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


_REPLICAS = table_of(ReplicaRow)
_PRESENCE = table_of(PlayerPresenceRow)


class Renewal(NamedTuple):
    """What RenewReplica answers."""

    expires_at: dt.datetime
    players_in_sync: bool
    expired_rows_deleted: int


class Sync(NamedTuple):
    """What SyncPlayers answers."""

    added: int
    removed: int
    held_elsewhere: list[str]
    """Listed players a live other replica holds, sorted."""


class Location(NamedTuple):
    """The live replica a player is attached to."""

    replica_id: str
    address: str


def _check_replica(replica_id: str) -> None:
    check_id(replica_id, "replica_id", MAX_REPLICA_ID)


def _check_players(player_ids: Sequence[str], limit: int) -> list[str]:
    if len(player_ids) > limit:
        raise InvalidArgument(
            f"player_ids has {len(player_ids)} entries; at most {limit} go in one call"
        )
    for index, player_id in enumerate(player_ids):
        check_player_id(player_id, f"player_ids[{index}]")
    return list(dict.fromkeys(player_ids))


def _live_replicas(session: Session, now: dt.datetime) -> set[str]:
    rows = session.execute(select(_REPLICAS.c.replica_id).where(_REPLICAS.c.expires_at > now))
    return {replica_id for (replica_id,) in rows}


def _require_live(session: Session, replica_id: str, now: dt.datetime) -> None:
    expires_at = session.execute(
        select(_REPLICAS.c.expires_at).where(_REPLICAS.c.replica_id == replica_id)
    ).scalar_one_or_none()
    if expires_at is None or aware(expires_at) <= now:
        raise FailedPrecondition(
            f"gateway replica {replica_id!r} holds no live lease; call RenewReplica first"
        )


class PresenceStore:
    """The presence rules over a database (see the module docstring)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def renew_replica(
        self,
        replica_id: str,
        address: str,
        lease_seconds: int,
        digest: str,
        now: dt.datetime,
    ) -> Renewal:
        """Makes or extends the replica's lease to now + lease_seconds, deletes the rows of
        replicas whose lease has ended, and compares `digest` with the replica's stored
        players."""
        _check_replica(replica_id)
        check_id(address, "address", MAX_ADDRESS)
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidArgument(
                f"address must be host:port (the replica's internal port), got {address[:64]!r}"
            )
        if not 1 <= lease_seconds <= MAX_LEASE_SECONDS:
            raise InvalidArgument(
                f"lease_seconds must be between 1 and {MAX_LEASE_SECONDS}, got {lease_seconds}"
            )
        if len(digest) != _DIGEST_CHARS or digest.strip("0123456789abcdef"):
            raise InvalidArgument(
                "players_digest must be the lowercase hex SHA-256 of the replica's sorted "
                "player ids, each followed by a newline"
            )
        expires_at = now + dt.timedelta(seconds=lease_seconds)
        with self._sessions.begin() as session:
            inserted = insert_for(session)(_REPLICAS).values(
                replica_id=replica_id, address=address, expires_at=expires_at
            )
            session.execute(
                inserted.on_conflict_do_update(
                    index_elements=["replica_id"],
                    set_={"address": address, "expires_at": expires_at},
                )
            )
            expired = [
                replica
                for (replica,) in session.execute(
                    select(_REPLICAS.c.replica_id).where(_REPLICAS.c.expires_at <= now)
                )
            ]
            deleted = 0
            if expired:
                deleted = rowcount(
                    session.execute(delete(_PRESENCE).where(_PRESENCE.c.replica_id.in_(expired)))
                )
                session.execute(delete(_REPLICAS).where(_REPLICAS.c.replica_id.in_(expired)))
            stored = session.execute(
                select(_PRESENCE.c.player_id).where(_PRESENCE.c.replica_id == replica_id)
            )
            in_sync = players_digest(player_id for (player_id,) in stored) == digest
        return Renewal(expires_at, in_sync, deleted)

    def attach(self, replica_id: str, player_ids: Sequence[str], now: dt.datetime) -> int:
        """Each player's row names `replica_id` from now on; answers how many were held by
        another live replica. FAILED_PRECONDITION when the replica's lease is not live."""
        _check_replica(replica_id)
        players = _check_players(player_ids, MAX_ATTACH)
        if not players:
            return 0
        with self._sessions.begin() as session:
            _require_live(session, replica_id, now)
            live = _live_replicas(session, now)
            before = session.execute(
                select(_PRESENCE.c.replica_id).where(_PRESENCE.c.player_id.in_(players))
            )
            taken_over = sum(1 for (holder,) in before if holder != replica_id and holder in live)
            _claim(session, replica_id, players, now)
        return taken_over

    def detach(self, replica_id: str, player_ids: Sequence[str]) -> int:
        """Deletes the players' rows that still name `replica_id`; answers how many."""
        _check_replica(replica_id)
        players = _check_players(player_ids, MAX_ATTACH)
        if not players:
            return 0
        with self._sessions.begin() as session:
            return rowcount(
                session.execute(
                    delete(_PRESENCE).where(
                        _PRESENCE.c.replica_id == replica_id,
                        _PRESENCE.c.player_id.in_(players),
                    )
                )
            )

    def sync(self, replica_id: str, player_ids: Sequence[str], now: dt.datetime) -> Sync:
        """Makes the rows naming `replica_id` exactly `player_ids`, except players whose row
        a live other replica holds (see the module docstring), which it names."""
        _check_replica(replica_id)
        players = set(_check_players(player_ids, MAX_SYNC))
        with self._sessions.begin() as session:
            _require_live(session, replica_id, now)
            live = _live_replicas(session, now)
            mine = {
                player_id
                for (player_id,) in session.execute(
                    select(_PRESENCE.c.player_id).where(_PRESENCE.c.replica_id == replica_id)
                )
            }
            gone = sorted(mine - players)
            for start in range(0, len(gone), MAX_ATTACH):
                session.execute(
                    delete(_PRESENCE).where(
                        _PRESENCE.c.replica_id == replica_id,
                        _PRESENCE.c.player_id.in_(gone[start : start + MAX_ATTACH]),
                    )
                )
            wanted = sorted(players - mine)
            elsewhere: list[str] = []
            added = 0
            for start in range(0, len(wanted), MAX_ATTACH):
                chunk = wanted[start : start + MAX_ATTACH]
                holders = {
                    player_id: holder
                    for player_id, holder in session.execute(
                        select(_PRESENCE.c.player_id, _PRESENCE.c.replica_id).where(
                            _PRESENCE.c.player_id.in_(chunk)
                        )
                    )
                }
                free = [p for p in chunk if holders.get(p) not in live]
                elsewhere += [p for p in chunk if holders.get(p) in live]
                if not free:
                    continue
                # A row of a gone replica is taken; a live replica's row (made between the
                # read and this write) is left to it.
                _claim(session, replica_id, free, now, unless_held_by=live)
                added += len(free)
        return Sync(added, len(gone), sorted(elsewhere))

    def locate(self, player_id: str, now: dt.datetime) -> Location | None:
        """The live replica the player is attached to, if any."""
        check_player_id(player_id)
        with self._sessions() as session:
            return locate_players(session, [player_id], now).get(player_id)

    def retire(self, replica_id: str) -> int:
        """Deletes the replica and its players' rows; answers how many player rows."""
        _check_replica(replica_id)
        with self._sessions.begin() as session:
            removed = rowcount(
                session.execute(delete(_PRESENCE).where(_PRESENCE.c.replica_id == replica_id))
            )
            session.execute(delete(_REPLICAS).where(_REPLICAS.c.replica_id == replica_id))
        return removed


# Built once: every task claim asks it.
_LOCATE = (
    select(_PRESENCE.c.player_id, _REPLICAS.c.replica_id, _REPLICAS.c.address)
    .join(_PRESENCE, _PRESENCE.c.replica_id == _REPLICAS.c.replica_id)
    .where(
        _PRESENCE.c.player_id.in_(bindparam("players", expanding=True)),
        _REPLICAS.c.expires_at > bindparam("now"),
    )
)


def locate_players(
    session: Session | Connection, player_ids: Collection[str], now: dt.datetime
) -> dict[str, Location]:
    """The live replica each of the players is attached to, by player; those attached to
    none are left out. One query, in the caller's transaction (a task claim reads it with
    its claim, storage_service.journal)."""
    if not player_ids:
        return {}
    found = session.execute(_LOCATE, {"players": sorted(player_ids), "now": now})
    return {player_id: Location(replica_id, address) for player_id, replica_id, address in found}


def live_replica_addresses(session: Session | Connection, now: dt.datetime) -> list[str]:
    """The internal address of every live replica, sorted and each once: where a notice for
    every game server goes (a budget alert, storage_service.budget_alerts). In the caller's
    transaction."""
    found = session.execute(
        select(_REPLICAS.c.address).where(_REPLICAS.c.expires_at > now).distinct()
    )
    return sorted(address for (address,) in found)


def _claim(
    session: Session,
    replica_id: str,
    players: Sequence[str],
    now: dt.datetime,
    unless_held_by: Collection[str] = (),
) -> None:
    """Writes the players' rows as attached to `replica_id` now, replacing existing rows
    except those held by a replica in `unless_held_by`."""
    inserted = insert_for(session)(_PRESENCE).values(
        [{"player_id": p, "replica_id": replica_id, "attached_at": now} for p in players]
    )
    session.execute(
        inserted.on_conflict_do_update(
            index_elements=["player_id"],
            set_={
                "replica_id": inserted.excluded.replica_id,
                "attached_at": inserted.excluded.attached_at,
            },
            where=_PRESENCE.c.replica_id.not_in(sorted(unless_held_by)) if unless_held_by else None,
        )
    )
