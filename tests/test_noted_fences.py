"""A group reads the fences its units name with its players' locks (decision 0032): a unit's
fence check is answered from the lease row that statement share-locked, and a fence that
does not hold is refused as before, on SQLite (which checks each fence itself) and
PostgreSQL."""

from __future__ import annotations

import uuid

import pytest
from google.protobuf import struct_pb2
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from system.storage.v1 import journal_pb2

from services.runtime.errors import FailedPrecondition
from storage_service.group_commit import Declared, declared, run_group
from storage_service.journal import JournalBounds, JournalStore
from storage_service.ledgers import _NOTED_LEASE, Writes, _transaction_locks, lock_in_order


@pytest.fixture
def store(sessions: sessionmaker[Session]) -> JournalStore:
    return JournalStore(sessions, JournalBounds())


def _claimed(store: JournalStore) -> journal_pb2.TaskClaim:
    player = f"p-{uuid.uuid4()}"
    store.create_task(player, "system:m", struct_pb2.Struct(), "e", journal_pb2.TASK_STATE_QUEUED)
    (claim,) = store.claim_tasks("owner-1", 1, 30, [player])
    return claim


def _fence(claim: journal_pb2.TaskClaim, stale: bool = False) -> journal_pb2.Fence:
    return journal_pb2.Fence(
        lease_name=claim.lease.name, token=claim.lease.token - (1 if stale else 0)
    )


def _record(
    store: JournalStore, claim: journal_pb2.TaskClaim, fence: journal_pb2.Fence
) -> Declared:
    task_id = claim.task.task_id
    return declared(
        store.record_step_in,
        Writes(tasks=(task_id,), fences=(fence.lease_name,)),
        step_id=f"{task_id}/0",
        task_id=task_id,
        position=0,
        tool="t.t",
        fence=fence,
    )


def test_fenced_units_of_a_group_are_applied(
    store: JournalStore, sessions: sessionmaker[Session]
) -> None:
    claims = [_claimed(store) for _ in range(3)]
    outcomes = run_group(sessions, [_record(store, c, _fence(c)) for c in claims])
    assert [created for _, created in outcomes] == [True, True, True]


def test_a_stale_fence_a_group_read_is_refused_alone(
    store: JournalStore, sessions: sessionmaker[Session]
) -> None:
    good, stale = _claimed(store), _claimed(store)
    outcomes = run_group(
        sessions, [_record(store, good, _fence(good)), _record(store, stale, _fence(stale, True))]
    )
    assert outcomes[0][1] is True
    assert isinstance(outcomes[1], FailedPrecondition)
    assert "stale fence" in outcomes[1].message
    with pytest.raises(Exception, match="no receipt"):
        store.get_step(f"{stale.task.task_id}/0", "t.t")


def test_a_released_lease_is_refused_though_the_group_named_it(
    store: JournalStore, sessions: sessionmaker[Session]
) -> None:
    claim = _claimed(store)
    assert store.release_lease(claim.lease.name, "owner-1", claim.lease.token)
    (outcome,) = run_group(sessions, [_record(store, claim, _fence(claim))])
    assert isinstance(outcome, FailedPrecondition)
    assert "not held by anyone" in outcome.message


def test_the_lock_statement_reads_the_named_leases(
    engine: Engine, store: JournalStore, sessions: sessionmaker[Session]
) -> None:
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite takes no locks: each unit checks its fence itself")
    claim = _claimed(store)
    with sessions.begin() as session:
        lock_in_order(session, [Writes(tasks=(claim.task.task_id,), fences=(claim.lease.name,))])
        locks, noted = _transaction_locks(session)
        assert claim.task.player_id in locks
        name, owner, token, expires_at = noted[(_NOTED_LEASE, claim.lease.name)]
        assert (name, owner, token) == (claim.lease.name, "owner-1", claim.lease.token)
        assert expires_at is not None
