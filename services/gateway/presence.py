"""Tells the storage service which players this gateway replica holds (decision 0023), so
that the engine's game-tool calls and notices for a player go to the replica their game
server is connected to.

One task per replica does all of it, in order: it renews the replica's lease (with the
address of its internal port) every third of `presence_lease_seconds`, and writes the
attachments and detachments the Connect streams report, coalesced per player (the latest
wins) and batched. Each renewal carries the digest of the players storage should hold for
the replica; when storage answers that its rows differ (a write lost, a row of a lease that
had run out, a JOIN elsewhere that came after), the replica sends its whole list once
(SyncPlayers), which repairs its own rows and never takes a player from another live
replica; players storage names another live replica for joined there later, and are let go
here (`on_taken`). Storage being away delays the writes (they are kept and sent once it answers) and
never a player's request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc
from prometheus_client import Counter
from system.storage.v1 import presence_pb2, presence_pb2_grpc

from services.presence import players_digest
from services.runtime.channels import ChannelSettings, Dependency

__all__ = ["PresenceReporter"]

log = logging.getLogger("system.gateway.presence")

PRESENCE_FAILURES = Counter(
    "gateway_presence_failures_total",
    "Presence calls to storage that failed (renewals, writes, syncs); they are tried again.",
    ["call"],
)
PRESENCE_SYNCS = Counter(
    "gateway_presence_syncs_total",
    "Whole player lists sent because storage's rows for this replica differed.",
)
PLAYERS_TAKEN = Counter(
    "gateway_players_taken_elsewhere_total",
    "Players let go because they joined on another gateway replica later.",
)

_SERVICE = "system.storage.v1.PresenceService"
BATCH = 1000
"""Players in one AttachPlayers or DetachPlayers call (storage's limit)."""
RETRY_SECONDS = 1.0
"""How soon a write or renewal storage did not take is tried again."""
CALL_SECONDS = 5.0
"""Deadline of one presence call."""


class PresenceReporter:
    """Reports this replica's players to storage's PresenceService.

    Args:
        storage_target: the storage service's address.
        replica_id: this replica's id, new at every start.
        lease_seconds: the replica's lease; renewed every third of it.
        address: the `host:port` other services reach this replica's internal port at, or
            "" while it is not known yet (a port picked at start).
        settings: the gateway's channel settings (its credential).
    """

    def __init__(
        self,
        storage_target: str,
        replica_id: str,
        lease_seconds: int,
        address: Callable[[], str],
        settings: ChannelSettings | None = None,
    ) -> None:
        self.replica_id = replica_id
        self._lease_seconds = lease_seconds
        self._address = address
        self._dep = Dependency(
            storage_target,
            presence_pb2_grpc.PresenceServiceStub,
            # Each call is safe to repeat: the same call again leaves the same rows.
            idempotent_methods=[
                f"{_SERVICE}/{name}"
                for name in (
                    "RenewReplica",
                    "AttachPlayers",
                    "DetachPlayers",
                    "SyncPlayers",
                    "RetireReplica",
                )
            ],
            # Its own connections: storage restarting never puts a player's request path
            # into reconnect backoff through these calls.
            private=True,
            settings=settings,
        )
        self._held: set[str] = set()
        """Players attached to this replica now (what the Connect streams reported)."""
        self._written: set[str] = set()
        """What storage holds for this replica once every write sent so far landed."""
        self._pending: dict[str, bool] = {}
        """Changes not written yet: scoped id → attached (True) or detached (False)."""
        self._writing = False
        self.on_taken: Callable[[list[str]], None] | None = None
        """Called with the players another replica took over while this one still held
        them (the gateway's servicer ends their attachment here)."""
        self._wake = asyncio.Event()
        self._landed = asyncio.Condition()
        """Notified after every write or sync (see `written`)."""
        self._task: asyncio.Task[None] | None = None
        self.renewals = 0
        """Renewals storage took."""
        self.syncs = 0
        """Full lists sent (SyncPlayers) because storage's rows differed."""

    # -- what the Connect streams report ------------------------------------------------------

    def attached(self, scoped_id: str) -> None:
        """The player joined on this replica (or on a newer connection here)."""
        self._held.add(scoped_id)
        self._pending[scoped_id] = True
        self._wake.set()

    def detached(self, scoped_id: str) -> None:
        """The player is attached to no connection of this replica any more."""
        self._held.discard(scoped_id)
        self._pending[scoped_id] = False
        self._wake.set()

    def holds(self, scoped_id: str) -> bool:
        return scoped_id in self._held

    async def written(self, scoped_id: str, timeout: float) -> bool:
        """Waits, at most `timeout` seconds, until what storage holds of the player is what
        this replica reported (their join written, say); returns whether it is. The engine
        finds a player through storage, so what it is asked to do for them right after a
        join (queue their tasks, run an event) waits for this first."""

        def landed() -> bool:
            return scoped_id not in self._pending and (scoped_id in self._held) == (
                scoped_id in self._written
            )

        async with self._landed:
            try:
                await asyncio.wait_for(self._landed.wait_for(landed), timeout)
            except TimeoutError:
                return False
        return True

    async def _tell_landed(self) -> None:
        async with self._landed:
            self._landed.notify_all()

    @property
    def settled(self) -> bool:
        """Whether every change reported so far was written (none pending or in flight)."""
        return not self._pending and not self._writing

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stops renewing and writing: storage counts the replica gone once its lease ends."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def aclose(self) -> None:
        """Stops, then retires the replica (its rows go at once), best effort."""
        await self.stop()
        try:
            await self._dep.stub.RetireReplica(
                presence_pb2.RetireReplicaRequest(replica_id=self.replica_id),
                timeout=CALL_SECONDS,
            )
        except grpc.aio.AioRpcError as exc:
            log.info("replica not retired (%s); its lease runs out instead", exc.code().name)
        await self._dep.aclose()

    # -- the one task ---------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._turns()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end presence for good: log it, go on
                log.exception("presence task failed; starting it again")
                await asyncio.sleep(RETRY_SECONDS)

    async def _turns(self) -> None:
        interval = self._lease_seconds / 3
        renew_at = 0.0
        live = False
        while True:
            self._wake.clear()
            if time.monotonic() >= renew_at:
                live = await self._renew()
                renew_at = time.monotonic() + (interval if live else min(interval, RETRY_SECONDS))
            retry = False
            if live and self._pending:
                written, live = await self._flush()
                retry = not written
                if not live:
                    renew_at = 0.0  # storage says the lease is gone: renew before writing
            wait = max(0.0, renew_at - time.monotonic())
            if retry:
                wait = min(wait, RETRY_SECONDS)
                await asyncio.sleep(wait)  # a back-off before writing again, not a poll
                continue
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that
            # arrives as the wait ends (a wake at shutdown), and stop() then never returns.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()

    async def _renew(self) -> bool:
        """Renews the lease; sends the whole list when storage's rows differ. Whether the
        lease is live."""
        address = self._address()
        if not address:
            return False
        try:
            renewed = await self._dep.stub.RenewReplica(
                presence_pb2.RenewReplicaRequest(
                    replica_id=self.replica_id,
                    address=address,
                    lease_seconds=self._lease_seconds,
                    players_digest=players_digest(self._written),
                ),
                timeout=CALL_SECONDS,
            )
        except grpc.aio.AioRpcError as exc:
            PRESENCE_FAILURES.labels("RenewReplica").inc()
            log.warning("gateway replica lease not renewed: %s %s", exc.code().name, exc.details())
            return False
        self.renewals += 1
        if not renewed.players_in_sync:
            await self._sync()
        return True

    async def _sync(self) -> None:
        # The list as it is now: changes made before it are in it, so they need no write.
        players = sorted(self._held)
        before, self._pending = self._pending, {}
        self._writing = True
        try:
            synced = await self._dep.stub.SyncPlayers(
                presence_pb2.SyncPlayersRequest(replica_id=self.replica_id, player_ids=players),
                timeout=CALL_SECONDS,
            )
        except grpc.aio.AioRpcError as exc:
            PRESENCE_FAILURES.labels("SyncPlayers").inc()
            log.warning("players not synced: %s %s", exc.code().name, exc.details())
            for player, on in before.items():  # the next renewal tries again
                self._pending.setdefault(player, on)
            return
        finally:
            self._writing = False
        self.syncs += 1
        PRESENCE_SYNCS.inc()
        elsewhere = set(synced.held_elsewhere)
        self._written = set(players) - elsewhere
        await self._tell_landed()
        # Joined on another replica since (their game server reconnected there, or they
        # moved within their network): let them go here, unless they joined here again
        # meanwhile (that write, still pending, takes them back).
        taken = sorted(p for p in elsewhere if p in self._held and p not in self._pending)
        self._held.difference_update(taken)
        PLAYERS_TAKEN.inc(len(taken))
        log.info(
            "presence synced: %d added, %d removed, %d held by another replica",
            synced.added,
            synced.removed,
            len(elsewhere),
            extra={"replica_id": self.replica_id},
        )
        if taken and self.on_taken is not None:
            self.on_taken(taken)

    async def _flush(self) -> tuple[bool, bool]:
        """Writes the pending changes; (whether they were all written, whether the lease was
        live). What was not written stays pending, behind any newer change."""
        batch, self._pending = self._pending, {}
        self._writing = True
        try:
            return await self._write(batch)
        finally:
            self._writing = False
            await self._tell_landed()

    async def _write(self, batch: dict[str, bool]) -> tuple[bool, bool]:
        attach = [p for p, on in batch.items() if on]
        detach = [p for p, on in batch.items() if not on]
        try:
            for start in range(0, len(detach), BATCH):
                chunk = detach[start : start + BATCH]
                await self._dep.stub.DetachPlayers(
                    presence_pb2.DetachPlayersRequest(replica_id=self.replica_id, player_ids=chunk),
                    timeout=CALL_SECONDS,
                )
                self._written.difference_update(chunk)
                for player in chunk:
                    batch.pop(player)
            for start in range(0, len(attach), BATCH):
                chunk = attach[start : start + BATCH]
                await self._dep.stub.AttachPlayers(
                    presence_pb2.AttachPlayersRequest(replica_id=self.replica_id, player_ids=chunk),
                    timeout=CALL_SECONDS,
                )
                self._written.update(chunk)
                for player in chunk:
                    batch.pop(player)
        except grpc.aio.AioRpcError as exc:
            for player, on in batch.items():
                self._pending.setdefault(player, on)
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return False, False
            PRESENCE_FAILURES.labels("write").inc()
            log.warning("presence not written: %s %s", exc.code().name, exc.details())
            return False, True
        return True, True
