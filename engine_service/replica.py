"""Who this engine replica is, and taking back what its earlier incarnation held
(decision 0014).

A replica has a stable *name*, the same for every process that runs in its slot one after
another (a container restarted in its pod, a service restarted on its host), and an
*incarnation*, new at every start. Its storage leases (event tasks, players) are owned by
`<name>#<incarnation>`. At start, before claiming anything, the replica asks storage to end
every lease an earlier incarnation of its name still holds: a replica that crashed and was
restarted takes its tasks and players back at once instead of waiting out their leases.

The name, when `replica_id` is not configured, is `<hostname>:<pid>`:

- the hostname tells hosts apart (in Kubernetes the pod's name, which a container restart
  keeps);
- the pid tells apart the engine processes of one host that are alive together, always (the
  kernel never gives two live processes one pid), forked `workers` included;
- and it is stable where it matters: in the container the engine is PID 1 (the image's
  exec-form entrypoint), so a restarted container gets the same name. Where the pid is not
  stable (a process on a laptop or VM; a forked worker whose pid came out different) the new
  process simply finds no earlier incarnation and the old leases expire, as before.

The `workers` index would be stable too, but two engines started separately on one host
would both be worker 0, and the second's start would end the first's live leases (its tasks
would then report EFFECT_UNKNOWN): a wrong pid costs a wait, a wrong index costs harm. A
second engine app made in the same process (tests, benches) gets `:<n>` added, so it never
shares the first one's name.

An explicitly configured `replica_id` is the name as given (the operator promises it is
unique among live replicas, e.g. the pod's name, and it is then stable whatever the pid);
with `workers` > 1 every forked worker would share it, so there it becomes
`<replica_id>:<pid>`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import uuid

import grpc
from system.storage.v1 import journal_pb2, journal_pb2_grpc

from services.runtime.channels import ChannelSettings, Dependency
from services.runtime.errors import ServiceError, Unavailable

__all__ = [
    "MAX_REPLICA_ID",
    "OWNER_SEPARATOR",
    "JournalIncarnations",
    "ReplicaIdentity",
    "replica_identity",
]

OWNER_SEPARATOR = "#"
"""Separates the name from the incarnation in a lease owner; never part of either."""
MAX_REPLICA_ID = 80
"""Longest configured `replica_id`: with a pid suffix, the separator and the incarnation the
owner stays within storage's 128 characters."""
INCARNATION_HEX = 16
"""Random hex digits of an incarnation: two starts never share one."""

_apps_made = itertools.count(1)  # engine apps made in this process (names never repeat)


@dataclasses.dataclass(frozen=True)
class ReplicaIdentity:
    """This process's replica name and incarnation."""

    name: str
    """Stable across restarts of the same slot; unique among live replicas."""
    incarnation: str
    """New at every start."""

    @property
    def owner(self) -> str:
        """The owner of this incarnation's storage leases: `<name>#<incarnation>`."""
        return f"{self.name}{OWNER_SEPARATOR}{self.incarnation}"


def replica_identity(replica_id: str = "", workers: int = 1) -> ReplicaIdentity:
    """The identity of an engine app made now, in this process (after any fork): see the
    module docstring for how the name is chosen."""
    made = next(_apps_made)
    pid = os.getpid()
    if replica_id:
        name = replica_id if workers <= 1 else f"{replica_id}:{pid}"
    else:
        host = socket.gethostname().replace(OWNER_SEPARATOR, "-") or "localhost"
        name = f"{host}:{pid}" if made == 1 else f"{host}:{pid}:{made}"
    return ReplicaIdentity(name, uuid.uuid4().hex[:INCARNATION_HEX])


class JournalIncarnations:
    """`JournalService.ReleaseEarlierIncarnations` for one replica identity (the
    `EarlierIncarnations` the event runner calls before its first claim). Safe to repeat,
    so retried on UNAVAILABLE; on connections of its own, as the runner's (storage may not be
    up yet when the replica starts)."""

    def __init__(
        self,
        target: str,
        identity: ReplicaIdentity,
        timeout: float = 5.0,
        settings: ChannelSettings | None = None,
    ) -> None:
        self.identity = identity
        self._timeout = timeout
        self._dep = Dependency(
            target,
            journal_pb2_grpc.JournalServiceStub,
            idempotent_methods=[
                "system.storage.v1.JournalService/ReleaseEarlierIncarnations",
            ],
            private=True,
            settings=settings,
        )

    async def release_earlier(self) -> int:
        """Ends the leases earlier incarnations of this replica's name hold; answers how many.

        Raises:
            Unavailable: storage could not be reached (or did not answer in time): ask again.
            ServiceError: storage refused (an older storage without the call answers
                UNIMPLEMENTED, a credential not allowed it PERMISSION_DENIED).
        """
        try:
            response = await self._dep.stub.ReleaseEarlierIncarnations(
                journal_pb2.ReleaseEarlierIncarnationsRequest(
                    name=self.identity.name, incarnation=self.identity.incarnation
                ),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            detail = f"{exc.code().name}: {exc.details()}"
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(detail) from None
            raise ServiceError(detail) from None
        return int(response.released)

    async def aclose(self) -> None:
        await self._dep.aclose()
