"""The presence rules (storage_service.presence) on SQLite and PostgreSQL: replica leases,
attachments taken over by the newest JOIN, detaches that never remove another replica's row,
repairs that never take a player from a live replica, and replicas whose lease ended."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy.orm import Session, sessionmaker

from services.presence import players_digest
from services.runtime.errors import FailedPrecondition, InvalidArgument
from storage_service.presence import MAX_ATTACH, Location, PresenceStore

T0 = dt.datetime(2026, 12, 2, 0, 0, tzinfo=dt.UTC)
LEASE = 10
A, B = "gw-a", "gw-b"
ADDRESS = {A: "10.0.0.1:50056", B: "10.0.0.2:50056"}


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


@pytest.fixture
def store(sessions: sessionmaker[Session]) -> PresenceStore:
    return PresenceStore(sessions)


def renew(store: PresenceStore, replica: str, when: float, players: list[str] | None = None):  # type: ignore[no-untyped-def]
    return store.renew_replica(
        replica, ADDRESS[replica], LEASE, players_digest(players or []), at(when)
    )


def test_a_player_is_located_at_the_replica_that_attached_them(store: PresenceStore) -> None:
    renew(store, A, 0)
    assert store.locate("sim/steve", at(1)) is None
    assert store.attach(A, ["sim/steve", "sim/alex"], at(1)) == 0
    assert store.locate("sim/steve", at(2)) == Location(A, ADDRESS[A])
    assert renew(store, A, 3, ["sim/steve", "sim/alex"]).players_in_sync
    assert store.detach(A, ["sim/steve"]) == 1
    assert store.locate("sim/steve", at(4)) is None
    assert store.locate("sim/alex", at(4)) == Location(A, ADDRESS[A])


def test_a_newer_attachment_takes_the_row_over_and_the_old_replica_cannot_remove_it(
    store: PresenceStore,
) -> None:
    renew(store, A, 0)
    renew(store, B, 0)
    store.attach(A, ["sim/steve"], at(1))
    assert store.attach(B, ["sim/steve"], at(2)) == 1  # taken over from a live replica
    assert store.locate("sim/steve", at(3)) == Location(B, ADDRESS[B])
    # A notices the old connection ended later: its detach leaves B's row alone.
    assert store.detach(A, ["sim/steve"]) == 0
    assert store.locate("sim/steve", at(3)) == Location(B, ADDRESS[B])


def test_a_replica_whose_lease_ended_is_ignored_then_cleaned_up(store: PresenceStore) -> None:
    renew(store, A, 0)
    renew(store, B, 0)
    store.attach(A, ["sim/steve", "sim/alex"], at(1))
    renew(store, B, 8)  # B goes on renewing; A stops
    assert store.locate("sim/steve", at(9)) == Location(A, ADDRESS[A])
    assert store.locate("sim/steve", at(LEASE)) is None  # A's lease ended at LEASE
    assert renew(store, B, 11).expired_rows_deleted == 2
    # A comes back (a paused process): its rows are gone, its digest no longer matches.
    again = renew(store, A, 12, ["sim/steve", "sim/alex"])
    assert not again.players_in_sync
    assert store.locate("sim/alex", at(12)) is None


def test_attaching_needs_a_live_lease(store: PresenceStore) -> None:
    with pytest.raises(FailedPrecondition, match="RenewReplica"):
        store.attach(A, ["sim/steve"], at(0))
    renew(store, A, 0)
    with pytest.raises(FailedPrecondition):
        store.attach(A, ["sim/steve"], at(LEASE + 1))
    with pytest.raises(FailedPrecondition):
        store.sync(A, ["sim/steve"], at(LEASE + 1))


def test_a_sync_repairs_without_taking_a_player_from_a_live_replica(store: PresenceStore) -> None:
    renew(store, A, 0)
    renew(store, B, 0)
    store.attach(A, ["sim/gone"], at(1))
    store.attach(B, ["sim/steve"], at(1))
    # A believes it holds steve and alex (a half-dead link to steve's server), not `gone`.
    renewal = renew(store, A, 2, ["sim/steve", "sim/alex"])
    assert not renewal.players_in_sync
    synced = store.sync(A, ["sim/steve", "sim/alex"], at(2))
    assert (synced.added, synced.removed, synced.held_elsewhere) == (1, 1, ["sim/steve"])
    assert store.locate("sim/steve", at(3)) == Location(B, ADDRESS[B])
    assert store.locate("sim/alex", at(3)) == Location(A, ADDRESS[A])
    assert store.locate("sim/gone", at(3)) is None
    # A sync takes the row of a replica whose lease ended (B renewed last at 0).
    renew(store, A, 9, ["sim/alex"])
    synced = store.sync(A, ["sim/alex", "sim/steve"], at(LEASE + 1))
    assert (synced.added, synced.removed, synced.held_elsewhere) == (1, 0, [])
    assert store.locate("sim/steve", at(LEASE + 1)) == Location(A, ADDRESS[A])
    assert renew(store, A, LEASE + 2, ["sim/alex", "sim/steve"]).players_in_sync


def test_retiring_a_replica_removes_its_players(store: PresenceStore) -> None:
    renew(store, A, 0)
    store.attach(A, ["sim/steve", "sim/alex"], at(1))
    assert store.retire(A) == 2
    assert store.locate("sim/steve", at(2)) is None
    with pytest.raises(FailedPrecondition):
        store.attach(A, ["sim/steve"], at(2))
    assert store.retire(A) == 0


def test_the_address_moves_with_the_renewal(store: PresenceStore) -> None:
    renew(store, A, 0)
    store.attach(A, ["sim/steve"], at(1))
    store.renew_replica(A, "10.0.0.9:50056", LEASE, players_digest(["sim/steve"]), at(2))
    assert store.locate("sim/steve", at(3)) == Location(A, "10.0.0.9:50056")


@pytest.mark.parametrize(
    ("replica", "address", "lease", "digest", "message"),
    [
        ("", "h:1", 5, players_digest([]), "replica_id is required"),
        ("x" * 65, "h:1", 5, players_digest([]), "replica_id is longer"),
        (A, "", 5, players_digest([]), "address is required"),
        (A, "no-port", 5, players_digest([]), "host:port"),
        (A, "h:1", 0, players_digest([]), "lease_seconds"),
        (A, "h:1", 3601, players_digest([]), "lease_seconds"),
        (A, "h:1", 5, "ABC", "players_digest"),
    ],
)
def test_bad_renewals_are_refused_with_what_to_fix(
    store: PresenceStore, replica: str, address: str, lease: int, digest: str, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        store.renew_replica(replica, address, lease, digest, at(0))


def test_bad_player_lists_are_refused(store: PresenceStore) -> None:
    renew(store, A, 0)
    with pytest.raises(InvalidArgument, match=r"player_ids\[1\] is required"):
        store.attach(A, ["sim/steve", ""], at(1))
    with pytest.raises(InvalidArgument, match="at most 1000"):
        store.detach(A, [f"sim/{i}" for i in range(MAX_ATTACH + 1)])
    with pytest.raises(InvalidArgument, match="player_id is required"):
        store.locate("", at(1))
